"""The tagged-line protocol between the ranks and the launcher's console: the rank side.

horovodrun forwards each rank's output with a `[rank]<stdout>:` prefix, in bursts when the
link is slow, and rank 0 may run on another machine. So every rank prints its own running
totals as one tagged JSON line about once a second (`Reporter`), stamped with its own clock:
the launcher computes rates from those stamps, never from when lines reach it (a bar timed by
arrival read "736404 step/s" after a burst). A failing rank prints one tagged summary
(rank/runner.py), rank 0 its results, and every rank a heartbeat. The launcher's side
(hvdhetero/cluster/console.py, live.py) turns them into the live table, the failure summary and
the rank logs. This module needs nothing but the standard library.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time

TAG_MARK = "@@hvdhetero-"
"""What every tag below starts with."""
TAG = "@@hvdhetero-progress "
"""A rank's running totals and the epoch's position (and from rank 0 its loss and logged scalars)."""
ERROR_TAG = "@@hvdhetero-error "
RESULT_TAG = "@@hvdhetero-result "
"""A job's answer for the launcher (invoke plan's plan), one JSON line from rank 0."""
DONE_TAG = "@@hvdhetero-done"
"""A rank's script has returned: from now on it may be quiet (its heartbeat stops at exit).
done_line adds the job's step at that moment."""
ALIVE_TAG = "@@hvdhetero-alive "
"""Every rank's heartbeat, from a thread of its own: a rank that sends none for SILENT_S is
frozen (SIGSTOP, a sleeping laptop) or cut off, whatever its training is doing."""
HEARTBEAT_S = 5.0
SILENT_S = 45.0
"""No line from a rank for this long ends the job (a heartbeat every 5 s; 9 missed in a row).
It bounds detection at ~46 s, under a minute. A slow step, a long calibration or a checkpoint
save cannot trip it: the heartbeat thread does not wait for them. What it cannot tell apart:
a rank whose host is so overloaded that a thread gets no time for 45 s (never seen here)."""
RECENT_BATCHES = 100
"""An endless epoch's (a sampler that never runs out) loss on the live line: that of its last
batches this many, as the epoch's mean would be that of every batch since the start."""
REPORT_S = 1.0
"""A rank prints its totals at most this often (and at its first step and each epoch's first and last):
the live table refreshes about once a second."""
# horovodrun's prefix on forwarded rank output, e.g. "[0]<stdout>:" (maybe with a timestamp).
# horovodrun tags a line "[RANK]<stdout>:", mpirun --tag-output "[JOB,RANK]<stdout>:".
PREFIX = re.compile(r"^(?:\S+ )?\[(?:\d+,)?(\d+)\]<(stdout|stderr)>:")


def failure_line(host: str, error: str, frames: list[str] = (), traceback: str = "",
                 step: int | None = None) -> str:
    """Rank side: the one tagged summary of this rank's failure (rank/runner.py's for a script's
    error, rank/host.py's for a start that never finished); cluster/failure.py says it.
    `step`: the job's global step when it failed (None before job.prepare)."""
    import socket

    return ERROR_TAG + json.dumps({"rank": int(os.environ.get("HOROVOD_RANK", 0)), "host": host,
                                   "hostname": socket.gethostname(), "error": error, "frames": list(frames),
                                   "traceback": traceback or error + "\n", "step": step})


def done_line(step: int | None) -> str:
    """Rank side: this rank's script returned, at the job's global `step` (None: no job.prepare)."""
    return DONE_TAG + (f" {json.dumps({'step': step})}" if step is not None else "")


def done_step(body: str) -> int | None:
    """Launcher side: the step a DONE line (done_line) names, if any."""
    try:
        step = json.loads(body[body.index(DONE_TAG) + len(DONE_TAG):].strip() or "null")
        return int(step["step"]) if isinstance(step, dict) else None
    except (ValueError, KeyError, TypeError):
        return None


def heartbeat(rank: int, host: str, every: float = HEARTBEAT_S) -> threading.Thread:
    """Rank side: print this rank's heartbeat every `every` seconds from a daemon thread."""
    line = (ALIVE_TAG + json.dumps({"rank": rank, "host": host, "pid": os.getpid()}) + "\n").encode()
    fd = os.dup(2)  # stderr, one write() each: never spliced into a stdout line (results, progress)

    def beat():
        while True:
            try:
                os.write(fd, line)
            except OSError:  # nobody reads us any more: the launcher is gone
                os._exit(1)
            time.sleep(every)

    thread = threading.Thread(target=beat, name="hvdhetero-heartbeat", daemon=True)
    thread.start()
    return thread


class Reporter:
    """Rank side: this rank's running totals since it started (steps, samples, seconds of
    compute and of communication or waiting), printed as one tagged line with this rank's
    monotonic clock at most every `every` seconds, and always at its first step and at each
    epoch's first and last."""

    def __init__(self, rank: int, host: str, device: str, every: float = REPORT_S, out=None,
                 size: int | None = None):
        self.who = {"rank": rank, "host": host, "device": device, **({"size": size} if size else {})}
        self.every, self.out = every, out
        self.steps = self.samples = 0
        self.compute_s = self.wait_s = 0.0
        self._printed: float | None = None
        self._round = 0
        self._last: dict | None = None
        self._job: tuple[int, int, dict] | None = None

    def exchanged(self, rounds: int, seconds: float) -> float:
        """--sync local/diloco: the seconds the last exchange blocked this rank, once per round
        (0 until `rounds` moves on)."""
        if rounds == self._round:
            return 0.0
        self._round = rounds
        return seconds

    def step(self, *, samples: int, compute_s: float, wait_s: float, share: int, batch: int,
             epoch_end: bool = False, **job) -> bool:
        """Count one of this rank's steps; print the totals if due (True when printed). `job`: the
        epoch, epochs, step and steps (and from rank 0 its loss and the script's logged scalars)."""
        self.steps += 1
        self.samples += samples
        self.compute_s += compute_s
        self.wait_s += wait_s
        self._job = share, batch, job
        now = time.monotonic()
        # an epoch's first step too: an epoch shorter than `every` had its last line alone, and the
        # table showed the epoch before's rates for it (two epochs' rows alike to the digit)
        epoch_begins = self._last is not None and job.get("epoch") != self._last.get("epoch")
        if self._printed is not None and now - self._printed < self.every and not epoch_end and not epoch_begins:
            return False
        self._print(now, share, batch, job)
        return True

    def again(self, **changes) -> None:
        """The last step's line again with `changes` (an epoch's end the line did not count to),
        unless the last line printed said them already at that step."""
        if self._job is None:
            return
        last = self._last
        if last is not None and last["n_steps"] == self.steps and all(last.get(k) == v for k, v in changes.items()):
            return
        share, batch, job = self._job
        job = {**job, **changes, **({"logs": []} if "logs" in job else {})}  # (unsent ones go with the next)
        self._print(time.monotonic(), share, batch, job)

    def _print(self, now: float, share: int, batch: int, job: dict) -> None:
        self._printed = now
        line = {**self.who, "t": round(now, 6), "n_steps": self.steps, "n_samples": self.samples,
                "compute_s": round(self.compute_s, 6), "wait_s": round(self.wait_s, 6), "share": share,
                "batch": batch, **job}
        self._last = line
        print(TAG + json.dumps(line), file=self.out or sys.stdout, flush=True)
