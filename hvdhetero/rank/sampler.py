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
    caps = [math.inf if c is None else c for c in (caps if caps is not None else [None] * k)]
    if k == 0 or any(w < 0 for w in weights):
        raise ValueError(f"weights must be a non-empty list of non-negative numbers, got {list(weights)}")
    if minimum * k > total:
        raise ValueError(f"cannot give {k} ranks at least {minimum} each out of {total}")
    if sum(caps) < total:
        raise ValueError(f"caps {[None if c == math.inf else c for c in caps]} allow only {sum(caps)} "
                         f"samples per step, fewer than {total}")
    if sum(weights) == 0:
        weights = [1.0] * k  # nothing known: split evenly
    # Real-valued shares with bounds: a share below the minimum or above its cap is pinned
    # there and the rest is shared among the others, until no share is out of bounds.
    share: list[float] = [0.0] * k
    free, left = set(range(k)), float(total)
    while free:
        wsum = sum(weights[i] for i in free)
        for i in free:
            share[i] = left * weights[i] / wsum if wsum else left / len(free)
        # Caps first: pinning a rank at its cap raises the others' shares, which may lift a
        # rank that looked below the minimum above it.
        pinned = {i: caps[i] for i in free if share[i] > caps[i]}
        if not pinned:
            pinned = {i: minimum for i in free if share[i] < minimum}
        if not pinned:
            break
        for i, value in pinned.items():
            share[i] = value
            free.discard(i)
        left = total - sum(share[i] for i in range(k) if i not in free)
    # Round down, then hand the samples left to the largest remainders that have room.
    out = [math.floor(x + 1e-9) for x in share]
    for i in sorted(range(k), key=lambda i: (out[i] - share[i], i)):
        if sum(out) == total:
            break
        if out[i] < caps[i]:
            out[i] += 1
    assert sum(out) == total and all(minimum <= n <= c for n, c in zip(out, caps)), (out, total)
    return out


def steps_merged(share: int, largest: int) -> int:
    """`--inner-steps by-speed`: how many consecutive steps' shares a rank with `share` samples a
    step takes in one optimizer step, so that its steps hold about as many samples as the
    largest share's (every rank's inner batch about equal; a rank k times slower takes ~1/k as
    many inner steps). The loader and the balancer's cost model both use this one rule."""
    return max(1, round(largest / share)) if share > 0 else 1


class WeightedBatchSampler:
    """Yields this rank's list of dataset indices for each step of an epoch."""

    def __init__(self, dataset_size: int, batch_sizes: Sequence[int], rank: int, *,
                 seed: int = 0, shuffle: bool = True, drop_last: bool = False, min_share: int = 0):
        if dataset_size <= 0:
            raise ValueError(f"dataset is empty (size {dataset_size})")
        if not 0 <= rank < len(batch_sizes):
            raise ValueError(f"rank {rank} outside 0..{len(batch_sizes) - 1}")
        self.n, self.rank, self.seed = dataset_size, rank, seed
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
        """This epoch's permutation of the dataset (the same on every rank)."""
        if not self.shuffle:
            return torch.arange(self.n)
        gen = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        return torch.randperm(self.n, generator=gen)

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
