"""What the launcher makes of its ranks' output: the console and the rank logs.

horovodrun forwards every rank's lines with a `[rank]<stream>:` prefix. The relay shows rank 0's
lines as they are, as a print reads on one machine; the other ranks' prints are their own
business and stay in RUN_DIR/rank-N.log (the same print on every rank would otherwise come once
per rank, interleaved), except our own `hvdhetero:` messages and, once each, the Python warnings
rank 0 did not print too (what a device of their own says: torch.amp.GradScaler("cuda") is
disabled on the Mac); `--all-ranks-output` shows them
too, each line behind `[rank N] `. It hands the ranks' progress lines to the live table
(live.py), collects results and failures, and keeps the heartbeats' times for the watchdog.
Once a rank has failed, horovodrun's walls about stopping the others stay off the console: the
user gets one summary naming the host, the rank, the exception and its last frames, and every
rank's whole output is in RUN_DIR/rank-N.log (RankLogs), and rank 0's progress and results in
RUN_DIR/progress.jsonl (wherever rank 0 runs: its metrics.jsonl is on its own host; invoke sweep
reads this copy). The rank side of these lines is hvdhetero/progress.py.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import IO, Iterable

from hvdhetero.cluster.lines import joined, tagged, without_heartbeat
from hvdhetero.progress import ALIVE_TAG, DONE_TAG, ERROR_TAG, PREFIX, RESULT_TAG, TAG

HOROVOD_LOOP_ERROR = "Horovod background loop uncaught exception"
"""Horovod's log line on a rank whose collective failed: nearly always a peer that died or was
cut off ("Connection to rank 1 lost", or Gloo's timeout), which that peer's own report or the
launcher names. Kept in the rank log, off the console (it can come before the report it
follows from)."""


def relay(lines: Iterable[str], display, results: list[dict] | None = None,
          alive: dict[int, tuple[float, str]] | None = None, all_ranks: bool = False,
          hidden_note: str = "", failures: list[dict] | None = None,
          finished: set[int] | None = None) -> list[dict]:
    """Show horovodrun's `lines` through `display` (live.display_for): progress lines update its
    table, rank 0's other lines are echoed as they are, the other ranks' only with `all_ranks`
    (tagged `[rank N] `) or when they are our own messages; the first line held back echoes
    `hidden_note` (where those lines are) once. Returns the failures ranks reported, in order
    (also in `failures`, if given, as they come: a caller whose `lines` raise still has them);
    once one is in, horovodrun's own lines about stopping the other ranks are not echoed. Result
    lines go to `results`, not the console; a rank's every line (heartbeats above all) renews
    its `alive`."""
    failures = [] if failures is None else failures
    finished = set() if finished is None else finished
    """Ranks that said DONE (the caller's set, if given: it may see them first): their heartbeat
    thread beats on until the process exits (Horovod's shutdown), and a late beat must not make a
    finished rank a silent one once it has exited."""
    noted = not hidden_note
    stall_from, stall_s = None, STALL_CHECK_S
    """The rank whose Horovod just logged "Missing ranks:" (its next lines name them), and how
    long it said they had been missing."""
    main = 0
    """The prefix rank 0's lines come with: horovodrun's launch-time rank, which --elastic
    renumbers (rank 0's host dropped, the new rank 0 prints as [1]); its progress records say."""
    warned: set[tuple[str, str]] = set()
    """Python warnings shown: each said once, by whichever rank printed it first (a process prints
    one again once a filter changed, and every rank prints it: a DataLoader's warning on the
    workers a rank's cores allow came 4 times)."""
    repeated = None
    """The rank and stream whose warning was left out as said already: its source line, its next
    line there, goes too (other ranks' lines may come between)."""
    try:
        for line in joined(lines):
            match = PREFIX.match(line)
            body = line[match.end():] if match else line
            rank = int(match.group(1)) if match else None
            if repeated is not None and match is not None and match.group(1, 2) == repeated:
                repeated = None  # that rank's next line on that stream: the warning's source line, or not
                if body.startswith("  "):
                    continue
            if alive is not None and rank in alive:  # a beating rank's lines count too
                alive[rank] = (time.monotonic(), alive[rank][1])
            if DONE_TAG in body:  # a rank that finished its script beats no more: not silent
                if alive is not None and rank is not None:
                    alive.pop(rank, None)
                    finished.add(rank)
                continue
            if ALIVE_TAG in body:  # at the start, or written between another line's text and its end
                body, beat = without_heartbeat(body)
                if alive is not None and beat is not None and beat["rank"] not in finished:
                    alive[beat["rank"]] = (time.monotonic(), beat["host"])
                if not body.strip():
                    continue
                line = (line[:match.end()] if match else "") + body
            if body.startswith(ERROR_TAG):
                failures += tagged(body, ERROR_TAG)
                continue
            if body.startswith(RESULT_TAG):
                if results is not None:
                    results += tagged(body, RESULT_TAG)
                continue
            if body.startswith(TAG):
                try:
                    record = json.loads(body[len(TAG):])
                except ValueError:  # a line cut short (the rank killed mid-write)
                    continue
                if record.get("rank") == 0 and rank is not None:
                    main = rank
                display.update(record)
                continue
            if waited := STALL_WARNING.search(body):
                stall_s = int(waited.group(1))
            elif body.startswith(STALL_HEAD):
                stall_from = rank
            elif stall_from is not None and rank == stall_from:
                stalled = STALLED.match(body.strip())
                if stalled:
                    display.echo(stall_hint(int(stalled.group(1)), stalled.group(2), stall_s))
                else:
                    stall_from = None
            if failures and (not match or body.strip() == "Terminated"):
                continue  # horovodrun's "Process N exit with status", its traceback, the ranks it stopped
            if body.strip() == "Killed":
                continue  # the rank's shell on its SIGKILL (the OOM killer's too): the failure message names both
            if HOROVOD_LOOP_ERROR in body:
                continue
            warning = WARNING.match(body)
            if warning and warning.group(1, 2) in warned and not all_ranks:  # --all-ranks-output: every line
                repeated = match.group(1, 2) if match else None
                continue
            if rank is None or rank == main or body.startswith(OUR_LINES):
                display.echo(body)
                if warning and warning.group(1, 2) not in warned:
                    warned.add(warning.group(1, 2))
                    if hint := device_hint(rank or 0, warning.group(2)):
                        display.echo(hint)
                continue
            if all_ranks:
                display.echo(f"[rank {rank}] {body}")
                continue
            if not noted:
                display.echo(hidden_note + "\n")
                noted = True
            if warning and warning.group(1, 2) not in warned:  # a device's own (CUDA not available on the Mac)
                warned.add(warning.group(1, 2))
                display.echo(f"hvdhetero: rank {rank} warned: {warning.group(1)}: {warning.group(2)}\n")
                if hint := device_hint(rank, warning.group(2)):
                    display.echo(hint)
    finally:  # a live table left running would draw itself over the message that ends the job
        display.close()
    return failures


WARNING = re.compile(r"^\S.*:\d+: (\w*Warning): (.+?)\s*$")
"""A Python warning's first line, as `warnings` prints it: "FILE:LINE: CATEGORY: MESSAGE"."""
STALL_WARNING = re.compile(r"waiting for remainder of ranks for more than (\d+) seconds")
STALL_HEAD = "Missing ranks:"
STALLED = re.compile(r"^(\d+)!?: \[(.*)\]$")
"""Horovod's stall inspector (HOROVOD_STALL_CHECK_TIME_SECONDS, launch.RANK_ENV): its warning
("... for more than 60 seconds ..."), "Missing ranks:" and a line per rank that has not joined,
"1: [name, name]"."""


def device_hint(rank: int, warning: str) -> str:
    """What a warning of torch's about the rank's device means for the run, or "": a script's
    `torch.autocast("cuda")` on a rank without CUDA (the Mac's mps, a CPU) runs in float32 there;
    DataLoader workers more than the rank's cores (the ranks of one host are pinned to cores of their own)."""
    if WORKERS_OVER_CORES in warning:
        return (f"hvdhetero: rank {rank}'s DataLoader workers share the cores it is pinned to (the ranks of one host "
                "each have their own: one of the `local` host's two has one), taking turns with its training; "
                "fewer workers, or none, may be as fast there\n")
    if not all(words in warning for words in AUTOCAST_OFF):
        return ""
    return (f"hvdhetero: rank {rank} runs the script's torch.autocast(\"cuda\") in float32 (its device is not "
            "CUDA); `with job.autocast():` and --precision fp16 or bf16 give every rank its own device's mixed "
            "precision (docs/api.md)\n")


WORKERS_OVER_CORES = "This DataLoader will create"
"""torch's DataLoader warning for more workers than the process's cores (its affinity): its only one so begun."""
AUTOCAST_OFF = ("CUDA is not available", "Disabling autocast")
"""torch's warning when `torch.autocast("cuda")` runs where CUDA is not (not its other "Disabling
autocast", for a dtype the device does not take)."""


def stall_hint(rank: int, names: str, seconds: int = 60) -> str:
    """In words, what Horovod's stall warning means for a script: nearly always a call that
    only some ranks made (`if job.is_main: job.save(...)` under --sync local/diloco, a job.save
    or job.evaluate behind a condition whose value differs between ranks)."""
    ours = "hvdhetero." in names
    return (f"hvdhetero: rank {rank} has not joined {names} for {seconds} s, where the other ranks wait"
            + (": every rank must make the same calls in the same order -- job.save, job.evaluate, job.epochs' "
               "loop and its end, job.stop -- each on every rank and decided alike (not under `if job.is_main:`, "
               "not on a value one rank computed alone)" if ours else " (a call only some ranks made?)")
            + "; Horovod ends the job if it does not come\n")


STALL_CHECK_S, STALL_SHUTDOWN_S = 60, 120
"""launch.RANK_ENV's HOROVOD_STALL_CHECK_TIME_SECONDS and HOROVOD_STALL_SHUTDOWN_TIME_SECONDS."""

OUR_LINES = "hvdhetero: "
"""What our own messages start with, on any rank (the console shows them whoever prints them)."""


PROGRESS_FILE = "progress.jsonl"
"""Rank 0's progress lines and results as they reached the launcher, one JSON object a line:
{"at": the launcher's time.time(), "progress": {epoch, epochs, step, steps, loss, logged,
logged_epoch, ...}} or {"at": ..., "result": {...}} (the end record lists every job.log)."""


class RankLogs:
    """Every rank's whole output in `folder`/rank-N.log on this machine, written as it arrives:
    horovodrun's lines for that rank without the prefix, without the protocol's lines, and a
    failure's full traceback where the rank sent its summary; rank 0's progress lines and
    results in `folder`/progress.jsonl. A resumed run appends."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self._files: dict[int, IO[str]] = {}
        self._progress: IO[str] | None = None
        self._broken = False

    def path(self, rank: int) -> Path:
        return self.folder / f"rank-{rank}.log"

    def has(self, rank: int) -> bool:
        return rank in self._files

    def write(self, line: str) -> None:
        match = PREFIX.match(line)
        if match is None or self._broken:  # horovodrun's own lines belong to no rank
            return
        file = self._open(int(match.group(1)))  # at a rank's first line (its heartbeat): a quiet rank's log
        body = line[match.end():]
        if ALIVE_TAG in body:
            body, _ = without_heartbeat(body)
        if body.startswith(ERROR_TAG):
            try:
                failure = json.loads(body[len(ERROR_TAG):])
                body = failure.get("traceback") or failure["error"] + "\n"
            except (ValueError, KeyError):
                pass
        elif body.startswith((TAG, RESULT_TAG)):
            self._keep_progress(body)
            return
        elif not body or DONE_TAG in body:
            return
        if file is not None:
            file.write(body if body.endswith("\n") else body + "\n")
            file.flush()

    def _open(self, rank: int) -> IO[str] | None:
        if rank not in self._files:
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                file = self.path(rank).open("a", encoding="utf-8", errors="replace")
            except OSError as err:  # the run goes on without its logs
                print(f"warning: cannot write the rank logs in {self.folder}: {err}", file=sys.stderr)
                self._broken = True
                return None
            file.write(f"# hvdhetero: rank {rank}'s output, launched {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
            self._files[rank] = file
        return self._files[rank]

    def _keep_progress(self, body: str) -> None:
        """Rank 0's progress line (the record says its rank: --elastic renumbers the prefix) or
        a result, into progress.jsonl."""
        tag = TAG if body.startswith(TAG) else RESULT_TAG
        try:
            record = json.loads(body[len(tag):])
        except ValueError:  # a line cut short (the rank killed mid-write)
            return
        if tag == TAG and record.get("rank") != 0:
            return
        if self._progress is None:
            try:
                self._progress = (self.folder / PROGRESS_FILE).open("a", encoding="utf-8")
            except OSError:  # the rank logs' folder: not writable was said at its first line
                self._broken = True
                return
        key = "progress" if tag == TAG else "result"
        self._progress.write(json.dumps({"at": round(time.time(), 3), key: record}) + "\n")
        self._progress.flush()

    def close(self) -> None:
        for file in [*self._files.values(), *([self._progress] if self._progress else [])]:
            file.close()
