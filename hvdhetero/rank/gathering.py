"""job.gather: every rank's rows of a tensor, for a loss over the whole global batch (SimCLR's
NT-Xent over 2N views, CLIP's image-text similarity matrix), exact.

    z = model(torch.cat([view1, view2]))          # this rank's share: 2 n_i rows
    loss = nt_xent(job.gather(z), temperature)    # every rank: the loss over all 2N rows
    job.backward(loss)

A rank alone sees n_i of the N samples: its loss has fewer negatives (a helper's SimCLR port
printed 4.63 for one device's 5.31) and its gradient is another. Gathered, every rank computes
the one loss of the whole batch; its gradient reaches the model only through this rank's own
rows, so the gather's backward hands them their gradient of the loss times N / n_i: job.backward
weighs each rank's gradient by n_i / N, and the reduced gradient is the one device's, whatever
the split (tests/test_gather.py: two uneven ranks against one process, to float32 rounding). The
rows go through the CPU as the gradients do (Horovod's Gloo build takes no device tensor), in
float32 for a half-precision tensor.
"""

from __future__ import annotations

import time

import horovod.torch as hvd
import torch

from hvdhetero.rank import collectives

_waited = [0.0]
"""Seconds this rank's gathers took since the step's clock last asked (`waited`)."""


def waited() -> float:
    """The seconds job.gather spent in its collectives since the last call: the step's clock
    leaves them out, as it does the gradients' reduction. Inside the forward, a gather waits
    for the slowest rank to get there, so every rank's step took the slowest one's time, and
    the balancer, seeing them alike, never moved a split (a rank slow at its data kept [32, 32])."""
    seconds, _waited[0] = _waited[0], 0.0
    return seconds


class Gathered(torch.autograd.Function):
    """Forward: every rank's rows, in rank order, on this rank's device. Backward: this rank's
    rows of the incoming gradient, times `scale`."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, scale: float, name: str) -> torch.Tensor:
        began = time.perf_counter()
        rows = torch.tensor([tensor.shape[0]], dtype=torch.int64)
        counts = collectives.wait(hvd.allgather_async(rows, name=f"{name}.rows"), "job.gather()")
        sent = tensor.detach().to("cpu", torch.float32 if tensor.dtype in (torch.float16, torch.bfloat16)
                                  else tensor.dtype).contiguous()
        whole = collectives.wait(hvd.allgather_async(sent, name=name), "job.gather()")
        start = int(counts[:hvd.rank()].sum())
        ctx.rows, ctx.scale = (start, start + tensor.shape[0]), scale
        _waited[0] += time.perf_counter() - began
        return whole.to(tensor.device, tensor.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start, end = ctx.rows
        return grad[start:end] * ctx.scale, None, None


def gather(tensor: torch.Tensor, scale: float, call: int) -> torch.Tensor:
    """`tensor`'s rows of every rank (`scale`: the step's samples over this rank's; `call`: the
    job's count of gathers, the same on every rank, which names the collective)."""
    if hvd.size() == 1:
        return tensor
    return Gathered.apply(tensor, scale, f"hvdhetero.gather.{call}")
