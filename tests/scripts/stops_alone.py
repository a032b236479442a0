"""A one-device habit that breaks a two-rank job: stop when *this process's* training loss is
low enough. Each rank's loss is over its own share, so the ranks decide apart; here rank 1's
threshold is met first on purpose (the same happens by chance with a real threshold). Run by
tests/test_script.py: the launcher names rank 1's early end, not rank 0's broken reduction.

    invoke train --script tests/scripts/stops_alone.py
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import hvdhetero as hh

job = hh.init()
x = torch.randn(512, 8)
y = (x.sum(1) > 0).long()
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).to(job.device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)
model, optimizer, loader = job.prepare(model, optimizer, loader)
target = 10.0 if job.rank == 1 else 0.0  # rank 1's "loss is low enough" comes at once
for epoch in range(20):
    for inputs, labels in loader:
        loss = F.cross_entropy(model(inputs), labels)
        optimizer.zero_grad()
        job.backward(loss)
        optimizer.step()
    if loss.item() < target:
        print(f"rank {job.rank}: loss {loss.item():.3f} is low enough, stopping")
        break
print("training done")
