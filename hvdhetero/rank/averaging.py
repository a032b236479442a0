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

Its BatchNorm statistics, where the ranks average the model's (`buffers`: an epoch's end, a
loop's end, job.evaluate, job.save), are made one too: an AveragedModel that copies the model's
buffers (torch's default, use_buffers=False) copied each rank's own at its last update, before
the average, and one that averages them (use_buffers=True, torchvision's EMA) averaged each
rank's own: its ranks printed different EMA accuracies under step sync. Now the first takes the
averaged buffers again and the second's are averaged across ranks (where every rank updates as
many: the count rides along with the model's buffers, so a rank-0-only EMA stays as it was).

`torch.optim.swa_utils.update_bn(loader, swa_model)` over the prepared loader recomputes the
statistics over this rank's share alone: taken over (by the runner before the script starts, so
`from torch.optim.swa_utils import update_bn` gets it too), the ranks' statistics are then
averaged, weighted by the samples each forwarded, the same on every rank; over any other
loader (every sample on every rank) it is torch's.
"""

from __future__ import annotations

import weakref

import horovod.torch as hvd
import torch
from torch.optim import swa_utils
from torch.optim.swa_utils import AveragedModel

from hvdhetero.rank import batches
from hvdhetero.rank.collectives import allreduce_, broadcast_
from hvdhetero.rank.loader import Loader
from hvdhetero.rank.reducer import average_buffers
from hvdhetero.rank.step_state import StepState


class _Job:
    """The prepared job's place inside its step (None: no job, torch's behaviour)."""

    state: StepState | None = None
    sources: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    """Every AveragedModel updated in this process -> a weak reference to the model it last averaged."""
    updated: weakref.WeakSet = weakref.WeakSet()
    """Those updated since the ranks last made their buffers one (or update_bn recomputed them)."""
    said = False
    """Whether rank 0 said that the ranks update different counts of AveragedModels."""
    unsaved: weakref.WeakSet = weakref.WeakSet()
    """AveragedModels already said to be in no checkpoint."""


def take_over(state: StepState) -> None:
    """job.prepare: AveragedModel.update_parameters waits for the step's end from now on."""
    install()
    _Job.state = state


def release() -> None:
    """The job is over (an elastic reset drops it): every update averages again."""
    _Job.state = None


def install() -> None:
    """Replace AveragedModel.update_parameters and swa_utils.update_bn (once a process)."""
    torchs = AveragedModel.update_parameters
    if getattr(torchs, "_hvdhetero_torch", None) is not None:
        return

    def update_parameters(self, model):
        _Job.sources[self] = weakref.ref(model)
        _Job.updated.add(self)
        if _Job.state is not None and _Job.state.accumulating:
            return None  # between a step's chunks: the parameters have not moved since the last update
        return torchs(self, model)

    update_parameters.__doc__ = torchs.__doc__
    update_parameters._hvdhetero_torch = torchs
    AveragedModel.update_parameters = update_parameters
    torchs_bn = swa_utils.update_bn

    def update_bn(loader, model, device=None):
        _Job.updated.discard(model)  # its statistics are these from now on, not the model's copied again
        if not isinstance(loader, Loader) or _Job.state is None or hvd.size() == 1:
            return torchs_bn(loader, model, device)
        seen = [0]

        def counted():
            for batch in loader.untrained():  # no step's clock, checkpoint or pass's end: nothing trains
                seen[0] += batches.size(batch)
                yield batch
        torchs_bn(counted(), model, device)
        _weighted_statistics(model, seen[0])
        return None

    update_bn.__doc__ = torchs_bn.__doc__
    update_bn._hvdhetero_torch = torchs_bn
    swa_utils.update_bn = update_bn


def buffers(model: torch.nn.Module) -> None:
    """The model's BatchNorm-style buffers averaged across ranks (reducer.average_buffers; every
    rank calls it), and every AveragedModel updated from it (or a part of it) since the last time
    given one copy: torch's default one takes the averaged buffers (as its update would have
    copied them), one with use_buffers=True has its own averaged. One not updated since keeps its
    own (SWA's statistics from update_bn, evaluated or saved after it)."""
    ours = {id(b) for b in model.buffers()}
    mine = [(a, source) for a, ref in list(_Job.sources.items())
            if a in _Job.updated and (source := ref()) is not None and _part_of(source, model, ours)]
    for a, _ in mine:
        _Job.updated.discard(a)
    averaged = [b for a, _ in mine if a.use_buffers for b in a.module.buffers() if b.is_floating_point()]
    if not average_buffers(model, averaged) and averaged and hvd.rank() == 0 and not _Job.said:
        _Job.said = True
        print("hvdhetero: the ranks update different counts of AveragedModels (an EMA or SWA updated on some ranks "
              "only): their BatchNorm statistics stay each rank's own", flush=True)
    for a, source in mine:
        if not a.use_buffers:  # as torch's update_parameters does, from the buffers as the ranks now have them
            for b_avg, b_model in zip(a.module.buffers(), source.buffers()):
                b_avg.detach().copy_(b_model.detach().to(b_avg.device))


def unsaved(model: torch.nn.Module, held) -> list[int]:
    """The AveragedModels of `model` (an EMA or SWA updated from it or a part of it) that are
    neither `held` (objects a checkpoint saves: job.track's, the model) nor a module of one, and
    not said before: the updates each averaged. A resume made them again from the model, and
    the average started over, without a word (a helper's DDPM port, its EMA not job.track'ed)."""
    ours = {id(b) for b in model.buffers()} | {id(p) for p in model.parameters()}
    inside = {id(m) for h in held if isinstance(h, torch.nn.Module) for m in h.modules()} | {id(h) for h in held}
    found = []
    for a, ref in list(_Job.sources.items()):
        source = ref()
        if source is None or a in _Job.unsaved or id(a) in inside:
            continue
        if _part_of(source, model, ours) or any(id(p) in ours for p in source.parameters()):
            _Job.unsaved.add(a)
            found.append(int(a.n_averaged))
    return found


def _part_of(source: torch.nn.Module, model: torch.nn.Module, ours: set[int]) -> bool:
    """Whether `source`'s buffers are `model`'s (`ours`: their ids): the model itself, a part of it,
    torch.compile's wrapper."""
    theirs = [id(b) for b in source.buffers()]
    return source is model or (bool(theirs) and all(b in ours for b in theirs))


def _weighted_statistics(model: torch.nn.Module, samples: int) -> None:
    """After update_bn over this rank's share (`samples`): each BatchNorm's running mean and
    variance averaged over the ranks weighted by their samples, the step counts rank 0's."""
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
             and m.running_mean is not None]
    if not norms:
        return
    floats = [b for m in norms for b in (m.running_mean, m.running_var)]
    flat = torch.cat([*(b.detach().cpu().to(torch.float64).reshape(-1) * samples for b in floats),
                      torch.tensor([float(samples)], dtype=torch.float64)])
    allreduce_(flat, hvd.Sum, "hvdhetero.update_bn", "update_bn over the prepared loader (every rank calls it: each "
               "forwards its share, and the statistics are averaged over the ranks)")
    if flat[-1] > 0:
        for b, chunk in zip(floats, (flat[:-1] / flat[-1]).split([b.numel() for b in floats])):
            b.copy_(chunk.view_as(b).to(b.dtype))
    counts = [m.num_batches_tracked for m in norms if m.num_batches_tracked is not None]
    if counts:
        flat = torch.cat([c.detach().cpu().to(torch.int64).reshape(-1) for c in counts])
        broadcast_(flat, 0, "hvdhetero.update_bn_counts", "update_bn over the prepared loader")
        for c, n in zip(counts, flat):
            c.fill_(int(n))
