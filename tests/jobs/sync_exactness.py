"""Exactness of --sync local:H / diloco:H through the public API: two ranks with unequal shares
(the last rank 3x slower) train H-step rounds; rank 0 replays every rank's steps in one process
(each rank's own model and optimizer), averages with the sample weights (local) or takes the
outer Nesterov step on the weighted mean change (diloco), and prints the relative errors.
Overlapped (--overlap-sync): the replay applies each round's mean change at the end of the next
round, on top of which each rank keeps its own unexchanged round; the error against the replay
that applies it at once (the non-overlapped rule) shows the delay is real.

Run: horovodrun -np 2 -H localhost:2 --gloo python tests/jobs/sync_exactness.py RUN_DIR
"""

import copy
import json
import sys

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import hvdhetero as hh
from hvdhetero.config import JobConfig
from hvdhetero.recipes import data, models

GLOBAL_BATCH = 48


def inner(name, model):
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1)
    if name == "sgd-momentum":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def flat(params):
    return torch.cat([p.detach().reshape(-1).double() for p in params])


def rel(a, b):
    a, b = flat(list(a)), flat(list(b))
    return ((a - b).norm() / b.norm()).item()


run_dir = sys.argv[1]
train, _, info = data.load("digits", "unused")
results = []
CASES = [  # (sync, inner optimizer, steps, the reference: one process on the joined batch, or each rank replayed,
    #         overlapped)
    ("local:1", "sgd", 2, "joined", False),  # local:1 with plain SGD is step sync
    ("step", "sgd", 2, "joined", False),
    ("local:3", "sgd-momentum", 6, "replayed", False),
    ("diloco:3", "adamw", 6, "replayed", False),  # two rounds: the outer momentum acts in the second
    ("local:3", "sgd-momentum", 9, "replayed", True),  # three rounds: rounds 1 and 2 applied, 3 in flight
    ("diloco:3", "adamw", 9, "replayed", True),
]


class Replay:
    """Every rank's replica and the global model, with the round-end rule of sync.py."""

    def __init__(self, model, size, kind, name, overlap):
        self.kind, self.overlap = kind, overlap
        self.refs = [copy.deepcopy(model) for _ in range(size)]
        self.opts = [inner(name, r) for r in self.refs]
        self.glob = [p.detach().clone() for p in model.parameters()]
        self.starts = [[p.detach().clone() for p in model.parameters()] for _ in range(size)]
        self.outer = torch.optim.SGD(self.glob, lr=0.7, momentum=0.9, nesterov=True)
        self.pending = None

    def outer_step(self, deltas):
        if self.kind == "diloco":
            for g, d in zip(self.glob, deltas):
                g.grad = d.clone()
            self.outer.step()
        else:
            for g, d in zip(self.glob, deltas):
                g.sub_(d)

    @torch.no_grad()
    def round_end(self, samples):
        w = [n / sum(samples) for n in samples]
        progress = [[s - p for s, p in zip(self.starts[r], ref.parameters())] for r, ref in enumerate(self.refs)]
        mean = [sum(w[r] * progress[r][k] for r in range(len(w))) for k in range(len(self.glob))]
        if not self.overlap:  # at once: local = the weighted average, diloco = one outer step from the start
            if self.kind == "local":
                new = [sum(w[r] * list(self.refs[r].parameters())[k] for r in range(len(w)))
                       for k in range(len(self.glob))]
                for g, v in zip(self.glob, new):
                    g.copy_(v)
            else:
                self.outer_step(mean)
            own = [[torch.zeros_like(g) for g in self.glob] for _ in self.refs]
        else:  # the previous round's mean change lands now; each rank keeps its own round on top
            if self.pending is not None:
                self.outer_step(self.pending)
            self.pending, own = mean, progress
        for r, ref in enumerate(self.refs):
            for p, g, d in zip(ref.parameters(), self.glob, own[r]):
                p.copy_(g - d)
            self.starts[r] = [p.detach().clone() for p in ref.parameters()]


for i, (sync, name, steps, reference, overlap) in enumerate(CASES):
    job = hh.Job(JobConfig(run_dir=f"{run_dir}/{i}", slowdown=3.0, micro_batch="0", sync=sync,
                           overlap_sync=overlap))
    torch.manual_seed(i)
    model = models.build("cnn", info).eval()  # eval: no dropout, the same function on every rank
    model, optimizer, loader = job.prepare(model, inner(name, model), train, global_batch=GLOBAL_BATCH,
                                           loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    kind, _, every = sync.partition(":")
    every = int(every or 1)
    initial = [p.detach().clone() for p in model.parameters()]
    replay = Replay(model, job.size, kind, name, overlap)
    at_once = Replay(model, job.size, kind, name, False) if overlap else None  # the rule the delay changes
    refs, ref_opts = replay.refs, replay.opts
    samples = [0] * job.size
    shares = []
    for x, y in loader:
        loss = F.cross_entropy(model(x), y)
        job.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        both = hvd.allgather_object((x, y), name=f"sync.batches.{i}.{job.step}")
        shares.append([len(b) for _, b in both])
        for r, (xr, yr) in enumerate(both):  # every rank's step, replayed
            if reference == "joined":  # one process on the joined batch
                if r == 0:
                    xb, yb = torch.cat([a for a, _ in both]), torch.cat([b for _, b in both])
                    ref_opts[0].zero_grad()
                    F.cross_entropy(refs[0](xb), yb).backward()
                    ref_opts[0].step()
                continue
            for rp in (replay, at_once) if at_once else (replay,):
                rp.opts[r].zero_grad()
                F.cross_entropy(rp.refs[r](xr), yr).backward()
                rp.opts[r].step()
            samples[r] += len(yr)
        if reference == "replayed" and job.step % every == 0:  # the round's end
            for rp in (replay, at_once) if at_once else (replay,):
                rp.round_end(samples)
            samples = [0] * job.size
        if job.step == steps:
            break
    exchange = getattr(job.strategy, "sync", None)  # local/diloco's ParameterSync
    applied = exchange.applied if exchange else None
    results.append({"sync": sync + (" overlapped" if overlap else ""), "optimizer": name, "steps": steps,
                    "shares": shares, "param_rel_err": rel(model.parameters(), refs[0].parameters()),
                    "rounds": exchange.rounds if exchange else None, "applied": applied,
                    "at_once_rel_err": rel(model.parameters(), at_once.refs[0].parameters()) if at_once else None,
                    "moved": rel(initial, model.parameters())})
    if overlap:
        # exchange=False: the sums of the global model (2 rounds applied), no exchange, own model kept
        probe = torch.utils.data.TensorDataset(*(t[:100] for t in train.tensors))
        before = flat(model.parameters()).clone()
        sums = job.evaluate(lambda b: {"out": model(b[0]).double().sum()}, probe, batch_size=16, exchange=False)
        glob_model = copy.deepcopy(model)
        with torch.no_grad():
            for p, g in zip(glob_model.parameters(), replay.glob):
                p.copy_(g)
            wanted = glob_model(probe.tensors[0]).double()
            own = model(probe.tensors[0]).double()
        results[-1]["global_eval"] = {"sum": sums["out"], "replay": wanted.sum().item(),
                                      "scale": wanted.abs().sum().item(), "own": own.sum().item(),
                                      "own_vs_replay": ((own - wanted).norm() / wanted.norm()).item(),
                                      "applied": job.strategy.sync.applied,
                                      "own_kept": bool(torch.equal(before, flat(model.parameters())))}
        # the round in flight lands at a flush with no step since: one model, that round's step times
        results[-1]["flush_times"] = job.strategy.sync.flush()
        results[-1]["applied_after_flush"] = job.strategy.sync.applied
        results[-1]["same_model"] = len(set(hvd.allgather_object(
            flat(model.parameters()).sum().item(), name=f"sync.same.{i}"))) == 1
if hvd.rank() == 0:
    print("SYNC_EXACTNESS " + json.dumps(results), flush=True)
