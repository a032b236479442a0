"""How the ranks' models stay one model: a sync strategy, one class per `--sync` mode.

    EveryStep   --sync step: each step's gradients reduced across ranks (weighted, exact) before
                the optimizer steps; the ranks hold one model all the time (ranks on different
                kinds of device up to rounding, settled where it shows: rank/replicas.py)
    Rounds      --sync local:H / diloco:H: each rank steps on its own gradient, and every H
                global steps the parameters are exchanged (rank/sync.py), overlapped or not

The Job calls the same places whatever the mode: `before_last_backward` and `reduce` around a
step's last backward, `after_step` once the optimizer stepped, `one_model` before an evaluation
or a save, `global_model` for an evaluation without an exchange, `clip` for
job.clip_grad_norm_, `end_epoch`, and `state_dict`/`load_state_dict` in checkpoints and elastic
commits. What a round's end means for the metrics and the balancer is the Job's: a strategy
hands each exchange to its `on_exchange(sync, landed, after_step, count)`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from hvdhetero.rank.host import one_hot
from hvdhetero.rank.reducer import Reducer, scale_gradients
from hvdhetero.rank.replicas import Replicas
from hvdhetero.rank.sync import ParameterSync


class Reduced(NamedTuple):
    """A step's gradients after `reduce`."""

    times: list[float] | None
    """Every rank's step seconds (they ride along with the gradients under step sync), else None."""
    seconds: float
    """Seconds the reduction took on this rank (waiting for the others included)."""
    overflowed: bool
    """Whether the gradients hold an inf or NaN (fp16 loss scaling skips the step)."""
    walls: list[float] | None = None
    """Every rank's previous step, wall seconds from its start to this one's (0: none yet), alike
    on every rank as `times` is: what a step of the job takes, all included (step sync)."""


class EveryStep:
    """--sync step: the weighted exact reduction of every gradient, every step."""

    kind, every, overlap = "step", 1, False
    rounds, last_exchange_s = 0, 0.0
    always_one_model = True
    """The ranks' models never differ but by rounding (`one_model`): no exchange before an
    evaluation or a save."""
    own_optimizers = False
    """Every rank's optimizer state is the same (a checkpoint keeps rank 0's)."""
    between_rounds = True
    """An elastic commit may be taken at any step."""
    unsettled = False

    def __init__(self, reducer: Reducer | None, overlap: bool, replicas: Replicas | None = None):
        self.reducer, self.overlap_reduce, self.replicas = reducer, overlap, replicas

    @property
    def name(self) -> str:
        return "step"

    def before_last_backward(self, weight: float, unscale: float = 1.0, common: bool = False) -> None:
        """The step's last backward is next: overlapped, its gradients are reduced as they come."""
        if self.overlap_reduce:
            self.reducer.prepare(self._on_wire(weight, unscale, common)[0])

    def _on_wire(self, weight: float, unscale: float, common: bool) -> tuple[float, float]:
        """(before, after) the sum: the loss scale's inverse `unscale` goes after it where every
        rank's scale is the same (`common`: the job's own) and the wire is fp16, so the scaled
        gradients cross it (as DDP's fp16 hook gets AMP's scaled ones): unscaled first, the small
        ones (under 6e-8, and under 6e-5 with fewer bits) flushed to zero there. Else before."""
        if common and unscale != 1.0 and self.reducer.wire_dtype != torch.float32:
            return weight, unscale
        return weight * unscale, 1.0

    def reduce(self, weight: float, unscale: float, seconds: float, check_overflow: bool, step: int = 0,
               common: bool = False, wall: float = 0.0) -> Reduced:
        """Every gradient reduced, weighted by `weight` (this rank's share of the global batch)
        times `unscale` (the loss scale's inverse; `common`: every rank's the same, see _on_wire);
        this rank's step `seconds` and its previous step's `wall` seconds ride along, so every rank
        gets every rank's, and so does a checksum of its optimizer's settings, made rank 0's on
        every rank where they differ (global `step`: the one about to be taken)."""
        started = time.perf_counter()
        settings = [] if self.replicas is None else one_hot(self.replicas.settings_sum())
        before, after = self._on_wire(weight, unscale, common)
        mine = one_hot(seconds) + one_hot(wall)
        extras = self.reducer.reduce(before, extras=mine + settings, after=after)
        n = len(mine) // 2
        times, walls, sums = extras[:n], extras[n:2 * n], extras[2 * n:]
        if sums:  # the optimizer's settings alike on every rank before it steps (rank/replicas.py)
            self.replicas.same_settings(sums, step)
        took = time.perf_counter() - started
        return Reduced(times, took, check_overflow and self.reducer.overflowed(), walls)  # a pass over every gradient

    def clip(self, max_norm: float, norm_type: float) -> torch.Tensor:
        """Clip the reduced gradients identically on every rank (the norm of the reduced CPU
        buffers, the same bytes everywhere); the norm before clipping."""
        total = self.reducer.grad_norm(norm_type)
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            scale_gradients(self.reducer.params, coef)
            self.reducer.clipped(coef)  # a second clip of the step (torch's kept beside ours) finds it clipped
        return torch.tensor(total)

    def after_step(self, share: int, seconds: float, steps: int, step: int, item_step: int,
                   epoch_left: int | None) -> bool:
        """The optimizer stepped: every step is a round's end (a checkpoint may be taken)."""
        return True

    def merge(self, step: int, left: int, share: int, largest: int, in_epochs: bool, cap: int | None) -> int:
        return 1

    def one_model(self, step: int) -> None:
        """The ranks hold one model already, but for what their devices' arithmetic rounded
        differently: settled now (rank/replicas.py; ranks that agree move nothing)."""
        if self.replicas is not None:
            self.replicas.settle(step)

    def end_epoch(self, step: int, more_epochs: bool) -> float:
        return 0.0

    def global_model(self):
        return contextlib.nullcontext()

    def pause(self) -> None:
        pass

    def land(self) -> None:
        pass

    def restart(self, step: int) -> None:
        pass

    def exchanged_names(self, model: torch.nn.Module) -> dict[str, int]:
        return {}

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, state: Any) -> None:
        pass


class Rounds:
    """--sync local:H / diloco:H: a rank steps on its own (unscaled) gradient and skips alone;
    its rounds end where the round clock says (policy/round_clock.py), where `sync` exchanges."""

    always_one_model = False
    own_optimizers = True
    """Each rank's inner optimizer state is its own (a checkpoint keeps every rank's)."""

    def __init__(self, sync: ParameterSync, on_exchange: Callable[..., None]):
        self.sync, self.on_exchange = sync, on_exchange
        self.kind, self.every, self.overlap = sync.kind, sync.every, sync.overlap

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.every}"

    @property
    def rounds(self) -> int:
        return self.sync.rounds

    @property
    def last_exchange_s(self) -> float:
        return self.sync.last_exchange_s

    @property
    def between_rounds(self) -> bool:
        """Whether no round is in progress (every rank at the same step, none of its round
        unexchanged): where an elastic commit may be taken (rank/elastic.py)."""
        return self.sync.clock.steps == 0

    @property
    def unsettled(self) -> bool:
        """Whether the ranks' models may differ: a partial round, or a round still in flight."""
        return self.sync.unsettled

    def before_last_backward(self, weight: float, unscale: float = 1.0, common: bool = False) -> None:
        pass

    def reduce(self, weight: float, unscale: float, seconds: float, check_overflow: bool, step: int = 0,
               common: bool = False, wall: float = 0.0) -> Reduced:
        """Nothing crosses the link: this rank's own gradients, multiplied by `unscale` (the
        loss scale's inverse), checked for overflow on their own."""
        scale_gradients(self.sync.params, unscale)
        grads = [q.grad._values() if q.grad.is_sparse else q.grad for q in self.sync.params if q.grad is not None]
        return Reduced(None, 0.0, check_overflow and not all(bool(torch.isfinite(g).all()) for g in grads))

    def clip(self, max_norm: float, norm_type: float) -> torch.Tensor:
        """Each rank's own gradient, clipped on its own (by torch's own function: torch.nn.utils'
        is rank/clipping.py's, which calls this)."""
        return torch.nn.utils.clip_grad.clip_grad_norm_(self.sync.params, max_norm, norm_type)

    def after_step(self, share: int, seconds: float, steps: int, step: int, item_step: int,
                   epoch_left: int | None) -> bool:
        """The prepared optimizer stepped (or skipped) over `steps` global steps, now at global
        `step`: count it and, at a round's end, exchange and feed the balancer the round's
        times. Whether a round ended."""
        landed = self.sync.after_step(share, seconds, steps, epoch_left=epoch_left)
        if self.sync.round_steps:
            return False
        self._exchanged(landed, step, after_step=item_step)
        return True

    def merge(self, step: int, left: int, share: int, largest: int, in_epochs: bool, cap: int | None) -> int:
        """--inner-steps by-speed: how many global steps from `step` this rank takes as one
        optimizer step (`RoundClock.merge`: about the largest share's batch, never past the
        round's end, so that every rank's merged step ends where the round does)."""
        return self.sync.clock.merge(step, left, share, largest, in_epochs, cap)

    def one_model(self, step: int) -> None:
        """Exchange the partial round (and the one in flight) now, so that what is evaluated or
        saved is one model on every rank. Only there: a flush at every epoch's end cost one
        exposed exchange an epoch (10-20% at the emulated Wi-Fi ratio with 96-step epochs)."""
        if self.sync.unsettled:
            # A new split from what a flush lands takes effect after the round that starts now:
            # merged steps up to its end may be drawn already (the checkpoint taken at a step's
            # start flushes after the step's indices were drawn).
            self._exchanged(self.sync.flush(), step, after_step=step + self.every - 1)
        self.sync.pause_clock()  # what follows (an evaluation, a save) is not a step's work

    def end_epoch(self, step: int, more_epochs: bool) -> float:
        """Overlapped, after the epoch's record: a round of H steps or more ends with the epoch and
        its exchange is launched (a shorter one runs on into the next epoch; the last epoch's
        lands in the run's end). Returns the seconds it blocked this rank (the round before it
        landing), which the next epoch counts as communication."""
        if not self.sync.clock.ends_with_epoch(more_epochs):
            return 0.0
        self._exchanged(self.sync.exchange(), step, after_step=step, count=False)
        return self.sync.last_exchange_s

    def global_model(self):
        """The global model as of the last round that landed, lent for a block (rank/sync.py)."""
        self.sync.pause_clock()  # an evaluation is not a step's work
        return self.sync.global_model()

    def pause(self) -> None:
        self.sync.pause_clock()

    def land(self) -> None:
        """The script returned with a round's exchange in flight (overlapped): it lands before
        this rank leaves. Every rank launched it; one that left Horovod first failed the others'
        (a rank 0 that evaluated alone was still on its way to it)."""
        self.sync.land()

    def restart(self, step: int) -> None:
        """The rounds start again at global `step` (a resume, an elastic rejoin)."""
        self.sync.clock.restart(step)

    def exchanged_names(self, model: torch.nn.Module) -> dict[str, int]:
        return self.sync.exchanged_names(model)

    def state_dict(self) -> dict:
        return self.sync.state_dict()

    def load_state_dict(self, state: dict | None) -> None:
        if state is not None:
            self.sync.load_state_dict(state)

    def _exchanged(self, landed, step: int, after_step: int, count: bool = True) -> None:
        self.sync.clock.restart(step)  # a round ended or was flushed: the next one starts here
        self.on_exchange(self.sync, landed, after_step, count)
