"""Checkpoints that a crash never leaves half-written.

A checkpoint is written to a temporary file in the same directory, flushed to disk, then
renamed over the target: readers see the old file or the new one, never a torn one. (The
metrics are hvdhetero/metrics.py's: JSON lines, one flushed record per event, so a run killed
mid-way keeps every line it finished.)
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

import torch

from hvdhetero.errors import briefly


def save_object(obj: Any, path: str | Path) -> Path:
    """torch.save `obj` to `path` atomically: temp file in the same directory, fsync, rename,
    fsync of the directory (so the rename itself survives a power cut). The file's mode is what
    the umask makes of 0o666, as torch.save's (a temporary file's own 0o600 left job.save's model
    unreadable to the user's other accounts and services)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = temporary_beside(path)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def temporary_beside(path: Path) -> tuple[int, Path]:
    """A new file in `path`'s folder, open for writing, to be renamed over `path` once written
    whole: made as open() makes a file (the umask in force applies, as to torch.save's), named
    by this process and a random token (`.NAME.PID.TOKEN.tmp`: a glob of `.NAME*.tmp` finds it)."""
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    return os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666), tmp


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- a run's checkpoints: RUN_DIR/checkpoints/step-000123.pt, the newest K kept ------------------

FOLDER = "checkpoints"
FORMAT = 1


def path_for(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / FOLDER / f"step-{step:09d}.pt"


def listed(run_dir: str | Path) -> list[Path]:
    """The run's checkpoints, oldest first (temporary files of an interrupted save excluded)."""
    folder = Path(run_dir) / FOLDER
    return sorted(folder.glob("step-*.pt")) if folder.is_dir() else []


def load(path: str | Path) -> dict[str, Any]:
    """A checkpoint back: tensors and plain values only (weights_only: nothing is unpickled)."""
    state = torch.load(Path(path), map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{path}: not an hvdhetero checkpoint (format {FORMAT})")
    return state


def newest(run_dir: str | Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint of the run that loads, and its state; None when none does. A file
    that does not load (a disk that filled, a copy cut short) is passed over, not fatal, and said."""
    for path in reversed(listed(run_dir)):
        try:
            return path, load(path)
        except Exception as err:  # noqa: BLE001 - any damage: try the one before
            print(f"hvdhetero: {path} does not load ({briefly(err)}): passed over for the one before", flush=True)
    return None


def keep_newest(run_dir: str | Path, keep: int) -> None:
    """Remove all but the newest `keep` checkpoints, and the temporary files of saves that a
    kill interrupted: those older than the newest checkpoint (a save still being written by
    another process, a leftover rank 0 of a killed run, is newer and stays)."""
    checkpoints = listed(run_dir)
    for path in checkpoints[:-keep] if keep else checkpoints:
        path.unlink(missing_ok=True)
    if checkpoints:
        newest_time = checkpoints[-1].stat().st_mtime if checkpoints[-1].exists() else 0.0
        for path in (Path(run_dir) / FOLDER).glob(".step-*.tmp"):
            try:
                if path.stat().st_mtime < newest_time:
                    path.unlink()
            except FileNotFoundError:
                pass


def rng_state(device: str = "cpu") -> dict[str, Any]:
    """This process's random states (torch's CPU generator, numpy's, random's) as tensors and
    plain values, and on a CUDA or MPS rank (`device`, its device's name) that device's own, which
    its dropout draws from (of the current CUDA device: the rank's, set up before any step)."""
    import random

    import numpy as np

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state = {"torch": torch.get_rng_state(), "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss,
                                                       gauss],
             "random": [version, list(internal), gauss_next]}
    if device == "cuda":
        state["cuda"] = torch.cuda.get_rng_state()
    elif device == "mps":
        state["mps"] = torch.mps.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import random

    import numpy as np

    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():  # the rank's device (a CPU rank sees none)
        torch.cuda.set_rng_state(state["cuda"])
    if "mps" in state and torch.backends.mps.is_available():
        torch.mps.set_rng_state(state["mps"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = state["random"]
    random.setstate((version, tuple(internal), gauss_next))
