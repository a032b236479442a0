"""What `job.prepare` takes and what it refuses, each with the fix, before anything is broadcast
or timed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import (BatchSampler, DataLoader, DistributedSampler, IterableDataset, RandomSampler,
                              SequentialSampler, SubsetRandomSampler, WeightedRandomSampler)

from hvdhetero.config import check_sync
from hvdhetero.errors import ConfigError
from hvdhetero.rank.batch_function import BatchFunction
from hvdhetero.rank.own_sampler import OwnDraw
from hvdhetero.rank.sampler import ENDLESS, Draw


@dataclass(frozen=True)
class Data:
    """What job.prepare trains on."""

    dataset: Any
    global_batch: int
    """Samples of one step on all ranks together."""
    collate_fn: Callable | None = None
    num_workers: int = 0
    worker_init_fn: Callable | None = None
    shuffle: bool = True
    """Every epoch in a new order (--seed's); False: the dataset's order, dealt by speed."""
    draw: Draw | None = None
    """The DataLoader's own way to draw an epoch (WeightedRandomSampler, ...), drawn alike on every rank."""
    drop_last: bool = False
    """An epoch's short last step is left out."""
    persistent_workers: bool = False
    """The workers live on from epoch to epoch (a Mac spawns each, which runs the script's top level again)."""
    prefetch_factor: int | None = None
    """Chunks each worker collates ahead (torch's default, 2, where None)."""
    own: OwnDraw | None = None
    """The DataLoader's sampler or batch_sampler of the script's own, drawn alike on every rank each epoch."""


def data_arguments(data, global_batch: int | None, collate_fn: Callable | None, num_workers: int | None,
                   batch_dim: int | None = None) -> Data:
    """What job.prepare was given: a dataset with global_batch=, or the script's training
    DataLoader (as accelerate's prepare takes one), whose dataset, batch_size (the global batch:
    what one device took a step), shuffle, drop_last, collate_fn, num_workers, worker_init_fn,
    persistent_workers and prefetch_factor are kept; what is passed as well wins. Its sampler's
    way to draw an epoch is kept too where torch's own samplers say it (`draw`); another sampler
    of its own (a DistributedSampler, a class of the script's) cannot be shared by ranks that are
    dealt their parts of every global batch by index: refused, saying so. A function that returns
    one step's whole batch (nanoGPT's get_batch) is drawn from once a step on every rank
    (rank/batch_function.py); `batch_dim`, the dimension its samples lie along, is for such a
    function alone (a DataLoader's collate_fn lays out its batches itself)."""
    if isinstance(data, (tuple, list)) and len(data) > 1 and all(isinstance(d, DataLoader) for d in data):
        raise ConfigError(f"job.prepare(model, optimizer, ({', '.join('DataLoader' for _ in data)})): one data source "
                          "a job. Loaders drawn together in each step (a labelled and an unlabelled set, FixMatch's) "
                          "go in one batch function that returns a batch of each, a larger one laid out [batch, k, "
                          "...], so that every rank takes its share of both (docs/api.md, 'Two data sources in one "
                          "step')")
    function = callable(data) and not isinstance(data, DataLoader) and not hasattr(data, "__getitem__")
    if batch_dim is not None and (type(batch_dim) is not int or batch_dim < 0 or (batch_dim and not function)):
        raise ConfigError(f"job.prepare(..., batch_dim={batch_dim!r}): " + (
            "batch_dim is the dimension of the samples in what a batch function returns (0, or 1 for "
            "[sequence, batch] windows); a dataset or DataLoader is dealt by sample, its collate_fn laying out "
            "each rank's batch: leave batch_dim out" if not function or type(batch_dim) is int and batch_dim > 0
            else "give a dimension, 0 or more (1 for [sequence, batch] windows)"))
    if function:
        given = [name for name, value in (("global_batch", global_batch), ("collate_fn", collate_fn),
                                          ("num_workers", num_workers)) if value]
        if given:
            raise ConfigError(f"job.prepare(model, optimizer, fn, {given[0]}=...): a batch function returns one "
                              "step's whole batch itself (its rows are the global batch) on this process; leave "
                              f"{' and '.join(given)} out")
        source = BatchFunction(data, batch_dim or 0)
        return Data(source, 0, source.collate, shuffle=False)
    if not isinstance(data, DataLoader):
        if global_batch is None:
            raise ConfigError("job.prepare(model, optimizer, dataset): pass global_batch=, the samples of one "
                              "step on all ranks together (or pass your training DataLoader: its batch_size is taken)")
        return Data(data, global_batch, collate_fn, num_workers or 0)
    if isinstance(data.dataset, IterableDataset):  # prepare_arguments says what is wrong
        return Data(data.dataset, global_batch or 0, collate_fn, num_workers or 0)
    batches = data.batch_sampler
    if batches is None:
        raise ConfigError("job.prepare(): the DataLoader has batch_size=None (each item of its dataset is a whole "
                          "batch), but hvdhetero deals the samples of every global batch to the ranks by speed: "
                          "give it a dataset of samples and batch_size=, or pass that dataset with global_batch=")
    sampler = batches.sampler if type(batches) is BatchSampler else batches
    if collate_fn is None and data.collate_fn is not torch.utils.data.default_collate:
        collate_fn = data.collate_fn
    kept = dict(num_workers=num_workers if num_workers is not None else data.num_workers,
                worker_init_fn=data.worker_init_fn, persistent_workers=data.persistent_workers,
                prefetch_factor=data.prefetch_factor)
    if type(batches) is not BatchSampler:  # a batch_sampler of the script's own (buckets of similar lengths)
        nominal = global_batch if global_batch is not None else getattr(batches, "batch_size", None)
        if not isinstance(nominal, int) or nominal < 1:
            raise ConfigError(f"job.prepare(): the DataLoader's batch_sampler {type(batches).__name__} has no "
                              "batch_size: pass global_batch=, the samples of its usual batch (each batch of "
                              "another length is dealt in proportion)")
        own = OwnDraw(batches, batches=True)
        own.declared()  # its refusal now: a batch sampler with no len()
        return Data(data.dataset, nominal, collate_fn, shuffle=False, own=own, **kept)
    draw = drawn(sampler, batches.batch_size if global_batch is None else global_batch)
    own = None
    if type(sampler) not in (RandomSampler, SequentialSampler) and draw is None:
        if isinstance(sampler, DistributedSampler):
            collate = ", collate_fn=loader.collate_fn" if collate_fn is not None else ""
            raise ConfigError("job.prepare(): the DataLoader draws its batches with a DistributedSampler of its own, "
                              "which two ranks cannot share: hvdhetero deals each rank its part of every global "
                              "batch (a DDP script's sampler goes: shuffle=True does what it did); pass its dataset "
                              f"and global_batch= instead (job.prepare(model, optimizer, loader.dataset, "
                              f"global_batch=...{collate}))")
        own = OwnDraw(sampler, batches=False)  # a sampler of the script's own: every rank draws it alike
        own.declared()
    return Data(data.dataset, global_batch if global_batch is not None else batches.batch_size, collate_fn,
                shuffle=isinstance(sampler, RandomSampler), drop_last=batches.drop_last, draw=draw, own=own, **kept)


def drawn(sampler, global_batch: int | None) -> Draw | None:
    """How torch's `sampler` draws an epoch, where that is not one permutation of the dataset
    (a RandomSampler without replacement or num_samples, a SequentialSampler: None). Refused,
    with the fix: a WeightedRandomSampler without replacement (torch draws it through a random
    stream that differs between a Mac's and a PC's build), an epoch shorter than a global batch."""
    kind = type(sampler)
    if kind is WeightedRandomSampler:
        if not sampler.replacement:
            raise ConfigError("job.prepare(): the DataLoader's WeightedRandomSampler has replacement=False, which "
                              "torch draws through a random stream that differs between a Mac's and a PC's build, "
                              "so two ranks could not draw one epoch alike: use replacement=True (its default)")
        draw = Draw(sampler.num_samples, sampler=sampler, replacement=True,
                    endless=sampler.num_samples >= ENDLESS * len(sampler.weights))
    elif kind is SubsetRandomSampler:
        draw = Draw(len(sampler.indices), subset=torch.as_tensor(list(sampler.indices), dtype=torch.long),
                    source=sampler)
    elif kind is RandomSampler and (sampler.replacement or sampler._num_samples is not None):
        draw = Draw(sampler.num_samples, replacement=sampler.replacement,
                    endless=sampler.num_samples >= ENDLESS * len(sampler.data_source))
    else:
        return None
    if global_batch and draw.size < global_batch:
        raise ConfigError(f"job.prepare(): the DataLoader's {kind.__name__} draws {draw.size} samples an epoch, fewer "
                          f"than one global batch ({global_batch}): no step of the epoch would be whole; draw more "
                          "(num_samples=, a bigger subset) or take a smaller batch_size")
    return draw


@dataclass(frozen=True)
class Parts:
    """What job.prepare trains: one model, or several (a GAN's generator and discriminator) as one
    module, and their optimizers and schedulers; `given` as the script passed them, to return."""

    model: torch.nn.Module
    """The model, or the models as one nn.ModuleList: broadcast, reduced and checkpointed as one."""
    optimizers: list[torch.optim.Optimizer]
    schedulers: list
    given: tuple[Any, Any]
    """(model, optimizer) as passed: a tuple of models or optimizers comes back as one."""

    @property
    def several(self) -> bool:
        """Several optimizers, stepped in turn within each global step (a GAN's)."""
        return len(self.optimizers) > 1


def parts_arguments(model, optimizer, scheduler) -> Parts:
    """job.prepare's model, optimizer and scheduler: each one object, or a tuple or list of them
    (a GAN's two models, each with its optimizer), refused with the fix where not torch's kinds."""
    models = list(model) if isinstance(model, (tuple, list)) else [model]
    optimizers = list(optimizer) if isinstance(optimizer, (tuple, list)) else [optimizer]
    for m in models:
        if not isinstance(m, torch.nn.Module):
            raise ConfigError(f"job.prepare(model, ...): expected a torch.nn.Module (or a tuple of them, a GAN's "
                              f"generator and discriminator), got {type(m).__name__}")
    if optimizer is None:
        raise ConfigError("job.prepare(model, None, ...): give it the optimizer the loop steps. A loop that updates "
                          "the parameters by hand (`p.data.add_(p.grad, alpha=-lr)`) makes torch's "
                          "`optimizer = torch.optim.SGD(model.parameters(), lr=lr)`, calls `optimizer.step()` in place "
                          "of the update and sets `optimizer.param_groups[0]['lr'] = lr` where it changes lr")
    for o in optimizers:
        if not isinstance(o, torch.optim.Optimizer):
            raise ConfigError(f"job.prepare(model, optimizer, ...): expected a torch.optim.Optimizer (or a tuple of "
                              f"them, one per model, stepped in turn as a GAN's), got {type(o).__name__}")
    if not models or not optimizers:
        raise ConfigError("job.prepare(): give it a model and its optimizer (an empty tuple was passed)")
    if len({id(o) for o in optimizers}) < len(optimizers):
        raise ConfigError("job.prepare(): the same optimizer is in the tuple twice: pass each optimizer once")
    schedulers = [s for s in (scheduler if isinstance(scheduler, (tuple, list)) else [scheduler]) if s is not None]
    whole = models[0] if len(models) == 1 else torch.nn.ModuleList(models)  # (a tuple of one: that model)
    return Parts(whole, optimizers, schedulers, (model, optimizer))


def closure_optimizers(config, optimizers: list) -> bool:
    """Whether an optimizer steps only with a closure (LBFGS: `optimizer.step(closure)`, which
    evaluates the batch in hand several times a step): the rank's share then goes in one piece,
    an explicit --micro-batch refused with the fix (the closure cannot wait for a step's last chunk)."""
    closures = [type(o).__name__ for o in optimizers if isinstance(o, torch.optim.LBFGS)]
    if closures and config.micro_batch.isdigit() and int(config.micro_batch):
        raise ConfigError(f"--micro-batch {config.micro_batch} with {closures[0]}: its step(closure) evaluates the "
                          "batch in hand several times a step, which cannot wait for a step's last chunk: use "
                          "--micro-batch 0 (each rank's share in one piece; a smaller global batch where it does not "
                          "fit)")
    return bool(closures)


def several_optimizers(config) -> None:
    """Several optimizers stepped in turn (a GAN's): what the job cannot do with them, refused
    before anything is broadcast or timed, with the fix."""
    if config.micro_batch.isdigit() and int(config.micro_batch):
        raise ConfigError(f"--micro-batch {config.micro_batch} with several optimizers: a GAN's loop steps its "
                          "discriminator before its generator's backward, which cannot wait for a step's last chunk "
                          "(the generator's loss would add to the discriminator's gradients being accumulated): "
                          "use --micro-batch 0 (each rank's share in one piece; a smaller global batch where it does "
                          "not fit)")
    if check_sync(config.sync)[0] not in ("step", "auto"):
        raise ConfigError(f"--sync {config.sync} with several optimizers (stepped in turn, as a GAN's): "
                          f"{SEVERAL_STEP_ONLY}; use --sync step (the default)")


SEVERAL_STEP_ONLY = "local and diloco rounds count one optimizer's steps"
"""Why a job with several optimizers trains in step sync (its refusal, its plan's line)."""


def prepare_arguments(model, optimizers, dataset, global_batch, device: torch.device, ranks: int) -> None:
    """Refuse, with the fix, what would go wrong later or silently."""
    elsewhere = {str(p.device) for p in model.parameters()
                 if (p.device.type, p.device.index or 0) != (device.type, device.index or 0)}
    if elsewhere:
        raise ConfigError(f"job.prepare(): the model has parameters on {', '.join(sorted(elsewhere))}, but this "
                          f"rank computes on {device}: call model.to(job.device) before prepare()")
    mine = {id(p) for p in model.parameters()}
    for optimizer in optimizers:
        foreign = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in mine)
        if foreign:
            raise ConfigError(f"job.prepare(): the optimizer holds {foreign} parameter(s) that are not the model's: "
                              "build it from model.parameters() after model.to(job.device)"
                              + (" (and pass every model it steps)" if len(optimizers) > 1 else ""))
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__getitem__") \
            or not hasattr(dataset, "__len__"):
        raise ConfigError(f"job.prepare(): the dataset must be map-style (__len__ and __getitem__), got "
                          f"{type(dataset).__name__}: the balancer deals each rank its share by index; a stream "
                          "that fits in memory becomes one as a list (`job.prepare(model, optimizer, list(stream), "
                          "global_batch=...)`), a Hugging Face dataset when loaded without streaming=True; one "
                          "too big for that goes in as a batch function, every rank reading it whole and keeping "
                          "its rows of each batch: `stream = iter(DataLoader(dataset, batch_size=...)); model, "
                          "optimizer, batches = job.prepare(model, optimizer, lambda: next(stream))`, then `for x, "
                          "y in batches:` (docs/api.md)")
    if not isinstance(global_batch, int) or global_batch < ranks:
        raise ConfigError(f"job.prepare(global_batch={global_batch!r}): must be an integer of at least the "
                          f"number of ranks ({ranks}), so that every rank gets a sample")
    if global_batch > len(dataset):
        raise ConfigError(f"job.prepare(global_batch={global_batch}): the dataset holds only {len(dataset)} "
                          "samples; lower global_batch or use a larger dataset")
