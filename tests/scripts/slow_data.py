"""A rank slow at its data, not at its compute: rank 1's dataset waits --delay seconds a sample in
__getitem__ (images read from a slow disk, a transform's augmentation on a slow CPU), with no
DataLoader workers, so the wait is on the step's path (metrics.jsonl's split records say how the
job dealt the batch).

    invoke train --script tests/scripts/slow_data.py -- [--delay 0.001]
"""

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import hvdhetero as hh

parser = argparse.ArgumentParser()
parser.add_argument("--delay", type=float, default=0.001)
parser.add_argument("--epochs", type=int, default=3)
args = parser.parse_args()
job = hh.init()


class Readings(Dataset):
    def __init__(self, n: int):
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 16, generator=gen)
        self.y = (self.x[:, :8].sum(1) > 0).long()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if job.rank == 1:
            time.sleep(args.delay)
        return self.x[i], self.y[i]


model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer, loader = job.prepare(model, optimizer, DataLoader(Readings(2560), batch_size=64, shuffle=True))
for epoch in job.epochs(args.epochs):
    for x, y in loader:
        job.backward(F.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
