"""What `job.prepare` takes and what it refuses, each with the fix, before anything is broadcast
or timed."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler

from hvdhetero.errors import ConfigError


def data_arguments(data, global_batch: int | None, collate_fn: Callable | None,
                   num_workers: int | None) -> tuple[object, int, Callable | None, int]:
    """(dataset, global_batch, collate_fn, num_workers) from what job.prepare was given: a dataset
    with global_batch=, or the script's own training DataLoader (as accelerate's prepare takes one),
    whose dataset, batch_size (the global batch: what one device took a step), collate_fn and
    num_workers are taken; what is passed as well wins. Its order is hvdhetero's: every sample
    once an epoch, shuffled by --seed, shares by the ranks' speeds."""
    if not isinstance(data, DataLoader):
        if global_batch is None:
            raise ConfigError("job.prepare(model, optimizer, dataset): pass global_batch=, the samples of one "
                              "step on all ranks together (or pass your training DataLoader: its batch_size is taken)")
        return data, global_batch, collate_fn, num_workers or 0
    if isinstance(data.dataset, IterableDataset):
        return data.dataset, global_batch or 0, collate_fn, num_workers or 0  # prepare_arguments says what is wrong
    own = data.batch_sampler if data.batch_size is None else data.sampler
    if data.batch_size is None or not isinstance(own, (RandomSampler, SequentialSampler)) or (
            isinstance(own, RandomSampler) and (own.replacement or own._num_samples is not None)):
        what = "RandomSampler with replacement or num_samples" if isinstance(own, RandomSampler) else type(own).__name__
        raise ConfigError(f"job.prepare(): the DataLoader draws its batches with a {what} of its own, "
                          "which two ranks cannot share: hvdhetero deals each rank its part of every global batch "
                          "(every sample once an epoch, shuffled); pass its dataset and global_batch= instead "
                          "(job.prepare(model, optimizer, loader.dataset, global_batch=...))")
    if collate_fn is None and data.collate_fn is not torch.utils.data.default_collate:
        collate_fn = data.collate_fn
    return (data.dataset, global_batch if global_batch is not None else data.batch_size, collate_fn,
            num_workers if num_workers is not None else data.num_workers)


def prepare_arguments(model, optimizer, dataset, global_batch, device: torch.device, ranks: int) -> None:
    """Refuse, with the fix, what would go wrong later or silently."""
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"job.prepare(model, ...): expected a torch.nn.Module, got {type(model).__name__}")
    elsewhere = {str(p.device) for p in model.parameters()
                 if (p.device.type, p.device.index or 0) != (device.type, device.index or 0)}
    if elsewhere:
        raise ConfigError(f"job.prepare(): the model has parameters on {', '.join(sorted(elsewhere))}, but this "
                          f"rank computes on {device}: call model.to(job.device) before prepare()")
    mine = {id(p) for p in model.parameters()}
    foreign = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in mine)
    if foreign:
        raise ConfigError(f"job.prepare(): the optimizer holds {foreign} parameter(s) that are not the model's: "
                          "build it from model.parameters() after model.to(job.device)")
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__getitem__") \
            or not hasattr(dataset, "__len__"):
        raise ConfigError(f"job.prepare(): the dataset must be map-style (__len__ and __getitem__), got "
                          f"{type(dataset).__name__}: the balancer deals each rank its share by index")
    if not isinstance(global_batch, int) or global_batch < ranks:
        raise ConfigError(f"job.prepare(global_batch={global_batch!r}): must be an integer of at least the "
                          f"number of ranks ({ranks}), so that every rank gets a sample")
    if global_batch > len(dataset):
        raise ConfigError(f"job.prepare(global_batch={global_batch}): the dataset holds only {len(dataset)} "
                          "samples; lower global_batch or use a larger dataset")
