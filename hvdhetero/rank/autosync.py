"""`invoke plan` and `--sync auto` inside a job: time the link and the exchange's CPU work, then
print the plan (policy/plan.py predicts and advises) or pick the mode to train in.

Everything here runs inside `job.prepare`, after calibration, on every rank together: the
timings are collectives, and every rank ends with the same numbers and the same choice.
"""

from __future__ import annotations

import json
import statistics
import time

import horovod.torch as hvd
import torch

from hvdhetero import progress
from hvdhetero.config import JobConfig
from hvdhetero.errors import ConfigError
from hvdhetero.policy import plan
from hvdhetero.policy.balancer import Balancer
from hvdhetero.rank.host import one_hot
from hvdhetero.rank.records import RunRecords
from hvdhetero.rank import collectives
from hvdhetero.rank.reducer import WIRE_DTYPES
from hvdhetero.rank.sync import exchanged_tensors


def choose(config: JobConfig, records: RunRecords, balancer: Balancer, model: torch.nn.Module,
           probe_failed: bool, step_only: str = "") -> tuple[str, int, bool, str]:
    """`invoke plan`: print the plan and end the job here. --sync auto: the advised mode for
    these hosts (step when the ranks could not be timed, or `step_only` says why local/diloco
    cannot run): (kind, H, overlapped, inner steps)."""
    if probe_failed or config.equal_split:
        why = "the calibration probe failed (pass loss_fn=... to prepare)" if probe_failed else "--equal-split"
        if config.plan_only:
            raise ConfigError(f"invoke plan needs every rank timed on the model, but {why}")
        if records.is_main:
            print(f"hvdhetero: --sync auto: cannot time the ranks ({why}); using step sync", flush=True)
        return "step", 1, False, "same"
    params, buffers = exchanged_tensors(model)
    _, host, device, size = records.who
    measured = measure(balancer, params + buffers, WIRE_DTYPES[config.compression], host, device)
    full = plan.make(measured, step_only=step_only)
    if config.plan_only:
        if records.is_main:
            print(plan.render(full), flush=True)
            print(progress.RESULT_TAG + json.dumps(full.to_json()), flush=True)
        collectives.barrier("hvdhetero.plan.done", "invoke plan's end")
        raise SystemExit(0)
    together = [p for p in full.predictions if len(p.ranks) == size]
    pick, _ = plan.advise(together)
    records.write("plan", chose=pick.mode, **full.to_json())
    if records.is_main:
        note = f"hvdhetero: --sync auto chose {pick.mode}: predicted " \
               f"{pick.samples_per_s:,.0f} samples/s ({pick.vs_fastest:.2f}x the fastest rank alone)"
        if full.advice.ranks != pick.ranks:
            note += f"; but {full.reason} (see invoke plan)"
        print(note, flush=True)
    if pick.sync in ("step", "alone"):  # alone: a one-rank job
        return "step", 1, False, "same"
    return "diloco", int(pick.sync.split(":")[1]), pick.overlap, pick.inner_steps


def measure(balancer: Balancer, params: list[torch.Tensor], wire: torch.dtype, host: str, device: str,
            repeats: int = 4) -> plan.Measured:
    """The link and the exchange's CPU work, with the calibrated a_i, p_i; identical on every rank."""
    numel = sum(p.numel() for p in params)
    started = time.perf_counter()
    for _ in range(2):
        flat = torch.cat([p.detach().to("cpu", torch.float32).reshape(-1) for p in params]).to(wire)
        for p, chunk in zip(params, flat.to(torch.float32).split([p.numel() for p in params])):
            chunk.view_as(p).to(p.device)
    copy_s = (time.perf_counter() - started) / 2
    small, big = torch.zeros(1, dtype=torch.float32), torch.zeros(numel, dtype=wire)
    latency = statistics.median(_timed(small, "hvdhetero.plan.latency", repeats + 2))
    # Training exchanges after a round of compute, on a link idle since the last one: TCP
    # restarts slowly after idle and a shaped or lossy link drops bursts, so the same 0.6 MB took
    # 0.65-0.8 s back to back and up to 1.5 s after a second's pause (8 Mbit, measured). The plan
    # counts the slowest of a few exchanges, each after a pause.
    exchange = max(_timed(big, "hvdhetero.plan.exchange", repeats, pause_s=0.5))
    behind = [_behind(big, f"hvdhetero.plan.behind.{i}") for i in range(3)]
    stolen, busy = statistics.median(s for s, _ in behind), max(b for _, b in behind)
    size = hvd.size()
    summed = collectives.allreduce_sum(one_hot(latency) + one_hot(exchange) + one_hot(copy_s) + one_hot(stolen)
                                       + one_hot(busy), "hvdhetero.plan.times")
    hosts = collectives.allgather_object(host, "hvdhetero.plan.hosts")
    devices = collectives.allgather_object(device, "hvdhetero.plan.devices")
    return plan.Measured(hosts, devices, list(balancer.overhead), list(balancer.seconds_per_sample),
                    balancer.global_batch, numel * big.element_size(), max(summed[:size]),
                    max(summed[size:2 * size]), max(summed[2 * size:3 * size]), list(balancer.caps),
                    busy_exchange_s=max(summed[4 * size:]), stolen=max(summed[3 * size:4 * size]))


def _behind(tensor: torch.Tensor, name: str, bursts: int = 12) -> tuple[float, float]:
    """An exchange behind compute, after a pause: the share of this rank's CPU compute lost
    while it runs (the same small matrix products timed alone, then while an allreduce of
    `tensor` is on the link) and how long it took meanwhile."""
    time.sleep(0.5)
    work = torch.randn(96, 96)

    def burst() -> float:
        t0 = time.perf_counter()
        for _ in range(20):
            work @ work
        return time.perf_counter() - t0

    alone = statistics.median(burst() for _ in range(bursts))
    hvd.barrier()
    t0 = time.perf_counter()
    handle = hvd.allreduce_async_(tensor.clone(), op=hvd.Sum, name=name)
    during = []
    while not hvd.poll(handle):
        during.append(burst())
    took = time.perf_counter() - t0
    hvd.synchronize(handle)
    if len(during) < 3:  # over before it could be seen
        return 0.0, took
    return max(0.0, 1.0 - alone / statistics.median(during)), took


def _timed(tensor: torch.Tensor, name: str, repeats: int, pause_s: float = 0.0) -> list[float]:
    hvd.allreduce_(tensor, op=hvd.Sum, name=name + ".warm")
    times = []
    for i in range(repeats):
        time.sleep(pause_s)
        hvd.barrier()
        t0 = time.perf_counter()
        hvd.allreduce_(tensor, op=hvd.Sum, name=f"{name}.{i}")
        times.append(time.perf_counter() - t0)
    return times
