"""trials.jsonl, a sweep's ledger: one record per ended trial (host, parameters, state, the
metric at each epoch, times), appended as each ends; --resume and invoke report read it back."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

TRIALS_FILE = "trials.jsonl"


def read(path: Path) -> list[dict]:
    """Every whole record (a line cut short, the sweep killed mid-write, is skipped)."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def append(path: Path, record: dict) -> None:
    with path.open("a+b") as f:
        f.seek(0, os.SEEK_END)
        if f.tell():  # a line cut short (the sweep killed mid-write) ends here, not in this record
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")
        f.write(json.dumps(record).encode() + b"\n")


def best(records: list[dict], mode: str) -> dict | None:
    """The complete trial with the best value (`mode`: min or max)."""
    complete = [r for r in records if r["state"] == "complete"]
    if not complete:
        return None
    pick = min if mode == "min" else max
    return pick(complete, key=lambda r: r["value"])


def summary(records: list[dict], metric: str, mode: str) -> str:
    """The table printed at the sweep's end: every trial, then the best one's arguments."""
    lines = [f"{'trial':>5}  {'host':<10} {'state':<9} {metric:>12} {'seconds':>8}  parameters"]
    for r in sorted(records, key=lambda r: r["number"]):
        value = f"{r['value']:.4g}" if isinstance(r.get("value"), (int, float)) else "-"
        lines.append(f"{r['number']:>5}  {r['host']:<10} {r['state']:<9} {value:>12} {r['seconds']:>8.1f}  "
                     f"{' '.join(r['argv'])}")
    top = best(records, mode)
    if top:
        lines.append(f"best: trial {top['number']} on {top['host']}, {metric} {top['value']:.6g}: "
                     f"{' '.join(top['argv'])}")
    return "\n".join(lines)
