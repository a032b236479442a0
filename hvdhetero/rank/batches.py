"""Batches as users have them: a tensor, a tuple or list of tensors (inputs, targets, ...), a
dict of tensors, at any nesting; also any other mapping (transformers' BatchEncoding is a
UserDict), a dataclass of tensors, or an object of the script's own with a `.to(device)`. What
the loader and the timing probes need of them: how many samples one holds, a slice of it (a
micro-batch), and a copy on the rank's device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

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
    return _map(batch, lambda t: t[start:stop], lambda b: take(b, start, stop))


def to_device(batch, device: torch.device):
    """`batch` with every tensor on `device`. Blocking copies: non_blocking CPU->MPS copies have
    returned wrong data in other projects. An object of the script's own that is none of the
    kinds `_map` knows moves by its own `.to(device)` (as transformers' BatchEncoding does)."""
    if not isinstance(batch, (torch.Tensor, dict, list, tuple)) and callable(getattr(batch, "to", None)):
        return batch.to(device)
    return _map(batch, lambda t: t.to(device), lambda b: to_device(b, device))


def _map(batch, tensor: Callable, inner: Callable):
    """`batch` with `tensor` applied to a tensor, `inner` to each value of a container (a dict or
    other mapping, a list, a tuple or namedtuple, a dataclass), rebuilt as its own type where
    that takes the values back (a mapping that does not: a dict); anything else as it is."""
    if isinstance(batch, torch.Tensor):
        return tensor(batch)
    if isinstance(batch, Mapping):
        values = {k: inner(v) for k, v in batch.items()}
        if type(batch) is dict:
            return values
        try:
            return type(batch)(values)
        except Exception:  # noqa: BLE001 - a mapping type that is not built from a dict (defaultdict)
            return values
    if isinstance(batch, (list, tuple)):
        items = [inner(v) for v in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(batch, **{f.name: inner(getattr(batch, f.name))
                                             for f in dataclasses.fields(batch) if f.init})
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
    if isinstance(batch, Mapping):
        values = batch.values()
    elif isinstance(batch, (list, tuple)):
        values = batch
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        values = [getattr(batch, f.name) for f in dataclasses.fields(batch)]
    else:
        values = ()
    for v in values:
        found = first_tensor(v)
        if found is not None:
            return found
    return None


def fewest_samples(model: torch.nn.Module) -> int:
    """The fewest samples a rank's batch may hold, 0 aside: 2 with BatchNorm (training mode
    refuses a batch of one where a channel has one value: BatchNorm1d after a Linear), else 1."""
    return 2 if any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()) else 1
