"""What a pass over the prepared loader does as it begins and ends (rank/training.py calls these
with itself, from the loader's hooks and the optimizer's step).

    iter(loader)                -> begins(t): job.step as the pass begins
    the pass's last batch taken -> ended(t, began, holding): now, or where the loop backed fewer
                                   of the pass's batches than it was handed (it fetches one batch
                                   ahead: apex's data_prefetcher, timm's PrefetchLoader) once the
                                   batch it holds has trained: settle(t) at each optimizer step
    a pass left early (break)   -> left(t)

A pass that trained ends with BatchNorm-style buffers averaged under step sync (the script's
own evaluation after its loop sees one model on every rank). Outside job.epochs (a loop of the
script's own, `for epoch in range(n)`) its end is also the epoch's: the epoch's record (every
rank's loss, samples and times: a collective), its counts started afresh for the next pass, and
what the script does before that pass (its evaluation) left out of the next step's compute.

Both are collectives, so whether they wait, and for what, is decided only from what every rank's
loop does alike: its pass's batches, the batches its job.backward calls came from and its
optimizer steps. Not from the batches the loader hands out to any pass, nor from whether a loop is
found fetching ahead: a look at a batch (rank 0's `next(iter(loader))` to show a few images) hands
one out on one rank alone, and a look kept open makes rank 0's passes ones inside it, where no
prefetcher is found. (One corner is left: in a loop fetching ahead, a look kept open on one rank
inside the loop's body has that rank's later losses taken for the batch ahead, not the one in hand.)

What each got wrong before:
- a loop fetching one batch ahead ended its pass with its last batch still in hand: each epoch's
  record missed its last step (15 of 16 steps, 960 of 1024 samples), and the buffers averaged
  before that batch's forward differed again on every rank after the loop;
- a look at a batch inside a pass started the next epoch's counts from the batch it trained
  next: rank 0's record left out its first 9 steps (736 of 1024 samples);
- the epoch's seconds began at its first job.backward, after that step's data and forward.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hvdhetero.rank import averaging, collectives

if TYPE_CHECKING:
    from hvdhetero.rank.training import Training


@dataclass
class Pending:
    """A pass's end that waits for the batch its loop held to train."""

    began: int
    backwards: int
    """job.backward calls as the pass ended: one more is the held batch's."""
    steps: int = 0
    """Optimizer steps since that job.backward (a GAN's two optimizers each step once a batch)."""


def begins(t: Training) -> int:
    """A loop takes the prepared loader (iter()): job.step as its pass begins (ended() gets it). A
    pass of the script's own after one it left early (a `break`: no record came) starts its counts
    afresh, and any fresh counts start their clock now."""
    t.passes.begun()
    if t.passes.outermost and not t.in_epochs:
        if t.left_pass:
            t.records.begin_epoch()
        if t.records.steps == 0:
            t.records.epoch_started = time.perf_counter()
    t.left_pass = False
    return t.train.step


def ended(t: Training, began: int, holding: bool) -> None:
    """A loop took every batch of the pass, from global step `began`. `holding`: the batches its
    job.backward calls came from (each once: a GAN's three losses a batch are one) were fewer than
    the pass's, and not none (a pass that trains nothing, rank 0's alone counting its share): it
    holds the last, not trained yet (it fetches one batch ahead), and the pass's end waits for that
    batch's steps (settle). A pass that ends on a thread of its own (a background prefetcher) ends
    there, as its iterator runs out (Horovod matches the ranks' collectives by name, whichever
    thread makes them)."""
    t.step_state.pass_over = t.step_state.updates
    if holding and threading.current_thread() is threading.main_thread():
        t.pass_end = Pending(began, t.backwards)
        t.step_state.held_begins()
    else:
        _over(t, began)


def settle(t: Training, now: bool = False) -> None:
    """An optimizer stepped: a pass's end waiting for its held batch comes once that batch's
    job.backward came and every optimizer has stepped since (`now`: job.epochs' epoch ends)."""
    pending = t.pass_end
    if pending is None or threading.current_thread() is not threading.main_thread():
        return
    if t.backwards > pending.backwards:
        pending.steps += 1
    if now or pending.steps >= len(t.optimizers):
        t.pass_end = None
        _over(t, pending.began)


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
            t.epoch_record()
        t.records.begin_epoch()
