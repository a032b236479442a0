"""Exactness of the weighted reduction: two real Horovod ranks with unequal batches end a step
where one process on the joined batch ends."""

from __future__ import annotations

import json

import pytest

from conftest import ROOT, VENV_BIN, run_cmd

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def results():
    proc = run_cmd([VENV_BIN / "horovodrun", "-np", "2", "-H", "localhost:2", "--gloo", "--start-timeout", "60",
                    VENV_BIN / "python", ROOT / "tests/jobs/exactness.py"], timeout=300)
    line = next(ln for ln in proc.stdout.splitlines() if "EXACTNESS " in ln)
    return {(r["optimizer"], r["overlap"], r["compression"]): r
            for r in json.loads(line.split("EXACTNESS ", 1)[1])}


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("overlap", [False, True])
def test_unequal_batches_match_one_process_on_the_joined_batch(results, optimizer, overlap):
    r = results[(optimizer, overlap, "none")]
    assert r["param_rel_err"] <= 1e-5, r
    assert r["grad_rel_err"] <= 1e-5, r


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_fp16_on_the_wire_stays_within_1e_3(results, optimizer):
    for overlap in (False, True):
        r = results[(optimizer, overlap, "fp16")]
        assert r["param_rel_err"] <= 1e-3, r
        assert r["grad_rel_err"] > 0, "fp16 must actually be on the wire"


def test_overlap_starts_allreduces_during_backward(results):
    r = results[("sgd", True, "none")]
    assert r["buckets"] > 1 and r["launched_in_backward"] == r["buckets"] * 2  # every bucket, both steps
    assert results[("sgd", False, "none")]["launched_in_backward"] == 0
