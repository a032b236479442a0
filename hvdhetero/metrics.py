"""metrics.jsonl: rank 0's record of a run, one JSON object a line, each with its `event`
(start, split, epoch, log, exchange, checkpoint, plan, elastic, end) and its wall `time`. One
writer (`MetricsLog`, in rank 0) and one reader (`read`, `records`) for everything that reads it
back: resume, the report, the benchmarks, the tests. Torch-free: the launcher reads it too.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from hvdhetero.errors import ConfigError

FILE = "metrics.jsonl"
"""Its name in a run directory."""


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

    def offset(self) -> int:
        """Bytes written so far: a checkpoint holds it, a resume cuts the file back to it."""
        return self._file.tell()

    def truncate(self, offset: int, keep=None) -> None:
        """Drop what was written after `offset` (a resumed run redoes it), but the whole record
        right after it where `keep(record)` (the checkpoint resumed from, written after its state)."""
        self._file.flush()
        offset = min(offset, self.path.stat().st_size)
        if keep is not None:
            with open(self.path, "rb") as f:
                f.seek(offset)
                line = f.readline()
            try:
                record = json.loads(line)
            except ValueError:  # a torn or undecodable line: cut with the rest
                record = None
            offset += len(line) if line.endswith(b"\n") and isinstance(record, dict) and keep(record) else 0
        self._file.truncate(offset)
        self._file.seek(0, os.SEEK_END)

    def complete_lines(self) -> int:
        """Bytes up to the end of the last whole line (a writer killed mid-line leaves a part)."""
        self._file.flush()
        data = self.path.read_bytes()
        return data.rfind(b"\n") + 1

    def close(self) -> None:
        self._file.close()


def read(path: str | Path) -> tuple[list[dict[str, Any]], bool]:
    """metrics.jsonl's records, and whether a torn last line (no newline: a write the run was
    killed in) was left out. Anything else unreadable is an error naming the file and line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read it ({err})") from None
    lines = text.split("\n")
    records, torn = [], False
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or "event" not in record or "time" not in record:
                raise ValueError("not a metrics record (an object with event and time)")
        except ValueError as err:
            if number == len(lines):  # the last line, without its newline
                torn = True
                continue
            raise ConfigError(f"{path}:{number}: not a metrics record ({err}): {line[:80]!r}; is this an "
                              "hvdhetero run's metrics.jsonl?") from None
        records.append(record)
    return records, torn


def records(path: str | Path, event: str | None = None, missing_ok: bool = False) -> list[dict[str, Any]]:
    """The records of the metrics file at `path` (of one `event` kind if given), a torn last
    line left out; a missing file is [] with `missing_ok` (a run that has not written yet)."""
    if missing_ok and not Path(path).exists():
        return []
    found, _ = read(path)
    return [r for r in found if event is None or r.get("event") == event]
