"""An LR scheduler on the job's optimizer steps once a global step, passed to job.prepare or not.

A one-device script steps its per-batch scheduler (OneCycleLR, a warm-up LambdaLR, Hugging
Face's linear schedule) after `optimizer.step()` in the loop body. With micro-batches the loop
body runs once a chunk: the scheduler ran k times a step, torch warned that it stepped before
the optimizer, and a OneCycleLR ended the job with "Tried to step 41 times". So every scheduler
built on the prepared optimizer (or on the script's own object job.prepare took) steps as the
prepared `scheduler=` does (step_state.OncePerStep): nothing between a step's chunks, and a
merged step's count of steps. Nothing is set on the scheduler itself: torch's state_dict() holds
every attribute it has, and a script saves it (a `step` of ours in it made the script's own
checkpoint fail to load with weights_only=True). One the checkpoints do not hold (not `scheduler=`, not
`job.track`ed) is said once: a --resume would start its schedule over.

Replaced on torch's LRScheduler class (and its subclasses' own steps) by job.prepare, before it
wraps a `scheduler=`; a scheduler on another optimizer, torch's first step in a scheduler's
__init__, the schedulers a SequentialLR or ChainedScheduler steps, and any stepped without a
prepared job are torch's. A `scheduler=` of another kind (timm's, a class of the script's own)
steps once a step by its class too, for that object alone: timm's state_dict() is its __dict__,
and a `step` of ours there failed the script's own checkpoint as torch's had. Only one whose step
is an attribute of the object itself (no class to put it on) is wrapped there.
"""

from __future__ import annotations

import functools
import inspect

import torch

from hvdhetero.rank import current
from hvdhetero.rank.optimizer import prepared_of
from hvdhetero.rank.step_state import OncePerStep, StepState


class _Job:
    """The prepared job's place inside its step, and the schedulers its checkpoints hold."""

    state: StepState | None = None
    saved: set[int] = set()
    said: set[int] = set()
    nested = 0
    """Inside torch's step of a scheduler: the schedulers it steps are torch's (SequentialLR's)."""
    seen: dict[int, int] = {}
    """Per scheduler (by id): the optimizer steps it had seen at its last step (OncePerStep.seen)."""
    given: set[int] = set()
    """`scheduler=`s of another kind than torch's (by id): their class's step is ours for them."""
    wrapped: list = []
    """(object, its step, an attribute of its own?) for the schedulers wrapped on the object: put back at release."""


def take_over(state: StepState, saved: list, given: list = ()) -> None:
    """job.prepare: schedulers on its optimizer step once a step from now on; `saved`: the
    objects its checkpoints hold (the prepared scheduler, job.track's); `given`: the `scheduler=`s,
    of whatever kind."""
    install()
    _Job.state, _Job.saved, _Job.seen = state, {id(obj) for obj in saved if obj is not None}, {}
    _Job.given = set()
    for scheduler in given:
        if isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
            continue
        if "step" not in vars(scheduler) and _adopt(type(scheduler)):
            _Job.given.add(id(scheduler))
        else:  # a step of the object's own, or one no class can take: wrapped on the object
            own = scheduler.step.wrapped if isinstance(scheduler.step, OncePerStep) else scheduler.step
            _Job.wrapped.append((scheduler, own, "step" in vars(scheduler)))
            scheduler.step = OncePerStep(own, state)


def release() -> None:
    """The job is over (an elastic reset drops it): every scheduler is torch's (or its own) again."""
    for scheduler, own, attribute in _Job.wrapped:
        if attribute:
            scheduler.step = own
        else:  # its class's again
            del scheduler.step
    _Job.state, _Job.saved, _Job.seen, _Job.given, _Job.wrapped = None, set(), {}, set(), []


def _adopt(cls: type) -> bool:
    """Put a once-a-step step on `cls` (another kind than torch's) for the given schedulers of it;
    False where its step is no plain function (a staticmethod, a classmethod, a callable object:
    the object is wrapped instead) or the class takes no attribute (a C type)."""
    own = inspect.getattr_static(cls, "step", None)
    if getattr(own, "_hvdhetero_given", None) is not None:
        return True
    if not inspect.isfunction(own):
        return False

    @functools.wraps(own)
    def step(self, *args, **kwargs):
        state = _Job.state
        if state is None or id(self) not in _Job.given:
            return own(self, *args, **kwargs)
        return _once(own, self, state, args, kwargs)

    step._hvdhetero_given = own
    try:
        cls.step = step
    except (TypeError, AttributeError):
        return False
    return True


def install() -> None:
    """Replace torch's LRScheduler.step, and the step of each of its subclasses that has its own
    (SequentialLR, ChainedScheduler, CosineAnnealingWarmRestarts, ReduceLROnPlateau; once a process)."""
    base = torch.optim.lr_scheduler.LRScheduler
    for cls in (base, *_subclasses(base)):
        own = cls.__dict__.get("step")
        if own is not None and getattr(own, "_hvdhetero_torch", None) is None:
            cls.step = _once_a_step(own)


def _once_a_step(torchs):
    """`torchs` (a scheduler class's own step) as every scheduler on the job's optimizer steps."""
    def step(self, *args, **kwargs):
        state = _Job.state
        if (_Job.nested or state is None or getattr(self, "_is_initial", False)  # torch's first step, in __init__
                or prepared_of(getattr(self, "optimizer", None)) is None):
            return _torchs(torchs, self, args, kwargs)
        if id(self) not in _Job.saved | _Job.said:
            _Job.said.add(id(self))
            if current.job is None or current.job.is_main:
                print(f"hvdhetero: the {type(self).__name__} on {_whose(self.optimizer)} is in no checkpoint: pass "
                      "it as job.prepare(..., scheduler=) (or job.track it) so that --resume goes on with its "
                      "schedule; it steps as it does now, where your script steps it", flush=True)
        return _once(torchs, self, state, args, kwargs)

    step.__doc__ = torchs.__doc__
    step._hvdhetero_torch = torchs
    return step


def _whose(optimizer) -> str:
    """The job's optimizer a scheduler steps, in words: which one where job.prepare took several
    (a seq2seq's encoder and decoder optimizers each with its scheduler said the same line twice)."""
    prepared = prepared_of(optimizer)
    training = getattr(current.job, "training", None)
    several = getattr(training, "optimizers", None) or []
    if len(several) < 2 or prepared not in several:
        return "the job's optimizer"
    place = several.index(prepared)
    return f"the job's optimizer {place + 1} of {len(several)} ({type(prepared.optimizer).__name__})"


def _once(own, scheduler, state: StepState, args, kwargs):
    """`scheduler`'s step `own` once a global step (OncePerStep), the optimizer steps it had seen at
    its last step kept here, not on the scheduler: its state_dict() may hold every attribute it has."""
    once = OncePerStep(lambda *a, **k: _torchs(own, scheduler, a, k), state)
    once.seen = _Job.seen.get(id(scheduler), 0)
    try:
        return once(*args, **kwargs)
    finally:
        _Job.seen[id(scheduler)] = once.seen


def _torchs(own, scheduler, args, kwargs):
    """A scheduler class's own step; the torch schedulers it steps in turn (SequentialLR's,
    ChainedScheduler's, a wrapper of the script's around one) are torch's."""
    _Job.nested += 1
    try:
        return own(scheduler, *args, **kwargs)
    finally:
        _Job.nested -= 1


def _subclasses(cls) -> list[type]:
    found = []
    for sub in cls.__subclasses__():
        found += [sub, *_subclasses(sub)]
    return found
