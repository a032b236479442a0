"""A loop with an LR scheduler that is not torch's, passed to job.prepare(scheduler=): a class of
the script's own with no state_dict() (`--kind hand`), or one whose state_dict() is its __dict__
as timm's Scheduler is (`--kind timm`). Rank 0 saves the scheduler's own state_dict() (timm's
kind) each epoch with torch.save, as a script's checkpoint does, and loads it back.

    invoke train --script tests/scripts/own_scheduler.py --checkpoint-every 5 -- --kind hand
"""

import argparse
import math
import os

import torch
from torch import nn
from torch.utils.data import TensorDataset

import hvdhetero as hh


class WarmupCosine:
    """A handwritten schedule, as many scripts have: a few numbers and a step()."""

    def __init__(self, optimizer, warmup, total, lr):
        self.optimizer, self.warmup, self.total, self.lr, self.n = optimizer, warmup, total, lr, 0

    def step(self):
        self.n += 1
        f = self.n / self.warmup if self.n < self.warmup else 0.5 * (1 + math.cos(math.pi * self.n / self.total))
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr * f


class TimmLike:
    """timm's Scheduler: its state_dict() is its __dict__ but the optimizer."""

    def __init__(self, optimizer):
        self.optimizer, self.n = optimizer, 0

    def step(self, epoch=None):
        self.n += 1

    def state_dict(self):
        return {k: v for k, v in self.__dict__.items() if k != "optimizer"}

    def load_state_dict(self, state):
        self.__dict__.update(state)


parser = argparse.ArgumentParser()
parser.add_argument("--kind", choices=["hand", "timm"], default="hand")
parser.add_argument("--epochs", type=int, default=2)
args = parser.parse_args()

job = hh.init()
torch.manual_seed(0)
X = torch.randn(2000, 8)
y = X.sum(1, keepdim=True)
model = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
scheduler = WarmupCosine(optimizer, 5, 40, 0.05) if args.kind == "hand" else TimmLike(optimizer)
model, optimizer, loader = job.prepare(model, optimizer, TensorDataset(X, y), global_batch=100, scheduler=scheduler)
for epoch in job.epochs(args.epochs):
    for xb, yb in loader:
        loss = nn.functional.mse_loss(model(xb), yb)
        optimizer.zero_grad()
        job.backward(loss)
        optimizer.step()
        scheduler.step()
    if args.kind == "timm" and job.is_main:
        path = os.path.join(job.run_dir, "own.pt")
        torch.save({"scheduler": scheduler.state_dict()}, path)
        print("own checkpoint's scheduler:", torch.load(path, weights_only=True)["scheduler"])
    print(f"epoch {epoch} loss {loss.item():.4f} schedule at {scheduler.n}")
