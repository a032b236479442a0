"""Straggler injection: a rank with slowdown k sleeps (k-1) x its compute, using no CPU."""

from __future__ import annotations

import time

import pytest
import torch

from hvdhetero.rank import devices
from hvdhetero.rank.worker import Worker, forward_backward


@pytest.fixture
def sleeps(monkeypatch):
    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    return slept


def test_sleeps_k_minus_1_times_the_median_compute_of_steps_of_the_same_size(sleeps):
    me = Worker(devices.select("cpu"), 3.0, None)
    assert me.straggle(100) == 0.0 and sleeps == []  # nothing measured yet
    me.recent.extend([(200, 0.2), (200, 0.2), (200, 5.0), (100, 0.15), (200, 0.3)])  # one noisy step
    assert me.straggle(200) == pytest.approx(2 * 0.25)  # median of the four 200s: noise not multiplied
    assert me.straggle(100) == pytest.approx(2 * 0.15)  # a step of 100 has its own overhead: not 0.25 / 2
    assert me.straggle(50) == 0.0  # never measured at 50: sleeps after computing instead
    assert me.straggle(0) == 0.0  # an empty share waits for nothing
    assert sleeps == [pytest.approx(0.5), pytest.approx(0.3)]


def test_the_first_step_of_a_new_size_sleeps_after_its_own_compute(sleeps):
    me = Worker(devices.select("cpu"), 10.0, None)
    assert me.straggle_after(64, 0.02) == pytest.approx(0.18) and sleeps == [pytest.approx(0.18)]
    assert me.straggle_after(0, 0.02) == 0.0


def test_a_step_takes_k_times_its_compute_from_the_first_step_on():
    """forward_backward on a real model: a rank 4x slower spends 3x its compute asleep, the
    first step of each size (nothing measured) as well as the later ones."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    me = Worker(devices.select("cpu"), 4.0, None)
    computed = []
    for n in (64, 64, 32):
        x, y = torch.randn(n, 1, 8, 8), torch.randint(10, (n,))
        seconds = forward_backward(model, (x, y), me)[1]
        # first of its size: 3x its own compute after it; then 3x the earlier step's before it
        asleep = 3 * (computed[0] if len(computed) == 1 else me.last_busy)
        assert seconds >= me.last_compute + asleep - 1e-4, (n, seconds, me.last_compute, asleep)
        computed.append(me.last_busy)
    assert [n for n, _ in me.recent] == [64, 64, 32]


def test_a_fresh_copy_does_not_share_history():
    me = Worker(devices.select("cpu"), 10.0, None)
    me.recent.append((100, 0.01))
    other = me.fresh(micro_batch=64)
    assert (other.slowdown, other.micro_batch, list(other.recent)) == (10.0, 64, [])
    other.recent.append((100, 1.0))
    assert list(me.recent) == [(100, 0.01)]


def test_no_slowdown_never_sleeps(sleeps):
    me = Worker(devices.select("cpu"), 1.0, None)
    me.recent.append((1000, 0.5))
    assert me.straggle(1000) == 0.0 and me.straggle_after(1000, 0.5) == 0.0 and sleeps == []


def test_a_one_thread_cpu_rank_multiplies_its_compute_not_the_time_its_thread_stood_still(sleeps):
    """On a pinned CPU rank the Horovod background thread's allreduce runs on the same core,
    inside the last backward: communication, which a slower device would not slow. Here a
    50 ms block inside the step stands for it; the straggler multiplies only the compute."""
    threads = torch.get_num_threads()
    me = Worker(devices.select("cpu"), 10.0, None)
    torch.set_num_threads(1)  # as devices.select gives a rank pinned to one core
    try:
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
        x, y = torch.randn(16, 1, 8, 8), torch.randint(10, (16,))
        forward_backward(model, (x, y), me, before_last_backward=lambda: _block(0.05))
        assert me.last_compute >= 0.05 > 0.01 > me.last_busy  # the wall clock saw the block, the busy clock not
        assert sleeps == [pytest.approx(9 * me.last_busy)]
    finally:
        torch.set_num_threads(threads)


def _block(seconds):
    """Stand still without using CPU (time.sleep is patched out in these tests)."""
    import select
    select.select([], [], [], seconds)
