"""What a round's end waits for, on two real ranks driving rank/sync.py's ParameterSync directly:
rank 1 takes 0.3 s a step, rank 0 a few ms.

- Overlapped local:2: rank 0's round ends must not wait for rank 1 (the counts travel with the
  exchange); only applying a round (at the end of the next) waits for it.
- Not overlapped: the round lands at once, so rank 0 waits for rank 1's round.
- A round's step seconds are the whole time since the previous step ended (work between steps
  counted), except the first step after pause_clock(), which counts its compute only.
- A rank that merged steps: its change counts per global step of the round, added to the change of
  the rank that took every step.

Run: horovodrun -np 2 -H localhost:2 --gloo python tests/jobs/sync_timing.py RUN_DIR
"""

import json
import time

import horovod.torch as hvd
import torch

from hvdhetero.rank.sync import ParameterSync

hvd.init()
SLOW = 0.3
results = {}


def step(sync, model, between=0.0):
    """One optimizer step of this rank: its compute (slept), the update, then `between` seconds of
    other per-step work (a loader, the script) that the next step's whole time includes."""
    compute = SLOW if hvd.rank() == 1 else 0.005
    time.sleep(compute)
    with torch.no_grad():
        model.weight.add_(0.01 * (hvd.rank() + 1))
    t0 = time.perf_counter()
    landed = sync.after_step(16 if hvd.rank() == 0 else 4, compute)
    took = time.perf_counter() - t0
    time.sleep(between)
    return landed, took


for overlap in (True, False):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    sync = ParameterSync(model, "local", 2, 20, overlap=overlap)
    hvd.barrier()
    ends = []  # per round end on this rank: seconds the exchange blocked, what landed
    for i in range(6):
        landed, took = step(sync, model)
        if sync.round_steps == 0:
            ends.append({"took": took, "landed": landed, "wait_s": sync.wait_s, "link_late": sync.link_late})
    sync.flush()
    results["overlapped" if overlap else "at-once"] = ends

# The whole-step clock: rank 0 idles 0.2 s between steps (its loader, say); after pause_clock the
# next step counts its compute only.
model = torch.nn.Linear(4, 2)
sync = ParameterSync(model, "local", 3, 20, overlap=False)
hvd.barrier()
step(sync, model, between=0.2)
step(sync, model, between=0.2)
sync.pause_clock()
time.sleep(0.5)  # an evaluation: not a step's work
landed, _ = step(sync, model)
results["clock_times"], results["clock_sizes"] = landed

# A rank that merged steps (--inner-steps by-speed): in a 4-step round rank 0 takes 4 steps of 16
# samples, each moving the weights by +0.01; rank 1 one merged step of 16 samples (4 x 4) moving
# them by +0.02. Rank 0 took every step, so its change counts whole (0.04); rank 1's, counted per
# global step (x4) and weighted by its samples over rank 0's (16:64), adds its one step (0.02):
# the round moves the weights 0.06. Averaged by samples (64:16) it would move them 0.036, or
# 0.048 counted per global step: less than rank 0 alone.
for kind in ("local", "diloco"):
    model = torch.nn.Linear(4, 2)
    torch.nn.init.zeros_(model.weight)
    sync = ParameterSync(model, kind, 4, 20, outer_lr=1.0)
    for _ in range(4 if hvd.rank() == 0 else 1):
        with torch.no_grad():
            model.weight.add_(0.01 if hvd.rank() == 0 else 0.02)
        sync.after_step(16, 0.001, steps=1 if hvd.rank() == 0 else 4)
    results[f"merged_{kind}"] = {"moved": model.weight.mean().item(), "inner_steps": sync.inner_steps,
                                 "same": len(set(hvd.allgather_object(model.weight.sum().item()))) == 1}
if hvd.rank() == 0:
    print("SYNC_TIMING " + json.dumps(results), flush=True)
