"""Where the live line says a loop stands in its epoch: step N of M (rank/training.py's part).

    count = Counting(is_main)
    count.at(item, len(loader), in_epochs, endless, taken)   # each step: (step, steps) for the line
    count.epoch_ended(len(loader), endless, taken)           # job.epochs' epoch ended: its steps, if
                                                             # the line did not count to them

A pass over the loader is an epoch's steps where the loop takes it once. Otherwise:
- a loop that leaves each epoch early (Optuna's examples break after N batches) counts to the N
  its last whole epoch took (`pass_steps`), not to the loader's length;
- a loop that takes the loader more than once within one of job.epochs' epochs (FixMatch's
  labelled loader restarted with iter() beside its unlabelled batches) counts the epoch's steps
  over its passes: each pass's 6/6 had ended the epoch on the console (108 blocks in a helper's
  45 s run); and so does one over an endless draw (a batch function's) inside job.epochs. Both
  count to what the last such epoch took (`epoch_steps`), with no total in the first;
- an endless draw outside job.epochs counts optimizer steps, with no total.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hvdhetero.rank.loader import Item

TAKEN_AGAIN = ("hvdhetero: the loop took the prepared loader again within one of job.epochs' epochs (a loader "
               "restarted with iter() or cycled through): each pass deals an order of its own, as a DataLoader "
               "reshuffles at every iter(), and the live line counts the epoch's steps over its passes. Where the loop draws a second "
               "data source beside it (FixMatch's unlabelled batches beside the labelled), that one is each "
               "rank's whole: return both from one batch function, so that every rank takes its share of each "
               "(docs/api.md, 'Two data sources in one step')")


class Counting:
    """One rank's count of its loop's steps in the epoch, for the live line."""

    def __init__(self, is_main: bool):
        self.is_main = is_main
        self.pass_steps: int | None = None
        """The loader steps a pass of the script's loop takes where it leaves each epoch early: the
        live line's and a sweep's count, from the last whole epoch's."""
        self.span: tuple[int, int] | None = None
        """This epoch's first and last loader steps (within a pass), + 1."""
        self.repasses = 0
        """Passes over the loader begun again within this job.epochs epoch (each deals an order of its own:
        rank/passes.py's `again`, which counts the same passes as they begin)."""
        self.epoch_steps: int | None = None
        """The steps the last epoch took where its loop took the loader more than once, or drew without end."""
        self.taken_again = False
        """Whether the loop took the loader again within an epoch at all (its loader steps repeat)."""
        self.partial = False
        """This epoch began before this process did (resumed, or restarted by --elastic, mid-epoch): its
        steps are not an epoch's."""

    def at(self, item: Item, steps: int, in_epochs: bool, endless: bool, taken: int,
           step: int) -> tuple[int, int | None]:
        """The line's (step, steps) after `item`'s step: `steps` the loader's length, `taken` the
        steps taken in this epoch, `step` job.step's count."""
        at = item.step % steps + 1
        if in_epochs and not endless and self.span is not None and at <= self.span[1]:
            self.repasses += 1
            self.taken_again = True
            if self.is_main and self.repasses == 1 and self.epoch_steps is None:
                print(TAKEN_AGAIN, flush=True)
        self.span = (self.span or (at - item.steps, at))[0], at
        if in_epochs and (self.repasses or self.epoch_steps or endless):  # the epoch's steps over its passes
            return taken, self.epoch_steps if self.epoch_steps and taken <= self.epoch_steps else None
        if endless:  # the optimizer step in hand, what a loop of its own counts (one that accumulates: k batches)
            return step + 1, None
        return at, self.pass_steps if self.pass_steps and at <= self.pass_steps else steps

    def epoch_ended(self, steps: int, endless: bool, taken: int) -> int | None:
        """job.epochs' epoch ended after `taken` steps: those steps, where the line counted them
        over its passes (the line's end of the epoch, and its count from now on)."""
        ended = None
        if self.repasses or endless:
            ended = taken
            if not self.partial and taken:  # (a resumed epoch's rest is no epoch's count)
                self.epoch_steps = taken
        elif self.span is not None and self.span[0] == 0:  # an epoch taken from its start
            self.pass_steps = self.span[1] if self.span[1] < steps else None
            self.epoch_steps = None
        self.span, self.repasses, self.partial = None, 0, False
        return ended
