"""What `job.prepare` does before the first step, on every rank together: time the user's model
(the micro-batch and speed probes), size the first split, choose the sync mode, and write the
run's start record.

    begun = start.calibrate(config, me, model, dataset, global_batch, size, loss_fn, collate_fn)
    kind, every, overlap, inner = start.sync_mode(config, records, begun, model)
    ... the loader, optimizer and strategy are built (rank/training.py) ...
    start.record(records, config, me, precision, begun.balancer, host_names, resumed, step)

Start-up never ends a user's job for our sake: whatever the user's model raises in a probe, the
ranks agree on it (one allgather, before any other collective) and start from the equal split,
balancing from the first steps' timings instead.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import asdict, dataclass

import horovod.torch as hvd
import torch

from hvdhetero.config import JobConfig, check_sync
from hvdhetero.policy.balancer import Balancer
from hvdhetero.rank import autosync, batches, collectives
from hvdhetero.rank.calibrate import ProbeLoss, fallback_message, probe_error, split_from, timings, unchanged
from hvdhetero.rank.records import RunRecords
from hvdhetero.rank.worker import Worker, micro_batch_for


@dataclass
class Begun:
    """The calibration's outcome, the same on every rank but `me`'s chunk size."""

    balancer: Balancer
    failed: list[str]
    """Per rank: what its probe raised ("" where it ran)."""
    timed: bool
    """Whether every rank's speed was measured (else the step time is unknown until an epoch ends)."""


def calibrate(config: JobConfig, me: Worker, model: torch.nn.Module, dataset, global_batch: int, size: int,
              loss_fn: Callable | None, collate_fn: Callable | None) -> Begun:
    """Tune this rank's micro-batch, time its steps, and size the first split from every rank's
    timings (`me.micro_batch` set); the model and its RNG are left as they were. A job of one rank
    is not timed (a sweep's trial on a one-slot host: the probes were start-up time of every trial,
    and a slow host's the longest), unless `invoke plan` or --sync auto asks for its timings."""
    probe = loss_fn or ProbeLoss()
    alone = size == 1 and not config.plan_only and config.sync != "auto"  # no split to size, no plan to make
    if hvd.rank() == 0 and compiled(model) and not (alone and config.micro_batch != "auto"):
        print("hvdhetero: timing the model before training: torch.compile compiles it in these first calls, which "
              "can take minutes on a CPU (the console stays quiet meanwhile)", flush=True)
    with unchanged(model, me.device.name):
        largest = min(global_batch, me.max_batch or global_batch)
        big = min(global_batch, len(dataset))
        measured, error = None, ""
        # the chunk size if tuning it fails: the setting's, else whole shares
        me.micro_batch = (int(config.micro_batch) or None) if config.micro_batch.isdigit() else None
        try:  # the user's model on the user's batches: whatever it raises, the job goes on
            me.micro_batch = micro_batch_for(config.micro_batch, model, dataset, me, largest, probe, collate_fn)
            if not (config.equal_split or alone):
                measured = timings(model, dataset, me, max(1, big // 4), big, probe, collate_fn)
        except Exception as err:  # noqa: BLE001 - any error of the user's model in a probe
            measured, error = None, probe_error(err)
        failed = collectives.allgather_object(error, "hvdhetero.probe", "the start-up")
        caps = collectives.allgather_object(me.max_batch, "hvdhetero.caps", "the start-up")
        balancer = Balancer(global_batch, size, caps=caps, merges=config.inner_steps == "by-speed",
                            minimum=batches.fewest_samples(model))
        if measured is not None and not any(failed):
            split_from(balancer, model, dataset, me, *measured, loss_fn=probe, collate_fn=collate_fn)
    if any(failed) and hvd.rank() == 0 and not (alone or config.plan_only):  # no split to start from (plan: refused)
        print(fallback_message(failed, loss_fn), flush=True)
    return Begun(balancer, failed, timed=measured is not None and not any(failed))


def compiled(model: torch.nn.Module) -> bool:
    """Whether `model` is torch.compile's (the probes' first calls compile it), or holds one."""
    return any(type(m).__name__ == "OptimizedModule" for m in model.modules())


def sync_mode(config: JobConfig, records: RunRecords, begun: Begun, model: torch.nn.Module,
              step_only: str = "") -> tuple[str, int, bool, str]:
    """(kind, H, overlapped, inner steps): the --sync setting's, or with --sync auto (and in
    `invoke plan`) what the plan advises for these ranks (rank/autosync.py; `step_only`: why
    local/diloco cannot run, the plan then weighing step sync alone). The balancer is set for
    the rounds the mode has."""
    balancer = begun.balancer
    kind, every = check_sync(config.sync)
    overlap, inner = config.overlap_sync, config.inner_steps
    if config.plan_only or kind == "auto":
        kind, every, overlap, inner = autosync.choose(config, records, balancer, model,
                                                      probe_failed=any(begun.failed), step_only=step_only)
        if inner == "by-speed":  # the split balanced for merged steps, as the plan predicted it
            balancer.merges, balancer.merge_limit = True, every
            balancer.calibrate(balancer.overhead, balancer.seconds_per_sample)
    if kind != "step":
        # The balancer hears once a round, a mean of H steps: it may decide at every hearing
        # (at its default of every 5th, a K=12 job at H=4 spent 60 steps unbalanced).
        balancer.interval = 1
        # ...and each hearing is the mean of H steps: the steps a settled split needs before a
        # small, sustained imbalance is corrected count as rounds (20 rounds of 32 steps held a
        # 12x-slower rank 9% behind for the whole benchmark).
        balancer.settle = max(3, -(-balancer.settle // every))
        balancer.trial_steps = 3  # a trial's rounds, each the mean of H steps
        if inner == "by-speed":
            balancer.merge_limit = every
    return kind, every, overlap, inner


def record(records: RunRecords, config: JobConfig, me: Worker, precision, balancer: Balancer,
           host_names: list[str], resumed: str | None, step: int) -> list[float]:
    """The run's "start" record (every rank's host, device, speed setting, chunk and precision)
    and the first split's; the precision's note printed by each rank it applies to. Returns every
    rank's slowdown (an experiment's straggler: --slowdown, the inventory's `slowdown:`)."""
    gathered = {k: collectives.allgather_object(v, f"hvdhetero.start.{k}", "the start-up") for k, v in {
        "hostnames": socket.gethostname(), "devices": me.device.describe(),
        "slowdowns": me.slowdown, "micro_batches": me.micro_batch,
        "precision": precision.note or str(precision.dtype or "float32")}.items()}
    records.write("start", config=asdict(config), ranks=len(host_names), **gathered, host_names=host_names,
                  **({"resumed_from": resumed, "step": step} if resumed else {}),
                  overhead_s=balancer.overhead, seconds_per_sample=balancer.seconds_per_sample)
    records.write("split", epoch=0, step=0, split=balancer.split, reason=balancer.reason,
                  fallback=balancer.fallback)
    notes: dict[str, list[int]] = {}  # one line a note, its ranks named (two CPU ranks said the same line twice)
    for rank, said in enumerate(gathered["precision"]):
        if precision.note_of(said):
            notes.setdefault(said, []).append(rank)
    for said, ranks in notes.items() if records.is_main else ():
        print(f"hvdhetero: rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {said}", flush=True)
    return list(gathered["slowdowns"])
