"""A script that resumes itself from a file only rank 0's host holds (torchrun's snapshot: rank 0
saved it, and each process loads it where it exists): rank 0 loads its weights and epoch, rank 1
starts afresh. job.prepare gives every rank rank 0's weights, and job.epochs(start=) rank 0's
epoch: both ranks train epochs 3 and 4, as one model. Then a pass of the script's own (a
fine-tuning pass after job.epochs) is the next epoch, 5: a new order, not epoch 4's again. Rank 0
prints, as JSON, the epochs each rank trained, job.step, every rank's parameters, and the samples
of epoch 4 and of the pass after it with job.epoch then.

Run: horovodrun -np 2 -H localhost:2 --gloo python tests/jobs/api_start.py RUN_DIR
"""

import json
import sys

import horovod.torch as hvd
import torch
from torch.utils.data import DataLoader, TensorDataset

import hvdhetero as hh

job = hh.init(run_dir=sys.argv[1], micro_batch="0")
x = torch.linspace(-1, 1, 64).view(-1, 1)
model = torch.nn.Linear(1, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
epochs_run = 0
if job.rank == 0:  # "if os.path.exists(snapshot_path)": rank 0's host alone has the file
    with torch.no_grad():
        model.weight.fill_(2.0)
        model.bias.fill_(0.5)
    epochs_run = 3
loader = DataLoader(TensorDataset(x, 3 * x, torch.arange(64)), batch_size=16, shuffle=True)
model, optimizer, loader = job.prepare(model, optimizer, loader)
trained, seen = [], {}


def train_pass(name):
    seen[name] = []
    for xb, yb, index in loader:
        seen[name] += index.tolist()
        job.backward(torch.nn.functional.mse_loss(model(xb), yb))
        optimizer.step()
        optimizer.zero_grad()


for epoch in job.epochs(5, start=epochs_run):
    train_pass(f"epoch {epoch}")
    trained.append(epoch)
step = job.step
train_pass("after")  # a pass of the script's own after job.epochs
every = hvd.allgather_object(trained)
weights = hvd.allgather_object([model.weight.item(), model.bias.item()])
seen = hvd.allgather_object({"epoch 4": seen["epoch 4"], "after": seen["after"], "epoch": job.epoch})
if job.is_main:
    print("API_START " + json.dumps({"trained": every, "step": step, "weights": weights, "seen": seen,
                                     "steps": job.step}), flush=True)
