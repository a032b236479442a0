"""Straggler injection: a rank with slowdown k sleeps (k-1) x its compute, using no CPU."""

from __future__ import annotations

import time

import pytest

from hvdhetero import devices
from hvdhetero.step import Rank


@pytest.fixture
def sleeps(monkeypatch):
    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    return slept


def test_sleeps_k_minus_1_times_the_median_per_sample_compute_times_n(sleeps):
    me = Rank(devices.select("cpu"), 3.0, None)
    assert me.straggle(100) == 0.0 and sleeps == []  # nothing measured yet
    me.per_sample.extend([0.001, 0.001, 0.050, 0.001, 0.002])  # one noisy step
    assert me.straggle(200) == pytest.approx(2 * 0.001 * 200)  # the noise is not multiplied
    assert me.straggle(0) == 0.0  # an empty share waits for nothing
    assert sleeps == [pytest.approx(0.4)]


def test_a_fresh_copy_does_not_share_history():
    me = Rank(devices.select("cpu"), 10.0, None)
    me.per_sample.append(0.01)
    other = me.fresh(micro_batch=64)
    assert (other.slowdown, other.micro_batch, list(other.per_sample)) == (10.0, 64, [])
    other.per_sample.append(1.0)
    assert list(me.per_sample) == [0.01]


def test_no_slowdown_never_sleeps(sleeps):
    me = Rank(devices.select("cpu"), 1.0, None)
    me.per_sample.append(0.5)
    assert me.straggle(1000) == 0.0 and sleeps == []
