"""Multi-host, for real: two sshd hosts in network namespaces (ci/testhosts), provisioned over
SSH, checked, and training one model together, launched from a third namespace. Also every
way a host can refuse or be missing. Needs root (CI runs as root)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import shutil
import time
import uuid
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, STATE, VENV_BIN, invoke, launcher, requires_root
from hvdhetero import metrics

pytestmark = [requires_root, pytest.mark.slow]
def variant(inventory: Path, tmp_path: Path, edit) -> Path:
    """A copy of the test inventory changed by `edit(dict)`."""
    data = yaml.safe_load(inventory.read_text())
    edit(data)
    out = tmp_path / "inventory.yaml"
    out.write_text(yaml.safe_dump(data))
    return out


def sshd_log_lines(host: str) -> int:
    return len((STATE / host / "sshd.log").read_text().splitlines())


def test_provision_installs_both_hosts(provisioned):
    _, first = provisioned
    table = first.stdout[first.stdout.index("host "):]
    assert re.search(r"^h1\s+changed\s+venv, torch 2\.14\.1, hvdhetero", table, re.M), table
    assert re.search(r"^h2\s+changed\s+venv, torch 2\.14\.1, hvdhetero", table, re.M), table
    # each step says how long it took (a Mac's first provision takes minutes: where they went)
    took = {m[1]: int(m[2]) for m in re.finditer(r"^(h[12]: torch 2\.14\.1): done in (\d+) s$", first.stdout, re.M)}
    assert took.keys() == {"h1: torch 2.14.1", "h2: torch 2.14.1"} and all(s > 0 for s in took.values()), first.stdout
    print("provision's steps:", *re.findall(r"^h\d: .*: done in \d+ s$", first.stdout, re.M), sep="\n  ")


def test_provision_again_changes_nothing(provisioned):
    inventory, _ = provisioned
    again = invoke("provision", inventory=inventory, check=True)
    assert re.search(r"^h1\s+ok\s+nothing changed$", again.stdout, re.M), again.stdout
    assert re.search(r"^h2\s+ok\s+nothing changed$", again.stdout, re.M), again.stdout


def test_check_is_green(provisioned):
    inventory, _ = provisioned
    proc = invoke("check", inventory=inventory, check=True)
    assert "h1: ok: Python 3.11, torch 2.14.1" in proc.stdout and "interface en0" in proc.stdout
    assert "h2: ok:" in proc.stdout and "interface enp3s0" in proc.stdout
    assert "check: all hosts ready" in proc.stdout


ACROSS = ["--hosts", "h1,h2", "--epochs", "10", "--equal-split"]
"""Digits across h1,h2 at an equal split: the balanced one follows timings, which differ between
runs; this way a run is a pure function of the seed and of what the transport delivers."""


@pytest.fixture(scope="module")
def across(provisioned, tmp_path_factory):
    """One run of ACROSS on the uv transport (the hosts' as provisioned): (its output, its run
    directory), for the NIC test and as the uv side of the uv/tcp comparison."""
    run_dir = tmp_path_factory.mktemp("across") / "uv" / "run"  # rank 0 runs on h1; /tmp is shared with the hosts
    proc = invoke("train", *ACROSS, "--run-dir", run_dir, "--verbose", inventory=provisioned[0], timeout=900,
                  check=True)
    return proc, run_dir


def test_train_across_two_hosts_with_different_nic_names(across):
    """h1's NIC is en0 and its hostname resolves to 127.0.1.1; h2's NIC is enp3s0."""
    proc, run_dir = across
    assert "--network-interfaces hvdtbr0 " in proc.stdout  # the launcher's NIC; ranks set their own
    records = metrics.records(run_dir / "metrics.jsonl")
    start, end = records[0], records[-1]
    assert start["ranks"] == 2 and start["hostnames"] == ["h1", "h2"]
    assert end["test_accuracy"] >= 0.95, end
    assert len(set(end["param_digests"])) == 1


def test_a_users_script_trains_across_hosts_with_its_folder_shipped(provisioned, tmp_path):
    """`invoke train --script` across h1,h2: the script's folder goes to every host over the
    checked SSH, named by its content; a second run copies nothing."""
    inventory, _ = provisioned
    project = tmp_path / "my project"  # a fresh folder, so a fresh digest
    project.mkdir()
    script = project / "user_train.py"
    script.write_text((ROOT / "tests" / "scripts" / "user_train.py").read_text() + f"\n# {uuid.uuid4()}\n")
    (project / "__pycache__").mkdir()
    (project / "__pycache__" / "junk.pyc").write_bytes(b"not shipped")
    run_dir = tmp_path / "run"
    proc = launcher(VENV_BIN / "invoke", "train", "--inventory", inventory, "--hosts", "h1,h2", "--script", script,
                    "--run-dir", run_dir, "--", "--epochs", "12", timeout=900, check=True)
    shipped = re.findall(r"^(h[12]): workdir (copied|unchanged)$", proc.stdout, re.M)
    # (the test hosts share one home: whichever finishes second may find the copy already there)
    assert sorted(h for h, _ in shipped) == ["h1", "h2"] and "copied" in dict(shipped).values(), proc.stdout
    records = metrics.records(run_dir / "metrics.jsonl")
    assert records[0]["hostnames"] == ["h1", "h2"]
    assert records[-1]["test_accuracy"] >= 0.9 and len(set(records[-1]["param_digests"])) == 1, records[-1]
    workdirs = [d for d in Path("/root/.hvdhetero/workdirs").iterdir() if (d / "user_train.py").exists()
                and (d / "user_train.py").read_text() == script.read_text()]
    assert len(workdirs) == 1 and not (workdirs[0] / "__pycache__").exists()
    # the launcher's HOME is not the hosts' (a PC's /home/anna, a Mac's /Users/anna): each rank
    # finds its env and its workdir (~/...) under its own host's home, not under the launcher's
    elsewhere = tmp_path / "launcher-home"
    elsewhere.mkdir()
    again = launcher("env", f"HOME={elsewhere}", VENV_BIN / "invoke", "train", "--inventory", inventory, "--hosts",
                     "h1,h2", "--script", script, "--run-dir", tmp_path / "again", "--", "--epochs", "1",
                     timeout=900, check=True)
    assert re.findall(r"^h[12]: workdir (\w+)$", again.stdout, re.M) == ["unchanged", "unchanged"], again.stdout
    shutil.rmtree(workdirs[0])  # the test hosts share this machine's /root


def test_h1_hostname_resolves_to_loopback_like_ubuntu(hosts):
    out = launcher("ssh", "-F", STATE / "ssh_config", "h1", "getent", "hosts", "h1", timeout=30, check=True)
    assert out.stdout.split()[0] == "127.0.1.1"  # so h1 joining the job needs our patch 0003


def test_push_data_pushes_a_dataset_directory_to_every_host(provisioned, tmp_path):
    inventory, _ = provisioned
    src = tmp_path / "data with space"
    (src / "MNIST" / "raw").mkdir(parents=True)
    (src / "MNIST" / "raw" / "t10k-labels-idx1-ubyte").write_bytes(b"\x00\x01labels")
    dest = "/srv/hvdhost/data"  # each host's own disk
    proc = invoke("push-data", "--src", src, "--dest", dest, inventory=inventory, timeout=120)
    assert proc.returncode == 0 and "h1: ok" in proc.stdout and "h2: ok" in proc.stdout, proc.stdout + proc.stderr
    for host in ("h1", "h2"):
        copied = STATE / host / "srv" / "data" / "MNIST" / "raw" / "t10k-labels-idx1-ubyte"
        assert copied.read_bytes() == b"\x00\x01labels"


def test_provision_reports_every_host_when_one_is_down(provisioned, tmp_path):
    inventory, _ = provisioned
    edited = variant(inventory, tmp_path, lambda d: d["hosts"].update(h3={**d["hosts"]["h2"], "address": "10.213.0.13"}))
    proc = invoke("provision", "--hosts", "h1,h2,h3", inventory=edited, timeout=600)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert re.search(r"^h1\s+ok\s+nothing changed$", proc.stdout, re.M)
    assert re.search(r"^h3\s+unreachable\s+h3 \(root@10.213.0.13:22\): cannot connect", proc.stdout, re.M), proc.stdout


def test_hostile_values_reach_the_remote_shell_quoted(provisioned):
    inventory, _ = provisioned
    hostile = "$(touch /tmp/hvdt-pwned) `touch /tmp/hvdt-pwned`; touch /tmp/hvdt-pwned | x & 'q\""
    Path("/tmp/hvdt-pwned").unlink(missing_ok=True)
    code = ("import subprocess, sys; sys.exit(subprocess.run(['ip', 'netns', 'exec', 'hvdt-launch', "
            "sys.executable, '-c', sys.argv[1], sys.argv[2]]).returncode)")
    body = ("import sys; from hvdhetero.cluster import ssh; from hvdhetero.cluster.inventory import load; "
            f"inv = load({str(inventory)!r}); c = ssh.connect(inv.host('h1'), inv.known_hosts); "
            "r = ssh.run(c, ['printf', '%s', sys.argv[1]]); print(r.stdout, end='')")
    proc = subprocess.run([VENV_BIN / "python", "-c", code, body, hostile], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert proc.stdout == hostile, proc.stderr
    assert not Path("/tmp/hvdt-pwned").exists()


def test_unknown_host_key_is_refused_with_its_fingerprint(provisioned, tmp_path):
    inventory, _ = provisioned
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    edited = variant(inventory, tmp_path, lambda d: d.update(known_hosts=str(empty)))
    before = sshd_log_lines("h1")
    proc = invoke("check", "--hosts", "h1", inventory=edited, timeout=60)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "h1: refused: h1 (10.213.0.11): host key not in" in proc.stdout
    assert re.search(r"ssh-ed25519 SHA256:[A-Za-z0-9+/]{43}", proc.stdout)
    new = (STATE / "h1" / "sshd.log").read_text().splitlines()[before:]
    assert not any("Accepted publickey" in line for line in new), "no login, so no command, may happen"
    assert empty.read_text() == "", "an unknown key is never recorded without the opt-in flag"


def test_changed_host_key_is_refused_showing_both_fingerprints(provisioned, tmp_path):
    inventory, _ = provisioned
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", tmp_path / "other"], check=True)
    other = (tmp_path / "other.pub").read_text().split()
    known = tmp_path / "known_hosts"
    known.write_text(f"10.213.0.11 {other[0]} {other[1]}\n")
    edited = variant(inventory, tmp_path, lambda d: d.update(known_hosts=str(known)))
    proc = invoke("check", "--hosts", "h1", inventory=edited, timeout=60)
    assert proc.returncode == 4
    assert "host key CHANGED" in proc.stdout and proc.stdout.count("SHA256:") >= 2, proc.stdout


def test_key_not_authorized_fails_fast_without_prompt(provisioned, tmp_path):
    inventory, _ = provisioned
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", tmp_path / "stranger"], check=True)
    edited = variant(inventory, tmp_path, lambda d: d["hosts"]["h1"].update(identity=str(tmp_path / "stranger")))
    t0 = time.monotonic()
    proc = invoke("check", "--hosts", "h1", inventory=edited, timeout=60)
    assert proc.returncode == 4 and "no key accepted" in proc.stdout and "passwords are never tried" in proc.stdout
    assert time.monotonic() - t0 < 30


def test_host_down_is_named_and_the_others_still_reported(provisioned, tmp_path):
    inventory, _ = provisioned

    def add_dead_host(d):
        d["hosts"]["h3"] = {**d["hosts"]["h2"], "address": "10.213.0.13"}
    edited = variant(inventory, tmp_path, add_dead_host)
    proc = invoke("check", "--hosts", "h1,h2,h3", inventory=edited, timeout=120)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "h3: unreachable: h3 (root@10.213.0.13:22)" in proc.stdout
    assert "h1: ok:" in proc.stdout and "h2: ok:" in proc.stdout


def test_missing_interface_is_named(provisioned, tmp_path):
    inventory, _ = provisioned
    edited = variant(inventory, tmp_path, lambda d: d["hosts"]["h2"].update(interface="eth9"))
    proc = invoke("check", inventory=edited, timeout=120)
    assert proc.returncode == 1
    assert "h2: failed: h2: network interface 'eth9' not found there (it has: " in proc.stdout
    assert "enp3s0" in proc.stdout


def test_torch_differing_on_one_host_stops_check_and_train(provisioned, tmp_path):
    """h2's env runs torch 2.13.0 (the CPU build beside the pinned 2.14.1 on this machine's disk),
    installed in a folder that a .pth file puts first on that env's path: the env's python sees
    2.13.0 as a replaced torch would look, and taking the .pth away puts h2 back as it was (a
    real replacement took a reinstall of torch 2.14.1 after: ~50 s)."""
    inventory, _ = provisioned
    shadow, pth = "/srv/hvdhost/torch-2.13", "/srv/hvdhost/venv/lib/python3.11/site-packages/00-torch-2.13.pth"
    on_h2 = ["ssh", "-F", STATE / "ssh_config", "h2"]
    launcher(*on_h2, "env", "PIP_NO_INDEX=1", "PIP_FIND_LINKS=/opt/wheels", "/srv/hvdhost/venv/bin/python", "-m",
             "pip", "install", "--quiet", "--no-deps", "--target", shadow, "torch==2.13.0", timeout=600, check=True)
    first = f"import sys; sys.path.insert(0, {shadow!r})"
    launcher(*on_h2, shlex.join(["/srv/hvdhost/venv/bin/python", "-c", "import pathlib, sys; "
                                 "pathlib.Path(sys.argv[1]).write_text(sys.argv[2] + '\\n')", pth, first]),
             timeout=30, check=True)
    try:
        proc = invoke("check", inventory=inventory, timeout=120)
        assert proc.returncode == 1
        assert "h2: torch 2.13.0+cpu, expected 2.14.1 (h1 has 2.14.1" in proc.stdout, proc.stdout
        run_dir = tmp_path / "never"
        train = invoke("train", "--hosts", "h1,h2", "--run-dir", run_dir, inventory=inventory, timeout=120)
        assert train.returncode == 1 and "refusing to go on" in train.stderr
        assert not run_dir.exists(), "no rank may start"
    finally:
        launcher(*on_h2, "rm", "-rf", pth, shadow, timeout=60, check=True)
    assert invoke("check", inventory=inventory, timeout=120).returncode == 0, "h2 is as it was"


def _train_and_allreduce(inventory: Path, run_dir: Path, transport: str, trained=None) -> tuple[dict, dict]:
    """One ACROSS training run (or `trained`: the output of one in `run_dir`) and one allreduce
    job: (end record, digests)."""
    proc = trained or invoke("train", *ACROSS, "--run-dir", run_dir, inventory=inventory, timeout=900, check=True)
    assert f"transport {transport}" in proc.stdout  # the pre-flight's report of both hosts
    end = metrics.records(run_dir / "metrics.jsonl")[-1]
    out = run_dir.parent / f"allreduce-{transport}.json"
    invoke("bench", "--allreduce", "--hosts", "h1,h2", "--transports", transport, "--rounds", "1",
           "--repeats", "2", "--sizes-mb", "1,16", "--out", out, inventory=inventory, timeout=600, check=True)
    result = json.loads(out.read_text())
    assert result["bit_identical"], result  # repeats within the job agree
    return end, {mb: row["sha256"] for mb, row in result["transports"][transport]["sizes"].items()}


def test_uv_and_tcp_builds_train_alike_and_allreduce_bit_identically(provisioned, across, tmp_path):
    """The hosts run the uv transport (the inventory's default). Switching pins.transport to tcp:
    check names the host still on uv, then with both rebuilt the same job ends with bit-identical
    parameters (so the same accuracy) and the allreduce of the same inputs gives the same bits. Last: it re-provisions
    both hosts back to uv."""
    inventory, _ = provisioned
    uv_end, uv_sums = _train_and_allreduce(inventory, across[1], "uv", trained=across[0])
    tcp_inventory = variant(inventory, tmp_path, lambda d: d["pins"].update(transport="tcp"))
    try:
        one = invoke("provision", "--hosts", "h1", inventory=tcp_inventory, timeout=1800)
        assert one.returncode == 0 and re.search(r"^h1\s+changed\s+horovod 0\.28\.1 \(tcp\)", one.stdout, re.M), \
            one.stdout[-3000:] + one.stderr[-3000:]
        mixed = invoke("check", inventory=tcp_inventory, timeout=120)
        assert mixed.returncode == 1, mixed.stdout
        assert ("h2: failed: h2: Horovod built with Gloo transport uv, pins.transport is tcp (h1 has tcp): ranks "
                "with different transports cannot connect; re-provision h2") in mixed.stdout, mixed.stdout
        assert "h1: ok:" in mixed.stdout
        invoke("provision", "--hosts", "h2", inventory=tcp_inventory, timeout=1800, check=True)
        tcp_end, tcp_sums = _train_and_allreduce(tcp_inventory, tmp_path / "tcp" / "run", "tcp")
    finally:
        back = invoke("provision", inventory=inventory, timeout=1800)
        assert back.returncode == 0, back.stdout[-3000:]
    assert tcp_sums == uv_sums
    assert uv_end["test_accuracy"] >= 0.95
    assert tcp_end["test_accuracy"] == uv_end["test_accuracy"]
    assert tcp_end["param_digests"] == uv_end["param_digests"]  # bit-identical models


def test_time_to_accuracy_compares_the_first_host_alone_step_and_a_mode(provisioned, tmp_path):
    """invoke bench --to-accuracy: three real jobs, each trained until its test accuracy reaches
    the target; what it reports is what each run logged."""
    inventory, _ = provisioned
    out = tmp_path / "tta.json"
    proc = invoke("bench", "--to-accuracy", "0.8", "--hosts", "h1,h2", "--sync", "local:4", "--overlap-sync",
                  "--seeds", "0", "--epochs", "4", "--repeat", "4", "--batch-size", "256", "--out", out, "--verbose",
                  inventory=inventory, timeout=900, check=True)
    summary = json.loads(out.read_text())
    rows = {r["way"]: r for r in summary["ways"]}
    assert list(rows) == ["h1 alone", "h1+h2 step", "h1+h2 local:4 overlapped"]
    assert proc.stdout.count("horovodrun -np 1 ") == 1 and proc.stdout.count("horovodrun -np 2 ") == 2
    for row in rows.values():
        assert row["reached"] == 1 and 0 < row["seconds_to_target"], row  # digits: 80% within 4 epochs
        assert 0.0 < row["accuracy_equal_samples"] <= 1.0, row  # the same epoch for all three
        assert row["samples_per_s"] > 0
        assert len(row["each_first_rank_us_per_sample"]) == 1 and row["first_rank_us_per_sample"] > 0, row
    assert "time to test accuracy 80.00%" in proc.stdout and "h1+h2 local:4 overlapped" in proc.stdout
