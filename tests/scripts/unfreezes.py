"""Fine-tuning as one-device scripts do it: a pretrained backbone frozen for the first epoch while
the new head trains, then unfrozen with a smaller learning rate of its own (a param group added
to the optimizer). Run by tests/test_script.py under --sync step (the backbone's gradients are
reduced from the second epoch on: one model on every rank) and --sync local:4 (refused, saying so).

    invoke train --script tests/scripts/unfreezes.py
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import hvdhetero as hh

job = hh.init()
x = torch.randn(768, 12)
y = (x[:, :4].sum(1) > 0).long()
backbone = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
head = nn.Linear(32, 2)
model = nn.Sequential(backbone, head).to(job.device)
backbone.requires_grad_(False)
optimizer = torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9)
loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)
model, optimizer, loader = job.prepare(model, optimizer, loader)
for epoch in job.epochs(3):
    if epoch == 1:
        backbone.requires_grad_(True)
        optimizer.add_param_group({"params": backbone.parameters(), "lr": 0.01})
    for inputs, labels in loader:
        loss = F.cross_entropy(model(inputs), labels)
        optimizer.zero_grad()
        job.backward(loss)
        optimizer.step()
    print(f"epoch {epoch}: loss {loss.item():.4f}")
