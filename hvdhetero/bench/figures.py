"""The report's figures, drawn with matplotlib's Agg backend from report.py's series.

Every figure overlays all the runs given, one color per run; within a run the line style tells
the series apart (train from test loss, one rank from another). matplotlib is imported only
here, when a report is drawn: the launcher's other commands never load it. Each figure comes
back as a record of what its axes hold, read from the drawn axes themselves, so a test checks
what a reader sees.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hvdhetero.bench.runs import Run
from hvdhetero.bench.series import is_accuracy, is_loss, scalar_series, split_series, step_times, throughput

STYLES = ["-", "--", ":", "-."]
DPI = 110
PARTS = (("compute", "#4c72b0"), ("communication", "#dd8452"), ("other", "#bbbbbb"))


@dataclass
class Figure:
    path: Path
    title: str
    caption: str
    series: dict[str, list[str]] = field(default_factory=dict)
    """Each axes' title -> the labels of its lines (bar charts: its bar segments, then its bars)."""


def draw_all(runs: list[Run], out: Path) -> list[Figure]:
    """Every figure the runs have data for, as PNGs in `out` (one no run has data for is left out)."""
    drawn = [loss(runs, out), accuracy(runs, out), samples_per_s(runs, out), split(runs, out), step_time(runs, out)]
    return [f for f in drawn if f is not None]


def loss(runs: list[Run], out: Path) -> Figure | None:
    return _scalar_figure(runs, out / "loss.png", is_loss, "loss", percent=False, caption=(
        "Train loss (epoch mean): the mean over each epoch's samples on every rank, a point at each epoch's end. "
        "The others: what the script passed to job.log with 'loss' in the name, at the step it logged them."))


def accuracy(runs: list[Run], out: Path) -> Figure | None:
    """The job.log scalars named like an accuracy; none logged: no figure."""
    values = [v for r in runs for s in scalar_series(r, is_accuracy) for v in s.values]
    return _scalar_figure(runs, out / "accuracy.png", is_accuracy, "accuracy",
                          percent=bool(values) and all(0 <= v <= 1 for v in values), caption=(
                              "What the script passed to job.log with 'acc' in the name, at the step it logged them."))


def samples_per_s(runs: list[Run], out: Path) -> Figure | None:
    """Per epoch, or per window between job.log calls (a loop of the script's own); none where no
    run has either."""
    if not any(r.epochs or r.windows for r in runs):
        return None
    fig, axes = new_figure()
    unit = _time_axis(runs)
    _lines(axes[0], runs, lambda r: [throughput(r)[0]], "time", unit)
    _lines(axes[1], runs, lambda r: throughput(r)[1], "time", unit)
    for ax, name in zip(axes, ("whole job", "each rank")):
        ax.set_title(name)
        ax.set_ylabel("samples/s")
        ax.set_ylim(bottom=0)
        _legend_below(ax, ax)
    return _save(fig, out / "samples_per_s.png", f"Samples/s: {_names(runs)}", (
        "Training samples over each epoch's wall time (its evaluation included), a point at each epoch's end; per "
        "rank, the samples that rank computed. The balancer sizes each rank's share by its speed, so a slower rank "
        "computes fewer samples while every rank's step takes about as long." + _looped(runs)))


def split(runs: list[Run], out: Path) -> Figure:
    fig, axes = new_figure(cols=1)
    ax, unit = axes[0], _time_axis(runs)
    for i, run in enumerate(runs):
        for j, s in enumerate(split_series(run)):
            ax.step([t / unit[0] for t in s.seconds], s.values, STYLES[j % len(STYLES)], where="post",
                    color=_color(i), label=_label(runs, run, s.label))
    ax.set_xlabel(_time_label(runs, unit))
    ax.set_ylabel("samples per step")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    _legend_below(fig, ax)
    return _save(fig, out / "split.png", f"Batch split: {_names(runs)}", (
        "Each rank's samples per step as the balancer set them: calibrated at the start, then each re-split, held "
        "until the next. The ranks' shares add up to the global batch."))


def step_time(runs: list[Run], out: Path) -> Figure | None:
    """Stacked bars, one per run and rank: compute, communication, the rest (ms per step)."""
    bars = [(run, rank) for run in runs for rank in (step_times(run) or [])]
    if not bars:
        return None
    fig, axes = new_figure(cols=1, height=0.55 * len(bars) + 2.2, width=7.5)
    ax = axes[0]
    left = [0.0] * len(bars)
    for k, (part, color) in enumerate(PARTS):
        widths = [ms[1 + k] for _, ms in bars]
        ax.barh(range(len(bars)), widths, left=left, color=color, label=part)
        left = [a + w for a, w in zip(left, widths)]
    for y, total in enumerate(left):
        ax.text(total, y, f" {total:.1f} ms", va="center", fontsize="small")
    ax.set_yticks(range(len(bars)), [(f"{run.label}\n" if len(runs) > 1 else "") + ms[0] for run, ms in bars],
                  fontsize="small")
    ax.invert_yaxis()
    ax.set_xlim(right=max(left) * 1.18)
    ax.set_xlabel("ms per step (mean over the run's epochs, or its steps)")
    ax.set_title("where each rank's step goes")
    ax.grid(axis="x", alpha=0.3)
    fig.legend(loc="outside lower center", ncols=3, fontsize="small", frameon=False)
    caption = ("Compute: forward and backward (a straggler's wait included). Communication: the gradient "
               "allreduce every step, or with local/diloco each exchange spread over its round's steps, waiting "
               "for the slower ranks included. Other: the optimizer step, data loading, evaluation and logging "
               "(the epoch's wall time less the two).")
    missing = [r.label for r in runs if step_times(r) is None and r.epochs]
    if missing:
        caption += f" Not timed (their metrics were written before these times were): {', '.join(missing)}."
    caption += _looped(runs)
    return _save(fig, out / "step_time.png", f"Step time: {_names(runs)}", caption)


# -- drawing helpers -------------------------------------------------------------------------------

def _scalar_figure(runs: list[Run], path: Path, match, name: str, percent: bool, caption: str) -> Figure | None:
    """`name` against time and against epochs (steps, where a run has no epoch records: a loop of
    the script's own), side by side; None if no run has such a series."""
    if not any(scalar_series(r, match) for r in runs):
        return None
    fig, axes = new_figure()
    unit = _time_axis(runs)
    by = "epoch" if all(r.epochs for r in runs) else "step"
    for ax, x in zip(axes, ("time", by)):
        _lines(ax, runs, lambda r: scalar_series(r, match), x, unit)
        ax.set_title(f"{name} against {'time' if x == 'time' else x + 's'}")
        ax.set_ylabel(name)
        if percent:
            from matplotlib.ticker import PercentFormatter

            ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    _legend_below(fig, axes[0])
    return _save(fig, path, f"{name.capitalize()}: {_names(runs)}", caption + _looped(runs))


def _looped(runs: list[Run]) -> str:
    """What a caption says of the runs without epoch records."""
    looped = [r.label for r in runs if not r.epochs]
    return (f" No epoch records in {', '.join(looped)}: its script loops on its own, without job.epochs, so its "
            "loss is what it passed to job.log, drawn against time and steps, and its speed (step sync) is that of "
            "the steps between two job.log calls, a point at the second." if looped else "")


def new_figure(cols: int = 2, height: float = 4.2, width: float = 12.4):
    from matplotlib.figure import Figure as MplFigure  # no pyplot: no global state, no display backend

    fig = MplFigure(figsize=(width, height), dpi=DPI, layout="constrained")
    return fig, fig.subplots(1, cols, squeeze=False).ravel()


def _save(fig, path: Path, title: str, caption: str) -> Figure:
    """Title, write the PNG, and record each axes' series as drawn."""
    fig.suptitle(title)
    fig.savefig(path)
    series = {}
    for ax in fig.axes:
        lines = [line.get_label() for line in ax.get_lines() if not line.get_label().startswith("_")]
        bars = [c.get_label() for c in ax.containers]
        ticks = [t.get_text() for t in ax.get_yticklabels()] if bars else []
        series[ax.get_title() or ax.get_ylabel()] = lines + bars + ticks
    return Figure(path, title, caption, series)


def _names(runs: list[Run]) -> str:
    return " vs ".join(r.label for r in runs)


def _time_axis(runs: list[Run]) -> tuple[float, str]:
    """Seconds, minutes or hours, whichever keeps the ticks short for the longest run."""
    longest = max(r.last_time - r.t0 for r in runs)
    return (1.0, "s") if longest < 600 else (60.0, "min") if longest < 3 * 3600 else (3600.0, "h")


def _time_label(runs: list[Run], unit: tuple[float, str]) -> str:
    """The time axis: wall-clock time, so a resumed run's pause before its resume is on it."""
    paused = " (wall clock: the pause before a resume included)" if any(r.resumes for r in runs) else ""
    return f"time since training started ({unit[1]}){paused}"


def _color(i: int) -> str:
    return f"C{i % 10}"


def _label(runs: list[Run], run: Run, what: str) -> str:
    return what if len(runs) == 1 else f"{run.label}: {what}"


def _lines(ax, runs: list[Run], per_run, x: str, unit: tuple[float, str]) -> None:
    """Draw `per_run(run) -> [Series]` for every run against time or epochs completed."""
    for i, run in enumerate(runs):
        for j, s in enumerate(per_run(run)):
            if not s.values:  # a run with no epoch records has no per-epoch series
                continue
            xs = [t / unit[0] for t in s.seconds] if x == "time" else s.steps if x == "step" else s.epochs
            ax.plot(xs, s.values, STYLES[j % len(STYLES)], color=_color(i), label=_label(runs, run, s.label),
                    marker="o" if len(xs) <= 40 else None, markersize=4)
    ax.grid(alpha=0.3)
    ax.set_xlabel(_time_label(runs, unit) if x == "time" else
                  "steps" if x == "step" else "epochs completed")
    if x != "time":
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _legend_below(owner, ax) -> None:
    """The legend under the plot (the figure's, when its axes share their series), never over a line."""
    handles, labels = ax.get_legend_handles_labels()
    cols = 1 if max(len(x) for x in labels) > 40 else min(len(labels), 4)
    if owner is ax:
        ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncols=cols, fontsize="small",
                  frameon=False)
    else:
        owner.legend(handles, labels, loc="outside lower center", ncols=2 if cols == 1 else cols, fontsize="small",
                     frameon=False)
