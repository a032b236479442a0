"""Weighted distributed batch sampler: each rank draws a share of the epoch proportional to
its batch, every rank takes the same number of steps, and within an epoch no sample is
repeated or lost.

One permutation of the dataset per (seed, epoch) is shared by all ranks. Step s takes the next
B = sum(b) indices of it; rank i gets the slice at offset b_0 + ... + b_{i-1} of length b_i.
The final step of an epoch holds the N mod B samples left: they are split across ranks in
proportion to b (largest remainder), so a rank may get none on that step; with
`drop_last=True` that partial step is skipped instead. The split may change between steps
(the balancer re-splits) as long as every rank sets the same split before the same step.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch


def proportional_split(total: int, weights: Sequence[float], minimum: int = 0,
                       caps: Sequence[int | None] | None = None) -> list[int]:
    """Integers summing to `total`, proportional to `weights` (largest remainder), each >= minimum
    and <= its cap. Raises ValueError when the caps or minimums make it impossible."""
    k = len(weights)
    caps = list(caps) if caps is not None else [None] * k
    if k == 0 or any(w < 0 for w in weights):
        raise ValueError(f"weights must be a non-empty list of non-negative numbers, got {list(weights)}")
    if minimum * k > total:
        raise ValueError(f"cannot give {k} ranks at least {minimum} each out of {total}")
    cap_total = sum(math.inf if c is None else c for c in caps)
    if cap_total < total:
        raise ValueError(f"caps {caps} allow only {cap_total} samples per step, fewer than {total}")
    out = [minimum] * k
    free = [i for i in range(k) if caps[i] is None or caps[i] > minimum]
    left = total - minimum * k
    # Water-filling: hand out what is left in proportion to weight; a rank that hits its cap
    # is frozen there and the rest is re-split among the others.
    while left > 0 and free:
        w = {i: float(weights[i]) for i in free}
        if sum(w.values()) == 0:  # all-zero weights: split evenly
            w = dict.fromkeys(free, 1.0)
        share = {i: left * w[i] / sum(w.values()) for i in free}
        give = {i: math.floor(share[i]) for i in free}
        by_remainder = sorted(free, key=lambda i: (give[i] - share[i], i))
        for i in by_remainder[: left - sum(give.values())]:
            give[i] += 1
        capped = False
        for i in free:
            room = math.inf if caps[i] is None else caps[i] - out[i]
            if give[i] >= room:
                give[i], capped = int(room), True
        for i in free:
            out[i] += give[i]
        left = total - sum(out)
        free = [i for i in free if caps[i] is None or out[i] < caps[i]]
        if not capped:
            break
    assert sum(out) == total, (out, total)
    return out


class WeightedBatchSampler:
    """Yields this rank's list of dataset indices for each step of an epoch."""

    def __init__(self, dataset_size: int, batch_sizes: Sequence[int], rank: int, *,
                 seed: int = 0, shuffle: bool = True, drop_last: bool = False):
        if dataset_size <= 0:
            raise ValueError(f"dataset is empty (size {dataset_size})")
        if not 0 <= rank < len(batch_sizes):
            raise ValueError(f"rank {rank} outside 0..{len(batch_sizes) - 1}")
        self.n, self.rank, self.seed = dataset_size, rank, seed
        self.shuffle, self.drop_last = shuffle, drop_last
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
        return full + (1 if rest and not self.drop_last else 0)

    def step_sizes(self, step: int) -> list[int]:
        """Every rank's sample count at `step` of the epoch (the same on all ranks)."""
        start = step * self.global_batch
        if start + self.global_batch <= self.n:
            return list(self.batch_sizes)
        return proportional_split(max(0, self.n - start), self.batch_sizes)

    def _order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.n)
        gen = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        return torch.randperm(self.n, generator=gen)

    def __iter__(self) -> Iterator[list[int]]:
        order = self._order()
        for step in range(len(self)):
            # Re-read the split every step: the balancer may have changed it.
            sizes = self.step_sizes(step)
            start = step * self.global_batch + sum(sizes[: self.rank])
            yield order[start : start + sizes[self.rank]].tolist()
