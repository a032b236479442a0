"""A training run's folder, from the launcher's side: where a new one goes, its `launch.json`
(what `invoke train` was given: hosts, script or recipe, the script's arguments, the job's
settings) and the run `--resume` continues from it. The ranks write the rest (metrics.jsonl,
checkpoints/, what job.save writes: hvdhetero/metrics.py, rank/checkpoint.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hvdhetero import metrics
from hvdhetero.cluster import console
from hvdhetero.config import run_name
from hvdhetero.errors import ConfigError

LAUNCH = "launch.json"
ENDED = "ended.json"
"""Written by the launcher when a run's every rank ended cleanly: rank 0's end result (its step)."""


def new(name: str, run_dir: str | Path | None, runs: Path) -> str:
    """The run's folder: `run_dir` as given (absolute), else runs/<time>-<name>."""
    return str(Path(run_dir).resolve()) if run_dir else str(runs / run_name(name))


def write_launch(run_dir: str | Path, hosts: list[str], rank0_local: bool, script: str, workdir: str,
                 recipe: list[str], script_args: list[str], settings: dict[str, Any], inventory: str = "",
                 launcher: str = "horovodrun", checked: bool = False) -> None:
    """What --resume relaunches with (written once the hosts passed their checks); `inventory`:
    the file given with --inventory, absolute ("" for the default one); `launcher`: horovodrun or ray.
    `checked`: a new run that `fresh` let into the folder, whose leftovers it starts anew."""
    writable(run_dir)
    Path(run_dir, ENDED).unlink(missing_ok=True)  # a launch under way: an earlier run's end in this folder is past
    if checked and not settings.get("resume"):  # a new run where one stopped before training (fresh refused others)
        for pattern in LEFTOVERS:
            for path in Path(run_dir).glob(pattern):
                path.unlink(missing_ok=True)
    (Path(run_dir) / LAUNCH).write_text(json.dumps(
        {"hosts": hosts, "rank0_local": rank0_local, "script": script, "workdir": workdir, "recipe": recipe,
         "script_args": script_args, "settings": {k: v for k, v in settings.items() if k != "resume"},
         "inventory": inventory, "launcher": launcher}, indent=1))


class Finished(Exception):
    """--resume of a run that trained to its end: nothing to relaunch (said, exit 0)."""


def mark_ended(run_dir: str | Path, results: list[dict]) -> None:
    """The run ended cleanly (every rank's script returned): its end step, which --resume reads."""
    end = next((r for r in reversed(results) if r.get("event") == "end"), None)
    if end is not None and Path(run_dir, LAUNCH).is_file():
        Path(run_dir, ENDED).write_text(json.dumps({"step": end.get("step"), "seconds": end.get("seconds")}))


def finished(folder: str | Path) -> str:
    """Where the run in `folder` trained to its end (every rank's script returned, and no
    checkpoint holds a later step than its end's): its epochs and step, in words; else ''. A run
    that failed after its last epoch (in the script's code after its loop) is not: its resume
    runs that code again."""
    try:
        end = json.loads(Path(folder, ENDED).read_text())
    except (OSError, ValueError):
        return ""
    step = end.get("step") or 0
    if max((s for s, _ in checkpoints(folder)), default=0) > step:
        return ""
    epochs = len({r.get("epoch") for r in metrics.records(Path(folder) / "metrics.jsonl", "epoch", missing_ok=True)})
    return f"{epochs} epoch{'s' * (epochs != 1)}, step {step}" if epochs else f"step {step}"


def checkpoints(folder: str | Path) -> list[tuple[int, Path]]:
    """The run's checkpoints (rank 0 writes RUN_DIR/checkpoints/step-<step>.pt): (step, path), oldest first."""
    saved = ((p.stem.removeprefix("step-"), p) for p in (Path(folder) / "checkpoints").glob("step-*.pt"))
    return sorted((int(step), p) for step, p in saved if step.isdigit())


def keeps_none(folder: str | Path) -> bool:
    """Whether the run in `folder` was launched with --keep-checkpoints 0 (it writes none)."""
    try:
        return json.loads(Path(folder, LAUNCH).read_text()).get("settings", {}).get("keep_checkpoints") == 0
    except (OSError, ValueError, AttributeError):
        return False


def has_checkpoint(folder: Path) -> bool:
    return bool(checkpoints(folder))


TRAINED = ("epoch", "log", "window", "exchange", "checkpoint", "end")
"""Records a run writes once it trains: a folder holding them holds a run worth keeping."""
PROGRESS = console.PROGRESS_FILE
"""Rank 0's live lines as the launcher kept them: lines only once steps ran."""
LEFTOVERS = (metrics.FILE, PROGRESS, "rank-*.log")
"""What a run that stopped before training leaves (its start records, its ranks' output): a new
run in its folder starts them anew."""


def fresh(run_dir: str | Path) -> None:
    """Where a new run (not --resume) may go: a folder, or none yet (made), that holds no earlier
    run that trained: its checkpoints would sit among the new run's (a later --resume loads the
    newest, maybe the old run's) and its metrics would run on into the new run's (invoke report
    drew both as one). ConfigError (exit 2) saying how to go on otherwise."""
    folder = Path(run_dir)
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"--run-dir {run_dir} is a file: name a folder (made if missing)")
    above = next((p for p in folder.parents if p.exists()), None)
    if above is not None and not above.is_dir():
        raise ConfigError(f"--run-dir {run_dir}: {above} is a file, not a folder")
    elsewhere = ("give the new run its own folder (or delete {} first; a script that resumes itself from a "
                 "file here: launch it into a new --run-dir, pointing it at that file)")
    if ended := finished(folder):
        raise ConfigError(f"--run-dir {run_dir} holds a run that trained to its end ({ended}): "
                          + elsewhere.format(run_dir))
    if saved := checkpoints(folder):
        step, newest = saved[-1]
        raise ConfigError(f"--run-dir {run_dir} holds an earlier run's checkpoints (newest {newest.name}, step "
                          f"{step}): continue that run with `invoke train --resume {run_dir}`, or "
                          + elsewhere.format(folder / "checkpoints"))
    live = folder / PROGRESS  # (a loop of its own that never called job.log leaves its live lines alone)
    try:
        trained = (any(r.get("event") in TRAINED for r in metrics.records(folder / metrics.FILE, missing_ok=True))
                   or (live.is_file() and '"progress"' in live.read_text(errors="replace")))
    except (OSError, ValueError, ConfigError):
        trained = True  # unreadable: not ours to overwrite
    if trained:
        raise ConfigError(f"--run-dir {run_dir} holds an earlier run that trained ({metrics.FILE}, {PROGRESS}) and "
                          "kept no checkpoint to resume from: " + elsewhere.format(run_dir))


def writable(run_dir: str | Path) -> None:
    """ConfigError (exit 2) where the run's folder cannot be made or written (a read-only disk)."""
    try:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        probe = Path(run_dir, ".hvdhetero-write-check")
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"--run-dir {run_dir}: cannot write there ({err.strerror or err}): name a folder you can "
                          "write to") from None


def resumable(resume: str, runs: Path) -> tuple[str, dict[str, Any]]:
    """The run directory `--resume` names (latest: the newest under `runs` with a checkpoint) and
    the options it was launched with (its launch.json); ConfigError (exit 2) naming what is
    wrong otherwise."""
    if resume == "latest":
        found = sorted((p for p in runs.glob("*") if (p / LAUNCH).is_file() and has_checkpoint(p)),
                       key=lambda p: p.stat().st_mtime)
        if not found:
            raise ConfigError(f"--resume latest: no run under {runs} has a checkpoint")
        folder = found[-1]
    else:
        folder = Path(resume).resolve()
    launched = folder / LAUNCH
    if not folder.is_dir():
        raise ConfigError(f"--resume {resume}: " + ("a file, not a run directory" if folder.exists() else
                                                     f"no such folder {folder}") + "; name a run directory (its path "
                          f"is on the run's console and under {runs}), or `--resume latest`")
    if not launched.is_file():
        raise ConfigError(f"--resume {resume}: {launched} not found (not a run directory invoke train wrote)")
    try:
        saved = json.loads(launched.read_text())
    except ValueError as err:
        raise ConfigError(f"--resume {resume}: {launched} is not the JSON invoke train writes ({err}); start the "
                          "run again") from None
    if ended := finished(folder):
        raise Finished(f"hvdhetero: --resume {resume}: the run in {folder} trained to its end ({ended}); nothing is "
                       "left to resume. To train on, start a new run (" + (
                           f"invoke train --script {saved['script']}, the script's own option for how long after --"
                           if saved.get("script") else "--epochs for how long") + ")")
    if saved.get("rank0_local", True) and not has_checkpoint(folder):
        raise ConfigError(f"--resume {resume}: the run has no checkpoint in {folder / 'checkpoints'} ("
                          + ("it kept none: --keep-checkpoints 0" if keeps_none(folder)
                             else "it ended before its first")
                          + "); start it again")
    return str(folder), saved  # rank 0 elsewhere: its host has the checkpoints (the job says if none loads)
