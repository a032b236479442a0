"""Where overlapped local/DiLoCo rounds end, as every rank decides it alone: a rank that merges
steps (--inner-steps by-speed, rounds.merged) must end each round at the same global step as one
that does not (ParameterSync.round_due and the epoch's end in rounds.end_epoch), or the ranks
meet at different steps and the job stops. Replayed in one process, step by step, as the loader
numbers steps (epoch * steps_per_epoch + s)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hvdhetero.rank import rounds
from hvdhetero.rank.sync import ParameterSync

SPLIT = [490, 22]
"""A rank 22x slower: it merges about 22 global steps into one optimizer step."""


def round_ends(rank: int, every: int, steps_per_epoch: int, epochs: int, in_epochs: bool = True) -> list[int]:
    """The global steps after which `rank` ends a round, over `epochs` epochs (the run's end,
    which flushes whatever is left, not included)."""
    sync = ParameterSync(torch.nn.Linear(2, 2), "diloco", every, sum(SPLIT), overlap=True)
    job = SimpleNamespace(_sync=sync, _round_origin=0, rank=rank, _in_epochs=in_epochs, _stopping=False,
                          epoch=0, _epochs=epochs, me=SimpleNamespace(max_batch=None),
                          _prepared=SimpleNamespace(sampler=SimpleNamespace(batch_sizes=SPLIT)))
    ends, done = [], 0
    for epoch in range(epochs):
        job.epoch, s = epoch, 0
        while s < steps_per_epoch:
            merged = rounds.merged(job, epoch * steps_per_epoch + s, steps_per_epoch - s)
            s += merged
            done += merged
            sync.round_steps += merged
            item_step = epoch * steps_per_epoch + s - 1
            epoch_left = (epoch + 1) * steps_per_epoch - 1 - item_step if in_epochs else None
            if sync.round_due(epoch_left):
                ends.append(done)
                sync.round_steps, job._round_origin = 0, done
        if in_epochs and rounds.ends_with_epoch(job):  # rounds.end_epoch, after the epoch's collectives
            ends.append(done)
            sync.round_steps, job._round_origin = 0, done
    return ends


@pytest.mark.parametrize("every, steps_per_epoch", [(4, 23), (32, 96), (32, 100), (30, 23), (64, 23), (23, 23),
                                                    (8, 7)])
def test_a_merging_rank_ends_every_round_where_the_others_do(every, steps_per_epoch):
    fast, slow = (round_ends(rank, every, steps_per_epoch, epochs=6) for rank in (0, 1))
    assert fast == slow, (fast, slow)
    lengths = [b - a for a, b in zip([0, *fast], fast)]
    # never shorter than H (what the plan hides an exchange behind), shorter than 2H
    assert lengths and all(every <= n < 2 * every for n in lengths), lengths
    # each ends where H steps or more of the epoch are left, or at an epoch's end
    assert all(e % steps_per_epoch == 0 or steps_per_epoch - e % steps_per_epoch >= every for e in fast), fast


def test_rounds_end_with_the_epoch_only_where_they_would_leave_fewer_than_h_steps_of_it():
    assert round_ends(0, 4, 23, epochs=2) == [4, 8, 12, 16, 23, 27, 31, 35, 39]  # 4, 4, 4, 4, 7; the last flushed
    assert round_ends(0, 30, 23, epochs=3) == [46]  # a round of 30+ ends at the first epoch's end 30 steps on


def test_outside_job_epochs_rounds_are_every_h_steps():
    """A loop over the loader that job.epochs does not end (the throughput bench): rounds of H,
    whatever the loader's passes, on every rank alike."""
    for every, steps_per_epoch in [(32, 96), (32, 100), (4, 23)]:
        fast, slow = (round_ends(rank, every, steps_per_epoch, epochs=4, in_epochs=False) for rank in (0, 1))
        assert fast == slow == list(range(every, 4 * steps_per_epoch + 1, every))[:len(fast)], (fast, slow)
