"""rank/passes.py: the epoch each pass over the prepared loader deals, driven step by step as the
loader and job.backward drive them (no process: the ranks' side of it runs in
tests/jobs/api_passes.py and api_start.py)."""

from __future__ import annotations

from dataclasses import dataclass

from hvdhetero.rank.loader import Item
from hvdhetero.rank.passes import Passes
from hvdhetero.rank.registry import TrainState

STEPS = 6
"""Steps a pass over the loader takes."""


@dataclass
class Loader:
    start_step: int = 0
    iterating: int = 1
    """Passes under way (2: a look at a batch inside the loop's pass)."""
    start_again: int = 0

    def __len__(self) -> int:
        return STEPS


def passes(start_step: int = 0, epoch: int = 0) -> Passes:
    made = Passes(TrainState(epoch=epoch))
    made.loader = Loader(start_step)
    return made


def take(p: Passes, steps: int, in_epochs: bool = False) -> list[int]:
    """A pass as a loop takes it: its epoch asked at iter(), `steps` steps taken. The loader steps
    taken."""
    epoch = p.epoch(in_epochs)
    taken = []
    for step in range(epoch * STEPS, epoch * STEPS + steps):
        p.stepped(Item(step, 0, 1, 8, 8, (8, 8)), in_epochs)
        taken.append(step)
    return taken


def test_a_loop_over_steps_deals_each_pass_that_follows_a_step_a_new_epoch():
    p = passes()
    assert take(p, STEPS) == list(range(6)) and p.train.epoch == 0
    assert take(p, 3) == [6, 7, 8] and p.train.epoch == 1  # cut short by a step budget
    assert p.epoch(False) == 2  # a new iterator after the cut: a new order, as a DataLoader's
    p.stepped(Item(12, 0, 1, 8, 8, (8, 8)), False)
    assert p.train.epoch == 2 and p.epoch(False) == 3


def test_a_pass_that_takes_no_step_starts_no_epoch():
    p = passes()
    assert p.epoch(False) == 0  # next(iter(loader)) before the loop: drawn only
    assert take(p, 4) == [0, 1, 2, 3]
    assert p.epoch(False) == 1  # rank 0's look at a batch inside the pass: the next epoch's, moving nothing
    for step in (4, 5):  # the pass's last steps
        p.stepped(Item(step, 0, 1, 8, 8, (8, 8)), False)
    assert p.train.epoch == 0 and p.epoch(False) == p.epoch(False) == 1  # rank 0's pass alone, then every rank's


def test_a_pass_of_the_scripts_own_after_job_epochs_deals_the_next_epoch():
    p = passes(epoch=3)
    p.train.epoch = 3
    assert take(p, STEPS, in_epochs=True) == list(range(18, 24))
    p.train.epoch = 4
    assert take(p, STEPS, in_epochs=True) == list(range(24, 30))
    assert p.epoch(False) == 5  # it dealt epoch 4 again: its order and its step numbers
    assert take(p, STEPS) == list(range(30, 36)) and p.train.epoch == 5


def test_a_resumed_loop_deals_where_the_loader_stands_and_a_batch_function_one_pass():
    p = passes(start_step=12, epoch=1)  # a checkpoint taken as pass 2's first step came: epoch 1's, loader at 12
    assert p.epoch(False) == 2
    p.stepped(Item(12, 0, 1, 8, 8, (8, 8)), False)
    assert p.train.epoch == 2 and p.epoch(False) == 3
    batch_function = passes()
    batch_function.one_pass = True
    batch_function.stepped(Item(40, 0, 1, 8, 8, (8, 8)), False)
    assert batch_function.epoch(False) == batch_function.epoch(True) == 0 and batch_function.train.epoch == 0


def test_inside_job_epochs_a_pass_begun_again_within_an_epoch_deals_an_order_of_its_own():
    """FixMatch's labelled loader restarted with iter() within each of job.epochs' epochs: every
    pass after one that took a step counts on (the sampler's order of its own for it); a look at
    the first batch (no step) deals what the pass after it deals; the next epoch starts at 0."""
    p = passes()
    seen = []
    for epoch in range(2):
        p.train.epoch = epoch
        take(p, 0, in_epochs=True)  # next(iter(loader)), a look before the loop (the DDP tutorial's)
        seen.append(p.again)
        for _ in range(3):
            take(p, STEPS, in_epochs=True)
            seen.append(p.again)
        take(p, 0, in_epochs=True)
        seen.append(p.again)
    assert seen == [0, 0, 1, 2, 3, 0, 0, 1, 2, 3]
    take(p, 2)  # a pass of the script's own after job.epochs: its order by its epoch alone
    assert p.again == 0


def test_the_pass_a_checkpoint_holds_is_the_loops_own_and_a_resume_goes_on_in_it():
    """Inside job.epochs, the second of an epoch's passes under way: a look at a batch inside it
    (rank 0's alone, to log a sample) deals its order and counts nothing (it had moved rank 0's
    passes' orders off the others', and a checkpoint had held the look's count). A resume goes on
    in the checkpoint's pass, a look at a batch before job.epochs' loop (outside it) in between;
    a loop fetching one batch ahead, checkpointed as the next pass's first batch is handed out,
    goes on in the pass of the batch it holds."""
    p = passes(epoch=1)
    take(p, STEPS, in_epochs=True)
    take(p, 2, in_epochs=True)
    p.loader.iterating = 2
    take(p, 0, in_epochs=True)  # the look, inside the pass
    p.loader.iterating = 1
    assert p.again == 1 and p.state_dict() == {"epoch": 1, "again": 1}
    assert (take(p, 1, in_epochs=True), p.again) == ([STEPS], 2), "the epoch's third pass"

    resumed = passes(epoch=1)
    resumed.load_state_dict({"epoch": 1, "again": 1})
    assert resumed.loader.start_again == 1
    take(resumed, 0)  # next(iter(loader)) before job.epochs' loop
    take(resumed, STEPS, in_epochs=True)
    assert resumed.state_dict() == {"epoch": 1, "again": 1}
    take(resumed, 1, in_epochs=True)
    assert resumed.again == 2

    ahead = passes(epoch=1)
    ahead.epoch(True)
    for step in range(STEPS):  # the pass's batches handed out, each backed once the next is
        ahead.handed(item(STEPS + step))
        if step:
            assert ahead.backward(item(STEPS + step)) == (step == 1, item(STEPS + step - 1)), "the batch in hand"
            ahead.stepped(item(STEPS + step - 1), True)
    ahead.begun()
    ahead.epoch(True)  # the next pass, as the prefetcher takes its first batch: the last one still in hand
    assert ahead.again == 1 and ahead.held.step == 2 * STEPS - 1
    assert ahead.state_dict() == {"epoch": 1, "again": 0}


def item(step: int) -> Item:
    return Item(step, 0, 1, 8, 8, (8, 8))


def test_a_loop_fetching_one_batch_ahead_is_found_through_two_losses_a_batch_and_lost_when_it_breaks():
    """A GAN's two job.backward calls a batch, over an endless cycle of the loader fetched one batch
    ahead: each is the batch in hand's, pass after pass (the calls were counted as batches, so
    the next pass took nothing for in hand, and the batch ahead's weights came back). A break out
    of such a pass leaves nothing in hand: a plain loop after it backs the batch it was handed (it
    got the abandoned pass's)."""
    p = passes()
    held, trained = None, []
    for lap in range(3):
        p.begun()
        p.epoch(False)
        for step in range(STEPS):
            p.handed(item(step))
            if held is not None:
                for _ in range(2):  # the discriminator's loss, then the generator's
                    trained.append(p.backward(item(step))[1].step)
                p.stepped(held, False)
            held = item(step)
    assert trained == ([s for s in range(STEPS) for _ in range(2)] * 3)[:len(trained)], trained
    assert len(trained) == 2 * (3 * STEPS - 1) and p.ahead
    p.left()  # the loop breaks out of its pass, the batch fetched ahead dropped with it
    p.begun()
    p.epoch(False)
    p.handed(item(0))
    assert p.backward(item(0)) == (False, item(0)) and not p.ahead


def test_the_loader_says_when_a_loop_leaves_its_pass_early_and_only_then():
    """Loader.__iter__ calls `left` as a loop's break drops its iterator (apex's prefetcher with it),
    and `after_pass` alone when the pass ran to its end."""
    from hvdhetero.rank import loader as loader_module

    said = []
    made = object.__new__(loader_module.Loader)
    made.iterating, made.began, made.backed, made._live = 0, (lambda: 0), (lambda: 0), []
    made.left, made.after_pass = (lambda: said.append("left")), (lambda began, holding: said.append("ended"))
    made._batches = lambda me: (batch for batch in range(3))
    for batch in made:
        if batch == 1:
            break
    assert said == ["left"] and made.iterating == 0 and made._live == []
    assert [batch for batch in made] == [0, 1, 2] and said == ["left", "ended"] and made._live == []


class Handing:
    """rank/loader.py's Loader as its passes hand chunks out (Loader._handing), job.backward calls
    counted (`backward`), the steps begun and the chunks taken as the job's written down."""

    def __init__(self):
        from hvdhetero.rank.loader import Loader

        self.backed, self.calls, self.begun, self.ours = 0, 0, [], []
        self.made = object.__new__(Loader)
        self.made.backed, self.made.calls = (lambda: self.backed), (lambda: self.calls)
        self.made.before_step = lambda item: self.begun.append(item.step)
        self.made._live, self.made._twins, self.made._latest = [], [], (None, 0, 0)

    def hand(self, by, step: int, chunk: int = 0) -> None:
        if by not in self.made._live:
            self.made._live.append(by)
        if self.made._handing(by, Item(step, chunk, 2, 4, 8, (8, 8))):
            self.ours.append((step, chunk))

    def backward(self, again: bool = False) -> None:
        """A job.backward (`again`: of the chunk the last one came from)."""
        self.backed += 0 if again else 1
        self.calls += 1

    def over(self, done, ran_out: bool = True) -> None:
        """`done`'s pass ran out, or its iterator was dropped (`ran_out` False)."""
        done.ran_out = ran_out
        self.made._live.remove(done)


def test_a_look_inside_the_loops_pass_hands_out_none_of_the_jobs_chunks_and_one_left_open_before_it_does():
    """Loader._handing: a chunk handed out is the job's (a step's first begins the step:
    before_step, where a checkpoint or commit due is taken; the step in hand, its clock, the loss
    that follows), unless it is a look at a batch inside the loop's pass (rank 0's
    `next(iter(loader))`, after a step or before the loss, its iterator dropped or kept open, or
    a preview iterator kept from before the loop and advanced now and then): the pass that handed
    out the job's latest chunk is another, under way, trains, and is in its step. Taken as the
    job's, a look's chunk began a step on rank 0 alone (a checkpoint due there held the look's
    position) and its loss was the look's batch's (the next pass's: rank 0's epoch moved on)."""
    from hvdhetero.rank.loader import _Pass

    job = Handing()
    preview, loop, look, inside, kept = _Pass(), _Pass(), _Pass(), _Pass(), _Pass()
    job.hand(preview, 0)  # before the loop, two batches (the job's: nothing trains yet)
    job.hand(preview, 1)
    job.hand(loop, 0)
    job.backward()
    job.hand(loop, 0, 1)
    job.backward()
    job.hand(look, 2 * STEPS)  # after the step: rank 0's look (its pass deals the next epoch), dropped
    job.over(look, ran_out=False)
    job.hand(loop, 1)
    job.hand(inside, 2 * STEPS + 1)  # inside the body, before the loss: a look, dropped
    job.over(inside, ran_out=False)
    job.backward()
    job.hand(loop, 1, 1)
    job.hand(kept, 2 * STEPS)  # inside the body, before the loss: a look kept open
    job.backward()
    for step in (2, 3):
        job.hand(loop, step)
        job.hand(preview, step + 2 * STEPS)  # the preview advanced (more batches than the loop's pass, 4)
        job.hand(kept, step + 2 * STEPS)
        job.backward()
    assert job.ours == [(0, 0), (1, 0), (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (3, 0)], job.ours
    assert job.begun == [0, 1, 0, 1, 2, 3], job.begun
    assert loop.trains and not any(p.trains for p in (look, inside, kept))


def test_one_batch_handed_out_by_two_passes_before_its_loss_is_the_step_in_hand_and_the_next_to_hand_out_the_loop():
    """A look kept open at a pass's first step, before its loss, deals the loop's first batch; so
    does the loop after the CIFAR-10 tutorial's `dataiter`, left open: the step in hand, begun
    once. The pass that hands out next is the loop's, and a pass left over is a look; where one of
    the two ran out first (a resumed run's first pass with one step left, a full-batch loop of
    one step a pass), the next pass's first batch is the job's (either had been taken for the
    loop, and the next pass's batches for looks: rank 0 began no step and trained stale ones)."""
    from hvdhetero.rank.loader import _Pass

    job, loop, first_look, next_look = Handing(), _Pass(), _Pass(), _Pass()
    job.hand(loop, 0)
    job.hand(first_look, 0)  # (its pass deals the loop's order: the same batch)
    job.backward()
    job.hand(loop, 1)
    job.over(first_look, ran_out=False)  # (its iterator replaced by the next one)
    job.hand(next_look, 2 * STEPS)  # the next step's look, before the loss
    assert job.ours == [(0, 0), (0, 0), (1, 0)] and job.begun == [0, 1], (job.ours, job.begun)

    for kept_first in (False, True):  # a resumed pass, then a look kept; the tutorial's look, then a full batch
        job, kept, passes = Handing(), _Pass(), [_Pass() for _ in range(3)]
        for by in (kept, passes[0]) if kept_first else (passes[0], kept):  # step 0's batch, twice
            job.hand(by, 0)
        job.backward()
        job.over(passes[0])
        for step, loop in enumerate(passes[1:], start=1):  # one step a pass
            job.hand(loop, step)
            job.backward()
            job.over(loop)
        assert job.ours == [(0, 0), (0, 0), (1, 0), (2, 0)] and job.begun == [0, 1, 2], (kept_first, job.ours)


def test_a_pass_that_goes_on_after_its_first_chunks_were_taken_for_looks_is_the_loops():
    """Where a chunk is taken for a look and the loss that follows is the stale step in hand's,
    the pass that hands out again with none of the others' chunks between is the loop's: a loop
    that broke out of a pass kept in a variable (`it = iter(loader); for b in it: ... break`),
    then began a new one, had its new pass's chunks taken for looks for good (no step began, the
    loss was the old pass's last chunk's). A pass begun after the loop's pass that trained ran out
    trains from its first chunk: an evaluation over the prepared loader, or rank 0's preview
    advanced, before that pass's first loss is a look (taken for the job's, it began steps and
    weighed the loss); a look's dropped twin leaves the loop's pass as the job's."""
    from hvdhetero.rank.loader import _Pass

    job, kept, new = Handing(), _Pass(), _Pass()
    for step in range(2):
        job.hand(kept, step)
        job.backward()
    job.hand(new, 2 * STEPS)  # the break: `kept` stays open; a new pass begins, taken for a look
    job.backward(again=True)  # (the step in hand: the old pass's last chunk)
    for step in range(2 * STEPS + 1, 2 * STEPS + 3):
        job.hand(new, step)
        job.backward()
    assert job.ours == [(0, 0), (1, 0), (2 * STEPS + 1, 0), (2 * STEPS + 2, 0)], job.ours

    job, first, second, evaluation, preview = Handing(), _Pass(), _Pass(), _Pass(), _Pass()
    job.hand(preview, 0)  # (kept open, before the loop)
    for step in range(STEPS):
        job.hand(first, step)
        job.backward()
    job.over(first)
    job.hand(second, STEPS)
    for step in range(2):  # before the pass's first loss: an evaluation over the loader, the preview advanced
        job.hand(evaluation, STEPS + step)
    job.over(evaluation)
    job.hand(preview, 1)
    job.backward()
    job.hand(second, STEPS + 1)
    # (the evaluation's first batch is the pass's first: the same batch again; the rest are looks)
    assert job.ours == [(0, 0)] + [(step, 0) for step in range(STEPS + 1)] + [(STEPS, 0), (STEPS + 1, 0)], job.ours
    assert job.begun == list(range(STEPS + 2)), job.begun

    job, loop, twin, other = Handing(), _Pass(), _Pass(), _Pass()
    job.hand(loop, 0)
    job.backward()
    job.hand(loop, 1)
    job.hand(twin, 1)  # a look at the same batch, dropped
    job.over(twin, ran_out=False)
    job.hand(other, 3 * STEPS)  # another look, kept, before the loss
    job.backward()
    job.hand(loop, 2)
    assert job.ours == [(0, 0), (1, 0), (1, 0), (2, 0)] and job.begun == [0, 1, 2], (job.ours, job.begun)
