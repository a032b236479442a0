"""The Job's side of local:H and diloco:H: how many global steps a merging rank takes as one,
the exchange at a round's end (and overlapped, at an epoch's end), its record in the metrics and
the balancer's hearing of it. Where rounds end is the round clock's (policy/round_clock.py);
ParameterSync (rank/sync.py) does the exchange itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hvdhetero.rank.job import Job


def merged(job: Job, step: int, left: int) -> int:
    """--inner-steps by-speed: how many global steps from `step` on this rank takes as one
    optimizer step (`RoundClock.merge`: about the largest share's batch, never past the round's
    end, so that every rank's merged step ends where the round does)."""
    sizes = job._prepared.sampler.batch_sizes
    return job._sync.clock.merge(step, left, sizes[job.rank], max(sizes), job._in_epochs, job.me.max_batch)


def after_step(job: Job) -> bool:
    """The prepared optimizer stepped (or skipped): count the step and, at a round's end,
    exchange parameters and feed the balancer the round's times. Whether a round ended."""
    item = job._item
    if job._sync is None or item is None:
        return False
    # steps of the epoch left after this one, in the loader's numbering (as `merged` counts)
    steps = len(job._prepared.loader) if job._prepared and job._in_epochs else 0
    landed = job._sync.after_step(item.share, job.last_step_seconds[0], item.steps,
                                  epoch_left=(job.epoch + 1) * steps - 1 - item.step if steps else None)
    if job._sync.round_steps:
        return False
    exchanged(job, landed, after_step=item.step)
    return True


def one_model(job: Job) -> None:
    """Exchange the partial round (and the one in flight) now, so that what is evaluated or
    saved is one model on every rank. Only there: a flush at every epoch's end cost one exposed
    exchange an epoch (10-20% at the emulated Wi-Fi ratio with 96-step epochs, measured).
    Under step sync there is one model already: nothing to do."""
    if job._sync is None:
        return
    if job._sync.unsettled:
        # A new split from what a flush lands takes effect after the round that starts now:
        # merged steps up to its end may be drawn already (the checkpoint taken at a step's
        # start flushes after the step's indices were drawn).
        exchanged(job, job._sync.flush(), after_step=job.step + job._sync.every - 1)
    job._sync.pause_clock()  # what follows (an evaluation, a save) is not a step's work


def end_epoch(job: Job) -> float:
    """Overlapped, after the epoch's record: a round of H steps or more ends with the epoch and
    its exchange is launched (a shorter one runs on into the next epoch; the last epoch's lands
    in the run's end). Returns the seconds it blocked this rank (the round before it landing),
    which the next epoch counts as communication."""
    if not ends_with_epoch(job):
        return 0.0
    exchanged(job, job._sync.exchange(), after_step=job.step, count=False)
    return job._sync.last_exchange_s


def ends_with_epoch(job: Job) -> bool:
    """Whether the round in progress ends with this epoch: overlapped, H steps or more, and
    another epoch follows (the run's end, or a stop, flushes it instead)."""
    sync = job._sync
    return sync is not None and not job._stopping and sync.clock.ends_with_epoch(job.epoch + 1 < job._epochs)


def exchanged(job: Job, landed: tuple[list[float], list[float]] | None, after_step: int,
              count: bool = True) -> None:
    """After a round's end or a flush: its record in the metrics, and the round that landed
    (every rank's mean step seconds and samples per step in it) to the balancer. `count`: its
    seconds go to this epoch's communication time."""
    item, p, sync = job._item, job._prepared, job._sync
    sync.clock.restart(job.step)  # a round ended or was flushed: the next one starts here
    if item is None:
        return
    if count:
        job._busy[1] += sync.last_exchange_s
    job._write("exchange", step=job.step, round=sync.rounds, applied=sync.applied,
               split=list(p.sampler.batch_sizes), seconds=round(sync.last_exchange_s, 4),
               wait_s=round(sync.wait_s, 4), link_late=sync.link_late, inner_steps=sync.inner_steps)
    if landed is not None:
        job._rebalance(*landed, item, after_step)
