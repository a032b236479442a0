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


def plan(now: float, left: int, hosts: Mapping[str, HostClock]) -> list[tuple[str, float, float]]:
    """The trials not yet started, in order, as (host, start, end): each on the host where it
    ends first (ties: the host that starts it sooner, an idle one, then the name)."""
    free = {name: max(now, clock.free_at) for name, clock in hosts.items()}
    out = []
    for _ in range(left):
        name = min(hosts, key=lambda n: (free[n] + hosts[n].per_trial, free[n], n))
        out.append((name, free[name], free[name] + hosts[name].per_trial))
        free[name] += hosts[name].per_trial
    return out


def should_start(host: str, now: float, left: int, hosts: Mapping[str, HostClock]) -> bool:
    """Whether the free `host` starts one of the `left` trials now."""
    if left <= 0 or hosts[host].free_at > now:
        return False
    return any(name == host for name, _, _ in plan(now, left, hosts))  # its first one would start now


def fastest_alone(left: int, hosts: Mapping[str, HostClock], now: float = 0.0) -> float:
    """When the fastest host alone would end `left` trials started at `now` (the baseline)."""
    return now + left * min(clock.per_trial for clock in hosts.values())


def simulate(trials: int, per_trial: Mapping[str, float]) -> tuple[float, dict[str, int]]:
    """The sweep's end and each host's trial count when every host follows should_start from
    time 0 and trials take exactly per_trial (what the guarantee is about)."""
    clocks = {name: HostClock(t, 0.0) for name, t in per_trial.items()}
    done = {name: 0 for name in per_trial}
    now, left, end = 0.0, trials, 0.0
    while left:
        for name in sorted(clocks, key=lambda n: clocks[n].per_trial):
            if left and should_start(name, now, left, clocks):
                clocks[name] = HostClock(per_trial[name], now + per_trial[name])
                done[name] += 1
                left -= 1
                end = max(end, now + per_trial[name])
        busy = [c.free_at for c in clocks.values() if c.free_at > now]
        if left and not busy:
            raise AssertionError("no host took a trial while trials were left")  # the fastest always does
        now = min(busy) if busy else now
    return end, done
