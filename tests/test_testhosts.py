"""ci/testhosts: real sshd in network namespaces, reached from hvdt-launch, and a clean teardown.

Namespace names are global, so when another state dir (a session fixture) already has the hosts
up, the test borrows them: it checks them and that a second state is refused, without `down`.
"""

import importlib.machinery
import importlib.util
import os
import re
import time
import uuid
from pathlib import Path

import pytest

from conftest import ROOT, requires_root, run_cmd

TESTHOSTS = ROOT / "ci" / "testhosts"


def run_testhosts(*args, check=True):
    return run_cmd(["python3", TESTHOSTS, *args], timeout=60, check=check)


def ssh(state, *argv, check=True):
    return run_cmd(["ip", "netns", "exec", "hvdt-launch", "ssh", "-F", state / "ssh_config", *argv],
                   timeout=30, check=check)


@pytest.mark.alone
@pytest.mark.root
@requires_root
def test_up_ssh_down_cycle(tmp_path):
    status = run_testhosts("status", check=False)
    owner = next((line.split(": ", 1)[1] for line in status.stdout.splitlines() if line.startswith("state: ")), None)
    borrowed = status.returncode == 0 and owner is not None
    state = Path(owner) if borrowed else tmp_path / "state"

    try:
        inventory = run_testhosts("up", "--state", state).stdout.splitlines()[-1]
        assert inventory == str(state / "inventory.yaml")
        assert run_testhosts("up", "--state", state).stdout.splitlines()[-1] == inventory  # idempotent
        text = (state / "inventory.yaml").read_text()
        assert "default_hosts: [h1, h2]" in text and "interface: enp3s0" in text and 'torch: "' in text

        for host, nic in [("h1", "en0"), ("h2", "enp3s0")]:
            out = ssh(state, host, "hostname; ip -o link").stdout.splitlines()
            assert out[0] == host
            assert any(f" {nic}@" in line or f" {nic}:" in line for line in out[1:]), out
        # Separate /srv/hvdhost per host: a file written on h1 is not on h2.
        marker = f"/srv/hvdhost/testhosts-{uuid.uuid4().hex}"
        ssh(state, "h1", f"touch {marker}")
        try:
            assert ssh(state, "h2", f"test -e {marker}", check=False).returncode == 1
        finally:
            ssh(state, "h1", f"rm -f {marker}")
        # Without the key: refused at once, no prompt (BatchMode).
        denied = run_cmd(["ip", "netns", "exec", "hvdt-launch", "ssh", "-F", "/dev/null", "-o", "BatchMode=yes",
                          "-o", "IdentitiesOnly=yes", "-o", "IdentityFile=none", "-o", "ConnectTimeout=5",
                          "-o", f"UserKnownHostsFile={state / 'known_hosts'}", "root@h1", "true"],
                         timeout=30, check=False)
        assert denied.returncode == 255 and "Permission denied" in denied.stderr

        check_own_cores_and_shaped_links(state)

    except BaseException:
        if not borrowed:  # a failed check must not leave hosts up for the next test or run
            run_testhosts("down", "--state", state, check=False)
        raise
    if borrowed:
        refused = run_testhosts("up", "--state", tmp_path / "other", check=False)
        assert refused.returncode != 0 and "down --state" in refused.stderr
        return
    run_testhosts("down", "--state", state)
    assert run_testhosts("status", check=False).stdout.strip() == "testhosts: nothing up"
    assert "hvdt-" not in run_cmd(["ip", "netns", "list"], timeout=10).stdout
    assert not state.exists() and not list(Path("/etc").glob("netns/hvdt-*"))
    run_testhosts("down", "--state", state)  # safe when nothing is up


def allowed_cores(state, host) -> set[int]:
    line = ssh(state, host, "grep Cpus_allowed_list /proc/self/status").stdout.split()[-1]
    cores = set()
    for part in line.split(","):
        lo, _, hi = part.partition("-")
        cores |= set(range(int(lo), int(hi or lo) + 1))
    return cores


def seconds_to_fetch(state, host, megabytes=5) -> float:
    t0 = time.monotonic()
    ssh(state, host, f"head -c {megabytes * 10**6} /dev/zero")
    return time.monotonic() - t0


def check_own_cores_and_shaped_links(state):
    """Hosts that stand for separate machines: a process an SSH login starts on h1 may use only
    h1's cores, h2's others; --rate holds each link to the rate (5 MB at 20 Mbit: 2 s)."""
    machine = set(os.sched_getaffinity(0))
    h1, h2 = allowed_cores(state, "h1"), allowed_cores(state, "h2")
    if len(machine) >= 2:
        assert h1 and h2 and not h1 & h2 and h1 | h2 <= machine, (h1, h2)
        assert len(h1) == len(h2) == len(machine) // 2
    status = run_testhosts("status").stdout
    assert re.search(r"^h1: .*cores [0-9,]+, link unshaped$", status, re.M), status
    # SSH's own round trip (0.5 s on a busy 2-core VM) left out of both: the bytes' time is compared
    login = min(seconds_to_fetch(state, "h1", 0) for _ in range(2))
    free = seconds_to_fetch(state, "h1") - login
    run_testhosts("shape", "--state", state, "--rate", "20mbit")
    try:
        assert re.search(r"^h2: .*link 20Mbit$", run_testhosts("status").stdout, re.M)
        shaped = seconds_to_fetch(state, "h1") - login
    finally:
        run_testhosts("shape", "--state", state, "--off")
    assert shaped >= 1.6 > 3 * free, (shaped, free, login)  # 5 MB at 20 Mbit is 2.0 s; unshaped a fraction
    assert "link unshaped" in run_testhosts("status").stdout
    bad = run_testhosts("shape", "--state", state, "--rate", "fast", check=False)
    assert bad.returncode == 2 and "--rate must be a number and a tc unit" in bad.stderr


def _testhosts_module():
    loader = importlib.machinery.SourceFileLoader("testhosts", str(TESTHOSTS))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("testhosts", loader))
    loader.exec_module(module)
    return module


def test_dedupe_shares_identical_big_files_and_a_replaced_file_stays_the_hosts_own(tmp_path):
    """Two provisioned hosts hold the same torch, each in two envs at different paths; sharing
    its files must not make one host's install land on the other."""
    testhosts = _testhosts_module()
    big, h1, h2 = os.urandom(testhosts.SHARED_MIN_BYTES + 1), tmp_path / "h1", tmp_path / "h2"
    lib = "lib/libtorch.so"
    envs = [h1 / "venv", h2 / "venv", h1 / "venv-mpi", h2 / "mpi/venv"]
    for env in envs:
        (env / "lib").mkdir(parents=True)
        (env / lib).write_bytes(big)
        (env / "stamp").write_text("same small file")  # small: written in place, never shared
    (h1 / "venv/lib/other.so").write_bytes(big)
    (h2 / "venv/lib/other.so").write_bytes(big[:-1] + bytes([big[-1] ^ 0xFF]))  # same size and name, other bytes
    assert testhosts.dedupe(h1, h2) == 3 * len(big)
    assert len({(env / lib).stat().st_ino for env in envs}) == 1 and (h2 / "mpi/venv" / lib).read_bytes() == big
    assert (h1 / "venv/lib/other.so").stat().st_ino != (h2 / "venv/lib/other.so").stat().st_ino
    assert len({(env / "stamp").stat().st_ino for env in envs}) == 4
    assert not list(tmp_path.rglob(".*.dedupe"))
    assert testhosts.dedupe(h1, h2) == 0  # again: nothing left to share
    # h2 installs another torch as pip does (a new file replaces the path): the others keep theirs
    (h2 / "venv/lib/new").write_bytes(b"2.13")
    os.replace(h2 / "venv/lib/new", h2 / "venv" / lib)
    assert all((env / lib).read_bytes() == big for env in envs if env != h2 / "venv")
