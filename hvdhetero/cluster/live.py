"""The live table of a training run on the launcher's console: per rank its host, device,
batch share, samples/s, compute and communication/wait ms per step; above it the job's epoch,
step, ETA, loss and the script's last logged scalars (its accuracy).

Rates come from the ranks' own clocks: each progress line (progress.Reporter) carries its
rank's monotonic time and running totals, and a rate is the change of a total over the last
WINDOW_S seconds of that clock. Lines that reach the launcher in a burst (a slow link, a busy
launcher) change nothing: a bar timed by their arrival once read "736404 step/s". On a
terminal a rich Live table redraws about once a second; elsewhere (CI logs, `| tee`) a plain
block is printed every PLAIN_EVERY_S seconds and at each epoch's end (once every rank has
reported its last step).
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import IO

from hvdhetero import progress

WINDOW_S = 5.0
"""Rates are averaged over this much of each rank's own time (about 5 of its progress lines)."""
MIN_SPAN_S = 0.05
"""Two lines closer than this in the rank's time give no rate (it would be mostly noise)."""
PLAIN_EVERY_S = 10.0
"""Off a terminal, a block of plain lines at most this often (and at every epoch's end)."""
MAX_LOGGED = 2
"""The script's logged scalars shown: accuracies first, then losses, then whatever it logs."""


@dataclass(frozen=True)
class Point:
    """One progress line of a rank: its clock and running totals."""

    t: float
    steps: int
    samples: int
    compute_s: float
    wait_s: float


@dataclass(frozen=True)
class Row:
    """What the table shows of one rank (None: not known yet)."""

    rank: int
    host: str
    device: str
    share: int
    batch: int
    samples_per_s: float | None
    steps_per_s: float | None
    compute_ms: float | None
    wait_ms: float | None


class Track:
    """One rank's recent progress lines, by its own clock."""

    def __init__(self, window_s: float = WINDOW_S):
        self.window_s = window_s
        self.points: deque[Point] = deque()
        self.last: dict = {}
        self.before: deque[Point] = deque()
        """The last epoch's points: its rates stand until the new epoch has two points of its own."""

    def add(self, record: dict) -> bool:
        """Keep `record` (False for one no newer than the last: a repeat). A new epoch's first line
        starts the window afresh: what the script did between the epochs (its evaluation, an
        eval-mode compile) is no step's, and counted in, a 9 s evaluation made the next epoch's
        first rate 30 samples/s and its ETA 2:18 where 3 s were left."""
        point = Point(float(record["t"]), int(record["n_steps"]), int(record["n_samples"]),
                      float(record["compute_s"]), float(record["wait_s"]))
        if self.points and point.t <= self.points[-1].t:
            return False
        if self.last and record.get("epoch") != self.last.get("epoch") and len(self.points) > 1:
            self.before, self.points = self.points, deque()
        self.points.append(point)
        # keep the newest point at least window_s older than this one, and all after it
        while len(self.points) > 2 and self.points[1].t <= point.t - self.window_s:
            self.points.popleft()
        self.last = record
        return True

    def row(self) -> Row:
        r = self.last
        rates: list[float | None] = [None] * 4
        points = self.points if len(self.points) > 1 else self.before
        if len(points) > 1:
            old, new = points[0], points[-1]
            span, steps = new.t - old.t, new.steps - old.steps
            if span >= MIN_SPAN_S:
                rates[:2] = [(new.samples - old.samples) / span, steps / span]
            if steps > 0:
                rates[2:] = [1e3 * (new.compute_s - old.compute_s) / steps, 1e3 * (new.wait_s - old.wait_s) / steps]
        return Row(int(r["rank"]), str(r.get("host", "?")), str(r.get("device", "?")), int(r.get("share", 0)),
                   int(r.get("batch", 0)), *rates)


@dataclass(frozen=True)
class Status:
    """The job's line: rank 0's position in the run, its loss and logged scalars, and rates."""

    epoch: int
    epochs: int | None
    """None where the script loops over epochs of its own (`range(n)`, not job.epochs): no total."""
    step: int
    steps: int | None
    """None in an endless epoch (a sampler that never runs out: the script's loop ends it)."""
    loss: float | None
    logged: dict
    logged_epoch: int | None
    """The epoch in which the script logged them (its test accuracy: the previous epoch's)."""
    samples_per_s: float | None
    eta_epoch_s: float | None
    eta_run_s: float | None


class Board:
    """Every rank's track and the job's status, fed progress records as they come."""

    def __init__(self, window_s: float = WINDOW_S):
        self.window_s = window_s
        self.tracks: dict[int, Track] = {}
        self.lock = threading.Lock()  # the live display renders from its own thread

    def update(self, record: dict) -> bool:
        """Take one record; True when with it every rank has reported an epoch's last step."""
        with self.lock:
            try:
                rank = int(record["rank"])
                track = self.tracks.get(rank)
                if track is None or _another_process(track.last, record):
                    track = Track(self.window_s)
                if not track.add(record):
                    return False
            except (KeyError, TypeError, ValueError):  # not ours, or from another version
                return False
            self.tracks[rank] = track
            if isinstance(record.get("size"), int):  # --elastic: a host dropped, its ranks' rows go
                for gone in [r for r in self.tracks if r >= record["size"]]:
                    del self.tracks[gone]
            # every rank at the same end (a loop that takes the loader again within an epoch ended a
            # pass there first: that rank's line of it is no end of the epoch another rank reached)
            at = record.get("epoch"), record.get("step")
            return _ends_epoch(record) and all((t.last.get("epoch"), t.last.get("step")) == at and _ends_epoch(t.last)
                                               for t in self.tracks.values())

    def rows(self) -> list[Row]:
        """Every rank's row; the shares from rank 0's latest split where its line has one: each rank's
        own line is of its own moment, and a split moved between two of them showed 2/4 and 3/4."""
        with self.lock:
            rows = [self.tracks[r].row() for r in sorted(self.tracks)]
            split = self.tracks[0].last.get("split") if 0 in self.tracks else None
        if not (isinstance(split, list) and all(isinstance(n, int) for n in split)):
            return rows
        return [replace(r, share=split[r.rank], batch=sum(split)) if r.rank < len(split) else r
                for r in rows]

    def status(self) -> Status | None:
        rows = self.rows()
        with self.lock:
            main = self.tracks.get(0)
            job = dict(main.last) if main else {}
        if "epoch" not in job:
            return None
        rates = [r.samples_per_s for r in rows if r.samples_per_s is not None]
        step_rate = rows[0].steps_per_s if rows and rows[0].rank == 0 else None
        left = job["steps"] - job["step"] if job["steps"] is not None else None
        first = job.get("first", 0)  # job.epochs(range(1, n + 1)): its epoch 1 is the first of n
        epoch = job["epoch"] - first
        epochs = job["epochs"] - first if job.get("epochs") else None
        run_left = left + max(epochs - epoch - 1, 0) * job["steps"] if epochs and left is not None else None
        logged_epoch = job["logged_epoch"] - first if job.get("logged_epoch") is not None else None
        return Status(epoch, epochs, job["step"], job["steps"], job.get("loss"),
                      _ordered(job.get("logged") or {}), logged_epoch, sum(rates) if rates else None,
                      left / step_rate if step_rate and left is not None else None,
                      run_left / step_rate if step_rate and run_left is not None else None)


def _another_process(last: dict | None, record: dict) -> bool:
    """--elastic renumbers ranks after a host is dropped or joins, and a rank's totals start
    again in the Job made for the new membership: its rates start afresh too."""
    return bool(last) and (last.get("host") != record.get("host") or record["n_steps"] < last["n_steps"])


def _ends_epoch(record: dict) -> bool:
    return "steps" in record and record.get("step") == record["steps"]


def _ordered(logged: dict) -> dict:
    """The script's numeric scalars worth a place on the status line, accuracies first."""
    numbers = {k: v for k, v in logged.items() if isinstance(v, (int, float)) and k not in ("epoch", "step")}
    keys = sorted(numbers, key=lambda k: ("acc" not in k, "loss" not in k))[:MAX_LOGGED]
    return {k: numbers[k] for k in keys}


# -- text -----------------------------------------------------------------------------------------

def clock(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def number(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def scalar(value) -> str:
    """A logged scalar as a person reads it: 0.9312, 12.5000, 1,725.16, 3.2e-05, 12,000."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if not math.isfinite(value):
        return str(value)
    if abs(value) >= 1000:
        return f"{value:,.2f}"
    return f"{value:.4f}" if value == 0 or abs(value) >= 0.001 else f"{value:.2g}"


def status_line(status: Status | None) -> str:
    if status is None:
        return "starting"
    if status.steps is None:  # an endless epoch: the script's loop ends it, when is its own
        parts = ([_epoch(status)] if status.epochs else []) + [f"step {status.step}"]  # (a stream's, in job.epochs)
    else:
        eta = f"ETA {clock(status.eta_epoch_s)}" + (f" (run ETA {clock(status.eta_run_s)})" if status.epochs else "")
        parts = [_epoch(status), f"step {status.step}/{status.steps} ({100 * status.step // max(status.steps, 1)}%)",
                 eta]
    if status.loss is not None:
        recent = f" (last {progress.RECENT_BATCHES} batches)" if status.steps is None else ""
        parts.append(f"loss {status.loss:.4f}{recent}")
    parts += [f"{k} {scalar(v)}" for k, v in status.logged.items()]
    if status.logged and status.logged_epoch is not None and status.logged_epoch != status.epoch:
        parts[-1] += f" (epoch {status.logged_epoch + 1})"
    parts.append(f"{number(status.samples_per_s)} samples/s")
    return "  ".join(parts)


def epoch_line(status: Status) -> str:
    """What stays on a terminal of each epoch once it ends (what the script logs after it, such
    as its test accuracy, comes later: the script's own print shows it)."""
    loss = f": loss {status.loss:.4f}," if status.loss is not None else ":"
    return f"{_epoch(status)} done{loss} {number(status.samples_per_s)} samples/s"


def _epoch(status: Status) -> str:
    """`epoch 3/10` under job.epochs; `epoch 3` in a loop of the script's own (or over steps)."""
    return f"epoch {status.epoch + 1}" + (f"/{status.epochs}" if status.epochs else "")


def plain_block(board: Board) -> list[str]:
    """The status line and one aligned line per rank, for a log."""
    rows = board.rows()
    host_w = max([len(r.host) for r in rows] + [1])
    dev_w = max([len(r.device) for r in rows] + [1])
    lines = [status_line(board.status())]
    for r in rows:
        lines.append(f"  rank {r.rank}  {r.host:<{host_w}}  {r.device:<{dev_w}}  share {r.share}/{r.batch}  "
                     f"{number(r.samples_per_s):>7} samples/s  compute {number(r.compute_ms, 1)} ms  "
                     f"comm/wait {number(r.wait_ms, 1)} ms per step")
    return lines


# -- displays ---------------------------------------------------------------------------------------

class PlainLines:
    """Off a terminal: a block of plain lines every `every` seconds and at each epoch's end."""

    def __init__(self, out: IO[str], every: float = PLAIN_EVERY_S):
        self.out, self.every, self.board = out, every, Board()
        self._printed: float | None = None

    def update(self, record: dict) -> None:
        ended = self.board.update(record)
        if self._printed is None:  # the first lines have no rates yet: the first block comes later
            self._printed = time.monotonic()
        if ended or time.monotonic() - self._printed >= self.every:
            self._printed = time.monotonic()
            self.echo("\n".join(plain_block(self.board)) + "\n")

    def echo(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    def close(self) -> None:
        pass


class LiveTable:
    """On a terminal: the table redrawn in place about once a second (rich's Live), from the
    first progress line on; other lines and each finished epoch's line print above it."""

    def __init__(self, out: IO[str]):
        from rich.console import Console

        self.console = Console(file=out, highlight=False, soft_wrap=True)
        self.board = Board()
        self.live = None

    def update(self, record: dict) -> None:
        ended = self.board.update(record)
        if self.live is None:
            from rich.live import Live

            self.live = Live(get_renderable=self.render, console=self.console, refresh_per_second=1)
            self.live.start()
        if ended:
            self.console.print(epoch_line(self.board.status()), markup=False, emoji=False)

    def echo(self, text: str) -> None:
        if self.live is None:
            self.console.file.write(text)
            self.console.file.flush()
        else:
            self.console.print(text.rstrip("\n"), markup=False, emoji=False)

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()  # its last drawing stays
            self.live = None

    def render(self):
        """One line a rank, within the terminal's width: no vertical rules, the numbers whole,
        the host and device names cut with an ellipsis where they must be (a Mac and a PC fit
        in 80 columns whole: `cuda:0 (RTX 4070 Ti)`)."""
        from rich import box
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        rows = self.board.rows()
        rates = [r.samples_per_s for r in rows if r.samples_per_s is not None]
        cells = [[str(r.rank), r.host, short_device(r.device), f"{r.share}/{r.batch}", number(r.samples_per_s),
                  number(r.compute_ms, 1), number(r.wait_ms, 1)] for r in rows]
        cells.append(["all", "", "", "", number(sum(rates) if rates else None), "", ""])
        names = ("rank", "host", "device", "share", "samples/s", "compute", "comm/wait")
        widths = [max(len(c) for c in column) for column in zip(names, *cells)]
        room = self.console.width - sum(widths[3:]) - widths[0] - 2 * (len(names) - 1)
        widths[1:3] = fitted(widths[1], widths[2], room)
        kept = [i for i, w in enumerate(widths) if w]  # too narrow a terminal: the device, then the host, left out
        table = Table(box=box.SIMPLE_HEAD, padding=(0, 1, 0, 0), pad_edge=False, show_edge=False,
                      caption="compute, comm/wait: ms per step", caption_justify="left")
        for i in kept:
            table.add_column(names[i], justify="left" if names[i] in ("host", "device") else "right", no_wrap=True,
                             overflow="ellipsis", width=widths[i])
        for n, row in enumerate(cells):
            table.add_row(*(row[i] for i in kept), end_section=n == len(cells) - 2)
        return Group(Text(folded(status_line(self.board.status()), self.console.width)), table)


def folded(line: str, width: int) -> str:
    """A status line on as many lines as the terminal needs, broken between its parts (two
    spaces apart), not inside `3,691 samples/s` (the live display crops what it does not fold)."""
    lines: list[str] = []
    for part in line.split("  "):
        if lines and len(lines[-1]) + 2 + len(part) <= width:
            lines[-1] += "  " + part
        else:
            lines.append(part)
    return "\n".join(lines)


def fitted(host: int, device: int, room: int) -> tuple[int, int]:
    """The host and device columns' widths within `room` (their gaps counted in it), the device's
    name kept longer (it says what computes); a column narrower than 4 (`mac…`) is left out (0),
    the device's first, so that no number is cut (down to the ~45 columns the numbers need)."""
    if host + device <= room:
        return host, device
    if room >= 4 + 4:
        host = max(4, min(host, room // 3))
        return host, min(device, room - host)
    return (min(host, room + 2), 0) if room + 2 >= 4 else (0, 0)  # the device's gap is the host's now


def short_device(device: str) -> str:
    """The live table's name of a device: the vendor's words that every GPU of its kind has left
    out (`cuda:0 (NVIDIA GeForce RTX 4070 Ti)` -> `cuda:0 (RTX 4070 Ti)`)."""
    return device.replace("NVIDIA ", "").replace("GeForce ", "")


def display_for(out: IO[str]):
    """The live table where `out` is a terminal that can redraw; plain lines where it is not."""
    try:
        terminal = out.isatty() and os.environ.get("TERM", "") not in ("dumb", "unknown")
    except (AttributeError, ValueError):  # no isatty, or closed
        terminal = False
    return LiveTable(out) if terminal else PlainLines(out)
