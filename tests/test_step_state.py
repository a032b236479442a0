"""The step state the loader, the prepared optimizer and the prepared scheduler share: a
scheduler stepped by the user's loop moves once per global step, whatever the micro-batches and
merged steps (rank/step_state.py), driven here as job.backward and the optimizer drive it."""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import torch

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


def test_the_scripts_own_optimizer_steps_as_the_prepared_one_does():
    """`model, _, loader = job.prepare(model, optimizer, ...)`, then the loop steps its own
    `optimizer`: it must not update between micro-batches, and every step must reach the job
    (counted, skipped after an overflow); an LR scheduler built on it before or after
    job.prepare still counts its steps without a warning."""
    import warnings

    import torch

    from hvdhetero.rank.optimizer import JobOptimizer

    weight = torch.nn.Parameter(torch.ones(2))
    own = torch.optim.SGD([weight], lr=1.0)
    before = torch.optim.lr_scheduler.StepLR(own, step_size=1, gamma=0.5)
    state, calls = StepState(), []

    def before_step():
        calls.append("before")
        return not state.skip

    prepared = JobOptimizer(own, state, before_step, lambda: calls.append("after"))
    torch.optim.lr_scheduler.LambdaLR(own, lambda step: 1.0)  # built after job.prepare: it wraps own.step
    state.chunk_given(item(0, chunk=0, chunks=2))
    state.backward_done(last=False)
    weight.grad = torch.ones(2)
    own.step()
    own.zero_grad()
    assert weight.tolist() == [1.0, 1.0] and weight.grad is not None and calls == [], "between micro-batches"
    state.chunk_given(item(0, chunk=1, chunks=2))
    state.backward_done(last=True)
    own.step()
    assert weight.tolist() == [0.0, 0.0] and calls == ["before", "after"]
    state.chunk_given(item(1))
    state.backward_done(last=True, overflowed=True)
    own.step()
    assert weight.tolist() == [0.0, 0.0] and calls[2:] == ["before", "after"], "skipped, still counted"
    own.zero_grad()
    assert weight.grad is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        before.step()
    assert own.param_groups[0]["lr"] == 0.5
    assert prepared.param_groups is own.param_groups


@contextmanager
def prepared_sgd():
    """(the script's SGD over one weight, the StepState) as job.prepare leaves them: the optimizer
    routed through a JobOptimizer that counts its steps as Training.stepped does, and every LR
    scheduler on it taken over (rank/scheduling.py) until the block ends."""
    from hvdhetero.rank import scheduling
    from hvdhetero.rank.optimizer import JobOptimizer

    own, state = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=1.0), StepState()

    def stepped():
        state.updates += 1
        return True

    JobOptimizer(own, state, stepped, lambda: None)
    scheduling.take_over(state, saved=[])
    try:
        yield own, state
    finally:
        scheduling.release()


def optimizer_step(own, state, step: int, chunk: int = 0, chunks: int = 1, steps: int = 1) -> None:
    """A chunk's job.backward and the loop's optimizer.step() and zero_grad()."""
    state.chunk_given(item(step, chunk=chunk, chunks=chunks, steps=steps))
    state.backward_done(last=chunk == chunks - 1)
    own.param_groups[0]["params"][0].grad = torch.ones(2)
    own.step()
    own.zero_grad()


def test_every_scheduler_on_the_jobs_optimizer_steps_once_a_step_passed_to_prepare_or_not(capsys):
    """A warm-up then cosine SequentialLR and a ReduceLROnPlateau built on the script's optimizer,
    neither passed to job.prepare, stepped in a loop of 4 steps of 3 chunks: the sequence moves
    once a step (it moved once a chunk, reached its cosine phase at step 4 of 10 and a OneCycleLR
    raised "Tried to step 41 times"), its two parts as SequentialLR steps them, the plateau once;
    one on another optimizer is torch's; each of the job's says once that no checkpoint holds it."""
    with prepared_sgd() as (own, state):
        warm = torch.optim.lr_scheduler.LinearLR(own, 0.1, 1.0, total_iters=10)
        cos = torch.optim.lr_scheduler.CosineAnnealingLR(own, T_max=30)
        sequence = torch.optim.lr_scheduler.SequentialLR(own, [warm, cos], milestones=[10])
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(own)
        another = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=1.0)
        elsewhere = torch.optim.lr_scheduler.StepLR(another, step_size=1)
        for step in range(4):
            for chunk in range(3):
                optimizer_step(own, state, step, chunk, chunks=3)
                sequence.step()
                another.step()
                elsewhere.step()
        plateau.step(1.0)
    # as one device: the same schedulers stepped 4 times, once a step
    alone = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=1.0)
    one = [torch.optim.lr_scheduler.LinearLR(alone, 0.1, 1.0, total_iters=10),
           torch.optim.lr_scheduler.CosineAnnealingLR(alone, T_max=30)]
    one_sequence = torch.optim.lr_scheduler.SequentialLR(alone, one, milestones=[10])
    for _ in range(4):
        alone.step()
        one_sequence.step()
    assert [s.last_epoch for s in (sequence, warm, cos)] == [s.last_epoch for s in (one_sequence, *one)]
    assert own.param_groups[0]["lr"] == alone.param_groups[0]["lr"] < 1.0
    assert plateau.last_epoch == 1 and elsewhere.last_epoch == 12
    said = capsys.readouterr().out
    assert said.count("is in no checkpoint") == 2 and "the SequentialLR on" in said and "ReduceLROnPlateau" in said


def test_two_schedulers_on_the_jobs_optimizer_each_count_a_merged_steps_steps():
    """--inner-steps by-speed: a merged optimizer step stands for 3 global steps, and each of two
    per-step schedulers on the optimizer moves 3 (the second moved 1: the first had taken the
    shared count). Neither holds anything of ours: their state_dict() saves as torch's."""
    import io

    with prepared_sgd() as (own, state):
        first, second = (torch.optim.lr_scheduler.LambdaLR(own, lambda s: 1.0) for _ in range(2))
        optimizer_step(own, state, 0, steps=3)
        first.step()
        second.step()
    assert (first.last_epoch, second.last_epoch) == (3, 3)
    for scheduler in (first, second):
        assert not [k for k in scheduler.state_dict() if "hvdhetero" in k]
        torch.save({k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}, io.BytesIO())


def test_a_scheduler_of_another_kind_given_to_prepare_steps_once_a_step_by_its_class_for_it_alone():
    """scheduler= of a class of the script's own: its class's step is ours for that object (once a
    step over 3 chunks), another object of the class steps as it always did, its __dict__ holds
    nothing of ours; one whose step is its own attribute (no class to put it on) is wrapped there."""
    from hvdhetero.rank import scheduling

    class Warmup:
        def __init__(self):
            self.n = 0

        def step(self):
            self.n += 1

    class OwnStep:
        def __init__(self):
            self.n = 0
            self.step = self.advance

        def advance(self):
            self.n += 1

    class Static:  # a step no class-level wrapper can take: the object is wrapped
        count = [0]

        @staticmethod
        def step():
            Static.count[0] += 1

    with prepared_sgd() as (own, state):
        given, other, attribute, static = Warmup(), Warmup(), OwnStep(), Static()
        scheduling.take_over(state, saved=[given, attribute], given=[given, attribute, static])
        for step in range(2):
            for chunk in range(3):
                optimizer_step(own, state, step, chunk, chunks=3)
                for scheduler in (given, other, attribute, static):
                    scheduler.step()
        assert (given.n, other.n, attribute.n, Static.count[0]) == (2, 6, 2, 2)
        assert vars(given) == {"n": 2}
    for scheduler in (given, attribute, static, Static()):
        scheduler.step()
    assert (given.n, attribute.n, Static.count[0]) == (3, 3, 4), "the job is over: their own steps again"
    assert "step" not in vars(static) and vars(attribute)["step"] == attribute.advance


def test_a_scheduler_with_no_state_dict_keeps_only_what_a_weights_only_load_reads_back():
    """Its plain attributes are checkpointed; NumPy's float64 (np.cos's), an IntEnum, a namedtuple
    or a defaultdict would be written and then refused by torch.load(weights_only=True), and
    with them every checkpoint: they stay out, as the optimizer it holds does."""
    import collections
    import enum
    import io

    import numpy as np

    from hvdhetero.rank.registry import Scheduler

    class Phase(enum.IntEnum):
        WARM = 1

    class Own:
        def __init__(self, optimizer):
            self.optimizer, self.n, self.lrs, self.by = optimizer, 3, [0.1, 0.2], {"a": (1, 2.5)}
            self.cos, self.phase = np.cos(0.5), Phase.WARM
            self.pair, self.counts = collections.namedtuple("P", "a b")(1, 2), collections.defaultdict(int)

    state = Scheduler(Own(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0))).state_dict()
    assert state == {"n": 3, "lrs": [0.1, 0.2], "by": {"a": (1, 2.5)}}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    fresh = Own(None)
    fresh.n = 0
    Scheduler(fresh).load_state_dict(torch.load(buffer, weights_only=True))
    assert (fresh.n, fresh.lrs) == (3, [0.1, 0.2])


def test_the_line_of_a_scheduler_in_no_checkpoint_names_which_of_several_optimizers(monkeypatch):
    """A seq2seq's encoder and decoder optimizers, each with a ReduceLROnPlateau the script did not
    pass to job.prepare: each is said once, naming its optimizer (both said the same line)."""
    from hvdhetero.rank import current, scheduling
    from hvdhetero.rank.optimizer import JobOptimizer

    state = StepState()
    encoder, decoder = (torch.optim.Adam([torch.nn.Parameter(torch.ones(2))]),
                        torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=1.0))
    prepared = [JobOptimizer(o, state, lambda: True, lambda: None) for o in (encoder, decoder)]
    monkeypatch.setattr(current, "job", SimpleNamespace(is_main=True, training=SimpleNamespace(optimizers=prepared)))
    assert scheduling._whose(encoder) == "the job's optimizer 1 of 2 (Adam)"
    assert scheduling._whose(decoder) == "the job's optimizer 2 of 2 (SGD)"
    monkeypatch.setattr(current, "job", SimpleNamespace(is_main=True, training=SimpleNamespace(optimizers=prepared[:1])))
    assert scheduling._whose(encoder) == "the job's optimizer"
