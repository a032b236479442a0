"""`invoke sweep` as a user runs it (hvdhetero/sweep/run.py): bad input refused before anything
starts, a real sweep of the built-in recipe on two local hosts of very different speeds, a
metric the script never logs, and a sweep stopped with Ctrl-C and resumed.

The two hosts are this machine twice (localhost and 127.0.0.1, one rank each); the slow one
carries `slowdown: 100`, far beyond what the fast host alone needs for the whole sweep, so its
first trial must be stopped and run again on the fast host. The timing guarantee itself (a sweep
never ends later than the fastest host alone) is the policy's, checked in test_sweep_policy.py
and measured by `invoke bench --sweep`, not here."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import optuna
import pytest
import yaml
from conftest import ROOT, VENV_BIN, left_running, run_cmd
from test_sweep_space import BAD

from hvdhetero import metrics
from hvdhetero.bench import sweep_report

SPACE = "lr: {loguniform: [1.0e-4, 3.0e-3]}\n"


def inventory(tmp_path: Path, slowdown: float = 100.0) -> Path:
    """Two one-rank hosts on this machine: `fast` and `slow` (the same cores, slowed down)."""
    pins = yaml.safe_load((ROOT / "inventory.yaml").read_text())["pins"]
    env = str(ROOT / ".venv")
    path = tmp_path / "inventory.yaml"
    path.write_text(yaml.safe_dump({"pins": pins, "default_hosts": ["fast", "slow"], "hosts": {
        "fast": {"address": "localhost", "device": "cpu", "slots": 1, "env": env},
        "slow": {"address": "127.0.0.1", "device": "cpu", "slots": 1, "env": env, "slowdown": slowdown}}}))
    return path


def sweep_cmd(inv: Path, space: Path, run_dir: Path, *args) -> list:
    return [VENV_BIN / "invoke", "sweep", "--inventory", inv, "--space", space, "--run-dir", run_dir, *args]


def trials(folder: Path) -> list[dict]:
    path = folder / "trials.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def study(folder: Path):
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.load_study(study_name="hvdhetero-sweep", storage=f"sqlite:///{folder / 'study.db'}")


# -- bad input: exit 2, the file, line and key, nothing launched ----------------------------------

BAD_INPUT = {  # id: (space text, extra options, what stderr must say)
    "an option the recipe lacks": ("momentum: {uniform: [0.1, 0.9]}\n", [],
                                   ":1: key 'momentum': the built-in recipe has no option --momentum; it takes"),
    "a value the recipe refuses": ("batch-size: {int: [16, 99999]}\n", ["--hosts", "fast"],
                                   ":1: key 'batch-size': the built-in recipe refuses --batch-size=99999 on host "
                                   "fast: --batch-size must be an integer from 1 to 1437"),
    "a metric no script can log": (SPACE, ["--metric", "val loss"], "--metric must be the name a script logs"),
    "mode": (SPACE, ["--mode", "lowest"], "--mode"),
    "no trials": (SPACE, ["--trials", "0"], "--trials must be at least 1, got 0"),
    "a host not in the inventory": (SPACE, ["--hosts", "fast,mac"], "mac"),
    "a script that is not there": ("width: {int: [1, 8]}\n", ["--script", "nope.py"], "nope.py"),
}


@pytest.mark.parametrize("text, line, key, said", BAD.values(), ids=BAD.keys())
def test_a_bad_space_file_stops_invoke_sweep_before_anything_starts(tmp_path, text, line, key, said):
    space = tmp_path / "space.yaml"
    space.write_text(text)
    proc = run_cmd(sweep_cmd(inventory(tmp_path), space, tmp_path / "sweep"), check=False, timeout=60)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    named = "" if key == "(top level)" else f"key '{key}': "  # the file as a whole: no key named
    assert f"error: {space}:{line}: {named}" in proc.stderr and said in proc.stderr, proc.stderr
    assert "(top level)" not in proc.stderr, proc.stderr
    assert not (tmp_path / "sweep").exists(), "nothing written, no trial launched"


@pytest.mark.parametrize("text, options, said", BAD_INPUT.values(), ids=BAD_INPUT.keys())
def test_bad_options_stop_invoke_sweep_before_anything_starts(tmp_path, text, options, said):
    space = tmp_path / "space.yaml"
    space.write_text(text)
    proc = run_cmd(sweep_cmd(inventory(tmp_path), space, tmp_path / "sweep", *options), check=False, timeout=60)
    assert proc.returncode == 2 and said in proc.stderr, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and not (tmp_path / "sweep").exists()


def test_a_folder_that_holds_a_sweep_is_not_overwritten(tmp_path):
    (tmp_path / "sweep").mkdir()
    (tmp_path / "sweep" / "sweep.json").write_text("{}")
    space = tmp_path / "space.yaml"
    space.write_text(SPACE)
    proc = run_cmd(sweep_cmd(inventory(tmp_path), space, tmp_path / "sweep"), check=False, timeout=60)
    assert proc.returncode == 2 and f"invoke sweep --resume {tmp_path / 'sweep'}" in proc.stderr, proc.stderr
    assert os.listdir(tmp_path / "sweep") == ["sweep.json"]


def test_resume_keeps_the_sweeps_own_options_and_checks_new_hosts_in_its_inventory(tmp_path):
    folder = tmp_path / "sweep"
    folder.mkdir()
    space = tmp_path / "space.yaml"
    space.write_text(SPACE)
    (folder / "sweep.json").write_text(json.dumps({"inventory": str(inventory(tmp_path)), "hosts": ["fast"],
                                                   "space": str(space), "trials": 2}))
    changed = run_cmd([VENV_BIN / "invoke", "sweep", "--resume", folder, "--trials", "5"], check=False, timeout=60)
    assert changed.returncode == 2 and "--trials cannot change there (--hosts and --inventory can)" in \
        changed.stderr, changed.stderr
    # written at its default value, as much (it was taken silently, the sweep going on with its own)
    default = run_cmd([VENV_BIN / "invoke", "sweep", "--resume", folder, "--trials=12", "--mode", "min"], check=False,
                      timeout=60)
    assert default.returncode == 2 and "--trials, --mode cannot change there" in default.stderr, default.stderr
    unknown = run_cmd([VENV_BIN / "invoke", "sweep", "--resume", folder, "--hosts", "mac"], check=False, timeout=60)
    assert unknown.returncode == 2 and "mac" in unknown.stderr and str(tmp_path / "inventory.yaml") in \
        unknown.stderr, unknown.stderr
    assert sorted(os.listdir(folder)) == ["sweep.json"], "nothing started"


def test_a_metric_is_taken_at_the_epoch_it_was_logged_in_not_at_the_last_log_of_any_scalar(tmp_path):
    """A script logs val_loss at each epoch's end and train_loss during the next: rank 0's
    progress line says each scalar's own epoch, and epoch 0's val_loss stays epoch 0's."""
    from hvdhetero.sweep.trial import Trial

    trial = Trial(None, "fast", tmp_path, None, 0.0)
    trial.progressed(1.0, {"logged": {"val_loss": 0.9}, "logged_epoch": 0, "logged_epochs": {"val_loss": 0}})
    trial.progressed(2.0, {"logged": {"val_loss": 0.9, "train_loss": 0.7}, "logged_epoch": 1,
                           "logged_epochs": {"val_loss": 0, "train_loss": 1}})
    trial.progressed(3.0, {"logged": {"val_loss": 0.5, "train_loss": 0.7}, "logged_epoch": 1,
                           "logged_epochs": {"val_loss": 1, "train_loss": 1}})
    assert trial.epoch_values("val_loss") == {0: 0.9, 1: 0.5}
    assert trial.epoch_values("train_loss") == {1: 0.7}
    # job.epochs(range(1, 16)): epoch 1 is the first of 15 on the sweep's table, as on the live line
    trial.progressed(4.0, {"epoch": 1, "epochs": 16, "first": 1, "step": 2, "steps": 10})
    assert trial.where() == "1/15", trial.where()


def test_a_loop_of_the_scripts_own_is_judged_at_the_steps_it_logged_at_and_timed_by_the_ended_trials(tmp_path):
    """nanoGPT's `while iter_num < max_iters` logs val_loss every 100 iterations in one epoch: each
    value is the metric at its step (not epoch 0's first), and once a trial of the sweep ended
    after 300 steps, this one's end is told from the steps it has taken."""
    from hvdhetero.sweep.trial import Trial

    trial = Trial(None, "slow", tmp_path, None, 0.0)
    line = {"epoch": 0, "epochs": None, "step": 1, "steps": None}
    trial.progressed(5.0, {**line, "taken": 1, "logged": {"val_loss": 3.2}, "logged_epoch": 0,
                           "logged_epochs": {"val_loss": 0}, "logs": [{"epoch": 0, "step": 0, "val_loss": 3.2}]})
    trial.progressed(15.0, {**line, "taken": 101, "logged": {"val_loss": 1.4}, "logged_epoch": 0,
                            "logged_epochs": {"val_loss": 0}, "logs": [{"epoch": 0, "step": 100, "val_loss": 1.4}]})
    assert trial.looped and trial.epoch_values("val_loss") == {0: 3.2, 100: 1.4}
    assert trial.expected_end() is None and trial.where() == "step 101", "no trial has ended: its length is unknown"
    trial.length = 300
    assert trial.expected_end() == pytest.approx(15.0 + 199 * 0.1) and trial.where() == "step 101/300"
    assert trial.speed() == pytest.approx((4.9, 0.1))  # start-up, seconds a step
    trial.logged = [{"epoch": 0, "step": 0, "val_loss": 3.2}, {"epoch": 0, "step": 300, "val_loss": 0.3}]
    assert trial.epoch_values("val_loss") == {0: 3.2, 100: 1.4, 300: 0.3}, "its end record's last value wins"
    trial.progressed(16.0, {**line, "taken": 301, "logged": {}})
    assert trial.expected_end() is None, "past the length the last trial had: it cannot tell (a back-up may run it)"
    fast = Trial(None, "fast", tmp_path, None, 0.0)  # two evaluations within a second: one line carries both
    logs = [{"epoch": 0, "step": 100, "val_loss": 1.2}, {"epoch": 0, "step": 200, "val_loss": 0.9}]
    fast.progressed(1.0, {**line, "taken": 201, "logged": {"val_loss": 0.9}, "logs": logs})
    assert fast.epoch_values("val_loss") == {100: 1.2, 200: 0.9}


def test_a_loop_of_the_scripts_own_over_epochs_is_judged_at_each_pass_and_timed_in_steps(tmp_path):
    """`for epoch in range(n)` over a prepared loader: no epochs total, but each pass has its
    steps; a value belongs to the pass it was logged in (as under job.epochs), whatever steps a
    swept batch size gives a pass."""
    from hvdhetero.sweep.trial import Trial

    trial = Trial(None, "fast", tmp_path, None, 0.0)
    line = {"epochs": None, "step": 40, "steps": 40}
    trial.progressed(5.0, {**line, "epoch": 0, "taken": 40, "logged": {"val_loss": 0.9},
                           "logged_epochs": {"val_loss": 0}, "logs": [{"epoch": 0, "step": 40, "val_loss": 0.9}]})
    trial.progressed(9.0, {**line, "epoch": 1, "taken": 80, "logged": {"val_loss": 0.5},
                           "logged_epochs": {"val_loss": 1}, "logs": [{"epoch": 1, "step": 80, "val_loss": 0.5}]})
    assert trial.looped and not trial.by_step and trial.epoch_values("val_loss") == {0: 0.9, 1: 0.5}
    trial.length = 120
    assert trial.expected_end() == pytest.approx(13.0) and trial.where() == "step 80/120"


class Running:
    """A trial's process that has not ended (a pid above Linux's pid_max: a stop signals no one)."""

    pid, returncode = 4194304 + 1, None

    def poll(self):
        return self.returncode


def test_a_slow_hosts_short_trial_of_a_loop_is_cut_once_its_value_at_a_multiple_of_the_interval_is_in(
        tmp_path, monkeypatch):
    """--prune, nanoGPT-style trials (200 steps, a value every 50): slow takes 42 s a trial, fast 10,
    so slow ends no whole trial before fast would have got to it and runs a short one: the steps
    it ends before the sweep's planned end, down to a multiple of 50, with no --epochs (the
    script has none). The sweep cuts it once its value at that step is in and tells the study it
    was pruned there: the sampler learns from it. Real scheduler and study; the trials' processes
    are stand-ins fed progress lines as their launchers write them."""
    from hvdhetero.cluster import console
    from hvdhetero.sweep import scheduler
    from hvdhetero.sweep.request import Request
    from hvdhetero.sweep.trial import Trial

    launched = {}

    def start(cls, trial, host, run_dir, argv, stopped_on, short=0, cut_at=None):
        launched[host] = [str(a) for a in argv]
        return cls(trial, host, run_dir, Running(), time.time(), stopped_on, short=short, cut_at=cut_at)

    monkeypatch.setattr(Trial, "start", classmethod(start))
    space = tmp_path / "space.yaml"
    space.write_text("learning_rate: {loguniform: [1.0e-4, 1.0e-2]}\n")
    (tmp_path / "sweep").mkdir()
    said = io.StringIO()
    sweep = scheduler.Sweep(Request(inventory=str(inventory(tmp_path)), hosts=["fast", "slow"], space=str(space),
                                    trials=3, metric="val_loss", prune=True, script=str(tmp_path / "train.py")),
                            tmp_path / "sweep", ROOT, out=said)
    sweep.hosts.durations["fast"] = [10.0, 10.0]
    sweep.hosts.speeds["slow"] = (2.0, 0.2)  # start-up, seconds a step: 42 s for 200
    sweep.hosts.looped, sweep.hosts.length, sweep.hosts.interval, sweep.hosts.last_value = True, 201, 50, 200
    sweep.launch(sweep.study.ask(sweep.space.distributions()), "fast", [])  # fast is busy 10 s more
    sweep.start_trials(time.time())
    short = sweep.running["slow"]
    # 2 trials left, fast ends them 20 and 30 s from now: 28 s after slow's start-up fit 140 steps
    assert (short.short, short.cut_at) == (100, 100), said.getvalue()
    assert not any(a.startswith("--epochs") for a in launched["slow"]), launched["slow"]
    assert "trial 1 on slow (short: 100 of 201 steps)" in said.getvalue()

    def logs(*values):
        with (short.run_dir / console.PROGRESS_FILE).open("a") as f:
            for step, value in values:
                f.write(json.dumps({"at": time.time(), "progress": {
                    "epoch": 0, "epochs": None, "step": step + 1, "steps": None, "taken": step,
                    "logged": {"val_loss": value}, "logs": [{"epoch": 0, "step": step, "val_loss": value}]}}) + "\n")

    logs((0, 3.2), (50, 2.1))
    sweep.poll(short, time.time())
    assert not short.stopping and short.where() == "step 50/100"
    logs((100, 1.7))
    sweep.poll(short, time.time())
    assert short.stopping == "cut"
    record = trials(tmp_path / "sweep")[-1]
    assert record["state"] == "short" and record["steps"] == 100 and record["value"] == 1.7
    assert record["values"] == {"0": 3.2, "50": 2.1, "100": 1.7} and record["values_at"] == "step"
    told = sweep.study.trials[short.trial.number]
    assert told.state.name == "PRUNED" and told.intermediate_values == {0: 3.2, 50: 2.1, 100: 1.7}
    diverged = Trial(None, "slow", tmp_path, Running(), 0.0, short=100, cut_at=100)
    diverged.progressed(1.0, {"epochs": None, "steps": None, "taken": 100, "logged": {"val_loss": float("nan")},
                              "logs": [{"epoch": 0, "step": 100, "val_loss": float("nan")}]})
    assert sweep.cut_due(diverged), "a value that is not finite ends a short trial too (the study is told none)"


def standin_sweep(tmp_path: Path, monkeypatch, trials: int):
    """The real scheduler and study on fast and slow, its trials' processes stand-ins that never
    end (Running): a test feeds it progress and times. Returns the Sweep and what it said."""
    from hvdhetero.sweep import scheduler
    from hvdhetero.sweep.request import Request
    from hvdhetero.sweep.trial import Trial

    monkeypatch.setattr(Trial, "start", classmethod(
        lambda cls, trial, host, run_dir, argv, stopped_on, short=0, cut_at=None:
        cls(trial, host, run_dir, Running(), time.time(), stopped_on, short=short, cut_at=cut_at)))
    space = tmp_path / "space.yaml"
    space.write_text("learning_rate: {loguniform: [1.0e-4, 1.0e-2]}\n")
    (tmp_path / "sweep").mkdir()
    said = io.StringIO()
    sweep = scheduler.Sweep(Request(inventory=str(inventory(tmp_path)), hosts=["fast", "slow"], space=str(space),
                                    trials=trials, metric="val_loss", script=str(tmp_path / "train.py")),
                            tmp_path / "sweep", ROOT, out=said)
    return sweep, said


def test_a_trial_stopped_on_the_only_host_the_plan_gives_it_to_runs_there_again_rather_than_wait(tmp_path,
                                                                                                    monkeypatch):
    """A trial moved off fast waits for another host; when fast is free again, the plan gives it
    a trial, and nothing but that one is left to start, fast runs it again: it sat idle while the
    slow host, never planned a whole trial, ran short ones, and the sweep never ended (a user's
    Optuna study on a 4x slower second host). Real scheduler and study; stand-in processes."""
    sweep, said = standin_sweep(tmp_path, monkeypatch, trials=2)
    sweep.hosts.durations["fast"], sweep.hosts.durations["slow"] = [10.0], [40.0]
    moved = sweep.study.ask(sweep.space.distributions())
    sweep.pending.append((moved, ["fast"]))  # stopped on fast, to run on slow
    sweep.launch(sweep.study.ask(sweep.space.distributions()), "slow", [])  # which runs the other trial
    sweep.start_trials(time.time())
    assert "fast" in sweep.running and sweep.running["fast"].trial.number == moved.number, said.getvalue()
    assert f"trial {moved.number} on fast (again)" in said.getvalue() and not sweep.pending


def test_a_trial_whose_estimate_overshoots_its_hosts_whole_trials_is_not_moved(tmp_path, monkeypatch):
    """From a review: a first epoch whose loop leaves early (Optuna's 30 of 469 batches) tells an
    end far past what this host's whole trials take; judged then (--budget 1: never again), the
    fast host's trial was moved to the 4x slower one. Its end is capped by the host's longest
    recent whole trial."""
    sweep, said = standin_sweep(tmp_path, monkeypatch, trials=3)
    sweep.hosts.durations["fast"], sweep.hosts.durations["slow"] = [10.0], [40.0]
    now = time.time()
    sweep.launch(sweep.space.ask(sweep.study), "fast", [])
    trial = sweep.running["fast"]
    trial.started, trial.length = now - 3.0, 10
    trial.first, trial.last = (now - 3.0, 0.0), (now, 0.6)  # 0.06 of it in 3 s: 47 s more, by its progress
    assert trial.expected_end() == pytest.approx(now + 47.0)
    sweep.judge(trial, now)
    assert trial.judged and not trial.stopping, said.getvalue()  # capped at 7 s more: it goes on


def test_a_hosts_trials_slower_on_its_ranks_than_on_one_are_said_once_on_the_sweeps_console(tmp_path, monkeypatch):
    """The default `local` host runs a trial on its two ranks, sharing one machine's cores: a small
    model's trial ran 0.23x as fast as one rank alone, said only in each trial's log. The sweep
    relays it once for the host, with the way out (`slots: 1`)."""
    from hvdhetero.policy.alone import Verdict
    from hvdhetero.sweep.trial import LOG_FILE

    sweep, said = standin_sweep(tmp_path, monkeypatch, trials=3)
    line = Verdict(0, 0.01, 0.043, 64).line(30, ["fast", "fast"], [0.02, 0.04], [32, 32], equal_split=False,
                                            auto=False)
    for n in range(2):
        sweep.launch(sweep.space.ask(sweep.study), "fast", [])
        trial = sweep.running["fast"]
        (trial.run_dir / LOG_FILE).write_text(f"epoch 0\n{line}\nepoch 1\n")
        trial.proc.returncode, trial.logged = 0, [{"epoch": 0, "step": 9, "val_loss": 0.5}]
        sweep.ended(trial)
    out = said.getvalue()
    assert out.count("sweep: trials on fast run slower than one of its ranks would alone; trial 0's run said: the "
                     "job trains about 1,488 samples/s, where rank 0 (fast) alone would train about 6,400") == 1, out
    assert "(`slots: 1` for it in the inventory: its ranks share its cores" in out


def test_a_trial_that_ended_before_a_ctrl_c_was_seen_is_recorded_as_it_ended(tmp_path, monkeypatch):
    """Ctrl-C stops the running trials, and --resume asks them again; a trial whose run had ended
    (both epochs trained, invoke train exited 0) before the sweep saw it was dropped with them and
    trained again on --resume. Real scheduler and study; the trials' processes are stand-ins."""
    from hvdhetero.cluster import console
    from hvdhetero.sweep import scheduler
    from hvdhetero.sweep.request import Request
    from hvdhetero.sweep.trial import Trial

    class Ended(Running):
        returncode = 0

        def wait(self, timeout=None):
            return self.returncode

    class Stopped(Running):
        def wait(self, timeout=None):
            self.returncode = 143
            return self.returncode

    procs = iter([Ended(), Stopped()])

    def start(cls, trial, host, run_dir, argv, stopped_on, short=0, cut_at=None):
        return cls(trial, host, run_dir, next(procs), time.time(), stopped_on, short=short, cut_at=cut_at)

    monkeypatch.setattr(Trial, "start", classmethod(start))
    space = tmp_path / "space.yaml"
    space.write_text("learning_rate: {loguniform: [1.0e-4, 1.0e-2]}\n")
    (tmp_path / "sweep").mkdir()
    sweep = scheduler.Sweep(Request(inventory=str(inventory(tmp_path)), hosts=["fast", "slow"], space=str(space),
                                    trials=3, metric="val_loss", script=str(tmp_path / "train.py")),
                            tmp_path / "sweep", ROOT, out=io.StringIO())
    for host in ("fast", "slow"):
        sweep.launch(sweep.study.ask(sweep.space.distributions()), host, [])
    ended = sweep.running["fast"]
    ended.run_dir.mkdir(parents=True, exist_ok=True)
    with (ended.run_dir / console.PROGRESS_FILE).open("a") as f:  # its last lines, written after the last poll
        f.write(json.dumps({"at": time.time(), "progress": {"epoch": 1, "epochs": 2, "step": 10, "steps": 10, "logs": [
            {"epoch": 0, "step": 10, "val_loss": 0.7}, {"epoch": 1, "step": 20, "val_loss": 0.5}]}}) + "\n")
    sweep.interrupt()
    assert [(r["number"], r["host"], r["state"], r["value"]) for r in trials(tmp_path / "sweep")] == [
        (0, "fast", "complete", 0.5)]
    assert [t.state.name for t in sweep.study.trials] == ["COMPLETE", "RUNNING"] and not sweep.running
    assert sweep.done() == 1


def test_a_loop_learns_the_steps_between_its_values_from_complete_trials_and_on_resume(tmp_path):
    from hvdhetero.sweep.hosts import Hosts

    hosts = Hosts(["fast"], [{"state": "complete", "host": "fast", "seconds": 9.0, "steps": 201,
                              "values_at": "step", "values": {"0": 3.2, "100": 1.5, "200": 0.9}}], budget=0)
    assert (hosts.looped, hosts.length, hosts.interval, hosts.last_value) == (True, 201, 100, 200)
    assert [hosts.cut_steps(n) for n in (99, 100, 250)] == [0, 100, 100], "never at the last value: a whole trial"
    assert Hosts(["fast"], [], budget=0).cut_steps(250) == 0, "no interval known: no short trial"
    steps = (0, 500, 1000, 1500, 2000, 2001)
    off_grid = Hosts(["fast"], [{"state": "complete", "host": "fast", "seconds": 9.0, "steps": 2002,
                                 "values_at": "step", "values": {str(s): 1.0 for s in steps}}], budget=0)
    assert (off_grid.interval, off_grid.cut_steps(1999)) == (500, 1500), "a last value off the grid is no interval"


def test_a_record_after_a_line_cut_short_starts_on_a_line_of_its_own(tmp_path):
    from hvdhetero.sweep import records

    (tmp_path / "trials.jsonl").write_text('{"number": 0, "state": "complete"}\n{"number": 1, "sta')
    records.append(tmp_path / "trials.jsonl", {"number": 2, "state": "complete"})
    assert [r["number"] for r in records.read(tmp_path / "trials.jsonl")] == [0, 2]


# -- a real sweep ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """3 trials of 3 epochs of digits on fast and slow (100x slower): the console, the folder."""
    tmp = tmp_path_factory.mktemp("swept")
    space = tmp / "space.yaml"
    space.write_text(SPACE)
    proc = run_cmd(sweep_cmd(inventory(tmp), space, tmp / "sweep", "--trials", "3", "--budget", "3"), timeout=400)
    return proc.stdout + proc.stderr, tmp / "sweep"


@pytest.mark.alone
@pytest.mark.slow
def test_every_trial_is_recorded_with_the_value_its_run_logged(swept):
    out, folder = swept
    records = trials(folder)
    assert [r["number"] for r in records] == [0, 1, 2] or sorted(r["number"] for r in records) == [0, 1, 2], records
    assert all(r["state"] == "complete" for r in records), records
    told = {t.number: t for t in study(folder).trials}
    for r in records:
        run = folder / r["run_dir"]
        logged = [m for m in metrics.records(run / "metrics.jsonl") if m["event"] == "log"]
        assert len(logged) == 3 and r["value"] == logged[-1]["test_loss"], (r, logged[-1])
        assert r["values"] == {str(m["epoch"]): m["test_loss"] for m in logged}  # each epoch reported
        assert told[r["number"]].value == r["value"] and told[r["number"]].state.name == "COMPLETE"
        # the trial's run got the value the study asked for, exactly
        launched = json.loads((run / "launch.json").read_text())
        assert launched["hosts"] == [r["host"]] and launched["script_args"] == [f"--lr={r['params']['lr']!r}"]
        assert "--epochs" in launched["recipe"] and launched["recipe"][launched["recipe"].index("--epochs") + 1] == "3"
    best = min(records, key=lambda r: r["value"])
    assert f"best: trial {best['number']} on fast, test_loss {best['value']:.6g}: --lr={best['params']['lr']!r}" in out


@pytest.mark.alone
@pytest.mark.slow
def test_a_trial_too_slow_for_its_host_is_run_again_on_the_fast_one_which_finishes_it(swept):
    """slow's first trial (100x slower: its first steps alone outlast fast's whole trials) has
    not even shown its speed when fast has nothing left to start: fast runs it too, finishes it
    first, and slow's copy is stopped. slow gets no other trial; nothing is left running."""
    out, folder = swept
    records = trials(folder)
    assert [r["host"] for r in records] == ["fast"] * 3, records
    moved = [r for r in records if r["stopped_on"]]
    assert len(moved) == 1 and moved[0]["stopped_on"] == ["slow"], records
    number = moved[0]["number"]
    assert re.search(rf"trial {number} on slow has run \d+ s and cannot tell its end yet; fast would end it in",
                     out), out
    assert f"trial {number} on fast (again)" in out and "the first to finish counts" in out, out
    assert len(list((folder / "trials").glob(f"{number:03d}*"))) == 2  # slow's run and fast's
    assert not left_running(folder)


@pytest.mark.alone
@pytest.mark.slow
def test_the_report_of_a_sweep_draws_every_trial_where_trials_jsonl_has_it(swept, tmp_path):
    """`invoke report SWEEP_DIR` writes its figures and page; each figure's points, read back from
    the drawn artists, are the trials' own numbers."""
    _, folder = swept
    proc = run_cmd([VENV_BIN / "invoke", "report", folder], timeout=120)
    names = ["metric.png", "params.png", "hosts.png", "epochs.png"]
    assert sorted(p.name for p in (folder / "report").iterdir()) == sorted([*names, "report.html"])
    assert all((folder / "report" / n).read_bytes()[:4] == b"\x89PNG" for n in names)
    assert f"report: {folder / 'report' / 'report.html'}" in proc.stdout
    records = sorted(trials(folder), key=lambda r: r["number"])
    best = min(records, key=lambda r: r["value"])
    page = (folder / "report" / "report.html").read_text()
    assert f"trial {best['number']} on fast: test_loss {best['value']:.6g} with --lr={best['params']['lr']!r}" in page
    assert page.count("data:image/png;base64,") == 4

    _, drawn = sweep_report.write(sweep_report.read(folder), tmp_path)
    series = {d.path.name: d.series for d in drawn}
    t0 = min(r["started"] for r in records)
    assert sorted(series["metric.png"]["test_loss against trial"]["complete"]) == [
        (r["number"], r["value"]) for r in records]
    by_end = sorted(records, key=lambda r: r["ended"])
    drawn_at = sorted(series["metric.png"]["test_loss against time"]["complete"])
    assert [y for _, y in drawn_at] == [r["value"] for r in by_end]
    assert [x for x, _ in drawn_at] == pytest.approx([r["ended"] - t0 for r in by_end])
    best_so_far = [min(r["value"] for r in by_end[:i + 1]) for i in range(len(by_end))]
    assert [y for _, y in series["metric.png"]["test_loss against time"]["best so far"]] == best_so_far
    assert sorted(series["params.png"]["lr"]["complete"]) == sorted((r["params"]["lr"], r["value"]) for r in records)
    assert sorted(series["hosts.png"]["trials on each host"]["complete"]) == [
        (round(r["started"] - t0, 3), round(r["ended"] - r["started"], 3), 0) for r in by_end]  # fast: row 0
    assert {k: v for k, v in series["epochs.png"]["test_loss at each epoch"].items()} == {
        f"trial {r['number']} (complete)": [(float(e), v) for e, v in r["values"].items()] for r in records}


@pytest.mark.slow
def test_a_metric_the_script_never_logs_ends_the_sweep_naming_what_it_logged(tmp_path):
    space = tmp_path / "space.yaml"
    space.write_text(SPACE)
    proc = run_cmd(sweep_cmd(inventory(tmp_path), space, tmp_path / "sweep", "--hosts", "fast", "--trials", "2",
                             "--budget", "1", "--metric", "val_loss"), check=False, timeout=300)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "ended without logging --metric val_loss (it logged " in proc.stderr and "test_loss" in proc.stderr, \
        proc.stderr
    assert not left_running(tmp_path / "sweep")


@pytest.mark.slow
def test_a_sweep_stopped_with_ctrl_c_resumes_keeping_its_finished_trials(tmp_path):
    space = tmp_path / "space.yaml"
    space.write_text(SPACE)
    folder = tmp_path / "sweep"
    proc = subprocess.Popen([str(a) for a in sweep_cmd(inventory(tmp_path), space, folder, "--hosts", "fast",
                                                        "--trials", "3", "--budget", "3")],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while not trials(folder) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    time.sleep(2)  # the next trial under way
    second = run_cmd([VENV_BIN / "invoke", "sweep", "--resume", folder], check=False, timeout=60)
    assert second.returncode == 2 and f"another invoke sweep is running in {folder}" in second.stderr, second.stderr
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (out, err)
    assert f"sweep: stopped: 1 of 3 trials done; continue with\n  invoke sweep --resume {folder}" in err, err
    assert not left_running(folder)
    first = trials(folder)
    interrupted = [t for t in study(folder).trials if t.state.name == "RUNNING"]
    assert len(first) == 1 and len(interrupted) == 1, (first, interrupted)

    proc = run_cmd([VENV_BIN / "invoke", "sweep", "--resume", folder], timeout=300)
    records = trials(folder)
    assert records[0] == first[0] and len(records) == 3 and all(r["state"] == "complete" for r in records), records
    assert records[1]["params"] == interrupted[0].params  # the trial that was running, asked again
    assert records[2]["params"] not in (records[0]["params"], records[1]["params"]), records  # not the same draws
    assert "sweep: 3 trials of space.yaml on fast; 1 done already" in proc.stdout, proc.stdout


@pytest.mark.alone
@pytest.mark.slow
def test_on_a_terminal_the_trials_under_way_are_a_live_table(tmp_path):
    """Each running trial's host, epoch, metric and parameters, redrawn in place below the event
    lines; the summary after it. The host acts 5x slower, so that an epoch (0.3 s here) outlasts
    the table's redraw (once a second) and a row shows the trial running with its metric."""
    from test_live import ANSI, under_a_terminal

    space = tmp_path / "space.yaml"
    space.write_text(SPACE)
    code, out = under_a_terminal(sweep_cmd(inventory(tmp_path, slowdown=5.0), space, tmp_path / "sweep", "--hosts",
                                           "slow", "--trials", "1", "--budget", "3"), timeout=200)
    text = ANSI.sub("", out)
    assert code == 0, text[-3000:]
    assert re.search(r"trial\s*\S\s*host\s*\S\s*epoch\s*\S\s*test_loss\s*\S\s*seconds\s*\S\s*state", text), text[-3000:]
    assert re.search(r"\s0\s*\S\s*slow\s*\S\s*[123]/3\s*\S\s*[\d.]+\s*\S\s*\d+\s*\S\s*running\s*\S\s*--lr=", text), \
        text[-3000:]
    assert "0 of 1 trials done; test_loss best: none yet" in text and "sweep: trial 0 on slow: test_loss " in text
    assert text.rstrip().endswith(f"sweep directory: {tmp_path / 'sweep'}"), text[-500:]


@pytest.mark.slow
def test_a_sweep_killed_outright_leaves_no_trial_running(tmp_path):
    """SIGKILL gives the sweep no chance to stop its trials (each in a session of its own): the
    trial's launcher is told by PR_SET_PDEATHSIG and stops its ranks itself."""
    space = tmp_path / "space.yaml"
    space.write_text(SPACE)
    folder = tmp_path / "sweep"
    proc = subprocess.Popen([str(a) for a in sweep_cmd(inventory(tmp_path), space, folder, "--hosts", "fast",
                                                        "--trials", "3", "--budget", "3")],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (folder / "trials" / "000" / "progress.jsonl").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left_running(folder), "the first trial is training"
    proc.kill()
    proc.wait(timeout=10)
    deadline = time.monotonic() + 30
    while left_running(folder) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left_running(folder)
    assert "hvdhetero: SIGTERM: the job was stopped" in (folder / "trials" / "000" / "trial.log").read_text()


@pytest.mark.slow
def test_a_timeout_starts_no_trial_after_it_and_the_sweep_goes_on_when_resumed(tmp_path):
    """Optuna's optimize(timeout=): --timeout 1 lets the first trial (started at once) end, starts
    none after, and says how to go on; --env reaches each trial as invoke train's."""
    space = tmp_path / "space.yaml"
    space.write_text("lr: {loguniform: [0.01, 0.2]}\n")
    folder = tmp_path / "sweep"
    proc = run_cmd(sweep_cmd(inventory(tmp_path), space, folder, "--hosts", "fast", "--trials", "3", "--budget", "1",
                             "--timeout", "1", "--env", "OMP_NUM_THREADS=1,SWEPT=yes", "--metric", "test_accuracy", "--mode", "max", "--script",
                             ROOT / "tests" / "scripts" / "user_train.py"), timeout=300)
    records = trials(folder)
    assert [r["state"] for r in records] == ["complete"], proc.stdout
    assert "sweep: --timeout 1 s: no trial starts from now on; 1 running end as they would" in proc.stdout
    assert f"sweep: 1 of 3 trials done within --timeout 1 s; continue with\n  invoke sweep --resume {folder}" in \
        proc.stdout, proc.stdout
    launched = json.loads((folder / records[0]["run_dir"] / "launch.json").read_text())
    assert launched["settings"]["env"] == "OMP_NUM_THREADS=1,SWEPT=yes", launched["settings"]


@pytest.mark.slow
def test_a_users_script_is_swept_with_its_own_arguments_and_a_flag_written_as_a_value_stops_it_saying_how(tmp_path):
    """A user's script swept through its own argparse options, the budget its --epochs, the
    metric what it logs, maximised: a flag goes alone or not at all, one written as a value
    stops the sweep after one trial naming the space's line, and a conditional parameter whose
    condition no trial meets is never passed nor in the study (define-by-run)."""
    space, script = tmp_path / "space.yaml", ROOT / "tests" / "scripts" / "user_train.py"
    space.write_text("lr: {loguniform: [0.01, 0.2]}\nnesterov: {choice: [true, false]}\n")
    command = [*sweep_cmd(inventory(tmp_path), space, tmp_path / "valued", "--hosts", "fast", "--trials", "2",
                          "--budget", "1", "--metric", "test_accuracy", "--mode", "max", "--script", script)]
    proc = run_cmd(command, check=False, timeout=300)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert ("error: argument --nesterov: ignored explicit argument" in proc.stderr
            and f"--nesterov is a flag, which takes no value: write `nesterov: {{choice: [true, false], flag: true}}` "
                f"in {space} (line 2)" in proc.stderr), proc.stderr
    assert len(trials(tmp_path / "valued")) <= 1 and not left_running(tmp_path / "valued")  # not a trial more
    space.write_text("lr: {loguniform: [0.01, 0.2]}\nnesterov: {choice: [true, false], flag: true}\n"
                     "warm: {choice: [true], flag: true, when: {lr: {max: 0.001}}}\n")  # never met: never passed
    folder = tmp_path / "flagged"
    proc = run_cmd([*command[:command.index(tmp_path / "valued")], folder,
                    *command[command.index(tmp_path / "valued") + 1:]], timeout=300)
    records = trials(folder)
    assert [r["state"] for r in records] == ["complete"] * 2, records
    assert all(set(t.params) == {"lr", "nesterov"} for t in study(folder).trials)
    for r in records:
        launched = json.loads((folder / r["run_dir"] / "launch.json").read_text())
        assert launched["script"].endswith("user_train.py")
        assert launched["script_args"] == ["--epochs=1", f"--lr={r['params']['lr']!r}",
                                           *(["--nesterov"] if r["params"]["nesterov"] else [])]
        assert r["value"] == r["values"]["0"]  # one epoch: its test accuracy
    best = max(records, key=lambda r: r["value"])
    assert f"best: trial {best['number']} on fast, test_accuracy {best['value']:.6g}" in proc.stdout


@pytest.mark.slow
def test_a_hydra_app_is_swept_with_overrides_and_a_key_its_config_lacks_stops_the_sweep_saying_so(tmp_path):
    """tests/scripts/hydra_app (`@hydra.main` over a config group): every trial passes
    `epochs=1 optimizer=adam optimizer.lr=0.01`, no dashes (`--optimizer.lr=0.01` is refused by
    Hydra's own argparse), and records the val_acc the app logs; a key its config lacks stops the
    sweep after one trial, naming the space's line."""
    shutil.copytree(ROOT / "tests" / "scripts" / "hydra_app", tmp_path / "app")  # its outputs/ go there
    script, space = tmp_path / "app" / "train.py", tmp_path / "space.yaml"
    space.write_text("optimizer: {choice: [sgd, adam]}\noptimiser.lr: {loguniform: [0.003, 0.1]}\n")
    command = sweep_cmd(inventory(tmp_path), space, tmp_path / "typo", "--hosts", "fast", "--trials", "2", "--budget",
                        "1", "--metric", "val_acc", "--mode", "max", "--script", script)
    proc = run_cmd(command, check=False, timeout=300)
    assert proc.returncode == 2 and "ConfigCompositionException: Could not override 'optimiser.lr'" in proc.stderr \
        and f"the script's config has no key optimiser.lr: name optimiser.lr in {space} (line 2)" in proc.stderr, \
        proc.stderr[-3000:]
    assert len(trials(tmp_path / "typo")) <= 1
    space.write_text("optimizer: {choice: [sgd, adam]}\noptimizer.lr: {loguniform: [0.003, 0.1]}\n")
    folder = tmp_path / "sweep"
    run_cmd([*command[:command.index(tmp_path / "typo")], folder, *command[command.index(tmp_path / "typo") + 1:]],
            timeout=300)
    records, kept = trials(folder), []
    assert [r["state"] for r in records] == ["complete"] * 2, records
    for r in records:
        launched = json.loads((folder / r["run_dir"] / "launch.json").read_text())
        params = r["params"]
        assert launched["script_args"] == ["epochs=1", f"optimizer={params['optimizer']}",
                                           f"optimizer.lr={params['optimizer.lr']!r}"], launched
        logged = [x for x in metrics.records(folder / r["run_dir"] / "metrics.jsonl") if x["event"] == "log"]
        assert len(logged) == 1 and r["value"] == logged[0]["val_acc"] > 0.5, (r, logged)
        kept.append(launched["script_args"])
    hydra = [yaml.safe_load(f.read_text()) for f in (tmp_path / "app" / "outputs").glob("*/*/.hydra/overrides.yaml")]
    assert all(args in hydra for args in kept), (kept, hydra)  # Hydra's own record of each trial's overrides


SMALL_GPT = ["--n_layer=1", "--n_head=2", "--n_embd=32", "--batch_size=16", "--eval_iters=4"]
"""nanoGPT's settings for a model a tenth of the port's (its configurator takes them as globals)."""


@pytest.mark.alone
@pytest.mark.slow
def test_nanogpt_with_one_job_log_line_is_swept_judged_at_its_steps_and_pruned(tmp_path):
    """nanoGPT's train.py as ported (tests/scripts/ported/nanogpt.py) plus the one line a sweep
    needs, `job.log(val_loss=...)` beside its own print: its configurator reads `--key=value`
    only, it loops over iterations of its own (no epochs), and it evaluates every 100. On fast
    and slow (40x slower): the slow host's trial is timed by the steps the first trial took and
    moved, each value is the study's at its step, and a trial worse than the median at step 100 is
    pruned there. Both hosts are this machine: the sweep runs on one core, so that each rank
    computes on one thread and the slowdown multiplies its CPU time, not the time it waited for
    the core (on two threads each, the fast host's trials stretched the slow one's first step past
    the sweep's end)."""
    source = (ROOT / "tests" / "scripts" / "ported" / "nanogpt.py").read_text()
    printed = "        print(f\"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}\")\n"
    assert printed in source
    script = tmp_path / "train.py"
    script.write_text(source.replace(printed, printed + "        job.log(val_loss=losses['val'])\n"))
    space = tmp_path / "space.yaml"
    space.write_text("learning_rate: {loguniform: [1.0e-5, 3.0e-2]}\n")
    folder = tmp_path / "sweep"
    own = ["--max_iters=200", *SMALL_GPT, f"--out_dir={tmp_path / 'out'}"]
    proc = run_cmd(["taskset", "-c", "0", *sweep_cmd(inventory(tmp_path, slowdown=40.0), space, folder, "--trials", "6",
                                                      "--metric", "val_loss", "--prune", "--script", script, "--",
                                                      *own)], timeout=400)
    out = proc.stdout + proc.stderr
    records = {r["number"]: r for r in trials(folder) if r["state"] != "short"}  # (a short trial takes a number)
    assert len(records) == 6 and {r["state"] for r in records.values()} <= {"complete", "pruned"}, out
    last_end = max(r["ended"] for r in records.values())
    for r in trials(folder):  # a short trial of slow's: cut at the evaluation it was planned to reach, or, where
        # the sweep ended sooner than planned (fast's trials pruned at step 100), as it stood then (CI56: at step 0)
        assert r["state"] != "short" or (r["host"] == "slow" and r["steps"] % 100 == 0 and (
            max(map(int, r["values"])) == r["steps"] or r["ended"] >= last_end - 1.0)), (r, last_end)
    # its end told from its steps: it is moved, or, where fast has no trial left by then, backed up knowing it;
    # or kept, where it ends before fast alone could have run it after its own (CI60: a pruned trial's stop took
    # fast 15 s, and slow's trial ended 2.6 s after fast's last, where fast's quickest whole trial took 5.6 s)
    fast_ends = [r["ended"] for r in records.values() if r["host"] == "fast"]
    fast_whole = [r["seconds"] for r in records.values() if r["host"] == "fast" and r["state"] == "complete"]
    kept = [r for r in records.values() if r["host"] == "slow" and r["state"] == "complete"
            and fast_ends and fast_whole and r["ended"] <= max(fast_ends) + min(fast_whole)]
    assert kept or re.search(r"trial \d on slow(: would end in \d+ s; run again on fast it would end in \d+ s| would "
                             r"end in \d+ s; fast would end it in)", out), out
    told = {t.number: t for t in study(folder).trials}
    for number, r in records.items():
        run = folder / r["run_dir"]
        launched = json.loads((run / "launch.json").read_text())
        assert launched["script_args"] == [*own, f"--learning_rate={r['params']['learning_rate']!r}"]
        logged = {m["step"]: m["val_loss"] for m in metrics.records(run / "metrics.jsonl") if m["event"] == "log"}
        reported = {int(step): value for step, value in r["values"].items()}  # a pruned run logs on until stopped
        assert r["values_at"] == "step" and reported == {s: v for s, v in logged.items() if s <= max(reported)}
        assert told[number].intermediate_values == reported
        if r["state"] == "complete":
            assert list(reported) == [0, 100, 200] and r["value"] == logged[200]
            assert r["steps"] == 201 and told[number].value == r["value"]
    complete = [r for r in records.values() if r["state"] == "complete"]
    pruned = [r for r in records.values() if r["state"] == "pruned"]
    assert pruned, out  # the space spans 3 decades: its low rates lag at step 100
    for r in pruned:
        at_100 = sorted(c["values"]["100"] for c in complete)
        assert list(r["values"]) == ["0", "100"] and r["value"] > at_100[len(at_100) // 2 - 1], (r, at_100)
        assert f"trial {r['number']} on fast: pruned at step 100 (val_loss " in out
