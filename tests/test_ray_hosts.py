"""Ray as the cluster across machines, for real: the two namespaced sshd hosts (ci/testhosts, each
on its own core) provisioned with pins.ray, a Ray head started on h1 and h2 joined by `invoke ray
up` from a third namespace, digits and a user's script trained through `--launcher ray`, one
rank's actor killed on h2, and `invoke ray down` leaving no process of either node. The launcher
itself has no Ray: it reaches the driver on h1 over ssh. Needs root (CI runs as root)."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, VENV_BIN, invoke, launcher, left_in_namespaces, requires_root, train_across
from hvdhetero import metrics
from hvdhetero.bench.recovery import job_pids
from hvdhetero.cluster import ray_node
from hvdhetero.rank import checkpoint

pytestmark = [requires_root, pytest.mark.slow]

RAY = "2.60.0"


@pytest.fixture(scope="module")
def ray_hosts(provisioned, tmp_path_factory):
    """The test hosts with pins.ray, provisioned (Ray from their wheelhouse) and a Ray cluster on
    them; after the module, `invoke ray down` and no process of either node left."""
    data = yaml.safe_load(provisioned[0].read_text())
    data["pins"]["ray"] = RAY
    inventory = tmp_path_factory.mktemp("ray-hosts") / "inventory.yaml"
    inventory.write_text(yaml.safe_dump(data))
    first = invoke("provision", inventory=inventory)
    assert first.returncode == 0, first.stdout[-5000:] + first.stderr[-5000:]
    up = invoke("ray", "up", "--hosts", "h1,h2", inventory=inventory, timeout=600)
    sessions = [int(s) for s in re.findall(r"session (\d+)\)$", up.stdout, re.M)]
    try:
        assert up.returncode == 0 and len(sessions) == 2, up.stdout + up.stderr
        yield inventory, first, up, sessions  # a test that starts a node again adds its session
    finally:
        down = invoke("ray", "down", "--hosts", "h1,h2", inventory=inventory, timeout=300)
        assert down.returncode == 0, down.stdout + down.stderr
        left = {sid: ray_node.session_pids(sid) for sid in sessions}  # the hosts share this pid space
        assert not any(left.values()), left


def test_provision_installs_ray_and_ray_up_puts_the_head_on_h1_and_h2_in_it(ray_hosts):
    inventory, first, up, _ = ray_hosts
    for host in ("h1", "h2"):  # from bare hosts Ray is installed now; kept hosts (a developer's re-run) have it
        assert re.search(rf"^{host}\s+(changed\s+ray {re.escape(RAY)}|ok\s+nothing changed)$", first.stdout,
                         re.M), first.stdout
    assert re.search(r"^h1: started in [\d.]+ s \(head, cluster 10\.213\.0\.11:6380, session \d+\)$", up.stdout, re.M)
    assert re.search(r"^h2: started in [\d.]+ s \(worker, cluster 10\.213\.0\.11:6380, session \d+\)$", up.stdout,
                     re.M), up.stdout
    check = invoke("check", "--hosts", "h1,h2", inventory=inventory)  # compares each host's Ray with pins.ray
    assert check.returncode == 0, check.stdout + check.stderr
    status = invoke("ray", "status", "--hosts", "h1,h2", inventory=inventory)
    assert re.search(r"^h2: up, \d+ processes \(worker", status.stdout, re.M), status.stdout


def test_digits_trains_across_the_hosts_through_ray(ray_hosts, tmp_path):
    inventory = ray_hosts[0]
    run_dir = tmp_path / "run"  # /tmp is shared with the test hosts: rank 0 (h1) writes here
    proc = invoke("train", "--hosts", "h1,h2", "--launcher", "ray", "--epochs", "10", "--run-dir", run_dir,
                  inventory=inventory, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    start, end = metrics.records(run_dir / "metrics.jsonl")[0], metrics.records(run_dir / "metrics.jsonl")[-1]
    assert start["ranks"] == 2 and start["hostnames"] == ["h1", "h2"], start
    assert end["test_accuracy"] >= 0.95 and len(set(end["param_digests"])) == 1, end


def test_a_users_script_trains_across_the_hosts_through_ray(ray_hosts, tmp_path):
    inventory = ray_hosts[0]
    run_dir = tmp_path / "run"
    proc = launcher(VENV_BIN / "invoke", "train", "--inventory", inventory, "--hosts", "h1,h2", "--launcher", "ray",
                    "--script", ROOT / "tests/scripts/user_train.py", "--run-dir", run_dir, "--", "--epochs", "12",
                    timeout=900)  # the script's own arguments last
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    end = metrics.records(run_dir / "metrics.jsonl")[-1]
    assert end["test_accuracy"] >= 0.9 and len(set(end["param_digests"])) == 1, end
    assert f"user script: test accuracy {end['test_accuracy']:.4f}" in proc.stdout


def test_killing_h2s_actor_ends_the_job_in_words_within_30_s_and_nothing_is_left(ray_hosts, tmp_path):
    inventory = ray_hosts[0]
    run_dir = tmp_path / "run"
    proc = train_across(inventory, run_dir, "--launcher", "ray", "--checkpoint-every", "20", "--script",
                        ROOT / "tests/scripts/paced_digits.py", "--", "70", "0.05")
    try:
        deadline = time.monotonic() + 300
        while not checkpoint.listed(run_dir) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert checkpoint.listed(run_dir), "the run did not get going"
        rank = job_pids(run_dir)[1]  # h2's (the shared pid space shows it)
        actor = int(Path(f"/proc/{rank}/stat").read_text().rsplit(")", 1)[1].split()[1])
        assert "RankProcess" in Path(f"/proc/{actor}/cmdline").read_text()
        t0 = time.monotonic()
        subprocess.run(["kill", "-KILL", str(actor)], check=True, timeout=10)
        out, _ = proc.communicate(timeout=120)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            subprocess.run(["kill", "-KILL", f"-{proc.pid}"], timeout=10)
    print(f"h2's actor killed: the job ended {took:.1f} s later")  # pytest -s shows it (the note's figures)
    assert proc.returncode == 1 and took < 30, (took, out[-3000:])
    assert len(re.findall(r"^error: rank 1 on host h2 lost its Ray actor", out, re.M)) == 1, out[-3000:]
    assert f"resume with: invoke train --resume {run_dir}" in out and "Traceback" not in out, out[-3000:]
    deadline = time.monotonic() + 30
    while (left := left_in_namespaces(run_dir)) and time.monotonic() < deadline:
        time.sleep(1)
    assert not left, left


def node_session(name: str) -> int:
    """The session of `name`'s Ray node, from the state `invoke ray up` left in its temp dir
    (/tmp is shared with the test hosts)."""
    return json.loads((Path(ray_node.temp_dir(name)) / ray_node.STATE).read_text())["sid"]


@pytest.mark.parametrize("how", ["raylet-killed", "node-frozen"])
def test_h2s_node_dying_or_freezing_ends_the_job_in_words_within_30_s_and_nothing_is_left(ray_hosts, tmp_path, how):
    """h2's Ray node itself fails: its raylet killed (Ray's process manager on that host gone),
    or every process of the node stopped (a laptop's lid closed). Ray's health check (5 missed
    1 s checks, set by invoke ray up) declares the node dead; the job ends with the lost-actor
    message; once the node wakes, nothing of the job is left on any host."""
    inventory, _, _, sessions = ray_hosts
    up = invoke("ray", "up", "--hosts", "h1,h2", inventory=inventory, timeout=600)  # the case before took h2's node
    assert up.returncode == 0, up.stdout + up.stderr
    sid = node_session("h2")
    sessions.append(sid)
    run_dir = tmp_path / "run"
    proc = train_across(inventory, run_dir, "--launcher", "ray", "--checkpoint-every", "20", "--script",
                        ROOT / "tests/scripts/paced_digits.py", "--", "70", "0.05")
    frozen = []
    try:
        deadline = time.monotonic() + 300
        while not checkpoint.listed(run_dir) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert checkpoint.listed(run_dir), "the run did not get going"
        pids = ray_node.session_pids(sid)
        t0 = time.monotonic()
        if how == "raylet-killed":
            raylet = [p for p in pids if "raylet/raylet" in Path(f"/proc/{p}/cmdline").read_text()]
            assert len(raylet) == 1, pids
            subprocess.run(["kill", "-KILL", str(raylet[0])], check=True, timeout=10)
        else:
            frozen = pids
            subprocess.run(["kill", "-STOP", *map(str, frozen)], check=True, timeout=10)
        out, _ = proc.communicate(timeout=120)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            subprocess.run(["kill", "-KILL", f"-{proc.pid}"], timeout=10)
        if frozen:  # the lid opens again
            subprocess.run(["kill", "-CONT", *map(str, frozen)], timeout=10)
    print(f"h2 {how}: the job ended {took:.1f} s later")  # pytest -s shows it (the note's figures)
    assert proc.returncode == 1 and took < 30, (took, out[-3000:])
    assert len(re.findall(r"^error: rank 1 on host h2 lost its Ray actor", out, re.M)) == 1, out[-3000:]
    assert f"resume with: invoke train --resume {run_dir}" in out and "Traceback" not in out, out[-3000:]
    deadline = time.monotonic() + 60
    while (left := left_in_namespaces(run_dir)) and time.monotonic() < deadline:
        time.sleep(1)
    assert not left, left
