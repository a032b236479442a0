"""One trial running on a host: its `invoke train` process (a session of its own, stopped with
the sweep), and what its run's progress.jsonl says of it (position, speed, expected end, the
metric at each epoch).

A script in job.epochs says how far it is (epochs and their steps) and its metric is judged at
each epoch's end. A loop of the script's own says no epochs: its length is taken in optimizer
steps from the trial of the sweep that ended last (the steps it took), so its end can be told
once one has. One that draws from a source with no end (nanoGPT's `get_batch`, an endless
sampler: no epoch ever ends) has its metric judged at the global step it was logged at (the
same steps in every trial of one script); a `for epoch in range(n)` of its own over a loader, at
the pass it was logged in."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hvdhetero.cluster import console

LOG_FILE = "trial.log"
SLOWER_THAN_ALONE = re.compile(r"hvdhetero: step \d+: (the job trains about .*?\(metrics\.jsonl: slower_than_alone\))")
"""policy/alone.py's line in a trial's output."""
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
    """(launcher time, work done) of its first progress line: epochs (and their fraction) in
    job.epochs, global steps in a loop of the script's own."""
    position: tuple[int, int] | None = None
    """(epoch, epochs) of its last progress line."""
    last: tuple[float, float] | None = None
    length: float | None = None
    """Its whole work, in first's units: the epochs job.epochs runs, or for a loop of the script's
    own the steps the sweep's ended trials took (the scheduler's; None until one has)."""
    looped: bool = False
    """A loop of the script's own (its progress says no epochs): timed in steps."""
    by_step: bool = False
    """...drawing from a source with no end (no steps an epoch either): its values are keyed by the step logged at."""
    steps: int | None = None
    """The global steps it took (its end record)."""
    values: dict[int, float] = field(default_factory=dict)
    """The metric at each epoch's end (a loop of its own: at each step it was logged at), as reported."""
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
    """A short trial's epochs, or steps where cut_at (--prune: extra work of a host the plan gives no
    whole trial; not one of --trials)."""
    cut_at: int | None = None
    """A short trial of a loop over a source with no end: the sweep stops it once its value at this step is in."""
    stopped_at: float = 0.0

    @classmethod
    def start(cls, trial, host: str, run_dir: Path, argv: list[str], stopped_on: list[str], short: int = 0,
              cut_at: int | None = None) -> Trial:
        """`argv` (the trial's invoke train) started in a session of its own, its output in LOG_FILE."""
        with (run_dir / LOG_FILE).open("w") as log:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, preexec_fn=_stop_with_parent)
        return cls(trial, host, run_dir, proc, time.time(), stopped_on, short=short, cut_at=cut_at)

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

    def slower_than_alone(self) -> str:
        """Its run's line saying the job was slower than its fastest rank alone (rank/training.py's
        verdict: a host whose ranks share one machine's cores, the default `local` host's two), or ''."""
        try:
            text = (self.run_dir / LOG_FILE).read_text(errors="replace")
        except OSError:
            return ""
        found = SLOWER_THAN_ALONE.search(text)
        return found.group(1).strip() if found else ""

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
                self.steps = record["result"].get("step")
                for entry in self.logged:
                    self.logged_names.update(k for k in entry if k not in ("epoch", "step"))

    def progressed(self, at: float, p: dict) -> None:
        done = None
        if p.get("epochs") and p.get("steps"):
            first = int(p.get("first", 0))  # job.epochs(range(1, n + 1)): shown 1/n, as the live line does
            self.position = (int(p["epoch"]) - first, int(p["epochs"]) - first)
            self.length = p["epochs"]
            done = p["epoch"] + p["step"] / p["steps"]
        elif p.get("epochs") is None and p.get("taken") is not None:
            self.looped, done = True, p["taken"]
            self.by_step = p.get("steps") is None
        if done is not None:
            self.first = self.first or (at, done)
            self.last = (at, done)
        logged = p.get("logged") or {}
        self.logged_names.update(logged)
        if not self.by_step:  # each scalar's last value at the epoch it was logged in
            epochs = p.get("logged_epochs") or {}
            for key, value in logged.items():
                epoch = epochs.get(key, p.get("logged_epoch"))
                if epoch is not None:
                    self.seen.setdefault(int(epoch), {})[key] = value
        for entry in p.get("logs") or []:  # every job.log since the last line, in order, at its epoch or step
            when = entry.get("step" if self.by_step else "epoch")
            if when is not None:
                self.seen.setdefault(int(when), {}).update(
                    {k: v for k, v in entry.items() if k not in ("epoch", "step") and isinstance(v, (int, float))})

    def speed(self) -> tuple[float, float] | None:
        """(start-up seconds, seconds a unit of its length: an epoch, or a step of a loop of its
        own) from its progress, once its end can be told."""
        if self.expected_end() is None:
            return None
        (t0, d0), (t1, d1) = self.first, self.last
        unit = (t1 - t0) / (d1 - d0)
        return max(0.0, t0 - self.started - d0 * unit), unit

    def expected_end(self) -> float | None:
        """When it will end, from its progress (None until that can be told)."""
        if self.first is None or self.last is None or not self.length:
            return None
        (t0, f0), (t1, f1) = ((t, d / self.length) for t, d in (self.first, self.last))
        if f1 - f0 < ESTIMATE_AFTER[0] or t1 - t0 < ESTIMATE_AFTER[1] or f1 > 1.0:
            return None  # a loop of its own past the length the last trial had: it cannot tell
        return t1 + (1.0 - f1) * (t1 - t0) / (f1 - f0)

    def short_unit(self) -> str:
        """What a short trial's length counts: its epochs, or a loop's steps where the sweep cuts it."""
        return "steps" if self.cut_at else "epochs"

    def where(self) -> str:
        """How far it is, for the live table: its epoch, or a loop of its own's step."""
        if self.position is not None:
            return f"{self.position[0] + 1}/{self.position[1]}"
        if self.looped and self.last is not None:
            return f"step {int(self.last[1])}" + (f"/{int(self.length)}" if self.length else "")
        return "starting"

    def epoch_values(self, metric: str) -> dict[int, float]:
        """The metric at each epoch it was logged in, or for a source with no end at each step it
        was logged at (the end record's last value there wins)."""
        out = {}
        for when, logged in sorted(self.seen.items()):
            if isinstance(logged.get(metric), (int, float)):
                out[int(when)] = float(logged[metric])
        for entry in self.logged or []:
            if isinstance(entry.get(metric), (int, float)):
                out[int(entry["step" if self.by_step else "epoch"])] = float(entry[metric])
        return out


def _stop_with_parent() -> None:
    """In a trial's process: SIGTERM (invoke train's clean stop) when the sweep dies, even by
    SIGKILL: a trial runs in a session of its own, which nothing else would stop. Linux only
    (PR_SET_PDEATHSIG); a Mac launcher relies on Ctrl-C's and SIGTERM's own stop."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
