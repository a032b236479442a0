"""Exactness of --sync local:H / diloco:H through the public API: two ranks with unequal shares
(the last rank 3x slower) train H-step rounds; rank 0 replays every rank's steps in one process
(each rank's own model and optimizer), averages with the sample weights (local) or takes the
outer Nesterov step on the weighted mean change (diloco), and prints the relative errors.

Run: horovodrun -np 2 -H localhost:2 --gloo python tests/jobs/sync_exactness.py RUN_DIR
"""

import copy
import json
import sys

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import hvdhetero as hh
from hvdhetero.config import JobConfig
from hvdhetero.recipes import data, models

GLOBAL_BATCH = 48


def inner(name, model):
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1)
    if name == "sgd-momentum":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def flat(params):
    return torch.cat([p.detach().reshape(-1).double() for p in params])


def rel(a, b):
    a, b = flat(list(a)), flat(list(b))
    return ((a - b).norm() / b.norm()).item()


run_dir = sys.argv[1]
train, _, info = data.load("digits", "unused")
results = []
CASES = [  # (sync, inner optimizer, steps, the reference: one process on the joined batch, or each rank replayed)
    ("local:1", "sgd", 2, "joined"),  # local:1 with plain SGD is step sync
    ("step", "sgd", 2, "joined"),
    ("local:3", "sgd-momentum", 6, "replayed"),
    ("diloco:3", "adamw", 6, "replayed"),  # two rounds: the outer momentum acts in the second
]
for i, (sync, name, steps, reference) in enumerate(CASES):
    job = hh.Job(JobConfig(run_dir=f"{run_dir}/{i}", slowdown=3.0, micro_batch="0", sync=sync))
    torch.manual_seed(i)
    model = models.build("cnn", info).eval()  # eval: no dropout, the same function on every rank
    model, optimizer, loader = job.prepare(model, inner(name, model), train, global_batch=GLOBAL_BATCH,
                                           loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    kind, _, every = sync.partition(":")
    every = int(every or 1)
    refs = [copy.deepcopy(model) for _ in range(job.size)]  # each rank's replica, replayed here
    ref_opts = [inner(name, r) for r in refs]
    start = [p.detach().clone() for p in model.parameters()]
    initial = [p.detach().clone() for p in model.parameters()]
    outer = torch.optim.SGD(start, lr=0.7, momentum=0.9, nesterov=True)
    samples = [0] * job.size
    shares = []
    for x, y in loader:
        loss = F.cross_entropy(model(x), y)
        job.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        both = hvd.allgather_object((x, y), name=f"sync.batches.{i}.{job.step}")
        shares.append([len(b) for _, b in both])
        for r, (xr, yr) in enumerate(both):  # every rank's step, replayed
            if reference == "joined":  # one process on the joined batch
                if r == 0:
                    xb, yb = torch.cat([a for a, _ in both]), torch.cat([b for _, b in both])
                    ref_opts[0].zero_grad()
                    F.cross_entropy(refs[0](xb), yb).backward()
                    ref_opts[0].step()
                continue
            ref_opts[r].zero_grad()
            F.cross_entropy(refs[r](xr), yr).backward()
            ref_opts[r].step()
            samples[r] += len(yr)
        if reference == "replayed" and job.step % every == 0:  # the round's end
            w = [n / sum(samples) for n in samples]
            with torch.no_grad():
                if kind == "local":
                    new = [sum(w[r] * list(refs[r].parameters())[k] for r in range(job.size))
                           for k in range(len(start))]
                else:
                    for k, s in enumerate(start):
                        s.grad = sum(w[r] * (s - list(refs[r].parameters())[k]) for r in range(job.size))
                    outer.step()
                    new = [s.clone() for s in start]
                for ref in refs:
                    for p, v in zip(ref.parameters(), new):
                        p.copy_(v)
            samples = [0] * job.size
        if job.step == steps:
            break
    results.append({"sync": sync, "optimizer": name, "steps": steps, "shares": shares,
                    "param_rel_err": rel(model.parameters(), refs[0].parameters()),
                    "moved": rel(initial, model.parameters())})
if hvd.rank() == 0:
    print("SYNC_EXACTNESS " + json.dumps(results), flush=True)
