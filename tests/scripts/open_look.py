"""The CIFAR-10 tutorial's look at a batch (`dataiter = iter(trainloader); images, labels =
next(dataiter)`), its iterator left open, taken on the prepared loader and by rank 0 alone (to
show its images once), before a plain `for epoch in range(n)` loop: every pass of rank 0's loop
is then one inside that open one, and rank 1's are not. Each epoch's end must still be every
rank's (an epoch record is a collective): rank 0 writes each epoch's mean loss, as its loop
summed it, to OUT/losses.json, and every rank its BatchNorm's running mean after the loop to
OUT/buffersR.json.

With --one-ahead the loop fetches one batch ahead (apex's data_prefetcher): each pass ends with
its last batch still in hand. With --look-inside there is no look before the loop: rank 0 (every
rank with --everyone) takes `next(iter(trainloader))` at each pass's batch 8, before its loss.
With --two-models each batch trains a second model too, with its own optimizer and job.backward
after the first's step (a GAN's discriminator, then its generator: one global step a batch).
With --look-between (and --two-models) rank 0 takes its look at each pass's batch 8 between the
first model's step and the second's loss, instead.
With --persistent-workers the DataLoader has two workers kept across epochs (persistent_workers).

    invoke train --script tests/scripts/open_look.py -- --out DIR [--everyone] [--one-ahead] [--look-inside] \
        [--two-models [--look-between]] [--persistent-workers]
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
parser.add_argument("--one-ahead", action="store_true", help="the loop fetches one batch ahead")
parser.add_argument("--look-inside", action="store_true", help="the look at each pass's batch 8, not before the loop")
parser.add_argument("--two-models", action="store_true", help="a second model and optimizer, stepped after the first")
parser.add_argument("--look-between", action="store_true", help="the look at batch 8 between the two models' steps")
parser.add_argument("--persistent-workers", action="store_true", help="two DataLoader workers, kept across epochs")
args = parser.parse_args()

job = hh.init()
x, y = load_digits(return_X_y=True)
train_set = torch.utils.data.TensorDataset(torch.tensor(x[:1024] / 16.0, dtype=torch.float32), torch.tensor(y[:1024]))
model = nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10)).to(job.device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
workers = {"num_workers": 2, "persistent_workers": True} if args.persistent_workers else {}
trainloader = torch.utils.data.DataLoader(train_set, batch_size=64, shuffle=True, **workers)
if args.two_models:
    second = nn.Linear(64, 10).to(job.device)
    second_optimizer = torch.optim.SGD(second.parameters(), lr=0.1)
    (model, second), (optimizer, second_optimizer), trainloader = job.prepare(
        (model, second), (optimizer, second_optimizer), trainloader)
else:
    model, optimizer, trainloader = job.prepare(model, optimizer, trainloader)

looks = job.is_main or args.everyone
if looks and not args.look_inside and not args.look_between:
    dataiter = iter(trainloader)
    images, labels = next(dataiter)
    print(f"a look at {len(labels)} of the batch's {trainloader.batch_size}", flush=True)


def one_ahead(batches):
    """apex's data_prefetcher, as a generator: the next batch fetched before the one in hand is used."""
    it = iter(batches)
    ahead = next(it, None)
    while ahead is not None:
        batch, ahead = ahead, next(it, None)
        yield batch


losses = []
for epoch in range(args.epochs):
    total, seen = 0.0, 0
    for i, (inputs, labels) in enumerate(one_ahead(trainloader) if args.one_ahead else trainloader):
        if looks and args.look_inside and i == 8:
            images, _ = next(iter(trainloader))
        loss = F.cross_entropy(model(inputs), labels)
        job.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if args.two_models:  # (the epoch's loss: the step's two, summed)
            if looks and args.look_between and i == 8:
                images, _ = next(iter(trainloader))
            second_loss = F.cross_entropy(second(inputs), labels)
            job.backward(second_loss)
            second_optimizer.step()
            second_optimizer.zero_grad()
            loss = loss + second_loss
        total, seen = total + loss.item() * len(labels), seen + len(labels)
    losses.append(total / seen)
if job.is_main:
    with open(os.path.join(args.out, "losses.json"), "w") as f:
        json.dump(losses, f)
with open(os.path.join(args.out, f"buffers{job.rank}.json"), "w") as f:
    json.dump(model[1].running_mean.tolist(), f)
