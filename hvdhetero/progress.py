"""Rank 0's progress and any rank's failure, as the launcher's console shows them.

horovodrun forwards each rank's output with a `[rank]<stdout>:` prefix and splits a bar's
carriage-return updates into garbled lines, and rank 0 may run on another machine. So rank 0
prints one tagged JSON line per update (throttled), a failing rank one tagged summary
(rank/runner.py), and the launcher, reading horovodrun's output, turns the progress lines into
a tqdm bar per epoch, collects the failures, and passes every other line through. Both ends of
this protocol live here; the rank side needs nothing but the standard library.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from typing import IO, Iterable

TAG = "@@hvdhetero-progress "
ERROR_TAG = "@@hvdhetero-error "
RESULT_TAG = "@@hvdhetero-result "
"""A job's answer for the launcher (invoke plan's plan), one JSON line from rank 0."""
DONE_TAG = "@@hvdhetero-done"
"""A rank's script has returned: from now on it may be quiet (its heartbeat stops at exit)."""
ALIVE_TAG = "@@hvdhetero-alive "
"""Every rank's heartbeat, from a thread of its own: a rank that sends none for SILENT_S is
frozen (SIGSTOP, a sleeping laptop) or cut off, whatever its training is doing."""
HEARTBEAT_S = 5.0
SILENT_S = 45.0
"""No line from a rank for this long ends the job (a heartbeat every 5 s; 9 missed in a row).
It bounds detection at ~46 s, under a minute. A slow step, a long calibration or a checkpoint
save cannot trip it: the heartbeat thread does not wait for them. What it cannot tell apart:
a rank whose host is so overloaded that a thread gets no time for 45 s (never seen here)."""
# horovodrun's prefix on forwarded rank output, e.g. "[0]<stdout>:" (maybe with a timestamp).
PREFIX = re.compile(r"^(?:\S+ )?\[(\d+)\]<(stdout|stderr)>:")
_last = 0.0


def heartbeat(rank: int, host: str, every: float = HEARTBEAT_S) -> threading.Thread:
    """Rank side: print this rank's heartbeat every `every` seconds from a daemon thread."""
    line = (ALIVE_TAG + json.dumps({"rank": rank, "host": host}) + "\n").encode()
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


def report(*, step: int, steps: int, min_interval: float = 0.2, **fields) -> None:
    """Rank side: print a progress line, at most every `min_interval` s and at epoch ends."""
    global _last
    now = time.monotonic()
    if step != steps and now - _last < min_interval:
        return
    _last = now
    print(TAG + json.dumps({"step": step, "steps": steps, **fields}), flush=True)


def relay(lines: Iterable[str], out: IO[str] = sys.stdout, results: list[dict] | None = None,
          alive: dict[int, tuple[float, str]] | None = None) -> list[dict]:
    """Launcher side: draw tagged lines as one bar per epoch; echo the rest (rank 0's printed
    lines without horovodrun's prefix, as a script's print reads on one machine). Returns the
    failures ranks reported, in order; once one is in, horovodrun's own tracebacks about
    stopping the other ranks are not echoed. Result lines go to `results`, not the console."""
    from tqdm import tqdm

    bar, bar_epoch, failures = None, None, []
    try:
        for line in lines:
            match = PREFIX.match(line)
            body = line[match.end():] if match else line
            if alive is not None and match and int(match.group(1)) in alive:  # a beating rank's lines count too
                rank = int(match.group(1))
                alive[rank] = (time.monotonic(), alive[rank][1])
            if DONE_TAG in body:  # a rank that finished its script beats no more: not silent
                if alive is not None and match:
                    alive.pop(int(match.group(1)), None)
                continue
            if ALIVE_TAG in body:  # at the start, or written between another line's text and its end
                body, _, beat = body.partition(ALIVE_TAG)
                if alive is not None:
                    try:
                        beat = json.loads(beat.split("}", 1)[0] + "}")
                        alive[beat["rank"]] = (time.monotonic(), beat["host"])
                    except (ValueError, KeyError):
                        pass
                if not body.strip():
                    continue
                body += "\n"
                line = (line[:match.end()] if match else "") + body
            if body.startswith(ERROR_TAG):
                failures.append(json.loads(body[len(ERROR_TAG):]))
                continue
            if body.startswith(RESULT_TAG):
                if results is not None:
                    results.append(json.loads(body[len(RESULT_TAG):]))
                continue
            if body.startswith(TAG):
                update = json.loads(body[len(TAG):])
                if update["epoch"] != bar_epoch:
                    if bar is not None:
                        bar.close()
                    bar_epoch = update["epoch"]
                    bar = tqdm(total=update["steps"], desc=f"epoch {bar_epoch + 1}/{update['epochs']}",
                               unit="step", file=out, dynamic_ncols=True, leave=True)
                bar.update(update["step"] - bar.n)
                bar.set_postfix({k: _short(k, v) for k, v in update.items()
                                 if k not in ("step", "steps", "epoch", "epochs")})
                continue
            if bar is not None and bar.n >= bar.total:
                bar.close()
                bar = None
            if failures and (not match or body.strip() == "Terminated"):
                continue  # horovodrun's "Process N exit with status", its traceback, the ranks it stopped
            own = match is not None and match.group(1) == "0" and match.group(2) == "stdout"
            out.write(body if own else line)
            out.flush()
    finally:  # a bar left open would print itself after the message that ends the job
        if bar is not None:
            bar.close()
    return failures


def _short(key: str, value):
    if isinstance(value, float):
        return f"{value:,.0f}" if key.endswith("_per_s") else f"{value:.4f}"
    return value


def failure_summary(failures: list[dict]) -> str:
    """One message for the console: the first rank that failed, where, what, its last frames."""
    first = failures[0]
    lines = [f"rank {first['rank']} on host {first['host']} failed: {first['error']}"]
    lines += [f"  {frame}" for frame in first["frames"]]
    if first.get("log"):
        lines.append(f"  full traceback: {first['log']} (on {first['hostname']})")
    others = [f"rank {f['rank']} ({f['error'].split(':')[0]})" for f in failures[1:]]
    if others:
        lines.append(f"  then also: {', '.join(others)}")
    lines.append("  the other ranks were stopped")
    return "\n".join(lines)
