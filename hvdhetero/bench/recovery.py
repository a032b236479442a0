"""How long --elastic takes to go on after a rank is killed or frozen, and how much it redoes:

    .venv/bin/python -m hvdhetero.bench.recovery --signal KILL --repeats 5
    .venv/bin/python -m hvdhetero.bench.recovery --signal STOP --repeats 5
    .venv/bin/python -m hvdhetero.bench.recovery --signal KILL --sync diloco:4

Each repeat starts `invoke train --elastic` (digits on this machine's two ranks as two hosts),
sends the signal to rank 1 once training is under way, and reads the survivors' `elastic`
record in metrics.jsonl: seconds from the signal to the record (written as the survivors resume
from their last commit, just before their next step) and the steps redone since that commit.
Then it stops the job and checks that no process of it is left. Prints each repeat and the
medians. Launcher side: the tests (tests/test_elastic.py) use its helpers too.

    .venv/bin/python -m hvdhetero.bench.recovery --accuracy --seeds 0,1,2,3,4

trains the built-in recipe to its end per seed twice, undisturbed and with rank 1 killed half-way
(dropped, then let back after its cooldown), and prints each final test accuracy, the
undisturbed seeds' spread and whether every disturbed run lies within it.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hvdhetero import metrics
from hvdhetero.cluster.checkout import ROOT

INVOKE = Path(sys.executable).parent / "invoke"
LONG = ["--epochs", "30", "--checkpoint-minutes", "0", "--", "--repeat", "4"]
"""A run that outlasts a measurement: 30 epochs of 90 steps."""


def job_pids(run_dir: Path, by: str = "HOROVOD_RANK") -> dict:
    """The job's rank processes on this machine: {rank as horovodrun numbered it: pid}, or by
    another of their environment's variables (HOROVOD_HOSTNAME: the host's address); their
    command line carries the run directory."""
    pids = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if "hvdhetero.rank.runner" in cmdline and str(run_dir) in cmdline:
            key = next((e.split(b"=", 1)[1].decode() for e in environ if e.startswith(by.encode() + b"=")), None)
            if key is not None:
                pids[int(key) if by == "HOROVOD_RANK" else key] = int(proc.name)
    return pids


def records(run_dir: Path, event: str) -> list[dict]:
    """The run's metrics records of one kind (none yet: [], a line being written: left out)."""
    return metrics.records(run_dir / metrics.FILE, event, missing_ok=True)


def start(run_dir: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    """`invoke train --elastic ARGS --run-dir RUN_DIR` in a session of its own, output captured."""
    return subprocess.Popen([str(INVOKE), "train", "--elastic", "--run-dir", str(run_dir), *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, **(env or {})})


def under_way(proc: subprocess.Popen, run_dir: Path, ranks: int = 2, after_s: float = 3.0,
              within: float = 180.0) -> dict[int, int]:
    """Wait until `ranks` ranks run and training has gone on for `after_s`; their pids."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and proc.poll() is None:
        pids = job_pids(run_dir)
        starts = records(run_dir, "start")
        if len(pids) >= ranks and starts and time.time() - starts[-1]["time"] > after_s:
            return pids
        time.sleep(0.2)
    raise RuntimeError(f"the run in {run_dir} did not get going (exit {proc.poll()})")


def recovered(run_dir: Path, since: float, within: float = 120.0, hosts: int | None = None) -> dict | None:
    """The first `elastic` record written after `since` (wall time), of `hosts` hosts if given
    (a rejoin), or None within the bound."""
    deadline = time.monotonic() + within
    while True:
        for record in records(run_dir, "elastic"):
            if record["time"] > since and hosts in (None, len(record["hosts"])):
                return record
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.2)


def stop(proc: subprocess.Popen) -> str:
    """End the launcher and its job; its output."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
    return out


def measure(signum: int, folder: Path, sync: str = "step") -> dict:
    """One repeat: seconds from the signal to the survivors' resumption, steps redone."""
    run_dir = folder / f"run-{signal.Signals(signum).name}-{time.time_ns()}"
    proc = start(run_dir, "--sync", sync, *LONG)
    try:
        pids = under_way(proc, run_dir)
        sent = time.time()
        os.kill(pids[1], signum)
        record = recovered(run_dir, sent)
    finally:
        if signum == signal.SIGSTOP:  # the watchdog killed it; if not, it must not stay stopped
            try:
                os.kill(pids[1], signal.SIGCONT)
            except (ProcessLookupError, UnboundLocalError):
                pass
        stop(proc)
    time.sleep(1)
    left = job_pids(run_dir)
    if record is None:
        raise RuntimeError(f"no recovery recorded in {run_dir}")
    return {"seconds": round(record["time"] - sent, 2), "redone_steps": record["redone_steps"],
            "left": len(left)}


SHORT = ["--epochs", "8", "--checkpoint-minutes", "0", "--", "--repeat", "4"]
"""A run trained to its end: 8 epochs of 90 steps (about 40 s on this machine's two ranks)."""


def final_accuracy(seed: int, folder: Path, kill: bool) -> float:
    """One elastic run of the recipe to its end; with `kill`, rank 1 killed half-way."""
    run_dir = folder / f"run-{seed}-{'kill' if kill else 'whole'}"
    proc = start(run_dir, "--seed", str(seed), *SHORT)
    try:
        if kill:
            under_way(proc, run_dir, after_s=15.0)
            os.kill(job_pids(run_dir)[1], signal.SIGKILL)
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            stop(proc)
    logs = records(run_dir, "log")
    if proc.returncode != 0 or not logs:
        raise RuntimeError(f"the run in {run_dir} failed (exit {proc.returncode}):\n{out[-3000:]}")
    if kill and not records(run_dir, "elastic"):
        raise RuntimeError(f"the kill in {run_dir} came too late: no host was dropped")
    return logs[-1]["test_accuracy"]


def accuracy(seeds: list[int]) -> None:
    """Final accuracy undisturbed and with a kill, per seed; the disturbed within the seed spread?"""
    with tempfile.TemporaryDirectory(prefix="hvdhetero-recovery-") as folder:
        whole, cut = [], []
        for seed in seeds:
            whole.append(final_accuracy(seed, Path(folder), kill=False))
            cut.append(final_accuracy(seed, Path(folder), kill=True))
            print(f"seed {seed}: undisturbed {whole[-1]:.2%}, rank 1 killed half-way {cut[-1]:.2%}", flush=True)
    low, high = min(whole), max(whole)
    inside = sum(low <= c <= high for c in cut)
    print(f"undisturbed: {low:.2%} .. {high:.2%} (median {statistics.median(whole):.2%}); killed: {min(cut):.2%} .. "
          f"{max(cut):.2%} (median {statistics.median(cut):.2%}); {inside} of {len(cut)} within the undisturbed "
          f"seeds' spread")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hvdhetero.bench.recovery", description=__doc__.split("\n")[0])
    parser.add_argument("--signal", choices=("KILL", "STOP"), default="KILL")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--accuracy", action="store_true",
                        help="final accuracy per seed, undisturbed and with rank 1 killed half-way")
    parser.add_argument("--seeds", default="0,1,2,3,4", help="with --accuracy: comma-separated seeds")
    parser.add_argument("--sync", default="step", help="the run's --sync mode (step, local:H, diloco:H)")
    args = parser.parse_args(argv)
    if args.accuracy:
        return accuracy([int(s) for s in args.seeds.split(",")])
    with tempfile.TemporaryDirectory(prefix="hvdhetero-recovery-") as folder:
        results = []
        for i in range(args.repeats):
            results.append(measure(getattr(signal, f"SIG{args.signal}"), Path(folder), args.sync))
            print(f"SIG{args.signal} {i + 1}/{args.repeats}: {results[-1]}", flush=True)
    print(f"SIG{args.signal}: median {statistics.median(r['seconds'] for r in results):.2f} s to go on, median "
          f"{statistics.median(r['redone_steps'] for r in results):g} steps redone (--sync {args.sync}, commit every "
          f"10 steps); processes left: {sum(r['left'] for r in results)}")


if __name__ == "__main__":
    main()
