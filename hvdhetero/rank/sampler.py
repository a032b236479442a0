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
drawn from the same (seed, epoch) generator on every rank, and dealt the same way.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hvdhetero.policy.split import proportional_split


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

    def indices(self, n: int, seed: int) -> torch.Tensor:
        """One epoch's indices into a dataset of `n`, drawn from `seed` (the same on every rank)."""
        if self.replacement:
            weights = self.sampler.weights.tolist() if self.sampler is not None else None
            population = range(len(weights)) if weights is not None else range(n)  # torch's: one index a weight
            return torch.tensor(random.Random(seed).choices(population, weights=weights, k=self.size))
        gen = torch.Generator().manual_seed(seed)
        if self.subset is not None:
            return self.subset[torch.randperm(len(self.subset), generator=gen)]
        # without replacement, more than n: whole permutations one after another (as torch's)
        return torch.cat([torch.randperm(n, generator=gen) for _ in range(-(-self.size // n))])[: self.size]


class WeightedBatchSampler:
    """Yields this rank's list of dataset indices for each step of an epoch."""

    def __init__(self, dataset_size: int, batch_sizes: Sequence[int], rank: int, *,
                 seed: int = 0, shuffle: bool = True, drop_last: bool = False, min_share: int = 0,
                 draw: Draw | None = None):
        if dataset_size <= 0:
            raise ValueError(f"dataset is empty (size {dataset_size})")
        if not 0 <= rank < len(batch_sizes):
            raise ValueError(f"rank {rank} outside 0..{len(batch_sizes) - 1}")
        self.dataset_size, self.draw = dataset_size, draw
        self.n = draw.size if draw is not None else dataset_size
        """Indices an epoch."""
        self.rank, self.seed = rank, seed
        self.shuffle, self.drop_last, self.min_share = shuffle, drop_last, min_share
        self.epoch = 0
        self.set_batch_sizes(batch_sizes)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

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
        full, rest = divmod(self.n, self.global_batch)
        keep = rest and not self.drop_last and rest >= self.min_share * len(self.batch_sizes)
        return full + (1 if keep else 0)

    def step_sizes(self, step: int) -> list[int]:
        """Every rank's sample count at `step` of the epoch (the same on all ranks)."""
        start = step * self.global_batch
        if start + self.global_batch <= self.n:
            return list(self.batch_sizes)
        return proportional_split(max(0, self.n - start), self.batch_sizes, self.min_share)

    def order(self) -> torch.Tensor:
        """This epoch's permutation of the dataset, or its `draw` (the same on every rank)."""
        if not self.shuffle and self.draw is None:
            return torch.arange(self.n)
        seed = self.seed * 100_003 + self.epoch
        if self.draw is not None:
            return self.draw.indices(self.dataset_size, seed)
        return torch.randperm(self.n, generator=torch.Generator().manual_seed(seed))

    def __iter__(self) -> Iterator[list[int]]:
        order = self.order()
        for step in range(len(self)):
            # Re-read the split every step: the balancer may have changed it.
            yield self.step_indices(order, step)

    def step_indices(self, order: torch.Tensor, step: int) -> list[int]:
        """This rank's indices at `step`, under the split set now."""
        sizes = self.step_sizes(step)
        start = step * self.global_batch + sum(sizes[: self.rank])
        return order[start : start + sizes[self.rank]].tolist()
