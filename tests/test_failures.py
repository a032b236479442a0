"""A rank that dies or goes silent ends the job with one message naming it, its newest
checkpoint and the command that resumes; nothing of the job is left running. Real ranks, real
signals (SIGKILL; SIGSTOP as a sleeping laptop)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import EXACT, ROOT, VENV_BIN, left_in_namespaces, left_running, requires_root, run_cmd, train_across
from hvdhetero import metrics
from hvdhetero.cluster import checkout
from hvdhetero.bench.recovery import job_pids
from hvdhetero.rank import checkpoint

pytestmark = pytest.mark.slow


def leftover(run_dir: Path) -> list[int]:
    return list(job_pids(run_dir).values())


LONG = ["--epochs", "50", "--checkpoint-every", "20"]
"""A run that outlasts any test: 50 epochs of 90 steps, a checkpoint every 20 steps."""


def started(run_dir: Path, args=LONG, cwd: Path = ROOT) -> subprocess.Popen:
    """`invoke train ARGS` (90 steps an epoch), once its first checkpoint is written; from a
    `cwd` other than the checkout as `invoke -r CHECKOUT train` (a project folder of one's own)."""
    root = [] if cwd == ROOT else ["-r", str(ROOT)]
    proc = subprocess.Popen([str(VENV_BIN / "invoke"), *root, "train", *args, "--run-dir", str(run_dir), "--",
                             "--repeat", "4"], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 180
    while not checkpoint.listed(run_dir) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    assert checkpoint.listed(run_dir) and len(job_pids(run_dir)) == 2, "the run did not get going"
    return proc


def ended(proc: subprocess.Popen, within: float) -> tuple[str, float]:
    t0 = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=within + 60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return out, time.monotonic() - t0


def test_a_rank_killed_ends_the_job_with_one_message_and_the_resume_command_which_ends_as_undisturbed(tmp_path,
                                                                                                     exact_whole):
    run_dir = tmp_path / "run"
    proc = started(run_dir, EXACT)
    os.kill(job_pids(run_dir)[1], signal.SIGKILL)
    out, took = ended(proc, 30)
    assert proc.returncode == 1 and took < 30, (took, out[-3000:])
    assert "error: rank 1 on host local killed by signal 9 (SIGKILL); the other ranks were stopped" in out, out[-3000:]
    assert f"its output: {run_dir / 'rank-1.log'}" in out and (run_dir / "rank-1.log").exists()
    assert "newest checkpoint: " + str(run_dir / "checkpoints") in out
    assert f"resume with: invoke train --resume {run_dir}" in out
    assert "Traceback" not in out and "RuntimeError: Horovod detected" not in out, out[-3000:]
    assert not leftover(run_dir)
    # the command it printed, run: the resumed run ends as one never interrupted (same parameters)
    run_cmd([VENV_BIN / "invoke", "train", "--resume", run_dir], timeout=600)
    a, b = (metrics.records(d / "metrics.jsonl")[-1] for d in (exact_whole, run_dir))
    assert a["event"] == b["event"] == "end", (a, b)
    assert a["param_digests"] == b["param_digests"] and a["test_accuracy"] == b["test_accuracy"], (a, b)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=["SIGTERM", "SIGHUP", "Ctrl-C"])
def test_kill_to_the_launcher_stops_the_job_says_how_to_resume_and_leaves_nothing(tmp_path, signum):
    """`kill PID` of `invoke train` (or its terminal closed) stops the ranks; Python's default for
    these signals runs no cleanup, which left horovodrun and both ranks training on (seen when a
    benchmark was killed). Ctrl-C reaches the terminal's whole process group: it ended in Invoke's
    silent exit 1, no word of the stop or the resume. SIGTERM's run goes from a project folder of
    one's own (`invoke -r CHECKOUT train`): the resume command it prints runs there, `-r` and all
    (it said `invoke train --resume`, which Invoke cannot find a tasks.py for there)."""
    run_dir = tmp_path / "run"
    project = tmp_path / "project" if signum == signal.SIGTERM else ROOT
    project.mkdir(exist_ok=True)
    proc = started(run_dir, cwd=project)
    if signum == signal.SIGINT:
        os.killpg(proc.pid, signum)  # as a terminal's Ctrl-C: every process of the foreground group
    else:
        os.kill(proc.pid, signum)  # the launcher alone, not its process group
    out, took = ended(proc, 30)
    name = "Ctrl-C (SIGINT)" if signum == signal.SIGINT else signal.Signals(signum).name
    assert proc.returncode == 128 + signum and took < 30, (proc.returncode, took, out[-3000:])
    invoke = "invoke" if project == ROOT else checkout.invoke(project)  # `invoke -r ROOT` (~/ where home holds it)
    assert invoke.startswith("invoke -r ") or project == ROOT, invoke
    assert f"hvdhetero: {name}: the job was stopped" in out and f"resume with: {invoke} train --resume {run_dir}" in out
    assert "Traceback" not in out, out[-3000:]
    assert not leftover(run_dir)
    if project != ROOT:  # the command as printed, where it was printed (--dry-run: it starts nothing)
        said = re.search(r"resume with: (.*)$", out, re.M).group(1)
        dry = run_cmd(["bash", "-c", f"{said} --dry-run"], cwd=project, timeout=60,
                      env={"PATH": f"{VENV_BIN}:{os.environ['PATH']}"})
        assert "horovodrun" in dry.stdout, dry.stdout
    # horovodrun and its helpers too: every process of the job names the run directory
    assert not (left := left_running(run_dir)), left


def test_a_frozen_rank_ends_the_job_within_a_minute_and_leaves_nothing_behind(tmp_path):
    """SIGSTOP (a laptop's lid closed): the rank sends nothing and closes nothing. Horovod alone
    took 253 s to give up; the heartbeat watchdog gives up after 45 s of silence."""
    run_dir = tmp_path / "run"
    proc = started(run_dir)
    frozen = job_pids(run_dir)[1]
    os.kill(frozen, signal.SIGSTOP)
    try:
        out, took = ended(proc, 60)
    finally:
        try:
            os.kill(frozen, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert proc.returncode == 1 and took < 60, (took, out[-3000:])
    assert "error: rank 1 on host local: no response for 4" in out and "(frozen, asleep or cut off)" in out, out[-3000:]
    assert f"resume with: invoke train --resume {run_dir}" in out
    time.sleep(1)
    assert not leftover(run_dir), "the frozen rank was killed too"


@pytest.mark.alone
def test_slow_steps_are_not_taken_for_a_frozen_rank(tmp_path):
    """A step of 15 s with the silence limit at 10 s (a heartbeat every 5 s): the heartbeat comes
    from a thread of its own, which a busy step does not hold up."""
    proc = run_cmd([VENV_BIN / "invoke", "train", "--script", ROOT / "tests" / "scripts" / "slow_step.py",
                    "--run-dir", tmp_path, "--micro-batch", "0", "--", "15"], env={"HVDHETERO_SILENT_S": "10"},
                   timeout=300)
    assert "slow steps done" in proc.stdout


@pytest.mark.alone
def test_a_rank_whose_script_returned_is_not_taken_for_a_frozen_one(tmp_path):
    proc = run_cmd([VENV_BIN / "invoke", "train", "--script", ROOT / "tests" / "scripts" / "main_lingers.py",
                    "--run-dir", tmp_path, "--", "15"], env={"HVDHETERO_SILENT_S": "8"}, timeout=300)
    assert "rank 0 finished its own work" in proc.stdout
    # It joined the job but prepared no model: said once, by rank 0, since nothing else would
    assert proc.stdout.count("hvdhetero: the script never called job.prepare(model, optimizer, dataset, "
                             "global_batch=...): each of the 2 ranks ran it on its own") == 1, proc.stdout


@requires_root
def test_across_namespaced_hosts_a_link_down_ends_the_job_within_60_s_and_nothing_is_left(provisioned, tmp_path):
    """Without --elastic: h2's link goes down (Wi-Fi gone) and stays down past the bound. Its rank
    sends nothing and closes nothing; the job ends within 60 s with the message naming h2's rank
    and the resume command. Once the link is back, the rank stranded on h2 is gone too (killed
    over SSH, or ended by itself with its launcher gone). The silence limit is 15 s here (elastic's),
    not the 45 s default, which the frozen rank's test above waits out: what this test adds is
    the cut link, not the bound."""
    inventory, _ = provisioned
    run_dir = tmp_path / "run"  # /tmp is shared with the test hosts: rank 0 (h1) writes here
    proc = train_across(inventory, run_dir, "--checkpoint-every", "20", "--script",
                        ROOT / "tests" / "scripts" / "paced_digits.py", "--", "70", "0.05",
                        env={"HVDHETERO_SILENT_S": "15"})
    link = ["ip", "netns", "exec", "hvdt-h2", "ip", "link", "set", "enp3s0"]
    try:
        deadline = time.monotonic() + 300
        while not checkpoint.listed(run_dir) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert checkpoint.listed(run_dir), "the run did not get going"
        subprocess.run([*link, "down"], check=True, timeout=30)
        try:
            out, took = ended(proc, 60)
        finally:
            subprocess.run([*link, "up"], check=True, timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1 and took < 40, (took, out[-3000:])
    assert re.search(r"error: rank \d on host h2: no response for 1\d s", out), out[-3000:]
    assert f"resume with: invoke train --resume {run_dir}" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    deadline = time.monotonic() + 90  # the stranded rank: gone once its host answers again
    while time.monotonic() < deadline:
        left = left_in_namespaces(run_dir)
        if not left:
            break
        time.sleep(2)
    assert not left, left
