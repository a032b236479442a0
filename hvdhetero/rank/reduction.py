"""job.reduce: a script's own numbers summed over the ranks, the way a DDP script's
`dist.all_reduce(t)` sums them, or torchvision's `utils.reduce_dict(loss_dict)`.

    running_corrects = job.reduce(running_corrects)       # every rank's count: the epoch's
    totals = job.reduce({"loss": loss_sum, "n": seen})     # a dict (or list, tuple) in one exchange

A number, a bool (counted), a tensor on any device, or a dict, list or tuple of them comes back
as it went, every leaf its type on its device, summed (or the largest, the smallest) over the
ranks. Float64 on the wire: integers are exact up to 2^53.

Every rank must call it as often: it is a collective, bounded in time like the job's own. Inside
the loop over the prepared loader the ranks take different numbers of batches (a share of zero
takes none, micro-batches and by-speed inner steps take several), so a call there is refused on
every rank, saying to sum over the loop and reduce after it. A mean over the ranks is refused
too: their shares differ, so the mean of their means is no mean over the samples.
"""

from __future__ import annotations

import numbers
from typing import Any

import horovod.torch as hvd
import torch

from hvdhetero.errors import ConfigError
from hvdhetero.rank import collectives

OPS = {"sum": hvd.Sum, "max": hvd.Max, "min": hvd.Min}


def check(op: str, in_loop: bool) -> None:
    """ConfigError, the same on every rank, for an `op` job.reduce does not take or a call from
    inside the loop over the prepared loader."""
    if op == "mean":
        raise ConfigError("job.reduce(value, op='mean'): the ranks' shares of a batch differ, so a mean of each rank's "
                          "mean is no mean over the samples; reduce the sum and the count (job.reduce({'loss': "
                          "loss_sum, 'n': samples})) and divide")
    if op not in OPS:
        raise ConfigError(f"job.reduce(value, op={op!r}): op is one of {', '.join(map(repr, OPS))}")
    if in_loop:
        raise ConfigError("job.reduce() inside the loop over the prepared loader: the ranks take different numbers of "
                          "batches there (a rank's share may be none, or several micro-batches), and every rank must "
                          "call job.reduce as often; add up over the loop and call job.reduce once after it")


def reduce(value: Any, op: str = "sum") -> Any:
    """`value` reduced over the ranks by `op` (module docstring), in one collective."""
    leaves: list = []
    _leaves(value, leaves)
    if not leaves:
        raise ConfigError(f"job.reduce(value): value holds no number or tensor ({type(value).__name__}); pass a "
                          "number, a tensor, or a dict, list or tuple of them")
    flat = torch.cat([t.detach().reshape(-1).to("cpu", torch.float64) if isinstance(t, torch.Tensor)
                      else torch.tensor([float(t)], dtype=torch.float64) for t in leaves])
    collectives.allreduce_(flat, OPS[op], "hvdhetero.job_reduce", "job.reduce()")
    done, at = [], 0
    for leaf in leaves:
        n = leaf.numel() if isinstance(leaf, torch.Tensor) else 1
        part, at = flat[at:at + n], at + n
        if isinstance(leaf, torch.Tensor):
            dtype = torch.int64 if leaf.dtype is torch.bool and op == "sum" else leaf.dtype  # a count of trues
            done.append(part.reshape(leaf.shape).to(leaf.device, dtype))
        else:
            done.append(int(part.item()) if isinstance(leaf, numbers.Integral) else part.item())
    return _rebuilt(value, iter(done))


def _leaves(value: Any, out: list) -> None:
    if isinstance(value, dict):
        for v in value.values():
            _leaves(v, out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _leaves(v, out)
    elif isinstance(value, torch.Tensor) or isinstance(value, numbers.Real):
        out.append(value)
    else:
        raise ConfigError(f"job.reduce(value): a {type(value).__name__} is no number or tensor; pass numbers, "
                          "tensors, or a dict, list or tuple of them")


def _rebuilt(value: Any, done) -> Any:
    if isinstance(value, dict):
        return type(value)((k, _rebuilt(v, done)) for k, v in value.items())
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*[_rebuilt(v, done) for v in value])
    if isinstance(value, (list, tuple)):
        return type(value)(_rebuilt(v, done) for v in value)
    return next(done)
