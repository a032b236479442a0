"""Where overlapped local/DiLoCo rounds end, as every rank decides it alone: a rank that merges
steps (--inner-steps by-speed, RoundClock.merge) must end each round at the same global step as
one that does not (RoundClock.due, and RoundClock.ends_with_epoch at an epoch's end), or the
ranks meet at different steps and the job stops. Replayed on integers, step by step, as the
loader numbers steps (epoch * steps_per_epoch + s) and the job counts them."""

from __future__ import annotations

import pytest

from hvdhetero.policy.round_clock import RoundClock

SPLIT = [490, 22]
"""A rank 22x slower: it merges about 22 global steps into one optimizer step."""


def round_ends(rank: int, every: int, steps_per_epoch: int, epochs: int, in_epochs: bool = True,
               cap: int | None = None) -> list[int]:
    """The global steps after which `rank` ends a round, over `epochs` epochs (the run's end,
    which flushes whatever is left, not included)."""
    clock = RoundClock(every, overlap=True)
    ends, done = [], 0
    for epoch in range(epochs):
        s = 0
        while s < steps_per_epoch:
            merged = clock.merge(epoch * steps_per_epoch + s, steps_per_epoch - s, SPLIT[rank], max(SPLIT),
                                 in_epochs, cap)
            s += merged
            done += merged
            clock.took(merged)
            item_step = epoch * steps_per_epoch + s - 1
            epoch_left = (epoch + 1) * steps_per_epoch - 1 - item_step if in_epochs else None
            if clock.due(epoch_left):
                ends.append(done)
                clock.restart(done)
        if in_epochs and clock.ends_with_epoch(more_epochs=epoch + 1 < epochs):  # after the epoch's collectives
            ends.append(done)
            clock.restart(done)
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


def test_a_merged_step_stays_within_its_hosts_memory_cap():
    """A cap of 44 samples on the slow rank (22 a step): it merges 2 steps, not 22, and still
    ends every round where the fast rank does."""
    capped, fast = round_ends(1, 32, 96, epochs=3, cap=44), round_ends(0, 32, 96, epochs=3)
    assert capped == fast
    clock = RoundClock(32, overlap=True)
    assert clock.merge(0, 96, 22, 490, in_epochs=True, cap=44) == 2
    assert clock.merge(0, 96, 22, 490, in_epochs=True) == 22


def test_a_round_is_due_at_h_steps_and_not_before():
    clock = RoundClock(4)
    for _ in range(3):
        clock.took()
        assert not clock.due(epoch_left=None)
    clock.took()
    assert clock.due(epoch_left=0), "without overlap a round ends at H steps, at an epoch's end too"
    overlapped = RoundClock(4, overlap=True, steps=4)
    assert not overlapped.due(epoch_left=3) and overlapped.due(epoch_left=4) and overlapped.due(epoch_left=None)
    assert RoundClock(4, overlap=True, steps=8).due(epoch_left=0), "never past 2H"
    assert (clock.updates, clock.steps) == (4, 4)
