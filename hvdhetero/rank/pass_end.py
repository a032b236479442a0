"""What a pass over the prepared loader does as it begins and ends (rank/training.py calls these
with itself, from the loader's hooks and the optimizer's step).

    iter(loader)                -> begins(t): job.step as the pass begins
    the pass's last batch taken -> ended(t, began): now, or in a loop that fetches one batch ahead
                                   (apex's data_prefetcher, timm's PrefetchLoader) once the batch it
                                   still holds has trained: at that step's end (settle(t))
    a pass left early (break)   -> left(t)

A pass that trained ends with BatchNorm-style buffers averaged under step sync (the script's
own evaluation after its loop sees one model on every rank). Outside job.epochs (a loop of the
script's own, `for epoch in range(n)`) its end is also the epoch's: the epoch's record (every
rank's loss, samples and times: a collective), its counts started afresh for the next pass, and
what the script does before that pass (its evaluation) left out of the next step's compute.

What each got wrong before:
- a loop fetching one batch ahead ended its pass with its last batch still in hand: each epoch's
  record missed its last step (15 of 16 steps, 960 of 1024 samples), and the buffers averaged
  before that batch's forward differed again on every rank after the loop;
- a look at a batch inside a pass (rank 0's `next(iter(loader))` to show a few images) started
  the next epoch's counts from the batch it trained next: rank 0's record left out its first 9
  steps (736 of 1024 samples);
- the epoch's seconds began at its first job.backward, after that step's data and forward.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from hvdhetero.rank import averaging, collectives

if TYPE_CHECKING:
    from hvdhetero.rank.training import Training


def begins(t: Training) -> int:
    """A loop takes the prepared loader (iter()): job.step as its pass begins (ended() gets it). A
    pass end still held back (its held batch never stepped: a script accumulating over it) comes
    now, before this pass deals anything. A pass of the script's own after one it left early (a
    `break`: no record came) starts its counts afresh, and any fresh counts start their clock now.
    Only the loop's own pass (not a look at a batch inside one, which one rank may take alone)."""
    if t.passes.outermost:
        settle(t)
    t.passes.begun()
    if t.passes.outermost and not t.in_epochs:
        if t.left_pass:
            t.records.begin_epoch()
        if t.records.steps == 0:
            t.records.epoch_started = time.perf_counter()
    t.left_pass = False
    return t.train.step


def ended(t: Training, began: int) -> None:
    """A loop took every batch of the pass, from global step `began`. In a loop that fetches one
    batch ahead (or one fetching on a thread of its own) the pass's last batch has not trained
    yet: its end waits for that step's end, on the main thread, as every rank's does."""
    t.step_state.pass_over = t.step_state.updates
    if t.passes.ahead or threading.current_thread() is not threading.main_thread():
        t.pass_end = began
    else:
        _over(t, began)


def settle(t: Training) -> None:
    """A pass's end held back comes now: at a step's end (the loop fetching one batch ahead trained
    the batch it held), at the next pass's begin, at job.epochs' epoch's end."""
    if t.pass_end is not None and threading.current_thread() is threading.main_thread():
        began, t.pass_end = t.pass_end, None
        _over(t, began)


def left(t: Training) -> None:
    """The loop left its pass early (a `break`): no end, no record; the next pass counts afresh."""
    t.passes.left()
    if t.passes.outermost:
        t.left_pass = True


def _over(t: Training, began: int) -> None:
    """Every rank's pass ended (a pass that took no step, rank 0's alone counting its share, does
    nothing: none of the others took it)."""
    if t.train.step <= began:
        return
    if t.strategy.always_one_model:
        averaging.buffers(t.model)  # (and an EMA's of it)
    if not t.in_epochs and not t.records.ended:  # a loop of the script's own (every rank's pass)
        t.strategy.pause()
        with collectives.within("the end of a pass over the prepared loader"):
            t.records.end_epoch(t.train.epoch, t.train.step, t.size, max(1, t.records.steps),
                                t.sampler.batch_sizes, t.loss_scale.skipped if t.loss_scale else 0)
        t.records.begin_epoch()
