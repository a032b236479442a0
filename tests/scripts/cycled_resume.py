"""FixMatch's labelled loader, prepared and restarted with iter() when it runs out, inside
job.epochs: 15 steps an epoch over 6-step passes, so each epoch takes the loader 3 times, each pass
in an order of its own. Checkpointed by hvdhetero (--checkpoint-every 10: taken as step 10 comes, in
the epoch's second pass); rank 1 fails once, at step 14 (the third pass's third batch; a marker file
says it did). Run by tests/test_script.py: each rank writes every step's sample indices to
OUT/stepsR.jsonl, with the run it came from (1, or 2 once resumed).

    invoke train --script tests/scripts/cycled_resume.py --checkpoint-every 10 -- --out DIR
"""

import argparse
import json
import os

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import hvdhetero as hh

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
args = parser.parse_args()

STEPS = 15
torch.manual_seed(0)
x = torch.randn(192, 8)
labelled = DataLoader(TensorDataset(x, (x.sum(1) > 0).long(), torch.arange(192)), batch_size=32, shuffle=True,
                      drop_last=True)
job = hh.init()
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
model, optimizer, labelled = job.prepare(model, optimizer, labelled)
marker = os.path.join(args.out, "failed-once")
run = 2 if os.path.exists(marker) else 1
labelled_iter = iter(labelled)


def next_labelled():
    """The next labelled batch, the loader restarted when it runs out (the FixMatch reference's way)."""
    global labelled_iter
    try:
        return next(labelled_iter)
    except StopIteration:
        labelled_iter = iter(labelled)
        return next(labelled_iter)


for epoch in job.epochs(3):
    while job.step < (epoch + 1) * STEPS:  # (counted by job.step: a resumed epoch goes on where it stood)
        inputs, targets, index = next_labelled()
        if job.rank == 1 and run == 1 and job.step == 14:
            open(marker, "w").close()
            raise RuntimeError("rank 1 fails once, at step 14")
        with open(os.path.join(args.out, f"steps{job.rank}.jsonl"), "a") as f:
            f.write(json.dumps({"run": run, "step": job.step, "index": index.tolist()}) + "\n")
        optimizer.zero_grad()
        job.backward(F.cross_entropy(model(inputs), targets))
        optimizer.step()
with open(os.path.join(args.out, f"rank{job.rank}.jsonl"), "a") as f:
    f.write(json.dumps({"step": job.step, "epoch": job.epoch}) + "\n")
