"""ci/testhosts: real sshd in network namespaces, reached from hvdt-launch, and a clean teardown.

Namespace names are global, so when another state dir (a session fixture) already has the hosts
up, the test borrows them: it checks them and that a second state is refused, without `down`.
"""

import os
import uuid
from pathlib import Path

import pytest

from conftest import ROOT, run_cmd

TESTHOSTS = ROOT / "ci" / "testhosts"
pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root: network namespaces and sshd")]


def run_testhosts(*args, check=True):
    return run_cmd(["python3", TESTHOSTS, *args], timeout=60, check=check)


def ssh(state, *argv, check=True):
    return run_cmd(["ip", "netns", "exec", "hvdt-launch", "ssh", "-F", state / "ssh_config", *argv],
                   timeout=30, check=check)


def test_up_ssh_down_cycle(tmp_path):
    status = run_testhosts("status", check=False)
    owner = next((line.split(": ", 1)[1] for line in status.stdout.splitlines() if line.startswith("state: ")), None)
    borrowed = status.returncode == 0 and owner is not None
    state = Path(owner) if borrowed else tmp_path / "state"

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

    if borrowed:
        refused = run_testhosts("up", "--state", tmp_path / "other", check=False)
        assert refused.returncode != 0 and "down --state" in refused.stderr
        return
    run_testhosts("down", "--state", state)
    assert run_testhosts("status", check=False).stdout.strip() == "testhosts: nothing up"
    assert "hvdt-" not in run_cmd(["ip", "netns", "list"], timeout=10).stdout
    assert not state.exists() and not list(Path("/etc").glob("netns/hvdt-*"))
    run_testhosts("down", "--state", state)  # safe when nothing is up
