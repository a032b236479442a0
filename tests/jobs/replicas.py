"""Step sync across ranks whose optimizer arithmetic differs: made one model where it shows.

A CUDA or MPS rank beside a CPU rank applies the same reduced gradient with kernels that round
differently (rank/replicas.py). On two CPU ranks the stand-in is the optimizer itself: SGD with
momentum, whose last operation rank 1 rounds twice (p - lr * buf: a multiply, then a subtract)
where torch rounds once (a fused multiply-add); the same update, not the same last bits. Two
cases, each its own Job: "same" (both torch's SGD) and "apart" (rank 1 rounds twice).
Each trains the digits CNN for 2 epochs of 6 steps (an evaluation after the first epoch's 3rd
step); rank 0 prints, as JSON per case, every rank's checksum just before that evaluation and
just after it, and the run directory.

A third case, "lr", trains 3 epochs with a ReduceLROnPlateau stepped at each epoch's end on a
number each rank has of its own (a loss over its own share, as one-device scripts step it):
rank 0's improves, rank 1's does not, so rank 1's scheduler halves its learning rate after
epoch 1. Every rank's learning rate at each optimizer step is printed. "lr-local" and
"lr-overlap" do the same under --sync local:2 (and --overlap-sync), where each rank steps its own
optimizer between the rounds' exchanges.

Run: horovodrun -np 2 -H localhost:2 --gloo python tests/jobs/replicas.py RUN_DIR
"""

import json
import sys

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import hvdhetero as hh
from hvdhetero.config import JobConfig
from hvdhetero.rank.replicas import checksum
from hvdhetero.recipes import data, models


class RoundsTwice(torch.optim.SGD):
    """torch's SGD with momentum (no dampening, no weight decay), its last step rounded twice."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = self.state[p]
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = p.grad.detach().clone()
                    else:
                        state["momentum_buffer"].mul_(group["momentum"]).add_(p.grad)
                    p.sub_(state["momentum_buffer"] * group["lr"])


train, test, info = data.load("digits", "unused")
train = torch.utils.data.Subset(train, range(6 * 64))
results = []
for case in ("same", "apart", "lr", "lr-local", "lr-overlap"):
    run_dir = f"{sys.argv[1]}/{case}"
    rounds = {"sync": "local:2", "overlap_sync": case == "lr-overlap"} if case in ("lr-local", "lr-overlap") else {}
    job = hh.Job(JobConfig(run_dir=run_dir, micro_batch="0", seed=1, **rounds))
    torch.manual_seed(1)
    model = models.build("cnn", info)
    kind = RoundsTwice if case == "apart" and hvd.rank() == 1 else torch.optim.SGD
    optimizer = kind(model.parameters(), lr=0.05, momentum=0.9)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.5)
    model, optimizer, loader = job.prepare(model, optimizer, train, global_batch=64)
    sums, lrs = {}, []
    for epoch in job.epochs(3 if case.startswith("lr") else 2):
        for x, y in loader:
            job.backward(F.cross_entropy(model(x), y))
            lrs.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if epoch == 0 and job.step == 3 and not case.startswith("lr"):
                sums["before"] = hvd.allgather_object(checksum(model, optimizer.optimizer), name=f"{case}.before")
                job.evaluate(lambda b: {"n": len(b[1])}, test, batch_size=64)
                sums["after"] = hvd.allgather_object(checksum(model, optimizer.optimizer), name=f"{case}.after")
        if case.startswith("lr"):
            plateau.step(1.0 / (epoch + 1) if job.rank == 0 else 1.0 + epoch)  # rank 1's "own loss" never improves
    if case.startswith("lr"):
        sums["lrs"] = hvd.allgather_object(lrs, name=f"{case}.lrs")
    results.append({"case": case, "run_dir": run_dir, **sums})
    job.close()
if hvd.rank() == 0:
    print("REPLICAS " + json.dumps(results), flush=True)
