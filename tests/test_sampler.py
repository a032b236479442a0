"""Weighted sampler and proportional split: coverage, disjointness, equal steps, determinism."""

import itertools
import os
import random

import pytest
import torch

from hvdhetero.rank.sampler import CHUNK, Draw, WeightedBatchSampler, proportional_split
from hvdhetero.rank.validate import drawn


def epoch(n, sizes, seed=0, epoch_no=0, drop_last=False):
    """Every rank's list of batches for one epoch."""
    out = []
    for rank in range(len(sizes)):
        s = WeightedBatchSampler(n, sizes, rank, seed=seed, drop_last=drop_last)
        s.set_epoch(epoch_no)
        out.append(list(s))
    return out


@pytest.mark.parametrize("n", [1, 7, 64, 100, 1437])
@pytest.mark.parametrize("sizes", [[32, 32], [48, 16], [63, 1], [5, 0, 11], [1, 1, 1, 1]])
def test_epoch_covers_every_sample_once_with_equal_steps(n, sizes):
    ranks = epoch(n, sizes)
    assert len({len(batches) for batches in ranks}) == 1, "all ranks must take the same number of steps"
    drawn = [i for batches in ranks for b in batches for i in b]
    assert sorted(drawn) == list(range(n)), "no sample repeated or lost"
    full_steps = n // sum(sizes)
    for rank, batches in enumerate(ranks):
        assert all(len(b) == sizes[rank] for b in batches[:full_steps]), "full steps use the rank's batch"


def test_shares_follow_the_split():
    ranks = epoch(1000, [75, 25])
    counts = [sum(map(len, batches)) for batches in ranks]
    assert counts == [750, 250]


def test_drop_last_skips_the_partial_step():
    ranks = epoch(100, [30, 10], drop_last=True)
    assert [len(b) for b in ranks] == [2, 2]
    assert sum(len(x) for batches in ranks for x in batches) == 80


def test_same_seed_same_order_other_epoch_other_order():
    assert epoch(200, [16, 16], seed=3) == epoch(200, [16, 16], seed=3)
    assert epoch(200, [16, 16], seed=3, epoch_no=1) != epoch(200, [16, 16], seed=3, epoch_no=0)
    assert epoch(200, [16, 16], seed=4) != epoch(200, [16, 16], seed=3)


def test_resplit_mid_epoch_keeps_coverage():
    samplers = [WeightedBatchSampler(300, [20, 20], r) for r in range(2)]
    iters = [iter(s) for s in samplers]
    drawn = []
    for step in range(len(samplers[0])):
        if step == 3:
            for s in samplers:
                s.set_batch_sizes([30, 10])
        drawn += [i for it in iters for i in next(it)]
    assert sorted(drawn) == list(range(300))


def test_resplit_must_keep_the_global_batch():
    s = WeightedBatchSampler(100, [8, 8], 0)
    with pytest.raises(ValueError, match="keep the global batch 16"):
        s.set_batch_sizes([8, 9])


@pytest.mark.parametrize("total,weights,minimum,caps,expected", [
    (64, [1, 1], 0, None, [32, 32]),
    (64, [3, 1], 0, None, [48, 16]),
    (10, [1, 1, 1], 0, None, [4, 3, 3]),
    (64, [1000, 1], 1, None, [63, 1]),
    (64, [3, 1], 1, [40, None], [40, 24]),
    (5, [0, 0], 0, None, [3, 2]),
])
def test_proportional_split(total, weights, minimum, caps, expected):
    assert proportional_split(total, weights, minimum, caps) == expected


def test_impossible_splits_are_refused():
    with pytest.raises(ValueError, match="at least 3 each"):
        proportional_split(5, [1, 1], minimum=3)
    with pytest.raises(ValueError, match="allow only 20"):
        proportional_split(64, [1, 1], caps=[10, 10])


def test_a_rank_that_merges_steps_gets_the_same_samples_in_fewer_bigger_steps():
    """--inner-steps by-speed: rank 1 merges 3 steps at a time (the epoch's end cuts the last
    merge short); its items hold exactly the samples of those steps, in order, and say which
    global step they end at and how many they span; the other rank is untouched."""
    import torch

    from hvdhetero.rank.loader import Loader

    data = torch.arange(100)

    def items(rank, group=None):
        sampler = WeightedBatchSampler(len(data), [12, 4], rank, seed=1)
        loader = Loader(data, sampler, torch.device("cpu"), chunk=5, group=group)
        seen = []
        loader.on_item = lambda item: seen.append(item)
        return [(batch.tolist(), seen[-1]) for batch in loader]

    plain = items(1)
    merged = items(1, group=lambda step, left: min(3, left))
    assert [i.steps for _, i in merged if i.chunk == 0] == [3, 3, 1]  # 7 steps: 16 a step, 4 at the end
    assert [i.step for _, i in merged if i.chunk == 0] == [2, 5, 6]
    assert sum((b for b, _ in merged), []) == sum((b for b, _ in plain), [])
    first = [i for _, i in merged if i.step == 2]
    assert [i.n for i in first] == [4, 4, 4] and first[0].share == 12 and first[0].sizes == (36, 12)
    assert items(0, group=lambda step, left: 1) == items(0)


def test_a_merged_step_never_spans_a_change_of_split_and_every_sample_is_seen_once():
    """A new split due at step 4: rank 1 (merging 3 steps at a time) cuts its merge at step 3 so
    that it takes the new split at step 4 exactly as rank 0 does; the epoch's samples are
    still each seen once, and from step 4 on the merge follows the new split (equal shares:
    no merging)."""
    import torch

    from hvdhetero.rank.loader import Loader

    data = torch.arange(100)

    def items(rank, group):
        sampler = WeightedBatchSampler(len(data), [12, 4], rank, seed=1)
        loader = Loader(data, sampler, torch.device("cpu"), chunk=None, group=group)
        loader.resplit([8, 8], after_step=3)
        seen = []
        loader.on_item = lambda item: seen.append(item)
        return [(batch.tolist(), seen[-1]) for batch in loader]

    fast, slow = items(0, None), items(1, lambda step, left: min(3, left))
    assert [(i.step, i.steps) for _, i in slow] == [(2, 3), (3, 1), (6, 3)]  # 7 steps of 100 samples
    assert [i.sizes for _, i in slow] == [(36, 12), (12, 4), (18, 18)]
    everything = sum((b for b, _ in fast + slow), [])
    assert sorted(everything) == list(range(100))


def test_a_share_is_cut_into_as_few_chunks_as_its_cap_allows_as_even_as_can_be():
    """A share of 81 in chunks of at most 40 runs 27 + 27 + 27, not 40 + 40 + 1 (a chunk of one
    costs a whole forward and backward, and BatchNorm1d refuses it in training); 65 at 64 runs
    33 + 32. Where the cap is below what the model takes (`fewest` 2, a BatchNorm model), no chunk
    is left that small."""
    import torch

    from hvdhetero.rank import batches
    from hvdhetero.rank.loader import Loader

    data = torch.arange(162)

    def chunks(fewest, chunk=40):
        loader = Loader(data, WeightedBatchSampler(len(data), [81, 81], 0, seed=1), torch.device("cpu"), chunk=chunk)
        loader.fewest = fewest
        return [len(batch) for batch in loader]

    assert chunks(1) == chunks(2) == [27, 27, 27]
    assert chunks(2, chunk=1) == [3] + [2] * 39 and chunks(1, chunk=1) == [1] * 81
    assert chunks(1, chunk=0) == chunks(1, chunk=81) == [81]
    assert [b - a for a, b in batches.spans(65, 64)] == [33, 32] and batches.spans(0, 8) == []
    for n, chunk in ((37, 8), (11, 8), (1000, 64), (7, 3)):
        sizes = [b - a for a, b in batches.spans(n, chunk)]
        assert sum(sizes) == n and max(sizes) <= chunk and max(sizes) - min(sizes) <= 1, (n, chunk, sizes)
        assert len(sizes) == -(-n // chunk), "as few chunks as the cap allows"


class WhichWorker(torch.utils.data.Dataset):
    """Each sample says which process collated it."""

    def __len__(self):
        return 96

    def __getitem__(self, i):
        return torch.tensor([i, os.getpid()])


def test_persistent_workers_serve_every_epoch_and_deal_what_new_ones_would():
    """A DataLoader's persistent_workers=True is kept: the same two workers collate every epoch
    (a Mac spawns each worker, which runs the script's top level again: seconds an epoch), with
    the same samples in the same order as workers started anew each epoch."""
    from hvdhetero.rank.loader import Loader

    def epochs(persistent):
        current = [0]
        loader = Loader(WhichWorker(), WeightedBatchSampler(96, [16, 16], 0, seed=3), torch.device("cpu"), chunk=None,
                        num_workers=2, epoch=lambda: current[0], persistent_workers=persistent, prefetch_factor=3)
        out = []
        for current[0] in range(3):
            out.append(torch.cat(list(loader)))
        return [e[:, 0].tolist() for e in out], [set(e[:, 1].tolist()) for e in out]

    kept, workers = epochs(True)
    anew, fresh = epochs(False)
    assert kept == anew and kept[0] != kept[1] and all(len(e) == 48 for e in kept)
    assert workers[0] == workers[1] == workers[2] and len(workers[0]) == 2, workers
    assert len(fresh[0] | fresh[1] | fresh[2]) == 6, fresh  # two new workers each epoch

def test_a_weighted_draw_is_the_same_sequence_on_every_rank_dealt_by_the_split():
    """torch's WeightedRandomSampler in the script's DataLoader (an imbalanced dataset: the 10
    rare samples weighted 9 times the 90 others): each epoch draws num_samples indices by weight
    from the job's generator, the same on both ranks, and deals them by the split; every epoch
    draws anew."""
    weights = torch.utils.data.WeightedRandomSampler([9.0] * 10 + [1.0] * 90, 200)
    draw = Draw(200, sampler=weights, replacement=True)
    samplers = [WeightedBatchSampler(100, [30, 10], r, seed=3, draw=draw) for r in range(2)]
    assert len(samplers[0]) == 5  # 200 drawn a epoch, 40 a step
    epochs = []
    for epoch in range(2):
        for s in samplers:
            s.set_epoch(epoch)
        steps = [list(s) for s in samplers]
        assert [len(i) for i in steps[0]] == [30] * 5 and [len(i) for i in steps[1]] == [10] * 5
        dealt = [i for step in zip(*steps) for part in step for i in part]
        assert dealt == samplers[0].order().tolist() == samplers[1].order().tolist()
        epochs.append(dealt)
    assert epochs[0] != epochs[1]
    rare = sum(i < 10 for e in epochs for i in e) / 400
    assert 0.4 < rare < 0.6, rare  # 10 * 9 / (10 * 9 + 90) = half of the draws


def test_a_subset_draw_deals_each_of_its_indices_once_an_epoch():
    """torch's SubsetRandomSampler (a split by indices): each epoch is a new order of the subset."""
    subset = torch.arange(0, 100, 3)
    samplers = [WeightedBatchSampler(100, [8, 4], r, seed=1, draw=Draw(len(subset), subset=subset)) for r in range(2)]
    orders = []
    for epoch in range(2):
        for s in samplers:
            s.set_epoch(epoch)
        dealt = [i for s in samplers for step in s for i in step]
        assert sorted(dealt) == subset.tolist()
        orders.append(samplers[0].order().tolist())
    assert orders[0] != orders[1]


def test_a_weighted_draw_reads_the_samplers_weights_each_epoch():
    """A script that reweighs its WeightedRandomSampler between epochs (a curriculum) is drawn
    by the weights it holds then."""
    weights = torch.utils.data.WeightedRandomSampler([1.0] * 100, 50)
    s = WeightedBatchSampler(100, [10], 0, seed=0, draw=Draw(50, sampler=weights, replacement=True))
    assert max(s.order().tolist()) >= 50
    weights.weights = torch.tensor([1.0] * 50 + [0.0] * 50, dtype=torch.double)
    s.set_epoch(1)
    assert max(s.order().tolist()) < 50


def test_a_draw_longer_than_its_chunks_is_one_sequence_from_pythons_generator():
    """A draw is made a chunk at a time as the epoch is read: the indices are the same as one
    `random.Random(seed).choices` call over the whole epoch (the sequence every rank and
    platform draws), whether read step by step, from a step on (a resumed run) or again."""
    weights = torch.rand(1000, generator=torch.Generator().manual_seed(0)).tolist()
    size = 2 * CHUNK + 123
    for draw, expected in [
        (Draw(size, replacement=True), random.Random(5).choices(range(1000), k=size)),
        (Draw(size, sampler=torch.utils.data.WeightedRandomSampler(weights, size), replacement=True),
         random.Random(5).choices(range(1000), weights=weights, k=size)),
    ]:
        order = draw.indices(1000, 5)
        assert torch.cat([order[s:s + 333] for s in range(0, size, 333)]).tolist() == expected
        assert order[CHUNK - 2:CHUNK + 2].tolist() == expected[CHUNK - 2:CHUNK + 2]
        assert order[10:20].tolist() == expected[10:20]  # behind what was read: drawn again from the seed
    more = Draw(2500, replacement=False).indices(1000, 5)  # num_samples > len, without replacement
    firsts = torch.cat([more[s:s + 64] for s in range(0, 2500, 64)])
    assert [sorted(firsts[i:i + 1000].tolist()) for i in (0, 1000)] == [list(range(1000))] * 2


def test_an_endless_sampler_deals_its_first_steps_without_drawing_the_epoch():
    """minGPT's DataLoader never runs out: RandomSampler(replacement=True, num_samples=int(1e10)).
    Drawn whole, 1e10 indices would fill any memory (the ranks were killed); read as the steps go,
    two ranks deal the same sequence, the live table counts its steps with no total."""
    dataset = torch.utils.data.TensorDataset(torch.arange(500))
    loader = torch.utils.data.DataLoader(dataset, batch_size=64, num_workers=0,
                                         sampler=torch.utils.data.RandomSampler(dataset, True, int(1e10)))
    draw = drawn(loader.sampler, 64)
    assert draw.endless and draw.size == int(1e10)
    assert not drawn(torch.utils.data.RandomSampler(dataset, True, 5 * 500), 64).endless  # a long epoch, not endless
    samplers = [WeightedBatchSampler(len(dataset), [40, 24], r, seed=2, draw=draw) for r in range(2)]
    assert len(samplers[0]) == int(1e10) // 64
    first = [list(itertools.islice(iter(s), 1000)) for s in samplers]
    dealt = [i for step in zip(*first) for part in step for i in part]
    assert dealt == random.Random(2 * 100_003).choices(range(500), k=64_000)
