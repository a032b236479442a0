"""`invoke bench --sweep SPACE --hosts fast,slow`: does a sweep across uneven hosts end no later
than the fastest host alone would, running the very same trials?

Three sweeps of the built-in recipe (--trials trials of --budget epochs, sampler seed 0), one
after the other, each in its own folder under runs/<time>-bench-sweep/:

  swept   every host (invoke sweep's placement: docs/sweep.md)
  alone   the host that was fastest in `swept` (its mean complete trial), the same trials in the
          same order (the sweep's parameters enqueued): the baseline of the guarantee
  pruned  every host with --prune (the median pruner): what pruning costs or finds

Printed: each sweep's wall time (first trial's start to last trial's end), trials per host and
best test_loss, and the ratios swept/alone (<= 1.0 is the guarantee) and pruned/alone. A sweep
on these machines varies by the VM's noise (10-15%); run it a few times to read a ratio near 1.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

from hvdhetero.recipes.options import RecipeOptions
from hvdhetero.sweep.records import TRIALS_FILE
from hvdhetero.sweep.records import read as read_records
from hvdhetero.sweep import run as sweeps


def wall(records: list[dict]) -> float:
    return max(r["ended"] for r in records) - min(r["started"] for r in records)


def per_host(records: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in records:
        out[r["host"]] = out.get(r["host"], 0) + (r["state"] == "complete")
    return out


def fastest(records: list[dict], hosts: list[str]) -> str:
    """The host whose complete trials were shortest on average (hosts without one last)."""
    def mean(host):
        times = [r["seconds"] for r in records if r["host"] == host and r["state"] == "complete"]
        return sum(times) / len(times) if times else float("inf")

    return min(hosts, key=mean)


def summarize(ways: dict[str, list[dict]], alone_host: str) -> dict:
    out = {"alone_host": alone_host, "ways": {}}
    for name, records in ways.items():
        complete = [r for r in records if r["state"] == "complete"]
        out["ways"][name] = {"wall_s": round(wall(records), 2), "trials_per_host": per_host(records),
                             "best": min((r["value"] for r in complete), default=None),
                             "states": {s: sum(r["state"] == s for r in records) for s in ("complete", "pruned",
                                                                                           "short", "failed")}}
    base = out["ways"]["alone"]["wall_s"]
    out["ratios"] = {name: round(w["wall_s"] / base, 3) for name, w in out["ways"].items() if name != "alone"}
    return out


def render(result: dict, trials: int, budget: int) -> str:
    lines = [f"sweep bench: {trials} trials of {budget} epochs of digits; alone = {result['alone_host']}",
             f"  {'way':<8} {'wall s':>8} {'best test_loss':>15}  trials per host (complete)  states"]
    for name, w in result["ways"].items():
        hosts = ", ".join(f"{h}: {n}" for h, n in w["trials_per_host"].items())
        states = ", ".join(f"{n} {s}" for s, n in w["states"].items() if n)
        best = f"{w['best']:.4g}" if w["best"] is not None else "-"
        lines.append(f"  {name:<8} {w['wall_s']:>8.1f} {best:>15}  {hosts:<27} {states}")
    for name, ratio in result["ratios"].items():
        verdict = " (<= 1.0: no later than the fastest host alone)" if name == "swept" and ratio <= 1.0 else ""
        lines.append(f"  {name} / alone: {ratio:.3f}{verdict}")
    return "\n".join(lines)


def run(inventory: str, hosts: list[str], options, runs: Path, tasks_root: Path, recipe_check,
        recipe_flags: list[str]) -> dict:
    folder = runs / f"{time.strftime('%Y%m%d-%H%M%S')}-bench-sweep"
    base = sweeps.Request(str(Path(inventory).resolve()), hosts, str(Path(options.sweep).resolve()), options.trials,
                          budget=options.budget, recipe=RecipeOptions(epochs=options.budget).argv())
    ways: dict[str, list[dict]] = {}
    swept = sweeps.start(base, folder / "swept", tasks_root, recipe_check, recipe_flags)
    ways["swept"] = read_records(swept / TRIALS_FILE)
    alone_host = fastest(ways["swept"], hosts)
    order = sorted(ways["swept"], key=lambda r: r["number"])
    alone = replace(base, hosts=[alone_host], enqueued=[r["params"] for r in order])
    ways["alone"] = read_records(sweeps.start(alone, folder / "alone", tasks_root, recipe_check,
                                              recipe_flags) / TRIALS_FILE)
    pruned = replace(base, prune=True)
    ways["pruned"] = read_records(sweeps.start(pruned, folder / "pruned", tasks_root, recipe_check,
                                               recipe_flags) / TRIALS_FILE)
    result = summarize(ways, alone_host)
    result["folder"] = str(folder)
    print(render(result, options.trials, options.budget))
    if options.out:
        Path(options.out).write_text(json.dumps(result, indent=1) + "\n")
    return result
