"""The step state the loader, the prepared optimizer and the prepared scheduler share: a
scheduler stepped by the user's loop moves once per global step, whatever the micro-batches and
merged steps (rank/step_state.py), driven here as job.backward and the optimizer drive it."""

from __future__ import annotations

from types import SimpleNamespace

from hvdhetero.rank.step_state import OncePerStep, StepState


def item(step: int, chunk: int = 0, chunks: int = 1, steps: int = 1):
    return SimpleNamespace(step=step, chunk=chunk, chunks=chunks, last=chunk == chunks - 1, steps=steps)


def run(items, per_step_schedule: bool = True) -> list[int]:
    """The user's loop over `items`: backward, optimizer.step(), scheduler.step() after every
    batch (a per-step schedule) or once at the end (a per-epoch one). The scheduler's count after each."""
    state, stepped = StepState(), []
    schedule = OncePerStep(lambda: stepped.append(1), state)
    seen = []
    for it in items:
        state.chunk_given(it)
        state.backward_done(last=it.last)
        if not state.accumulating:  # the prepared optimizer steps on the last chunk only
            state.reduced = False
            state.updates += 1
        if per_step_schedule:
            schedule()
        seen.append(len(stepped))
    if not per_step_schedule:
        schedule()
        seen.append(len(stepped))
    return seen


def test_a_per_step_schedule_moves_once_per_step_not_per_micro_batch():
    items = [item(s, c, chunks=3) for s in range(2) for c in range(3)]
    assert run(items) == [0, 0, 1, 1, 1, 2]


def test_a_merged_step_moves_a_per_step_schedule_once_per_global_step_it_spans():
    assert run([item(0, steps=4), item(4, steps=2)]) == [4, 6]


def test_a_per_epoch_schedule_moves_once_whatever_the_steps():
    assert run([item(0, steps=4), item(4, steps=2), item(6)], per_step_schedule=False) == [0, 0, 0, 1]


def test_the_last_chunk_reduced_with_an_overflow_is_skipped_and_the_next_step_starts_unreduced():
    state = StepState()
    state.chunk_given(item(0))
    state.backward_done(last=True, overflowed=True)
    assert (state.reduced, state.skip, state.accumulating) == (True, True, False)
    state.chunk_given(item(1, chunks=2))
    assert not state.reduced
    state.backward_done(last=False)
    assert state.accumulating
