"""`invoke bench`'s table and JSON, from the phases' per-round rates (bench/throughput.py):
rates are medians over rounds, ratios medians of the ratios within rounds."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from hvdhetero.recipes import models


def sync_name(args) -> str:
    wire = ", fp16 wire" if args.compression != "none" else ""
    return args.sync + (" overlapped" if args.overlap_sync else "") + (" by-speed" if args.inner_steps != "same" else "") + wire


def report(args, solo_rounds: list[list[float]], horovod: dict, ours: dict, engine: dict, counts: dict,
           saving: dict, solo_steps: list[dict] | None = None) -> None:
    """Rates are medians over rounds; E, vs_fastest and hvdhetero/horovod are medians of the
    ratios within each round (paired, so the VM's drift between rounds cancels)."""
    med = statistics.median
    rounds = range(len(solo_rounds[0]))
    total_r = [sum(rank[r] for rank in solo_rounds) for r in rounds]
    fastest_r = [max(rank[r] for rank in solo_rounds) for r in rounds]
    solo = [med(rank) for rank in solo_rounds]
    total, fastest = sum(solo), max(solo)
    for job in (horovod, ours, engine):
        rates = job["per_round_samples_per_s"]
        job["samples_per_s"] = med(rates)
        job["efficiency"] = med(rates[r] / total_r[r] for r in rounds)
        job["vs_fastest"] = med(rates[r] / fastest_r[r] for r in rounds)
        job["min_vs_fastest"] = min(rates[r] / fastest_r[r] for r in rounds)
        # What the job made of the slower ranks: 1 = all their solo speed added, < 0 = a loss.
        # (None with one rank: there is no slower rank to capture.)
        job["captured"] = (med((rates[r] - fastest_r[r]) / (total_r[r] - fastest_r[r]) for r in rounds)
                           if len(solo_rounds) > 1 else None)
    result = {
        "config": {"ranks": len(solo_rounds), "slowdown": args.slowdown, "sync": args.sync, "overlap_sync": args.overlap_sync,
                   "inner_steps": args.inner_steps,
                   "compression": args.compression, "dataset": args.dataset, "synthetic": args.dataset != "digits",
                   "model": args.model or models.default_for(args.dataset), "global_batch": args.batch_size,
                   "steps": args.steps, "min_seconds": args.min_seconds, "repeats": args.repeats,
                   "warmup": args.warmup, "timed_steps": counts},
        "solo": {"samples_per_s": total, "per_rank_samples_per_s": solo, "fastest": fastest,
                 "per_round_samples_per_s": total_r, "per_round_fastest": fastest_r,
                 "per_rank_step_ms": solo_steps or []},
        "horovod": horovod,
        "hvdhetero": ours,
        "engine": engine,
        "checkpoint": saving,
        "hvdhetero_vs_horovod": med(o / h for o, h in zip(ours["per_round_samples_per_s"],
                                                          horovod["per_round_samples_per_s"])),
        # The public API's cost: how much faster the bare engine ran, paired within rounds.
        "api_overhead": med(e / o - 1 for e, o in zip(engine["per_round_samples_per_s"],
                                                      ours["per_round_samples_per_s"])),
    }
    rows = [(f"solo rank {i}", s, None, None, "") for i, s in enumerate(solo)]
    rows += [("solo, sum", total, 1.0, total / fastest, ""),
             ("plain horovod", horovod["samples_per_s"], horovod["efficiency"], horovod["vs_fastest"],
              str(horovod["split"])),
             ("hvdhetero", ours["samples_per_s"], ours["efficiency"], ours["vs_fastest"],
              f"{ours['split']}, chunks {ours['micro_batches']}"),
             ("engine (no API)", engine["samples_per_s"], engine["efficiency"], engine["vs_fastest"],
              str(engine["split"]))]
    print(f"\nbenchmark: {len(solo_rounds)} ranks, last rank {args.slowdown:g}x slower, hvdhetero --sync {sync_name(args)}, global batch "
          f"{args.batch_size}, {result['config']['model']} on {args.dataset}"
          f"{'' if args.dataset == 'digits' else '-shaped random images'}, median of {args.repeats} rounds; "
          f"steps per round: solo {counts['solo']}, horovod {counts['horovod']}, hvdhetero {counts['hvdhetero']}, "
          f"engine {counts['engine']}")
    print(f"{'':16}{'samples/s':>12}{'E':>8}{'vs fastest':>12}  split")
    for name, rate, eff, vs, split in rows:
        e = f"{eff:8.3f}" if eff is not None else " " * 8
        v = f"{vs:12.3f}" if vs is not None else " " * 12
        print(f"{name:16}{rate:12,.0f}{e}{v}  {split}")
    steps = ours["per_rank_step_ms"]
    per_rank = lambda key: " / ".join(f"{r[key]:.1f}" for r in steps)  # noqa: E731
    fast = solo.index(fastest)
    if solo_steps and solo_steps[fast] and steps[fast] and ours["split"][fast]:
        # The fastest rank's forward/backward per sample alone and in hvdhetero (the same chunks;
        # their batches differ), and its whole step: what separates "alone" from the job.
        alone, mine = solo_steps[fast], steps[fast]
        print(f"fastest rank {fast}, per sample: compute {1e3 * alone['compute_ms'] / args.batch_size:.1f} us alone, "
              f"{1e3 * mine['compute_ms'] / ours['split'][fast]:.1f} us in hvdhetero; whole step "
              f"{1e3 * alone['step_ms'] / args.batch_size:.1f} us alone, "
              f"{1e3 * mine['step_ms'] / ours['split'][fast]:.1f} us in hvdhetero")
    print(f"hvdhetero median step, ms per rank: compute {per_rank('compute_ms')}, reduce (mostly waiting for "
          f"the slower rank) {per_rank('reduce_ms')}, whole step {per_rank('step_ms')}; "
          f"mean step {steps[0]['mean_step_ms']:.1f}")
    captured = (f"slower ranks' solo speed captured (combined - fastest) / (sum - fastest): hvdhetero "
                f"{ours['captured']:.0%}, plain horovod {horovod['captured']:.0%}; " if len(solo) > 1 else "")
    print(f"hvdhetero / plain horovod: {result['hvdhetero_vs_horovod']:.3f}x; {captured}hvdhetero's worst round "
          f"{ours['min_vs_fastest']:.3f}x the fastest rank alone", flush=True)
    print(f"checkpoints at the default interval: {saving['save_s'] * 1e3:,.1f} ms a save "
          f"({saving['bytes'] / 1e6:,.2f} MB) every {saving['interval_s']:,.1f} s ("
          + {"epoch": "an epoch of hvdhetero's steps, sooner than --checkpoint-minutes",
             "minutes": "--checkpoint-minutes" + ("" if args.sync == "step" else
                                                  ": local/diloco do not checkpoint every epoch")}
          [saving.get("interval_by", "minutes")]
          + f"): {saving['cost']:.2%} of training time", flush=True)
    if args.sync == "step":
        print(f"public API overhead (engine alone / hvdhetero, paired per round): {result['api_overhead']:+.2%}",
              flush=True)
    else:
        print(f"hvdhetero --sync {sync_name(args)} / step sync (engine), paired per round: "
              f"{1 / (1 + result['api_overhead']):.3f}x", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    sys.stdout.flush()
