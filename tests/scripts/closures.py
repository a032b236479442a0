"""Optimizers stepped with a closure, ported as one-device scripts step them. Run by
tests/test_batch_function.py through `invoke train --script`:

    lbfgs    LBFGS(max_iter=5), 3 steps on a regression: prints the job's steps and samples as
             its records count them, and the first evaluation's loss of each step
    apart    an optimizer whose step evaluates the closure once more on rank 1 than on rank 0 (as
             LBFGS's own decisions could go apart on devices that round its sums differently)
    chunks   SGD stepped with a closure under --micro-batch: the closure sees a chunk, not the step
"""

import json
import sys

import torch
from torch import nn

import hvdhetero as hh

mode = sys.argv[1]
job = hh.init()
torch.manual_seed(0)
x = torch.randn(40, 4)
y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1


class Apart(torch.optim.SGD):
    def step(self, closure):
        for _ in range(1 + job.rank):
            loss = closure()
        super().step()
        return loss


model = nn.Linear(4, 1)
optimizer = {"lbfgs": lambda p: torch.optim.LBFGS(p, lr=0.5, max_iter=5), "apart": lambda p: Apart(p, lr=0.05),
             "chunks": lambda p: torch.optim.SGD(p, lr=0.05)}[mode](model.parameters())
model, optimizer, whole = job.prepare(model, optimizer, lambda data=(x, y): data)
firsts, evaluations = [], 0
for step in range(3):
    xb, yb = whole()

    def closure():
        global evaluations
        evaluations += 1
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(xb), yb)
        job.backward(loss)
        return loss
    firsts.append(float(optimizer.step(closure)))
records = job.training.records
print("CLOSURES " + json.dumps({"step": job.step, "steps": records.steps, "samples": records.samples,
                                "share": len(yb), "evaluations": evaluations, "firsts": firsts,
                                "loss": records.loss_sum / max(1, records.samples)}), flush=True)
