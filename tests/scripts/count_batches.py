"""Gradient accumulation as one-device scripts write it: the loop counts batches and steps the
optimizer and a per-step LR schedule every --accumulate of them (`if (i + 1) % k == 0`). The
model's per-sample cost grows with the batch (a [batch, batch] product that adds nothing), so
`--micro-batch auto` surely picks chunks of 64 for the ~192-sample shares. Each rank writes what
its loop saw: the size of every batch it was handed, its optimizer steps and its schedule's steps.

    invoke train --script tests/scripts/count_batches.py -- --out DIR [--accumulate 2]
"""

import argparse
import json
import os

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import hvdhetero as hh

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--accumulate", type=int, default=1)
parser.add_argument("--epochs", type=int, default=2)
args = parser.parse_args()


class Pairwise(nn.Module):
    """An MLP whose forward also multiplies the batch by itself and adds none of it."""

    def __init__(self):
        super().__init__()
        self.wide, self.out = nn.Linear(64, 1024), nn.Linear(1024, 10)

    def forward(self, x):
        h = torch.relu(self.wide(x))
        return self.out(h + 0.0 * (h @ h.T).sum())


job = hh.init()
x, y = load_digits(return_X_y=True)
train_set = torch.utils.data.TensorDataset(torch.tensor(x[:1536] / 16.0, dtype=torch.float32), torch.tensor(y[:1536]))
model = Pairwise().to(job.device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
loader = torch.utils.data.DataLoader(train_set, batch_size=384, shuffle=True, drop_last=True)  # 4 batches an epoch
total = args.epochs * len(loader) // args.accumulate
schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, 1 - s / total))
model, optimizer, loader = job.prepare(model, optimizer, loader, scheduler=schedule)
sizes, steps = [], 0
for epoch in job.epochs(args.epochs):
    for i, (inputs, labels) in enumerate(loader):
        sizes.append(len(inputs))
        job.backward(F.cross_entropy(model(inputs), labels) / args.accumulate)
        if (i + 1) % args.accumulate == 0:
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
            steps += 1
with open(os.path.join(args.out, f"rank{job.rank}.json"), "w") as f:
    json.dump({"sizes": sizes, "steps": steps, "schedule": schedule.last_epoch, "job_step": job.step,
               "lr": optimizer.param_groups[0]["lr"]}, f)
