"""Where this rank is inside a global step: one small object that the loader's hooks, the
prepared optimizer, the prepared scheduler and job.backward share (as accelerate's
GradientState), instead of each reading the Job's private fields.

    loader hands out a chunk     -> state.item (a step's first chunk: reduced = False)
    job.backward, not the last   -> accumulating = True (optimizer, zero_grad, scheduler wait)
    job.backward, the last       -> accumulating = False, reduced = True, skip = overflowed
    optimizer.step()             -> steps unless skip; updates += 1 (with several optimizers, a
                                    GAN's, once a global step: `stepped` says one stepped in it)
    scheduler.step()             -> steps once per global step (a merged step: once per step it spans)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class StepState:
    """One rank's position inside its current global step."""

    item: Any = None
    """The chunk the loader handed out last (loader.Item: which step, which chunk, how many)."""
    backed: bool = False
    """job.backward ran for that chunk (a batch function's next batch fetched before it waits)."""
    accumulating: bool = False
    """Between a step's micro-batches: the optimizer, zero_grad and the scheduler do nothing."""
    reduced: bool = False
    """job.backward has reduced this step's gradients (the optimizer may step)."""
    skip: bool = False
    """The step's gradients overflowed (fp16 loss scaling): every rank skips the update alike."""
    stepped: bool = False
    """Several optimizers (a GAN's): one of them stepped in this global step already; the next
    one's step and job.backward belong to the same step (counted and timed once)."""
    reevaluating: bool = False
    """A closure's evaluation after the one its step was decided on (LBFGS's): its job.backward
    reduces, and belongs to the step already counted and timed (rank/optimizer.py)."""
    evaluations: int = 0
    """A closure's evaluations in the step in hand (each a collective: the ranks must agree)."""
    pass_over: int | None = None
    """`updates` when the prepared loader's pass ended after it handed out `item` (its loop took
    every batch), with nothing handed out since; None within a pass. A loop that fetches one batch
    ahead (apex's data_prefetcher, timm's PrefetchLoader) ends the pass before its last batch's
    backward and step, a GAN's two optimizers and an LBFGS closure's evaluations included; two
    updates past it, a job.backward is of a batch the prepared loader did not give (rank/job.py
    refuses it: a DataLoader made anew each epoch trained every rank on the whole batch)."""
    updates: int = 0
    """Optimizer steps this rank took (updates or skips); each scheduler's OncePerStep compares it
    with the count at its own last step (1 more: the scheduler steps every step)."""

    def chunk_given(self, item) -> None:
        """The loader handed out `item`; a step's first chunk starts a step not yet reduced."""
        self.item, self.backed, self.pass_over = item, False, None
        if item.chunk == 0:
            self.reduced = self.stepped = False

    def held_begins(self) -> None:
        """A loop fetching one batch ahead ran out with its pass's last batch in hand, handed out
        before the step before it trained: that batch's step begins now, as a step begins when its
        first chunk is handed out (a GAN's first optimizer to step counts it; it had been taken for
        the second of the step before, and the pass lost a step)."""
        if self.item is not None and self.item.chunk == 0:
            self.stepped = False

    def foreign(self) -> bool:
        """Two updates since the prepared loader's pass ended and nothing handed out: the loop's
        batches come from elsewhere."""
        return self.pass_over is not None and self.updates - self.pass_over >= 2

    def backward_done(self, last: bool, overflowed: bool = False) -> None:
        """job.backward of a chunk: the step's last one was reduced (`overflowed`: skip it)."""
        self.accumulating, self.backed = not last, True
        if last:
            self.reduced, self.skip = True, overflowed


class OncePerStep:
    """A scheduler's `step` that steps once per global step, whatever the micro-batches: nothing
    between a step's chunks, and for a merged step (--inner-steps by-speed) once per global step
    it stands for when the scheduler is stepped after every optimizer step (a per-step
    schedule); one stepped once an epoch is stepped once."""

    def __init__(self, step: Callable, state: StepState):
        self.wrapped, self.state, self.seen = step, state, state.updates

    def __call__(self, *args, **kwargs):
        state = self.state
        if state.accumulating:
            return None
        since, self.seen = state.updates - self.seen, state.updates  # its own count: two schedulers see alike
        merged = state.item.steps if state.item is not None and since == 1 else 1
        for _ in range(merged - 1):
            self.wrapped(*args, **kwargs)
        return self.wrapped(*args, **kwargs)
