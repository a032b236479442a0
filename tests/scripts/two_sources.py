"""Two data sources in one step, as semi-supervised scripts (FixMatch) draw them: a small labelled
set and a larger unlabelled one, mu unlabelled samples to each labelled, in one loss.

--mode cycled: the labelled DataLoader prepared, restarted with iter() when it runs out (15 steps an
epoch over its 6-step passes), the unlabelled one drawn beside it, each rank its whole batch: what a
port of the reference loop does first (the console says what it means).
--mode joined: docs/api.md's "Two data sources in one step": one batch function returns both, the
unlabelled batch laid out [batch, mu, ...], so that each rank takes its share of each.

Each rank writes what it took at every step (and its labels) to OUT/rank{r}.json.
"""

import argparse
import json
import os

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

import hvdhetero as hh

parser = argparse.ArgumentParser()
parser.add_argument("--mode", choices=["cycled", "joined"], default="joined")
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--out", required=True)
args = parser.parse_args()

torch.manual_seed(0)
digits = load_digits()
x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
y = torch.tensor(digits.target)
labelled, unlabelled, test = TensorDataset(x[:192], y[:192]), TensorDataset(x[192:1500]), (x[1500:], y[1500:])
BATCH, MU, STEPS = 32, 3, 15
labelled_loader = DataLoader(labelled, batch_size=BATCH, shuffle=True, drop_last=True)
unlabelled_loader = DataLoader(unlabelled, batch_size=BATCH * MU, shuffle=True, drop_last=True)

job = hh.init()
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
labelled_iter, unlabelled_iter = iter(labelled_loader), iter(unlabelled_loader)


def next_of(name):
    """The next batch of a loader, restarted when it runs out (the FixMatch reference's way)."""
    global labelled_iter, unlabelled_iter
    try:
        return next(labelled_iter if name == "labelled" else unlabelled_iter)
    except StopIteration:
        if name == "labelled":
            labelled_iter = iter(labelled_loader)
            return next(labelled_iter)
        unlabelled_iter = iter(unlabelled_loader)
        return next(unlabelled_iter)


if args.mode == "joined":
    def both():
        x_l, y_l = next_of("labelled")
        (x_u,) = next_of("unlabelled")
        return x_l, y_l, x_u.view(BATCH, MU, -1)  # mu unlabelled samples beside each labelled one
    model, optimizer, batches = job.prepare(model, optimizer, both)
else:
    model, optimizer, labelled_loader = job.prepare(model, optimizer, labelled_loader)
    labelled_iter = iter(labelled_loader)

took, labels = [], []
for epoch in job.epochs(args.epochs):
    model.train()
    for step in range(STEPS):
        if args.mode == "joined":
            x_l, y_l, x_u = next(batches)
            x_u = x_u.flatten(0, 1)
        else:
            x_l, y_l = next_of("labelled")
            (x_u,) = next_of("unlabelled")
        took.append([len(y_l), len(x_u)])
        labels.append(y_l.tolist())
        with torch.no_grad():
            probs = F.softmax(model(x_u + 0.05 * torch.randn_like(x_u)), dim=1)  # the weak view's pseudo-labels
        confidence, pseudo = probs.max(1)
        strong = x_u * (torch.rand_like(x_u) > 0.2)  # the strong view: a fifth of the pixels masked
        unsupervised = (F.cross_entropy(model(strong), pseudo, reduction="none") * (confidence > 0.9)).mean()
        loss = F.cross_entropy(model(x_l), y_l) + unsupervised
        optimizer.zero_grad()
        job.backward(loss)
        optimizer.step()
    model.eval()
    with torch.no_grad():
        accuracy = (model(test[0]).argmax(1) == test[1]).float().mean().item()
    print(f"epoch {epoch}: test accuracy {accuracy:.4f}", flush=True)

with open(os.path.join(args.out, f"rank{job.rank}.json"), "w") as f:
    json.dump({"took": took, "labels": labels, "weights": [round(p.double().sum().item(), 10) for p in model.parameters()]}, f)
