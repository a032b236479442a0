"""torch's `AveragedModel` (an EMA or SWA of the model, `torch.optim.swa_utils`) updated in a
script's loop body, as one-device scripts do after `optimizer.step()`: it averages once an
optimizer step, micro-batches or not.

With micro-batches the loop body runs once a chunk, and between a step's chunks the optimizer
does nothing, so `ema.update_parameters(model)` averaged the same parameters once a chunk: an EMA
of decay d decayed as d**k with k chunks a step (and SWA counted k copies of each step). Taken
over, `update_parameters` does nothing between a step's chunks: it runs once a step, after its
last chunk's reduction (called before job.backward, on the step's first chunk). An EMA of your
own making goes under `if job.sync_gradients:` (docs/api.md).

The method is replaced on the class by job.prepare, for every AveragedModel of the process, and
does what torch's does whenever no prepared job is between chunks.
"""

from __future__ import annotations

from torch.optim.swa_utils import AveragedModel

from hvdhetero.rank.step_state import StepState


class _Job:
    """The prepared job's place inside its step (None: no job, torch's behaviour)."""

    state: StepState | None = None


def take_over(state: StepState) -> None:
    """job.prepare: AveragedModel.update_parameters waits for the step's end from now on."""
    install()
    _Job.state = state


def release() -> None:
    """The job is over (an elastic reset drops it): every update averages again."""
    _Job.state = None


def install() -> None:
    """Replace AveragedModel.update_parameters (once a process)."""
    torchs = AveragedModel.update_parameters
    if getattr(torchs, "_hvdhetero_torch", None) is not None:
        return

    def update_parameters(self, model):
        if _Job.state is not None and _Job.state.accumulating:
            return None  # between a step's chunks: the parameters have not moved since the last update
        return torchs(self, model)

    update_parameters.__doc__ = torchs.__doc__
    update_parameters._hvdhetero_torch = torchs
    AveragedModel.update_parameters = update_parameters
