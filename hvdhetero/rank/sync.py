"""Syncing every H steps instead of every step: local SGD and DiLoCo.

With `--sync local:H` or `--sync diloco:H` each rank steps its own optimizer on its own share's
gradient (nothing crosses the link), and every H optimizer steps the ranks' parameters meet in
one allreduce, each rank weighted by the samples it processed in the round, w_i = n_i / sum(n):

    local:H    theta = sum_i w_i theta_i                         (weighted parameter averaging)
    diloco:H   delta = sum_i w_i (theta_start - theta_i)          (the round's pseudo-gradient)
               theta = theta_start after one outer Nesterov SGD step on delta (lr 0.7, momentum 0.9)

local:1 with plain SGD is exactly step sync: sum_i w_i (theta - lr g_i) = theta - lr sum_i w_i g_i.
The inner optimizer's state (momentum, Adam moments) stays each rank's own, as in the papers;
the outer optimizer's state is float32 on the CPU and identical on every rank (same inputs).
Floating-point buffers (BatchNorm statistics) are averaged with the same weights.
"""

from __future__ import annotations

import time

import horovod.torch as hvd
import torch

from hvdhetero.rank.host import one_hot
from hvdhetero.rank.reducer import WIRE_DTYPES, allreduce_sum


class ParameterSync:
    """Counts a rank's steps and samples; every `every` steps, the exchange."""

    def __init__(self, model: torch.nn.Module, kind: str, every: int, compression: str = "none",
                 outer_lr: float = 0.7, outer_momentum: float = 0.9):
        self.kind, self.every = kind, every
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.buffers = [b for b in model.buffers() if b.is_floating_point()]
        self.wire = WIRE_DTYPES[compression]
        self.start = [p.detach().to("cpu", torch.float32, copy=True) for p in self.params]
        self.outer = None
        if kind == "diloco":
            self.outer = torch.optim.SGD(self.start, lr=outer_lr, momentum=outer_momentum, nesterov=True)
        self.steps = self.samples = self.round_steps = 0
        self.seconds = 0.0
        self.rounds = 0
        self.last_exchange_s = 0.0
        """Seconds the last exchange took on this rank (waiting for the slower one included)."""

    def after_step(self, samples: int, seconds: float) -> list[float] | None:
        """Record one optimizer step of this rank; at the round's end exchange and return every
        rank's mean step seconds of the round (for the balancer), else None."""
        self.steps += 1
        self.round_steps += 1
        self.samples += samples
        self.seconds += seconds
        if self.round_steps < self.every:
            return None
        return self.exchange()

    def flush(self) -> list[float] | None:
        """End a partial round (the epoch's end: evaluation and checkpoints see one model)."""
        return self.exchange() if self.round_steps else None

    def exchange(self) -> list[float]:
        """The round's end, on every rank together (a collective)."""
        started = time.perf_counter()
        total, *times = allreduce_sum([float(self.samples), *one_hot(self.seconds / self.round_steps)],
                                      f"hvdhetero.sync.counts.{self.rounds}")
        weight = self.samples / total
        mine = [p.detach().to("cpu", torch.float32) for p in self.params]
        if self.kind == "diloco":
            mine = [s - p for s, p in zip(self.start, mine)]  # this rank's parameter change, reversed
        mine += [b.detach().to("cpu", torch.float32) for b in self.buffers]
        flat = torch.cat([t.reshape(-1) for t in mine]).mul_(weight) if mine else torch.zeros(0)
        wire = flat.to(self.wire)
        # Horovod: one allreduce of every weighted parameter (and buffer) of the round.
        hvd.allreduce_(wire, op=hvd.Sum, name=f"hvdhetero.sync.params.{self.rounds}")
        flat = wire.to(torch.float32)
        chunks = list(flat.split([t.numel() for t in mine]))
        reduced, buffers = chunks[:len(self.params)], chunks[len(self.params):]
        if self.kind == "diloco":
            for start, delta in zip(self.start, reduced):
                start.grad = delta.view_as(start).clone()
            self.outer.step()
            reduced = [s.reshape(-1) for s in self.start]
        with torch.no_grad():
            for p, new in zip(self.params, reduced):
                p.copy_(new.view_as(p))
            for b, new in zip(self.buffers, buffers):
                b.copy_(new.view_as(b))
        if self.kind == "local":
            self.start = [p.detach().to("cpu", torch.float32, copy=True) for p in self.params]
        self.samples, self.seconds, self.round_steps = 0, 0.0, 0
        self.rounds += 1
        self.last_exchange_s = time.perf_counter() - started
        return times
