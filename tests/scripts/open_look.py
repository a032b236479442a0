"""The CIFAR-10 tutorial's look at a batch (`dataiter = iter(trainloader); images, labels =
next(dataiter)`), its iterator left open, taken on the prepared loader and by rank 0 alone (to
show its images once), before a plain `for epoch in range(n)` loop: every pass of rank 0's loop
is then one inside that open one, and rank 1's are not. Each epoch's end must still be every
rank's (an epoch record is a collective): rank 0 writes each epoch's mean loss, as its loop
summed it, to OUT/losses.json.

    invoke train --script tests/scripts/open_look.py -- --out DIR [--everyone]
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
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--everyone", action="store_true", help="every rank looks, not rank 0 alone")
args = parser.parse_args()

job = hh.init()
x, y = load_digits(return_X_y=True)
train_set = torch.utils.data.TensorDataset(torch.tensor(x[:1024] / 16.0, dtype=torch.float32), torch.tensor(y[:1024]))
model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)).to(job.device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
trainloader = torch.utils.data.DataLoader(train_set, batch_size=64, shuffle=True)
model, optimizer, trainloader = job.prepare(model, optimizer, trainloader)

if job.is_main or args.everyone:
    dataiter = iter(trainloader)
    images, labels = next(dataiter)
    print(f"a look at {len(labels)} of the batch's {trainloader.batch_size}", flush=True)

losses = []
for epoch in range(args.epochs):
    total, seen = 0.0, 0
    for inputs, labels in trainloader:
        loss = F.cross_entropy(model(inputs), labels)
        job.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        total, seen = total + loss.item() * len(labels), seen + len(labels)
    losses.append(total / seen)
if job.is_main:
    with open(os.path.join(args.out, "losses.json"), "w") as f:
        json.dump(losses, f)
