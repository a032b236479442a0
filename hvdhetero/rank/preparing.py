"""What `job.prepare` wires together, in this order: the arguments checked (rank/validate.py),
a batch function's stream shared, lazy modules shaped, rank 0's model and optimizer state on
every rank, the speed probes and the first split (rank/start.py), the sync mode, the step's
parts (rank/training.py: loader, reducer, strategy, optimizer), torch's own clipping, EMA,
zero_grad and schedulers taken over for the step (clipping, averaging, zeroing, scheduling),
every rank but rank 0 on a random stream of its own, then an elastic rejoin or --resume, and the
run's start record. Job.prepare (rank/job.py)
says what a script passes and gets back.
"""

from __future__ import annotations

import dataclasses

import torch

from hvdhetero.rank import (averaging, calibrate, clipping, current, elastic, resume, scheduling, start, validate,
                            zeroing)
from hvdhetero.rank.batch_function import BatchFunction
from hvdhetero.rank.reducer import Reducer, broadcast_state, sparse_params
from hvdhetero.rank.training import Training


def prepare(job, model, optimizer, dataset, *, global_batch, collate_fn, num_workers, loss_fn, scheduler,
            batch_dim, tracked):
    """job.prepare's work (module docstring): sets job.training and job.strategy, returns (model,
    optimizer or optimizers as passed, loader). `tracked`: the job's Registry (job.track's parts)."""
    parts = validate.parts_arguments(model, optimizer, scheduler)
    cfg = job.config
    if parts.several:
        validate.several_optimizers(cfg)
    data = validate.data_arguments(dataset, global_batch, collate_fn, num_workers, batch_dim)
    if isinstance(data.dataset, BatchFunction):  # a get_batch of the script's: rank 0's stream, a first draw
        data = data.dataset.shared(data, job.size, job.is_main)
    model = parts.model
    validate.prepare_arguments(model, parts.optimizers, data.dataset, data.global_batch, job.device, job.size)
    calibrate.materialize(model, data.dataset, job.device, data.collate_fn, loss_fn)  # lazy modules shaped
    broadcast_state(model, parts.optimizers)
    scheduling.install()  # before Training wraps a `scheduler=`: what it steps in turn is torch's
    reducer = Reducer(model.parameters(), cfg.compression, overlap=cfg.overlap, sparse=sparse_params(model))
    # several optimizers (a GAN's): each rank's share in one piece, step sync (validate.several_optimizers)
    timed_as = dataclasses.replace(cfg, micro_batch="0", sync="step") if parts.several else cfg
    if validate.closure_optimizers(cfg, parts.optimizers):  # LBFGS: the share in one piece
        timed_as = dataclasses.replace(timed_as, micro_batch="0")
    if loss_fn is None and isinstance(parts.given[0], (tuple, list)) and len(parts.given[0]) > 1:
        loss_fn = calibrate.SeveralModels(len(parts.given[0]))
    begun = start.calibrate(timed_as, job.me, model, data.dataset, data.global_batch, job.size, loss_fn,
                            data.collate_fn)
    mode = start.sync_mode(timed_as, job.records, begun, model,
                           step_only=f"{len(parts.optimizers)} optimizers: {validate.SEVERAL_STEP_ONLY}"
                           if parts.several else "")
    t = job.training = Training(cfg, job.me, job.records, job.train_state, job.step_state, job.loss_scale,
                                model=model, optimizers=parts.optimizers, reducer=reducer, data=data,
                                begun=begun, mode=mode, schedulers=parts.schedulers, tracked=tracked,
                                device=job.device)
    job.strategy = t.strategy
    job.autocasts.first_forward(  # --precision where no autocast is: said, and recorded
        model, job.precision, job.is_main, lambda: job.records.write("precision", step=job.train_state.step,
                                                                   autocast=False, trained="float32"))
    clipping.take_over(job.clip_grad_norm_, t.reducer.params, t.flush)  # torch's, over the whole model, is ours
    averaging.take_over(job.step_state)  # torch's AveragedModel (an EMA) averages once a step
    zeroing.take_over(job.step_state, t.reducer.params)  # and model.zero_grad() zeroes once a step
    scheduling.take_over(job.step_state, [*parts.schedulers, *tracked.parts.values()],  # so do LR schedulers
                         given=parts.schedulers)
    own_stream(job.rank)  # before a resume, which sets each rank's saved states
    # --elastic after a reset (or joining): the last commit, from memory; else --resume's checkpoint
    resumed = elastic.rejoin(t) if t.elastic else None
    if resumed is None and cfg.resume:
        resumed = resume.resume_from_disk(t)
    t.schedule.retime(begun.balancer.step_time(begun.balancer.split) if begun.timed else 0.0)
    t.slowdowns = start.record(job.records, cfg, job.me, job.precision, begun.balancer, t.host_names, resumed,
                               job.train_state.step)
    if t.elastic:
        elastic.commit(t, check_hosts=False)
    given_model, given_optimizer = parts.given
    if isinstance(given_optimizer, (tuple, list)):  # as passed: a tuple (optG, optD) comes back as one
        return given_model, (list if isinstance(given_optimizer, list) else tuple)(t.optimizers), t.batches
    return given_model, t.optimizer, t.batches


def own_stream(rank: int) -> None:
    """From job.prepare on, every rank but rank 0 draws from torch's generators (the CPU's and the
    device's) on a stream of its own, seeded from the one the script's torch stood on and the rank:
    what a loop draws (a GAN's noise, dropout's masks, an augmentation in the loader's process, an
    RL rollout's actions) differs by rank as it would across one device's batch, instead of every
    rank repeating rank 0's draws (a GAN's second rank fed the discriminator the same noise).
    Rank 0 goes on as one device would; until prepare every rank draws alike (a random_split, the
    model's initial weights). NumPy's and Python's generators are the script's own."""
    if rank:
        current.rank_seed = (torch.initial_seed() * 1_000_003 + rank * 7_919) % (2 ** 63)
        torch.manual_seed(current.rank_seed)
