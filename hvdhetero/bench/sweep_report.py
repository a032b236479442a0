"""`invoke report SWEEP_DIR`: what a sweep found and how its hosts were used, as PNGs and one
self-contained report.html in SWEEP_DIR/report.

    sweep = read(SWEEP_DIR)           # sweep.json and trials.jsonl (bad folder: exit 2, nothing written)
    page, drawn = write(sweep, out)

Figures (each records what its axes hold, read back from the drawn artists: a test compares
them with trials.jsonl):
  metric.png   the metric of every trial against its number and against the time it ended,
               with the best so far; pruned and failed trials marked
  params.png   the metric against each parameter's value (log axes where the space is log)
  hosts.png    which host ran which trial when (a bar per trial on its host's row)
  epochs.png   each trial's metric at every epoch's end (what the pruner judged)
matplotlib is imported only while drawing, as in figures.py.
"""

from __future__ import annotations

import base64
import html
import json
from dataclasses import dataclass, field
from pathlib import Path

from hvdhetero.bench.figures import new_figure
from hvdhetero.errors import ConfigError, SpaceError
from hvdhetero.sweep.records import TRIALS_FILE
from hvdhetero.sweep.run import SWEEP_FILE

STATES = {"complete": ("o", 1.0), "pruned": ("x", 0.8), "short": ("s", 0.6), "failed": ("v", 0.8)}
"""How each state's trials are marked; short: a short trial of a slow host (--prune, docs/sweep.md)."""


@dataclass
class SweepRecords:
    path: Path
    request: dict
    trials: list[dict]
    space: list[dict] = field(default_factory=list)
    """Each parameter: name, kind, log (from the space file, when it can still be read)."""

    @property
    def metric(self) -> str:
        return self.request["metric"]

    def best(self) -> dict | None:
        complete = [t for t in self.trials if t["state"] == "complete"]
        if not complete:
            return None
        return (min if self.request["mode"] == "min" else max)(complete, key=lambda t: t["value"])

    @property
    def t0(self) -> float:
        return min(t["started"] for t in self.trials)


@dataclass
class Drawn:
    path: Path
    title: str
    caption: str
    series: dict[str, dict[str, list]] = field(default_factory=dict)
    """Each axes' title -> each labelled artist's points, as drawn ((x, y); bars: (start, width, row))."""


def is_sweep(folder: str | Path) -> bool:
    return (Path(folder) / SWEEP_FILE).is_file()


def read(folder: str | Path) -> SweepRecords:
    folder = Path(folder)
    try:
        request = json.loads((folder / SWEEP_FILE).read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"{folder / SWEEP_FILE} cannot be read ({err}): not a folder invoke sweep wrote") from None
    trials = []
    path = folder / TRIALS_FILE
    if path.is_file():
        lines = path.read_text().splitlines()
        for n, line in enumerate(lines, 1):
            try:
                trials.append(json.loads(line))
            except ValueError:
                if n < len(lines):  # the last one may be cut short (the sweep killed mid-write)
                    raise ConfigError(f"{path}:{n}: not a JSON record (the file was edited?)") from None
    if not trials:
        raise ConfigError(f"{path}: no trial has ended yet: nothing to report (report again once one has)")
    space = []
    try:
        from hvdhetero.sweep import space as spaces

        space = [{"name": p.name, "kind": p.kind, "log": p.log or p.kind == "loguniform"}
                 for p in spaces.load(request["space"]).params]
    except SpaceError:  # the space file moved or changed since: the parameters' names from the trials
        names = list(dict.fromkeys(k for t in trials for k in t["params"]))
        space = [{"name": n, "kind": "choice" if any(isinstance(t["params"].get(n), str) for t in trials)
                  else "uniform", "log": False} for n in names]
    return SweepRecords(folder, request, trials, space)


def write(sweep: SweepRecords, out: Path) -> tuple[Path, list[Drawn]]:
    out.mkdir(parents=True, exist_ok=True)
    drawn = [metric(sweep, out), params(sweep, out), hosts(sweep, out)]
    drawn += [f for f in [epochs(sweep, out)] if f is not None]
    page = out / "report.html"
    page.write_text(render_html(sweep, drawn), encoding="utf-8")
    return page, drawn


# -- figures ---------------------------------------------------------------------------------------

def metric(sweep: SweepRecords, out: Path) -> Drawn:
    fig, (by_number, by_time) = new_figure(2)
    for ax, x in ((by_number, "number"), (by_time, "time")):
        for state, (marker, alpha) in STATES.items():
            shown = [t for t in sweep.trials if t["state"] == state and t.get("value") is not None]
            if shown:
                xs = [t["number"] if x == "number" else t["ended"] - sweep.t0 for t in shown]
                ax.plot(xs, [t["value"] for t in shown], marker, linestyle="none", alpha=alpha, label=state)
        done = sorted((t for t in sweep.trials if t["state"] == "complete"),
                      key=lambda t: t["number"] if x == "number" else t["ended"])
        best, xs, ys = None, [], []
        for t in done:
            better = best is None or (t["value"] < best if sweep.request["mode"] == "min" else t["value"] > best)
            best = t["value"] if better else best
            xs.append(t["number"] if x == "number" else t["ended"] - sweep.t0)
            ys.append(best)
        if xs:
            ax.step(xs, ys, where="post", color="k", linewidth=1, label="best so far")
        ax.set_title(f"{sweep.metric} against {'trial' if x == 'number' else 'time'}")
        ax.set_xlabel("trial number" if x == "number" else "time since the sweep started (s)")
        if x == "number":
            from matplotlib.ticker import MaxNLocator

            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(sweep.metric)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return _save(fig, out / "metric.png", f"{sweep.metric} of each trial ({sweep.request['mode']} is best)",
                 "Each trial's value (its last epoch's), by trial number and by the time it ended; the line is "
                 "the best complete trial so far. Pruned trials show the value they were stopped at.")


def params(sweep: SweepRecords, out: Path) -> Drawn:
    fig, axes = new_figure(len(sweep.space), width=max(5.0, 4.2 * len(sweep.space)))
    for ax, p in zip(axes, sweep.space):
        for state, (marker, alpha) in STATES.items():
            shown = [t for t in sweep.trials if t["state"] == state and t.get("value") is not None
                     and p["name"] in t["params"]]
            if not shown:
                continue
            xs = [t["params"][p["name"]] for t in shown]
            if p["kind"] == "choice":
                xs = [str(x) for x in xs]
            ax.plot(xs, [t["value"] for t in shown], marker, linestyle="none", alpha=alpha, label=state)
        if p["log"]:
            ax.set_xscale("log")
        ax.set_title(p["name"])
        ax.set_xlabel(f"--{p['name']}")
        ax.set_ylabel(sweep.metric)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    return _save(fig, out / "params.png", f"{sweep.metric} against each parameter",
                 "Every trial's value against the value it was given, one panel per parameter of the space.")


def hosts(sweep: SweepRecords, out: Path) -> Drawn:
    names = list(dict.fromkeys([*sweep.request["hosts"], *(t["host"] for t in sweep.trials)]))
    fig, (ax,) = new_figure(1, height=1.2 + 0.6 * len(names), width=12.4)
    for state, color in (("complete", "C0"), ("pruned", "C1"), ("short", "C2"), ("failed", "C3")):
        shown = [t for t in sweep.trials if t["state"] == state]
        if shown:
            ax.barh([names.index(t["host"]) for t in shown], [t["ended"] - t["started"] for t in shown],
                    left=[t["started"] - sweep.t0 for t in shown], height=0.6, color=color, edgecolor="k",
                    label=state)
            for t in shown:
                ax.text(t["started"] - sweep.t0 + 0.2, names.index(t["host"]), str(t["number"]), va="center",
                        fontsize="small", color="w")
    ax.set_yticks(range(len(names)), names)
    ax.set_title("trials on each host")
    ax.set_xlabel("time since the sweep started (s)")
    ax.legend(fontsize="small", loc="upper right")
    ax.grid(alpha=0.3, axis="x")
    return _save(fig, out / "hosts.png", "Which host ran what, when",
                 "A bar per trial (its number on it) from its start to its end on the host that finished it; "
                 "a copy stopped on a slower host is not drawn (trials.jsonl lists it under stopped_on).")


def epochs(sweep: SweepRecords, out: Path) -> Drawn | None:
    traced = [t for t in sweep.trials if len(t.get("values") or {}) > 1]
    if not traced:
        return None
    at = "step" if any(t.get("values_at") == "step" for t in traced) else "epoch"  # a loop of the script's own
    fig, (ax,) = new_figure(1)
    for t in traced:
        xs = sorted(int(e) for e in t["values"])
        ax.plot(xs, [t["values"][str(e)] for e in xs], "-" if t["state"] == "complete" else ":", marker=".",
                label=f"trial {t['number']} ({t['state']})")
    ax.set_title(f"{sweep.metric} at each {at}")
    ax.set_xlabel(at if at == "epoch" else "global step")
    ax.set_ylabel(sweep.metric)
    ax.grid(alpha=0.3)
    if len(traced) <= 16:
        ax.legend(fontsize="x-small", ncols=2)
    when = "every epoch's end" if at == "epoch" else "each step it logged it at"
    return _save(fig, out / "epochs.png", f"{sweep.metric} at each {at} of each trial",
                 f"What each trial reported at {when} (what --prune judges); dotted: pruned or failed.")


def _save(fig, path: Path, title: str, caption: str) -> Drawn:
    """Title, write the PNG, and record each axes' artists as drawn."""
    fig.suptitle(title)
    fig.savefig(path)
    series = {}
    for ax in fig.axes:
        found: dict[str, list] = {}
        for line in ax.get_lines():
            if not line.get_label().startswith("_"):
                xs = [ax.xaxis.convert_units(x) if isinstance(x, str) else x for x in line.get_xdata()]
                found[line.get_label()] = [(_plain(x), _plain(y)) for x, y in zip(xs, line.get_ydata())]
        for container in ax.containers:
            found[container.get_label()] = [(round(b.get_x(), 3), round(b.get_width(), 3),
                                             round(b.get_y() + b.get_height() / 2)) for b in container]
        series[ax.get_title()] = found
    return Drawn(path, title, caption, series)


def _plain(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return v


def render_html(sweep: SweepRecords, drawn: list[Drawn]) -> str:
    e = html.escape
    best = sweep.best()
    states = {s: sum(1 for t in sweep.trials if t["state"] == s) for s in STATES}
    head = {
        "sweep": str(sweep.path),
        "trials": f"{len(sweep.trials) - states['short']} of {sweep.request['trials']} ended (" + ", ".join(
            f"{n} {s}" for s, n in states.items() if n) + ")",
        "hosts": ", ".join(sweep.request["hosts"]),
        "metric": f"{sweep.metric} ({sweep.request['mode']} is best)",
        "what ran": sweep.request["script"] or "the built-in recipe " + " ".join(sweep.request["recipe"]),
        "best": (f"trial {best['number']} on {best['host']}: {sweep.metric} {best['value']:.6g} with "
                 f"{' '.join(best['argv'])}") if best else "no trial completed",
        "wall time": f"{max(t['ended'] for t in sweep.trials) - sweep.t0:.1f} s",
    }
    rows = "".join(f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in head.items())
    def value(t: dict) -> str:
        return "-" if t.get("value") is None else f"{t['value']:.6g}"

    trials = "".join(
        f"<tr><td>{t['number']}</td><td>{e(t['host'])}</td><td>{e(t['state'])}</td><td>{value(t)}</td>"
        f"<td>{t['seconds']:.1f}</td><td>{e(' '.join(t['argv']))}</td></tr>"
        for t in sorted(sweep.trials, key=lambda t: t["number"]))
    parts = [f"<h1>hvdhetero sweep: {e(sweep.path.name)}</h1>", f"<table>{rows}</table>", "<h2>Trials</h2>",
             f"<table><tr><th>trial</th><th>host</th><th>state</th><th>{e(sweep.metric)}</th><th>seconds</th>"
             f"<th>parameters</th></tr>{trials}</table>"]
    for fig in drawn:
        data = base64.b64encode(fig.path.read_bytes()).decode()
        parts += [f"<h2>{e(fig.title)}</h2>", f"<p>{e(fig.caption)}</p>",
                  f'<img src="data:image/png;base64,{data}" alt="{e(fig.path.name)}">']
    style = ("body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;color:#222}"
             "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:.25em .6em;"
             "text-align:left}th{background:#f4f4f4}img{max-width:100%}")
    return (f"<!doctype html><html><head><meta charset=utf-8><title>hvdhetero sweep {e(sweep.path.name)}</title>"
            f"<style>{style}</style></head><body>{''.join(parts)}</body></html>\n")
