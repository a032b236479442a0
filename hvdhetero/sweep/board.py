"""The sweep's console: one line per event (a trial started, pruned, moved, finished, failed)
and, on a terminal, a live table of the trials under way below them, redrawn about once a second
(rich's Live): host, trial, parameters, epoch, the metric's last value, seconds, state; its
title the trials done and the best so far. Off a terminal (CI logs, `| tee`) the event lines
alone."""

from __future__ import annotations

import os
import time
from typing import IO, Callable


class Board:
    def __init__(self, out: IO[str], rows: Callable[[], list[dict]], title: Callable[[], str], metric: str):
        """`rows()`: the trials under way, each {trial, host, params, epoch, metric, seconds, state};
        `title()`: the line above them; `metric`: the metric's name (a column)."""
        self.out, self.rows, self.title, self.metric = out, rows, title, metric
        self.live = None
        self.console = None
        try:
            terminal = out.isatty() and os.environ.get("TERM", "") not in ("dumb", "unknown")
        except (AttributeError, ValueError):
            terminal = False
        if terminal:
            from rich.console import Console

            self.console = Console(file=out, highlight=False, soft_wrap=True)

    def say(self, text: str) -> None:
        if self.console is None:
            print(text, file=self.out, flush=True)
            return
        if self.live is None:
            from rich.live import Live

            self.live = Live(get_renderable=self.render, console=self.console, refresh_per_second=1)
            self.live.start()
        self.console.print(text, markup=False, emoji=False)

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None

    def render(self):
        from rich.table import Table

        table = Table(title=self.title(), title_justify="left")
        for name in ("trial", "host", "epoch", self.metric, "seconds", "state", "parameters"):
            table.add_column(name, justify="left" if name in ("host", "state", "parameters") else "right")
        for r in self.rows():
            metric = f"{r['metric']:.4g}" if isinstance(r.get("metric"), float) else "-"
            table.add_row(str(r["trial"]), r["host"], r["epoch"], metric, f"{r['seconds']:.0f}", r["state"],
                          r["params"])
        return table


def elapsed(since: float) -> float:
    return max(0.0, time.time() - since)
