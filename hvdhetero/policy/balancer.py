"""Batch split that follows each rank's measured speed, so a slow device never holds a fast one.

With equal batches a rank k times slower makes every step k times longer, capping the job at
2/(k+1) of the devices' combined speed. Giving each rank a share of the fixed global batch
proportional to its throughput makes all ranks finish a step together, which is the
physical limit (the sum of their speeds) up to communication.

Every rank holds a Balancer and feeds it the same numbers (each rank's compute time of the
step, summed across ranks inside the gradient allreduce), so every rank computes the same new
split without an extra message. Pure Python arithmetic on identical inputs is identical on
every platform (IEEE 754), which keeps the ranks in agreement.

The model can be wrong in a way its own numbers never show: a host busy with other work (a
browser, a CPU hog) adds spikes to its rank's step that do not scale with the batch, and the
split that equalizes average times then measures slower than a plain equal split. So the split
is checked against the equal split by measurement, never by prediction alone: when the model
stops explaining the measured step times, a few steps at the equal split are timed and the
faster of the two is kept; while the equal split is held, the model's split is timed now and
then, so that it comes back when the host goes quiet (see `probe_every`). A move the moving
average calls for is a trial of the same kind: kept only when it measures faster (see `trial_wait`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from statistics import fmean

from hvdhetero.policy.split import proportional_split, steps_merged
from hvdhetero.policy.step_times import Recent, apart, typical, typical_se


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
    """The least gain worth a re-split once `settle` steps at the split are averaged (their
    typical value is far less noisy than the moving average, so a smaller gain is real;
    at threshold 3% a K=10 job ran with its slow rank 4-5% behind or ahead for good)."""
    confidence: float = 4.0
    """...and the imbalance behind that gain must exceed this many standard errors of the
    averaged step times (noise, measured), so a balanced split does not wander."""
    overhead: list[float] = field(default_factory=list)
    """a_i: seconds per step that do not depend on the batch, from calibration."""
    seconds_per_sample: list[float] = field(default_factory=list)
    """p_i: seconds per sample, calibrated, then tracked from every step's timing."""
    probe_every: int = 100
    """Least steps from one probe of the equal split to the next. Such a probe starts only while
    the model misses the measured step time of its split by more than `tolerance`, so a job
    that the model explains never pays for one."""
    probe_budget: float = 0.01
    """Share of the run that probes may cost. A probe waits until the steps since the last one
    cover its cost: its steps (`probe_steps` plus the loader's lag) times how much slower the
    model predicts the probed split than the split in force measures, or than the last probe
    measured if it lost by more. At K=10 an equal split predicted 5x slower is probed once in
    4000-6000 steps."""
    probe_steps: int = 8
    """Steps timed at the probed split. Only steps that ran it count: the loader applies a new
    split a few steps late, and those steps ran the old one."""
    window: int = 24
    """The latest steps at the split in force that the model is checked and a probe is
    measured against."""
    tolerance: float = 0.10
    """The model explains the job while the mean measured step time (the slowest rank's) of
    `window` steps is within this fraction of the mean predicted one: 3-10% timing noise
    misses by 1-4%, a busy host's spikes by 10-20% (simulated)."""
    margin: float = 0.03
    """A probed split takes over only when its typical step time (`step_times.typical`) beats the split in
    force's by this fraction, the model's `threshold`: a smaller lead over 8 steps may be noise."""
    trials: bool = True
    """Whether the moving average's moves are tried before they are kept (`trial_wait`)."""
    trial_steps: int = 8
    """Steps a trial runs, and steps of the split in force it is measured against (local/diloco:
    rounds, each the mean of H steps: fewer)."""
    trial_wait: int = 15
    """Least steps, after a trial move that measured no faster, before the next. The moving
    average's move is tried for `trial_steps` steps and kept only when its typical step time beats
    that of the split's latest steps before it by `confidence` / 2 standard errors; else that split
    comes back. The moving average takes a busy host's spikes for a slower rank (simulated at
    K=3, the fast host busy: its moves cost 11-14% against the better of the equal and the
    calibrated split held throughout; tried, 2-6%), and a step that barely depends on the batch
    (a tiny model: kernel launches and Python, ~1 ms) has no split better than another, yet its
    noise and a rank's drifting speed make the model predict one (two alike ranks walked from
    [64, 64] to [26, 102] in 300 steps). The wait doubles with each such trial in a row, up to
    8 times, so there trials grow rare, and no move stays that did not pay."""
    merges: bool = False
    """--inner-steps by-speed: a rank with n_i samples a step merges `steps_merged(n_i, max n)`
    steps into one optimizer step, so its fixed cost a_i is paid once per merge: per global
    step it costs a_i / m_i + p_i n_i, nearly proportional to n_i for a small share (a split
    solved with the whole a_i every step starves the slow rank: it is cheaper than modelled)."""
    merge_limit: int = 0
    """With `merges`: the most steps a merge spans (H: a merge never passes a round's end; 0: no limit)."""
    noise: list[float] | None = None
    """Each rank's timing noise at calibration (its probes' standard error, seconds); None: unknown."""
    history: list[tuple[int, list[int]]] = field(default_factory=list)
    """(step, split) for the initial split and every change, for the metrics."""
    reason: str = field(default="equal split", init=False)
    """Why the split is what it is, set with every change (every `history` entry) for the
    metrics: "calibrated: ...", "refined: ...", "model: ..." (the model re-split), "probe: ..."
    (a probe starts), "probe over, [...] kept: ..." (the probed split lost), "fallback: ..."
    (the equal split measured faster and is held), "balanced again: ..." (the model's split
    measured faster than the held equal split). Verdicts quote the measured step times."""
    fallback: bool = field(default=False, init=False)
    """True while the equal split is held because it measured faster than the model's split."""

    def __post_init__(self):
        self.caps = list(self.caps) or [None] * self.size
        if len(self.caps) != self.size:
            raise ValueError(f"{len(self.caps)} caps for {self.size} ranks")
        self.overhead = [0.0] * self.size
        self.seconds_per_sample = [1.0] * self.size
        self.equal = self.target()  # nothing measured yet: every rank alike, within its cap
        self.split = list(self.equal)
        self._steps = self._wanted = 0
        self._settled = Recent(self.size)
        # (measured, predicted) step seconds at the split in force, and at the probed split
        self._held: deque[tuple[float, float]] = deque(maxlen=self.window)
        self._probed: list[tuple[float, float]] = []
        self._probe: list[int] | None = None  # the split being probed ...
        self._left = self.split  # ... and the one it left, which it must beat
        self._probe_start = self._probe_end = self._lag = 0
        self._lost_by = 0.0
        # the latest steps whatever split they ran: a trial of the model's move (`trial_wait`) is
        # measured against the steps that ran the split it left
        self._recent: deque[tuple[list[int], float]] = deque(maxlen=self.window)
        self._trial: list[float] | None = None  # during a trial: the latest step times of the split it left
        self._failed_trials = self._trial_end = 0

    def target(self, per_sample: Sequence[float] | None = None) -> list[int]:
        """The integer split that makes every rank's predicted step time equal."""
        p = per_sample or self.seconds_per_sample
        split = self._solve(self.overhead, p)
        seen = [split]
        for _ in range(6 if self.merges else 0):  # the overheads depend on the split: to a fixed point,
            split = self._solve(self.overheads(split), p)  # or the quickest split visited if it cycles
            if split in seen:
                break
            seen.append(split)
        return min(seen, key=lambda s: self.step_time(s, p)) if self.merges else split

    def _solve(self, a: Sequence[float], p: Sequence[float]) -> list[int]:
        """The integer split that makes a_i + p_i * n_i equal across ranks."""
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

    def overheads(self, split: Sequence[int]) -> list[float]:
        """Each rank's fixed seconds per global step at `split`: a_i, or with `merges` a_i over
        the steps it merges there."""
        if not self.merges:
            return list(self.overhead)
        return [a / m for a, m in zip(self.overhead, self.merged_steps(split))]

    def merged_steps(self, split: Sequence[int]) -> list[int]:
        """Each rank's steps per merge at `split` (1 without `merges`). A round of H steps cut
        into merges of m holds ceil(H/m) of them: on average H/ceil(H/m) steps each."""
        largest = max(split)
        out = []
        for n in split:
            m = steps_merged(n, largest) if self.merges else 1
            if self.merge_limit:
                m = self.merge_limit / -(-self.merge_limit // min(m, self.merge_limit))
            out.append(m)
        return out

    def rank_times(self, split: Sequence[int], per_sample: Sequence[float] | None = None) -> list[float]:
        """Each rank's predicted step time with `split`."""
        return [a + p * n for a, p, n in zip(self.overheads(split), per_sample or self.seconds_per_sample, split)]

    def step_time(self, split: Sequence[int], per_sample: Sequence[float] | None = None) -> float:
        """Predicted time of a step with `split`: the slowest rank's."""
        return max(self.rank_times(split, per_sample))

    def calibrate(self, overhead: Sequence[float], seconds_per_sample: Sequence[float], step: int = 0,
                  noise: Sequence[float] | None = None) -> list[int]:
        """Initial split from each rank's measured a_i and p_i (from a short probe). Like every
        later change it must promise a gain above the threshold: ranks that measure alike
        keep the even split instead of a skew made of probe noise; so too when the gain is within
        the probes' `noise` (each rank's standard error, seconds)."""
        self.overhead = [max(0.0, float(a)) for a in overhead]
        self.seconds_per_sample = [max(float(p), 1e-9) for p in seconds_per_sample]
        if noise is not None:
            self.noise = list(noise)
        noise = self.noise  # a later calibration (--inner-steps by-speed's) weighs the probes' noise too
        target = self.target()
        now = self.step_time(self.split)
        gain = now - self.step_time(target)
        if gain > self.threshold * now and self._beyond_noise(gain, self.rank_times(self.split), noise):
            self.split = target
        self._settled = Recent(self.size)
        self.history.append((step, list(self.split)))
        self.reason = f"calibrated: model predicts {_s(self.step_time(self.split))} s/step, {_s(now)} at {self.equal}"
        return self.split

    def _beyond_noise(self, gap: float, seconds: Sequence[float], noise: Sequence[float] | None) -> bool:
        """Whether `gap` (seconds a step: a gain predicted, or the slowest less the fastest rank's
        time measured) is more than `confidence` / 2 standard errors (`noise`, each rank's; None:
        none known) of the timing of the slowest and the fastest of the ranks' step `seconds`. A
        step that hardly depends on its batch (a tiny model) has no split better than another by
        more than its noise, and no move there pays."""
        if noise is None:
            return True
        slow, fast = max(range(self.size), key=seconds.__getitem__), min(range(self.size), key=seconds.__getitem__)
        return apart(gap, noise[slow], noise[fast], self.confidence / 2)

    def _measured(self, step_seconds: Sequence[float], sizes: Sequence[int]):
        """(rank, seconds per sample) for each rank whose step shows a per-sample cost: its time
        less its overhead, over its samples (a rank with no samples tells nothing). A step
        faster than the rank's overhead proves the overhead overrated (calibrated while its
        host was busy): it drops to that step's time, else the rank would keep the minimum
        share for good, every step of it inside the overhead and none measured."""
        for rank, (t, n, merged) in enumerate(zip(step_seconds, sizes, self.merged_steps(sizes) if sizes else [])):
            if n > 0:
                self.overhead[rank] = min(self.overhead[rank], t * merged)
            per_sample = (t - self.overhead[rank] / merged) / n if n > 0 else 0.0
            if per_sample > 0:
                yield rank, per_sample

    def refine(self, step_seconds: Sequence[float], sizes: Sequence[int], step: int = 0,
               noise: Sequence[float] | None = None,
               anchors: Sequence[tuple[float, float]] | None = None) -> list[int]:
        """Re-measure at the calibrated split: each rank timed steps of exactly its share, which
        replace its per-sample cost outright (the calibration probes ran other batch sizes, and
        a_i + p_i * n only extrapolates to the share). Moves to the equal-time split of what was
        measured without the hysteresis threshold: a one-off decision cannot oscillate, and at
        K=10 a slow rank short of 20 samples costs the job <3% a step, for ever (measured: 131
        samples where 149 were due, the slow rank idle 40 ms a step: a gain of 0.9%). But not
        when the ranks timed alike within the probes' `noise` (each rank's standard error): a
        tiny model's step (0.2 ms, launches and Python whatever the share) moved two alike CPU
        ranks from [32, 32] to [18, 46] on its noise alone. Where calibration kept the equal split
        (the ranks timed alike within its probes' noise, or a gain under `threshold`), its fit of
        a_i and p_i is that noise, and the split follows each rank's samples per second as
        measured here instead, which never starves a rank: the fit gave the least share to one of
        two alike CPU ranks of a tiny model (0.3 ms a step, all but fixed cost) that this probe
        timed 100-200 us slower, [1, 63] in 4 runs of 6, where its one sample showed no
        per-sample cost and it stayed.

        `anchors` (each rank's calibration probe farthest from its share: samples, seconds) draw
        each rank's line through both measured points instead, its overhead kept only where the
        two do not make one: from the calibrated overhead alone, a straggler's few samples
        (5-10 of 64, --slowdown 3) carried its probes' noise into its per-sample cost 13-fold, and
        `invoke plan` once put it alone at 1.6x the fast rank's time where it measured 3x."""
        for rank, per_sample in self._measured(step_seconds, sizes):
            self.seconds_per_sample[rank] = per_sample
        for rank, anchor in enumerate(anchors or []):
            self._through(rank, sizes[rank], step_seconds[rank], *anchor)
        by_speed = self.split == self.equal
        if by_speed and min(step_seconds) <= 0:  # no time measured: no speed to split by
            return self.split
        if by_speed:
            speeds = [n / t for n, t in zip(sizes, step_seconds)]
            target = proportional_split(self.global_batch, speeds, self.minimum, self.caps)
        else:
            target = self.target()
        if target != self.split and self._beyond_noise(max(step_seconds) - min(step_seconds), step_seconds, noise):
            why = (f"by the samples per second measured at {self.split} ({', '.join(_s(t) for t in step_seconds)} s)"
                   if by_speed else f"measured at {self.split}, predicts {_s(self.step_time(target))} s/step")
            self._move(target, step, f"refined: {why}")
        return self.split

    def _through(self, rank: int, n: int, seconds: float, far: float, far_seconds: float) -> None:
        """Rank `rank`'s a and p from the line through two single steps it measured (probes
        merge nothing): n samples in `seconds` and `far` in `far_seconds`; left as they are where
        the two make no line of a positive cost a sample. A line below zero at no samples (a cost
        a sample that grows with the batch, as on CPUs) is no overhead and the larger probe's
        cost a sample: the smaller's, a straggler's few samples, carried its noise 13-fold."""
        if n <= 0 or far == n:
            return
        p = (far_seconds - seconds) / (far - n)
        if p <= 0:
            return
        a = seconds - p * n
        if a < 0:
            a, p = 0.0, max((n, seconds), (far, far_seconds))[1] / max(n, far)
        self.overhead[rank], self.seconds_per_sample[rank] = a, p

    def observe(self, step_seconds: Sequence[float], sizes: Sequence[int], step: int) -> list[int] | None:
        """Feed every rank's compute time for a step and the samples each had; returns a new
        split when the measured speeds moved far enough or a probe starts or ends, else None
        (keep the current one)."""
        sizes = list(sizes)
        predicted = self.step_time(sizes)
        for rank, per_sample in self._measured(step_seconds, sizes):
            old = self.seconds_per_sample[rank]
            self.seconds_per_sample[rank] = old + self.smoothing * (per_sample - old)
            if sizes == self.split:
                self._settled.add(rank, per_sample)
        self._record(max(step_seconds), predicted, sizes)
        self._steps += 1
        if self._probe is not None:
            return self._verdict(step)
        if self._steps % self.interval:
            return None
        if self.fallback:
            return self._probe_model(step)
        return self._follow_model(step) or self._probe_equal(step)

    def _follow_model(self, step: int) -> list[int] | None:
        """The model's new split when it promises a real gain, else None."""
        target = self.target()
        now, then = self.step_time(self.split), self.step_time(target)
        # Hysteresis in size (a real gain) and in time (seen at two decisions in a row).
        self._wanted = self._wanted + 1 if now - then > self.threshold * now else 0
        if self._wanted >= self.patience:
            return self._start_trial(target, step, f"model: predicts {_s(then)} s/step against {_s(now)} at {self.split}")
        settled = self._settled_target()
        if settled is None:
            return None
        target, mean = settled
        self.seconds_per_sample = mean  # the better estimate, and the one the move is based on
        return self._move(target, step, f"model, averaged over the steps at {self.split}: predicts "
                                        f"{_s(self.step_time(target))} s/step against {_s(self.step_time(self.split))}")

    def _settled_target(self) -> tuple[list[int], list[float]] | None:
        """The split for the typical per-sample costs of the latest steps at the current split
        (step_times.Recent: a busy host's spikes left out), and those costs, if that many steps
        were seen, the gain is above `fine_threshold` and the imbalance behind it (slowest minus
        fastest predicted time) is `confidence` standard errors clear of noise."""
        stats = self._settled.summary()
        if stats is None or min(count for _, _, count in stats) < self.settle:
            return None
        mean = [m for m, _, _ in stats]
        target = self.target(mean)
        now, then = self.step_time(self.split, mean), self.step_time(target, mean)
        if target == self.split or now - then <= self.fine_threshold * now:
            return None
        times = [(a + m * n, se * n) for a, (m, se, _), n in zip(self.overheads(self.split), stats, self.split)]
        (slow, slow_se), (fast, fast_se) = max(times), min(times)
        if not apart(slow - fast, slow_se, fast_se, self.confidence):
            return None
        return target, mean

    def _record(self, seconds: float, predicted: float, sizes: list[int]) -> None:
        """File the job's step time (its slowest rank's) by the split the step really ran: the
        probed split's steps, or the split in force's (the model's splits, or the equal one
        while it is held). Steps of the other kind are late steps of the split just left, and an
        epoch's short last step measures no split at all."""
        if sum(sizes) != self.global_batch:
            return
        self._recent.append((sizes, seconds))
        if sizes == self._probe:
            self._probed.append((seconds, predicted))
        elif (sizes == self.equal) == self.fallback:
            self._held.append((seconds, predicted))

    def _probe_equal(self, step: int) -> list[int] | None:
        """The equal split, to be timed, when the model no longer explains the measured step
        time of its split and the probe's cost is within budget."""
        if self.split == self.equal or len(self._held) < self.window:
            return None
        measured, predicted = fmean(m for m, _ in self._held), fmean(p for _, p in self._held)
        if abs(measured - predicted) <= self.tolerance * predicted or not self._probe_due(self.equal):
            return None
        return self._start_probe(self.equal, step, f"probe: equal split, as {self.split} measures "
                                                   f"{_s(measured)} s/step where the model predicts {_s(predicted)}")

    def _probe_model(self, step: int) -> list[int] | None:
        """While the equal split is held: the model's split, to be timed, when the model predicts
        it faster than the equal split measures by `margin` (as when a busy host went quiet;
        while it is busy, the model's own split is mostly predicted well, the equal one not)
        and the probe's cost is within budget."""
        target = self.target()
        then, now = self.step_time(target), self._typical_held()
        if target == self.equal or then >= (1 - self.margin) * now or not self._probe_due(target):
            return None
        return self._start_probe(target, step, f"probe: model's split, predicted {_s(then)} s/step "
                                               f"against {_s(now)} measured at {self.equal}")

    def _probe_due(self, split: list[int]) -> bool:
        """Whether the steps since the last probe cover the cost of one of `split` within budget:
        its steps times how much slower the model predicts them than the split in force
        measures, or the last probe measured them if it lost by more. The last probe's lag
        (steps that still ran the old split at its start) repeats at its end, at the probed split."""
        slower = max(self.step_time(split) / self._typical_held() - 1, self._lost_by)
        cost = (self.probe_steps + self._lag) * slower
        least = 0 if self.fallback else self.probe_every
        return self._steps - self._probe_end >= max(least, cost / self.probe_budget)

    def _typical_held(self) -> float:
        return typical([m for m, _ in self._held])

    def _start_trial(self, target: list[int], step: int, reason: str) -> list[int] | None:
        """The model's move, to be kept only if it measures faster (`trial_wait`); None while the
        last trial that did not pay still waits out its time, or while too few steps ran the split
        in force to measure it against (a move straight away there chained untried moves)."""
        if not self.trials:
            return self._move(target, step, reason)
        failed = self._failed_trials
        if failed and self._steps - self._trial_end < self.trial_wait * 2 ** min(failed - 1, 3):
            return None
        before = [seconds for sizes, seconds in self._recent if sizes == self.split]
        if len(before) < self.trial_steps:
            return None
        self._trial = before[-self.trial_steps:]  # the latest: the speeds may have just changed
        return self._start_probe(target, step, reason)

    def _trial_verdict(self, step: int) -> list[int] | None:
        """A trial's steps are in: keep its split if it measured faster than the one it left (beyond
        noise), else go back to that one and wait longer before the next trial."""
        before, self._trial = self._trial, None
        tried, left, self._probe, self._trial_end = self.split, self._left, None, self._steps
        self._lag = self._steps - self._probe_start - self.trial_steps
        (ours, ours_se), (theirs, theirs_se) = typical_se([m for m, _ in self._probed]), typical_se(before)
        if apart(theirs - ours, theirs_se, ours_se, self.confidence / 2):
            self._failed_trials = 0
            self._held.extend(self._probed)
            return None
        self._failed_trials += 1
        return self._move(left, step, f"model's split {tried} measured {_s(ours)} s/step against {_s(theirs)} "
                                      f"at {left}, {left} kept: no faster beyond the noise of either (standard "
                                      f"errors {_s(ours_se)} and {_s(theirs_se)})")

    def _start_probe(self, split: list[int], step: int, reason: str) -> list[int]:
        self._probe, self._probed, self._left, self._probe_start = split, [], self.split, self._steps
        return self._move(split, step, reason)

    def _verdict(self, step: int) -> list[int] | None:
        """Once `probe_steps` steps ran the probed split: keep whichever split has the lower
        typical step time (the probed one only by `margin`), and say which and why."""
        if len(self._probed) < (self.trial_steps if self._trial is not None else self.probe_steps):
            return None
        if self._trial is not None:
            return self._trial_verdict(step)
        probed, held, self._probe, self._probe_end = self.split, self._left, None, self._steps
        self._lag = self._steps - self._probe_start - self.probe_steps
        ours, theirs = typical([m for m, _ in self._probed]), self._typical_held()
        verdict = f"{_s(ours)} s/step at {probed} against {_s(theirs)} at {held}"
        if ours >= (1 - self.margin) * theirs:
            self._lost_by = ours / theirs - 1
            return self._move(held, step, f"probe over, {held} kept: measured {verdict}")
        self.fallback, self._lost_by = not self.fallback, 0.0
        self._held = deque(self._probed, maxlen=self.window)
        return self._move(probed, step, f"{'fallback' if self.fallback else 'balanced again'}: measured {verdict}")

    def _move(self, target: list[int], step: int, reason: str) -> list[int]:
        self._wanted = 0
        self._settled = Recent(self.size)
        self.split = list(target)
        self.history.append((step, list(target)))
        self.reason = reason
        return self.split


def _s(seconds: float) -> str:
    return f"{seconds:.3g}"
