"""A CUDA rank and a CPU rank in one job (issue 32): exact weighted reduction across them, loss
scaling on the CUDA rank with an overflow on one rank, a resume bit-exact with the CUDA RNG
state, DiLoCo with overlapped exchanges, and the examples through --script.

Every test carries the marker `gpu`, which tests/conftest.py skips, with the reason, where torch
sees no CUDA device (CI, this project's machines). `ci/gpu-check` sets up an env on a GPU machine
and runs them there with the GPU bench, writing a JSON summary.

The job: the inventory's one local host `gpu` with two slots and a device per slot (`device:
cuda,cpu`): local rank 0 on CUDA, local rank 1 on the CPU, pinned to this env's own versions (a
GPU machine's torch need not be the inventory's pin).
"""

from __future__ import annotations

import json
import sys
from importlib import metadata
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, VENV_BIN, run_cmd
from test_checkpoint import EXACT, end_record, killed_after_step

from hvdhetero import metrics
from hvdhetero.rank import checkpoint

pytestmark = pytest.mark.gpu

HOSTS = {"localhost": {"name": "gpu", "device": "cuda,cpu"}}
"""JobConfig.hosts for the jobs horovodrun starts with -H localhost:2."""


def env_pins() -> dict:
    """The pins this env meets: its own Python, torch, torchvision, and its Horovod build's transport."""
    from hvdhetero.cluster import horovod_build

    build = horovod_build.installed_build(sys.executable) or {}
    return {"python": "%d.%d" % sys.version_info[:2], "torch": metadata.version("torch"),
            "torchvision": metadata.version("torchvision"), "horovod": horovod_build.HOROVOD_VERSION,
            "transport": build.get("transport", horovod_build.DEFAULT_TRANSPORT)}


@pytest.fixture(scope="module")
def gpu_inventory(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gpu") / "inventory.yaml"
    write_inventory(path)
    return path


def write_inventory(path: Path) -> None:
    """One local host, a CUDA rank and a CPU rank (ci/gpu-check's bench takes it too)."""
    env = str(Path(sys.executable).parent.parent)
    path.write_text(yaml.safe_dump({"pins": env_pins(), "default_hosts": ["gpu"], "hosts": {
        "gpu": {"address": "localhost", "device": "cuda,cpu", "slots": 2, "env": env}}}))


def hosts_env() -> dict[str, str]:
    return {"HVDHETERO_TEST_HOSTS": json.dumps(HOSTS)}

HOSTS_FLAGS = ["-H", "localhost:2"]


def two_ranks(job: str, tag: str, run_dir, env: dict) -> list[dict]:
    proc = run_cmd([VENV_BIN / "horovodrun", "-np", "2", *HOSTS_FLAGS, "--gloo", "--start-timeout", "120",
                    VENV_BIN / "python", ROOT / "tests" / "jobs" / job, run_dir], timeout=900, env=env)
    line = next(ln for ln in proc.stdout.splitlines() if f"{tag} " in ln)
    return json.loads(line.split(f"{tag} ", 1)[1])


def train(inventory, run_dir, *args, timeout=900, check=True):
    return run_cmd([VENV_BIN / "invoke", "train", "--inventory", inventory, "--run-dir", run_dir, *args],
                   timeout=timeout, check=check)


def test_a_cuda_rank_and_a_cpu_rank_step_like_one_process_on_the_joined_batch(tmp_path):
    """fp32, every case of the CPU test (SGD+StepLR or AdamW, clipping, overlap, micro-batches):
    the parameters within 1e-5 (relative) of one process on the joined batch, or within twice
    the distance between that process on the GPU and on the CPU where that is larger (AdamW:
    seen on an H200 at 1.3e-5, its first steps lr * g / |g| a whole step apart wherever the
    gradient is near zero and its last bits differ)."""
    cases = two_ranks("api_exactness.py", "API_EXACTNESS", tmp_path, hosts_env())
    print("case, param_rel_err, device_rel_err (one process: GPU against CPU)")
    for c in cases:
        print(c["optimizer"], c["clip"], c["overlap"], c["micro_batch"], c["param_rel_err"], c["device_rel_err"])
    assert cases and all(c["devices"][0].startswith("cuda") and c["devices"][1] == "cpu" for c in cases), cases
    for c in cases:
        assert min(c["sizes"]) > 0 and sum(c["sizes"]) == 48, c
        assert c["param_rel_err"] <= max(1e-5, 2 * (c["device_rel_err"] or 0)), c


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_an_overflow_on_one_rank_is_skipped_by_both_and_they_end_equal(tmp_path, precision):
    ranks = two_ranks("api_overflow.py", "API_OVERFLOW", tmp_path,
                      {**hosts_env(), "HVDHETERO_TEST_PRECISION": precision})
    assert ranks[0]["device"].startswith("cuda") and ranks[1]["device"] == "cpu", ranks
    for r in ranks:
        assert r["seen"]["overflowed"] == {"unchanged": True, "scale": [1024.0, 512.0]}, r
        assert r["seen"]["after"]["unchanged"] is False, r
        assert r["skipped"] == 1
    assert ranks[0]["digest"] == ranks[1]["digest"]


def test_a_run_killed_mid_epoch_resumes_bit_exact_with_the_cuda_rng_state(gpu_inventory, tmp_path):
    """--deterministic: CUDA's default convolution kernels add in whatever order threads finish."""
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    args = ["--inventory", str(gpu_inventory), *EXACT, "--deterministic"]
    run_cmd([VENV_BIN / "invoke", "train", *args, "--run-dir", whole, "--", "--repeat", "4"], timeout=900)
    killed_after_step(args, cut, 50)
    newest = checkpoint.newest(cut)
    assert newest is not None and not newest[1]["epoch_done"], newest
    rngs = newest[1]["rng"]
    assert "cuda" in rngs[0] and "cuda" not in rngs[1], "the CUDA rank's RNG state (dropout's) is in the checkpoint"
    run_cmd([VENV_BIN / "invoke", "train", "--resume", cut], timeout=900)
    a, b = end_record(whole), end_record(cut)
    assert a["param_digests"] == b["param_digests"] and a["test_accuracy"] == b["test_accuracy"], (a, b)


def test_diloco_with_overlapped_exchanges_trains_across_the_cuda_and_cpu_ranks(gpu_inventory, tmp_path):
    train(gpu_inventory, tmp_path, "--epochs", "6", "--sync", "diloco:4", "--overlap-sync", "--", "--repeat", "4")
    records = metrics.records(tmp_path / "metrics.jsonl")
    start, end = records[0], records[-1]
    assert start["devices"][0].startswith("cuda") and start["devices"][1].startswith("cpu"), start["devices"]
    assert end["event"] == "end" and len(set(end["param_digests"])) == 1, end
    assert end["test_accuracy"] >= 0.95, end


def test_a_gradscaler_of_the_scripts_own_on_the_cuda_rank_beside_the_cpu_rank(tmp_path):
    """GradScaler("cuda") in both ranks' script: enabled on the CUDA rank, disabled (scale 1) on
    the CPU rank. With micro-batches, bit for bit the same run without it until the CPU rank's
    inf, which both skip; the job's own fp16 scale keeps what a script accumulates; under
    local:2 a rank's own skip leaves the rounds aligned (tests/test_api.py, on two CPU ranks)."""
    cases = two_ranks("api_scalers.py", "API_SCALERS", tmp_path, hosts_env())
    assert [r["device"].split(":")[0] for r in cases["scaler-micro"]] == ["cuda", "cpu"], cases["scaler-micro"]
    ref, mine = cases["ref-micro"], cases["scaler-micro"]
    for r in (0, 1):
        assert mine[r]["digests"][:3] == ref[r]["digests"][:3] and mine[r]["digests"][3] == mine[r]["digests"][2]
        assert mine[r]["step"] == 4
    assert mine[0]["scales"] == [1024.0, 2048.0, 2048.0, 1024.0] and mine[1]["scales"] == [1.0] * 4, mine
    for name in ("scaler-accumulate", "lossscale-accumulate"):
        assert [r["digests"] for r in cases[name]] == [r["digests"] for r in cases["ref-accumulate"]], name
    local = cases["scaler-local"]
    assert [r["step"] for r in local] == [4, 4] and local[0]["digests"][-1] == local[1]["digests"][-1], local


@pytest.mark.parametrize("script, args, precision", [
    ("cifar10_resnet.py", ["--fake-data", "512", "--epochs", "1", "--batch-size", "128", "--workers", "0"], "fp16"),
    ("char_transformer.py", ["--epochs", "1", "--max-chars", "20000"], "bf16"),
], ids=["cifar10-resnet18-fp16", "char-transformer-bf16"])
def test_the_examples_run_through_script_on_the_cuda_and_cpu_ranks(gpu_inventory, tmp_path, script, args, precision):
    """Last, and one precision each (fp32 is the tests' above): they take the longest."""
    train(gpu_inventory, tmp_path, "--script", str(ROOT / "examples" / script), "--precision", precision, "--", *args)
    records = metrics.records(tmp_path / "metrics.jsonl")
    assert records[-1]["event"] == "end" and len(set(records[-1]["param_digests"])) == 1, records[-1]
    assert records[0]["devices"][0].startswith("cuda"), records[0]["devices"]
