"""Which hosts and which sync mode: measured speeds and link, predicted samples/s, one advice.

`invoke plan` (and `invoke train --sync auto`) run the user's script up to `job.prepare`, which
calibrates every rank as training would (its step time t_i(n) = a_i + p_i n on the real model,
rank/calibrate.py) and then times the link the exchange would use (rank/autosync.py): allreduces
of one number (latency L) and of the model's bytes in the wire's dtype (C) over the same Gloo path, and the
CPU work an exchange adds on each rank (X: copies and flattening). From those, for every
subset of hosts and every mode, the step time of a global batch B:

    alone (one rank)     t = a + p B
    step                 t = T + C                      T: the balanced split's step (all ranks
    local/diloco:H       t = T + (C + L + X) / H           finish together), from the a_i, p_i
    ... overlapped       t = T + (L + X + max(0, C - H T)) / H   (the allreduce runs while the
                                                                   next H steps compute)

and samples/s = B / t. With --inner-steps by-speed a slower rank merges its shares into steps
about the largest share's size, so its a_i counts once a merge (a_i / m_i a step): T is the
split balanced for that (policy/balancer.py, `merges`). Step sync is predicted without the part of C that hides behind
backward, so it errs on the slow side; it is never what a slow link recommends.

An overlapped mode is advised only when its exchange fits in half a round (HEADROOM): under
training load the transfer slows by more than the probes see (8 Mbit: 0.75 s idle, 0.73 s
beside the probe's matrix products, up to 1.8 s beside real training), so diloco:16 overlapped
with 1.15 s rounds was predicted 1.05x and measured 0.96x, while diloco:32 (2.3 s) measured 1.05x.

The advice: the fastest prediction, unless it is within 3% of the fastest host alone (then
that host alone: a second machine is not worth its risk for less); among the modes within 2%
of the best, the one whose information from the other ranks is freshest (staleness H steps at
once, 2H overlapped), since larger H converges slower per sample (DiLoCo, local SGD papers).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field

from hvdhetero.policy.balancer import Balancer

EVERY = (4, 8, 16, 32, 64, 128)
"""The H a plan considers for local/diloco."""
ALONE_MARGIN = 0.03
"""A multi-host mode must beat the fastest host alone by more than this to be advised."""
PER_SAMPLE_CAUTION = 0.15
"""Below this gain over the fastest host alone, advice for local/DiLoCo says that the rate may
not buy an earlier accuracy: syncing every H steps can learn less per sample, and a model
evaluated without an exchange is a round or two old (on digits at K=12 the pair was +6-12% in
samples/s and reached 98% 1.02x as fast as the fast host alone in the same mode by the training
loop's clock, at 8 and 25 Mbit, the median over 4 seeds of each seed's ratio; by the elapsed
clock 0.94x and 1.02x: within this VM's noise; docs/benchmarks.md)."""
NEAR_BEST = 0.02
"""Modes within this of the best rate count as equally fast; the freshest of them is advised."""
HEADROOM = 2.0
"""An overlapped mode is advised only when a round lasts this many times its exchange."""


@dataclass
class Measured:
    """What a plan is computed from (every rank's numbers; the same on every rank)."""

    hosts: list[str]
    """Per rank: its host's name."""
    devices: list[str]
    overhead: list[float]
    """Per rank: a_i, seconds per step whatever the batch."""
    per_sample: list[float]
    """Per rank: p_i, seconds per sample."""
    global_batch: int
    wire_bytes: int
    """The model's parameters (and float buffers) in the wire's dtype."""
    latency_s: float
    """An allreduce of one number across all ranks."""
    exchange_s: float
    """An allreduce of the model's bytes across all ranks (the slowest of a few, each after a pause)."""
    copy_s: float
    """The CPU work of one exchange on the slowest rank (copies to and from the CPU, flattening)."""
    caps: list = field(default_factory=list)
    """Per rank: the most samples it may take a step (the inventory's max_batch), or None."""
    busy_exchange_s: float = 0.0
    """The same exchange while the rank computes (the slowest of a few): with training on the
    core, the transfer's threads wait their turn. At 8 Mbit 0.75 s idle took up to 1.8 s behind
    compute, so diloco:16 overlapped (1.15 s rounds) predicted 1.05x and measured 0.96x."""
    stolen: float = 0.0
    """Share of a rank's compute lost while an exchange is on the link (the worst rank's):
    an exchange behind compute is not free. Measured 0.1-0.13 on the one-core test hosts (the
    sender's shaping and Gloo's copies run on the core that trains); assumed 0, the plan
    advised diloco:4 overlapped at 25 Mbit for a predicted 1.04x that measured 0.85x."""

    @property
    def bandwidth_mbit(self) -> float | None:
        """The link's rate as the exchange saw it; None when latency alone explains its time."""
        if self.exchange_s < 1.5 * self.latency_s:
            return None
        return 8 * self.wire_bytes / (self.exchange_s - self.latency_s) / 1e6


@dataclass
class Prediction:
    hosts: tuple[str, ...]
    """Who trains: host names, or host[rank] when the job has one host."""
    ranks: tuple[int, ...]
    names: tuple[str, ...]
    """The inventory hosts (for --hosts)."""
    sync: str
    """alone, step, local:H or diloco:H (local and diloco move the same bytes: one prediction)."""
    overlap: bool
    step_s: float
    samples_per_s: float
    staleness: int
    """Steps the other ranks' work may be old when a rank sees it: 0 step sync, H, 2H overlapped."""
    vs_fastest: float = 0.0
    headroom: float = 0.0
    """Overlapped: a round's compute over its exchange (behind compute); below HEADROOM the
    exchange may outlast the round under load and the mode is not advised."""
    inner_steps: str = "same"
    """local/diloco: same (every rank H steps a round) or by-speed (a slower rank merges steps)."""
    flush_s: float = 0.0
    """local/diloco: what one job.evaluate or job.save adds, exchanging at once so that every
    rank holds one model (not behind compute)."""

    @property
    def fits(self) -> bool:
        return not self.overlap or self.headroom >= HEADROOM

    @property
    def label(self) -> str:
        hosts = "+".join(self.hosts)
        if self.sync == "alone":
            return f"{hosts} alone"
        return f"{hosts} {self.mode}"

    @property
    def mode(self) -> str:
        """The sync mode in words: step, diloco:H [overlapped] [by-speed]."""
        return (self.sync + (" overlapped" if self.overlap else "")
                + (" by-speed" if self.inner_steps != "same" else ""))

    @property
    def one_slot(self) -> str | None:
        """The host whose one rank alone this is, where the host runs several (`local[1] alone`):
        `--hosts` alone starts them all, its `slots: 1` in the inventory one."""
        return self.names[0] if self.sync == "alone" and "[" in self.hosts[0] else None

    @property
    def flags(self) -> str:
        """The `invoke train` options that run it."""
        hosts = f"--hosts {','.join(self.names)}"
        if self.sync in ("alone", "step"):
            return hosts + ("" if self.sync == "alone" else " --sync step")
        return (f"{hosts} --sync {self.sync}" + (" --overlap-sync" if self.overlap else "")
                + (f" --inner-steps {self.inner_steps}" if self.inner_steps != "same" else ""))


@dataclass
class Plan:
    measured: Measured
    predictions: list[Prediction]
    advice: Prediction
    reason: str
    step_only: str = ""
    """Why local/diloco rounds were not weighed (the job cannot run them); "" when they were."""

    def to_json(self) -> dict:
        return {"measured": asdict(self.measured), "predictions": [asdict(p) | {"label": p.label}
                                                                   for p in self.predictions],
                "advice": asdict(self.advice) | {"label": self.advice.label, "flags": self.advice.flags},
                "reason": self.reason, "step_only": self.step_only}


def predict(m: Measured, subsets: bool = True, rounds: bool = True) -> list[Prediction]:
    """Every subset of hosts (or only all of them) in every mode (`rounds` False: alone and step
    only), from the measurements."""
    names = list(dict.fromkeys(m.hosts))
    if len(names) > 1:
        units = [(h, tuple(r for r, x in enumerate(m.hosts) if x == h)) for h in names]
    else:  # one host with several ranks (the local default): its ranks alone and together
        units = [(f"{m.hosts[r]}[{r}]", (r,)) for r in range(len(m.hosts))]
    groups = [c for k in range(1, len(units) + 1) for c in itertools.combinations(units, k)]
    if not subsets:
        groups = [tuple(units)]
    out = []
    for group in groups:
        labels = tuple(label for label, _ in group)
        ranks = tuple(r for _, rs in group for r in rs)
        if len(ranks) == 1:
            r = ranks[0]
            out.append(_made(labels, ranks, "alone", False, m.overhead[r] + m.per_sample[r] * m.global_batch, 0, m))
            continue
        caps = [m.caps[r] for r in ranks] if m.caps else ()
        try:
            balancer = Balancer(m.global_batch, len(ranks), caps=caps)
        except ValueError:  # their caps (max_batch) hold less than the global batch
            continue
        a, p = [m.overhead[r] for r in ranks], [m.per_sample[r] for r in ranks]
        t = balancer.step_time(balancer.calibrate(a, p))
        out.append(_made(labels, ranks, "step", False, t + m.exchange_s, 0, m))
        for h in EVERY if rounds else ():
            out += _rounds(labels, ranks, h, t, "same", m)
            # --inner-steps by-speed: a slower rank merges its shares into steps about the largest
            # share's size, paying its fixed cost once a merge (policy/balancer.py `merges`)
            merging = Balancer(m.global_batch, len(ranks), caps=caps, merges=True, merge_limit=h)
            quicker = merging.step_time(merging.calibrate(a, p))
            if quicker < t:  # listed where merging gains (no fixed cost a step: nothing to gain)
                out += _rounds(labels, ranks, h, quicker, "by-speed", m)
    fastest = max(p.samples_per_s for p in out if len(p.hosts) == 1) if any(len(p.hosts) == 1 for p in out) else 0
    for p in out:
        p.vs_fastest = p.samples_per_s / fastest if fastest else 0.0
    return out


def _rounds(labels, ranks, h: int, t: float, inner: str, m: Measured) -> list[Prediction]:
    """diloco:H at once and overlapped, for a step of `t` seconds between exchanges."""
    exposed = m.exchange_s + m.latency_s + m.copy_s  # an exchange not behind compute: a round's, or a flush
    at_once = _made(labels, ranks, f"diloco:{h}", False, t + exposed / h, h, m, inner)
    behind = max(m.exchange_s, m.busy_exchange_s)
    hidden = t + (m.latency_s + m.copy_s + m.stolen * min(behind, h * t) + max(0.0, behind - h * t)) / h
    overlapped = _made(labels, ranks, f"diloco:{h}", True, hidden, 2 * h, m, inner)
    overlapped.headroom = h * t / max(behind, 1e-9)
    at_once.flush_s = overlapped.flush_s = exposed
    return [at_once, overlapped]


def _made(labels, ranks, sync, overlap, step_s, staleness, m: Measured, inner: str = "same") -> Prediction:
    names = tuple(dict.fromkeys(m.hosts[r] for r in ranks))
    return Prediction(labels, ranks, names, sync, overlap, step_s, m.global_batch / step_s, staleness,
                      inner_steps=inner)


def advise(predictions: list[Prediction]) -> tuple[Prediction, str]:
    """The advised prediction and why, in plain words."""
    if not predictions:
        raise ValueError("advise() needs at least one prediction")
    predictions = [p for p in predictions if p.fits]  # never empty: alone and step always fit
    best = max(predictions, key=lambda p: p.samples_per_s)
    alone = [p for p in predictions if len(p.hosts) == 1]
    fastest_alone = max(alone, key=lambda p: p.samples_per_s) if alone else None
    together = [p for p in predictions if len(p.hosts) > 1]
    best_together = max(together, key=lambda p: p.samples_per_s) if together else None
    if best_together is not None:  # the one the table shows: within 2% of it, the freshest (_shown)
        best_together = _freshest([p for p in together if p.hosts == best_together.hosts])
    if (fastest_alone is not None and best_together is not None
            and best_together.samples_per_s < (1 + ALONE_MARGIN) * fastest_alone.samples_per_s):
        others = sorted(set(best_together.hosts) - set(fastest_alone.hosts))
        gain = best_together.samples_per_s / fastest_alone.samples_per_s - 1
        verb = "more than" if gain < 0 else "about as much as"
        return fastest_alone, (f"train on {'+'.join(fastest_alone.hosts)} alone: the link costs {verb} "
                               f"{', '.join(others)} add{'s' if len(others) == 1 else ''} (best with "
                               f"{'them' if len(others) > 1 else 'it'}: {best_together.label}, {gain:+.0%})")
    pick = _freshest([p for p in predictions if p.hosts == best.hosts])
    if fastest_alone is None or len(pick.hosts) == 1:
        return pick, f"use {pick.label}"
    gain = pick.samples_per_s / fastest_alone.samples_per_s - 1
    reason = f"use {pick.label}: {gain:+.0%} over {'+'.join(fastest_alone.hosts)} alone"
    if pick.sync != "step" and gain < PER_SAMPLE_CAUTION:
        reason += (f" in samples/s; syncing every {pick.sync.split(':')[1]} steps learns less per sample, which can "
                   f"cost more than {gain:+.0%}: before a long run, compare the time to your accuracy with `invoke "
                   f"bench --to-accuracy A {pick.flags}`")
    if pick.sync != "step" and gain > 0 and pick.flush_s:
        # One flush every n steps costs flush_s / (n step_s) of the training time, the whole gain
        # at n = flush_s / (gain step_s). flush_s is a lower bound: a flush also waits for the
        # round in flight and for a slow rank's merged step (digits at 8 Mbit: 1.3 s measured
        # against 0.75 s predicted; an evaluation every 23-step epoch took the pair 1.7x the fast
        # host's elapsed time to 98%, where by the training loop's clock it was 1.07x as fast).
        every = math.ceil(pick.flush_s / (gain * pick.step_s))
        reason += (f"; each job.evaluate or job.save first exchanges at once (at least {pick.flush_s:.2f} s here, "
                   f"{pick.flush_s / pick.step_s:,.1f} steps' time): they cost the whole {gain:+.0%} when "
                   f"~{every:,} steps apart, so call them several times less often than that, or watch the run "
                   "with job.evaluate(..., exchange=False) (the global model, a round or two old, nothing exchanged)")
    return pick, reason


def render(plan: Plan) -> str:
    """The table and the advice, for the console."""
    m = plan.measured
    lines = ["ranks: " + "; ".join(f"{r} {h} ({d}): {m.global_batch / (a + p * m.global_batch):,.0f} samples/s alone"
                                   for r, (h, d, a, p) in enumerate(zip(m.hosts, m.devices, m.overhead, m.per_sample))),
             f"link: {m.wire_bytes / 1e6:.2f} MB exchange {m.exchange_s * 1e3:,.1f} ms ("
             f"{f'~{m.bandwidth_mbit:,.0f} Mbit/s' if m.bandwidth_mbit else 'latency-bound'}), "
             f"latency {m.latency_s * 1e3:.1f} ms, CPU work per exchange {m.copy_s * 1e3:.1f} ms, "
             f"{m.busy_exchange_s * 1e3:,.1f} ms "
             f"behind compute, costing it {m.stolen:.0%}; global batch "
             f"{m.global_batch}",
             f"{'':48}{'samples/s':>11}{'vs fastest':>12}{'step ms':>9}"]
    shown = _shown(plan.predictions)
    for p in shown:
        mark = "  <- advised" if p is plan.advice else ""
        lines.append(f"{p.label:48}{p.samples_per_s:11,.0f}{p.vs_fastest:11.2f}x{p.step_s * 1e3:9.1f}{mark}")
    if plan.step_only:
        lines.append(f"local/diloco: not weighed: {plan.step_only}")
    lines.append(f"advice: {plan.reason}")
    one = plan.advice.one_slot
    lines.append(f"  invoke train {plan.advice.flags} ..." + (f"   (with `slots: 1` for {one} in the inventory: "
                                                              "--hosts alone starts every rank of it)" if one else ""))
    return "\n".join(lines)


def _shown(predictions: list[Prediction]) -> list[Prediction]:
    """Per host subset: alone or step, and for local/diloco the freshest H within 2% of the
    best, at once and overlapped, each rank H steps a round and by-speed (the full list is in
    the JSON)."""
    shown = []
    for hosts in dict.fromkeys(p.hosts for p in predictions):
        group = [p for p in predictions if p.hosts == hosts]
        shown += [p for p in group if p.sync in ("alone", "step")]
        for inner, overlap in itertools.product(("same", "by-speed"), (False, True)):
            modes = [p for p in group if p.sync.startswith("diloco") and p.overlap == overlap
                     and p.inner_steps == inner]
            if modes:
                shown.append(_freshest([p for p in modes if p.fits] or modes))
    return shown


def _freshest(predictions: list[Prediction]) -> Prediction:
    """Among those within NEAR_BEST of the fastest, the one whose news of the others is freshest."""
    top = max(p.samples_per_s for p in predictions)
    return min((p for p in predictions if p.samples_per_s >= (1 - NEAR_BEST) * top),
               key=lambda p: (p.staleness, -p.samples_per_s))


def make(m: Measured, subsets: bool = True, step_only: str = "") -> Plan:
    """The plan; `step_only`, where the job cannot run local/diloco rounds, says why (the plan
    then weighs alone and step sync only, and says so)."""
    predictions = predict(m, subsets, rounds=not step_only)
    advice, reason = advise(predictions)
    return Plan(m, predictions, advice, reason, step_only)
