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
combined / max(T_i). Rank 0 prints the table and writes it as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from hvdhetero.config import JobConfig, check_sync
from hvdhetero.rank import checkpoint, resume
from hvdhetero.rank import host as rank_host
from hvdhetero.rank.calibrate import calibrate
from hvdhetero.rank.host import one_hot
from hvdhetero.rank.job import Job

from hvdhetero.recipes import data
from hvdhetero.rank import devices
from hvdhetero.recipes import models
from hvdhetero.rank.balancer import Balancer
from hvdhetero.rank.reducer import Reducer, allreduce_sum, broadcast_state
from hvdhetero.rank.step import Rank, forward_backward, micro_batch_for


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m hvdhetero.bench.throughput", description=__doc__.split("\n")[0])
    parser.add_argument("--slowdown", type=float, default=1.0, help="the last rank is this many times slower")
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--model", default="")
    parser.add_argument("--batch-size", type=int, default=2048, help="global batch")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per phase and repeat (at least)")
    parser.add_argument("--min-seconds", type=float, default=6.0,
                        help="a phase whose steps are quick takes more of them, to be timed over at least this "
                             "long in each repeat (a 1-second window on a shared VM is mostly noise)")
    parser.add_argument("--repeats", type=int, default=5, help="rounds of all phases; medians are reported")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps of each phase before the first round")
    parser.add_argument("--data-dir", default="data")
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
    try:
        device = devices.select(host.get("device", "auto"), hvd.local_rank(), hvd.local_size())
        me = Rank(device=device, slowdown=args.slowdown if hvd.rank() == hvd.size() - 1 else 1.0, max_batch=None)
        train_set, _, info = data.load(args.dataset, args.data_dir)
        build = lambda: fresh_model(args, info, device)  # noqa: E731 - same start for every phase
        # One chunk size for this rank's solo and hvdhetero phases, timed on a scratch model up
        # to the whole global batch (the share this rank may get).
        chunk = micro_batch_for(args.micro_batch, build()[0], train_set, me, args.batch_size)
        # Each phase straggles from its own recent steps (a Rank apiece): phases differ in
        # chunking and batch, so one phase's per-sample compute is not another's.
        phases = {"solo": solo_step(args, build, train_set, me.fresh(micro_batch=chunk)),
                  "horovod": horovod_step(args, build, train_set, me.fresh()),
                  "hvdhetero": api_step(args, build, train_set, host, chunk),
                  "engine": engine_step(args, build, train_set, me.fresh(micro_batch=chunk))}
        chunks = hvd.allgather_object(chunk, name="bench.micro_batches")
        seconds, counts = measure(args, phases)
        saving = checkpoint_cost(phases["hvdhetero"], statistics.median(seconds["hvdhetero"]))
        # Every rank's solo rate in every round, on every rank.
        mine = [phases["solo"].batch / s for s in seconds["solo"]]
        flat = allreduce_sum([v for r in range(hvd.size()) for v in (mine if r == hvd.rank() else [0.0] * len(mine))],
                             "bench.solo")
        solo = [flat[r * len(mine):(r + 1) * len(mine)] for r in range(hvd.size())]
        horovod = {"per_round_samples_per_s": [args.batch_size / s for s in seconds["horovod"]],
                   "split": phases["horovod"].split}
        ours, engine = ({"per_round_samples_per_s": [args.batch_size / s for s in seconds[name]],
                         "split": phases[name].split,
                         "splits": [split for _, split in phases[name].balancer.history], "micro_batches": chunks,
                         "per_rank_step_ms": hvd.allgather_object(where_time_goes(phases[name].timings),
                                                                  name=f"bench.where.{name}"),
                         "per_rank_exchanges": hvd.allgather_object(getattr(phases[name], "exchanges", []),
                                                                    name=f"bench.exchanges.{name}")}
                        for name in ("hvdhetero", "engine"))
        if hvd.rank() == 0:
            report(args, solo, horovod, ours, engine, counts, saving)
    finally:
        hvd.shutdown()


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
    counts["solo"] = hvd.allgather_object(counts["solo"], name="bench.steps.solo")
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


def fresh_model(args, info, device):
    torch.manual_seed(0)
    model = models.build(args.model or models.default_for(args.dataset), info).to(device.torch_device)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def sampler(dataset, seed: int):
    """draw(n): n random training samples (the benchmark measures speed, not learning)."""
    gen = torch.Generator().manual_seed(seed)
    return lambda n: torch.randint(len(dataset), (n,), generator=gen).tolist()


def solo_step(args, build, dataset, me: Rank):
    """This rank alone, no communication, on the whole global batch in its micro-batches: what
    training on this host alone would run. (At global / ranks, as this phase ran before, a
    rank's fixed per-step cost is spread over fewer samples, and "the fastest rank alone"
    looked slower than it is: at K=12, 5% slower.)"""
    model, optimizer = build()
    draw = sampler(dataset, seed=hvd.rank())
    local = args.batch_size

    def step():
        optimizer.zero_grad(set_to_none=True)
        forward_backward(model, take(dataset, draw(local), me), me)
        optimizer.step()

    step.batch = local
    return step


def horovod_step(args, build, dataset, me: Rank):
    """Plain Horovod: DistributedOptimizer averaging gradients, equal batches."""
    model, optimizer = build()
    # Horovod: the stock recipe. Our Horovod is CPU-only, which suits the CPU ranks a
    # benchmark on this machine has.
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    local = args.batch_size // hvd.size()
    draw = sampler(dataset, seed=100 + hvd.rank())

    def step():
        optimizer.zero_grad()
        forward_backward(model, take(dataset, draw(local), me), me)
        optimizer.step()

    step.split = [local] * hvd.size()
    return step


def take(dataset, indices, me: Rank):
    return tuple(t[indices].to(me.device.torch_device) for t in dataset.tensors)


EPOCH_STEPS = 96
"""Steps in an epoch of the hvdhetero phase (rounded up to whole rounds)."""


def api_step(args, build, dataset, host: dict, chunk: int | None):
    """Ours, as a user's script runs it: `job.prepare` (calibrated split), then a loop of
    forward, `job.backward`, `optimizer.step()`; one call is one global step (all its chunks)."""
    model, optimizer = build()
    config = JobConfig(run_dir=tempfile.mkdtemp(prefix="hvdhetero-bench-"), slowdown=args.slowdown, sync=args.sync,
                       overlap_sync=args.overlap_sync, overlap=args.overlap, compression=args.compression,
                       inner_steps=args.inner_steps,
                       micro_batch=str(chunk or 0))
    job = Job(replace(config, hosts=args.hosts), pin=args.pin)
    job.report_progress = False  # the benchmark prints its own table
    # The API deals each epoch out once: a dataset of whole global batches, so that every step
    # is a whole one (a short last step credited as a whole made hvdhetero look 11% faster than
    # the bare engine, at E 1.07), and of whole rounds (with --sync local/diloco the epoch's end
    # exchanges its partial round at once, as training does): about 100 steps an epoch, like
    # CIFAR-10 at a global batch of 512, so the epoch's flush costs what it costs there.
    every = check_sync(args.sync)[1]
    length = -(-EPOCH_STEPS // every) * every * args.batch_size
    times = -(-length // len(dataset))
    data = TensorDataset(*(t.repeat(times, *[1] * (t.dim() - 1))[:length] for t in dataset.tensors))
    model, optimizer, loader = job.prepare(model, optimizer, data, global_batch=args.batch_size,
                                           loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]))

    def batches():
        while True:
            yield from loader
            job.epoch += 1

    it = batches()

    def step():
        # One global step of the job a call; a rank that merges steps (--inner-steps by-speed)
        # runs its merged step at the call that reaches it and nothing at the calls it covers.
        step.target += 1
        started = time.perf_counter()
        if job.step >= step.target:
            return
        while job.step < step.target:
            x, y = next(it)
            loss = F.cross_entropy(model(x), y)
            job.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        step.split = job._prepared.balancer.split
        step.timings.append((*job.last_step_seconds, time.perf_counter() - started))
        if job._sync is not None and job._sync.round_steps == 0:  # this step ended a round
            step.exchanges.append([round(job._sync.last_exchange_s, 4), round(job._sync.wait_s, 4),
                                   job._sync.link_late])

    step.balancer, step.split, step.timings = job._prepared.balancer, job._prepared.balancer.split, []
    step.job, step.epoch_steps = job, len(loader)
    step.exchanges, step.target = [], 0
    """Per round's end in the timed steps: [seconds blocked, of which waiting for the round applied
    (its slowest rank, then the link), whether that round was still on the link]."""
    if job._sync is not None:
        step.round, step.drain = every, job._one_model
    return step


def engine_step(args, build, dataset, me: Rank):
    """The engine alone: calibrated split, online re-balancing, one fused weighted allreduce per
    step, driven directly (what hvdhetero measured before the public API existed)."""
    model, optimizer = build()
    broadcast_state(model, optimizer)
    reducer = Reducer(model.parameters(), overlap=args.overlap)
    balancer = Balancer(args.batch_size, hvd.size())
    small = max(1, args.batch_size // (4 * hvd.size()))
    calibrate(balancer, model, dataset, me, small=small, big=max(small + 1, args.batch_size // hvd.size()))
    draw, steps = sampler(dataset, seed=200 + hvd.rank()), [0]

    def step():
        started = time.perf_counter()
        sizes = list(balancer.split)
        n = sizes[hvd.rank()]
        optimizer.zero_grad(set_to_none=True)
        arm = (lambda: reducer.prepare(n / args.batch_size)) if args.overlap else None
        seconds = forward_backward(model, take(dataset, draw(n), me), me, arm)[1]
        t0 = time.perf_counter()
        times = reducer.reduce(n / args.batch_size, extras=one_hot(seconds))
        reduced = time.perf_counter() - t0
        optimizer.step()
        balancer.observe(times, sizes, steps[0])
        steps[0] += 1
        step.split = balancer.split
        step.timings.append((seconds, reduced, time.perf_counter() - started))

    step.balancer, step.split, step.timings = balancer, balancer.split, []
    return step


def checkpoint_cost(step, step_s: float, saves: int = 3) -> dict:
    """What checkpointing costs the hvdhetero phase at the default interval: a few checkpoints
    saved as training saves them (every rank takes part; with local/diloco the ranks first agree
    on one model), the slowest rank's median time, against the time between two checkpoints by
    default: an epoch (EPOCH_STEPS steps at the phase's measured step time, about CIFAR-10's at
    batch 512) or --checkpoint-minutes, whichever is shorter."""
    job, took = step.job, []
    for i in range(saves):
        hvd.barrier()
        t0 = time.perf_counter()
        resume.save_checkpoint(job, epoch_done=False)
        took.append(max(allreduce_sum(one_hot(time.perf_counter() - t0), f"bench.checkpoint.{i}")))
    save_s = statistics.median(took)
    interval_s = min(step.epoch_steps * step_s, job.config.checkpoint_minutes * 60 or math.inf)
    return {"save_s": save_s, "interval_s": interval_s, "cost": save_s / (save_s + interval_s),
            "bytes": max((f.stat().st_size for f in checkpoint.listed(job.run_dir)), default=0)}


def where_time_goes(timings: list[tuple[float, float, float]]) -> dict:
    """This rank's median step: compute (forward/backward, straggling included), the reduce
    (mostly waiting for the slowest rank when the split is off) and the whole step; its mean
    step (what the rate sees: a few slow steps count in full); and every step's three times."""
    if not timings:
        return {}
    compute, reduce, whole = zip(*timings)
    return {"compute_ms": 1e3 * statistics.median(compute), "reduce_ms": 1e3 * statistics.median(reduce),
            "step_ms": 1e3 * statistics.median(whole), "mean_step_ms": 1e3 * statistics.fmean(whole),
            "steps_ms": [[round(1e3 * t, 2) for t in step] for step in timings]}


def sync_name(args) -> str:
    wire = ", fp16 wire" if args.compression != "none" else ""
    return args.sync + (" overlapped" if args.overlap_sync else "") + (" by-speed" if args.inner_steps != "same" else "") + wire


def report(args, solo_rounds: list[list[float]], horovod: dict, ours: dict, engine: dict, counts: dict,
           saving: dict) -> None:
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
        job["captured"] = med((rates[r] - fastest_r[r]) / (total_r[r] - fastest_r[r]) for r in rounds)
    result = {
        "config": {"ranks": hvd.size(), "slowdown": args.slowdown, "sync": args.sync, "overlap_sync": args.overlap_sync,
                   "inner_steps": args.inner_steps,
                   "compression": args.compression, "dataset": args.dataset,
                   "model": args.model or models.default_for(args.dataset), "global_batch": args.batch_size,
                   "steps": args.steps, "min_seconds": args.min_seconds, "repeats": args.repeats,
                   "warmup": args.warmup, "timed_steps": counts},
        "solo": {"samples_per_s": total, "per_rank_samples_per_s": solo, "fastest": fastest,
                 "per_round_samples_per_s": total_r, "per_round_fastest": fastest_r},
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
    print(f"\nbenchmark: {hvd.size()} ranks, last rank {args.slowdown:g}x slower, hvdhetero --sync {sync_name(args)}, global batch "
          f"{args.batch_size}, {result['config']['model']} on {args.dataset}, median of {args.repeats} rounds; "
          f"steps per round: solo {counts['solo']}, horovod {counts['horovod']}, hvdhetero {counts['hvdhetero']}, "
          f"engine {counts['engine']}")
    print(f"{'':16}{'samples/s':>12}{'E':>8}{'vs fastest':>12}  split")
    for name, rate, eff, vs, split in rows:
        e = f"{eff:8.3f}" if eff is not None else " " * 8
        v = f"{vs:12.3f}" if vs is not None else " " * 12
        print(f"{name:16}{rate:12,.0f}{e}{v}  {split}")
    steps = ours["per_rank_step_ms"]
    per_rank = lambda key: " / ".join(f"{r[key]:.1f}" for r in steps)  # noqa: E731
    print(f"hvdhetero median step, ms per rank: compute {per_rank('compute_ms')}, reduce (mostly waiting for "
          f"the slower rank) {per_rank('reduce_ms')}, whole step {per_rank('step_ms')}; "
          f"mean step {steps[0]['mean_step_ms']:.1f}")
    print(f"hvdhetero / plain horovod: {result['hvdhetero_vs_horovod']:.3f}x; slower ranks' solo speed captured "
          f"(combined - fastest) / (sum - fastest): hvdhetero {ours['captured']:.0%}, plain horovod "
          f"{horovod['captured']:.0%}; hvdhetero's worst round {ours['min_vs_fastest']:.3f}x the fastest rank alone",
          flush=True)
    print(f"checkpoints at the default interval: {saving['save_s'] * 1e3:,.1f} ms a save "
          f"({saving['bytes'] / 1e6:,.2f} MB) every {saving['interval_s']:,.1f} s (an epoch of hvdhetero's "
          f"steps, or --checkpoint-minutes if sooner): {saving['cost']:.2%} of training time", flush=True)
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


if __name__ == "__main__":
    main()
