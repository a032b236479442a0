"""The public API (`import hvdhetero as hh`) on two real horovodrun ranks: exact weighted
reduction through job.prepare/backward/optimizer.step, and loss scaling that every rank agrees on."""

from __future__ import annotations

import json

import pytest

from conftest import ROOT, VENV_BIN, run_cmd

pytestmark = pytest.mark.slow


def two_ranks(job: str, tag: str, run_dir) -> list[dict]:
    proc = run_cmd([VENV_BIN / "horovodrun", "-np", "2", "-H", "localhost:2", "--gloo", "--start-timeout", "60",
                    VENV_BIN / "python", ROOT / "tests" / "jobs" / job, run_dir], timeout=600)
    line = next(ln for ln in proc.stdout.splitlines() if f"{tag} " in ln)
    return json.loads(line.split(f"{tag} ", 1)[1])


@pytest.fixture(scope="module")
def exactness(tmp_path_factory):
    return two_ranks("api_exactness.py", "API_EXACTNESS", tmp_path_factory.mktemp("api"))


@pytest.mark.parametrize("micro", [0, 8], ids=["whole-share", "micro-batches-of-8"])
@pytest.mark.parametrize("overlap", [False, True], ids=["after-backward", "overlapped"])
@pytest.mark.parametrize("clip", [False, True], ids=["no-clip", "clip"])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_two_unequal_ranks_step_like_one_process_on_the_joined_batch(exactness, optimizer, clip, overlap, micro):
    """SGD with momentum, two param groups and a per-batch StepLR (passed to prepare), or
    AdamW; two global steps; the ranks' shares unequal."""
    r = next(r for r in exactness if (r["optimizer"], r["clip"], r["overlap"], r["micro_batch"]) ==
             (optimizer, clip, overlap, micro))
    # Unequal shares are the premise; which rank gets more follows measured times (the 3x
    # straggler is a sleep), which a busy 2-vCPU machine can turn around: not asserted here.
    assert r["sizes"][0] != r["sizes"][1] and min(r["sizes"]) > 0 and sum(r["sizes"]) == 48, r
    assert r["param_rel_err"] <= 1e-5, r
    assert r["lr"] == r["ref_lr"], "the scheduler stepped once per global step, not per micro-batch"
    if micro:
        assert r["chunks"] > 2, "micro-batches really ran"


def test_an_overflow_on_one_rank_is_skipped_by_every_rank(tmp_path):
    ranks = two_ranks("api_overflow.py", "API_OVERFLOW", tmp_path)
    for r in ranks:
        assert r["seen"]["overflowed"] == {"unchanged": True, "scale": [1024.0, 512.0]}, r
        assert r["seen"]["after"]["unchanged"] is False and r["seen"]["after"]["scale"] == [512.0, 512.0], r
        assert r["skipped"] == 1
    assert ranks[0]["digest"] == ranks[1]["digest"]
