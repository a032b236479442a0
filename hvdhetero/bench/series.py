"""What the report's figures draw, from a Run (bench/runs.py): loss and accuracy against time
and epochs, samples/s of the job and of each rank, each rank's share, where each rank's step
goes. Pure: a test feeds it a hand-written metrics file."""

from __future__ import annotations

from dataclasses import dataclass, field

from hvdhetero.bench.runs import Run


@dataclass
class Series:
    label: str
    seconds: list[float]
    """Since the run's training started."""
    epochs: list[float]
    """Epochs completed at each point (fractions for a job.log between epochs' ends)."""
    values: list[float]
    steps: list[float] = field(default_factory=list)
    """The global step at each point (scalars: a run that loops on its own has no epochs to draw them against)."""


def epoch_steps(run: Run) -> list[tuple[int, int]]:
    """(first step, last step) of each epoch; older runs' epoch records lack the step: counted
    from the samples over the global batch."""
    out, before = [], 0
    batch = sum(run.splits[0]["split"]) if run.splits else 0
    for e in run.epochs:
        last = e.get("step") or before + (-(-e["samples"] // batch) if batch else 1)
        out.append((before, last))
        before = last
    return out


def _at_epoch(run: Run, epoch: int, step: int) -> float:
    """Epochs completed at (`epoch`, `step`): a job.log at an epoch's last step is at epoch+1."""
    bounds = epoch_steps(run)
    if epoch >= len(bounds):
        return float(epoch)
    first, last = bounds[epoch]
    return epoch + (min(max(step - first, 0), last - first) / (last - first) if last > first else 1.0)


def scalar_series(run: Run, match) -> list[Series]:
    """The epochs' train loss (when `match('loss')`) and every job.log scalar whose name matches,
    each one Series."""
    out = []
    if match("loss") and run.epochs:
        out.append(Series("train loss (epoch mean)", [e["time"] - run.t0 for e in run.epochs],
                          [e["epoch"] + 1.0 for e in run.epochs], [e["loss"] for e in run.epochs],
                          [last for _, last in epoch_steps(run)]))
    names = sorted({k for r in run.logs for k, v in r.items()
                    if k not in ("event", "time", "epoch", "step") and isinstance(v, (int, float))
                    and not isinstance(v, bool) and match(k)})
    for name in names:
        points = [r for r in run.logs if isinstance(r.get(name), (int, float))]
        out.append(Series(name.replace("_", " "), [r["time"] - run.t0 for r in points],
                          [_at_epoch(run, r.get("epoch", 0), r.get("step", 0)) for r in points],
                          [r[name] for r in points], [r.get("step", 0) for r in points]))
    return out


def is_loss(name: str) -> bool:
    return "loss" in name.lower()


def is_accuracy(name: str) -> bool:
    return "acc" in name.lower() and "target" not in name.lower()


def throughput(run: Run) -> tuple[Series, list[Series]]:
    """Samples/s of the whole job and of each rank, per epoch (its training samples over its wall
    time, evaluation included); a rank's from its samples in the epoch (older runs: the split). A
    loop of the script's own: per window, the steps between two job.log calls."""
    periods = run.epochs or run.windows
    seconds = [e["time"] - run.t0 for e in periods]
    done = [e["epoch"] + 1.0 for e in run.epochs]
    steps = [e.get("step", 0) for e in periods]
    total = Series("all ranks", seconds, done, [e["samples"] / max(e["seconds"], 1e-9) for e in periods], steps)
    per_rank = []
    for i, name in enumerate(run.ranks):
        values = []
        for e in periods:  # (a period without this rank, fewer hosts then: a gap in its line)
            if i >= len(e.get("rank_samples") or e["split"]):
                values.append(float("nan"))
                continue
            n = e["rank_samples"][i] if "rank_samples" in e else e["samples"] * e["split"][i] / sum(e["split"])
            values.append(n / max(e["seconds"], 1e-9))
        per_rank.append(Series(name, seconds, done, values, steps))
    return total, per_rank


def split_series(run: Run) -> list[Series]:
    """Each rank's samples per step, as a step function over time: a point at every re-split and
    one at the last epoch's end, or the last record of a run with none (the split held until then)."""
    end = (run.epochs[-1]["time"] if run.epochs else run.last_time) - run.t0
    out = []
    for i, name in enumerate(run.ranks):
        t = [max(0.0, s["time"] - run.t0) for s in run.splits] + [end]
        v = [s["split"][i] if i < len(s["split"]) else float("nan") for s in run.splits]
        out.append(Series(name, t, [], v + v[-1:]))
    return out


def step_times(run: Run) -> list[tuple[str, float, float, float]] | None:
    """Per rank, ms per step over the run: (name, compute, communication, the rest). Compute is
    forward and backward (straggling included); communication is the gradient allreduce or the
    local/diloco exchange, waiting for the slower ranks included; the rest is the optimizer
    step, data loading, evaluation and logging. A loop of the script's own: over its windows.
    None when the run's epochs lack the times (written since 2026-11-23), or it has neither."""
    timed = [e for e in run.epochs if "compute_s" in e and "comm_s" in e]
    if timed:
        bounds = dict(zip((e["epoch"] for e in run.epochs), epoch_steps(run)))
        steps = [max(1, bounds[e["epoch"]][1] - bounds[e["epoch"]][0]) for e in timed]
    elif run.windows and not run.epochs:
        timed = run.windows
        steps = [w["steps"] for w in timed]
    else:
        return None
    out = []
    for i, name in enumerate(run.ranks):  # over the periods the rank took part in (fewer hosts at times)
        there = [(e, n) for e, n in zip(timed, steps) if i < len(e["compute_s"])]
        if not there:
            continue
        taken = max(1, sum(n for _, n in there))
        compute, comm = sum(e["compute_s"][i] for e, _ in there), sum(e["comm_s"][i] for e, _ in there)
        rest = sum(e["seconds"] for e, _ in there) - compute - comm
        out.append((name, 1000 * compute / taken, 1000 * comm / taken, 1000 * max(0.0, rest) / taken))
    return out


