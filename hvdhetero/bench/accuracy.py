"""Time to a test accuracy: `invoke bench --to-accuracy A --hosts fast,slow --sync MODE`.

Ways to train the same model, each with the built-in recipe until its test accuracy reaches A
(evaluated after every epoch; the training loop's seconds to it, evaluations excluded, as the
recipe logs them, and the elapsed seconds, evaluations included), for a few seeds:

  alone       the first of --hosts alone, the whole global batch (put the fastest first)
  step        all the hosts, gradients reduced every step
  mode        all the hosts in the local/DiLoCo mode asked for
  alone-mode  the first host alone in that mode (one rank: its own rounds, the outer optimizer):
              what the other hosts add with the algorithm alike. At a low inner lr DiLoCo's
              outer Nesterov step alone trains several times faster than plain Adam, which a
              comparison with `alone` would credit to the other hosts.

With --eval-global, local/diloco's evaluations score the global model (no exchange first; the
recipe's --eval-global), so the elapsed clock pays no exchange per evaluation, and a target is
reached when the pair holds one model at it.

Reported per way: the median seconds to A over the seeds, how many seeds reached it, and the
test accuracy after the last epoch every run of a seed completed (equal samples seen), next
to the samples/s over the training loop. This side starts no torch: each run is a job.

Against the host alone, two ratios: the medians' (alone's median seconds / the way's) and the
median of the per-seed ratios, with how many seeds got there sooner. The second is the one to
read: a seed fixes the initial model and the digits train/test split, so one seed's test set
can take twice another's training (seed 0: 9-10 s alone where the others take 4-6 s), and
comparing the same seed's runs takes that out, where the medians of five mix it in.

Why both clocks: with --sync local/diloco an evaluation first makes the ranks' models one (the
round in flight and the partial one exchanged at once, job.evaluate), so the training loop's
clock leaves out exchanges that the pair's learning got; the elapsed clock counts them (and the
evaluations, the same few milliseconds for every way).
"""

from __future__ import annotations

import json
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from hvdhetero import metrics
from hvdhetero.errors import ConfigError, HvdHeteroError


WAYS = ("alone", "step", "mode", "alone-mode")
"""The ways `ways` builds: the first host alone, all hosts with step sync, all in --sync's mode,
and the first host alone in --sync's mode (one rank: its own rounds and outer optimizer)."""
DEFAULT_WAYS = "alone,step,mode"
"""What --ways trains unless told."""


@dataclass
class Way:
    label: str
    hosts: list[str]
    settings: dict
    """JobConfig fields for the run (sync, overlap, slowdown)."""


@dataclass
class Run:
    way: str
    seed: int
    logs: list[dict] = field(default_factory=list)
    """The recipe's per-epoch records (test_accuracy, train_seconds, samples_seen, ...)."""
    epochs: list[dict] = field(default_factory=list)
    """The job's own `epoch` records from metrics.jsonl (compute_s, rank_samples per rank)."""

    @property
    def seconds_to_target(self) -> float | None:
        return next((r["seconds_to_target"] for r in self.logs if "seconds_to_target" in r), None)

    @property
    def elapsed_to_target(self) -> float | None:
        return next((r["elapsed_to_target"] for r in self.logs if "elapsed_to_target" in r), None)

    @property
    def samples_per_s(self) -> float:
        last = self.logs[-1] if self.logs else {}
        return last.get("samples_seen", 0) / last["train_seconds"] if last.get("train_seconds") else 0.0

    @property
    def first_rank_us_per_sample(self) -> float | None:
        """The first host's compute per sample (us; median over the epochs after the first, which
        holds the warm-up, unless there is only one): what tells a pair whose fast host ran slower
        than alone from a pair that lost its gain elsewhere (waits, exchanges)."""
        each = [r["compute_s"][0] / r["rank_samples"][0] * 1e6 for r in self.epochs[1:] or self.epochs
                if r.get("compute_s") and r.get("rank_samples") and r["rank_samples"][0]]
        return statistics.median(each) if each else None

    def accuracy_after(self, epochs: int) -> float | None:
        return next((r["test_accuracy"] for r in self.logs if r["epoch"] + 1 == epochs), None)


def ways(hosts: list[str], sync: str, overlap: bool, slowdown: float, inner_steps: str = "same",
         keep: tuple[str, ...] = tuple(DEFAULT_WAYS.split(","))) -> list[Way]:
    """Alone on the first host, step sync and `sync` on all of them (the straggler injection,
    which slows the last rank, only where there is more than one host); only those in `keep`."""
    if len(hosts) < 2:
        raise ValueError("--to-accuracy compares a host alone with several together: give --hosts two or more")
    mode = f"{sync}{' overlapped' if overlap else ''}{' by-speed' if inner_steps != 'same' else ''}"
    together = dict(slowdown=slowdown)
    every = {"alone": Way(f"{hosts[0]} alone", hosts[:1], dict(sync="step", overlap_sync=False, slowdown=1.0)),
             "step": Way(f"{'+'.join(hosts)} step", hosts, dict(sync="step", overlap_sync=False, **together)),
             "mode": Way(f"{'+'.join(hosts)} {mode}", hosts, dict(sync=sync, overlap_sync=overlap,
                                                                   inner_steps=inner_steps, **together)),
             "alone-mode": Way(f"{hosts[0]} alone, {sync}{' overlapped' if overlap else ''}", hosts[:1],
                               dict(sync=sync, overlap_sync=overlap, slowdown=1.0))}
    return [way for name, way in every.items() if name in keep]


def measure(train: Callable[[Way, int], tuple[list[dict], list[dict]]], plan: list[Way],
            seeds: list[int]) -> list[Run]:
    """Every way for every seed, seed by seed (so a drift of the machine hits all ways alike);
    `train(way, seed)` runs one job and returns its logged records and its epoch records."""
    return [Run(way.label, seed, *train(way, seed)) for seed in seeds for way in plan]


def summarize(runs: list[Run], target: float, evaluated: str = "exact") -> dict:
    """Per way, the seconds to `target` (both clocks) and the ratios to the host alone;
    `evaluated`: what local/diloco's evaluations scored, "exact" (the current model, exchanged
    first) or "global" (the global model as of the last exchange, nothing exchanged)."""
    labels = list(dict.fromkeys(r.way for r in runs))
    seeds = list(dict.fromkeys(r.seed for r in runs))  # as measured (each way's runs are in this order)
    # equal samples: per seed, the last epoch every way's run completed
    common = {s: min((len(r.logs) for r in runs if r.seed == s), default=0) for s in seeds}
    rows = []
    for label in labels:
        mine = [r for r in runs if r.way == label]
        reached = [r.seconds_to_target for r in mine if r.seconds_to_target is not None]
        accs = [a for r in mine if (a := r.accuracy_after(common[r.seed])) is not None]
        elapsed = [r.elapsed_to_target for r in mine if r.elapsed_to_target is not None]
        rows.append({"way": label, "seeds": len(mine), "reached": len(reached),
                     "seconds_to_target": statistics.median(reached) if reached else None,
                     "each_seconds_to_target": [r.seconds_to_target for r in mine],
                     "elapsed_to_target": statistics.median(elapsed) if elapsed else None,
                     "each_elapsed_to_target": [r.elapsed_to_target for r in mine],
                     "samples_per_s": statistics.median(r.samples_per_s for r in mine),
                     "each_samples_per_s": [round(r.samples_per_s, 1) for r in mine],
                     "first_rank_us_per_sample": _median(r.first_rank_us_per_sample for r in mine),
                     "each_first_rank_us_per_sample": [_round(r.first_rank_us_per_sample) for r in mine],
                     "accuracy_equal_samples": statistics.mean(accs) if accs else None,
                     "each_accuracy_equal_samples": accs})
    alone_row = next((r for r in rows if r["way"].endswith(" alone")), None)
    alone = alone_row["seconds_to_target"] if alone_row else None
    for row in rows:
        row["vs_alone"] = alone / row["seconds_to_target"] if alone and row["seconds_to_target"] else None
        row["each_vs_alone"] = _per_seed(alone_row, row, "each_seconds_to_target")
        row["vs_alone_per_seed"] = statistics.median(row["each_vs_alone"]) if row["each_vs_alone"] else None
        row["seeds_sooner"] = _sooner(alone_row, row) if alone_row else 0
        elapsed_ratios = _per_seed(alone_row, row, "each_elapsed_to_target")
        row["elapsed_vs_alone_per_seed"] = statistics.median(elapsed_ratios) if elapsed_ratios else None
    # against the first host alone in the same mode: what the other hosts add, the algorithm alike
    same = next((r for r in rows if " alone, " in r["way"]), None)  # ways()'s label for alone-mode
    for row in rows:
        if same is None or row is same or row is alone_row:
            continue
        loop, elapsed = (_per_seed(same, row, key) for key in ("each_seconds_to_target", "each_elapsed_to_target"))
        row["vs_alone_mode"] = {"way": same["way"], "per_seed": statistics.median(loop) if loop else None,
                                "elapsed_per_seed": statistics.median(elapsed) if elapsed else None,
                                "seeds_sooner": _sooner(same, row), "each": loop, "each_elapsed": elapsed}
    return {"target_accuracy": target, "seeds": seeds, "equal_samples_epochs": common, "evaluated": evaluated,
            "ways": rows}


def _median(values) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _round(value: float | None) -> float | None:
    return round(value, 1) if value is not None else None


def _per_seed(alone: dict | None, row: dict, key: str) -> list[float]:
    """Each seed's alone time over the way's, where both reached the target (rows list their
    runs in the same seed order: measure's)."""
    return [a / t for a, t in zip(alone[key], row[key]) if a and t] if alone else []


def _sooner(alone: dict, row: dict) -> int:
    """Seeds on which the way reached the target sooner than the host alone, or reached it where
    the host alone did not."""
    return sum(t is not None and (a is None or t < a)
               for a, t in zip(alone["each_seconds_to_target"], row["each_seconds_to_target"]))


def render(summary: dict) -> str:
    lines = [f"time to test accuracy {summary['target_accuracy']:.2%}, median over seeds "
             f"{','.join(map(str, summary['seeds']))} (accuracy at equal samples: after the last epoch every "
             f"way completed, per seed {summary['equal_samples_epochs']}):",
             f"{'':40}{'seconds':>9}{'reached':>9}{'vs alone':>10}{'per seed':>16}{'elapsed, per seed':>20}"
             f"{'samples/s':>11}{'acc (eq. samples)':>19}"]
    for row in summary["ways"]:
        alone = row["way"].endswith(" alone")
        secs = f"{row['seconds_to_target']:.1f}" if row["seconds_to_target"] is not None else "-"
        ratio = f"{row['vs_alone']:.2f}x" if row["vs_alone"] else "-"
        paired = (f"{row['vs_alone_per_seed']:.2f}x ({row['seeds_sooner']}/{row['seeds']})"
                  if row["vs_alone_per_seed"] and not alone else "-")
        elapsed = (f"{row['elapsed_to_target']:.1f}" if row["elapsed_to_target"] is not None else "-") + (
            f" {row['elapsed_vs_alone_per_seed']:.2f}x" if row["elapsed_vs_alone_per_seed"] and not alone else "")
        acc = f"{row['accuracy_equal_samples']:.2%}" if row["accuracy_equal_samples"] is not None else "-"
        lines.append(f"{row['way']:40}{secs:>9}{row['reached']:>5}/{row['seeds']:<3}{ratio:>10}{paired:>16}"
                     f"{elapsed:>20}{row['samples_per_s']:11,.0f}{acc:>19}")
    compute = [f"{row['way']} {row['first_rank_us_per_sample']:.1f}" for row in summary["ways"]
               if row.get("first_rank_us_per_sample") is not None]
    if compute:
        lines.append("the first host's compute per sample (us, median over seeds): " + "; ".join(compute))
    for row in summary["ways"]:
        other = row.get("vs_alone_mode")
        if other and other["per_seed"]:
            elapsed = f"{other['elapsed_per_seed']:.2f}x" if other["elapsed_per_seed"] else "-"
            lines.append(f"{row['way']} against {other['way']} (the same mode on one host), per seed: "
                         f"{other['per_seed']:.2f}x ({other['seeds_sooner']}/{row['seeds']} sooner), elapsed {elapsed}")
    lines.append("seconds: training loop to the first epoch at the target, evaluations excluded; vs alone > 1: "
                 "sooner than the first host alone (the medians' ratio); per seed: the median of each seed's "
                 "ratio to the host alone on the same seed (same model init and test split), and in how many "
                 "seeds it was sooner; elapsed: evaluations included, and with local/diloco "
                 + ("the exchange each one starts with" if summary.get("evaluated", "exact") == "exact" else
                    "no exchange: each epoch scored the global model as of the last exchange (--eval-global), "
                    "so a target is reached when the pair holds one model at it"))
    return "\n".join(lines)


def run(inventory: str | None, selected, options, runs: Path, extra: list[str]) -> dict:
    """`invoke bench --to-accuracy`: every way of `options` for every seed, each a job of the
    built-in recipe through the launcher (cluster/submit.py) in a scratch run directory; prints
    the summary table (and writes it as JSON to --out) and returns it."""
    from hvdhetero.cluster import submit
    from hvdhetero.recipes.options import check_argv, recipe_argv

    recipe = recipe_argv({}, dataset="digits", epochs=options.epochs, batch_size=options.batch_size,
                         repeat=options.repeat, target_accuracy=options.to_accuracy, lr=options.lr,
                         eval_global=options.eval_global)
    try:
        chosen = ways([h.name for h in selected], options.sync, options.overlap_sync, options.slowdown,
                      options.inner_steps, keep=tuple(options.way_list))
    except ValueError as err:
        raise ConfigError(str(err)) from None

    def train(way: Way, seed: int) -> tuple[list[dict], list[dict]]:
        settings = dict(seed=seed, compression=options.compression, keep_checkpoints=0, **way.settings)
        request = submit.Request(",".join(way.hosts), inventory, settings, recipe=recipe, script_args=extra)
        with tempfile.TemporaryDirectory(prefix="hvdhetero-tta-") as scratch:
            _, results = submit.submit(request, runs, scratch, name="tta", recipe_check=check_argv,
                                       verbose=options.verbose)
            try:  # what the job recorded of its epochs (compute per rank); a run without them is unknown
                records = metrics.records(Path(scratch) / metrics.FILE)
            except (OSError, HvdHeteroError):
                records = []
        return (next((r["logs"] for r in results if r.get("event") == "end"), []),
                [r for r in records if r.get("event") == "epoch"])

    summary = summarize(measure(train, chosen, options.seed_list), options.to_accuracy,
                        evaluated="global" if options.eval_global else "exact")
    print(render(summary))
    if options.out:
        Path(options.out).write_text(json.dumps(summary, indent=1) + "\n")
    return summary
