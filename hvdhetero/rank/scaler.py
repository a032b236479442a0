"""A GradScaler of the script's own (`torch.amp.GradScaler`, or the older
`torch.cuda.amp.GradScaler`), as one-GPU AMP scripts use it:

    scaler = torch.amp.GradScaler("cuda")
    ...
        job.backward(scaler.scale(loss))
        scaler.unscale_(optimizer)          # before clipping, if the script clips
        job.clip_grad_norm_(1.0)
        scaler.step(optimizer)
        scaler.update()

Across ranks it would go wrong three ways; each is mended here:
- Between a step's micro-batches `scaler.step` unscaled gradients that were still accumulating
  (the next chunk added scaled ones to unscaled ones) and `update` moved the scale mid-step: for
  an optimizer job.prepare knows, `unscale_`, `step` and `update` wait for the step's last chunk.
- The ranks' scales differ: `torch.amp.GradScaler("cuda")` is disabled (scale 1) on the Mac's MPS
  rank or a CPU rank while the CUDA rank scales by 65536, and an elastic host joins with the
  initial scale. Summing S_0 g_0 + S_1 g_1 and dividing by one's own S is wrong, so under step
  sync job.backward takes each rank's scale from the tensor `scale()` returned, divides the
  rank's gradient by it before the sum and multiplies the sum by it after (rank/backward.py): the
  scaler's own unscale_ then yields the reduced gradient, exactly (the scales are powers of two).
  An inf or NaN in any rank's gradient is in the sum, so every rank skips that step, a rank whose
  scaler is disabled too.
- A step the scaler skips never calls optimizer.step(), so that rank counted no step: its
  checkpoints and local/diloco rounds fell out of step with the other ranks'. It counts now, as
  a skipped step (as --precision fp16's skips do).

The methods are replaced on the class, once, when a job prepares its optimizer; a scaler used
with an optimizer job.prepare did not see works as torch's.
"""

from __future__ import annotations

import torch

from hvdhetero.errors import ConfigError
from hvdhetero.rank.optimizer import JobOptimizer, prepared_of

_DEFERRED = "_hvdhetero_deferred"
"""Set on a scaler whose step() came between a step's micro-batches: its update() waits too."""


class _Scaled:
    """The GradScaler whose scale() ran since the last job.backward."""

    scaler: torch.amp.GradScaler | None = None


def claimed() -> torch.amp.GradScaler | None:
    """The script's GradScaler whose scale() ran since the last job.backward, whose loss came from
    it (`job.backward(scaler.scale(loss))`, or `scaler.scale(loss) / k`); a disabled one too."""
    scaler, _Scaled.scaler = _Scaled.scaler, None
    return scaler


def install() -> None:
    """Replace GradScaler's scale, unscale_, step and update (once a process)."""
    cls = torch.amp.GradScaler
    if "_hvdhetero_torch" in cls.__dict__:
        return
    scale, unscale_, step, update = cls._hvdhetero_torch = (cls.scale, cls.unscale_, cls.step, cls.update)

    def scale_(self, outputs):
        _Scaled.scaler = self
        return scale(self, outputs)

    def unscale(self, optimizer):
        prepared = prepared_of(optimizer)
        if _accumulating(prepared):
            return None  # unscaled once, after the step's last chunk
        if prepared is not None:
            prepared.flush()  # the gradient a script's own accumulation left pending, reduced first
        return unscale_(self, optimizer)

    def step_(self, optimizer, *args, **kwargs):
        prepared = prepared_of(optimizer)
        if prepared is None or not self.is_enabled():  # disabled: it calls optimizer.step(), which counts
            return step(self, optimizer, *args, **kwargs)
        if _accumulating(prepared):
            self.__dict__[_DEFERRED] = True
            return None
        self.__dict__.pop(_DEFERRED, None)
        calls = prepared.calls
        out = step(self, optimizer, *args, **kwargs)
        if prepared.calls == calls:  # it found an inf or NaN and left optimizer.step() out
            prepared.skipped()
        return out

    def update_(self, new_scale=None):
        if self.__dict__.pop(_DEFERRED, False) and new_scale is None:
            if self._per_optimizer_states:  # another optimizer stepped between the chunks: its state says so
                raise ConfigError("one GradScaler steps the optimizer job.prepare returned and another one: between "
                                  "micro-batches the prepared one waits for its step's last chunk, the other does not,"
                                  " and the scaler cannot update for one alone. Use a GradScaler per optimizer, or "
                                  "--micro-batch 0 (whole shares)")
            return None
        return update(self, new_scale)

    cls.scale, cls.unscale_, cls.step, cls.update = scale_, unscale, step_, update_


def _accumulating(prepared: JobOptimizer | None) -> bool:
    return prepared is not None and prepared.step_state.accumulating

