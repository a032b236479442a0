"""job.epochs' helpers (rank/job.py): its arguments read, rank 0's start on every rank, and what
rank 0 says of an epoch that took no step.

    n, start = numbers(n, start)                       # a count and a start, or the loop's own range
    start = rank_0s_start(start, size, is_main)        # every rank starts at rank 0's epoch
    took_no_step(epoch, counted_from, n, stream, item)  # rank 0, once a run
"""

from __future__ import annotations

from numbers import Integral
from typing import TYPE_CHECKING

from hvdhetero.errors import ConfigError
from hvdhetero.rank import collectives, host

if TYPE_CHECKING:
    from hvdhetero.rank.loader import Item


def numbers(n, start) -> tuple[int, int]:
    """job.epochs' arguments as (stop, start): a count and a start, or the loop's own range
    (`range(1, epochs + 1)`, `range(start_epoch, epochs)`); anything else said, naming it."""
    usage = "job.epochs(n, start=0) takes whole numbers n >= 1 and start >= 0, or the loop's range"
    if isinstance(n, range):
        if n.step != 1 or start or n.start < 0:
            raise ConfigError(f"{usage} of step 1 alone (job.epochs(range(1, epochs + 1))), got {n!r}"
                              + (f" and start={start!r}" if start else ""))
        if not n:
            raise ConfigError(f"{usage}, got {n!r}, which holds no epoch")
        n, start = n.stop, n.start
    if isinstance(n, bool) or not isinstance(n, Integral) or isinstance(start, bool) \
            or not isinstance(start, Integral):
        raise ConfigError(f"{usage}, got n={n!r}, start={start!r}: pass int(...) where a config gives a float or "
                          "a string")
    if n < 1 or start < 0:
        raise ConfigError(f"{usage}, got n={n}, start={start}")
    return int(n), int(start)


def took_no_step(epoch: int, counted_from: int, n: int, stream: bool, item: Item | None = None) -> None:
    """Said once a run, by rank 0 (job.epochs calls it there): an epoch of job.epochs ended with no step taken (a batch
    function's stream that ended and was not made anew: every later loop over it ends at once;
    or a loop that calls the function once an epoch, full-batch, under micro-batches: each call
    one chunk of a step)."""
    if stream and item is not None and item.chunks > 1 and not item.last:
        why = (f"the loop took chunk {item.chunk + 1} of its step's {item.chunks} (micro-batches hand a step's "
               "share in chunks, one a call) and went on to its next epoch: a loop that calls the function once "
               "a step (a graph's training nodes, trained full-batch) wants whole shares, --micro-batch 0")
    elif stream:
        why = ("its loop over the prepared batches yielded none. A batch function's stream (lambda: next(stream)) "
               "that ended yields none until the script makes it anew (stream = iter(...) before the loop: the "
               "next batch is drawn from it); else end with job.stop()")
    else:
        why = ("no step's job.backward came in its loop over the prepared loader (a loop that ends before its "
               "first step, a budget of steps spent); to end training early, call job.stop()")
    print(f"hvdhetero: epoch {epoch} ({epoch - counted_from + 1}/{n - counted_from} on the live line) took no "
          f"training step: {why}", flush=True)


def rank_0s_start(start: int, size: int, is_main: bool) -> int:
    """Rank 0's `start` on every rank (one small exchange), said once where the ranks' differ: a
    script that resumes itself from a file only rank 0's host holds (torchrun's snapshot) goes
    on there on every rank, as job.prepare gave every rank rank 0's weights; before, the other
    ranks trained epochs rank 0 never took, and the job failed at rank 0's end."""
    if size == 1:
        return start
    starts = [round(s) for s in collectives.allreduce_sum(host.one_hot(float(start)), "hvdhetero.epochs_start")]
    if len(set(starts)) > 1 and is_main:
        each = ", ".join(f"rank {r}: {s}" for r, s in enumerate(starts))
        print(f"hvdhetero: job.epochs(start=) differs between the ranks ({each}): every rank starts at rank 0's "
              f"epoch {starts[0]}, as it trains rank 0's weights (job.prepare); a file of the script's own that "
              "only rank 0's host holds (torchrun's snapshot) resumes rank 0 alone: --resume loads the job's "
              "checkpoints on every rank", flush=True)
    return starts[0]
