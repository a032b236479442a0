"""Optuna's examples' loop: each epoch takes the first N batches of the loader and leaves
(`if batch_idx * BATCHSIZE >= N_TRAIN_EXAMPLES: break`); the live line and a sweep count a pass
of N steps from the second epoch on.

    invoke train --script tests/scripts/leaves_early.py -- --epochs 3 --batches 5
"""

import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

import hvdhetero as hh

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--batches", type=int, default=5)
args = parser.parse_args()

job = hh.init()
x, y = load_digits(return_X_y=True)
train_set = torch.utils.data.TensorDataset(torch.tensor(x[:1500] / 16.0, dtype=torch.float32), torch.tensor(y[:1500]))
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)).to(job.device)
optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
model, optimizer, loader = job.prepare(model, optimizer, train_set, global_batch=64)  # 24 steps an epoch
for epoch in job.epochs(args.epochs):
    for batch_idx, (inputs, labels) in enumerate(loader):
        if batch_idx >= args.batches:
            break
        loss = F.cross_entropy(model(inputs), labels)
        job.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    print(f"epoch {epoch}: loss {loss.item():.4f}")
