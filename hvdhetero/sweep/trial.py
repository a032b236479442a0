"""One trial running on a host: its `invoke train` process (a session of its own, stopped with
the sweep), and what its run's progress.jsonl says of it (position, speed, expected end, the
metric at each epoch)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hvdhetero.cluster import console

LOG_FILE = "trial.log"
"""The trial's console output, in its run directory."""
ESTIMATE_AFTER = (0.05, 2.0)
"""A trial's end is estimated once it has gone this fraction further and this many seconds
since its first progress line (the steps before include start-up: data, calibration)."""


@dataclass
class Trial:
    """A trial running on a host."""

    trial: Any
    """optuna.trial.Trial"""
    host: str
    run_dir: Path
    proc: subprocess.Popen
    started: float
    stopped_on: list[str] = field(default_factory=list)
    """Hosts where a copy of this trial was stopped (too slow there)."""
    offset: int = 0
    first: tuple[float, float] | None = None
    """(launcher time, fraction done) of its first progress line."""
    position: tuple[int, int] | None = None
    """(epoch, epochs) of its last progress line."""
    last: tuple[float, float] | None = None
    values: dict[int, float] = field(default_factory=dict)
    """The metric at each epoch's end, as reported."""
    logged: list[dict] | None = None
    """Every job.log of the run (its end record)."""
    logged_names: set[str] = field(default_factory=set)
    seen: dict[int, dict] = field(default_factory=dict)
    """The scalars rank 0 had logged by each epoch's end, from its progress lines."""
    judged: bool = False
    """keep_running asked (once, at its first estimate)."""
    stopping: str = ""
    """Why we stopped it: pruned, moved, superseded (a copy finished first), interrupted, cut."""
    short: int = 0
    """A short trial's epochs (--prune: extra work of a host the plan gives no whole trial; not one of --trials)."""
    stopped_at: float = 0.0

    @classmethod
    def start(cls, trial, host: str, run_dir: Path, argv: list[str], stopped_on: list[str], short: int = 0) -> Trial:
        """`argv` (the trial's invoke train) started in a session of its own, its output in LOG_FILE."""
        with (run_dir / LOG_FILE).open("w") as log:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, preexec_fn=_stop_with_parent)
        return cls(trial, host, run_dir, proc, time.time(), stopped_on, short=short)

    def stop(self, why: str) -> None:
        """SIGTERM to its session (invoke train's clean stop), once; `why` says what it is stopping for."""
        if self.stopping:
            return
        self.stopping, self.stopped_at = why, time.time()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL to its whole session (it did not end in time after stop)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def said(self) -> str:
        """The line of its output that says why it ended: its last error, else its last line."""
        try:
            lines = [l for l in (self.run_dir / LOG_FILE).read_text(errors="replace").splitlines() if l.strip()]
        except OSError:
            return ""
        errors = [l for l in lines if l.startswith("error:") or "hvdhetero:" in l]
        return (errors or lines or [""])[-1].strip()[:500]

    def read(self) -> None:
        """New lines of its progress.jsonl."""
        path = self.run_dir / console.PROGRESS_FILE
        try:
            with path.open("rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return
        whole = chunk[:chunk.rfind(b"\n") + 1]
        self.offset += len(whole)
        for line in whole.decode(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if "progress" in record:
                self.progressed(record["at"], record["progress"])
            elif record.get("result", {}).get("event") == "end":
                self.logged = record["result"].get("logs", [])
                for entry in self.logged:
                    self.logged_names.update(k for k in entry if k not in ("epoch", "step"))

    def progressed(self, at: float, p: dict) -> None:
        if p.get("epochs") and p.get("steps"):
            self.position = (int(p["epoch"]), int(p["epochs"]))
            done = (p["epoch"] + p["step"] / p["steps"]) / p["epochs"]
            self.first = self.first or (at, done)
            self.last = (at, done)
        logged = p.get("logged") or {}
        self.logged_names.update(logged)
        epochs = p.get("logged_epochs") or {}
        for key, value in logged.items():  # each scalar at the epoch it was logged in
            epoch = epochs.get(key, p.get("logged_epoch"))
            if epoch is not None:
                self.seen.setdefault(int(epoch), {})[key] = value

    def speed(self) -> tuple[float, float] | None:
        """(start-up seconds, seconds an epoch) from its progress, once its end can be told."""
        if self.expected_end() is None or self.position is None:
            return None
        (t0, f0), (t1, f1) = self.first, self.last
        whole = (t1 - t0) / (f1 - f0)
        return max(0.0, t0 - self.started - f0 * whole), whole / self.position[1]

    def expected_end(self) -> float | None:
        """When it will end, from its progress (None until that can be told)."""
        if self.first is None or self.last is None:
            return None
        (t0, f0), (t1, f1) = self.first, self.last
        if f1 - f0 < ESTIMATE_AFTER[0] or t1 - t0 < ESTIMATE_AFTER[1]:
            return None
        return t1 + (1.0 - f1) * (t1 - t0) / (f1 - f0)

    def epoch_values(self, metric: str) -> dict[int, float]:
        """The metric at each epoch it was logged in (the end record's last value an epoch wins)."""
        out = {}
        for epoch, logged in sorted(self.seen.items()):
            if isinstance(logged.get(metric), (int, float)):
                out[int(epoch)] = float(logged[metric])
        for entry in self.logged or []:
            if isinstance(entry.get(metric), (int, float)):
                out[int(entry["epoch"])] = float(entry[metric])
        return out


def _stop_with_parent() -> None:
    """In a trial's process: SIGTERM (invoke train's clean stop) when the sweep dies, even by
    SIGKILL: a trial runs in a session of its own, which nothing else would stop. Linux only
    (PR_SET_PDEATHSIG); a Mac launcher relies on Ctrl-C's and SIGTERM's own stop."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
