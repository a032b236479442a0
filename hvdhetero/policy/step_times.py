"""Summaries of measured step times that the balancer decides on: a running mean with its
standard error (Welford), and the typical step time of a window, which leaves a busy host's
spikes out. Pure arithmetic, identical on every rank."""

from __future__ import annotations

from statistics import fmean, stdev


class Moments:
    """Running mean and standard error of each rank's per-sample cost (Welford)."""

    def __init__(self, size: int):
        self.count, self.mean, self.m2 = [0] * size, [0.0] * size, [0.0] * size

    def add(self, rank: int, value: float) -> None:
        self.count[rank] += 1
        delta = value - self.mean[rank]
        self.mean[rank] += delta / self.count[rank]
        self.m2[rank] += delta * (value - self.mean[rank])

    def summary(self) -> list[tuple[float, float, int]] | None:
        """(mean, standard error of the mean, count) per rank; None until every rank has 2."""
        if min(self.count) < 2:
            return None
        return [(m, (m2 / (n - 1) / n) ** 0.5, n) for m, m2, n in zip(self.mean, self.m2, self.count)]


def typical(seconds: list[float]) -> float:
    """Mean of the faster three quarters of the step times: a busy host's spikes in up to a
    quarter of the steps are left out, yet a slower bulk counts in full, as in the mean the job
    pays. A median ignores a split that is slow in a third of the steps, as a model chasing the
    spikes makes it (simulated busy hosts, 3000 steps: the worst run 1.8% slower than the better
    of the equal and the model's split, 2.2% with a median)."""
    return typical_se(seconds)[0]


def typical_se(seconds: list[float]) -> tuple[float, float]:
    """`typical` and its standard error (from the spread of the values it averages)."""
    kept = sorted(seconds)[: len(seconds) - len(seconds) // 4]
    return fmean(kept), (stdev(kept) / len(kept) ** 0.5 if len(kept) > 1 else 0.0)


def apart(gap: float, se_a: float, se_b: float, errors: float) -> bool:
    """Whether `gap`, the difference of two estimates with standard errors `se_a` and `se_b`, is
    more than `errors` standard errors of that difference: beyond the noise they were timed with."""
    return gap > errors * (se_a ** 2 + se_b ** 2) ** 0.5
