"""backend mpi on this machine, for real: our own mpirun command starting two CPU ranks from the
MPI env (.venv-mpi: PyPI's Open MPI 4.1, mpi4py, Horovod built with MPI), the recipe and a
user's script trained through it, the same job under Gloo and under MPI ending in the same
parameters, and every Horovod collective on each build we ship."""

import json
import re

import pytest

from conftest import MPI_ENV, ROOT, VENV_BIN, mpi_inventory, run_cmd
from hvdhetero import metrics
from hvdhetero.cluster import mpi

pytestmark = pytest.mark.slow

MPI_PYTHON = MPI_ENV / "bin" / "python"


def mpi_invoke(task, *args, inventory, timeout=600, check=True):
    """`invoke TASK --inventory INVENTORY ARGS` with the MPI env as the launcher's (its mpirun
    starts the job)."""
    return run_cmd([MPI_PYTHON, "-m", "invoke", task, "--inventory", inventory, *args], timeout=timeout, check=check)


def test_the_recipe_trains_digits_through_mpirun(mpi_env, tmp_path):
    run_dir = tmp_path / "run"
    dry = mpi_invoke("train", "--dry-run", "--run-dir", run_dir, inventory=mpi_env)
    assert re.search(r"mpirun (--allow-run-as-root )?--tag-output --bind-to none --mca pml ob1 --mca btl tcp,self ",
                     dry.stdout), dry.stdout
    assert "horovodrun" not in dry.stdout and not run_dir.exists()
    proc = mpi_invoke("train", "--epochs", "10", "--run-dir", run_dir, inventory=mpi_env)
    records = metrics.records(run_dir / "metrics.jsonl")
    start, end = records[0], records[-1]
    assert start["ranks"] == 2 and end["test_accuracy"] >= 0.95, end
    assert len(set(end["param_digests"])) == 1, "ranks in sync"
    assert "test accuracy" in proc.stdout and "rank 1" in proc.stdout  # the live table saw both ranks


def test_a_users_script_trains_through_mpirun_and_sees_the_communicator(mpi_env, tmp_path):
    run_dir = tmp_path / "run"
    proc = mpi_invoke("train", "--script", ROOT / "tests/scripts/user_train.py", "--run-dir", run_dir, "--",
                      "--epochs", "12", inventory=mpi_env)
    end = metrics.records(run_dir / "metrics.jsonl")[-1]
    assert end["test_accuracy"] >= 0.9, end
    assert f"user script: test accuracy {end['test_accuracy']:.4f}" in proc.stdout
    comm = run_cmd([MPI_PYTHON, "-m", "invoke", "train", "--script", ROOT / "tests/scripts/mpi_comm.py",
                    "--inventory", mpi_env, "--run-dir", tmp_path / "comm", "--all-ranks-output"], timeout=300)
    lines = sorted(re.findall(r"MPI_COMM (\{.*\})", comm.stdout))
    assert [json.loads(line) for line in lines] == [{"rank": 0, "size": 2, "sum": 1, "horovod_rank": 0},
                                                     {"rank": 1, "size": 2, "sum": 1, "horovod_rank": 1}]


def test_gloo_and_mpi_train_to_the_same_parameters(mpi_env, tmp_path):
    """Equal split and a fixed seed: the run is a function of what the collectives deliver, and
    a sum of two float32 values is the same whichever engine adds them."""
    ends = {}
    for engine in ("gloo", "mpi", "mpi+gloo-ops"):
        run_dir = tmp_path / engine
        if engine == "gloo":
            run_cmd([VENV_BIN / "invoke", "train", "--epochs", "6", "--equal-split", "--run-dir", run_dir], timeout=600)
        else:  # pins.mpi_ops: who moves the bytes under mpirun
            inventory = mpi_inventory(tmp_path / f"{engine}.yaml", mpi_ops="gloo" if "gloo" in engine else "mpi")
            mpi_invoke("train", "--epochs", "6", "--equal-split", "--run-dir", run_dir, inventory=inventory)
        ends[engine] = metrics.records(run_dir / "metrics.jsonl")[-1]
    for engine in ("mpi", "mpi+gloo-ops"):
        assert ends[engine]["param_digests"] == ends["gloo"]["param_digests"], engine
        assert ends[engine]["test_accuracy"] == ends["gloo"]["test_accuracy"], engine


def _collectives(argv) -> dict:
    proc = run_cmd(argv, timeout=300, check=False)
    lines = re.findall(r"COLLECTIVES (\{[^{}]*\})", proc.stdout)  # mpirun may run two ranks' lines together
    assert proc.returncode == 0 and len(lines) == 2, \
        f"exit {proc.returncode}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    first, second = (json.loads(line) for line in lines)
    assert first == second
    return first


@pytest.mark.parametrize("build", ["gloo-uv", "mpi", "mpi+gloo-ops"])
def test_every_collective_a_script_can_call_gives_the_right_answer(mpi_env, build):
    """hvd.reducescatter aborted both ranks on the uv build (Gloo's halving-doubling needs what
    the uv transport lacks; our patch 0011 sums through allreduce there). Under the MPI controller
    with Gloo moving the bytes, every collective segfaulted before patch 0013."""
    job = ROOT / "tests/jobs/collectives.py"
    if build.startswith("mpi"):
        ops = "gloo" if "gloo" in build else "mpi"
        argv = [MPI_ENV / "bin/mpirun", "--allow-run-as-root", "--bind-to", "none", *mpi.TCP_ONLY,
                "-x", "HOROVOD_CONTROLLER=mpi", "-x", f"HOROVOD_CPU_OPERATIONS={ops}",
                "-np", "2", MPI_PYTHON, job]
    else:
        argv = [VENV_BIN / "horovodrun", "-np", "2", "-H", "localhost:2", "--gloo", "--start-timeout", "60",
                VENV_BIN / "python", job]
    results = _collectives(argv)
    assert results == {name: "ok" for name in results} and len(results) == 16, results


def test_the_allreduce_bench_compares_gloo_and_open_mpi_bit_for_bit(mpi_env, tmp_path):
    """`invoke bench --allreduce --backends gloo,mpi`: the same build and the same seeded inputs
    through horovodrun (Gloo's uv transport) and through our mpirun (Open MPI's TCP)."""
    out = tmp_path / "allreduce.json"
    proc = mpi_invoke("bench", "--allreduce", "--backends", "gloo,mpi", "--transports", "uv", "--sizes-mb", "1,4",
                      "--rounds", "1", "--repeats", "3", "--out", out, inventory=mpi_env)
    assert re.search(r"^mpi\s+4\s+[\d.]+\s+[\d.]+", proc.stdout, re.M), proc.stdout
    assert "mpi / uv throughput: 1 MB" in proc.stdout
    result = json.loads(out.read_text())
    assert set(result["transports"]) == {"uv", "mpi"} and result["bit_identical"] is True, result
    digests = {engine: [row["sha256"] for row in v["sizes"].values()] for engine, v in result["transports"].items()}
    assert digests["uv"] == digests["mpi"]
    bad = mpi_invoke("bench", "--allreduce", "--backends", "nccl", inventory=mpi_env, check=False)
    assert bad.returncode == 2 and "--backends nccl: choose from gloo, mpi" in bad.stdout + bad.stderr
