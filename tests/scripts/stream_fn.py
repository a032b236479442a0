"""A stream in place of a dataset (an IterableDataset: lines read from a file in order, records
from a web dataset, a Hugging Face dataset with streaming=True), too big to hold as a list: its
DataLoader's batches go to job.prepare as a batch function, every rank reading the stream whole
and keeping its rows of each batch, and the loop runs over the batches job.prepare returns until
the stream ends. Each rank prints how many steps it took and its parameters' digest. With
--epochs N the loop runs in job.epochs(N); with --anew as well, the script makes the stream
anew at each epoch's end, as a one-device loop makes its iterator anew each epoch, and the next
epoch's loop draws from it.

    invoke train --script tests/scripts/stream_fn.py -- --samples 3000 [--epochs 3 [--anew]]
"""

import argparse
import hashlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset

import hvdhetero as hh

parser = argparse.ArgumentParser()
parser.add_argument("--samples", type=int, default=3000)
parser.add_argument("--batch-size", type=int, default=50)
parser.add_argument("--epochs", type=int, default=0)
parser.add_argument("--anew", action="store_true")
args = parser.parse_args()

job = hh.init()
torch.manual_seed(0)


class Readings(IterableDataset):
    """A sensor's readings in the order they were taken: 8 values and whether the next goes up."""

    def __iter__(self):
        gen = torch.Generator().manual_seed(1)
        for _ in range(args.samples):
            x = torch.randn(8, generator=gen)
            yield x, (x[:4].sum() > x[4:].sum()).long()


model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2)).to(job.device)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
stream = iter(DataLoader(Readings(), batch_size=args.batch_size))
model, optimizer, batches = job.prepare(model, optimizer, lambda: next(stream))
steps = 0


def train():
    global steps
    for x, y in batches:  # until the stream ends
        loss = F.cross_entropy(model(x), y)
        job.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
        if steps % 20 == 0 and job.is_main:
            print(f"step {steps}: loss {loss.item():.4f}", flush=True)


if args.epochs:
    for epoch in job.epochs(args.epochs):
        train()
        if args.anew:
            stream = iter(DataLoader(Readings(), batch_size=args.batch_size))
else:
    train()
digest = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())).hexdigest()
print(f"rank {job.rank} steps {steps} digest {digest[:16]}", flush=True)
