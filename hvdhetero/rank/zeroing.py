"""`model.zero_grad()`, the module's own, as pytorch/examples' word_language_model and DCGAN
call it at the top of every batch: between a step's micro-batches it zeroes nothing.

The prepared optimizer's `zero_grad` waits for the step's end (rank/optimizer.py), but a loop
that zeroes through the model did not: with `--micro-batch N`, or the micro-batches `auto` picks
for a batch over 64, each chunk wiped the gradients the chunks before it had accumulated, and
the step trained on its last chunk's alone (a two-layer net after 8 steps of 64 in chunks of 8:
parameters summing to -1.652 where one piece gives -1.549). Taken over, `nn.Module.zero_grad`
does nothing between a step's chunks for a module holding parameters the job reduces (the
prepared model, a part of it, or a container that holds it: a ModuleDict of it and a teacher
zeroes neither); any other module, and every module without a prepared job, zeroes as torch's
does.

Replaced on nn.Module (once a process) by job.prepare: nothing is stored on the script's model,
so `torch.save(model)` and `copy.deepcopy(model)` carry nothing of the job.
"""

from __future__ import annotations

import torch

from hvdhetero.rank.step_state import StepState


class _Job:
    """The prepared job's place inside its step and the parameters it reduces (None: torch's)."""

    state: StepState | None = None
    params: list = []
    """The reducer's own list, kept up to date as parameters are unfrozen or made after prepare."""


def take_over(state: StepState, params) -> None:
    """job.prepare: a zero_grad of a module holding any of `params` (the reducer's list, which
    follows the parameters unfrozen or made later) waits for the step's end."""
    install()
    _Job.state, _Job.params = state, params


def release() -> None:
    """The job is over (an elastic reset drops it): every module zeroes as torch's does."""
    _Job.state, _Job.params = None, []


def install() -> None:
    """Replace torch.nn.Module.zero_grad (once a process)."""
    torchs = torch.nn.Module.zero_grad
    if getattr(torchs, "_hvdhetero_torch", None) is not None:
        return

    def zero_grad(self, set_to_none: bool = True) -> None:
        state = _Job.state
        if state is not None and state.accumulating:
            reduced = {id(p) for p in _Job.params}
            if any(id(p) in reduced for p in self.parameters()):
                return None  # between a step's chunks: the gradients are the step's, still accumulating
        return torchs(self, set_to_none)

    zero_grad.__doc__, zero_grad.__qualname__ = torchs.__doc__, torchs.__qualname__
    zero_grad._hvdhetero_torch = torchs
    torch.nn.Module.zero_grad = zero_grad
