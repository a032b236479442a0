"""When a periodic checkpoint is due, counted in global steps.

    schedule = CheckpointSchedule(every_steps=0, minutes=10, keep=3)
    schedule.retime(step_s=0.42)          # at start (the calibrated step) and every epoch's end
    schedule.paced(walls)                 # a loop of the script's own, or an untimed start: each step
    schedule.due(step, last_checkpoint)   # after each optimizer step

`--checkpoint-every N` asks for one every N steps, `--checkpoint-minutes M` for one every M
minutes at the step time measured so far; the sooner of the two wins. The interval is in steps,
from a step time every rank has alike (the balancer's prediction, the epoch's slowest rank, the
slowest rank's whole steps riding with the gradients), so every rank decides alike and they meet
in the checkpoint's collectives at the same step. Without --keep-checkpoints nothing is periodic
(0 steps).
"""

from __future__ import annotations


RETIME = 32
"""Steps of a loop of the script's own between retimings from their pace (`paced`)."""


class CheckpointSchedule:
    """Steps between periodic checkpoints (0: none, only the epochs' ends where a mode keeps them)."""

    def __init__(self, every_steps: int, minutes: float, keep: int):
        self.every_steps, self.minutes, self.keep = every_steps, minutes, keep
        self.every = 0
        self.timed = False
        """The interval comes from a step time (measured at start, an epoch's end or paced)."""
        self.retime(0.0)
        self._paced: list[float] = []

    def paced(self, walls: list[float] | None) -> None:
        """A loop of the script's own, after each step: every rank's previous whole step (`walls`,
        start to start, alike on every rank; 0 before its first). No epoch's end retimes such a loop,
        and the calibrated step leaves out the exchange and the script's own work ("5 minutes" were
        15 on a nanoGPT-style run, and never where the probe could not time the model): every
        RETIME steps, the slowest rank's mean retimes the interval. So is job.epochs' first epoch
        where the start timed nothing (a job of one rank, a failed probe): its end may be hours away."""
        if walls and min(walls) > 0:
            self._paced.append(max(walls))
        if len(self._paced) >= RETIME:
            self.retime(sum(self._paced) / len(self._paced))
            self._paced = []

    def retime(self, step_s: float) -> None:
        """The interval at `step_s` seconds a step (0: unknown yet, only --checkpoint-every counts)."""
        # a step longer than the interval: every step (round() gave 0, which read as "none")
        by_time = max(1, round(self.minutes * 60 / step_s)) if self.minutes and step_s > 0 else 0
        self.timed = step_s > 0
        every = [n for n in (self.every_steps, by_time) if n]
        self.every = min(every) if every and self.keep else 0

    def due(self, step: int, last_checkpoint: int) -> bool:
        """Whether the steps since the last checkpoint reached the interval."""
        return bool(self.every) and step - last_checkpoint >= self.every
