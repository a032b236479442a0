"""Whether a step-sync job trains slower than its fastest rank would alone.

A rank far slower than the others gets the balancer's fewest samples, yet every step still
waits for its fixed costs and for the gradients' exchange. On the H200 machine a 14-core CPU
rank beside the GPU (82x slower on ResNet-18) took 143 ms a step for 2 samples, and the job
trained at 0.10x of the GPU alone, with nothing on the console to say so.

A rank's step alone on the whole global batch B is about its measured step at its share n
times B / n (its fixed costs a >= 0 do not grow with the batch: a + pB <= (a + pn) B / n). That,
not the balancer's model (its a and p, fitted on splits that barely move, put two equal CPU
ranks' digits job at 0.57x of one rank alone, more than their step times bear out), is set
against the job's own steps (rank 0's compute and reduce: the exchange and the wait for the
slowest included), medians over WINDOW steps. Both leave out the optimizer's step and the
script's own work between steps, which makes the ratio read low, so only a job clearly below
(MARGIN) is said to be slower. Once per Training: under --elastic, once per membership.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from statistics import median

MARGIN = 0.8
"""Said when the job's samples/s are below this fraction of the fastest rank's alone."""
WINDOW = 30
"""Steps whose median step time is the job's."""
SETTLE = 60
"""Steps before the first verdict: the calibration's split settled, the first re-splits made."""


@dataclass(frozen=True)
class Verdict:
    fastest: int
    """The rank that would train fastest alone."""
    alone_s: float
    """Its step alone on the whole global batch, about (median over the window)."""
    job_s: float
    """The job's median step."""
    batch: int
    """The median global batch of those steps (an epoch's short last step aside)."""

    @property
    def ratio(self) -> float:
        """The job's samples/s as a fraction of the fastest rank's alone."""
        return self.alone_s / self.job_s


@dataclass
class AloneWatch:
    """Rank 0's steps, to one verdict per run (`said`)."""

    steps: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    alone: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    batches: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    seen: int = 0
    said: bool = False

    def observe(self, step_s: float, times: Sequence[float], sizes: Sequence[int]) -> Verdict | None:
        """One step: the job's (`step_s`, wall seconds) and every rank's measured compute
        (`times`) at its share (`sizes`); a Verdict the first time the job is clearly slower than
        its fastest rank would be alone, else None."""
        batch = sum(sizes)
        bounds = [(t * batch / n, rank) for rank, (t, n) in enumerate(zip(times, sizes)) if n > 0 and t > 0]
        if not bounds:
            return None
        self.steps.append(step_s)
        self.alone.append(min(bounds))
        self.batches.append(batch)
        self.seen += 1
        if self.said or self.seen < SETTLE:
            return None
        alone_s, job_s = median(s for s, _ in self.alone), median(self.steps)
        if job_s <= 0 or alone_s / job_s >= MARGIN:
            return None
        self.said = True
        fastest = max(set(r for _, r in self.alone), key=[r for _, r in self.alone].count)
        return Verdict(fastest, alone_s, job_s, int(median(self.batches)))
