"""The optimizer `job.prepare` returns: the user's, stepping once per global step.

It shares the user's param_groups and state (an LR scheduler built on either one schedules
both) and is a torch.optim.Optimizer, so schedulers accept it. Between the micro-batches of a
step `step()` and `zero_grad()` do nothing (gradients are still accumulating), and a step whose
reduced gradients overflowed under fp16 loss scaling is skipped on every rank alike.

The user's own optimizer object steps the same way (`route`): a script that goes on stepping
the optimizer it passed to job.prepare (`model, _, loader = job.prepare(model, optimizer, ...)`)
would otherwise update between micro-batches on a partial gradient, never count a step (no
checkpoint would come due, no local/diloco round end, so the ranks drift apart) and step
through an fp16 overflow. A GradScaler of the script's own is rank/scaler.py's.

A closure (`optimizer.step(closure)`: LBFGS's, which calls it up to max_iter times a step) is
evaluated once before the step is decided (its job.backward reduces the step's gradients), and
each evaluation returns the loss averaged over every rank (`mean_loss`): under step sync every
rank's optimizer then sees the same loss and gradients. Each evaluation is a collective; the
later ones belong to the step already counted (StepState.reevaluating), and ranks whose own
decisions went apart (LBFGS's sums rounded apart on their devices) end the job, saying so.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch

from hvdhetero.rank import collectives
from hvdhetero.rank.step_state import StepState


class JobOptimizer(torch.optim.Optimizer):
    """Wraps `optimizer`: `step` asks `before_step` whether to update and calls `after_step`
    after; everything else is the wrapped optimizer's."""

    def __init__(self, optimizer: torch.optim.Optimizer, state: StepState, before_step: Callable[[], bool],
                 after_step: Callable[[], None], mean_loss: Callable = lambda loss: loss,
                 flush: Callable[[], None] = lambda: None):  # noqa: D107 - shares state
        self.optimizer, self.step_state = optimizer, state
        self.before_step, self.after_step = before_step, after_step
        """Hooks: whether to update (not after an overflow), and what follows an update or a skip."""
        self.flush = flush
        """Reduce what a script's own accumulation left pending (a GradScaler's unscale_ reads it: rank/deferral.py)."""
        self.mean_loss = mean_loss
        """A closure's loss as every rank's optimizer must see it (step sync: the mean over the ranks)."""
        self.calls = 0
        """How often step() was called (a GradScaler that skips a step does not call it)."""
        self._optimizer_step_pre_hooks = optimizer._optimizer_step_pre_hooks
        self._optimizer_step_post_hooks = optimizer._optimizer_step_post_hooks
        # The optimizer's own (with an LR scheduler's counting wrapper when one was built on it),
        # taken once: an optimizer prepared again (the script re-run after an elastic reset, its
        # optimizer made in a module that lives on) must not step through the old job's.
        self._update, self._zero = optimizer.__dict__.setdefault(OWN, (optimizer.step, optimizer.zero_grad))
        route(optimizer, self)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults

    def step(self, *args, **kwargs):
        self.calls += 1
        closure = None  # optimizer.step(closure) or step(closure=...); another optimizer's own arguments pass on
        if "closure" in kwargs:
            closure = kwargs.pop("closure")
        elif args and callable(args[0]):
            closure, args = args[0], args[1:]
        if self.step_state.accumulating:
            if closure is not None:
                raise _between_chunks()
            return None
        first = evaluations = None
        if closure is not None:
            self.step_state.evaluations = 0
            with torch.enable_grad():
                loss = closure()  # its job.backward reduces the step's gradients
            if self.step_state.accumulating:  # a chunk of a step in micro-batches: no step to decide yet
                raise _between_chunks()
            first = self.mean_loss(loss)
            evaluations = _evaluations(closure, first, self.mean_loss, self.step_state)
        out = None
        if self.before_step():
            out = self._update(*args, **kwargs) if closure is None else self._update(evaluations, *args, **kwargs)
        self.after_step()
        return first if closure is not None and out is None else out

    def skipped(self) -> None:
        """A GradScaler of the script's own found an inf or NaN and left step() out: the step
        counts, not taken (as every rank's does under step sync; local/diloco rounds stay aligned)."""
        self.before_step()
        self.after_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not self.step_state.accumulating:
            self._zero(set_to_none=set_to_none)

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group) -> None:
        self.optimizer.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"JobOptimizer({self.optimizer!r})"


def _evaluations(closure: Callable, first, mean_loss: Callable, state: StepState) -> Callable:
    """The closure the optimizer gets: its first call returns `first` (the evaluation the step was
    decided on), each later one evaluates again (its job.backward reduces, within the step already
    counted), the loss as every rank sees it."""
    given = [first]

    def evaluate():
        if given:
            return given.pop()
        state.reevaluating = True
        try:
            loss = closure()
        finally:
            state.reevaluating = False
        return mean_loss(loss)
    return evaluate


def mean_over_ranks(loss, state: StepState, step_sync: bool):
    """A closure's loss (`optimizer.step(closure)`), under step sync the mean over every rank's
    share of the step (a collective: every rank's LBFGS decides on the same numbers); under
    local/diloco this rank's own, as its optimizer steps on its own gradients. The ranks'
    evaluations must pair up: each carries its step and its number in the step, and a rank
    that took one more than another (its optimizer's own sums rounded apart on its device)
    ends the job, saying so, rather than pairing it with another step's."""
    item = state.item
    state.evaluations += 1
    if loss is None or not step_sync or item is None or len(item.sizes) < 2:
        return loss
    weight = item.share / sum(item.sizes)
    value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
    where = [float(item.step), float(state.evaluations)]
    got = collectives.allreduce_sum([value * weight if weight else 0.0, *where, *(w * w for w in where)],
                                    "hvdhetero.closure_loss")
    n = len(item.sizes)
    if any(abs(got[3 + i] * n - got[1 + i] ** 2) > 0.5 for i in range(2)):  # not every rank's the same
        raise RuntimeError(f"optimizer.step(closure): the ranks evaluated the closure a different number of times in "
                           f"step {item.step} (this rank: evaluation {state.evaluations}): their optimizer's own "
                           "decisions (LBFGS's tolerances, line search) went apart on sums their devices round "
                           "differently; train it on ranks of one kind of device, or with --sync local:H, where each "
                           "rank's optimizer steps on its own")
    return torch.tensor(got[0], dtype=loss.dtype) if isinstance(loss, torch.Tensor) else got[0]


def _between_chunks() -> RuntimeError:
    return RuntimeError("optimizer.step(closure) in a step of micro-batches: the closure evaluates the chunk in "
                        "hand, not the step's batch, and the optimizer would decide on part of it; train with "
                        "--micro-batch 0 (each rank's share in one piece)")


OWN = "_hvdhetero_own_methods"
"""The attribute on the user's optimizer holding its own (step, zero_grad) from before route()."""
PREPARED = "_hvdhetero_prepared"
"""The attribute on the user's optimizer holding the JobOptimizer that route() sent it to."""


def prepared_of(optimizer) -> JobOptimizer | None:
    """The JobOptimizer behind `optimizer` (itself, or the user's own object job.prepare took), else None."""
    if isinstance(optimizer, JobOptimizer):
        return optimizer
    return getattr(optimizer, "__dict__", {}).get(PREPARED)


def route(optimizer: torch.optim.Optimizer, prepared: JobOptimizer) -> None:
    """`optimizer.step()` and `optimizer.zero_grad()` of the user's own object do what the
    prepared optimizer's do (bound methods on the instance: an LR scheduler built on it after
    job.prepare wraps them as it wraps any optimizer's step)."""
    def step(self, *args, **kwargs):  # a closure, or an optimizer's own arguments (GradScaler passes them on)
        return prepared.step(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        prepared.zero_grad(set_to_none)

    if hasattr(optimizer.__dict__[OWN][0], "_wrapped_by_lr_sched"):  # a scheduler built on it before job.prepare
        step._wrapped_by_lr_sched = True  # (it warns when the step it wrapped is gone)
    optimizer.__dict__[PREPARED] = prepared
    optimizer.step = types.MethodType(step, optimizer)
    optimizer.zero_grad = types.MethodType(zero_grad, optimizer)
