"""Where a step's seconds go, once its last chunk's job.backward is done (rank/training.py calls
these with itself): every rank's to the balancer (a new split to the loader and the metrics),
rank 0's against the fastest rank alone (policy/alone.py), this rank's to the records and the
live line; and a round's exchange (local/diloco) the same way.

    after_batch(t, item, seconds, reduce_s, times, walls, overflowed)   # a step (or a batch deferred)
    exchanged(t, sync, landed, after_step)                              # Rounds.on_exchange
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hvdhetero.rank import resume

if TYPE_CHECKING:
    from hvdhetero.rank.loader import Item
    from hvdhetero.rank.sync import ParameterSync
    from hvdhetero.rank.training import Training

NEVER_STEPPED = 50
"""Steps reduced with the prepared optimizer never stepped before rank 0 says so (a loop that
updates the parameters by hand; accumulation over fewer batches steps before)."""


def after_batch(t: Training, item: Item, seconds: float, reduce_s: float, times: list[float] | None, walls,
                overflowed: bool, calls: int = 1, pending_s: float = 0.0) -> None:
    """A batch's job.backward done (its step's last chunk), reduced or added to what is
    pending: counted, timed, and its step's `times` (every rank's compute over the `calls`
    batches the reduction covered, `pending_s` of it this rank's before this one) to the
    balancer, the live line and the metrics."""
    t.last_step_seconds = (seconds, reduce_s)
    t.step_state.backward_done(last=True, overflowed=overflowed)
    t.records.step_done(item.share, *t.last_step_seconds, steps=item.steps)
    unstepped_step(t)
    if t.resumed_own_loop is not None:
        resume.own_loop_went_on(t)
    t.passes.stepped(item, t.in_epochs)
    at, steps = t.count.at(item, len(t.loader), t.in_epochs, t.endless, t.records.steps,
                           t.train.step)
    if times is not None:
        if not t.in_epochs or not t.schedule.timed:  # no epoch's end has retimed checkpoints (yet)
            t.schedule.paced(walls)
        whole_s = pending_s + seconds + reduce_s  # rank 0's batches the reduction covered, start to end
        if not t.in_epochs and t.is_main:  # a loop of its own: no epoch record says what the ranks did
            t.records.window_step(list(item.sizes), times, whole_s, steps=calls)
        each = [s / calls for s in times]  # a batch's compute, each rank's mean over them
        # a new split goes on after the steps the loader drew (a loop fetching one batch ahead holds the next)
        rebalance(t, each, list(item.sizes), t.passes.held or item)
        if (t.is_main and t.size > 1 and t.strategy.kind == "step"
                and t.train.step - t.again_at > 1):  # the last step's times were whole
            against_alone(t, whole_s / calls, each, list(item.sizes))
    t.records.progress(samples=item.share, compute_s=seconds, wait_s=reduce_s,
                       exchanged=(t.strategy.rounds, t.strategy.last_exchange_s),
                       split=t.sampler.batch_sizes,  # the split in effect (an epoch's short last step aside)
                       step=at, epoch=t.train.epoch, steps=steps,
                       epochs=t.epochs if t.in_epochs else None,  # a loop of the script's own: not known
                       first=t.epochs_from,
                       taken=t.train.step)  # optimizer steps, as job.step (a step may take several)


def unstepped_step(t: Training) -> None:
    """One more reduced step the prepared optimizer has not stepped after: at the NEVER_STEPPED-th
    with no update yet, where the parameters moved all the same (updated by hand; unmoved, the
    script accumulates over many batches), rank 0 says the job's steps stand still. Costs an int
    compare a step, and a 16-value copy at the first."""
    t.unstepped += 1
    if t.step_state.updates or not t.reducer.params:
        return
    first = t.reducer.params[0].detach().reshape(-1)[:16]
    if t.unstepped == 1:
        t.before_steps = first.clone()
    elif (t.unstepped == NEVER_STEPPED and t.is_main and t.before_steps is not None
          and not torch.equal(t.before_steps, first)):
        print(f"hvdhetero: {NEVER_STEPPED} steps' gradients were reduced (job.backward) and the optimizer given to "
              "job.prepare never stepped: the job counts its steps by that optimizer's step() (job.step, "
              "metrics, checkpoints, a resume's place), so they all stand at step 0. Update through it "
              "(torch.optim.SGD(parameters, lr=lr) does what `p.data += -lr * p.grad` does; set its "
              "param_groups' lr where the script changes lr)", flush=True)


def against_alone(t: Training, step_s: float, times: list[float], sizes: list[float], steps: int = 1,
                  step: int | None = None) -> None:
    """Rank 0: the first time the job is clearly slower than its fastest rank would be alone
    (policy/alone.py), a record and a line saying what to do instead. Step sync: a step (its
    compute and whole seconds), before the optimizer's; local/diloco: a round of `steps`
    (every rank's mean seconds a global step), at global `step`."""
    verdict = t.alone.observe(step_s, times, sizes, steps)
    if verdict is None:
        return
    step = t.train.step + 1 if step is None else step
    slow = verdict.waited_for(times)
    t.records.write("slower_than_alone", step=step, rank=verdict.fastest, alone_s=round(verdict.alone_s, 5),
                    job_s=round(verdict.job_s, 5), ratio=round(verdict.ratio, 4), slowest=slow)
    slowed = t.slowdowns[slow] if slow < len(t.slowdowns) else 1.0
    print(verdict.line(step, t.host_names, times, sizes, equal_split=t.config.equal_split,
                       auto=t.config.sync == "auto",
                       inner=None if t.strategy.kind == "step" else t.config.inner_steps)
          + (f". Rank {slow} runs {slowed:g}x slower on purpose (--slowdown, or the inventory's `slowdown:` for "
             f"{t.host_names[slow]}): an experiment's straggler" if slowed > 1.0 else ""), flush=True)


def rebalance(t: Training, times: list[float], sizes: list[float], item: Item, after_step: int | None = None) -> None:
    """Every rank's step seconds (and the samples they took) to the balancer; a new split
    reaches the loader (and the metrics) for the step it takes effect at."""
    if t.config.equal_split:
        return
    new = t.balancer.observe(times, sizes, step=item.step)
    if new:
        at = item.step if after_step is None else after_step
        effective = t.loader.resplit(new, at)
        # a loop that took the loader again within an epoch numbers its passes' steps alike: counted
        # from job.step (before this step's optimizer step; a round's exchange comes after it)
        step = t.train.step - (after_step is not None) + effective - at if t.count.taken_again \
            else t.counted(effective)
        t.records.write("split", step=step, split=new, reason=t.balancer.reason,
                        fallback=t.balancer.fallback)


def exchanged(t: Training, sync: ParameterSync, landed: tuple[list[float], list[float]] | None, after_step: int,
              count: bool = True) -> None:
    """Rounds.on_exchange, after a round's end or a flush: its record in the metrics, and the
    round that landed (every rank's mean step seconds and samples per step in it) to the
    balancer. `count`: its seconds go to this epoch's communication time."""
    item = t.step_state.item
    if item is None:
        return
    if count:
        t.records.communicated(sync.last_exchange_s)
    t.records.write("exchange", step=t.train.step, round=sync.rounds, applied=sync.applied,
                    split=list(t.sampler.batch_sizes), seconds=round(sync.last_exchange_s, 4),
                    wait_s=round(sync.wait_s, 4), link_late=sync.link_late, inner_steps=sync.inner_steps)
    if landed is not None:
        if not t.in_epochs:  # a loop of its own: the round's slowest mean step retimes the checkpoints
            t.schedule.retime(max(landed[0]))
        rebalance(t, *landed, item, after_step)
        steps = sync.landed_steps
        if t.is_main and t.size > 1 and len(landed[0]) == t.size and steps >= t.strategy.every:
            # rank 0's whole round (a flush's part round aside): its own steps, then what its
            # round's end blocked it (the slowest rank ending the round, the exchange), a step's share
            against_alone(t, landed[0][t.rank] + sync.last_exchange_s / steps, landed[0], landed[1], steps,
                          step=t.train.step)
