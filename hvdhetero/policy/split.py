"""How a global batch is cut into per-rank shares: integers in proportion to weights within
bounds, and how many steps a slower rank merges into one (--inner-steps by-speed). The sampler,
the balancer and the plan all cut with these, on every rank alike."""

from __future__ import annotations

import math
from collections.abc import Sequence


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
