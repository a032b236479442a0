"""Gradient reduction on the CPU through Horovod/Gloo, for MPS, CUDA and CPU ranks alike.

Every gradient is copied into one fused CPU buffer (one allreduce per step instead of one per
tensor), scaled by this rank's weight w_i = n_i / sum(n) (its share of the step's samples),
summed across ranks with `op=Sum`, and copied back to the device. Per-rank weights cannot go
through Horovod's `prescale_factor` (it rejects factors that differ across ranks), hence the
local scaling. Copies between device and CPU are blocking: non_blocking MPS<->CPU copies have
returned wrong data in other projects.

Our Horovod is a CPU-only build, so every tensor handed to it here is a CPU tensor; that is
also why parameters are broadcast through CPU copies rather than `hvd.broadcast_parameters`.
"""

from __future__ import annotations

from collections.abc import Iterable

import horovod.torch as hvd
import torch

WIRE_DTYPES = {"none": torch.float32, "fp16": torch.float16}


class Reducer:
    """Weighted allreduce of all gradients of `params` in one fused CPU buffer."""

    def __init__(self, params: Iterable[torch.nn.Parameter], compression: str = "none"):
        if compression not in WIRE_DTYPES:
            raise ValueError(f"compression must be one of {sorted(WIRE_DTYPES)}, got {compression!r}")
        self.params = [p for p in params if p.requires_grad]
        self.sizes = [p.numel() for p in self.params]
        self.buffer = torch.zeros(sum(self.sizes), dtype=torch.float32)
        self.wire = (None if compression == "none"
                     else torch.zeros_like(self.buffer, dtype=WIRE_DTYPES[compression]))
        self.steps = 0

    def reduce(self, weight: float) -> None:
        """Replace each .grad with sum over ranks of weight_i * grad_i (in place, same device)."""
        chunks = self.buffer.split(self.sizes)
        for p, chunk in zip(self.params, chunks):
            if p.grad is None:
                chunk.zero_()  # e.g. a rank that had no samples this step: contributes nothing
            else:
                chunk.copy_(p.grad.detach().reshape(-1))
        self.buffer.mul_(weight)
        # Horovod: one named allreduce of the fused buffer; names must match across ranks.
        if self.wire is None:
            hvd.allreduce_(self.buffer, op=hvd.Sum, name="hvdhetero.grads")
        else:
            self.wire.copy_(self.buffer)
            hvd.allreduce_(self.wire, op=hvd.Sum, name="hvdhetero.grads")
            self.buffer.copy_(self.wire)
        for p, chunk in zip(self.params, chunks):
            if p.grad is None:
                p.grad = torch.empty_like(p)
            p.grad.copy_(chunk.view_as(p))
        self.steps += 1


def broadcast_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    root_rank: int = 0) -> None:
    """Make every rank start from rank 0's parameters, buffers and optimizer state."""
    tensors = list(model.state_dict().values())
    if tensors:
        flat = torch.cat([t.detach().cpu().to(torch.float64).reshape(-1) for t in tensors])
        # Horovod: one broadcast of every parameter and buffer, as float64 so that integer
        # buffers (BatchNorm's counters) and float32 values both survive exactly.
        hvd.broadcast_(flat, root_rank=root_rank, name="hvdhetero.state")
        for t, chunk in zip(tensors, flat.split([t.numel() for t in tensors])):
            t.copy_(chunk.view_as(t).to(t.dtype))
    if optimizer is not None:
        # Optimizer state may be empty (fresh start) or hold tensors on rank 0's device, which
        # another rank may not have (cuda vs mps): move it to the CPU before pickling;
        # load_state_dict moves it onto each rank's own parameters' device.
        state = _to_cpu(optimizer.state_dict()) if hvd.rank() == root_rank else None
        # Horovod: broadcast_object pickles through a CPU byte tensor.
        optimizer.load_state_dict(hvd.broadcast_object(state, root_rank=root_rank,
                                                       name="hvdhetero.optimizer"))


def average_buffers(model: torch.nn.Module) -> None:
    """Average floating-point buffers (BatchNorm running statistics) across ranks, so that
    evaluation and the checkpoint see one model; parameters are already identical."""
    buffers = [b for b in model.buffers() if b.is_floating_point()]
    if not buffers:
        return
    flat = torch.cat([b.detach().cpu().to(torch.float64).reshape(-1) for b in buffers])
    # Horovod: one allreduce for every buffer; the result is bit-identical on every rank.
    hvd.allreduce_(flat, op=hvd.Average, name="hvdhetero.buffers")
    for b, chunk in zip(buffers, flat.split([b.numel() for b in buffers])):
        b.copy_(chunk.view_as(b).to(b.dtype))


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def allreduce_sum(values: list[float], name: str) -> list[float]:
    """Sum small lists of numbers across ranks (metrics, sample counts), in float64."""
    t = torch.tensor(values, dtype=torch.float64)
    hvd.allreduce_(t, op=hvd.Sum, name=name)
    return t.tolist()
