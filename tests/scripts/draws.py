"""What each rank draws from torch's generator before job.prepare and after it: each rank prints
both, tagged with its rank (invoke train --all-ranks-output shows every rank's)."""

import torch

import hvdhetero as hh

job = hh.init()
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
before = torch.rand(3).tolist()
model, optimizer, loader = job.prepare(model, optimizer, torch.utils.data.TensorDataset(torch.randn(8, 4)),
                                       global_batch=4)
print(f"rank {job.rank} before {before} after {torch.rand(3).tolist()}", flush=True)
