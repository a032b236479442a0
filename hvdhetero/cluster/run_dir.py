"""A training run's folder, from the launcher's side: where a new one goes, its `launch.json`
(what `invoke train` was given: hosts, script or recipe, the script's arguments, the job's
settings) and the run `--resume` continues from it. The ranks write the rest (metrics.jsonl,
checkpoints/, what job.save writes: hvdhetero/metrics.py, rank/checkpoint.py).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from hvdhetero import metrics
from hvdhetero.errors import ConfigError

LAUNCH = "launch.json"


def new(name: str, run_dir: str | Path | None, runs: Path) -> str:
    """The run's folder: `run_dir` as given (absolute), else runs/<time>-<name>."""
    return str(Path(run_dir).resolve()) if run_dir else str(runs / f"{time.strftime('%Y%m%d-%H%M%S')}-{name}")


def write_launch(run_dir: str | Path, hosts: list[str], rank0_local: bool, script: str, workdir: str,
                 recipe: list[str], script_args: list[str], settings: dict[str, Any], inventory: str = "",
                 launcher: str = "horovodrun") -> None:
    """What --resume relaunches with (written once the hosts passed their checks); `inventory`:
    the file given with --inventory, absolute ("" for the default one); `launcher`: horovodrun or ray."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / LAUNCH).write_text(json.dumps(
        {"hosts": hosts, "rank0_local": rank0_local, "script": script, "workdir": workdir, "recipe": recipe,
         "script_args": script_args, "settings": {k: v for k, v in settings.items() if k != "resume"},
         "inventory": inventory, "launcher": launcher}, indent=1))


def finished(folder: str | Path) -> str:
    """Where the run in `folder` trained to its end (its metrics.jsonl, rank 0's where rank 0 ran
    here, ends with its end record, and no checkpoint holds a later step than its last epoch's):
    its last epoch and step, in words; else ''."""
    found = metrics.records(Path(folder) / "metrics.jsonl", missing_ok=True)
    if not found or found[-1].get("event") != "end":
        return ""
    epochs = [r for r in found if r.get("event") == "epoch"]
    if not epochs:
        return "its script's own loop"
    saved = [int(p.stem.removeprefix("step-")) for p in (Path(folder) / "checkpoints").glob("step-*.pt")
             if p.stem.removeprefix("step-").isdigit()]
    last = epochs[-1]
    return "" if max(saved, default=0) > last["step"] else f"epoch {last['epoch'] + 1}, step {last['step']}"


def has_checkpoint(folder: Path) -> bool:
    return any((folder / "checkpoints").glob("step-*.pt"))


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
        raise ConfigError(f"--resume {resume}: no such folder {folder}; name a run directory (its path is on the run's "
                          f"console and under {runs}), or `--resume latest`")
    if not launched.is_file():
        raise ConfigError(f"--resume {resume}: {launched} not found (not a run directory invoke train wrote)")
    try:
        saved = json.loads(launched.read_text())
    except ValueError as err:
        raise ConfigError(f"--resume {resume}: {launched} is not the JSON invoke train writes ({err}); start the "
                          "run again") from None
    if saved.get("rank0_local", True) and not has_checkpoint(folder):
        raise ConfigError(f"--resume {resume}: the run has no checkpoint in {folder / 'checkpoints'} (it ended "
                          "before its first; start it again)")
    return str(folder), saved  # rank 0 elsewhere: its host has the checkpoints (the job says if none loads)
