"""A script whose steps are slow (a big model's first steps, a long checkpoint save): the job
must not take it for a frozen rank. Its own argument: seconds its one step sleeps."""

import sys
import time

import torch
import torch.nn.functional as F

import hvdhetero as hh

job = hh.init()
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
model, optimizer, loader = job.prepare(model, optimizer, data, global_batch=16,
                                       loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]))
for epoch in job.epochs(1):
    for x, y in loader:
        time.sleep(float(sys.argv[1]))
        job.backward(F.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
if job.is_main:
    print("slow steps done", flush=True)
