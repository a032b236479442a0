"""Batches as users have them: a tensor, a tuple or list of tensors (inputs, targets, ...), or
a dict of tensors, at any nesting. What the loader and the timing probes need of them: how many
samples one holds, a slice of it (a micro-batch), and a copy on the rank's device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.utils.data import TensorDataset, default_collate


def size(batch) -> int:
    """Samples in `batch`: the first dimension of its first tensor."""
    tensor = first_tensor(batch)
    if tensor is None:
        raise TypeError(f"a batch must hold at least one tensor (got {type(batch).__name__}); "
                        "give prepare() a collate_fn that returns tensors")
    return tensor.shape[0] if tensor.dim() else 1


def take(batch, start: int, stop: int):
    """Samples start..stop of every tensor in `batch` (other values as they are)."""
    if isinstance(batch, torch.Tensor):
        return batch[start:stop]
    if isinstance(batch, dict):
        return {k: take(v, start, stop) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        items = [take(v, start, stop) for v in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    return batch


def to_device(batch, device: torch.device):
    """`batch` with every tensor on `device`. Blocking copies: non_blocking CPU->MPS copies have
    returned wrong data in other projects."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        items = [to_device(v, device) for v in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    return batch


def collate(dataset, indices: Sequence[int], collate_fn: Callable | None = None):
    """The samples `indices` of a map-style dataset as one batch; a TensorDataset is indexed in
    one go (no per-sample Python), anything else goes through `collate_fn` (default: torch's)."""
    if collate_fn is None and isinstance(dataset, TensorDataset):
        index = torch.as_tensor(list(indices), dtype=torch.long)
        return tuple(t[index] for t in dataset.tensors)
    return (collate_fn or default_collate)([dataset[i] for i in indices])


def probe(dataset, n: int, device: torch.device, collate_fn: Callable | None = None):
    """n samples for timing probes, on `device`: the dataset's first ones, cycled if it has fewer."""
    return to_device(collate(dataset, [i % len(dataset) for i in range(n)], collate_fn), device)


def first_tensor(batch):
    if isinstance(batch, torch.Tensor):
        return batch
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for v in values:
        found = first_tensor(v)
        if found is not None:
            return found
    return None


def fewest_samples(model: torch.nn.Module) -> int:
    """The fewest samples a rank's batch may hold, 0 aside: 2 with BatchNorm (training mode
    refuses a batch of one where a channel has one value: BatchNorm1d after a Linear), else 1."""
    return 2 if any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()) else 1
