"""A run directory read: what `invoke report` draws (hvdhetero/bench/report.py).

A run directory holds `metrics.jsonl`, rank 0's records, one JSON object a line: `start`
(the job's config, every rank's host and device), `split` (each split the balancer chose),
`epoch` (loss, samples, seconds, and each rank's samples and seconds in compute and in
communication), `log` (the script's job.log), `exchange` (local/diloco rounds), `plan`
(--sync auto), `checkpoint`, `end`; and `launch.json`, the options invoke train was given.
Pure reading, no torch: a run's metrics come back as a Run, or a ConfigError (exit 2) that
names the file and what is wrong with it.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from hvdhetero import metrics as metrics_file
from hvdhetero.errors import ConfigError

@dataclass
class Run:
    """One run directory, read."""

    path: Path
    label: str
    """How figures and tables name it: the folder and its sync mode, e.g. `rep-a (step)`."""
    start: dict
    epochs: list[dict]
    logs: list[dict] = field(default_factory=list)
    windows: list[dict] = field(default_factory=list)
    """A loop of the script's own (no epoch records), step sync: every rank's samples and seconds
    over the steps between its job.log calls, as an epoch record says them."""
    splits: list[dict] = field(default_factory=list)
    exchanges: list[dict] = field(default_factory=list)
    end: dict | None = None
    resumes: list[dict] = field(default_factory=list)
    """The start records of each --resume after the first start."""
    before_s: float = 0.0
    """Resumed: the wall seconds of the stretches before the last start (each from its start record to
    its last record kept), which the end record's own seconds leave out."""
    plan: dict | None = None
    """--sync auto: the plan it chose from (its `chose`: the mode)."""
    launch: dict | None = None
    torn_last_line: bool = False
    """The file ended in a half-written line (a run killed mid-write): it was left out."""
    live_loss: bool = False
    """A loop of the script's own that never called job.log: `logs` are rank 0's live lines'
    loss (progress.jsonl: its share's, over the last 100 batches or the pass so far)."""

    @property
    def t0(self) -> float:
        """Wall time (s) the training started: the first start record, after calibration."""
        return self.start["time"]

    @property
    def last_time(self) -> float:
        """Wall time (s) of the run's last record (its end record, if it has one)."""
        return max(r["time"] for r in [self.start, *self.epochs, *self.logs, *self.windows, *self.splits,
                                        *self.exchanges, *([self.end] if self.end and "time" in self.end else [])])

    @property
    def sync(self) -> str:
        """The sync mode, `auto -> diloco:32 overlapped` for the one --sync auto chose (no plan
        record: it could not time the ranks and took step)."""
        cfg = self.start.get("config", {})
        if cfg.get("sync") == "auto":
            return "auto -> " + ((self.plan or {}).get("chose") or ("?" if self.plan else "step"))
        return (cfg.get("sync", "step") + (" overlapped" if cfg.get("overlap_sync") else "")
                + (" by-speed" if cfg.get("inner_steps", "same") != "same" else ""))

    @property
    def ranks(self) -> list[str]:
        """Each rank named by its host and device, `rank 0: local, cpu (1 thread)`: every rank of
        every start (a resume on more hosts, an elastic rejoin), each host and device it had in turn
        (`rank 1: mac, mps, then pc, cuda`)."""
        had: list[list[str]] = []
        for s in [self.start, *self.resumes]:
            hosts = s.get("host_names") or s.get("hostnames") or ["?"] * s["ranks"]
            devices = s.get("devices") or ["?"] * s["ranks"]
            for i, (h, d) in enumerate(zip(hosts, devices)):
                if i == len(had):
                    had.append([])
                if f"{h}, {d}" not in had[i][-1:]:
                    had[i].append(f"{h}, {d}")
        return [f"rank {i}: {', then '.join(names)}" for i, names in enumerate(had)]


def writing(out: Path, write):
    """`write()`'s result; a folder it cannot write (a read-only run directory) is a ConfigError
    (exit 2) saying so and how to write the report elsewhere."""
    try:
        return write()
    except OSError as err:
        raise ConfigError(f"cannot write the report into {out} ({err.strerror or err}): --out DIR writes it "
                          "elsewhere") from None


# -- reading -------------------------------------------------------------------------------------

def find_latest(runs: Path) -> tuple[Path, list[tuple[Path, str]]]:
    """What `invoke report` alone reports: the newest folder under `runs` whose metrics.jsonl
    reads as a run with something to draw, and the newer ones passed over with why (a start
    that failed before training, `--dataset mnist` without `--download`, must not stop the
    report of the run before it)."""
    found = sorted((p for p in runs.glob("*") if (p / "metrics.jsonl").is_file()),
                   key=lambda p: (p / "metrics.jsonl").stat().st_mtime, reverse=True)
    if not found:
        raise ConfigError(f"no run under {runs} has a metrics.jsonl: train one (invoke train) or name run "
                          "directories: invoke report -- RUN_DIR ...")
    passed = []
    for folder in found:
        try:
            read_run(folder)
        except ConfigError as err:
            passed.append((folder, str(err)))
            continue
        return folder, passed
    raise ConfigError(f"no run under {runs} has anything to report yet; the newest: {passed[0][1]}")


def newest(runs: Path) -> Path:
    """find_latest's run, the newer folders it passed over said on stderr (the first 3, then a count)."""
    found, passed = find_latest(runs)
    for folder, why in passed[:3]:
        print(f"report: passing over the newer {folder}: {_passed_note(why, folder)}", file=sys.stderr)
    if len(passed) > 3:
        print(f"report: and {len(passed) - 3} more newer folders like them", file=sys.stderr)
    return found


def _passed_note(why: str, folder: Path, width: int = 150) -> str:
    """read_run's refusal of `folder` as a note: its metrics file named short, cut to `width`."""
    why = why.replace(str(folder / "metrics.jsonl"), "metrics.jsonl")
    return why if len(why) <= width else why[:width - 1].rstrip() + "…"


NEEDED = {"start": ("ranks",), "epoch": ("epoch", "loss", "samples", "seconds", "split"), "split": ("split",),
          "exchange": ("seconds",),
          "window": ("step", "steps", "samples", "seconds", "rank_samples", "compute_s", "comm_s")}
"""What the report reads from each kind of record."""


def read_run(folder: str | Path) -> Run:
    """A run directory as a Run; a missing folder, metrics.jsonl or start record, or a file with
    no finished epoch, is a ConfigError (exit 2) naming the path."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"run directory {folder} not found (give the folder invoke train printed as 'run "
                          "directory: ...')")
    launch = _launch(folder)
    metrics = folder / "metrics.jsonl"
    if not metrics.is_file():
        elsewhere = launch is not None and not launch.get("rank0_local", True)
        raise ConfigError(f"{metrics} not found: " + (
            f"rank 0 ran on {launch['hosts'][0]}, which wrote it there; copy it into {folder}" if elsewhere
            else "not a run directory of invoke train, or the run stopped before training began"))
    records, torn = metrics_file.read(metrics)
    by = {kind: [r for r in records if r["event"] == kind]
          for kind in ("start", "epoch", "log", "window", "split", "exchange", "end", "plan")}
    if not by["start"]:
        raise ConfigError(f"{metrics} has no start record" + (" (the file is empty)" if not records else "")
                          + ": the run stopped before training began, or this is not an hvdhetero metrics file")
    for kind, keys in NEEDED.items():
        for record in by[kind]:
            if missing := [k for k in keys if k not in record]:
                raise ConfigError(f"{metrics}: a {kind} record lacks {', '.join(missing)} ({json.dumps(record)[:100]}"
                                  "...): not a metrics file of this hvdhetero version")
    live = live_losses(folder / PROGRESS_FILE) if not by["epoch"] and not by["log"] else []
    if not by["epoch"] and not by["log"] and not live:
        raise ConfigError(f"{metrics} has no finished epoch and no job.log record yet: nothing to plot. job.epochs(n) "
                          "writes a record at each epoch's end (report again once one ends); a loop of the script's "
                          "own (over steps, without job.epochs) writes none: call job.log(loss=...) in it every N "
                          "steps, and the report plots what it logs (without one, rank 0's live lines' loss, "
                          f"from {PROGRESS_FILE}, which this run has none of)")
    run = Run(path=folder, label="", start=by["start"][0], epochs=by["epoch"], logs=by["log"] or live,
              windows=by["window"], live_loss=bool(live),
              splits=by["split"],
              exchanges=by["exchange"], end=(by["end"] or [None])[-1], resumes=by["start"][1:],
              before_s=_before_last_start(records),
              plan=(by["plan"] or [None])[0], launch=launch, torn_last_line=torn)
    run.label = f"{folder.name} ({run.sync})"
    return run


PROGRESS_FILE = "progress.jsonl"
"""Rank 0's live lines, kept by the launcher in the run directory (cluster/console.py's)."""


def live_losses(path: Path) -> list[dict]:
    """Rank 0's live lines' loss as job.log records, one per step (its last line there): what a
    loop of the script's own that never calls job.log is drawn from."""
    by_step: dict[int, dict] = {}
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            record = json.loads(line)
            p = record["progress"]
            if p.get("rank", 0) == 0 and isinstance(p.get("loss"), (int, float)) and p.get("step"):
                by_step[int(p["step"])] = {"event": "log", "time": float(record["at"]), "epoch": p.get("epoch", 0),
                                           "step": int(p["step"]), "live_loss": float(p["loss"])}
        except (ValueError, KeyError, TypeError):  # a result line, one cut short by a kill
            continue
    return [by_step[s] for s in sorted(by_step)]


def read_runs(folders: list[str | Path]) -> list[Run]:
    """Every run, read before anything is written; labels made unique (two `run` folders under
    different parents are told apart by their parents)."""
    seen = [Path(f).resolve() for f in folders]
    if twice := next((f for f, r in zip(folders, seen) if seen.count(r) > 1), None):
        raise ConfigError(f"run directory {twice} is given twice: name each run once")
    runs = [read_run(f) for f in folders]
    labels = [r.label for r in runs]
    for r in runs:
        if labels.count(r.label) > 1:
            r.label = f"{r.path.parent.name}/{r.label}"
    return runs


def _launch(folder: Path) -> dict | None:
    try:
        return json.loads((folder / "launch.json").read_text())
    except (OSError, ValueError):
        return None  # a run not started by invoke train (a test's own job): the start record has the config


def default_out(folders: list[Path]) -> Path:
    """One run: RUN_DIR/report. Several: inside the first, report-vs-<the others' names>."""
    first = Path(folders[0])
    if len(folders) == 1:
        return first / "report"
    return first / ("report-vs-" + "-".join(Path(f).resolve().name for f in folders[1:]))


def _before_last_start(records: list[dict]) -> float:
    """The wall seconds of every stretch of a resumed run before its last launch: each from its
    first start record to its last record (a resume cut what came after its checkpoint). The start
    records an --elastic reset writes begin no stretch: the end record's seconds count from the
    launch's first Job."""
    done, began, last = 0.0, None, None
    for r in records:
        launched = r["event"] == "start" and (began is None or not str(r.get("resumed_from") or "elastic")
                                              .startswith("elastic"))
        if launched:
            if began is not None:
                done += last - began
            began = last = r["time"]
        elif began is not None and "time" in r:
            last = r["time"]
    return done
