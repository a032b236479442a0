"""Self-training on the digits: each epoch the unlabelled samples the model is sure of join the
labelled set with the labels it gave them, so the training set grows between epochs. The set
goes to job.prepare through a batch function over a DataLoader of the script's own, which sees
it as it stands at each iter() (docs/api.md, "A dataset that grows"). Rank 0 writes each
epoch's size to --out."""
import argparse
import json

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import hvdhetero as hh

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--out", required=True)
args = parser.parse_args()

job = hh.init()
torch.manual_seed(0)
X, y = load_digits(return_X_y=True)
X, y = torch.tensor(X, dtype=torch.float32) / 16, torch.tensor(y)
labelled, unlabelled = TensorDataset(X[:300], y[:300]), X[300:1500]
loader = DataLoader(labelled, batch_size=32, shuffle=True, drop_last=True)  # not prepared: it sees the set grow
batches = iter(loader)


def next_batch():
    global batches
    try:
        return next(batches)
    except StopIteration:  # the epoch's pass is over: the next begins over the set as it stands
        batches = iter(loader)
        return next(batches)


model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)).to(job.device)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
model, optimizer, get_batch = job.prepare(model, optimizer, next_batch)
taken = torch.zeros(len(unlabelled), dtype=torch.bool)
sizes = []
for epoch in job.epochs(args.epochs):
    sizes.append(len(labelled))
    model.train()
    end = job.step + len(loader)  # this epoch's steps, of the set as it stands (a step may come in chunks)
    while job.step < end:
        x, target = get_batch()
        loss = nn.functional.cross_entropy(model(x), target)
        optimizer.zero_grad()
        job.backward(loss)
        optimizer.step()
    model.eval()
    with torch.no_grad():
        confidence, label = model(unlabelled.to(job.device)).softmax(1).max(1)
    sure, label = (confidence.cpu() > 0.9) & ~taken, label.cpu()
    # rank 0's choice on every rank, so that every rank's set grows alike (another device may round a
    # borderline confidence otherwise; under local/diloco the replicas differ until the epoch's end)
    sure, label = job.reduce([sure.int(), label] if job.rank == 0 else [torch.zeros_like(sure, dtype=torch.int),
                                                                       torch.zeros_like(label)])
    sure = sure > 0
    taken |= sure
    labelled.tensors = (torch.cat([labelled.tensors[0], unlabelled[sure]]),
                        torch.cat([labelled.tensors[1], label[sure]]))
    job.log(labelled=len(labelled))
if job.rank == 0:
    with open(args.out, "w") as f:
        json.dump(sizes, f)
