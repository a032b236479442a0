"""Batch split that follows each rank's measured speed, so a slow device never holds a fast one.

With equal batches a rank k times slower makes every step k times longer, capping the job at
2/(k+1) of the devices' combined speed. Giving each rank a share of the fixed global batch
proportional to its throughput makes all ranks finish a step together, which is the
physical limit (the sum of their speeds) up to communication.

Every rank holds a Balancer and feeds it the same numbers (each rank's compute time of the
step, summed across ranks inside the gradient allreduce), so every rank computes the same new
split without an extra message. Pure Python arithmetic on identical inputs is identical on
every platform (IEEE 754), which keeps the ranks in agreement.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from hvdhetero.rank.sampler import proportional_split


@dataclass
class Balancer:
    """Splits `global_batch` across ranks so that every rank's step takes the same time.

    Each rank's step time is modelled as t_i(n) = a_i + p_i * n: a fixed overhead a_i per step
    (kernel launches, Python) plus p_i seconds per sample. Splitting in proportion to measured
    samples/s alone would be unstable: a rank given fewer samples looks slower per sample
    (its overhead is spread over fewer), gets fewer still, and so on. With the overhead
    known, the split that equalizes t_i is stable and moves only when p_i really changes.
    """

    global_batch: int
    size: int
    caps: Sequence[int | None] = ()
    """Most samples per step for each rank (memory cap from the inventory); () for none."""
    minimum: int = 1
    """Every rank keeps at least this many samples, so its speed stays measurable."""
    interval: int = 5
    """Steps between re-split decisions."""
    threshold: float = 0.03
    """Hysteresis: re-split only when the model predicts the step would get this much faster
    (a fraction of the current step time); smaller gains are within timing noise, and chasing
    them would make the split oscillate."""
    patience: int = 3
    """Decisions in a row that must call for a re-split before it happens."""
    smoothing: float = 0.2
    """Weight of the newest measurement in the moving average of each rank's p_i."""
    settle: int = 20
    """Steps at one split after which a smaller but sustained imbalance is corrected too."""
    fine_threshold: float = 0.01
    """The least gain worth a re-split once `settle` steps at the split are averaged (the
    mean of many steps is far less noisy than the moving average, so a smaller gain is real;
    at threshold 3% a K=10 job ran with its slow rank 4-5% behind or ahead for good)."""
    confidence: float = 4.0
    """...and the imbalance behind that gain must exceed this many standard errors of the
    averaged step times (noise, measured), so a balanced split does not wander."""
    overhead: list[float] = field(default_factory=list)
    """a_i: seconds per step that do not depend on the batch, from calibration."""
    seconds_per_sample: list[float] = field(default_factory=list)
    """p_i: seconds per sample, calibrated, then tracked from every step's timing."""
    history: list[tuple[int, list[int]]] = field(default_factory=list)
    """(step, split) for the initial split and every change, for the metrics."""

    def __post_init__(self):
        self.caps = list(self.caps) or [None] * self.size
        if len(self.caps) != self.size:
            raise ValueError(f"{len(self.caps)} caps for {self.size} ranks")
        self.overhead = [0.0] * self.size
        self.seconds_per_sample = [1.0] * self.size
        self.split = self.target()
        self._steps = self._wanted = 0
        self._settled = _Moments(self.size)

    def target(self, per_sample: Sequence[float] | None = None) -> list[int]:
        """The integer split that makes a_i + p_i * n_i equal across ranks."""
        a, p = self.overhead, per_sample or self.seconds_per_sample
        # Equal time T with sum(n_i) = B: n_i = (T - a_i) / p_i, T = (B + sum a_i/p_i) / sum 1/p_i.
        # A rank whose overhead alone exceeds T gets the minimum (weight 0 here).
        active = list(range(self.size))
        while True:
            inv = sum(1.0 / p[i] for i in active)
            t = (self.global_batch + sum(a[i] / p[i] for i in active)) / inv
            slow = [i for i in active if t <= a[i]]
            if not slow or len(slow) == len(active):
                break
            active = [i for i in active if i not in slow]
        weights = [max(0.0, (t - a[i]) / p[i]) if i in active else 0.0 for i in range(self.size)]
        return proportional_split(self.global_batch, weights, self.minimum, self.caps)

    def step_time(self, split: Sequence[int], per_sample: Sequence[float] | None = None) -> float:
        """Predicted time of a step with `split`: the slowest rank's."""
        return max(a + p * n for a, p, n in zip(self.overhead, per_sample or self.seconds_per_sample, split))

    def calibrate(self, overhead: Sequence[float], seconds_per_sample: Sequence[float], step: int = 0) -> list[int]:
        """Initial split from each rank's measured a_i and p_i (from a short probe). Like every
        later change it must promise a gain above the threshold: ranks that measure alike
        keep the even split instead of a skew made of probe noise."""
        self.overhead = [max(0.0, float(a)) for a in overhead]
        self.seconds_per_sample = [max(float(p), 1e-9) for p in seconds_per_sample]
        target = self.target()
        now = self.step_time(self.split)
        if now - self.step_time(target) > self.threshold * now:
            self.split = target
        self._settled = _Moments(self.size)
        self.history.append((step, list(self.split)))
        return self.split

    def _measured(self, step_seconds: Sequence[float], sizes: Sequence[int]):
        """(rank, seconds per sample) for each rank whose step shows a per-sample cost: its time
        less its overhead, over its samples (a rank with no samples, or within its overhead,
        tells nothing)."""
        for rank, (t, n) in enumerate(zip(step_seconds, sizes)):
            per_sample = (t - self.overhead[rank]) / n if n > 0 else 0.0
            if per_sample > 0:
                yield rank, per_sample

    def refine(self, step_seconds: Sequence[float], sizes: Sequence[int], step: int = 0) -> list[int]:
        """Re-measure at the calibrated split: each rank timed steps of exactly its share, which
        replace its per-sample cost outright (the calibration probes ran other batch sizes, and
        a_i + p_i * n only extrapolates to the share). Moves to the equal-time split of what was
        measured without the hysteresis threshold: a one-off decision cannot oscillate, and at
        K=10 a slow rank short of 20 samples costs the job <3% a step, for ever (measured: 131
        samples where 149 were due, the slow rank idle 40 ms a step)."""
        for rank, per_sample in self._measured(step_seconds, sizes):
            self.seconds_per_sample[rank] = per_sample
        target = self.target()
        if target != self.split:
            self._move(target, step)
        return self.split

    def observe(self, step_seconds: Sequence[float], sizes: Sequence[int], step: int) -> list[int] | None:
        """Feed every rank's compute time for a step and the samples each had; returns a new
        split when the measured speeds moved far enough, else None (keep the current one)."""
        for rank, per_sample in self._measured(step_seconds, sizes):
            old = self.seconds_per_sample[rank]
            self.seconds_per_sample[rank] = old + self.smoothing * (per_sample - old)
            if list(sizes) == self.split:
                self._settled.add(rank, per_sample)
        self._steps += 1
        if self._steps % self.interval:
            return None
        target = self.target()
        now, then = self.step_time(self.split), self.step_time(target)
        # Hysteresis in size (a real gain) and in time (seen at two decisions in a row).
        self._wanted = self._wanted + 1 if now - then > self.threshold * now else 0
        if self._wanted >= self.patience:
            return self._move(target, step)
        settled = self._settled_target()
        if settled is None:
            return None
        target, mean = settled
        self.seconds_per_sample = mean  # the better estimate, and the one the move is based on
        return self._move(target, step)

    def _settled_target(self) -> tuple[list[int], list[float]] | None:
        """The split for the mean per-sample costs of the steps at the current split, and those
        means, if that many steps were seen, the gain is above `fine_threshold` and the imbalance
        behind it (slowest minus fastest predicted time) is `confidence` standard errors clear
        of noise."""
        stats = self._settled.summary()
        if stats is None or min(count for _, _, count in stats) < self.settle:
            return None
        mean = [m for m, _, _ in stats]
        target = self.target(mean)
        now, then = self.step_time(self.split, mean), self.step_time(target, mean)
        if target == self.split or now - then <= self.fine_threshold * now:
            return None
        times = [(a + m * n, se * n) for a, (m, se, _), n in zip(self.overhead, stats, self.split)]
        (slow, slow_se), (fast, fast_se) = max(times), min(times)
        if slow - fast <= self.confidence * (slow_se ** 2 + fast_se ** 2) ** 0.5:
            return None
        return target, mean

    def _move(self, target: list[int], step: int) -> list[int]:
        self._wanted = 0
        self._settled = _Moments(self.size)
        self.split = target
        self.history.append((step, list(target)))
        return target


class _Moments:
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
