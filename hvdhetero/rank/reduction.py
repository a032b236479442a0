"""job.reduce: a script's own numbers summed over the ranks, the way a DDP script's
`dist.all_reduce(t)` sums them, or torchvision's `utils.reduce_dict(loss_dict)`.

    running_corrects = job.reduce(running_corrects)       # every rank's count: the epoch's
    totals = job.reduce({"loss": loss_sum, "n": seen})     # a dict (or list, tuple) at once

A number (Python's or NumPy's), a bool (counted by a sum), a tensor on any device, or a dict,
list or tuple of them comes back as it went, every leaf its type on its device, summed (or the
largest, the smallest) over the ranks. Integers go as int64 (exact; a Python int beyond int64 is
refused), floats as float64. A dict's keys are matched by name, whatever order each rank filled
it in (per-class counts); ranks whose values differ in keys or shapes are told so, every one.

Every rank must call it as often: it is a collective, bounded in time like the job's own. Inside
the loop over the prepared loader the ranks take different numbers of batches (a share of zero
takes none, micro-batches and by-speed inner steps take several), so a call there is refused on
every rank that reaches it, saying to sum over the loop and reduce after it. A batch function's
loop is the script's own, every rank calling the function once a step: a call there is fine (an
RL loop agreeing on when to stop), but not after a call that held a part of a step (micro-batches:
another rank's step may come in fewer calls; nor, unchecked, under --inner-steps by-speed, where
a merging rank's call holds several steps). A mean over the ranks is refused too: their shares
differ, so the mean of their means is no mean over the samples.
"""

from __future__ import annotations

import copy
import numbers
from typing import Any

import horovod.torch as hvd
import numpy as np
import torch

from hvdhetero.errors import ConfigError
from hvdhetero.rank import collectives

OPS = {"sum": hvd.Sum, "max": hvd.Max, "min": hvd.Min}
INT64 = (-2 ** 63, 2 ** 63 - 1)


def check(op: str, in_loop: bool, part_of_step: str = "") -> None:
    """ConfigError, the same on every rank, for an `op` job.reduce does not take or a call from
    inside the loop over the prepared loader; in a batch function's loop (every rank calls the
    function once a step: a call a step is fine there), one after a call that held `part_of_step`
    (micro-batches: a rank's calls a step differ)."""
    if op == "mean":
        raise ConfigError("job.reduce(value, op='mean'): the ranks' shares of a batch differ, so a mean of each rank's "
                          "mean is no mean over the samples; reduce the sum and the count (job.reduce({'loss': "
                          "loss_sum, 'n': samples})) and divide")
    if op not in OPS:
        raise ConfigError(f"job.reduce(value, op={op!r}): op is one of {', '.join(map(repr, OPS))}")
    if in_loop:
        raise ConfigError("job.reduce() inside the loop over the prepared loader (or with an iterator over it still "
                          "open): the ranks take different numbers of batches there (a rank's share may be none, or "
                          "several micro-batches), and every rank must call job.reduce as often; add up over the loop "
                          "and call job.reduce once after it")
    if part_of_step:
        raise ConfigError(f"job.reduce() in the loop over a batch function's calls after one that held {part_of_step} "
                          "(micro-batches: the loop's body runs once a chunk, and another rank's step may come in "
                          "fewer): every rank must call job.reduce as often; with --micro-batch 0 every rank calls the "
                          "function once a step, or add up over the loop and reduce after it")


def reduce(value: Any, op: str = "sum") -> Any:
    """`value` reduced over the ranks by `op` (module docstring)."""
    leaves: list[tuple[str, Any]] = []
    _leaves(value, "value", leaves)
    if not leaves:
        raise ConfigError(f"job.reduce(value): value holds no number or tensor ({type(value).__name__}); pass a "
                          "number, a tensor, or a dict, list or tuple of them")
    kinds = [(path, _integral(leaf), tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else ()) for path, leaf in leaves]
    if hvd.size() > 1:
        _same_everywhere(kinds)
    reduced: list = [None] * len(leaves)
    for integral, dtype in ((True, torch.int64), (False, torch.float64)):
        which = [i for i, (_, kind, _) in enumerate(kinds) if kind is integral]
        for i, part in zip(which, _reduced([leaves[i][1] for i in which], dtype, op)):
            reduced[i] = part
    return _rebuilt(value, iter([_as(leaf, part, op) for (_, leaf), part in zip(leaves, reduced)]))


def _integral(leaf) -> bool:
    if isinstance(leaf, torch.Tensor):
        return not leaf.dtype.is_floating_point
    return isinstance(leaf, (numbers.Integral, np.bool_))


def _same_everywhere(kinds: list) -> None:
    """Every rank passed the same keys, kinds and shapes: else each rank says where they differ."""
    every = collectives.allgather_object(kinds, "hvdhetero.job_reduce_shape", "job.reduce()")
    for rank, theirs in enumerate(every):
        if theirs != every[0]:
            mine = dict((p, (i, s)) for p, i, s in every[0])
            other = dict((p, (i, s)) for p, i, s in theirs)
            where = next((p for p in [*mine, *other] if mine.get(p) != other.get(p)), "value")
            raise ConfigError(f"job.reduce(value): rank {rank}'s value differs from rank 0's at {where} (rank 0: "
                              f"{_said(mine.get(where))}, rank {rank}: {_said(other.get(where))}): every rank must "
                              "pass the same keys, and tensors of the same shapes")


def _said(kind) -> str:
    if kind is None:
        return "nothing"
    integral, shape = kind
    return ("a tensor of shape " + str(list(shape)) if shape else "a number") + (" (integers)" if integral else "")


def _reduced(leaves: list, dtype: torch.dtype, op: str) -> list[torch.Tensor]:
    """The leaves' values reduced, in one exchange per dtype: a flat CPU tensor for each leaf."""
    if not leaves:
        return []
    parts = [leaf.detach().reshape(-1).to("cpu", dtype) if isinstance(leaf, torch.Tensor)
             else torch.tensor([int(leaf) if dtype is torch.int64 else float(leaf)], dtype=dtype) for leaf in leaves]
    flat = torch.cat(parts)
    collectives.allreduce_(flat, OPS[op], f"hvdhetero.job_reduce.{str(dtype).rsplit('.', 1)[-1]}", "job.reduce()")
    out, at = [], 0
    for part in parts:
        out.append(flat[at:at + len(part)])
        at += len(part)
    return out


def _as(leaf, part: torch.Tensor, op: str):
    """The reduced `part` as `leaf` was: its type, dtype, shape and device (a bool summed: a count)."""
    if isinstance(leaf, torch.Tensor):
        dtype = torch.int64 if leaf.dtype is torch.bool and op == "sum" else leaf.dtype
        return part.reshape(leaf.shape).to(leaf.device, dtype)
    value = part.item()
    if isinstance(leaf, (bool, np.bool_)):
        return int(value) if op == "sum" else type(leaf)(value)
    if isinstance(leaf, (np.integer, np.floating)):
        return type(leaf)(value)
    return int(value) if isinstance(leaf, numbers.Integral) else float(value)


def _leaves(value: Any, path: str, out: list) -> None:
    """(path, leaf) for every number and tensor in `value`, a dict's in its keys' sorted order."""
    if isinstance(value, dict):
        for k in sorted(value, key=repr):
            _leaves(value[k], f"{path}[{k!r}]", out)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _leaves(v, f"{path}[{i}]", out)
    elif isinstance(value, torch.Tensor):
        if value.is_complex():
            raise ConfigError(f"job.reduce(value): {path} is a complex tensor; pass its real and imaginary parts")
        out.append((path, value))
    elif isinstance(value, (numbers.Real, np.bool_)):
        if isinstance(value, numbers.Integral) and not INT64[0] <= int(value) <= INT64[1]:
            raise ConfigError(f"job.reduce(value): {path} is {value}, beyond a 64-bit integer")
        out.append((path, value))
    else:
        raise ConfigError(f"job.reduce(value): {path} is a {type(value).__name__}, no number or tensor; pass "
                          "numbers, tensors, or a dict, list or tuple of them")


def _rebuilt(value: Any, done) -> Any:
    """`value` with its leaves, in `_leaves`' order, taken from `done`; a dict as its own type
    (a defaultdict, a Counter) with its keys in its own order."""
    if isinstance(value, dict):
        values = {k: _rebuilt(value[k], done) for k in sorted(value, key=repr)}
        new = copy.copy(value)
        new.clear()
        for k in value:  # (a Counter's update would add)
            new[k] = values[k]
        return new
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*[_rebuilt(v, done) for v in value])
    if isinstance(value, (list, tuple)):
        return type(value)(_rebuilt(v, done) for v in value)
    return next(done)
