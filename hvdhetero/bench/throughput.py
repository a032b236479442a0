"""Benchmark, in one horovodrun job: each rank alone, plain Horovod, and hvdhetero.

    invoke bench --slowdown 3 --out bench.json

Same model, same global batch, same straggler (the last rank acts `slowdown` times slower by
sleeping, so no CPU is taken from the other rank). Three phases, each warmed up and then
timed over several repeats (medians):

  solo       every rank trains alone, no communication, on the whole global batch: T_i
  horovod    hvd.DistributedOptimizer, equal local batches (plain data parallelism)
  hvdhetero  a training loop on the public API (job.prepare / job.backward / optimizer.step),
             as a user's script runs it: balanced split, overlapped weighted reduction
  engine     the same reducer and balancer driven directly (no API): the API's overhead is
             hvdhetero against engine, paired within rounds

Efficiency E = combined samples/s / sum(T_i), the physical limit being 1; `vs_fastest` =
combined / max(T_i). Rank 0 prints the table and writes it as JSON. The phases are in
bench/phases.py, the table and JSON in bench/summary.py; here, the job and how it times them.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time

import horovod.torch as hvd

from hvdhetero.bench.phases import api_step, checkpoint_cost, engine_step, fresh_model, horovod_step, solo_step, \
    where_time_goes
from hvdhetero.bench.summary import report
from hvdhetero.rank import devices
from hvdhetero.rank import host as rank_host
from hvdhetero.rank.host import one_hot
from hvdhetero.rank.collectives import allgather_object, allreduce_sum
from hvdhetero.rank.worker import Worker, micro_batch_for
from hvdhetero.recipes import data


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m hvdhetero.bench.throughput", description=__doc__.split("\n")[0])
    parser.add_argument("--slowdown", type=float, default=1.0, help="the last rank is this many times slower")
    parser.add_argument("--dataset", default="digits", help="digits (in memory), or mnist or cifar10 as random "
                        "images of their shape (synthetic: no files)")
    parser.add_argument("--model", default="", help="cnn or resnet18; empty: the dataset's own")
    parser.add_argument("--batch-size", type=int, default=2048, help="global batch")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per phase and repeat (at least)")
    parser.add_argument("--min-seconds", type=float, default=6.0,
                        help="a phase whose steps are quick takes more of them, to be timed over at least this "
                             "long in each repeat (a 1-second window on a shared VM is mostly noise)")
    parser.add_argument("--repeats", type=int, default=5, help="rounds of all phases; medians are reported")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps of each phase before the first round")
    parser.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                        help="hvdhetero reduces gradient buckets while backward runs")
    parser.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                        help="give each CPU rank its own cores (as training does)")
    parser.add_argument("--sync", default="step", help="the hvdhetero phase's sync mode: step, local:H or diloco:H "
                        "(the engine phase always reduces every step)")
    parser.add_argument("--compression", default="none", choices=("none", "fp16"),
                        help="the hvdhetero phase's gradients or exchange on the wire")
    parser.add_argument("--inner-steps", default="same", choices=("same", "by-speed"),
                        help="local/diloco: a slower rank takes fewer, bigger inner steps (by-speed)")
    parser.add_argument("--overlap-sync", action="store_true",
                        help="local/diloco: exchange in the background, applied one round late")
    parser.add_argument("--micro-batch", default="auto",
                        help="chunk size of solo and hvdhetero steps: auto (timed per rank), 0 (whole batch) "
                             "or N; plain Horovod always runs its whole batch (hvd.DistributedOptimizer "
                             "reduces after every backward)")
    parser.add_argument("--out", default="", help="write the results here as JSON")
    parser.add_argument("--hosts-json", default="{}", help="per-host settings (from the launcher)")
    args = parser.parse_args(argv)
    args.hosts = json.loads(args.hosts_json)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    host = rank_host.settings(args.hosts)
    rank_host.join(host, pin=args.pin)
    # The hvdhetero phase's run folder: its checkpoints (the checkpoint cost's), gone at the end
    # (each run left ~130 MB in /tmp).
    scratch = tempfile.TemporaryDirectory(prefix="hvdhetero-bench-", ignore_cleanup_errors=True)
    try:
        device = devices.select(rank_host.rank_device(host), hvd.local_rank(), hvd.local_size())  # cuda,cpu: per slot
        me = Worker(device=device, slowdown=args.slowdown if hvd.rank() == hvd.size() - 1 else 1.0, max_batch=None)
        train_set, info = bench_data(args.dataset, args.batch_size)
        build = lambda: fresh_model(args, info, device)  # noqa: E731 - same start for every phase
        # One chunk size for this rank's solo and hvdhetero phases, timed on a scratch model up
        # to the whole global batch (the share this rank may get).
        chunk = micro_batch_for(args.micro_batch, build()[0], train_set, me, args.batch_size)
        # Each phase straggles from its own recent steps (a Worker apiece): phases differ in
        # chunking and batch, so one phase's per-sample compute is not another's.
        phases = {"solo": solo_step(args, build, train_set, me.fresh(micro_batch=chunk)),
                  "horovod": horovod_step(args, build, train_set, me.fresh()),
                  "hvdhetero": api_step(args, build, train_set, host, chunk, scratch.name),
                  "engine": engine_step(args, build, train_set, me.fresh(micro_batch=chunk))}
        chunks = allgather_object(chunk, "bench.micro_batches")
        seconds, counts = measure(args, phases)
        saving = checkpoint_cost(phases["hvdhetero"], statistics.median(seconds["hvdhetero"]))
        # Every rank's solo rate in every round, on every rank.
        mine = [phases["solo"].batch / s for s in seconds["solo"]]
        flat = allreduce_sum([v for r in range(hvd.size()) for v in (mine if r == hvd.rank() else [0.0] * len(mine))],
                             "bench.solo")
        solo = [flat[r * len(mine):(r + 1) * len(mine)] for r in range(hvd.size())]
        solo_steps = allgather_object(where_time_goes(phases["solo"].timings), "bench.where.solo")
        horovod = {"per_round_samples_per_s": [args.batch_size / s for s in seconds["horovod"]],
                   "split": phases["horovod"].split}
        ours, engine = ({"per_round_samples_per_s": [args.batch_size / s for s in seconds[name]],
                         "split": phases[name].split,
                         "splits": [split for _, split in phases[name].balancer.history], "micro_batches": chunks,
                         "per_rank_step_ms": allgather_object(where_time_goes(phases[name].timings),
                                                              f"bench.where.{name}"),
                         "per_rank_exchanges": allgather_object(getattr(phases[name], "exchanges", []),
                                                                f"bench.exchanges.{name}")}
                        for name in ("hvdhetero", "engine"))
        if hvd.rank() == 0:
            report(args, solo, horovod, ours, engine, counts, saving, solo_steps)
    finally:
        try:
            hvd.shutdown()
        finally:
            scratch.cleanup()


def bench_data(name: str, batch: int):
    """digits as the recipe trains it; mnist and cifar10 made up (data.synthetic), two global
    batches of them (the phases draw random batches: a step's time is all that is measured)."""
    if name == "digits":
        train_set, _, info = data.load(name, "unused")
        return train_set, info
    return data.synthetic(name, max(2 * batch, 256))


def measure(args, phases: dict) -> tuple[dict[str, list[float]], dict[str, object]]:
    """Seconds per step of each phase in every round, and the steps each phase was timed over.
    The phases take turns within a round (`phase_order`), so a drift of the machine's speed
    (other tenants, clocks) touches all of them alike, and the ratios are taken within rounds.
    A phase takes at least `steps` steps and, by its warm-up's pace, enough to last
    `min_seconds`: solo ranks each their own count (they never talk), a job's ranks the
    largest count."""
    counts = {}
    for name, step in phases.items():
        warm = []
        whole = getattr(step, "round", 1)  # local/diloco: whole rounds only (a merged step ends with one)
        rounds = -(-args.warmup // whole) + (whole > 1)  # ...and one more, to pace by (below)
        for _ in range(rounds * whole):
            t0 = time.perf_counter()
            step()
            warm.append(time.perf_counter() - t0)
        drain(step)
        if hasattr(step, "timings"):
            step.timings.clear()  # a step's breakdown is kept for timed steps only
            getattr(step, "exchanges", []).clear()
        # the pace of a step: the quickest warm-up step, or the mean of the last warm-up round (a
        # rank merging steps runs a round's work in a few calls and returns at once from the
        # others; the first round holds the first exchange's set-up and made windows short)
        pace = min(warm) if whole == 1 else sum(warm[-whole:]) / whole
        want = max(args.steps, math.ceil(args.min_seconds / pace)) if warm and pace > 0 else args.steps
        want = -(-want // whole) * whole
        counts[name] = want if name == "solo" else int(max(allreduce_sum(one_hot(want), f"bench.steps.{name}")))
    samples = {name: [] for name in phases}
    for round_ in range(args.repeats):
        for name in phase_order(list(phases), round_):
            step = phases[name]
            # local/diloco overlapped: one untimed round first, so that the window starts with an
            # exchange in flight as training does (else N rounds would hold N-1 waits).
            for _ in range(getattr(step, "round", 0) if getattr(step, "drain", None) else 0):
                step()
            hvd.barrier()  # Horovod: every rank starts a phase together
            t0 = time.perf_counter()
            for _ in range(counts[name]):
                step()
            elapsed = time.perf_counter() - t0
            # An overlapped exchange still in flight lands outside the window, as the steady
            # state of training hides it behind the next round; solo ranks never talk, so each
            # timed itself; a job is timed to its last rank.
            drain(step)
            if name != "solo":
                elapsed = max(allreduce_sum(one_hot(elapsed), f"bench.elapsed.{name}.{round_}"))
            samples[name].append(elapsed / counts[name])
    counts["solo"] = allgather_object(counts["solo"], "bench.steps.solo")
    return samples, counts


def drain(step) -> None:
    """Settle a phase between windows: with --sync local/diloco, exchange the partial round and
    apply the one in flight (every rank at once: a collective)."""
    if getattr(step, "drain", None):
        step.drain()


def phase_order(names: list[str], round_: int) -> list[str]:
    """The order of the phases in a round: the two whose ratio is the headline (solo and
    hvdhetero) run next to each other, first one then the other in turns, so that neither
    gains from its place and the VM's slow stretches (10-20 s) touch both alike; plain Horovod,
    whose steps are long at a large slowdown (8 steps x 2.7 s at K=10), runs last; the bare
    engine, whose ratio to hvdhetero is the API's overhead, right after the pair."""
    pair = ["solo", "hvdhetero"] if round_ % 2 == 0 else ["hvdhetero", "solo"]
    rest = ["engine"] + [n for n in names if n not in pair + ["engine"]]
    return [n for n in pair + rest if n in names]


























if __name__ == "__main__":
    main()
