"""What `job.prepare` refuses, each with the fix, before anything is broadcast or timed."""

from __future__ import annotations

import torch

from hvdhetero.errors import ConfigError


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
