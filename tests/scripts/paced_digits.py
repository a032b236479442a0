"""Digits at a fixed pace, an ordinary hvdhetero script: every step of every rank sleeps
STEP_S, so the job's length hardly depends on how many ranks it has (the elastic tests drop a
host and let it back while it runs). Its own arguments: epochs, STEP_S, and optionally
STOP_FILE: the run ends early at the first epoch's end after that file exists (a test that has
seen what it waited for ends the job there; every rank decides on job.evaluate's sum, so alike)."""

import os
import sys
import time

import torch
import torch.nn.functional as F

import hvdhetero as hh
from hvdhetero.recipes import data, models

epochs, step_s = int(sys.argv[1]), float(sys.argv[2])
stop_file = sys.argv[3] if len(sys.argv) > 3 else None
job = hh.init()
train_set, test_set, info = data.load("digits", "data", seed=job.config.seed)
model = models.build("cnn", info).to(job.device)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
model, optimizer, loader = job.prepare(model, optimizer, train_set, global_batch=64,
                                       loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]))
for epoch in job.epochs(epochs):
    for x, y in loader:
        time.sleep(step_s)
        job.backward(F.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    test = job.evaluate(lambda b: {"correct": (model(b[0]).argmax(1) == b[1]).sum(), "count": len(b[1]),
                                   "stop": int(stop_file is not None and os.path.exists(stop_file))}, test_set)
    job.log(test_accuracy=test["correct"] / test["count"])
    if test["stop"]:
        job.stop()
