"""A loop over steps, not job.epochs (max_steps training): the prepared loader iterated pass
after pass, a pass cut short by the step budget, then a new iterator. Each pass must deal a new
order, as a DataLoader with shuffle=True does at every iter(), and cover the dataset once across
the ranks. A BatchNorm layer's running mean, as each whole pass ends, must be one on every rank
(averaged as the loop takes its last batch; there is no epoch's end); a pass of rank 0's alone
that takes no step exchanges nothing at its end (it would wait for rank 1), and is no new epoch:
the ranks' next pass deals them one order; so is a batch drawn before a loop (`next(iter(loader))`)
and one rank 0 alone draws inside a pass.
Rank 0 prints, as JSON, every pass's labels and those means per rank, job.epoch and job.step.

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
model = torch.nn.Sequential(torch.nn.BatchNorm1d(1), torch.nn.Linear(1, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
loader = DataLoader(TensorDataset(y.float().view(-1, 1), y), batch_size=16, shuffle=True)
model, optimizer, loader = job.prepare(model, optimizer, loader)
passes, means, it = [[]], [], iter(loader)
for step in range(15):  # 2.5 passes of 6 steps
    try:
        x, labels = next(it)
    except StopIteration:  # a whole pass taken
        means.append(model[0].running_mean.item())
        it = iter(loader)
        x, labels = next(it)
        passes.append([])
    passes[-1] += labels.tolist()
    job.backward(model(x).pow(2).mean())
    optimizer.step()
    optimizer.zero_grad()
    if step == 8 and job.is_main:  # a look of rank 0's alone at a batch, inside a pass: no epoch of its own
        next(iter(loader))
it = iter(loader)  # a new iterator after a cut pass: one more whole pass, in a new order
passes.append([int(v) for _, labels in it for v in labels])  # drawn only: no step, no exchange
epoch = job.epoch
if job.is_main:  # a pass of rank 0's alone that takes no step: no exchange to wait for at its end
    sum(len(labels) for _, labels in loader)
steps = job.step
peek = next(iter(loader))[1].tolist()  # the DDP tutorial's look at a batch before its loop: no pass of its own
after = []
for x, labels in loader:  # every rank, after rank 0's pass alone: one epoch's order on both
    after += labels.tolist()
    job.backward(model(x).pow(2).mean())
    optimizer.step()
    optimizer.zero_grad()
every, means = hvd.allgather_object(passes), hvd.allgather_object(means)
peeks, afters, epochs = hvd.allgather_object(peek), hvd.allgather_object(after), hvd.allgather_object(job.epoch)
if job.is_main:
    print("API_PASSES " + json.dumps({"passes": every, "means": means, "epoch": epoch, "step": steps, "peeks": peeks,
                                      "afters": afters, "epochs": epochs}), flush=True)
