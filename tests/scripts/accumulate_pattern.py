"""A script that accumulates gradients over batches of its own, in groups of the sizes
`--pattern` cycles through (4,4,2,5,...: nanoGPT's fixed k, and groups that end sooner or later
than the one before), clipping before each step as build-nanogpt does; it counts batches by job.sync_gradients, so
that under --micro-batch a chunk is not a batch. Run by
tests/test_api.py on two uneven ranks and on one: the job reduces once a group where it can
(rank/deferral.py), and the models end alike. Its model goes to the run directory as final.pt.

    invoke train --script tests/scripts/accumulate_pattern.py -- --pattern 4,4,2,5
"""

import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import hvdhetero as hh

parser = argparse.ArgumentParser()
parser.add_argument("--pattern", default="4")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--samples", type=int, default=1280, help="1240: each epoch's last batch is short (40)")
args = parser.parse_args()
pattern = [int(k) for k in args.pattern.split(",")]

job = hh.init()
x, y = load_digits(return_X_y=True)
n = args.samples
train_set = torch.utils.data.TensorDataset(torch.tensor(x[:n] / 16.0, dtype=torch.float32), torch.tensor(y[:n]))
model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)).to(job.device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
model, optimizer, loader = job.prepare(model, optimizer, train_set, global_batch=80)  # 16 batches an epoch
group, in_group = 0, 0
for epoch in job.epochs(args.epochs):
    for inputs, labels in loader:
        k = pattern[group % len(pattern)]
        job.backward(F.cross_entropy(model(inputs), labels) / k)
        if not job.sync_gradients:  # a chunk of the batch (--micro-batch): the batch goes on
            continue
        in_group += 1
        if in_group == k:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
            group, in_group = group + 1, 0
job.save(model.state_dict(), "final.pt")
print(f"steps {job.step}", flush=True)
