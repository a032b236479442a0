"""Batches as users have them: a tensor, a tuple or list of tensors (inputs, targets, ...), a
dict of tensors, at any nesting; also any other mapping (transformers' BatchEncoding is a
UserDict), a dataclass of tensors, or an object of the script's own with a `.to(device)`. What
the loader and the timing probes need of them: how many samples one holds, a slice of it (a
micro-batch), and a copy on the rank's device.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import UserDict
from collections.abc import Callable, Mapping, Sequence

import torch
from torch.utils.data import TensorDataset, default_collate


def size(batch, dim: int = 0) -> int:
    """Samples in `batch`: its first tensor's length along `dim`, the batch dimension (1 for a
    batch laid out [sequence, batch], an LSTM's or a Transformer's without batch_first). A tensor
    with no such dimension is skipped (a flattened target beside [sequence, batch] inputs)."""
    tensor = first_tensor(batch, dim)
    if tensor is None:
        raise TypeError(f"a batch must hold at least one tensor (got {type(batch).__name__}); "
                        "give prepare() a collate_fn that returns tensors")
    return tensor.shape[dim] if tensor.dim() else 1


def take(batch, start: int, stop: int, dim: int = 0):
    """Samples start..stop of every tensor in `batch` (other values as they are), along `dim`. With
    dim >= 1, a tensor of fewer dimensions is the batch laid out flat, row by row (word_language_model's
    `target.view(-1)` of a [sequence, batch] window): its columns start..stop, flat again."""
    if not dim:
        def one(b):
            return b[start:stop] if isinstance(b, torch.Tensor) else _rebuilt(b, one)
        return one(batch)
    whole = size(batch, dim)

    def sliced(b):
        if not isinstance(b, torch.Tensor):
            return _rebuilt(b, sliced)
        if b.dim() > dim:
            return b.narrow(dim, start, min(stop, b.shape[dim]) - start)  # (a last chunk asks past the end)
        return b.reshape(-1, whole)[:, start:stop].reshape(-1)
    return sliced(batch)


def tensors(batch) -> list[torch.Tensor]:
    """Every tensor in `batch`, in order."""
    found = []

    def one(b):
        if isinstance(b, torch.Tensor):
            found.append(b)
            return b
        return _rebuilt(b, one)
    one(batch)
    return found


def to_device(batch, device: torch.device):
    """`batch` with every tensor on `device`. Blocking copies: non_blocking CPU->MPS copies have
    returned wrong data in other projects. An object that moves itself (`.to(device)`: transformers'
    BatchEncoding, a PackedSequence, a batch class of the script's own) does so."""
    def one(b):
        if isinstance(b, torch.Tensor):
            return b.to(device)
        if type(b) not in _BUILTIN and not isinstance(b, _LEAVES) and callable(getattr(b, "to", None)):
            return b.to(device)
        return _rebuilt(b, one)
    return one(batch)


_BUILTIN = (dict, list, tuple)
_LEAVES = (str, bytes, int, float, bool, type(None))


def _rebuilt(b, one: Callable):
    """A container `b` (a dict or other mapping, a list, a tuple or namedtuple, a dataclass) with
    `one` applied to each value, as its own type (a mapping not built from a dict: a dict); any
    other value as it is."""
    kind = type(b)
    if kind in _BUILTIN or isinstance(b, _LEAVES):
        if kind is dict:
            return {k: one(v) for k, v in b.items()}
        if kind is list:
            return [one(v) for v in b]
        return tuple(one(v) for v in b) if kind is tuple else b
    if isinstance(b, tuple) and hasattr(b, "_fields"):
        return kind(*[one(v) for v in b])
    if isinstance(b, (list, tuple)):
        return kind([one(v) for v in b])
    if isinstance(b, UserDict):  # its other attributes kept (BatchEncoding's encodings)
        new = copy.copy(b)
        new.data = {k: one(v) for k, v in b.data.items()}
        return new
    if isinstance(b, Mapping):
        values = {k: one(v) for k, v in b.items()}
        try:
            return kind(values)
        except Exception:  # noqa: BLE001 - a mapping type that is not built from a dict (defaultdict)
            return values
    if dataclasses.is_dataclass(b) and not isinstance(b, type):  # every field, init or not, frozen or not
        new = copy.copy(b)
        for f in dataclasses.fields(b):
            if hasattr(b, f.name):
                object.__setattr__(new, f.name, one(getattr(b, f.name)))
        return new
    return b


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


@dataclasses.dataclass(frozen=True)
class Chunks:
    """A probe's batch as the loader hands a rank its share: collated chunk by chunk from the
    samples' indices, so that each chunk holds whole samples whatever the collate_fn lays out (a
    [sequence, batch] pad_sequence, the detection tutorial's tuple of images and tuple of target
    dicts), where cutting one collated batch along its first dimension would cut a sequence or an
    image's channels. `sizes`: each chunk's samples."""

    parts: tuple
    sizes: tuple[int, ...]


def spans(n: int, chunk: int | None, fewest: int = 1) -> list[tuple[int, int]]:
    """`n` samples as (start, end) runs of at most `chunk` (one run where None or 0), as few as
    that allows and as even as can be (65 at 64: 33 + 32, not 64 + 1; 81 at 40: 27 + 27 + 27), none
    of fewer than `fewest` where that can be (BatchNorm refuses a batch of one); none for no samples."""
    if n <= 0:
        return []
    runs = min(-(-n // chunk), max(1, n // fewest)) if chunk else 1
    base, extra = divmod(n, runs)
    ends = [0]
    for i in range(runs):
        ends.append(ends[-1] + base + (i < extra))
    return list(zip(ends, ends[1:]))


def cut(indices: list[int], chunk: int | None, fewest: int = 1) -> list[list[int]]:
    """`indices` in `spans`: the loader's micro-batches and the probes' alike."""
    return [indices[a:b] for a, b in spans(len(indices), chunk, fewest)]


def probe_chunks(dataset, n: int, chunk: int | None, device: torch.device,
                 collate_fn: Callable | None = None, fewest: int = 1) -> Chunks:
    """`probe`'s n samples in chunks of at most `chunk` (all of them in one where None or 0), cut
    as the loader cuts a share (`spans`)."""
    runs = cut([i % len(dataset) for i in range(n)], chunk, fewest)
    return Chunks(tuple(to_device(collate(dataset, run, collate_fn), device) for run in runs),
                  tuple(len(run) for run in runs))


def first_tensor(batch, dim: int = 0):
    """The first tensor in `batch` with a dimension `dim` (any tensor where dim is 0)."""
    if isinstance(batch, torch.Tensor):
        return batch if not dim or batch.dim() > dim else None
    if isinstance(batch, Mapping):
        values = batch.values()
    elif isinstance(batch, (list, tuple)):
        values = batch
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        values = [getattr(batch, f.name, None) for f in dataclasses.fields(batch)]
    else:
        values = ()
    for v in values:
        found = first_tensor(v, dim)
        if found is not None:
            return found
    return None


def fewest_samples(model: torch.nn.Module) -> int:
    """The fewest samples a rank's batch may hold, 0 aside: 2 with BatchNorm (training mode
    refuses a batch of one where a channel has one value: BatchNorm1d after a Linear), else 1."""
    return 2 if any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()) else 1
