"""Where a rank's local:H / diloco:H rounds end, counted in global steps.

Every rank decides alone, from the same integers, and must decide alike: the ranks meet in
each round's exchange, and a rank that got there at another global step would stop the job.

A round is H global steps from its `origin`. Overlapped and inside `job.epochs`, a round that
would leave fewer than H of the epoch's steps after it takes them too (rounds of H..2H-1
steps), and its exchange starts at the epoch's end, after the epoch's collectives (Horovod runs
collectives in order: launched before them, it held up the epoch's end by its time on the link,
0.04-1.4 s an epoch at 8 Mbit, ~20% of the run). So a round never has fewer than H steps to
hide its exchange behind (an epoch shorter than H: a round ends at the first epoch's end H
steps on), and never runs past 2H (a script that does not loop over job.epochs). Without
overlap an exchange blocks anyway, and rounds run across epochs' ends.

A rank merging steps (--inner-steps by-speed) takes several global steps as one optimizer step
(`steps_merged`), never past its round's end: every rank's merged step ends where the round does.
"""

from __future__ import annotations

from dataclasses import dataclass

from hvdhetero.policy.split import steps_merged


@dataclass
class RoundClock:
    """One rank's position in its rounds."""

    every: int
    """H: global steps a round has (H..2H-1 overlapped at an epoch's end)."""
    overlap: bool = False
    """--overlap-sync: a round's exchange runs behind the next round's compute."""
    origin: int = 0
    """The global step the current round began at."""
    steps: int = 0
    """Global steps taken in the current round (a merged step counts every step it spans)."""
    updates: int = 0
    """Optimizer steps taken in the current round (fewer than `steps` on a rank that merges)."""

    def took(self, steps: int = 1) -> None:
        """This rank took one optimizer step spanning `steps` global steps."""
        self.steps += steps
        self.updates += 1

    def restart(self, at: int) -> None:
        """A round was exchanged (ended or flushed): the next begins at global step `at`."""
        self.origin, self.steps, self.updates = at, 0, 0

    def due(self, epoch_left: int | None) -> bool:
        """Whether the round ends now, `epoch_left` steps of the epoch after this one (None:
        not inside job.epochs). Overlapped, not where fewer than H of them would be left (none
        included): those join this round, which ends with the epoch (`ends_with_epoch`)."""
        if self.steps < self.every:
            return False
        return not self.overlap or epoch_left is None or epoch_left >= self.every or self.steps >= 2 * self.every

    def ends_with_epoch(self, more_epochs: bool) -> bool:
        """Whether the round in progress ends with this epoch: overlapped, H steps or more, and
        another epoch follows (the run's end, or a stop, flushes it instead)."""
        return self.overlap and self.steps >= self.every and more_epochs

    def merge(self, step: int, left: int, share: int, largest: int, in_epochs: bool,
              cap: int | None = None) -> int:
        """--inner-steps by-speed: how many global steps from `step` on (`left` of them in the
        epoch) a rank with `share` samples a step takes as one optimizer step: about the
        largest share's batch (`largest`), within its host's memory `cap`, never past the
        round's end."""
        since = step - self.origin
        round_left = self.every - since % self.every
        if self.overlap and in_epochs and (since >= self.every or left - round_left < self.every):
            round_left = min(left, 2 * self.every - since)  # on to the epoch's end (`due`)
        n = steps_merged(share, largest)
        if cap:  # a merged step stays within the host's memory cap
            n = min(n, max(1, cap // max(1, share)))
        return min(n, round_left, left)
