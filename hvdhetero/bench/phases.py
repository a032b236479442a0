"""The phases `invoke bench` times (bench/throughput.py runs them in turns): each is a `step()`
that runs one global step of the same model on the same global batch, and keeps what the
report needs (its split, its steps' times, its exchanges).

  solo_step     this rank alone on the whole global batch, no communication
  horovod_step  plain Horovod: hvd.DistributedOptimizer, equal batches
  api_step      hvdhetero through the public API, as a user's script runs it
  engine_step   the same reducer and balancer driven directly (the API's overhead)
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import replace

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from hvdhetero.config import JobConfig, check_sync
from hvdhetero.rank import checkpoint, resume
from hvdhetero.policy.balancer import Balancer
from hvdhetero.rank.calibrate import calibrate
from hvdhetero.rank.host import one_hot
from hvdhetero.rank.job import Job
from hvdhetero.rank.collectives import allgather_object, allreduce_sum
from hvdhetero.rank.reducer import Reducer, broadcast_state
from hvdhetero.rank.worker import Worker, forward_backward
from hvdhetero.rank.strategy import Rounds
from hvdhetero.recipes import models


def fresh_model(args, info, device):
    torch.manual_seed(0)
    model = models.build(args.model or models.default_for(args.dataset), info).to(device.torch_device)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def sampler(dataset, seed: int):
    """draw(n): n random training samples (the benchmark measures speed, not learning)."""
    gen = torch.Generator().manual_seed(seed)
    return lambda n: torch.randint(len(dataset), (n,), generator=gen).tolist()


def solo_step(args, build, dataset, me: Worker):
    """This rank alone, no communication, on the whole global batch in its micro-batches: what
    training on this host alone would run. (At global / ranks, as this phase ran before, a
    rank's fixed per-step cost is spread over fewer samples, and "the fastest rank alone"
    looked slower than it is: at K=12, 5% slower.)"""
    model, optimizer = build()
    draw = sampler(dataset, seed=hvd.rank())
    local = args.batch_size

    def step():
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        seconds = forward_backward(model, take(dataset, draw(local), me), me)[1]
        optimizer.step()
        step.timings.append((seconds, 0.0, time.perf_counter() - started))

    step.batch, step.timings = local, []
    return step


def horovod_step(args, build, dataset, me: Worker):
    """Plain Horovod: DistributedOptimizer averaging gradients, equal batches. Where a rank
    computes on a GPU, each rank's gradients go through the CPU instead (one averaging
    allreduce of them all after the backward): Horovod's ops take CPU tensors only in a build
    without that GPU's support (ours: a CUDA rank beside a CPU or MPS one), and the
    DistributedOptimizer's per-parameter allreduces of CUDA tensors abort the process."""
    model, optimizer = build()
    staged = any(name != "cpu" for name in allgather_object(me.device.name, "bench.horovod.devices"))
    if staged:
        state = {k: v.cpu() for k, v in model.state_dict().items()}
        hvd.broadcast_parameters(state, root_rank=0)
        model.load_state_dict(state)
    else:  # the stock recipe
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    local = args.batch_size // hvd.size()
    draw = sampler(dataset, seed=100 + hvd.rank())

    def step():
        optimizer.zero_grad()
        forward_backward(model, take(dataset, draw(local), me), me)
        if staged:
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            averaged = hvd.grouped_allreduce([g.cpu() for g in grads], op=hvd.Average, name="bench.horovod.grads")
            for g, a in zip(grads, averaged):
                g.copy_(a)
        optimizer.step()

    step.split = [local] * hvd.size()
    return step


def take(dataset, indices, me: Worker):
    return tuple(t[indices].to(me.device.torch_device) for t in dataset.tensors)


EPOCH_STEPS = 96
"""Steps in an epoch of the hvdhetero phase (rounded up to whole rounds)."""


def api_step(args, build, dataset, host: dict, chunk: int | None, run_dir: str):
    """Ours, as a user's script runs it: `job.prepare` (calibrated split), then a loop of
    forward, `job.backward`, `optimizer.step()`; one call is one global step (all its chunks).
    `run_dir`: a scratch folder of this rank's (its checkpoints), which the caller removes."""
    model, optimizer = build()
    config = JobConfig(run_dir=run_dir, slowdown=args.slowdown, sync=args.sync,
                       overlap_sync=args.overlap_sync, overlap=args.overlap, compression=args.compression,
                       inner_steps=args.inner_steps,
                       micro_batch=str(chunk or 0))
    job = Job(replace(config, hosts=args.hosts), pin=args.pin)
    job.records.report_progress = False  # the benchmark prints its own table
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
        while True:  # each pass over the loader outside job.epochs is the next epoch
            yield from loader

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
        step.split = job.balancer.split
        step.timings.append((*job.last_step_seconds, time.perf_counter() - started))
        if isinstance(job.strategy, Rounds) and job.strategy.between_rounds:  # this step ended a round
            sync = job.strategy.sync
            step.exchanges.append([round(sync.last_exchange_s, 4), round(sync.wait_s, 4), sync.link_late])

    step.balancer, step.split, step.timings = job.balancer, job.balancer.split, []
    step.job, step.epoch_steps = job, len(loader)
    step.exchanges, step.target = [], 0
    """Per round's end in the timed steps: [seconds blocked, of which waiting for the round applied
    (its slowest rank, then the link), whether that round was still on the link]."""
    if isinstance(job.strategy, Rounds):
        step.round, step.drain = every, lambda: job.strategy.one_model(job.step)
    return step


def engine_step(args, build, dataset, me: Worker):
    """The engine alone: calibrated split, online re-balancing, one fused weighted allreduce per
    step, driven directly (what hvdhetero measured before the public API existed)."""
    model, optimizer = build()
    broadcast_state(model, [optimizer])
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
    default: with step sync an epoch (EPOCH_STEPS steps at the phase's measured step time, about
    CIFAR-10's at batch 512) or --checkpoint-minutes, whichever is shorter; with local/diloco
    --checkpoint-minutes (training does not checkpoint their epochs' ends: each would expose an
    exchange, which a save on a slow link mostly is)."""
    job, took = step.job, []
    for i in range(saves):
        hvd.barrier()
        t0 = time.perf_counter()
        resume.save_checkpoint(job.training, epoch_done=False)
        took.append(max(allreduce_sum(one_hot(time.perf_counter() - t0), f"bench.checkpoint.{i}")))
    save_s = statistics.median(took)
    epoch_s = step.epoch_steps * step_s if job.strategy.always_one_model else math.inf
    interval_s = min(epoch_s, job.config.checkpoint_minutes * 60 or math.inf)
    return {"save_s": save_s, "interval_s": interval_s, "cost": save_s / (save_s + interval_s),
            "interval_by": "epoch" if interval_s == epoch_s else "minutes",
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
