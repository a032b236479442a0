"""rank/own_sampler.py: a DataLoader's sampler or batch_sampler of the script's own, drawn each
epoch on a stream of the job's and dealt to the ranks by speed (here without ranks: each rank's
sampler drawn alone, as every rank draws it)."""

from __future__ import annotations

import random

import pytest
import torch

from hvdhetero.errors import ConfigError
from hvdhetero.rank.own_sampler import OwnDraw
from hvdhetero.rank.sampler import WeightedBatchSampler


def _bucketing():
    """tests/scripts/bucketing.py: the bucket sampler tests/scripts/buckets.py trains with."""
    import importlib.util

    from conftest import ROOT

    spec = importlib.util.spec_from_file_location("bucketing", ROOT / "tests" / "scripts" / "bucketing.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Buckets


Buckets = _bucketing()


def samplers(source, split, seed=0, min_share=1):
    return [WeightedBatchSampler(100, split, rank, seed=seed, min_share=min_share, own=OwnDraw(source, batches=True))
            for rank in range(len(split))]


def test_a_bucket_samplers_batches_are_kept_and_dealt_by_the_split():
    """Each step's rows on the two ranks together are one of its batches, whole and in its order, a
    nominal one dealt 5/3 and a bucket's short last one (4 of 100 % 32) in proportion; every
    sample once an epoch; the script's own Python random left where it was."""
    lengths = [random.Random(1).randint(1, 30) for _ in range(100)]
    ranks = samplers(Buckets(lengths, 8), [5, 3])
    before = random.getstate()
    epoch = [list(r) for r in ranks]
    assert random.getstate() == before
    drawn = ranks[0].own.epoch(0, 0)
    assert len(epoch[0]) == len(epoch[1]) == len(drawn) == 13  # 100 samples: 3 chunks of 4 batches, and 4
    for step, batch in enumerate(drawn):
        assert epoch[0][step] + epoch[1][step] == batch
        assert (len(epoch[0][step]), len(epoch[1][step])) == ((5, 3) if len(batch) == 8 else (3, 1)), batch
        assert max(lengths[i] for i in batch) - min(lengths[i] for i in batch) <= 29
    assert sorted(i for r in epoch for b in r for i in b) == list(range(100))
    spreads = [max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in drawn]
    assert sum(spreads) / len(spreads) < 10, spreads  # bucketed: a shuffled batch of 8 spans ~20 of 30


def test_an_epoch_draws_alike_again_on_resume_and_anew_the_next_epoch():
    """A resumed run's sampler (a new object) draws the epoch it stopped in as the first run did;
    the next epoch draws another order."""
    lengths = list(range(100))
    first, again = samplers(Buckets(lengths, 8), [4, 4])[0], samplers(Buckets(lengths, 8), [4, 4])[0]
    for s in (first, again):
        s.set_epoch(3)
    assert list(first) == list(again)
    first.set_epoch(4)
    assert list(first) != list(again)


def test_a_batch_too_short_for_every_rank_is_left_out_and_a_changing_count_refused():
    """min_share 2 (BatchNorm) on 2 ranks: a batch of 3 is left out; a sampler whose count of such
    batches changes between epochs is refused, naming it and the fix."""
    class Changing:
        def __init__(self):
            self.epoch = 0

        def set_epoch(self, epoch):
            self.epoch = epoch

        def __iter__(self):
            return iter([[0, 1, 2, 3], [4, 5, 6]] + ([[7, 8, 9, 10]] if self.epoch else []))

        def __len__(self):
            return 2

    sampler = samplers(Changing(), [2, 2], min_share=2)[0]
    assert list(sampler) == [[0, 1]]
    sampler.set_epoch(1)
    with pytest.raises(ConfigError, match=r"its batch_sampler Changing gave 2 batches \(of 4 samples or more\) in "
                                          r"epoch 1, and 1 in the first"):
        list(sampler)


def test_a_sampler_of_its_own_is_batched_by_the_global_batch():
    """A sampler that yields indices (a class-balanced one of the script's, torch's generator): its
    epoch's order, batches of the global batch dealt as a permutation's would be."""
    class EvenFirst:
        def __iter__(self):
            order = torch.randperm(20).tolist()
            return iter(sorted(order, key=lambda i: i % 2))

        def __len__(self):
            return 20

    ranks = [WeightedBatchSampler(20, [3, 1], rank, own=OwnDraw(EvenFirst(), batches=False)) for rank in range(2)]
    epoch = [list(r) for r in ranks]
    joined = [a + b for a, b in zip(*epoch)]
    assert [i for b in joined for i in b] == ranks[0].own.epoch(0, 0)
    assert all(i % 2 == 0 for b in joined[:2] for i in b) and len(joined) == 5


def each_epochs_batches_in_order(run_dir) -> None:
    """tests/scripts/buckets.py's two ranks' RUN_DIR/seen-R.json: each step, the two ranks' rows
    together are one batch of the sampler's epoch, drawn from the job's (seed, epoch) stream, in order."""
    import json

    rng = random.Random(1)
    lengths = [rng.randint(2, 30) for _ in range(320)]
    seen = [json.loads((run_dir / f"seen-{rank}.json").read_text()) for rank in (0, 1)]
    assert len(seen[0]) == len(seen[1]) == 40, seen  # 2 epochs of 20 batches
    for epoch in (0, 1):
        drawn = OwnDraw(Buckets(lengths, batch_size=16), batches=True, ranks=2)._draw(epoch, epoch)
        steps = [(a[2], b[2]) for a, b in zip(seen[0], seen[1]) if a[0] == epoch]
        assert [a + b for a, b in steps] == drawn, epoch
        assert all(a and b for a, b in steps)


def test_rank_0s_look_at_a_batch_leaves_the_bucket_samplers_batches_to_the_loop(tmp_path):
    """tests/scripts/buckets.py --look: a loop of the script's own, and rank 0 takes
    `next(iter(loader))` after each step, a look that draws the next epoch's batches. Every step is
    still one batch of its epoch, both ranks' rows together (the sampler kept the latest pass's
    batches, and rank 0's loop went on with the look's: rows of another epoch's batches)."""
    from conftest import ROOT, VENV_BIN, run_cmd

    run_dir = tmp_path / "run"
    run_cmd([VENV_BIN / "invoke", "train", "--script", ROOT / "tests" / "scripts" / "buckets.py",
             "--run-dir", run_dir, "--", "--look"], timeout=300)
    each_epochs_batches_in_order(run_dir)


def test_two_ranks_train_on_the_bucket_samplers_batches_each_dealt_by_speed(tmp_path):
    """tests/scripts/buckets.py: its DataLoader (a bucket sampler of its own, a padding collate_fn)
    goes to job.prepare as it is. Each step the two ranks' rows together are one batch of the
    sampler's epoch, drawn from the job's (seed, epoch) stream, in its order; batches stay bucketed
    (mean padding 0.16 of a batch; shuffled batches of 16 pad ~0.45), as the seq2seq port's
    original's were (its port had to drop them: epochs 1.6x slower on one device). One shuffling
    with a generator seeded by the rank is refused at job.prepare, naming the rank that drew otherwise."""
    from conftest import ROOT, VENV_BIN, run_cmd

    run_dir = tmp_path / "run"
    proc = run_cmd([VENV_BIN / "invoke", "train", "--script", ROOT / "tests" / "scripts" / "buckets.py",
                    "--run-dir", run_dir], timeout=300)
    each_epochs_batches_in_order(run_dir)
    padding = float(proc.stdout.split("mean padding ")[1].split()[0])
    assert padding < 0.25, proc.stdout[-2000:]
    # a sampler shuffling with a generator seeded by the rank draws other batches on each: refused at prepare
    refused = run_cmd([VENV_BIN / "invoke", "train", "--script", ROOT / "tests" / "scripts" / "buckets.py",
                       "--run-dir", tmp_path / "by-rank", "--", "--by-rank"], check=False, timeout=300)
    said = refused.stdout + refused.stderr
    assert refused.returncode == 1 and "ConfigError: job.prepare(): its batch_sampler ByRank drew other batches on " \
        "rank 1 than on rank 0 from the same seed" in said, said[-2000:]


def test_a_sampler_that_deals_one_replicas_part_is_refused():
    """A DDP-style bucket sampler (VITS's: num_replicas, rank) would draw rank 0's part alone."""
    class Sharded(Buckets):
        num_replicas, rank = 2, 0

    with pytest.raises(ConfigError, match=r"batch_sampler Sharded draws for one of 2 replicas \(num_replicas, a DDP "
                                          r"habit\): make it for one process"):
        OwnDraw(Sharded(list(range(10)), 8), batches=True)


def test_a_sampler_with_a_generator_running_on_is_said_at_prepare_and_one_seeded_by_epoch_is_not(capsys):
    """A class-balanced sampler keeping one np.random.default_rng for the run draws, after a resume,
    other batches than the stopped run would have (a helper: 174 steps of 696 other samples, no
    word): said once at prepare. One that seeds it from the epoch in set_epoch is not, and the
    check leaves the generator where it was."""
    import numpy as np

    class Running:
        def __init__(self):
            self.rng = np.random.default_rng(3)

        def __iter__(self):
            return iter(self.rng.permutation(20).tolist())

        def __len__(self):
            return 20

    class ByEpoch(Running):
        def set_epoch(self, epoch):
            self.rng = np.random.default_rng(3 + epoch)

    running = Running()
    before = running.rng.bit_generator.state
    WeightedBatchSampler(20, [2, 2], 0, own=OwnDraw(running, batches=False)).first_draw()
    said = capsys.readouterr().out
    assert "its sampler Running draws from a generator of its own that runs on from epoch to epoch (self.rng: " \
           "Generator), which no checkpoint holds" in said, said
    assert running.rng.bit_generator.state != before  # its first epoch drawn, as a one-device loop's would be
    WeightedBatchSampler(20, [2, 2], 0, own=OwnDraw(ByEpoch(), batches=False)).first_draw()
    assert "runs on from epoch to epoch" not in capsys.readouterr().out


def test_short_batches_left_out_are_said_once(capsys):
    """A token-budget sampler's single long utterances, on 2 ranks: left out, and said once."""
    class Budget:
        def __iter__(self):
            return iter([[0, 1, 2, 3], [4], [5, 6], [7]])

        def __len__(self):
            return 4

    sampler = samplers(Budget(), [1, 1])[0]
    assert list(sampler) == [[0, 1], [5]]
    sampler.set_epoch(1)
    list(sampler)
    said = capsys.readouterr().out
    assert said.count("its batch_sampler Budget gave 2 batches of fewer than 2 samples in epoch 0 (2 samples): each is "
                      "left out") == 1, said
