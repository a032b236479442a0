"""Exactness through the public API: two ranks with unequal shares (the last rank 3x slower, so
the balancer gives it less) take two steps of `job.prepare`/`job.backward`/`optimizer.step()`;
rank 0 replays them in one process on the joined batches and prints the relative errors as JSON.
Cases: SGD with momentum, two param groups and a per-batch StepLR; AdamW; with and without
gradient clipping, overlap and micro-batches of 8; two that clip with the script's own
torch.nn.utils.clip_grad_norm_ over micro-batches; and a model of an nn.Embedding(sparse=True)
(sparse gradients) and an nn.LazyLinear (shaped by its first forward, in job.prepare), plain SGD;
fine-tuning's habit: all but the head frozen at prepare, unfrozen after the first step (a
param group added to the optimizer), overlapped, in micro-batches; then a new head made on every
rank from a seed of its own after the first step (rank 0's must train everywhere); and two losses
backpropagated in turn (`job.backward(loss, retain_graph=True)`, then a penalty's), overlapped, in
micro-batches, also under a dynamic loss scale; and "tiny": a loss 1e-4 of the usual (gradients
of 1e-9 to 1e-5) under a dynamic loss scale with fp16 on the wire, compared by each step's change
of the parameters (the wire's 11 bits against one process's float32); and "prefetch": a loop that fetches one
batch ahead (apex's data_prefetcher), the split changed between the batch in hand and the one ahead.

Run: horovodrun -np 2 -H localhost:2 --gloo python tests/jobs/api_exactness.py RUN_DIR
$HVDHETERO_TEST_HOSTS (JSON, JobConfig.hosts: each horovodrun host's device) puts the ranks on
different devices (tests/gpu: a CUDA rank and a CPU rank); the replay runs on rank 0's device
(and, on a GPU, the plain cases' on the CPU too: device_rel_err, the two devices' own distance).
"""

import copy
import itertools
import json
import os
import sys

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import hvdhetero as hh
from hvdhetero.config import JobConfig
from hvdhetero.rank import precision
from hvdhetero.recipes import data, models
from prefetching import one_ahead

STEPS = 2
GLOBAL_BATCH = 48
MAX_NORM = 0.5  # below the CNN's first gradient norms (~1-2): clipping really happens


class Tokens(torch.nn.Module):
    """Each pixel a token: above its image's mean or not, at its position; a sparse embedding and a
    lazy head."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(128, 4, sparse=True)
        self.head = torch.nn.LazyLinear(10)

    def forward(self, x):
        x = x.flatten(1)
        tokens = (x > x.mean(1, keepdim=True)).long() + 2 * torch.arange(x.shape[1], device=x.device)
        return self.head(self.emb(tokens).flatten(1))


def build(name, model):
    if name == "sparse":
        return torch.optim.SGD(model.parameters(), lr=0.5), None
    if name in ("twoloss", "tiny", "zeromodel", "prefetch"):
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), None
    if name == "newhead":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), None
    if name == "unfreeze":
        for part in list(model)[:-1]:
            part.requires_grad_(False)
        return torch.optim.SGD(model[-1].parameters(), lr=0.1, momentum=0.9), None
    if name == "sgd":
        head = list(model[-1].parameters())
        rest = [p for p in model.parameters() if all(p is not h for h in head)]
        opt = torch.optim.SGD([{"params": rest}, {"params": head, "lr": 0.05}], lr=0.1, momentum=0.9)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01), None


def rel(a, b):
    """Relative distance of two lists of tensors, on the CPU: on a GPU machine the replay's copy on
    the CPU is compared with the one on the CUDA rank's device."""
    a = torch.cat([t.detach().reshape(-1).cpu() for t in a]).double()
    b = torch.cat([t.detach().reshape(-1).cpu() for t in b]).double()
    return ((a - b).norm() / b.norm()).item()


# TF32 (cuDNN's convolutions use it by default on Ampere and later) rounds a CUDA rank's inputs
# to 10-bit mantissas: this checks the reduction, at fp32.
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
run_dir = sys.argv[1]
train, _, info = data.load("digits", "unused")
results = []
CASES = [*itertools.product(["sgd", "adamw"], [False, True], [False, True], [0, 8]),
         ("sgd", "torch", True, 8), ("adamw", "torch", False, 8),  # the script's torch.nn.utils.clip_grad_norm_
         ("sparse", False, True, 8), ("unfreeze", False, True, 8), ("twoloss", False, True, 8),
         ("twoloss", "scaled", False, 8), ("newhead", False, True, 8), ("tiny", "scaled", True, 0),
         ("zeromodel", False, True, 8),  # model.zero_grad() atop each chunk (word_language_model's, DCGAN's)
         ("prefetch", False, False, 0)]  # apex's data_prefetcher: the next batch fetched before the one in hand trains
TINY = 1e-4  # a dynamic loss scale (fp16 on CUDA/MPS), switched on by hand
PENALTY = 0.01  # "twoloss": the outputs' mean square, its own backward after the loss's
for i, (name, clip, overlap, micro) in enumerate(CASES):
    job = hh.Job(JobConfig(run_dir=f"{run_dir}/{i}", slowdown=3.0, overlap=overlap, micro_batch=str(micro),
                           compression="fp16" if name == "tiny" else "none",
                           hosts=json.loads(os.environ.get("HVDHETERO_TEST_HOSTS") or "{}")))
    if clip == "scaled":
        job.loss_scale = precision.LossScale(scale=2.0 ** 10)
    torch.manual_seed(i + hvd.rank())  # different initial weights per rank: prepare must broadcast rank 0's
    model = (Tokens() if name == "sparse" else models.build("cnn", info)).to(job.device).eval()  # eval: no dropout
    optimizer, scheduler = build(name, model)
    model, optimizer, loader = job.prepare(model, optimizer, train, global_batch=GLOBAL_BATCH, scheduler=scheduler,
                                           loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    ref = copy.deepcopy(model)
    ref_opt, ref_sched = build(name, ref)
    # On a GPU rank the plain cases' replay runs on the CPU too: how far one process on the CPU
    # lands from one on the GPU, the floor under the job's distance from the replay (AdamW's
    # first steps, lr * g / |g|, turn a near-zero gradient's last bits into a whole step).
    cpu_ref = copy.deepcopy(ref).cpu() if job.device.type != "cpu" and name in ("sgd", "adamw") else None
    replays = [(ref, ref_opt, ref_sched), *([(cpu_ref, *build(name, cpu_ref))] if cpu_ref is not None else [])]
    initial = [p.detach().clone() for p in model.parameters()]
    frozen, headless = name == "unfreeze", name == "newhead"
    seen, chunks, sizes, sparse, taken = [], 0, None, None, 0
    for x, y in (one_ahead(loader) if name == "prefetch" else loader):
        if frozen and job.step == 1:  # the backbone joins after the first step, here and in the replay
            frozen = False
            for m, opt in ((model, optimizer), (ref, ref_opt)):
                body = [p for part in list(m)[:-1] for p in part.parameters()]
                for p in body:
                    p.requires_grad_(True)
                opt.add_param_group({"params": body, "lr": 0.05})
        seen.append((x, y))
        chunks, taken = chunks + 1, taken + len(y)
        if name == "zeromodel":
            model.zero_grad()  # the module's own, every chunk: it must not wipe the step's earlier chunks
        out = model(x)
        loss = F.cross_entropy(out, y) * (TINY if name == "tiny" else 1.0)
        if name == "twoloss":
            job.backward(loss, retain_graph=True)
            job.backward(PENALTY * out.pow(2).mean())
        else:
            job.backward(loss)
        if clip == "torch":  # as one-device scripts clip, kept in a port (rank/clipping.py)
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        elif clip is True:
            job.clip_grad_norm_(MAX_NORM)
        before = job.step
        if name == "sparse":
            sparse = model.emb.weight.grad.is_sparse
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()
        if job.step > before:  # the step ended on this chunk: replay it in one process on both ranks' samples
            mine = (torch.cat([a for a, _ in seen]).cpu(), torch.cat([b for _, b in seen]).cpu())  # CPU: no CUDA there
            both = hvd.allgather_object(mine, name=f"api.joined.{i}.{job.step}")
            sizes = [len(b) for _, b in both]
            xb, yb = torch.cat([a.to(x.device) for a, _ in both]), torch.cat([b.to(x.device) for _, b in both])
            for r, r_opt, r_sched in replays:
                r_opt.zero_grad(set_to_none=True)
                at = next(r.parameters()).device
                out = r(xb.to(at))
                (F.cross_entropy(out, yb.to(at)) * (TINY if name == "tiny" else 1.0)
                 + (PENALTY * out.pow(2).mean() if name == "twoloss" else 0)).backward()
                if clip in (True, "torch"):
                    torch.nn.utils.clip_grad_norm_(r.parameters(), MAX_NORM)
                r_opt.step()
                if r_sched is not None:
                    r_sched.step()
            seen = []
        if job.step == STEPS:
            break
        if name == "prefetch" and job.step == 1:  # batch 1 is fetched (ahead) already: a new split from batch 2 on
            split = list(job.training.sampler.batch_sizes)
            job.training.loader.resplit(split[::-1] if split[0] != split[1] else [30, 18], 1)
        if headless and job.step == 1:  # a new head between steps: each rank's own initial values
            headless = False
            torch.manual_seed(100 + hvd.rank())
            model[-1] = torch.nn.Linear(model[-1].in_features, model[-1].out_features).to(job.device)
            ref[-1] = copy.deepcopy(model[-1])  # the replay: this rank's (rank 0 reports its own)
            optimizer.add_param_group({"params": list(model[-1].parameters())})
            ref_opt.add_param_group({"params": list(ref[-1].parameters())})
    results.append({"optimizer": name, "clip": clip, "overlap": overlap, "micro_batch": micro, "sizes": sizes,
                    "sparse_grad": sparse, "global_steps": job.step, "samples": job.training.records.samples, "taken": taken,
                    "chunks": chunks, "lr": [g["lr"] for g in optimizer.param_groups],
                    "ref_lr": [g["lr"] for g in ref_opt.param_groups],
                    "param_rel_err": rel(model.parameters(), ref.parameters()),
                    "device_rel_err": rel(cpu_ref.parameters(), ref.parameters()) if cpu_ref is not None else None,
                    "change_rel_err": rel([p - p0 for p, p0 in zip(model.parameters(), initial)],
                                          [p - p0 for p, p0 in zip(ref.parameters(), initial)]),
                    "devices": hvd.allgather_object(str(job.device), name=f"api.devices.{i}"),
                    "split_after": list(job.training.sampler.batch_sizes)})
if hvd.rank() == 0:
    print("API_EXACTNESS " + json.dumps(results), flush=True)
