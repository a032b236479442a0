"""What one job.backward does, and the reduction of what it added (rank/training.py calls these
with itself).

    job.backward(loss)   -> backward(t, loss, item): the chunk its loss came from (rank/passes.py),
                            the loss scaled for its share and the job's loss scale, backpropagated;
                            on the step's last chunk the strategy reduces (step sync) or checks
                            (local/diloco) the gradients, timed, and step_end.after_batch
    optimizer.step() etc -> flush(t): what a script's own accumulation left pending, reduced sooner
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from hvdhetero.rank import gathering, reaching, scaler, step_end, trainable
from hvdhetero.rank.reducer import scale_gradients

if TYPE_CHECKING:
    from hvdhetero.rank.loader import Item
    from hvdhetero.rank.training import Training


def backward(t: Training, loss: torch.Tensor, item: Item, **kwargs) -> None:
    """Backward of a chunk's loss; on the step's last chunk the strategy reduces (step sync) or
    checks (local/diloco) the gradients, and every rank's step time reaches the balancer."""
    # a loop fetching one batch ahead: an explicit split into chunks refused, and the item the batch it
    # holds (not the one ahead) from here on, to the optimizer's step (`trained`)
    t.backwards += 1
    ahead, item = t.passes.backward(item)
    if ahead:
        t.accumulation.one_ahead(t.step_state.item)
    t.trained = item
    if item.chunk == 0 and not t.step_state.reduced:
        trainable.follow(t, before_forward=False)
    if t.check_reach:
        t.check_reach = False
        reaching.check(loss, t.reducer.params, t.model)
    theirs = scaler.claimed()  # job.backward(scaler.scale(loss)): a GradScaler of the script's own
    theirs_scale = theirs.get_scale() if theirs is not None else 1.0
    if not t.step_state.reevaluating:  # (a closure's later evaluations: the step's loss is its first's)
        t.records.loss(float(loss.detach()) / theirs_scale, item.n)
    scale = item.n / item.share if item.chunks > 1 else 1.0
    if t.loss_scale is not None:
        scale *= t.loss_scale.scale
        # gradients kept from earlier steps (a script that accumulates), or this step's reduced
        # ones (a second job.backward of the step), unscaled: scaled alike before this backward adds
        if not t.grads_scaled:
            scale_gradients(t.reducer.params, t.loss_scale.scale)
            t.grads_scaled = True
    weight = item.share / sum(item.sizes)
    unscale = 1.0 / t.loss_scale.scale if t.loss_scale is not None else 1.0
    # Step sync sums the ranks' gradients: each rank's own scale out before, in again after (rank/scaler.py).
    # Under local/diloco the script's scaler unscales this rank's own gradients itself.
    summed = theirs is not None and t.strategy.kind == "step"
    rescale = theirs_scale if summed else 1.0
    unscale /= rescale
    common = theirs is None  # the job's own loss scale, every rank's: it may stay on the wire (strategy._on_wire)
    # A second job.backward of a step already reduced (two losses backpropagated in turn, the
    # first with retain_graph=True): what it added is reduced too (the ranks' weights sum to 1,
    # so the first's reduced part stays as it is), but the step is timed and counted once.
    # (or a GAN's generator after its discriminator, or LBFGS's closure evaluated again within its step)
    again = t.step_state.reduced or t.step_state.stepped or t.step_state.reevaluating
    defer = False  # a script's own accumulation: this batch's gradient added, reduced with its step's last
    if item.chunk == 0 and not again:  # the split moved within the step: the pending sum to this weight
        scale_gradients(t.reducer.params, t.deferral.rescale(weight))
    if item.last and not again:
        defer = t.deferral.call()
    elif item.last and t.deferral.pending:
        t.deferral.again()  # two losses in turn: this reduction takes what is pending; each reduces from now
    if item.last and not defer:
        t.strategy.before_last_backward(weight, unscale, common)
    (loss * scale if scale != 1.0 else loss).backward(**kwargs)
    if not item.last:
        t.step_state.backward_done(last=False)
        return
    gathered = gathering.waited()  # job.gather's collectives: waiting for the others is not this rank's work
    if not again:
        t.me.device.synchronize()
        began, busy0, slept = t.step_began
        t.me.finish_step(item.share, t.me.busy_clock()() - busy0 - gathered,
                         time.perf_counter() - began - gathered, slept)
    seconds = time.perf_counter() - t.step_began[0] - gathered
    if defer:
        t.deferral.deferred(weight, seconds)
        t.deferred_as = (unscale, common, rescale, t.loss_scale is not None or summed)
        trainable.share(t.unshared)  # parameters made in this batch's loop body take rank 0's now, as reduced
        t.unshared = []
        step_end.after_batch(t, item, seconds, 0.0, None, None, overflowed=False)
        return
    # Step sync: each rank's step time rides along with the gradients, and every rank gets all
    # of them. local:H / diloco:H: this rank steps on its own gradient, unscaled here, and skips alone.
    check = t.loss_scale is not None or summed  # an inf on any rank is in the sum: all skip alike
    turns = t.in_turn  # several optimizers: each decides on its own gradients as it steps
    calls, pending_s = t.deferral.reduced()  # a step's batches added before this one ride with it
    times, reduce_s, overflowed, walls = t.strategy.reduce(
        weight, unscale, seconds + pending_s, check and turns is None, t.train.step, common, t.last_wall)
    if turns is not None:
        turns.reduced(check)
    reduced(t, rescale)
    if again:
        t.again_at = t.train.step
        if overflowed and not t.step_state.skip and t.loss_scale is not None:
            t.loss_scale.update(True)
        t.step_state.backward_done(last=True, overflowed=overflowed or t.step_state.skip)
        return
    if t.loss_scale is not None and turns is None:
        t.loss_scale.update(overflowed)
    step_end.after_batch(t, item, seconds, reduce_s, times, walls, overflowed, calls + 1, pending_s)


def flush(t: Training) -> None:
    """What a script's own accumulation left pending (rank/deferral.py), reduced now: the
    optimizer steps, a clip or a GradScaler's unscale_ reads the gradients, sooner than the
    step's calls were predicted to end. Untimed (the balancer waits for a whole step's)."""
    if not t.deferral.pending:
        return
    weight = t.deferral.weight
    unscale, common, rescale, check = t.deferred_as
    t.deferral.reduced()
    _, _, overflowed, _ = t.strategy.reduce(weight, unscale, 0.0, check, t.train.step, common, t.last_wall)
    reduced(t, rescale)
    if t.loss_scale is not None:
        t.loss_scale.update(overflowed)
    t.step_state.skip = t.step_state.skip or overflowed


def reduced(t: Training, rescale: float) -> None:
    """After a reduction (a step's, or a flush of what was pending): a script's GradScaler's
    scale back in (`rescale`), the job's loss scale out, and parameters made inside the step's
    loop body (rank/trainable.py) given rank 0's values."""
    scale_gradients(t.reducer.params, rescale)
    t.grads_scaled = False
    trainable.share(t.unshared)
    t.unshared = []

