"""A loop over steps, not job.epochs (max_steps training): the prepared loader iterated pass
after pass, a pass cut short by the step budget, then a new iterator. Each pass must deal a new
order, as a DataLoader with shuffle=True does at every iter(), and cover the dataset once across
the ranks. Rank 0 prints, as JSON, every pass's labels per rank, job.epoch and job.step.

Run: horovodrun -np 2 -H localhost:2 --gloo python tests/jobs/api_passes.py RUN_DIR
"""

import json
import sys

import horovod.torch as hvd
import torch
from torch.utils.data import DataLoader, TensorDataset

import hvdhetero as hh

job = hh.init(run_dir=sys.argv[1], micro_batch="0")
y = torch.arange(96)
model = torch.nn.Linear(1, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
loader = DataLoader(TensorDataset(y.float().view(-1, 1), y), batch_size=16, shuffle=True)
model, optimizer, loader = job.prepare(model, optimizer, loader)
passes, it = [[]], iter(loader)
for step in range(15):  # 2.5 passes of 6 steps
    try:
        x, labels = next(it)
    except StopIteration:
        it = iter(loader)
        x, labels = next(it)
        passes.append([])
    passes[-1] += labels.tolist()
    job.backward(model(x).pow(2).mean())
    optimizer.step()
    optimizer.zero_grad()
it = iter(loader)  # a new iterator after a cut pass: one more whole pass, in a new order
passes.append([int(v) for _, labels in it for v in labels])  # drawn only: no step
every = hvd.allgather_object(passes)
if job.is_main:
    print("API_PASSES " + json.dumps({"passes": every, "epoch": job.epoch, "step": job.step}), flush=True)
