"""Which host runs a sweep's next trial (issue 31): every machine busy, never later than the
fastest host alone.

Hosts differ in speed (a Mac 12-17x slower than the PC). Giving every free host the next trial
makes the sweep end when the slow host's last trial does. The rule here is earliest-finish
list scheduling with a look-ahead: plan the trials not yet started, one at a time, each on the
host where it would *end* first (counting what that host is still running); a free host starts
a trial now only if that plan gives it one now.

The guarantee, for trials of equal length per host (each host's time per trial measured): the
planned end is never later than the fastest host alone running every remaining trial back to
back. Each trial in the plan ends no later than it would on the fastest host's own queue,
which is one of the choices the plan compares. So a slow host takes a trial only when it
finishes it before the fast hosts would have got to it, and the sweep ends no later than
without it. Pure arithmetic: tests/test_sweep_policy.py checks the guarantee over many speeds.

A host's speed is not known before it ran something, so every host starts a trial at first
(running is the probe: no separate measurement costs the fast hosts time). Once a running
trial's end can be estimated from its progress, `keep_running` asks the same question again:
would the sweep end later with this trial left where it is than with it run again on the host
that ends it first of the others (its own host then free for the trials not started)? If so it
is stopped and re-run there, and its host is from then on only given trials the plan gives it. The fastest host is then never stopped
and never idle, so the guarantee holds with speeds learned this way too, for sweeps of at
least as many trials as hosts (with fewer, nothing is known to pick the fastest to start).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class HostClock:
    """What the scheduler knows of a host."""

    per_trial: float
    """Seconds one trial takes there (measured, or the plan probe's ratio to the fastest host)."""
    free_at: float
    """When its current trial is expected to end (now or earlier when it is free)."""
    busy: bool = False
    """It runs a trial now (whose end may be guessed, and overdue): of two hosts that would end a
    trial alike, the idle one takes it."""

    def next_end(self, now: float) -> float:
        """When a trial it starts as soon as it is free would end."""
        return max(now, self.free_at) + self.per_trial


def plan(now: float, left: int, hosts: Mapping[str, HostClock]) -> list[tuple[str, float, float]]:
    """The trials not yet started, in order, as (host, start, end): each on the host where it
    ends first (ties: the host that starts it sooner, an idle one, then the name). A busy host
    whose trial's guessed end is overdue counts as free now, but after an idle one: the fastest
    host, idle, waited while the plan gave its trials to busy hosts of unknown speed (guessed as
    fast as it)."""
    free = {name: max(now, clock.free_at) for name, clock in hosts.items()}
    busy = {name for name, clock in hosts.items() if clock.busy}
    out = []
    for _ in range(left):
        name = min(hosts, key=lambda n: (free[n] + hosts[n].per_trial, free[n], n in busy, n))
        out.append((name, free[name], free[name] + hosts[name].per_trial))
        free[name] += hosts[name].per_trial
        busy.discard(name)  # (its next one starts as the trial it runs ends)
    return out


def should_start(host: str, now: float, left: int, hosts: Mapping[str, HostClock]) -> bool:
    """Whether the free `host` starts one of the `left` trials now."""
    if left <= 0 or hosts[host].free_at > now:
        return False
    return _planned(host, now, left, hosts)  # its first one would start now


def _planned(host: str, now: float, left: int, hosts: Mapping[str, HostClock]) -> bool:
    """Whether the plan gives `host` any of the `left` trials."""
    return any(name == host for name, _, _ in plan(now, left, hosts))


def sweep_end(now: float, left: int, hosts: Mapping[str, HostClock]) -> float:
    """When the sweep ends: the last running trial's end or the plan's last, whichever is later."""
    ends = [end for _, _, end in plan(now, left, hosts)]
    return max([now, *(clock.free_at for clock in hosts.values()), *ends])


def keep_running(host: str, now: float, expected_end: float, left: int, hosts: Mapping[str, HostClock]) -> bool:
    """Whether the trial running on `host`, expected to end at `expected_end`, goes on: the sweep
    ends no later with it there than with it run again from its start on another host (`moved_to`:
    the one that ends it first), its host free now for the `left` trials not started. `hosts`
    holds every host's clock; `host`'s is replaced. Run again on its own host it would never end
    sooner than where it stands: a trial whose estimate overshot its host's time per trial (a loop
    that leaves its epochs early) was stopped there for no other host to take it."""
    there = moved_to(host, now, hosts)
    if there is None:
        return True
    kept = sweep_end(now, left, {**hosts, host: HostClock(hosts[host].per_trial, max(expected_end, now), True)})
    other = hosts[there]
    moved = sweep_end(now, left, {**hosts, host: HostClock(hosts[host].per_trial, now),
                                  there: HostClock(other.per_trial, other.next_end(now), True)})
    return kept <= moved


def moved_to(host: str, now: float, hosts: Mapping[str, HostClock]) -> str | None:
    """The host other than `host` that would end a trial started as soon as it is free first (None: no other)."""
    others = [h for h in hosts if h != host]
    return min(others, key=lambda h: (hosts[h].next_end(now), h), default=None)


def short_budget(host: str, now: float, left: int, hosts: Mapping[str, HostClock], startup_s: float,
                 epoch_s: float, epochs: int) -> int:
    """Epochs of a *short* trial the free `host` can end before the sweep's planned end, when the
    plan gives it no whole trial (0 otherwise, or when not even one epoch fits; at most epochs - 1).
    A short trial is extra work, not one of the `left`: the plan of the others is unchanged, so
    it delays nothing as long as it ends by then (`startup_s` and `epoch_s`: the host's measured
    start-up and seconds an epoch)."""
    if left <= 0 or hosts[host].free_at > now or _planned(host, now, left, hosts):
        return 0
    window = sweep_end(now, left, hosts) - now - startup_s
    if window <= 0 or epoch_s <= 0:
        return 0
    return max(0, min(epochs - 1, int(window // epoch_s)))


def fastest_alone(left: int, hosts: Mapping[str, HostClock], now: float = 0.0) -> float:
    """When the fastest host alone would end `left` trials started at `now` (the baseline)."""
    return now + left * min(clock.per_trial for clock in hosts.values())


def simulate(trials: int, per_trial: Mapping[str, float], probe: float | None = None) -> tuple[float, dict[str, int]]:
    """The sweep's end and each host's trial count (trials stopped by keep_running not counted)
    when trials take exactly per_trial and every host follows should_start from time 0 (what
    the guarantee is about). With `probe` (a fraction of a trial), no speed is known at first,
    as in a real sweep: every host starts a trial at 0 (the first `trials` hosts listed) and its speed becomes known once that
    much of it is done, when keep_running decides whether it goes on; a host not yet known
    counts as the fastest known one."""
    start = {name: 0.0 for name in list(per_trial)[:trials]} if probe is not None else {}
    """The running trials' starts (speeds unknown: the first hosts as listed)."""
    known = set() if probe is not None else set(per_trial)
    done = {name: 0 for name in per_trial}
    now, end = 0.0, 0.0
    left = trials - len(start)

    def clocks() -> dict[str, HostClock]:
        fastest = min((per_trial[n] for n in known), default=1.0)
        out = {}
        for name in per_trial:
            t = per_trial[name] if name in known else fastest
            out[name] = HostClock(t, start[name] + t if name in start else now, busy=name in start)
        return out

    while left or start:
        for name in sorted(start, key=lambda n: per_trial[n]):  # the estimates due now
            if name not in known and now >= start[name] + probe * per_trial[name] - 1e-12:
                known.add(name)
                if not keep_running(name, now, start[name] + per_trial[name], left, clocks()):
                    del start[name]
                    left += 1
        for name in [n for n, began in list(start.items()) if began + per_trial[n] <= now + 1e-12]:
            done[name] += 1
            end = max(end, start.pop(name) + per_trial[name])
        for name in sorted(per_trial, key=lambda n: per_trial[n]):
            if left and name not in start and should_start(name, now, left, clocks()):
                start[name] = now
                left -= 1
        if left and not start:
            raise AssertionError("no host took a trial while trials were left")  # the fastest always does
        events = [began + per_trial[n] for n, began in start.items()]
        events += [began + probe * per_trial[n] for n, began in start.items() if n not in known]
        now = min(events) if events else now
    return end, done
