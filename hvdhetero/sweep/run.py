"""`invoke sweep`: a hyper-parameter sweep across the inventory's hosts, one trial per host at a
time, each an ordinary one-host `invoke train` job (pre-flight, env allowlist, run directory,
rank logs) in a session of its own.

    folder = start(Request(...), new_folder(...), tasks_root, recipe_check, recipe_flags)
    folder = resume(SWEEP_DIR, tasks_root)                      # after Ctrl-C: its own options

The parts: request.py (what was asked, a trial's command, the checks before anything starts),
scheduler.py (the study and which host runs what: policy/sweep.py's rule), trial.py (one
trial's process and progress), records.py (trials.jsonl), board.py (the live table).

SWEEP_DIR holds sweep.json (what was asked: --resume continues it), study.db, trials.jsonl (one
record per ended trial: host, parameters, state, value per epoch, times; invoke report reads it)
and trials/NNN (each trial's run directory, its console output in trial.log).
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

from hvdhetero.cluster import checkout
from hvdhetero.errors import ConfigError, HvdHeteroError
from hvdhetero.sweep import space as spaces
from hvdhetero.sweep.request import Request, check_before
from hvdhetero.sweep.scheduler import STUDY_FILE, STUDY_NAME, Sweep

SWEEP_FILE = "sweep.json"


def new_folder(run_dir: str, runs: Path, name: str) -> Path:
    folder = Path(run_dir).resolve() if run_dir else runs / f"{time.strftime('%Y%m%d-%H%M%S')}-sweep-{name}"
    if (folder / SWEEP_FILE).exists():
        raise ConfigError(f"--run-dir {folder} already holds a sweep: continue it with {checkout.invoke()} sweep --resume {folder}, "
                          "or name another folder")
    return folder


def start(request: Request, folder: Path, tasks_root: Path, recipe_check, recipe_flags: list[str],
          timeout: float = 0.0) -> Path:
    """A new sweep: checked (exit 2, nothing written: check_before), then run in `folder` (`timeout`:
    seconds after which no trial starts; 0: none)."""
    space = spaces.load(request.space, request.script)
    check_before(request, space, tasks_root, recipe_check, recipe_flags)
    folder.mkdir(parents=True, exist_ok=True)
    with _locked(folder):
        (folder / SWEEP_FILE).write_text(json.dumps(asdict(request), indent=1) + "\n")
        return _run(request, folder, tasks_root, timeout)


@contextlib.contextmanager
def _locked(folder: Path):
    """One sweep at a time in a folder: a second (a --resume while it runs) would fail the first's trials."""
    import fcntl

    with (folder / ".lock").open("w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise ConfigError(f"another invoke sweep is running in {folder}: wait for it, or stop it (Ctrl-C) "
                              "and resume") from None
        yield


def resume(folder: str, tasks_root: Path, hosts: str | None = None, inventory: str = "", timeout: float = 0.0) -> Path:
    """Continue the sweep in `folder` with its own options (sweep.json), on `hosts` of `inventory`
    if given (else its own): its finished trials kept, those that were running asked again
    (`timeout`: this run's, from now)."""
    import optuna

    from hvdhetero.cluster import inventory as inv

    path = Path(folder).resolve()
    try:
        saved = json.loads((path / SWEEP_FILE).read_text())
        request = Request(**saved)
    except (OSError, ValueError, TypeError) as err:
        raise ConfigError(f"--resume {folder}: {path / SWEEP_FILE} cannot be read ({err}): not a sweep invoke sweep "
                          "started") from None
    request.inventory = str(Path(inventory).resolve()) if inventory else request.inventory
    if hosts or inventory:
        request.hosts = [h.name for h in inv.load(request.inventory).select(hosts or request.hosts)]
    spaces.load(request.space)
    with _locked(path):
        (path / SWEEP_FILE).write_text(json.dumps(asdict(request), indent=1) + "\n")
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.load_study(study_name=STUDY_NAME, storage=f"sqlite:///{path / STUDY_FILE}")
        for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            study.tell(t.number, state=optuna.trial.TrialState.FAIL)  # not counted: trials.jsonl has no record of it
            study.enqueue_trial(t.params)
        return _run(request, path, tasks_root, timeout)


def _run(request: Request, folder: Path, tasks_root: Path, timeout: float = 0.0) -> Path:
    sweep = Sweep(request, folder, tasks_root, timeout=timeout)
    try:
        with _terminate_as_interrupt():
            try:
                sweep.run()
            finally:
                sweep.board.close()  # a live table left running would draw over the messages that follow
    except KeyboardInterrupt:
        sweep.interrupt()
        print(f"sweep: stopped: {sweep.done()} of {request.trials} trials done; continue with\n"
              f"  {checkout.invoke()} sweep --resume {folder}", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    except HvdHeteroError:
        sweep.interrupt()
        raise
    if sweep.done() < request.trials:  # --timeout
        print(f"sweep: {sweep.done()} of {request.trials} trials done within --timeout {timeout:g} s; continue with\n"
              f"  {checkout.invoke()} sweep --resume {folder}", flush=True)
    print(sweep.summary(), flush=True)
    return folder


@contextlib.contextmanager
def _terminate_as_interrupt():
    """SIGTERM and SIGHUP stop the sweep as Ctrl-C does (every trial stopped, the resume command said)."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    before = {s: signal.signal(s, interrupt) for s in (signal.SIGTERM, signal.SIGHUP)
              if signal.getsignal(s) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
