"""Checkpoints and metrics that a crash never leaves half-written.

A checkpoint is written to a temporary file in the same directory, flushed to disk, then
renamed over the target: readers see the old file or the new one, never a torn one.
Metrics are JSON lines, one flushed record per event, so a run killed mid-way keeps every
line it finished.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass
class Snapshot:
    """What a resume needs: weights, optimizer state, and where training stood."""

    model: dict[str, Any]
    optimizer: dict[str, Any]
    epoch: int
    step: int
    config: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)


def save(snapshot: Snapshot, path: str | Path) -> Path:
    """Write `snapshot` to `path` atomically (temp file + fsync + rename)."""
    return save_object(snapshot.__dict__, path)


def save_object(obj: Any, path: str | Path) -> Path:
    """torch.save `obj` to `path` atomically: temp file in the same directory, fsync, rename,
    fsync of the directory (so the rename itself survives a power cut)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
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


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load(path: str | Path, map_location: str | torch.device = "cpu") -> Snapshot:
    """A Snapshot back; tensors and plain values only (weights_only: nothing is unpickled)."""
    return Snapshot(**torch.load(Path(path), map_location=map_location, weights_only=True))


class MetricsLog:
    """Appends one JSON object per line to `path`, each stamped with the wall time."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")

    def write(self, event: str, **fields: Any) -> None:
        record = {"event": event, "time": round(time.time(), 3), **fields}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
