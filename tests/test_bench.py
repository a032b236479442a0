"""`invoke bench` keeps its interface: one job, three phases, the JSON scripts rely on."""

import json

import pytest

from conftest import VENV_BIN, run_cmd

pytestmark = pytest.mark.slow


def test_bench_writes_the_documented_json(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_cmd([VENV_BIN / "invoke", "bench", "--slowdown", "3", "--steps", "1", "--repeats", "1",
                    "--batch-size", "256", "--out", out], timeout=600)
    result = json.loads(out.read_text())
    assert result["config"]["slowdown"] == 3.0 and result["config"]["ranks"] == 2
    assert len(result["solo"]["per_rank_samples_per_s"]) == 2
    assert result["solo"]["samples_per_s"] == pytest.approx(sum(result["solo"]["per_rank_samples_per_s"]))
    for job in ("horovod", "hvdhetero"):
        r = result[job]
        assert r["samples_per_s"] > 0 and sum(r["split"]) == 256
        assert r["efficiency"] == pytest.approx(r["samples_per_s"] / result["solo"]["samples_per_s"])
        assert r["vs_fastest"] == pytest.approx(r["samples_per_s"] / result["solo"]["fastest"])
    assert result["horovod"]["split"] == [128, 128]
    assert "hvdhetero / plain horovod" in proc.stdout
