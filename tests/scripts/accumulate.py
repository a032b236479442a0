"""A script that accumulates gradients over two batches per optimizer step (a one-device habit
for a bigger batch than fits), checkpointed by hvdhetero every 2 optimizer steps; its epochs
counted from 1 (`job.epochs(range(1, 3))`), rank 1 fails once in epoch 2 (a marker file says it
did). Run by tests/test_script.py: the resumed epoch goes on from the checkpoint's batch, not from
the epoch's start.

    invoke train --script tests/scripts/accumulate.py --checkpoint-every 2 -- --out DIR
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
args = parser.parse_args()

job = hh.init()
x, y = load_digits(return_X_y=True)
train_set = torch.utils.data.TensorDataset(torch.tensor(x[:1400] / 16.0, dtype=torch.float32), torch.tensor(y[:1400]))
model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)).to(job.device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
model, optimizer, loader = job.prepare(model, optimizer, train_set, global_batch=100)  # 14 batches an epoch
marker = os.path.join(args.out, "failed-once")
for epoch in job.epochs(range(1, 3)):
    seen = 0
    for i, (inputs, labels) in enumerate(loader):
        if epoch == 2 and i == 9 and job.rank == 1 and not os.path.exists(marker):
            open(marker, "w").close()
            raise RuntimeError("rank 1 fails once, in epoch 2")
        job.backward(F.cross_entropy(model(inputs), labels) / 2)
        seen += 1
        if i % 2 == 1:  # every second batch
            optimizer.step()
            optimizer.zero_grad()
    with open(os.path.join(args.out, f"rank{job.rank}.jsonl"), "a") as f:
        f.write(json.dumps({"epoch": epoch, "batches": seen, "step": job.step}) + "\n")
