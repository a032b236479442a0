"""invoke train --elastic: a rank killed or frozen is dropped and the others go on from their last
commit; a host that comes back rejoins; below --min-hosts the job ends with the usual message.
Real horovodrun ranks (this machine's two slots run as two hosts, localhost and 127.0.0.1), real
signals; after each, no process of the job is left."""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from conftest import ROOT, VENV_BIN, left_in_namespaces, requires_root, run_cmd, train_across
from hvdhetero.bench.recovery import job_pids, records, recovered, start, stop, under_way
from hvdhetero.cluster import elastic_hosts, launch
from hvdhetero.cluster import inventory as inv
from hvdhetero.cluster.inventory import Host
from hvdhetero.config import JobConfig
from hvdhetero.rank import checkpoint
from test_api import two_ranks

PACED = str(ROOT / "tests" / "scripts" / "paced_digits.py")
RUN = ["--script", PACED, "--", "20", "0.05"]
"""20 epochs of 23 steps, each at least 50 ms on every rank (about 25 s undisturbed): as long
with one rank as with two, so that a host is dropped and let back before the end."""
WHOLE = ["--script", PACED, "--", "20", "0"]
"""RUN's undisturbed reference, unpaced: a step's sleep changes none of its numbers, only the time."""


def run_long(stop_file):
    """Across the namespaced hosts: up to 70 paced epochs (outlasting 60 s frozen, or 60 s of
    link down, and the rejoin after it), ended at the first epoch's end once `stop_file` exists:
    the test writes it when it has seen the rejoin."""
    return ["--script", PACED, "--", "70", "0.05", str(stop_file)]


@pytest.mark.parametrize("args, message", [
    (["--min-hosts", "2"], "--min-hosts and --commit-every go with --elastic"),
    (["--commit-every", "5"], "--min-hosts and --commit-every go with --elastic"),
    (["--elastic", "--min-hosts", "3"], "--min-hosts 3 is more than the 2 hosts of the job (local-1, local-2)"),
    (["--elastic", "--commit-every", "0"], "--commit-every must be an integer >= 1"),
    (["--elastic", "--sync", "auto"], "--elastic needs a fixed --sync mode, got --sync auto"),
])
def test_bad_elastic_options_stop_before_anything_starts(args, message, tmp_path):
    proc = run_cmd([VENV_BIN / "invoke", "train", *args, "--run-dir", tmp_path / "run", "--dry-run"], check=False,
                   timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, (proc.returncode, proc.stderr)
    assert not (tmp_path / "run").exists()


def test_every_fixed_sync_mode_is_elastic(tmp_path):
    """local/diloco (overlapped, with merged inner steps too) commit at rounds' ends: accepted."""
    proc = run_cmd([VENV_BIN / "invoke", "train", "--elastic", "--sync", "diloco:4", "--overlap-sync", "--inner-steps",
                    "by-speed", "--run-dir", tmp_path / "run", "--dry-run"], timeout=60)
    argv = shlex.split(next(line for line in proc.stdout.splitlines() if "--job-json" in line))
    job = JobConfig.from_json(argv[argv.index("--job-json") + 1])
    assert job.elastic and job.sync == "diloco:4" and job.overlap_sync and job.inner_steps == "by-speed", job


def test_the_elastic_command_runs_this_machines_two_slots_as_two_hosts():
    inventory = inv.load(ROOT / "inventory.yaml")
    config = JobConfig(run_dir="/tmp/run", elastic=True)
    argv, _ = launch.command(inventory, inventory.select(None), config, launch.recipe([]),
                             launcher_python="/opt/venv/bin/python")
    assert argv[:20] == ["/opt/venv/bin/python", "-m", "hvdhetero.cluster.horovodrun", "-np", "2", "--min-np", "1",
                         "--max-np", "2", "--host-discovery-script", "/tmp/run/discover-hosts.py",
                         "--blacklist-cooldown-range", "5", "60", "--elastic-timeout", "60", "--gloo",
                         "--start-timeout", "120", "--gloo-timeout-seconds"]
    assert argv[20] == "20" and "-H" not in argv
    hosts = JobConfig.from_json(argv[argv.index("--job-json") + 1]).hosts
    assert {a: h["name"] for a, h in hosts.items()} == {"localhost": "local-1", "127.0.0.1": "local-2"}
    # one machine as two hosts: each rank its half of the cores, as two ranks of one host get
    assert {a: h["machine_share"] for a, h in hosts.items()} == {"localhost": [0, 2], "127.0.0.1": [1, 2]}


def test_the_discovery_script_lists_the_hosts_that_answer(tmp_path):
    """This machine always; another host when its SSH port takes a TCP connection (127.0.0.2 and
    .3 stand for two hosts here: one with a listening port, one whose port refuses)."""
    listening = socket.create_server(("127.0.0.2", 0))
    closed = socket.create_server(("127.0.0.3", 0))
    closed_port = closed.getsockname()[1]
    closed.close()
    hosts = [Host("here", "localhost", slots=2), Host("up", "127.0.0.2", port=listening.getsockname()[1]),
             Host("down", "127.0.0.3", port=closed_port)]
    script = elastic_hosts.write_discovery(tmp_path / elastic_hosts.DISCOVERY, hosts, str(VENV_BIN / "python"))
    try:
        out = subprocess.run([str(script)], capture_output=True, text=True, timeout=30, check=True).stdout
    finally:
        listening.close()
    assert out.split() == ["localhost:2", "127.0.0.2:1"], out


def test_the_watch_kills_a_silent_rank_even_a_stopped_one_and_retries_a_host_that_did_not_answer():
    """A SIGSTOPped process (a frozen rank) dies of SIGKILL; for a remote host the kill command
    (ssh in a job; here a local stand-in) is retried until it works."""
    here, there = subprocess.Popen(["sleep", "120"]), subprocess.Popen(["sleep", "120"])
    os.kill(here.pid, signal.SIGSTOP)
    tries = []

    def kill_argv(host, pid):  # the first try fails, as ssh to a host that is asleep
        tries.append(pid)
        return ["false"] if len(tries) == 1 else ["kill", "-KILL", str(pid)]

    said = []
    watch = elastic_hosts.Watch([Host("pc", "localhost"), Host("mac", "10.0.0.9")], 2, kill_argv, say=said.append)
    watch.beat({"rank": 0, "host": "pc", "pid": here.pid})
    watch.beat({"rank": 1, "host": "mac", "pid": there.pid})
    watch.silent(0, 16.0)
    watch.silent(1, 17.0)
    try:
        assert here.wait(timeout=10) == -signal.SIGKILL
        assert watch.finish(within=20) == [] and there.wait(timeout=10) == -signal.SIGKILL and len(tries) == 2
    finally:
        for proc in (here, there):
            proc.kill()
    assert said[0].startswith("hvdhetero: elastic: rank 0 on host pc: no response for 16 s (frozen, asleep or cut off)")
    assert watch.too_few({5: (0.0, "pc")}) and not watch.too_few({5: (0.0, "pc"), 6: (0.0, "mac")})


@pytest.mark.slow
def test_an_overlapped_diloco_commit_completes_when_its_round_lands_and_holds_what_a_flush_would(tmp_path):
    """tests/jobs/elastic_commit.py: --sync diloco:2 --overlap-sync, a commit due at step 5 is taken
    at the round's end (step 6) without waiting for that round, which is still in flight; it is
    completed when the round lands (step 8) and then holds, bit for bit, the state of the same run
    flushed at step 6; a fresh Job's prepare restores it on a survivor and on a newcomer (rank
    0's commit)."""
    for rank, r in enumerate(two_ranks("elastic_commit.py", "ELASTIC_COMMIT", tmp_path)):
        seen = {int(k): v for k, v in r["seen"].items()}
        # (the commit held, a round in flight, rounds applied) after each step: nothing waited at 6
        assert seen[6] == [0, True, 2] and seen[7] == [0, True, 2] and seen[8] == [6, True, 3], seen
        assert r["committed_step"] == r["step"] == r["round_origin"] == 6 and not r["unsettled"], r
        assert r["rounds"] == r["applied"] == 3 and r["outer_momentum"] > 0, r  # Nesterov's buffer in it
        assert r["model"] == r["sync"] == r["optimizer"] == [], r  # anchor, outer state, counts, weights
        assert bool(r["own_optimizer"]) == (rank == 1), r  # the newcomer's own AdamW state differed


def finished(proc: subprocess.Popen, within: float) -> str:
    try:
        out, _ = proc.communicate(timeout=within)
    except subprocess.TimeoutExpired:
        out = stop(proc)
        pytest.fail(f"the job did not end within {within} s:\n{out[-4000:]}")
    return out


def accuracy(run_dir) -> float:
    """Where the run's test accuracy ended: the mean over its last 5 epochs. One epoch's (360
    test samples) swings by 1-2 points from epoch to epoch late in a run (0.964-0.983 over one
    killed diloco:4 run's last 8 epochs), enough to fail a 2-point comparison by the draw."""
    last = [r["test_accuracy"] for r in records(run_dir, "log") if "test_accuracy" in r][-5:]
    return sum(last) / len(last)


@pytest.mark.alone
@pytest.mark.slow
def test_a_killed_rank_is_dropped_the_job_completes_and_the_host_rejoins(tmp_path):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    run_cmd([VENV_BIN / "invoke", "train", "--run-dir", whole, *WHOLE], timeout=300)
    proc = start(cut, *RUN)
    under_way(proc, cut)
    sent = time.time()
    os.kill(job_pids(cut, by="HOROVOD_HOSTNAME")["127.0.0.1"], signal.SIGKILL)  # local-2's
    out = finished(proc, 300)
    assert proc.returncode == 0, out[-4000:]
    dropped_line = r"hvdhetero: elastic: rank \d on host local-2 killed by signal 9 \(SIGKILL\): host dropped"
    assert re.search(dropped_line, out), out[-4000:]
    assert "hvdhetero: elastic: dropped local-2; continuing on 1 rank(s) (local-1) from the commit at step" in out
    dropped = recovered(cut, sent, within=0)
    assert dropped["hosts"] == ["local-1"] and dropped["redone_steps"] <= 10, dropped
    assert dropped["time"] - sent < 30, dropped["time"] - sent
    # the survivor's collective failed as the killed rank's connection closed (our Gloo patch
    # 0009), not at Gloo's timeout 20 s later
    logs = "".join(p.read_text(errors="replace") for p in cut.glob("rank-*.log"))
    assert re.search(r"Connection to rank \d lost: ", logs) and "Timed out waiting" not in logs, logs[-3000:]
    # the killed host is listed again: after its cooldown it rejoins at a commit
    assert "joined local-2; continuing on 2 rank(s) (local-1, local-2)" in out, out[-4000:]
    assert abs(accuracy(cut) - accuracy(whole)) < 0.02 and accuracy(whole) > 0.95, (accuracy(cut), accuracy(whole))
    cores = os.cpu_count() // 2
    assert records(whole, "start")[0]["devices"] == [f"cpu ({cores} thread{'s' if cores != 1 else ''})"] * 2, \
        "the two hosts share the cores"
    assert "Traceback" not in out and "uncaught exception" not in out, out[-4000:]
    time.sleep(1)
    assert not job_pids(cut)


@pytest.mark.slow
def test_a_rank_killed_in_the_middle_of_a_large_transfer_is_dropped_and_the_survivor_completes(tmp_path):
    """Every step reduces 128 MB over loopback, so the kill most likely lands in the middle of a
    transfer, where the survivor's Gloo pair holds the buffer it was reading into or writing
    from (our Gloo patch 0010 lets go of them when the dead peer's connection closes: held, they
    could keep the survivor spinning in that buffer's destructor). The spin itself was never
    seen here: 3 kills at different moments passed on the build without 0010 too."""
    proc = start(tmp_path, "--script", str(ROOT / "tests" / "scripts" / "wide_exchange.py"), "--", "3")
    under_way(proc, tmp_path)
    sent = time.time()
    os.kill(job_pids(tmp_path, by="HOROVOD_HOSTNAME")["127.0.0.1"], signal.SIGKILL)  # local-2's
    dropped = recovered(tmp_path, sent, within=60)
    out = finished(proc, 240)
    assert dropped is not None and dropped["hosts"] == ["local-1"], out[-4000:]
    assert proc.returncode == 0 and records(tmp_path, "end"), out[-4000:]
    logs = "".join(p.read_text(errors="replace") for p in tmp_path.glob("rank-*.log"))
    assert re.search(r"Connection to rank \d lost: ", logs), logs[-3000:]
    time.sleep(1)
    assert not job_pids(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("sync", [["--sync", "diloco:4"], ["--sync", "local:4", "--overlap-sync"]],
                         ids=["diloco", "local-overlapped"])
@pytest.mark.alone
def test_under_local_or_diloco_a_killed_rank_is_dropped_the_round_restarts_and_the_host_rejoins(sync, tmp_path):
    """The kill test under --sync local/diloco: commits are taken between rounds (overlapped: once
    the round in flight landed); the survivor abandons the exchange it was in and restarts the
    round from the commit, alone, then with the host back. Same steps, same global batch: the
    test accuracy is the undisturbed run's within 2 points, as under step sync."""
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    run_cmd([VENV_BIN / "invoke", "train", "--elastic", "--run-dir", whole, *sync, *WHOLE], timeout=300)
    proc = start(cut, *sync, *RUN)
    under_way(proc, cut)
    deadline = time.monotonic() + 120
    while not records(cut, "epoch") and time.monotonic() < deadline:  # commits taken at rounds' ends since
        time.sleep(0.1)
    sent = time.time()
    os.kill(job_pids(cut, by="HOROVOD_HOSTNAME")["127.0.0.1"], signal.SIGKILL)  # local-2's
    out = finished(proc, 300)
    assert proc.returncode == 0, out[-4000:]
    assert "hvdhetero: elastic: dropped local-2; continuing on 1 rank(s) (local-1) from the commit at step" in out
    dropped = recovered(cut, sent, within=0)
    assert dropped["hosts"] == ["local-1"] and dropped["time"] - sent < 30, (dropped, sent)
    # a round's start (every 4 steps from an epoch's, whose evaluation exchanges the partial round)
    assert dropped["step"] >= 23 and dropped["step"] % 23 % 4 == 0, dropped
    assert "joined local-2; continuing on 2 rank(s) (local-1, local-2)" in out, out[-4000:]
    exchanges = records(cut, "exchange")
    assert exchanges and all(sum(e["split"]) == 64 for e in exchanges), exchanges[-3:]
    end = records(cut, "end")[-1]
    assert len(set(end["param_digests"])) == 1, end  # one model at the end, on both ranks again
    print(f"test accuracy {sync}: undisturbed {accuracy(whole):.4f}, killed {accuracy(cut):.4f}, "
          f"redone {dropped['redone_steps']} steps from step {dropped['step']}, went on after "
          f"{dropped['time'] - sent:.1f} s")
    assert abs(accuracy(cut) - accuracy(whole)) < 0.02 and accuracy(whole) > 0.95, (accuracy(cut), accuracy(whole))
    assert "Traceback" not in out and "uncaught exception" not in out, out[-4000:]
    time.sleep(1)
    assert not job_pids(cut)


@pytest.mark.slow
def test_a_frozen_rank_is_killed_and_the_others_go_on_within_60_s(tmp_path):
    proc = start(tmp_path, *RUN)
    under_way(proc, tmp_path)
    frozen = job_pids(tmp_path, by="HOROVOD_HOSTNAME")["localhost"]  # local-1's
    sent = time.time()
    os.kill(frozen, signal.SIGSTOP)
    try:
        went_on = recovered(tmp_path, sent, within=90)
    finally:
        try:
            os.kill(frozen, signal.SIGCONT)
        except ProcessLookupError:
            pass
        out = stop(proc)  # it went on (or not): the rest of the run is the kill test's
    assert went_on is not None and went_on["time"] - sent < 60 and went_on["hosts"] == ["local-2"], (went_on, sent)
    silent_line = r"rank \d on host local-1: no response for 1\d s \(frozen, asleep or cut off\): stopping it"
    assert re.search(silent_line, out), out[-4000:]
    time.sleep(1)
    assert not job_pids(tmp_path)


@pytest.mark.slow
def test_below_min_hosts_the_job_ends_with_the_failure_message(tmp_path):
    proc = start(tmp_path, "--min-hosts", "2", *RUN)
    under_way(proc, tmp_path)
    deadline = time.monotonic() + 60
    while not checkpoint.listed(tmp_path) and time.monotonic() < deadline:  # the first epoch's end
        time.sleep(0.1)
    t0 = time.monotonic()
    os.kill(job_pids(tmp_path, by="HOROVOD_HOSTNAME")["127.0.0.1"], signal.SIGKILL)
    out = finished(proc, 90)
    assert proc.returncode == 1 and time.monotonic() - t0 < 30, (time.monotonic() - t0, out[-4000:])
    assert re.search(r"error: rank \d on host local-2 killed by signal 9 \(SIGKILL\); the other ranks were stopped",
                     out), out[-3000:]
    assert "fewer than --min-hosts 2 hosts were left" in out
    assert f"newest checkpoint: {tmp_path / 'checkpoints'}" in out
    assert f"resume with: invoke train --resume {tmp_path}" in out
    assert "Traceback" not in out, out[-3000:]
    time.sleep(1)
    assert not job_pids(tmp_path)


def asleep_until(pid: int, until: float) -> None:
    """Keep `pid` stopped until `until` (wall time) or until it is dead (a zombie too): once the
    watchdog has killed it, the rest of the laptop's sleep changes nothing but the test's time."""
    while time.time() < until:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return
        if state in ("Z", "X"):
            return
        time.sleep(0.2)


@requires_root
@pytest.mark.slow
def test_across_namespaced_hosts_a_rank_frozen_60_s_is_dropped_and_its_host_rejoins(provisioned, tmp_path):
    """h1 and h2 (ci/testhosts), launched from a third namespace. The rank on h2 is stopped for
    60 s (a laptop asleep; as long as h1 may take to go on, so it goes on while h2 sleeps) or
    until the watchdog has killed it over SSH; h1 goes on within 60 s of the stop, and h2, still
    answering, is started again and rejoins at a commit."""
    inventory, _ = provisioned
    run_dir = tmp_path / "run"  # /tmp is shared with the test hosts: rank 0 (h1) writes the metrics here
    proc = train_across(inventory, run_dir, "--elastic", *run_long(tmp_path / "stop"))
    try:
        under_way(proc, run_dir, after_s=5.0, within=300)
        frozen = job_pids(run_dir, by="HOROVOD_HOSTNAME")["10.213.0.12"]  # h2's rank
        sent = time.time()
        os.kill(frozen, signal.SIGSTOP)
        went_on = recovered(run_dir, sent, within=60)
        asleep_until(frozen, sent + 60)
        try:
            os.kill(frozen, signal.SIGCONT)
        except ProcessLookupError:
            pass  # killed by the watchdog, as it should be
        recovered(run_dir, sent, within=300, hosts=2)  # the rejoin
        (tmp_path / "stop").touch()  # seen it all: the job ends at this epoch's end
        out = finished(proc, 600)
    finally:
        if proc.poll() is None:
            stop(proc)
    assert went_on is not None and went_on["hosts"] == ["h1"], (went_on, sent)
    assert went_on["time"] - sent < 60, went_on["time"] - sent
    assert proc.returncode == 0, out[-4000:]
    assert re.search(r"rank \d on host h2: no response for 1\d s", out), out[-4000:]
    assert "joined h2; continuing on 2 rank(s) (h1, h2)" in out, out[-4000:]
    time.sleep(2)
    assert not (left := left_in_namespaces(run_dir)), left  # no process of the job anywhere


@requires_root
@pytest.mark.slow
@pytest.mark.parametrize("cut", ["rank 0"])
def test_across_namespaced_hosts_a_link_down_30_s_drops_the_host_and_it_rejoins(cut, provisioned, tmp_path):
    """The link of the host holding `cut` goes down for 30 s or more (Wi-Fi gone): its rank cannot be
    killed meanwhile. Its ssh session ends (keepalive) and Gloo's timeout fails the survivor's
    collective, so the other host goes on within 60 s; once the link is up, the old rank is killed
    over SSH and the host rejoins. With rank 0 (Horovod's coordinator) on the cut host, stock
    Horovod's driver waited for the link to come back (our patch 0008). Only rank 0's host is cut
    in CI (2.5 min a case): the same test with a worker's host cut (add "rank 1") passes too, and
    a host dropped and rejoining is what the frozen-rank and killed-rank tests also check."""
    inventory, _ = provisioned
    run_dir = tmp_path / "run"
    proc = train_across(inventory, run_dir, "--elastic", *run_long(tmp_path / "stop"))
    link = None
    try:
        under_way(proc, run_dir, after_s=5.0, within=300)
        by_rank = records(run_dir, "start")[-1]["host_names"]  # elastic puts either host first
        host = by_rank[int(cut.split()[1])]
        survivor = next(h for h in by_rank if h != host)
        link = ["ip", "netns", "exec", f"hvdt-{host}", "ip", "link", "set", inv.load(inventory).host(host).interface]
        sent = time.time()
        subprocess.run([*link, "down"], check=True, timeout=30)
        went_on = recovered(run_dir, sent, within=60)
        # down at least 30 s, and 5 s past the survivor's going on: its ssh keepalive (20 s), Gloo's
        # timeout and the watch (15 s) have all fired, and the cut rank is still there to be killed
        time.sleep(max(0.0, sent + 30 - time.time(), (went_on["time"] + 5 - time.time()) if went_on else 0.0))
    finally:
        if link:
            subprocess.run([*link, "up"], check=True, timeout=30)
    try:
        recovered(run_dir, sent, within=300, hosts=2)  # the rejoin
        (tmp_path / "stop").touch()  # seen it all: the job ends at this epoch's end
        out = finished(proc, 600)
    finally:
        if proc.poll() is None:
            stop(proc)
    assert went_on is not None and went_on["hosts"] == [survivor] and went_on["time"] - sent < 60, (went_on, sent)
    print(f"link of {host} ({cut}) down: {survivor} went on after {went_on['time'] - sent:.1f} s")  # pytest -s
    assert proc.returncode == 0, out[-4000:]
    assert f"joined {host}; continuing on 2 rank(s)" in out, out[-4000:]
    time.sleep(2)
    assert not (left := left_in_namespaces(run_dir)), left  # no process of the job anywhere


@pytest.mark.slow
def test_a_scripts_own_error_is_no_host_failure_the_job_ends_with_it(tmp_path):
    """Under --elastic a rank whose script raises is not dropped (the others would only raise
    too): the job ends with the script's error, as without --elastic."""
    t0 = time.monotonic()
    proc = run_cmd([VENV_BIN / "invoke", "train", "--elastic", "--script", ROOT / "tests" / "scripts" / "raises.py",
                    "--run-dir", tmp_path], check=False, timeout=120)
    assert proc.returncode == 1 and time.monotonic() - t0 < 60, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"error: rank \d on host local-\d failed: ValueError: boom on purpose", proc.stderr), proc.stderr
    assert "host dropped" not in proc.stdout
    time.sleep(1)
    assert not job_pids(tmp_path)
