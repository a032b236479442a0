"""Whether a job trains slower than its fastest rank would alone.

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

Under local:H / diloco:H each whole round that lands tells every rank's mean seconds and samples
per global step in it, all of a step included; the job's step is rank 0's own over the round: its
steps, then its blocking time at the round's end (the wait for the slowest rank to end the round,
the exchange) spread over the round's steps. A verdict takes MIN_OBSERVATIONS rounds at least (the
median of three: the first round runs the calibration's split). On the H200 machine DiLoCo (H=32,
overlapped) trained at 0.31x of the GPU alone, its rounds waiting for the CPU rank's 38 ms steps
of 2 samples against the GPU's 17.5 ms of 254, with nothing said either.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from statistics import median, mode

MARGIN = 0.8
"""Said when the job's samples/s are below this fraction of the fastest rank's alone."""
WINDOW = 30
"""Steps whose median step time is the job's."""
SETTLE = 60
"""Steps before the first verdict: the calibration's split settled, the first re-splits made."""
MIN_OBSERVATIONS = 3
"""Observations before the first verdict: rounds of local/diloco (a step sync's steps are SETTLE's)."""


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

    def waited_for(self, times: Sequence[float]) -> int:
        """The rank the steps wait for: the slowest of the others (the balancer evens their times)."""
        return max((r for r in range(len(times)) if r != self.fastest), key=times.__getitem__)

    def line(self, step: int, hosts: Sequence[str], times: Sequence[float], sizes: Sequence[int], *,
             equal_split: bool, auto: bool, inner: str | None = None) -> str:
        """What the console says, with the ways out that fit the job's options; `inner`: the
        job's --inner-steps under local/diloco (None: step sync)."""
        fast, slow = self.fastest, self.waited_for(times)
        ways = ["without --equal-split"] if equal_split else []
        if hosts[fast] == hosts[slow]:  # the ranks share one machine's cores (the default `local` host's two)
            ways.append(f"with one rank on {hosts[fast]} (`slots: 1` for it in the inventory: its ranks share its "
                        "cores; with `device: cuda,cpu`, its GPU slot alone)")
        else:
            ways.append("without the slower ranks (--hosts; on a host with `device: cuda,cpu`, its GPU slot alone)")
        if not auto and inner is None:
            ways.append("with an exchange every H steps (--sync diloco:32 --overlap-sync)")
        elif not auto and inner == "same":
            ways.append("with --inner-steps by-speed (the slower ranks' shares merged into bigger steps)")
        share = round(sizes[slow]) if abs(sizes[slow] - round(sizes[slow])) < 0.05 else round(sizes[slow], 1)
        samples = f"{share} sample{'s' if share != 1 else ''}"
        waits = (f"Each step waits for rank {slow} ({hosts[slow]}), {_ms(times[slow])} ms for its {samples}, and "
                 "for the gradients' exchange" if inner is None else
                 f"Each round's steps wait for rank {slow} ({hosts[slow]}), {_ms(times[slow])} ms a step for its "
                 f"{samples}, and for the exchange")
        return (f"hvdhetero: step {step}: the job trains about {self.batch / self.job_s:,.0f} samples/s, where rank "
                f"{fast} ({hosts[fast]}) alone would train about {self.batch / self.alone_s:,.0f} (its own steps "
                f"here, scaled to the whole batch): {self.ratio:.2f}x. {waits}. "
                f"Train {', or '.join(ways)}; `invoke plan` predicts each (metrics.jsonl: slower_than_alone)")


@dataclass
class AloneWatch:
    """Rank 0's steps, to one verdict per run (`said`)."""

    steps: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    alone: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    batches: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    seen: int = 0
    said: bool = False

    def observe(self, step_s: float, times: Sequence[float], sizes: Sequence[float], steps: int = 1) -> Verdict | None:
        """One step: the job's (`step_s`, wall seconds) and every rank's measured compute
        (`times`) at its share (`sizes`); a Verdict the first time the job is clearly slower than
        its fastest rank would be alone, else None. A round of local/diloco is one observation
        of its `steps` global steps, each of them its mean."""
        batch = sum(sizes)
        bounds = [(t * batch / n, rank) for rank, (t, n) in enumerate(zip(times, sizes)) if n > 0 and t > 0]
        if not bounds:
            return None
        self.steps.append(step_s)
        self.alone.append(min(bounds))
        self.batches.append(batch)
        self.seen += steps
        if self.said or self.seen < SETTLE or len(self.steps) < MIN_OBSERVATIONS:
            return None
        alone_s, job_s = median(s for s, _ in self.alone), median(self.steps)
        if job_s <= 0 or alone_s / job_s >= MARGIN:
            return None
        self.said = True
        return Verdict(mode(r for _, r in self.alone), alone_s, job_s, int(median(self.batches)))


def _ms(seconds: float) -> str:
    """Milliseconds to two significant digits below 10 (a tiny model's 0.3 ms read "0 ms")."""
    ms = seconds * 1e3
    return f"{ms:,.0f}" if ms >= 10 else f"{ms:.2g}"
