"""Loss scales of the script's own across ranks: a torch GradScaler as one-GPU AMP scripts use
it (job.backward(scaler.scale(loss)); scaler.unscale_; scaler.step; scaler.update), and the
job's own fp16 loss scale under a script that accumulates gradients over two batches.

Each case is one epoch of 4 global steps of 48 digits on the CNN, equal shares; rank 0 prints,
as JSON, every case's parameter digest after each step (rank by rank), job.step, the scalers'
scales and the epoch's loss record. The cases with a scale are compared with their reference
without one: scales are powers of two, so the parameters must match bit for bit.

- ref-micro / scaler-micro: micro-batches of 8 (3 chunks a step), clipping; rank 0's scaler
  starts at 2**10 and doubles after every 2 clean steps, rank 1's is disabled (what
  torch.amp.GradScaler("cuda") is on a Mac or a CPU rank); rank 1's loss is inf at step 4.
  Stepped through the optimizer the script made (not the one job.prepare returned).
- ref-accumulate / scaler-accumulate / lossscale-accumulate: whole shares, the script steps
  every second batch; the job's own loss scale switched on by hand (what fp16 on cuda/mps does;
  a CPU has no fast fp16).
- scaler-local: --sync local:2, micro-batches, both scalers on; rank 1's loss is inf at step 2:
  rank 1 alone skips, and both ranks still count 4 steps and 2 rounds.

Run: horovodrun -np 2 -H localhost:2 --gloo python tests/jobs/api_scalers.py RUN_DIR
$HVDHETERO_TEST_HOSTS (JSON, JobConfig.hosts) puts rank 0 on CUDA and rank 1 on the CPU (tests/gpu):
then both make GradScaler("cuda"), which the CPU rank's torch disables.
"""

import hashlib
import json
import os
import sys

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import hvdhetero as hh
from hvdhetero import metrics
from hvdhetero.config import JobConfig
from hvdhetero.rank import precision
from hvdhetero.recipes import data, models

CASES = {  # name: (micro-batch, accumulate, scaler, sync, the step whose loss is inf on rank 1)
    "ref-micro": ("8", False, None, "step", None),
    "scaler-micro": ("8", False, "mixed", "step", 4),
    "ref-accumulate": ("0", True, None, "step", None),
    "scaler-accumulate": ("0", True, "mixed", "step", None),
    "lossscale-accumulate": ("0", True, "job", "step", None),
    "scaler-local": ("8", False, "both", "local:2", 2),
}


def digest(model):
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


run_dir = sys.argv[1]
hosts = json.loads(os.environ.get("HVDHETERO_TEST_HOSTS") or "{}")  # tests/gpu: rank 0 on CUDA, rank 1 on the CPU
train, _, info = data.load("digits", "unused")
train = torch.utils.data.Subset(train, range(192))
results = {}
for i, (name, (micro, accumulate, scaling, sync, inf_at)) in enumerate(CASES.items()):
    job = hh.Job(JobConfig(run_dir=f"{run_dir}/{name}", equal_split=True, micro_batch=micro, sync=sync, seed=3,
                           deterministic=True, hosts=hosts))
    torch.manual_seed(3)
    model = models.build("cnn", info).to(job.device).eval()  # eval: no dropout, the same function in every case
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if scaling == "job":
        job.loss_scale = precision.LossScale(scale=2.0 ** 10)
    scaler = None
    if scaling == "mixed":  # on a CUDA rank beside a CPU rank: GradScaler("cuda") on both, as a script has it
        scaler = torch.amp.GradScaler("cuda" if hosts else "cpu", init_scale=2.0 ** 10, growth_interval=2,
                                      enabled=bool(hosts) or job.rank == 0)
    elif scaling == "both":
        scaler = torch.amp.GradScaler(job.device.type, init_scale=2.0 ** 10, growth_interval=2)
    own = name == "scaler-micro"  # `model, _, loader = ...`: the script steps the optimizer it made
    model, prepared, loader = job.prepare(model, optimizer, train, global_batch=48)
    if not own:
        optimizer = prepared
    digests, scales, batches = [], [], 0
    for epoch in job.epochs(1):
        for x, y in loader:
            loss = F.cross_entropy(model(x), y) / (2 if accumulate else 1)
            if inf_at == job.step + 1 and job.rank == 1:
                loss = loss * float("inf")
            job.backward(scaler.scale(loss) if scaler is not None else loss)
            batches += 1
            if accumulate and batches % 2:
                continue
            before = job.step
            if scaler is not None:
                scaler.unscale_(optimizer)
                job.clip_grad_norm_(5.0)
                scaler.step(optimizer)
                scaler.update()
            else:
                job.clip_grad_norm_(5.0)
                optimizer.step()
            optimizer.zero_grad()
            if job.step != before:
                digests.append(digest(model))
                scales.append(scaler.get_scale() if scaler is not None else None)
    epoch_record = metrics.records(os.path.join(run_dir, name, metrics.FILE), "epoch") if job.is_main else None
    results[name] = hvd.allgather_object({"digests": digests, "step": job.step, "scales": scales,
                                          "rounds": job.training.strategy.rounds, "device": str(job.device),
                                          "loss": epoch_record[0]["loss"] if epoch_record else None},
                                         name=f"scalers.{i}")
if hvd.rank() == 0:
    print("API_SCALERS " + json.dumps(results), flush=True)
