"""A model that raises in calibration's probe on one rank only, as a device with little memory
does at the probe's batch (the whole global batch on one rank) though it would train on its
share: the job must start anyway, from an equal split, and balance from the first steps.

    invoke train --script tests/scripts/probe_raises.py --slowdown 3 -- --epochs 3
"""

import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import hvdhetero as hh

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
args = parser.parse_args()

job = hh.init()


class Net(nn.Module):
    def __init__(self, most):
        super().__init__()
        self.most = most
        self.layers = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x):
        if len(x) > self.most:
            raise RuntimeError(f"out of memory (on purpose): {len(x)} samples, this device holds {self.most}")
        return self.layers(x)


x, y = load_digits(return_X_y=True)
train_set = torch.utils.data.TensorDataset(torch.tensor(x[:1500] / 16.0, dtype=torch.float32), torch.tensor(y[:1500]))
model = Net(most=40 if job.rank == 1 else 10_000).to(job.device)
optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
model, optimizer, loader = job.prepare(model, optimizer, train_set, global_batch=64)
for epoch in job.epochs(range(1, args.epochs + 1)):  # numbered from 1, as many scripts do
    for inputs, labels in loader:
        loss = F.cross_entropy(model(inputs), labels)
        job.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    print(f"epoch {epoch}: loss {loss.item():.4f}")
