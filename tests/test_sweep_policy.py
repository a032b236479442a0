"""Which host runs a sweep's next trial (hvdhetero/policy/sweep.py): the guarantee that the
sweep ends no later than the fastest host alone, over many speeds and trial counts, and that a
slow host still works when it can finish in time."""

from __future__ import annotations

import random

import pytest

from hvdhetero.policy import sweep


def test_a_12x_slower_host_takes_one_of_12_trials_and_the_sweep_ends_when_the_fast_one_alone_would():
    end, done = sweep.simulate(12, {"pc": 1.0, "mac": 12.0})
    assert done == {"pc": 11, "mac": 1} and end == 12.0  # fast alone: 12 trials x 1.0


def test_a_slow_host_that_cannot_finish_in_time_is_left_idle():
    end, done = sweep.simulate(11, {"pc": 1.0, "mac": 12.0})
    assert done == {"pc": 11, "mac": 0} and end == 11.0  # its trial would end at 12: later than the PC alone


def test_equal_hosts_share_the_trials_and_halve_the_time():
    end, done = sweep.simulate(12, {"a": 2.0, "b": 2.0})
    assert done == {"a": 6, "b": 6} and end == 12.0


@pytest.mark.parametrize("seed", range(200))
def test_never_later_than_the_fastest_host_alone(seed):
    rng = random.Random(seed)
    hosts = {f"h{i}": round(rng.uniform(1.0, 20.0), 3) for i in range(rng.randint(1, 4))}
    trials = rng.randint(1, 40)
    end, done = sweep.simulate(trials, hosts)
    alone = trials * min(hosts.values())
    assert end <= alone + 1e-9 and sum(done.values()) == trials, (hosts, trials, end, alone, done)


def test_a_busy_host_is_never_started_and_the_plan_counts_what_it_still_runs():
    clocks = {"pc": sweep.HostClock(1.0, 5.0), "mac": sweep.HostClock(12.0, 0.0)}
    assert not sweep.should_start("pc", 0.0, 3, clocks)  # busy until 5
    # the PC is busy until 5: 3 more trials there end at 8, so the Mac (12) would end later: idle
    assert not sweep.should_start("mac", 0.0, 3, clocks)
    # 12 trials left: the PC alone ends at 17, the Mac's ends at 12
    assert sweep.should_start("mac", 0.0, 12, clocks)
    assert sweep.plan(0.0, 2, clocks) == [("pc", 5.0, 6.0), ("pc", 6.0, 7.0)]
    assert sweep.fastest_alone(12, clocks) == 12.0


def test_a_slow_trial_is_stopped_once_its_end_is_known_to_come_after_the_fast_host_alone():
    """Speeds unknown at first: both hosts start a trial. At 0.5 the Mac's trial is known to end at
    12 (12x slower): with 11 trials in all the PC alone ends at 11, so it is stopped and re-run on
    the PC; with 12 the Mac ends it at 12, when the PC alone would: it goes on."""
    clocks = {"pc": sweep.HostClock(1.0, 1.0), "mac": sweep.HostClock(12.0, 12.0)}
    assert not sweep.keep_running("mac", 0.5, 12.0, 9, clocks)  # 11 = 2 running + 9 left
    assert sweep.keep_running("mac", 0.5, 12.0, 10, clocks)
    assert sweep.simulate(11, {"pc": 1.0, "mac": 12.0}, probe=0.05) == (11.0, {"pc": 11, "mac": 0})
    assert sweep.simulate(12, {"pc": 1.0, "mac": 12.0}, probe=0.05) == (12.0, {"pc": 11, "mac": 1})


@pytest.mark.parametrize("seed", range(200))
def test_with_speeds_learned_while_running_never_later_than_the_fastest_host_alone(seed):
    """Every host starts a trial at 0 (running is the probe); each learns its speed a fraction into
    it. The fastest host is never stopped and never idle, so the sweep still ends no later than it
    alone would. (With fewer trials than hosts the fastest may not be among those that start:
    nothing is known to pick it.)"""
    rng = random.Random(1000 + seed)
    hosts = {f"h{i}": round(rng.uniform(1.0, 20.0), 3) for i in range(rng.randint(1, 4))}
    trials = rng.randint(len(hosts), 40)
    end, done = sweep.simulate(trials, hosts, probe=rng.uniform(0.01, 0.3))
    alone = trials * min(hosts.values())
    assert end <= alone + 1e-9 and sum(done.values()) == trials, (hosts, trials, end, alone, done)
