"""A loop with or without job.autocast() around its forward, for --precision's check
(rank/precision.py's Watch): `python autocast_or_not.py [--autocast]`, hh.init(precision="bf16").
"""

import sys

import torch
import torch.nn.functional as F

import hvdhetero as hh

job = hh.init(precision="bf16")
data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randint(0, 3, (64,)))
model = torch.nn.Linear(8, 3).to(job.device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer, loader = job.prepare(model, optimizer, data, global_batch=16)
with torch.no_grad():
    model.eval()
    model(torch.zeros(2, 8))  # a check of the script's own before training: not a training forward
    model.train()
for epoch in job.epochs(2):
    for x, y in loader:
        if "--autocast" in sys.argv:
            with job.autocast():
                loss = F.cross_entropy(model(x), y)
        else:
            loss = F.cross_entropy(model(x), y)
        job.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
print(f"done {job.step} steps")
