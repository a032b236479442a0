"""What a sweep knows of each host on its script: the trials it finished (how long they took), the
speed its last judged trial showed, the failures in a row, and how long a whole trial is; from
them, policy/sweep.py's clocks (when each host is free, what a trial takes there).

    hosts = Hosts(["pc", "mac"], records, budget=0)
    hosts.clocks(now, running)        # {host: HostClock(per_trial, free_at)}
    hosts.judged(trial)               # its progress told its end: its host's speed
    hosts.finished(trial, seconds)    # a complete trial: its host's time, a loop's length
    hosts.failed("mac")               # True when that host gets no more trials
"""

from __future__ import annotations

from hvdhetero.policy import sweep as policy
from hvdhetero.sweep.trial import Trial

HOST_FAILURES = 2
"""A host whose trials failed this many times in a row is given no more (a host down, a broken env)."""


class Hosts:
    """The sweep's hosts, in the order they were asked for."""

    def __init__(self, names: list[str], records: list[dict], budget: int):
        self.names = names
        self.durations: dict[str, list[float]] = {h: [] for h in names}
        """Each host's complete trials' seconds."""
        self.speeds: dict[str, tuple[float, float]] = {}
        """Each host's measured (start-up seconds, seconds a unit of self.length), from its last trial
        judged: its whole trial's estimate until one completes, and what a short trial's epochs are sized by."""
        self.length = budget or None
        """A whole trial's length: its epochs (--budget, else as the trials' progress says), or for a
        loop of the script's own the optimizer steps the trial that ended last took."""
        self.looped = False
        """The trials are loops of the script's own: timed in steps."""
        self.interval: int | None = None
        """Steps between the values of a loop over a source with no end (nanoGPT's eval_interval): the
        commonest gap in the last complete trial's; a short trial of such a loop is cut at a multiple."""
        self.last_value: int | None = None
        """The step of that trial's last value: a short trial is cut before it (never a whole trial's work)."""
        self.failures = {h: 0 for h in names}
        self.dropped: set[str] = set()
        """Hosts whose last HOST_FAILURES trials failed."""
        for r in records:  # resumed: what the trials that ended said
            if r["state"] == "complete" and r["host"] in self.durations:
                self.durations[r["host"]].append(r["seconds"])
            if r["state"] == "complete" and r.get("steps"):
                self.looped, self.length = True, r["steps"]
            if r["state"] == "complete" and r.get("values_at") == "step":
                self._learn_values([int(s) for s in r.get("values", {})])

    def per_trial(self, host: str) -> float | None:
        """Seconds a whole trial takes on `host`: its finished trials' mean, else as its speed says."""
        done = self.durations[host][-3:]
        if done:
            return sum(done) / len(done)
        if host in self.speeds:
            startup_s, unit_s = self.speeds[host]
            return startup_s + self.length * unit_s
        return None

    def longest(self, host: str) -> float | None:
        """Seconds the longest of `host`'s recent whole trials took (those per_trial averages); None before one."""
        return max(self.durations[host][-3:], default=None)

    def clocks(self, now: float, running: dict[str, Trial]) -> dict[str, policy.HostClock]:
        """Every host's clock but the dropped ones': a host not measured yet counts as fast as the
        fastest known; a busy one is free when its trial's progress says, else a whole trial after it began."""
        known = [t for h in self.names if (t := self.per_trial(h)) is not None]
        guess = min(known, default=1.0)
        out = {}
        for host in self.names:
            if host in self.dropped:
                continue
            t = self.per_trial(host) or guess
            trial = running.get(host)
            free_at = now
            if trial is not None and not trial.stopping:
                whole = t if not trial.short or host not in self.speeds else \
                    self.speeds[host][0] + trial.short * self.speeds[host][1]
                free_at = trial.expected_end() or trial.started + whole
            out[host] = policy.HostClock(t, max(free_at, now), busy=trial is not None and not trial.stopping)
        return out

    def order(self) -> list[str]:
        """Hosts in the order a free one is offered a trial: measured ones fastest first, then the
        others as the inventory lists them."""
        return sorted(self.names, key=lambda h: (self.per_trial(h) is None, self.per_trial(h) or 0.0,
                                                 self.names.index(h)))

    def length_of(self, trial: Trial) -> None:
        """A loop of the script's own is as long as the trial that ended last (unknown before one has);
        a short one, as far as it is cut."""
        if trial.looped:
            trial.length = trial.cut_at or (self.length if self.looped else None)

    def cut_steps(self, steps: int) -> int:
        """A short trial of a loop over a source with no end: the most of `steps` that ends on a value
        (a multiple of the interval), 0 where not one interval fits or none is known yet."""
        if not self.interval or not self.last_value:
            return 0
        steps = min(steps, self.last_value - 1)
        return max(0, steps // self.interval * self.interval)

    def judged(self, trial: Trial) -> None:
        """Its progress told its end: its host's speed, and the trials' length if not known yet."""
        self.speeds[trial.host] = trial.speed()
        self.length = self.length or trial.length

    def finished(self, trial: Trial, seconds: float) -> None:
        """A complete trial: its host's time per trial, and a loop's length in steps."""
        self.failures[trial.host] = 0
        self.durations[trial.host].append(seconds)
        if trial.looped and trial.steps:
            self.looped, self.length = True, trial.steps
        if trial.by_step:
            self._learn_values(list(trial.values))

    def _learn_values(self, steps: list[int]) -> None:
        steps = sorted(set(steps))
        gaps = [b - a for a, b in zip(steps, steps[1:])]
        if gaps:  # the commonest (the smaller of a tie): a last value off the grid (2000, 2001) is no interval
            self.interval = max(sorted(set(gaps)), key=gaps.count)
            self.last_value = steps[-1]

    def failed(self, host: str) -> bool:
        """A trial failed on `host`: True when that makes it one to give no more."""
        self.failures[host] += 1
        if self.failures[host] >= HOST_FAILURES and host not in self.dropped:
            self.dropped.add(host)
            return True
        return False
