"""`job.evaluate`: a function over a dataset, every rank on a disjoint part sized by its speed,
the sums over all ranks returned to every rank; and the replicas' digest the run's end records."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable

import horovod.torch as hvd
import torch

from hvdhetero.rank import averaging, batches
from hvdhetero.rank import collectives
from hvdhetero.rank.sampler import WeightedBatchSampler, proportional_split


@torch.no_grad()
def evaluate(fn: Callable, dataset, batch_size: int, collate_fn: Callable | None, exchange: bool, *, strategy,
             model: torch.nn.Module | None, split: list[int], step: int, device: torch.device,
             autocast: Callable) -> dict:
    """Job.evaluate's work (its docstring says what a script gets): `model` the prepared one (None
    before prepare), each rank's part of `dataset` in proportion to `split`, `strategy` makes or
    lends the one model evaluated."""
    if model is not None and not exchange and not strategy.always_one_model:
        borrowed = strategy.global_model()
    else:
        strategy.one_model(step)
        if model is not None:
            averaging.buffers(model)
        borrowed = contextlib.nullcontext()
    shares = proportional_split(batch_size * len(split), split)
    sampler = WeightedBatchSampler(len(dataset), shares, hvd.rank(), shuffle=False)
    sums: dict[str, float] = {}
    with borrowed, eval_mode(model):
        for indices in sampler:
            if indices:
                batch = batches.to_device(batches.collate(dataset, indices, collate_fn), device)
                with autocast():
                    for k, v in fn(batch).items():
                        sums[k] = sums.get(k, 0.0) + float(v)
    names = sorted(set().union(*collectives.allgather_object(sorted(sums), "hvdhetero.eval_names", "job.evaluate()")))
    return dict(zip(names, collectives.allreduce_sum([sums.get(k, 0.0) for k in names], "hvdhetero.eval")))


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module | None):
    """`model` in eval mode for the block (none: nothing), back in training mode after if it was."""
    was_training = model is not None and model.training
    if model is not None:
        model.eval()
    try:
        yield
    finally:
        if was_training:
            model.train()


def param_digest(model: torch.nn.Module) -> str:
    """sha256 of every parameter's and buffer's bytes: equal digests mean identical replicas."""
    h = hashlib.sha256()
    for name, p in model.state_dict().items():
        h.update(name.encode() + p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
