"""Weighted distributed batch sampler: each rank draws a share of the epoch proportional to
its batch, every rank takes the same number of steps, and within an epoch no sample is
repeated or lost.

One permutation of the dataset per (seed, epoch) is shared by all ranks. Step s takes the next
B = sum(b) indices of it; rank i gets the slice at offset b_0 + ... + b_{i-1} of length b_i.
The final step of an epoch holds the N mod B samples left: they are split across ranks in
proportion to b (largest remainder), so a rank may get none on that step; with
`drop_last=True` that partial step is skipped instead. With `min_share=1` (the prepared
loader's: a user's model may not take an empty batch) every rank gets at least one sample of the
final step, and a final step too small for that is skipped. The split may change between steps
(the balancer re-splits) as long as every rank sets the same split before the same step.

A script's DataLoader may draw its epochs otherwise (`Draw`): with torch's WeightedRandomSampler
(an imbalanced dataset's classes drawn by weight, with replacement), a RandomSampler with replacement or
num_samples, or a SubsetRandomSampler (a split by indices). Then the epoch is that sequence,
drawn from the same (seed, epoch) generator on every rank, and dealt the same way. A sampler or
batch sampler of the script's own is drawn alike on every rank each epoch (rank/own_sampler.py);
its batches, of any length, are dealt in proportion to the split.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hvdhetero.policy.split import proportional_split
from hvdhetero.rank.own_sampler import OwnDraw


@dataclass(frozen=True)
class Draw:
    """How an epoch's indices are drawn when not as one permutation of the dataset: what torch's
    WeightedRandomSampler (with replacement), RandomSampler(replacement=True or num_samples=) or
    SubsetRandomSampler of the script's DataLoader draws, from the job's (seed, epoch). Draws with
    replacement come from Python's own generator, the same on every platform (torch's multinomial
    can draw through MKL's stream on x86, which a Mac's arm64 build has not)."""

    size: int
    """Indices an epoch (the sampler's num_samples; the subset's length)."""
    sampler: Any = None
    """A WeightedRandomSampler, whose `weights` are read at every epoch (a script may reweigh)."""
    replacement: bool = False
    subset: torch.Tensor | None = None
    """SubsetRandomSampler's indices: each epoch a permutation of them."""
    source: Any = None
    """The SubsetRandomSampler itself: an active-learning loop extends its indices (rank/loader.py
    refuses a count that moved: the epochs deal `subset`, as prepared)."""
    sequential: bool = False
    """The indices in order, 0 to size - 1 (a batch function's rows: rank/batch_function.py)."""
    endless: bool = False
    """The epoch is the sampler's way never to run out (minGPT's num_samples=int(1e10), ENDLESS
    passes over the dataset or more): the script's own loop ends it, so the live table counts
    its steps without a total or an ETA."""

    def indices(self, n: int, seed: int) -> Drawn:
        """One epoch's indices into a dataset of `n`, drawn from `seed` (the same on every rank), made
        as far as the epoch is read: an endless sampler's (minGPT's num_samples=int(1e10)) are never
        all held."""
        return Drawn(lambda: self._chunks(n, seed), self.size)

    def _chunks(self, n: int, seed: int) -> Iterator[torch.Tensor]:
        if self.sequential:
            for start in range(0, self.size, CHUNK):
                yield torch.arange(start, min(start + CHUNK, self.size))
            return
        if self.replacement:
            # One random() a draw, in order, so the chunks are one choices(k=size) call's draws.
            rng = random.Random(seed)
            weights = self.sampler.weights.tolist() if self.sampler is not None else None
            cumulative = list(itertools.accumulate(weights)) if weights is not None else None
            population = range(len(weights)) if weights is not None else range(n)  # torch's: one index a weight
            for start in range(0, self.size, CHUNK):
                yield torch.tensor(rng.choices(population, cum_weights=cumulative, k=min(CHUNK, self.size - start)))
            return
        gen = torch.Generator().manual_seed(seed)
        if self.subset is not None:
            yield self.subset[torch.randperm(len(self.subset), generator=gen)]
            return
        for _ in range(-(-self.size // n)):  # without replacement, more than n: whole permutations in turn (as torch's)
            yield torch.randperm(n, generator=gen)


ENDLESS = 100
"""Passes over the dataset in one epoch from which a Draw is `endless`."""

CHUNK = 1 << 16
"""Indices a Draw makes at a time."""


class OwnBatches(list):
    """An epoch's batches drawn by a batch sampler of the script's own (rank/own_sampler.py), as
    `order()` gives them."""


class Drawn:
    """An epoch's drawn indices, sliced as a tensor is (`order[a:b]`), made in chunks as the reads
    move on and forgotten behind them; a read behind them draws the epoch again from its seed."""

    def __init__(self, chunks: Callable[[], Iterator[torch.Tensor]], size: int):
        self.chunks, self.size = chunks, size
        self._rewind()

    def _rewind(self) -> None:
        self._source, self._base, self._held = self.chunks(), 0, torch.empty(0, dtype=torch.long)

    def __len__(self) -> int:
        return self.size

    def tolist(self) -> list[int]:
        """The whole epoch, as a tensor's tolist() (an endless one would not fit in memory)."""
        return self[:].tolist()

    def __getitem__(self, where: slice) -> torch.Tensor:
        start, stop, _ = where.indices(self.size)
        stop = max(start, stop)
        if start < self._base:
            self._rewind()
        while True:
            behind = min(start - self._base, len(self._held))
            self._held, self._base = self._held[behind:], self._base + behind
            if self._base + len(self._held) >= stop:
                return self._held[start - self._base: stop - self._base]
            self._held = torch.cat([self._held, next(self._source)])


class WeightedBatchSampler:
    """Yields this rank's list of dataset indices for each step of an epoch."""

    def __init__(self, dataset_size: int, batch_sizes: Sequence[int], rank: int, *,
                 seed: int = 0, shuffle: bool = True, drop_last: bool = False, min_share: int = 0,
                 draw: Draw | None = None, own: OwnDraw | None = None):
        if dataset_size <= 0:
            raise ValueError(f"dataset is empty (size {dataset_size})")
        if not 0 <= rank < len(batch_sizes):
            raise ValueError(f"rank {rank} outside 0..{len(batch_sizes) - 1}")
        self.dataset_size, self.draw, self.own = dataset_size, draw, own
        self.n = draw.size if draw is not None else own.declared() if own is not None and not own.batches \
            else dataset_size
        """Indices an epoch."""
        if own is not None:
            own.ranks, own.min_share = len(batch_sizes), min_share
        self.rank, self.seed = rank, seed
        self.shuffle, self.drop_last, self.min_share = shuffle, drop_last, min_share
        self.epoch, self.again = 0, 0
        self.set_batch_sizes(batch_sizes)

    def set_epoch(self, epoch: int, again: int = 0) -> None:
        """The epoch the next pass deals; `again`: the passes of that epoch before it (a loop that
        takes the loader more than once an epoch), each dealing an order of its own."""
        self.epoch, self.again = epoch, again

    def first_draw(self) -> None:
        """A sampler of the script's own: its first epoch drawn now (job.prepare, every rank: the
        draws checked alike), so that an epoch's steps are counted from what it draws before the
        first loop asks."""
        if self.own is not None:
            self.own.first(self.seed * 100_003)
            self.n = self.own.count if not self.own.batches else self.n

    def set_batch_sizes(self, batch_sizes: Sequence[int]) -> None:
        """Change the split; every rank must make the same call before the same step."""
        sizes = [int(b) for b in batch_sizes]
        if any(b < 0 for b in sizes) or sum(sizes) == 0:
            raise ValueError(f"batch sizes must be >= 0 with a positive sum, got {sizes}")
        if getattr(self, "global_batch", sum(sizes)) != sum(sizes):
            # Step offsets are step * B: a re-split must keep the global batch B.
            raise ValueError(f"a re-split must keep the global batch {self.global_batch}, got {sizes}")
        self.batch_sizes = sizes
        self.global_batch = sum(sizes)

    def __len__(self) -> int:
        if self.own is not None and self.own.batches:
            return self.own.count if self.own.count is not None else self.own.declared()
        full, rest = divmod(self.n, self.global_batch)
        keep = rest and not self.drop_last and rest >= self.min_share * len(self.batch_sizes)
        return full + (1 if keep else 0)

    def step_sizes(self, step: int, order: torch.Tensor | Drawn | OwnBatches) -> list[int]:
        """Every rank's sample count at `step` of the epoch dealt in `order` (the same on all ranks)."""
        if isinstance(order, OwnBatches):  # a batch of the script's own sampler: dealt in proportion to the split
            length = len(order[step])
            return list(self.batch_sizes) if length == self.global_batch else \
                proportional_split(length, self.batch_sizes, self.min_share)
        start = step * self.global_batch
        if start + self.global_batch <= self.n:
            return list(self.batch_sizes)
        return proportional_split(max(0, self.n - start), self.batch_sizes, self.min_share)

    def order(self) -> torch.Tensor | Drawn | OwnBatches:
        """This epoch's permutation of the dataset, its `draw`, or a batch sampler of the script's
        own's batches (the same on every rank). Each pass keeps its own: a look at a batch inside
        the loop's pass draws the next epoch's, and the loop's steps after it took those batches
        when the sampler kept the latest pass's."""
        seed = self.seed * 100_003 + self.epoch  # (first_draw's for epoch 0)
        if self.again:
            seed = seed * 1_000_003 + self.again
        if self.own is not None:  # the script's own sampler, drawn alike on every rank
            drawn = self.own.epoch(self.epoch, seed)
            return OwnBatches(drawn) if self.own.batches else torch.tensor(drawn, dtype=torch.long)
        if not self.shuffle and self.draw is None:
            return torch.arange(self.n)
        if self.draw is not None:
            return self.draw.indices(self.dataset_size, seed)
        return torch.randperm(self.n, generator=torch.Generator().manual_seed(seed))

    def __iter__(self) -> Iterator[list[int]]:
        order = self.order()
        for step in range(len(self)):
            # Re-read the split every step: the balancer may have changed it.
            yield self.step_indices(order, step)

    def step_indices(self, order: torch.Tensor | Drawn | OwnBatches, step: int) -> list[int]:
        """This rank's indices at `step`, under the split set now."""
        sizes = self.step_sizes(step, order)
        if isinstance(order, OwnBatches):
            start = sum(sizes[: self.rank])
            return order[step][start : start + sizes[self.rank]]
        start = step * self.global_batch + sum(sizes[: self.rank])
        return order[start : start + sizes[self.rank]].tolist()
