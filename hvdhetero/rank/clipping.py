"""`torch.nn.utils.clip_grad_norm_` as a one-device script calls it, on the whole model, kept in
a port: it does what `job.clip_grad_norm_` does.

Left as torch's it went wrong two ways. Between a step's micro-batches it clipped a gradient
still accumulating (each chunk's part scaled on its own: the step's gradient was not the one
device's), and after the reduction each rank computed the norm on its own device, whose
rounding differs (a CUDA rank's norm and a CPU rank's part in the last bits, and so would the
replicas). Taken over, it returns the last step's norm between chunks and, once the step's
gradients are reduced, clips them by the norm of the reduced CPU buffers, the same bytes on
every rank (under local/diloco each rank's own gradient, as torch would).

Only a call over every parameter the job reduces is taken over (`model.parameters()`, frozen
ones or not); a part of the model (`model.encoder.parameters()`) is clipped by torch. Replaced
by the runner before the script starts (so `from torch.nn.utils import clip_grad_norm_` gets
it too) and by job.prepare; without a prepared job it is torch's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class _Job:
    """The prepared job's clip (job.clip_grad_norm_) and the parameters it reduces."""

    clip: Callable[[float, float], torch.Tensor] | None = None
    params: list = []
    flush: Callable[[], None] = staticmethod(lambda: None)
    """Reduce what a script's own accumulation left pending (rank/deferral.py) before torch clips a part."""


def take_over(clip: Callable[[float, float], torch.Tensor], params: list,
              flush: Callable[[], None] = lambda: None) -> None:
    """job.prepare: torch's clip_grad_norm_ over every one of `params` is `clip` from now on."""
    install()
    _Job.clip, _Job.params, _Job.flush = clip, params, staticmethod(flush)


def release() -> None:
    """The job is over (an elastic reset drops it): torch's clip_grad_norm_ is torch's again."""
    _Job.clip, _Job.params, _Job.flush = None, [], staticmethod(lambda: None)


def install() -> None:
    """Replace torch.nn.utils.clip_grad_norm_ (once a process)."""
    utils = torch.nn.utils
    if getattr(utils.clip_grad_norm_, "_hvdhetero_torch", None) is not None:
        return
    torchs = utils.clip_grad_norm_

    def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if _Job.clip is None or not _whole(params, _Job.params):
            if _Job.clip is not None:
                _Job.flush()  # a part of the model clipped by torch: on the reduced gradient, not a pending sum
            return torchs(params, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite, foreach=foreach)
        norm = torch.as_tensor(_Job.clip(float(max_norm), float(norm_type)), dtype=torch.float32)
        if error_if_nonfinite and not bool(torch.isfinite(norm)):
            raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
                               "non-finite, so it cannot be clipped (torch's words: error_if_nonfinite=True)")
        return norm.to(params[0].device) if params else norm

    clip_grad_norm_.__doc__ = torchs.__doc__
    clip_grad_norm_._hvdhetero_torch = torchs
    utils.clip_grad_norm_ = clip_grad_norm_


def _whole(params: list, reduced: list) -> bool:
    """Whether `params` are the parameters the job reduces, all of them that have a gradient
    (`[p for p in model.parameters() if p.grad is not None]` too), and no other."""
    given, job = {id(p) for p in params if p.requires_grad}, {id(p) for p in reduced}
    return bool(given) and given <= job and all(id(p) in given for p in reduced if p.grad is not None)
