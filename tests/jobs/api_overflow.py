"""Loss scaling across ranks: an overflow on one rank makes every rank skip that step.

Two ranks train the digits CNN through the public API with a dynamic loss scale (the fp16 path
of CUDA and MPS ranks; a CPU has no fast fp16, so the scale is switched on here by hand, around
bf16 autocast). At step 3 rank 1 alone multiplies its loss by inf. Rank 0 prints, as JSON, what
every rank saw: whether step 3 left the parameters as they were, the scale before and after,
the skipped-step count, and the final parameter digests.

Run: horovodrun -np 2 -H localhost:2 --gloo python tests/jobs/api_overflow.py RUN_DIR
$HVDHETERO_TEST_HOSTS (JSON, JobConfig.hosts) puts the ranks on different devices and
$HVDHETERO_TEST_PRECISION picks the precision (tests/gpu: fp16 and bf16 on a CUDA rank).
"""

import json
import os
import sys

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import hvdhetero as hh
from hvdhetero.rank import precision
from hvdhetero.rank.evaluation import param_digest
from hvdhetero.recipes import data, models

job = hh.init(run_dir=sys.argv[1], precision=os.environ.get("HVDHETERO_TEST_PRECISION") or "bf16", micro_batch="0",
              hosts=json.loads(os.environ.get("HVDHETERO_TEST_HOSTS") or "{}"))
job.loss_scale = precision.LossScale(scale=2.0 ** 10)  # what fp16 on cuda/mps turns on
train, _, info = data.load("digits", "unused")
model = models.build("cnn", info).to(job.device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
model, optimizer, loader = job.prepare(model, optimizer, train, global_batch=64)
seen = {}
for epoch in job.epochs(1):
    for x, y in loader:
        before = [p.detach().clone() for p in model.parameters()]
        scale_before = job.loss_scale.scale
        with job.autocast():
            loss = F.cross_entropy(model(x), y)
        which = {3: "overflowed", 4: "after"}.get(job.step)  # job.step: optimizer steps so far
        if which == "overflowed" and job.rank == 1:
            loss = loss * float("inf")  # this rank's gradients overflow
        job.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if which:
            seen[which] = {"unchanged": all(torch.equal(a, b) for a, b in zip(before, model.parameters())),
                           "scale": [scale_before, job.loss_scale.scale]}
everything = hvd.allgather_object({"rank": job.rank, "seen": seen, "skipped": job.loss_scale.skipped,
                                   "digest": param_digest(model), "device": str(job.device)}, name="overflow.report")
if job.is_main:
    print("API_OVERFLOW " + json.dumps(everything), flush=True)
