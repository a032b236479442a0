"""Gloo's uv transport against tcp on this machine: real 2-rank horovodrun jobs, once with each
of our builds (the installed uv one and the tcp one from the wheel cache through PYTHONPATH)."""

from __future__ import annotations

import json

import pytest

from conftest import VENV_BIN, run_cmd

pytestmark = pytest.mark.slow


def test_uv_and_tcp_allreduce_give_identical_bits_and_both_report_throughput(tmp_path):
    out = tmp_path / "allreduce.json"
    proc = run_cmd([VENV_BIN / "invoke", "bench", "--allreduce", "--rounds", "1", "--repeats", "3",
                    "--sizes-mb", "1,16", "--out", out], timeout=1800)
    result = json.loads(out.read_text())
    assert set(result["transports"]) == {"uv", "tcp"}
    for transport in ("uv", "tcp"):
        sizes = result["transports"][transport]["sizes"]
        assert set(sizes) == {"1", "16"} and result["transports"][transport]["ranks"] == 2
        assert all(row["algbw_gb_per_s"] > 0 and len(row["sha256"]) == 1 for row in sizes.values())
    assert result["bit_identical"] is True
    assert {mb: result["transports"]["uv"]["sizes"][mb]["sha256"] for mb in ("1", "16")} == \
        {mb: result["transports"]["tcp"]["sizes"][mb]["sha256"] for mb in ("1", "16")}
    assert set(result["uv_vs_tcp"]) == {"1", "16"}
    assert "results bit-identical across engines and rounds: yes" in proc.stdout


def test_the_allreduce_bench_refuses_an_unknown_transport():
    proc = run_cmd([VENV_BIN / "invoke", "bench", "--allreduce", "--transports", "uv,quic"], timeout=120,
                   check=False)
    assert proc.returncode == 2
    assert "--transports uv,quic: choose from uv, tcp" in proc.stderr


def _job(transport, sha, repeatable=True):
    return {"transport": transport, "ranks": 2, "sizes": [
        {"mb": 1.0, "median_s": 0.002, "algbw_gb_per_s": 0.5, "busbw_gb_per_s": 0.5, "sha256": sha,
         "repeatable": repeatable}]}


@pytest.mark.parametrize("runs,identical", [
    ({"uv": [_job("uv", "a"), _job("uv", "a")], "tcp": [_job("tcp", "a")]}, True),
    ({"uv": [_job("uv", "a")], "tcp": [_job("tcp", "b")]}, False),  # transports disagree
    ({"uv": [_job("uv", "a"), _job("uv", "b")], "tcp": [_job("tcp", "a")]}, False),  # rounds disagree
    ({"uv": [_job("uv", "a", repeatable=False)], "tcp": [_job("tcp", "a")]}, False),  # repeats within a job
])
def test_bit_identical_needs_every_repeat_round_and_transport_to_agree(runs, identical):
    from hvdhetero.bench import allreduce as allreduce_bench

    assert allreduce_bench.summarize(runs)["bit_identical"] is identical
