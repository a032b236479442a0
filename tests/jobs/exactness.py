"""Two ranks with unequal batches step through hvdhetero's Reducer (and the training loop's
forward_backward, whole batches or micro-batches of 8); rank 0 compares the result with one
process stepping on the joined batch and prints the relative errors as JSON. Each case also
`staged`: the buckets gathered in a flat buffer on the parameters' device before they cross, what
a CUDA or MPS rank does, taken here on the CPU.

Run: horovodrun -np 2 -H localhost:2 --gloo python tests/jobs/exactness.py
"""

import copy
import itertools
import json

import horovod.torch as hvd
import torch
import torch.nn.functional as F

from hvdhetero.recipes import data
from hvdhetero.rank import devices
from hvdhetero.recipes import models
from hvdhetero.rank.reducer import Reducer
from hvdhetero.rank.worker import Worker, forward_backward

SIZES = [37, 11]  # deliberately unequal local batches
STEPS = 2  # the second step also checks optimizer state (momentum, Adam moments)


def optimizer(name, model):
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.Adam(model.parameters(), lr=1e-3)


def rel(a, b):
    a = torch.cat([t.reshape(-1) for t in a]).double()
    b = torch.cat([t.reshape(-1) for t in b]).double()
    return ((a - b).norm() / b.norm()).item()


hvd.init()
train, _, info = data.load("digits", "unused")
x, y = train.tensors
lo, n, total = sum(SIZES[: hvd.rank()]), SIZES[hvd.rank()], sum(SIZES)
results = []
for name, overlap, compression, micro, staged in itertools.product(["sgd", "adam"], [False, True], ["none", "fp16"],
                                                                  [0, 8], [False, True]):
    me = Worker(device=devices.select("cpu"), slowdown=1.0, max_batch=None, micro_batch=micro or None)
    torch.manual_seed(0)
    model = models.build("cnn", info).eval()  # eval: no dropout, the same function everywhere
    ref = copy.deepcopy(model)
    opt, ref_opt = optimizer(name, model), optimizer(name, ref)
    reducer = Reducer(model.parameters(), compression, overlap=overlap, bucket_mb=0.1, stage=staged)
    for step in range(STEPS):
        xb, yb = x[step * total:(step + 1) * total], y[step * total:(step + 1) * total]
        opt.zero_grad(set_to_none=True)
        weight = n / total
        arm = (lambda: reducer.prepare(weight)) if overlap else None
        forward_backward(model, (xb[lo:lo + n], yb[lo:lo + n]), me, arm)
        reducer.reduce(weight)
        ref_opt.zero_grad(set_to_none=True)
        F.cross_entropy(ref(xb), yb).backward()
        grad_err = rel([p.grad for p in model.parameters()], [p.grad for p in ref.parameters()])
        opt.step()
        ref_opt.step()
    results.append({"optimizer": name, "overlap": overlap, "compression": compression, "micro_batch": micro,
                    "staged": staged, "flat_on_device": all(b.staged is not None for b in reducer.buckets),
                    "buckets": len(reducer.buckets),
                    "launched_in_backward": reducer.launched_in_backward, "grad_rel_err": grad_err,
                    "param_rel_err": rel(list(model.parameters()), list(ref.parameters()))})
if hvd.rank() == 0:
    print("EXACTNESS " + json.dumps(results), flush=True)


class Routed(torch.nn.Module):
    """Each sample goes to expert 0 or 1 by the sign of its first feature; expert 2 is never
    chosen (a mixture of experts' expert no sample picked this step)."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(64, 16)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(16, 10) for _ in range(3))

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        route = (x[:, 0] > 0).long()
        return sum(torch.where((route == e)[:, None], self.experts[e](h), 0.0) if bool((route == e).any())
                   else torch.zeros(len(x), 10) for e in (0, 1))


# Every sample of rank 1 goes to expert 0: expert 1 has a gradient on rank 0 alone, expert 2 on
# none, as on one device (None: AdamW's weight decay and step count leave it alone).
gen = torch.Generator().manual_seed(3)
xr, yr = torch.randn(STEPS * total, 64, generator=gen), torch.randint(0, 10, (STEPS * total,), generator=gen)
for step in range(STEPS):
    xr[step * total + SIZES[0]:(step + 1) * total, 0] = -xr[step * total + SIZES[0]:(step + 1) * total, 0].abs()
unused = []
for overlap, compression, staged in [(False, "none", False), (True, "none", False), (False, "fp16", False),
                                     (True, "none", True)]:
    torch.manual_seed(0)
    model = Routed()
    ref = copy.deepcopy(model)
    never = model.experts[2].weight.detach().clone()
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (model, ref))
    reducer = Reducer(model.parameters(), compression, overlap=overlap, bucket_mb=1e-4,  # (a bucket a tensor)
                      stage=staged)
    nones = []
    for step in range(STEPS):
        xb, yb = xr[step * total:(step + 1) * total], yr[step * total:(step + 1) * total]
        opt.zero_grad(set_to_none=True)
        if overlap:
            reducer.prepare(n / total)
        F.cross_entropy(model(xb[lo:lo + n]), yb[lo:lo + n]).backward()
        reducer.reduce(n / total)
        nones.append([p.grad is None for p in model.experts.parameters()])
        ref_opt.zero_grad(set_to_none=True)
        F.cross_entropy(ref(xb), yb).backward()
        opt.step()
        ref_opt.step()
    unused.append({"overlap": overlap, "compression": compression, "staged": staged, "buckets": len(reducer.buckets),
                   "param_rel_err": rel(list(model.parameters()), list(ref.parameters())),
                   "expert_2_kept": torch.equal(model.experts[2].weight, never),
                   "grad_none": hvd.allgather_object(nones),
                   "ref_grad_none": [p.grad is None for p in ref.experts.parameters()]})
if hvd.rank() == 0:
    print("UNUSED " + json.dumps(unused), flush=True)
hvd.shutdown()