"""Rank 0's progress, drawn as a progress bar in the launcher's terminal.

horovodrun forwards each rank's output with a `[rank]<stdout>:` prefix and splits a bar's
carriage-return updates into garbled lines, and rank 0 may run on another machine. So rank 0
prints one tagged JSON line per update (throttled), and the launcher, reading horovodrun's
output, turns those lines into a tqdm bar per epoch and passes every other line through.
"""

from __future__ import annotations

import json
import re
import sys
import time
from typing import IO, Iterable

TAG = "@@hvdhetero-progress "
# horovodrun's prefix on forwarded rank output, e.g. "[0]<stdout>:" (maybe with a timestamp).
PREFIX = re.compile(r"^(?:\S+ )?\[(\d+)\]<(stdout|stderr)>:")
_last = 0.0


def report(*, step: int, steps: int, min_interval: float = 0.2, **fields) -> None:
    """Rank side: print a progress line, at most every `min_interval` s and at epoch ends."""
    global _last
    now = time.monotonic()
    if step != steps and now - _last < min_interval:
        return
    _last = now
    print(TAG + json.dumps({"step": step, "steps": steps, **fields}), flush=True)


def relay(lines: Iterable[str], out: IO[str] = sys.stdout) -> None:
    """Launcher side: draw tagged lines as one bar per epoch; echo the rest (rank 0's own
    lines without horovodrun's prefix)."""
    from tqdm import tqdm

    bar, bar_epoch = None, None
    for line in lines:
        match = PREFIX.match(line)
        body = line[match.end():] if match else line
        if body.startswith(TAG):
            update = json.loads(body[len(TAG):])
            if update["epoch"] != bar_epoch:
                if bar is not None:
                    bar.close()
                bar_epoch = update["epoch"]
                bar = tqdm(total=update["steps"], desc=f"epoch {bar_epoch + 1}/{update['epochs']}",
                           unit="step", file=out, dynamic_ncols=True, leave=True)
            bar.update(update["step"] - bar.n)
            bar.set_postfix(loss=f"{update['loss']:.4f}", acc=f"{update['acc']:.3f}",
                            samples_s=f"{update['samples_per_s']:,.0f}")
            continue
        if bar is not None and bar.n >= bar.total:
            bar.close()
            bar = None
        own = match is not None and match.group(1) == "0" and body.startswith("hvdhetero:")
        out.write(body if own else line)
        out.flush()
    if bar is not None:
        bar.close()
