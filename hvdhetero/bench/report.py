"""`invoke report [RUN_DIR ...]`: figures and a one-page summary of runs, overlaid.

    invoke report                                  # the newest run under runs/
    invoke report runs/A                           # one run: runs/A/report/
    invoke report runs/A runs/B                    # A and B overlaid: runs/A/report-vs-B/

runs.py reads each run directory; series.py turns a Run into the series the figures draw, and
the functions here into the numbers the summary shows (pure: a test feeds them a hand-written
metrics file); figures.py draws the series with matplotlib, and `write` puts the PNGs and one
self-contained report.html (images inlined, the runs' headline numbers and options side by
side) in the output folder.
"""

from __future__ import annotations

import base64
import html
import json
import statistics
from pathlib import Path

from hvdhetero.bench.runs import Run
from hvdhetero.bench.series import epoch_steps, is_accuracy

WALL = "wall time (the job's start to its end, a pause before a resume left out)"
EPOCHS_TIME = "time in epochs (their loop bodies, evaluation included)"


def headline(run: Run) -> dict[str, str]:
    """The numbers a reader compares first, formatted."""
    s, epochs = run.start, run.epochs
    samples, seconds = sum(e["samples"] for e in epochs), sum(e["seconds"] for e in epochs)
    final = {**{k: v for r in run.logs for k, v in r.items() if k not in ("event", "time", "epoch", "step")}}
    out = {
        "run directory": str(run.path),
        "finished": "yes" if run.end else f"no (last record at {records_end(run):.1f} s)",
        "sync": run.sync,
        "hosts": ", ".join(dict.fromkeys(s.get("host_names") or s.get("hostnames") or [])),
        "ranks": "; ".join(run.ranks),
        "global batch": str(sum(run.splits[0]["split"])) if run.splits else "?",
    }
    if epochs:
        last = epochs[-1]
        out.update({
            "final split": "/".join(str(n) for n in last.get("split") or []),
            "epochs": str(len(epochs)),
            "steps": str(epoch_steps(run)[-1][1]),
            WALL: duration(run.before_s + run.end["seconds"]) if run.end else "-",
            EPOCHS_TIME: duration(seconds),
            "samples/s (all epochs)": f"{samples / seconds:,.0f}" if seconds else "-",
            "samples/s (last epoch)": f"{last['samples'] / last['seconds']:,.0f}",
            "final train loss": f"{last['loss']:.4g}",
        })
    else:  # a loop of the script's own: what job.log and the balancer recorded
        out.update({
            "final split": "/".join(str(n) for n in run.splits[-1]["split"]) if run.splits else "?",
            "epochs": "none recorded (the script loops on its own, without job.epochs)",
            "steps": f"{max(r.get('step', 0) for r in run.logs)} at the last "
                     + ("live line (the script calls no job.log: its loss is rank 0's share's, as the live line "
                        "shows it)" if run.live_loss else "job.log"),
            WALL: duration(run.before_s + run.end["seconds"]) if run.end else "-",
        })
        if run.windows:  # step sync: the steps between its job.log calls
            seconds = sum(w["seconds"] for w in run.windows)
            out["samples/s (between job.log calls)"] = (
                f"{sum(w['samples'] for w in run.windows) / seconds:,.0f}" if seconds else "-")
    for k, v in final.items():
        if isinstance(v, float) and "seconds" in k.split("_"):  # a time the script measured itself
            out[f"{k.replace('_', ' ')} (the script's last job.log)"] = duration(v)
        elif isinstance(v, float):
            out[f"final {k.replace('_', ' ')}"] = f"{v:.2%}" if is_accuracy(k) and 0 <= v <= 1 else f"{v:.4g}"
    if run.resumes:
        out["resumed"] = ", ".join(f"at step {r.get('step', '?')}, {r['time'] - run.t0:.0f} s after the start"
                                   for r in run.resumes)
    if run.exchanges:
        ex = [x["seconds"] for x in run.exchanges]
        out["exchanges"] = f"{len(ex)}, median {1000 * statistics.median(ex):.1f} ms on rank 0"
    return out


def duration(seconds: float) -> str:
    """0.0341 s, 1.2 s, 95.0 s, 1 h 56 min: seconds a reader takes in at a glance."""
    if seconds < 1:
        return f"{seconds:.3g} s"
    if seconds < 600:
        return f"{seconds:.1f} s"
    minutes = round(seconds / 60)
    return f"{minutes} min" if minutes < 60 else f"{minutes // 60} h {minutes % 60} min"


def records_end(run: Run) -> float:
    return run.last_time - run.t0


def config_rows(run: Run) -> dict[str, str]:
    """The options the run was launched with (launch.json), else the job config of its start."""
    if run.launch:
        what = run.launch.get("script") or "built-in recipe"
        args = run.launch.get("recipe", []) if not run.launch.get("script") else []
        rows = {"hosts": ",".join(run.launch.get("hosts", [])), "script": what,
                "arguments": " ".join(args + run.launch.get("script_args", []))}
        return {**rows, **{k: json.dumps(v) if not isinstance(v, str) else v
                           for k, v in run.launch.get("settings", {}).items()}}
    cfg = run.start.get("config", {})
    return {k: json.dumps(v) if not isinstance(v, str) else v for k, v in cfg.items() if k != "hosts"}


# -- the report ------------------------------------------------------------------------------------

def write(runs: list[Run], out: Path) -> tuple[Path, list]:
    """The figures (PNG) and report.html into `out`; returns the page and the figures drawn."""
    from hvdhetero.bench import figures

    out.mkdir(parents=True, exist_ok=True)
    drawn = figures.draw_all(runs, out)
    page = out / "report.html"
    page.write_text(render_html(runs, drawn), encoding="utf-8")
    return page, drawn


def render_html(runs: list[Run], drawn: list) -> str:
    """One page, nothing beside it needed: headline and config per run side by side, then every
    figure inlined as a base64 PNG with what it shows."""
    e = html.escape
    title = "hvdhetero report: " + " vs ".join(r.label for r in runs)

    def differs(rows: list[dict[str, str]], key: str) -> str:
        return " class=diff" if len(rows) > 1 and len({row.get(key) for row in rows}) > 1 else ""

    def table(rows: list[dict[str, str]]) -> str:
        keys = list(dict.fromkeys(k for row in rows for k in row))
        head = "".join(f"<th>{e(r.label)}</th>" for r in runs) if len(runs) > 1 else "<th></th>"
        body = "".join(f"<tr{differs(rows, k)}><th>{e(k)}</th>" + "".join(f"<td>{e(row.get(k, '-'))}</td>"
                                                                          for row in rows) + "</tr>" for k in keys)
        return f"<table><tr><th></th>{head}</tr>{body}</table>" if len(runs) > 1 else f"<table>{body}</table>"

    notes = [f"{r.label}: metrics.jsonl ended in a half-written line (left out)" for r in runs if r.torn_last_line]
    parts = [f"<h1>{e(title)}</h1>", "<h2>Headline</h2>", table([headline(r) for r in runs]),
             *(f"<p class=note>{e(n)}</p>" for n in notes), "<h2>Configuration</h2>",
             table([config_rows(r) for r in runs])]
    for fig in drawn:
        data = base64.b64encode(fig.path.read_bytes()).decode()
        parts += [f"<h2>{e(fig.title)}</h2>", f"<p>{e(fig.caption)}</p>",
                  f'<img src="data:image/png;base64,{data}" alt="{e(fig.path.name)}">',
                  f"<p class=file>{e(fig.path.name)}</p>"]
    style = ("body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;color:#222}"
             "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:.25em .6em;"
             "text-align:left;vertical-align:top}th{background:#f4f4f4}img{max-width:100%}"
             "tr.diff td{background:#fff3c4}.note{color:#a40}.file{color:#777;font-size:.85em}")
    return (f"<!doctype html><html><head><meta charset=utf-8><title>{e(title)}</title><style>{style}</style>"
            f"</head><body>{''.join(parts)}</body></html>\n")
