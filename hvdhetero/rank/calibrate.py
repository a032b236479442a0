"""The starting split: each rank's step time measured on the real model before training.

Each rank times its forward/backward at two batch sizes, which separates its per-step overhead
a from its per-sample cost p; every rank's (a, p) reach every rank and set the first split;
then one more probe at exactly that split refines each p (at K=10 the slow rank's share is far
below the small probe, where the straight line through two probes missed by 10-20%, measured).
"""

from __future__ import annotations

from collections.abc import Callable

import horovod.torch as hvd
import torch

from hvdhetero.rank import batches
from hvdhetero.rank.balancer import Balancer
from hvdhetero.rank.host import one_hot
from hvdhetero.rank.reducer import allreduce_sum
from hvdhetero.rank.step import Rank, cross_entropy_loss, forward_backward


def calibrate(balancer: Balancer, model, dataset, me: Rank, small: int, big: int,
              loss_fn: Callable = cross_entropy_loss, collate_fn: Callable | None = None) -> None:
    """Set `balancer`'s split from this rank's timings and every other rank's (a collective)."""
    probe = lambda n: probe_seconds(model, dataset, me, n, loss_fn, collate_fn)  # noqa: E731
    t_small, t_big = probe(small), probe(big)
    p = (t_big - t_small) / (big - small) if big > small else t_big / big
    p = max(p, 0.1 * t_big / big)  # timing noise must not make p vanish
    a = max(0.0, t_big - p * big)
    both = allreduce_sum(one_hot(a) + one_hot(p), "hvdhetero.calibrate")
    balancer.calibrate(both[: hvd.size()], both[hvd.size():])
    sizes = list(balancer.split)
    balancer.refine(allreduce_sum(one_hot(probe(sizes[hvd.rank()])), "hvdhetero.refine"), sizes)


def probe_seconds(model, dataset, me: Rank, n: int, loss_fn: Callable = cross_entropy_loss,
                  collate_fn: Callable | None = None, steps: int = 5) -> float:
    """This rank's compute time (forward + backward, straggling included) for n samples of the
    real model: the median of a few probes after one warm-up. The model is left unchanged."""
    batch = batches.probe(dataset, n, me.device.torch_device, collate_fn)
    times = [forward_backward(model, batch, me, loss_fn=loss_fn)[1] for _ in range(steps + 1)][1:]
    model.zero_grad(set_to_none=True)
    return sorted(times)[len(times) // 2]


def probe_loss(model, batch) -> torch.Tensor:
    """Calibration's stand-in for a loss: the model's output on the batch's inputs, averaged."""
    out = model(batch[0] if isinstance(batch, (tuple, list)) else batch)
    tensor = batches.first_tensor(out)
    if tensor is None or not tensor.is_floating_point():
        raise TypeError(f"the model's output holds no floating-point tensor ({type(out).__name__})")
    return tensor.float().mean()


class unchanged:
    """Calibration probes run forward/backward on the real model: put back its buffers
    (BatchNorm statistics) and leave no gradients."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.saved = {k: v.detach().clone() for k, v in self.model.named_buffers()}

    def __exit__(self, *exc):
        for k, v in self.model.named_buffers():
            v.copy_(self.saved[k])
        self.model.zero_grad(set_to_none=True)
