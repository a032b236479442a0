"""What a run leaves for people to read: metrics.jsonl and TensorBoard scalars (rank 0), the
live table's progress lines to the launcher (every rank, when launched), the epoch's counters
behind them, and the run's end record.

    records.write("split", step=..., split=[...])   # one metrics record (and its scalars)
    records.step_done(item, compute_s, reduce_s)     # a step's samples and seconds
    records.progress(...)                            # the live table's line, about once a second
    records.log(epoch, step, loss=...)               # job.log
    records.end_epoch(...)                           # every rank's epoch, summed: the "epoch" record
"""

from __future__ import annotations

import json
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hvdhetero import metrics, progress
from hvdhetero.rank import host
from hvdhetero.rank.collectives import allreduce_sum
from hvdhetero.rank.tensorboard import TensorBoardLog


class RunRecords:
    """One rank's records of the run (the files only on rank 0)."""

    def __init__(self, run_dir: Path, is_main: bool, tensorboard: bool, report_progress: bool,
                 step: Callable[[], int], who: tuple[int, str, str, int], started: float | None = None):
        """`who`: this rank's number, host name, device and the job's size (its progress lines say them)."""
        self.who = who
        self.metrics = metrics.MetricsLog(run_dir / metrics.FILE) if is_main else None
        self.tensorboard = TensorBoardLog(run_dir / "tensorboard") if tensorboard and is_main else None
        self.is_main, self.step = is_main, step
        self.report_progress = report_progress
        """Whether a launcher reads this rank's progress lines (set when launched)."""
        self.reporter: progress.Reporter | None = None
        self.loss_sum = self.samples = 0.0
        self.steps = 0
        self.recent: deque[tuple[float, int]] = deque(maxlen=progress.RECENT_BATCHES)
        """The last batches' (loss sum, samples): an endless epoch's live loss."""
        self.busy = [0.0, 0.0]
        """This epoch's seconds of this rank in compute and in communication (the report plots them)."""
        self.carried = 0.0
        """Overlapped: seconds the last epoch's end exchange blocked, counted in the next epoch."""
        self.last_scalars: dict[str, Any] = {}
        self.last_epochs: dict[str, int] = {}
        """The epoch each scalar was last logged in (a sweep judges a metric at its own epoch)."""
        self.unsent: list[dict] = []
        """Rank 0: the job.log records since its last progress line, which the next one carries (a sweep
        reads each value from them: with the last scalars alone, two logs within a second showed the second)."""
        self.logged: list[dict] = []
        """Every job.log record, for the end report."""
        self.window: Window | None = None
        """Rank 0, a loop of the script's own: the steps since its last job.log (no epoch records come)."""
        self.started = self.epoch_started = time.perf_counter()
        self.ended = False
        """The run's end record is written (job.epochs' end): a pass of the script's own after it writes no epoch."""
        if started is not None:  # --elastic: the run's seconds count from its first Job
            self.started = started

    def write(self, event: str, **fields) -> None:
        if self.metrics is not None:
            self.metrics.write(event, **fields)
        if self.tensorboard is not None:
            self.tensorboard.write(event, fields, self.step())

    def log(self, epoch: int, step: int, values: dict[str, Any]) -> None:
        self.close_window(epoch, step)
        self.last_scalars.update(values)
        self.last_epochs.update(dict.fromkeys(values, epoch))
        self.logged.append({"epoch": epoch, "step": step, **values})
        if self.is_main and self.report_progress:  # the next progress line carries it
            self.unsent.append(self.logged[-1])
        self.write("log", **self.logged[-1])  # the script's own win

    def begin_epoch(self) -> None:
        """An epoch starts: its counters from zero, what the last epoch's end exchange blocked counted in it."""
        self.loss_sum = self.samples = 0.0
        self.steps = 0  # global steps taken: a resumed epoch's rest, an endless one's until the script moved on
        carried, self.carried = self.carried, 0.0
        self.busy = [0.0, carried]
        self.epoch_started = time.perf_counter() - carried

    def loss(self, value: float, n: int) -> None:
        self.loss_sum += value * n
        if self.is_main:  # only rank 0's progress says a loss
            self.recent.append((value * n, n))

    def step_done(self, samples: int, compute_s: float, reduce_s: float, steps: int = 1) -> None:
        """A step's end: `steps` global steps (more where --inner-steps by-speed merged them)."""
        self.steps += steps
        self.busy[0] += compute_s
        self.busy[1] += reduce_s
        self.samples += samples

    def communicated(self, seconds: float) -> None:
        """Seconds this rank spent in an exchange outside a step (local/diloco): this epoch's communication."""
        self.busy[1] += seconds

    def progress(self, *, samples: int, compute_s: float, wait_s: float, exchanged: tuple[int, float],
                 split: list[int], step: int, steps: int | None, epoch: int, epochs: int | None,
                 taken: int, first: int = 0) -> None:
        """This rank's step for the launcher's live table (progress.Reporter: its running totals,
        its own clock and the epoch's position, about once a second); rank 0 adds its loss and
        the script's last logged scalars. `exchanged`: local/diloco's rounds and the seconds the
        last exchange blocked this rank (counted once a round). `epochs`: None outside job.epochs
        (a script's own `for epoch in range(n)` says no total); `steps`: None in an endless epoch
        (a sampler that never runs out), whose loss is that of its last batches. `taken`: the
        optimizer steps taken (job.step: a sweep times a loop of the script's own by them). `first`:
        the epoch the live table counts as its first (1 for job.epochs(range(1, n + 1))). Rank 0's
        line carries the whole split, which the table shows every rank's share from."""
        if not self.report_progress:
            return
        rank, host_name, device, size = self.who
        if self.reporter is None:
            self.reporter = progress.Reporter(rank, host_name, device, size=size)
        wait_s += self.reporter.exchanged(*exchanged)
        job = {"epoch": epoch, "epochs": epochs, "step": step, "steps": steps, "taken": taken}
        if first:
            job["first"] = first
        if self.is_main:
            recent = [sum(x) for x in zip(*self.recent)] if steps is None and self.recent else None
            job.update(loss=recent[0] / recent[1] if recent else self.loss_sum / max(self.samples, 1),
                       logged={k: v for k, v in self.last_scalars.items() if isinstance(v, (int, float))},
                       logged_epoch=self.logged[-1]["epoch"] if self.logged else None,
                       logged_epochs={k: e for k, e in self.last_epochs.items()
                                      if isinstance(self.last_scalars.get(k), (int, float))},
                       logs=list(self.unsent), split=list(split))
        if self.reporter.step(samples=samples, compute_s=compute_s, wait_s=wait_s, share=split[rank],
                              batch=sum(split), epoch_end=step == steps, **job):
            self.unsent = []

    def progress_ended(self, steps: int) -> None:
        """An epoch of `steps` steps ended where the live line did not count to its end (its loop took
        the loader more than once): its last line again, as the epoch's last."""
        if self.report_progress and self.reporter is not None:
            self.reporter.again(step=steps, steps=steps)

    def end_epoch(self, epoch: int, step: int, size: int, steps: int, split: list[int] | None,
                  skipped_steps: int) -> list[float]:
        """Every rank's epoch summed (a collective) into the "epoch" record; returns every rank's
        mean step seconds (rank 0's sets the time-based checkpoint interval, the same on every rank).
        At job.epochs' epoch's end, and under step sync at the end of each pass a loop of the script's
        own takes over the prepared loader (`for epoch in range(n)`: it had no epoch record, and the
        report drew two points of its loss)."""
        seconds = time.perf_counter() - self.epoch_started
        mine = [seconds / steps, self.samples, *self.busy]
        loss_sum, samples, *per_rank = allreduce_sum([self.loss_sum, self.samples,
                                                      *(x for v in mine for x in host.one_hot(v))],
                                                     "hvdhetero.train_stats")
        step_s, rank_samples, compute_s, comm_s = (per_rank[i * size:(i + 1) * size] for i in range(4))
        self.window = None  # (a loop of the script's own over epochs: this record says what its window would)
        self.write("epoch", epoch=epoch, loss=loss_sum / max(samples, 1), samples=int(samples),
                   seconds=round(seconds, 3), samples_per_s=samples / seconds,
                   rank_samples=[int(n) for n in rank_samples], compute_s=[round(t, 4) for t in compute_s],
                   comm_s=[round(t, 4) for t in comm_s], split=split, skipped_steps=skipped_steps, step=step)
        return step_s

    def window_step(self, sizes: list[int], times: list[float], step_s: float, steps: int = 1) -> None:
        """Rank 0, step sync, a loop of the script's own: `steps` batches' samples (`sizes` each)
        and compute seconds of every rank (they rode with the gradients; one reduction covers the
        batches a script accumulates over) and rank 0's whole time for them, for the next window record."""
        if self.window is None:
            self.window = Window(time.perf_counter() - step_s, [0] * len(sizes), [0.0] * len(sizes))
        self.window.add([n * steps for n in sizes], times, step_s, steps)

    def close_window(self, epoch: int, step: int) -> None:
        """The "window" record of the steps since the last one (at a job.log and at the run's end):
        what an epoch record says of each rank, for a loop with no epochs. The ranks step in lockstep,
        so a rank's communication is the steps' time less its compute (its wait for the others included)."""
        w, self.window = self.window, None
        if w is None or not w.steps:
            return
        seconds = time.perf_counter() - w.started
        self.write("window", epoch=epoch, step=step, steps=w.steps, seconds=round(seconds, 3),
                   samples=sum(w.samples), samples_per_s=sum(w.samples) / seconds, rank_samples=w.samples,
                   compute_s=[round(t, 4) for t in w.compute_s],
                   comm_s=[round(max(0.0, w.step_s - t), 4) for t in w.compute_s])

    def end(self, digests: list[str] | None, step: int, reductions: int | None = None) -> None:
        """The run's end record; rank 0 also tells a launcher (wherever rank 0 runs: bench --to-accuracy,
        a sweep's trial value). `digests`: every rank's parameter digest (job.epochs' end), or None
        where the script's own loop ended it (Job.finish: no collective, no digests). `step`: the
        global steps taken (a sweep takes a loop of the script's own to be that long). `reductions`:
        under step sync, how often the gradients crossed the link (once a step; a script's own
        accumulation over k batches: once its k)."""
        seconds = round(time.perf_counter() - self.started, 3)
        self.ended = True
        ours = {"seconds": seconds, **({"param_digests": digests} if digests is not None else {}),
                **({"reductions": reductions} if reductions is not None else {})}
        # (a scalar the script logged under one of these names gives way, rather than a TypeError)
        self.write("end", **ours, **{k: v for k, v in self.last_scalars.items() if k not in ours})
        if self.is_main and self.report_progress:
            print(progress.RESULT_TAG + json.dumps({"event": "end", "seconds": seconds, "step": step,
                                                    "logs": self.logged}), flush=True)

    def offset(self) -> int:
        """Where metrics.jsonl ends now (a checkpoint keeps it: a resume truncates there)."""
        return self.metrics.offset() if self.metrics is not None else 0

    def truncate(self, offset: int | None = None, keep=None) -> None:
        """Drop what was written after `offset` (None: a line cut short at the end), but the record
        right after it where `keep(record)`."""
        if self.metrics is not None:
            self.metrics.truncate(self.metrics.complete_lines() if offset is None else offset, keep)

    def close(self) -> None:
        for log in (self.metrics, self.tensorboard):
            if log is not None and hasattr(log, "close"):
                log.close()


def host_name(settings: dict) -> str:
    return settings.get("name") or socket.gethostname()


@dataclass
class Window:
    """A loop of the script's own, on rank 0: its steps since the last job.log."""

    started: float
    samples: list[int]
    compute_s: list[float]
    step_s: float = 0.0
    """Rank 0's whole steps: compute and reduction (every rank's, in lockstep)."""
    steps: int = 0

    def add(self, sizes: list[int], times: list[float], step_s: float, steps: int = 1) -> None:
        self.samples = [a + b for a, b in zip(self.samples, sizes)]
        self.compute_s = [a + b for a, b in zip(self.compute_s, times)]
        self.step_s += step_s
        self.steps += steps
