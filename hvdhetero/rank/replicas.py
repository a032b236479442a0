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
changes; to 12 significant digits) are compared every step, not only where it shows: a checksum
of each rank's rides along with the step's gradients (`settings_sum`), and where any differs from
rank 0's every rank takes rank 0's before the optimizer steps (`same_settings`); under local/diloco
a checksum rides with each round's counts and the settings are made alike where the round lands
(rank/sync.py). A scheduler stepped on a number each rank
computed alone (ReduceLROnPlateau on its own share's loss, a one-device habit) halved one rank's
learning rate and not the other's; the replicas then drifted apart by more than rounding at every
step, and a settle put them together only to see them drift again.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator

import torch

from hvdhetero.rank import collectives
from hvdhetero.rank.reducer import broadcast_optimizers, broadcast_tensors


class Replicas:
    """The model and optimizer every rank holds a copy of under step sync."""

    def __init__(self, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], device: str,
                 on_differed: Callable[[int, dict[int, str]], None],
                 on_settings: Callable[[int, list[list[dict]]], None] | None = None):
        """`on_differed(step, {rank: device})` hears of each settle that moved anything: the
        ranks whose replica was not rank 0's, and their devices (rank 0's with them);
        `on_settings(step, every rank's settings)` of each step whose optimizer settings differed.
        `optimizers`: the model's (several: a GAN's two, compared and settled alike)."""
        self.model, self.optimizers, self.device, self.on_differed = model, optimizers, device, on_differed
        self.on_settings = on_settings

    def settings_sum(self) -> float:
        """A checksum of this rank's optimizer settings, exact in the float32 a reduction carries."""
        mine = [{key: _rounded(value) for key, value in group.items()} for group in self.settings()]
        return float(zlib.crc32(repr(mine).encode()) & 0xFFFFFF)

    def same_settings(self, sums: list[float], step: int) -> bool:
        """`sums`: every rank's settings_sum, as the step's reduction brought them (the same on
        every rank, so every rank enters the collective below alike, or none does). Where any
        differs from rank 0's, every rank takes rank 0's settings; returns whether any did."""
        if all(s == sums[0] for s in sums):
            return False
        every = collectives.allgather_object(self.settings(), "hvdhetero.replicas.settings",
                                             "comparing the optimizer's settings")
        for group, wanted in zip([g for o in self.optimizers for g in o.param_groups], every[0]):
            for key, value in wanted.items():
                if isinstance(group.get(key), torch.Tensor):  # a tensor lr (capturable, fused): in place
                    group[key].fill_(value)
                elif key in group:
                    group[key] = value
        if self.on_settings is not None:
            self.on_settings(step, every)
        return True

    def settle(self, step: int) -> list[int]:
        """Every rank holds rank 0's parameters and optimizer state after this (a collective);
        returns the ranks that did not before."""
        sums = collectives.allgather_object((checksum(self.model, *self.optimizers), self.device),
                                            "hvdhetero.replicas")
        differed = [r for r, (s, _) in enumerate(sums) if s != sums[0][0]]
        if differed:
            broadcast_tensors(list(self.model.parameters()), 0, "hvdhetero.replicas.params", "settling the replicas")
            broadcast_optimizers(self.optimizers, 0, "hvdhetero.replicas.optimizer", "settling the replicas")
            self.on_differed(step, {r: sums[r][1] for r in [0, *differed]})
        return differed

    def settings(self) -> list[dict]:
        """Every param group's settings, the optimizers' in turn."""
        return [group for optimizer in self.optimizers for group in settings(optimizer)]


class Told:
    """What Replicas found and moved, told: a metrics record each time, rank 0's line the first time."""

    def __init__(self, records, is_main: bool, when: str = "step"):
        """`when`: where the settings are compared ("step", "round's exchange")."""
        self.records, self.is_main, self.when = records, is_main, when
        self.settles = 0
        """How often step sync's replicas differed by rounding and took rank 0's."""
        self.settings_taken = 0
        """How often some rank's optimizer settings were not rank 0's and took them (Replicas.same_settings)."""

    def differed(self, step: int, devices: dict[int, str]) -> None:
        """Replicas.settle gave some ranks rank 0's model: a record each time, a line the first time."""
        self.settles += 1
        self.records.write("settle", step=step, ranks=sorted(devices)[1:], devices=devices)
        if self.is_main and self.settles == 1:
            others = ", ".join(f"rank {r} on {d}" for r, d in devices.items() if r)
            kinds = {d.split()[0].split(":")[0] for d in devices.values()}
            why = ("their devices round the optimizer's arithmetic differently" if len(kinds) > 1 else
                   "ranks on one kind of device compute alike, so the script changed one rank's model or optimizer "
                   "alone (an optimizer other than the one job.prepare returned, stepped on its own?)")
            print(f"hvdhetero: step {step}: the model differed between rank 0 on {devices[0]} and {others}: {why}. "
                  "Every rank now holds rank 0's, as it will at each evaluation and checkpoint (metrics.jsonl: settle "
                  "records)", flush=True)

    def settings(self, step: int, every: list[list[dict]]) -> None:
        """Some rank's optimizer settings were not rank 0's and are now (Replicas.same_settings): a
        record each time, a line the first time."""
        apart = {rank: _differences(mine, every[0]) for rank, mine in enumerate(every) if rank and mine != every[0]}
        self.records.write("settings", step=step, ranks=sorted(apart), differed=apart)
        self.settings_taken += 1
        if self.is_main and self.settings_taken == 1:
            said = "; ".join(f"rank {rank}'s {', '.join(what)}" for rank, what in apart.items())
            print(f"hvdhetero: step {step}: the optimizer's settings differed between the ranks ({said}): a "
                  "scheduler stepped on a number each rank computed alone, as ReduceLROnPlateau on its own loss? "
                  f"Every rank takes rank 0's settings at each {self.when}, so rank 0's numbers decide; step such a "
                  "scheduler on what every rank gets alike (job.evaluate's sums) (metrics.jsonl: settings records)",
                  flush=True)


def _differences(mine: list[dict], main: list[dict]) -> list[str]:
    """`mine`'s settings that are not rank 0's (`main`), as "lr 0.025 (rank 0: 0.05)"."""
    out = []
    for index, (group, theirs) in enumerate(zip(mine, main)):
        where = f" (group {index})" if len(main) > 1 else ""
        out += [f"{key}{where} {group.get(key)!r} (rank 0: {value!r})" for key, value in theirs.items()
                if group.get(key) != value]
    return out or ["param groups"]


STEP_SETTINGS = ("lr", "momentum", "betas", "weight_decay", "eps", "dampening")
"""The param group settings an optimizer's step reads that schedulers change (OneCycleLR and
CyclicLR cycle momentum or betas too). Keys a torch version adds (Adam's decoupled_weight_decay)
or a scheduler keeps for itself (initial_lr) are left out: a Mac pinned to an older torch than the
PC's would differ in them at every step for nothing."""


def settings(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each param group's STEP_SETTINGS, as plain floats (a tensor lr, a numpy scalar: numbers)."""
    return [{key: _plain(group[key]) for key in STEP_SETTINGS if key in group} for group in optimizer.param_groups]


def _plain(value):
    if isinstance(value, (tuple, list)):
        return tuple(_plain(v) for v in value)
    if isinstance(value, bool) or value is None:
        return value
    try:
        return float(value)  # float, int, a one-element tensor, a numpy scalar
    except (TypeError, ValueError, RuntimeError):
        return repr(value)


def _rounded(value):
    """A setting to 12 significant digits: the last bits a schedule's math.cos or pow rounds apart
    on a Mac's libm and a PC's glibc are no difference; a learning rate halved is."""
    if isinstance(value, tuple):
        return tuple(_rounded(v) for v in value)
    return float(f"{value:.12g}") if isinstance(value, float) else value


def checksum(model: torch.nn.Module, *optimizers: torch.optim.Optimizer) -> int:
    """CRC-32 of the bytes of every parameter and every tensor in the optimizers' state, in a
    fixed order: one flipped bit anywhere changes it."""
    crc = 0
    for t in _tensors(model, optimizers):
        crc = zlib.crc32(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy(), crc)
    return crc


def _tensors(model: torch.nn.Module, optimizers: tuple[torch.optim.Optimizer, ...]) -> Iterator[torch.Tensor]:
    yield from model.parameters()
    for optimizer in optimizers:
        state = optimizer.state_dict()["state"]
        for index in sorted(state):
            for key in sorted(state[index]):
                if isinstance(state[index][key], torch.Tensor):
                    yield state[index][key]
