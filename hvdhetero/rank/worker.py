"""One step of compute on this rank's device: forward and backward over its share of the
batch, in micro-batches whose gradients accumulate, with the straggler injection experiments
use, and the timing that picks the micro-batch size. Training and the benchmark both step
through here; gradients leave through the reducer (reducer.py).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from hvdhetero.rank import batches, devices
from hvdhetero.config import check_micro_batch


STRAGGLER_WINDOW = 25
"""Steps of one size whose median compute a straggler multiplies."""


@dataclass
class Worker:
    """This rank's compute: its device, the slowdown an experiment gives it (the straggler), the
    most samples its memory takes and its micro-batch size. (The rank's number is hvd.rank():
    "rank" alone means that number everywhere.)"""

    device: devices.Device
    slowdown: float
    max_batch: int | None
    last_compute: float = 0.0
    """Wall-clock seconds of the last forward/backward, straggling excluded."""
    last_busy: float = 0.0
    """What the straggler multiplies: the last forward/backward's compute on this device (see
    `busy_clock`)."""
    micro_batch: int | None = None
    """Most samples per forward/backward (gradients accumulate over chunks); None: all."""
    recent: deque = field(default_factory=lambda: deque(maxlen=STRAGGLER_WINDOW))
    """(samples, busy seconds) of the last steps: the straggler's measure."""

    def busy_clock(self):
        """The clock that times this rank's device compute. A CPU rank computing on one thread
        (every pinned rank does) uses that thread's CPU time: the Horovod background thread's
        allreduce, which overlaps the last backward on the same core, is communication, and a
        slower device would not slow it down; nor the background thread's coordination cycles,
        nor another tenant's use of the core. Multiplied by k-1 they made up ~15% of a K=10
        straggler's time (`invoke bench --slowdown 10`: its solo rate was 540-576 samples/s by
        wall clock, 682 by this clock). Other devices, and multi-threaded CPU ranks, use wall
        time."""
        if self.device.name == "cpu" and torch.get_num_threads() == 1:
            return time.thread_time
        return time.perf_counter

    def straggle(self, n: int) -> float:
        """Act `slowdown` times slower on a step of n samples, before computing it (so
        gradients are ready when a slow device's would be): sleep (k-1) x the median compute
        (`busy_clock`) of the last steps of exactly n samples. No CPU is used. The median keeps one
        noisy step from being multiplied by k-1 into the next, and its long window keeps the
        VM's slow stretches out of the sleep: a device k times slower takes k times the typical
        time, and its noise is its own (this step's compute), not the host's times k-1 (with
        5 steps, a K=10 straggler's steps swung 240-337 ms with the VM). Keying on n keeps a re-split
        (or a probe of another size) from sleeping for another batch's time, including its
        per-step overhead. Returns the pause, 0 when no step of n samples was measured yet
        (then `straggle_after` sleeps once the step's own compute is known)."""
        same = [seconds for samples, seconds in self.recent if samples == n]
        if self.slowdown <= 1.0 or not same or not n:
            return 0.0
        return self._sleep((self.slowdown - 1.0) * statistics.median(same))

    def straggle_after(self, n: int, compute: float) -> float:
        """The first step of n samples: sleep (k-1) x its own compute (`busy_clock`), after
        computing it."""
        return self._sleep((self.slowdown - 1.0) * compute) if self.slowdown > 1.0 and n else 0.0

    def finish_step(self, n: int, busy: float, wall: float, slept: float) -> None:
        """Record a step of n samples that kept the device busy `busy` seconds (`busy_clock`)
        and took `wall` seconds with `slept` of straggling; a first step of its size, which
        slept nothing before, straggles now."""
        self.last_busy = busy
        self.last_compute = wall - slept
        if not slept:
            self.straggle_after(n, busy)
        if n:
            self.recent.append((n, busy))

    @staticmethod
    def _sleep(pause: float) -> float:
        time.sleep(pause)
        return pause

    def fresh(self, **changes) -> "Worker":
        """A copy with its own (empty) straggler history."""
        return replace(self, recent=deque(maxlen=STRAGGLER_WINDOW), **changes)


def cross_entropy_loss(model, batch) -> torch.Tensor:
    """The loss of an (inputs, targets) batch under a classifier: the built-in recipes' loss."""
    return F.cross_entropy(model(batch[0]), batch[1])


def forward_backward(model, batch, me: Worker, before_last_backward=None,
                     loss_fn: Callable = cross_entropy_loss) -> tuple[float, float]:
    """Straggle (if asked), then forward and backward of `loss_fn(model, batch)` on this rank's
    batch, which may be empty, in chunks of at most `me.micro_batch` samples whose gradients
    accumulate to the whole batch's mean; a probe's `batches.Chunks` in its own chunks.
    `before_last_backward()` runs just before the last chunk's backward (the overlapping reducer
    arms its hooks there). What the timing probes, the micro-batch tuner and the benchmark's
    bare-engine phases run; a training script steps through `Job` (rank/job.py), which times the
    same way. Returns (summed loss, seconds)."""
    t0 = time.perf_counter()
    if isinstance(batch, batches.Chunks):
        parts, n = list(zip(batch.parts, batch.sizes)), sum(batch.sizes)
    else:
        n = batches.size(batch)
        parts = [(batches.take(batch, a, b), b - a) for a, b in batches.spans(n, me.micro_batch)]
    slept = me.straggle(n)
    clock = me.busy_clock()
    busy0 = clock()
    loss_sum = 0.0
    for i, (part, share) in enumerate(parts):
        loss = loss_fn(model, part)
        if share != n:  # a chunk: weight its mean by its share of the batch
            loss = loss * (share / n)
        if before_last_backward is not None and i == len(parts) - 1:
            before_last_backward()
        loss.backward()
        loss_sum += loss.item() * n
    me.device.synchronize()
    me.finish_step(n, clock() - busy0, time.perf_counter() - t0, slept)
    return loss_sum, time.perf_counter() - t0


MICRO_BATCH_CANDIDATES = (64, 128, 256, 512, 1024)
TUNE_MARGIN = 0.03


def micro_batch_for(setting: str, model, dataset, me: Worker, largest: int,
                    loss_fn: Callable = cross_entropy_loss, collate_fn: Callable | None = None) -> int | None:
    """The chunk size this rank runs: from the setting, or timed on its own device (auto)."""
    if check_micro_batch(setting) == "auto":
        return tune_micro_batch(model, dataset, me, largest, loss_fn, collate_fn)
    return int(setting) or None


def tune_micro_batch(model, dataset, me: Worker, largest: int, loss_fn: Callable = cross_entropy_loss,
                     collate_fn: Callable | None = None) -> int | None:
    """The chunk size (a few powers of two below `largest`, or all of it) with the least
    compute time per sample on this rank's device, preferring larger chunks unless a smaller
    one is more than 3% faster; None if that is the whole batch. Each
    candidate runs whole chunks, at least 512 samples; straggling is off (it is sleep)."""
    candidates = [c for c in MICRO_BATCH_CANDIDATES if c < largest] + [largest]
    if len(candidates) == 1:
        return None
    probe = me.fresh(slowdown=1.0)
    probes = {c: batches.probe_chunks(dataset, c * max(1, -(-512 // c)), c, me.device.torch_device, collate_fn,
                                      batches.fewest_samples(model)) for c in candidates}
    per_sample = {c: float("inf") for c in candidates}
    # Round-robin: a warm-up round, then the fastest of 3 rounds per candidate. Timing the
    # candidates in turns (not one after the other) lets a drift of the machine's speed touch
    # them all alike; one after the other it once made 64 look fastest on both ranks.
    for round_ in range(4):
        for c, batch in probes.items():
            probe.micro_batch = c  # (the chunks are the probe's own)
            forward_backward(model, batch, probe, loss_fn=loss_fn)
            if round_:
                per_sample[c] = min(per_sample[c], probe.last_compute / sum(batch.sizes))
    model.zero_grad(set_to_none=True)
    # Largest first; a smaller chunk must be clearly faster (3%) to win over timing noise.
    best = largest
    for c in sorted(per_sample, reverse=True):
        if per_sample[c] < per_sample[best] * (1 - TUNE_MARGIN):
            best = c
    return None if best >= largest else best
