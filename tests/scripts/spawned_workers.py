"""DataLoader workers started as a Mac starts them (spawn: Python's default there; Linux forks),
so each worker runs this script's top level again, `job = hh.init()` included. Each worker
writes what its hh.init() gave it (worker_init_fn runs there). With --no-main-guard the training
runs at the top level too (the README's diff has no `if __name__ == "__main__":`), so a worker
would train as well: its job.prepare says what to do instead.

    invoke train --script tests/scripts/spawned_workers.py -- --out DIR [--no-main-guard]
"""

import argparse
import multiprocessing
import os
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import hvdhetero as hh

multiprocessing.set_start_method("spawn", force=True)  # the Mac's way to start a DataLoader worker
parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--no-main-guard", action="store_true")
args = parser.parse_args()
job = hh.init()


class Noisy(Dataset):
    """Defined here: a spawned worker unpickles it from this script, run again as __mp_main__."""

    def __len__(self):
        return 256

    def __getitem__(self, i):
        x = torch.tensor([i / 256.0, 1.0])
        return x, torch.tensor([2.0 * x[0] - 1.0])


def worker_said(worker_id):
    """In the worker: what its run of the top level got from hh.init(), and whether Horovod came with it."""
    path = os.path.join(args.out, f"worker-{job.rank}-{worker_id}-{os.getpid()}.txt")
    with open(path, "w") as f:
        f.write(f"{type(job).__name__} {job.rank} {job.size} {job.device} {job.is_main} "
                f"{'horovod.torch' in sys.modules}")


def train():
    model = torch.nn.Linear(2, 1).to(job.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(Noisy(), batch_size=32, shuffle=True, num_workers=2, worker_init_fn=worker_said)
    model, optimizer, loader = job.prepare(model, optimizer, loader)
    for epoch in job.epochs(2):
        for x, y in loader:
            job.backward(F.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        job.log(loss=job.evaluate(lambda b: {"se": F.mse_loss(model(b[0]), b[1], reduction="sum")}, Noisy())["se"])


if __name__ == "__main__" or args.no_main_guard:
    train()
