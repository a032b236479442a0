"""Step sync's replicas made one again where it shows: before an evaluation, a checkpoint and the
run's end (job.save writes rank 0's model, which a settle would give every rank: it needs none).

Under --sync step every rank applies the same reduced gradient (the same bytes everywhere) with
its own optimizer on its own device. Ranks on one kind of device compute the same update, bit
for bit. Across kinds they need not: a CUDA kernel may fuse a multiply and an add that the CPU
rounds twice, Metal (MPS) compiles with fast math, PyTorch's CPU and CUDA addcdiv (Adam's last
operation) divide and multiply in different orders. The replicas then drift apart by rounding,
a last bit here and there each step: harmless to training (the gradients are shared, nothing
amplifies it), but the run's end would record different models, a checkpoint would hold rank
0's where rank 1 trained on its own, and a resume would not be bit-exact.

`Replicas.settle` compares a checksum of every rank's parameters and optimizer state and, where
any differs from rank 0's, gives every rank rank 0's (parameters through one CPU broadcast,
optimizer state as an object, each rank keeping its own param_groups: their device switches).
Ranks that agree exchange a checksum each and move nothing. Elastic commits (--elastic) are not
settled: after a reset each survivor goes on from its own, apart by rounding until the next
evaluation or checkpoint settles them.
Buffers are not compared: BatchNorm's statistics are per rank by design and averaged after
(reducer.average_buffers).

The optimizer's settings (each param group's lr, momentum, betas, weight decay: what a scheduler
changes) are compared every step, not only where it shows: a checksum of each rank's rides along
with the step's gradients (`settings_sum`), and where any differs from rank 0's every rank takes
rank 0's before the optimizer steps (`same_settings`). A scheduler stepped on a number each rank
computed alone (ReduceLROnPlateau on its own share's loss, a one-device habit) halved one rank's
learning rate and not the other's; the replicas then drifted apart by more than rounding at every
step, and a settle put them together only to see them drift again.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator

import torch

from hvdhetero.rank import collectives
from hvdhetero.rank.reducer import broadcast_optimizer_state, broadcast_tensors


class Replicas:
    """The model and optimizer every rank holds a copy of under step sync."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: str,
                 on_differed: Callable[[int, dict[int, str]], None],
                 on_settings: Callable[[int, list[list[dict]]], None] | None = None):
        """`on_differed(step, {rank: device})` hears of each settle that moved anything: the
        ranks whose replica was not rank 0's, and their devices (rank 0's with them);
        `on_settings(step, every rank's settings)` of each step whose optimizer settings differed."""
        self.model, self.optimizer, self.device, self.on_differed = model, optimizer, device, on_differed
        self.on_settings = on_settings

    def settings_sum(self) -> float:
        """A checksum of this rank's optimizer settings, exact in the float32 a reduction carries."""
        return float(zlib.crc32(repr(settings(self.optimizer)).encode()) & 0xFFFFFF)

    def same_settings(self, sums: list[float], step: int) -> bool:
        """`sums`: every rank's settings_sum, as the step's reduction brought them (the same on
        every rank, so every rank enters the collective below alike, or none does). Where any
        differs from rank 0's, every rank takes rank 0's settings; returns whether any did."""
        if all(s == sums[0] for s in sums):
            return False
        every = collectives.allgather_object(settings(self.optimizer), "hvdhetero.replicas.settings",
                                             "comparing the optimizer's settings")
        for group, wanted in zip(self.optimizer.param_groups, every[0]):
            for key, value in wanted.items():
                if isinstance(group.get(key), torch.Tensor):  # a tensor lr (capturable, fused): in place
                    group[key].fill_(value)
                else:
                    group[key] = value
        if self.on_settings is not None:
            self.on_settings(step, every)
        return True

    def settle(self, step: int) -> list[int]:
        """Every rank holds rank 0's parameters and optimizer state after this (a collective);
        returns the ranks that did not before."""
        sums = collectives.allgather_object((checksum(self.model, self.optimizer), self.device), "hvdhetero.replicas")
        differed = [r for r, (s, _) in enumerate(sums) if s != sums[0][0]]
        if differed:
            broadcast_tensors(list(self.model.parameters()), 0, "hvdhetero.replicas.params", "settling the replicas")
            broadcast_optimizer_state(self.optimizer, 0, "hvdhetero.replicas.optimizer", "settling the replicas")
            self.on_differed(step, {r: sums[r][1] for r in [0, *differed]})
        return differed


DEVICE_SWITCHES = frozenset({"params", "foreach", "fused", "capturable", "differentiable"})
"""What of a param group is each rank's own: its parameters, and how its device runs the step."""


def settings(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each param group's settings (lr, momentum, betas, weight_decay, a scheduler's initial_lr)
    as plain values, but for DEVICE_SWITCHES."""
    def plain(value):
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            return float(value)
        return value

    return [{key: plain(value) for key, value in sorted(group.items()) if key not in DEVICE_SWITCHES}
            for group in optimizer.param_groups]


def checksum(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """CRC-32 of the bytes of every parameter and every tensor in the optimizer's state, in a
    fixed order: one flipped bit anywhere changes it."""
    crc = 0
    for t in _tensors(model, optimizer):
        crc = zlib.crc32(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy(), crc)
    return crc


def _tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    yield from model.parameters()
    state = optimizer.state_dict()["state"]
    for index in sorted(state):
        for key in sorted(state[index]):
            if isinstance(state[index][key], torch.Tensor):
                yield state[index][key]
