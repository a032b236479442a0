"""Fine-tuning as one-device scripts do it: a pretrained backbone frozen for the first epoch while
the new head trains, then unfrozen with a smaller learning rate of its own (a param group added
to the optimizer). Run by tests/test_script.py under --sync step (the backbone's gradients are
reduced from the second epoch on) and --sync diloco:4 (the rounds exchange it from then on): one
model on every rank at the end. UNFREEZE_IN_LOOP=1 unfreezes inside the loop body instead, which
the rounds refuse, saying so; UNFREEZE_MID_EPOCH=1 after the epoch's 6th step, between steps,
which --inner-steps by-speed refuses (a merging rank would reach it at another step).

    invoke train --script tests/scripts/unfreezes.py
"""

import os

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
in_loop = os.environ.get("UNFREEZE_IN_LOOP") == "1"
mid_epoch = os.environ.get("UNFREEZE_MID_EPOCH") == "1"
for epoch in job.epochs(3):
    if epoch == 1 and not in_loop and not mid_epoch:
        backbone.requires_grad_(True)
        optimizer.add_param_group({"params": backbone.parameters(), "lr": 0.01})
    for inputs, labels in loader:
        if epoch == 1 and in_loop and not backbone[0].weight.requires_grad:
            backbone.requires_grad_(True)
            optimizer.add_param_group({"params": backbone.parameters(), "lr": 0.01})
        loss = F.cross_entropy(model(inputs), labels)
        optimizer.zero_grad()
        job.backward(loss)
        optimizer.step()
        if mid_epoch and job.step == 18:  # the 6th step of epoch 1, at the loop body's end
            backbone.requires_grad_(True)
            optimizer.add_param_group({"params": backbone.parameters(), "lr": 0.01})
    print(f"epoch {epoch}: loss {loss.item():.4f}")
