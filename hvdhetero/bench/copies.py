"""What a device rank's gradients cost on their way through the CPU reducer, one rank on its own.

On the H200 machine (2026-11-30) the CUDA rank's ResNet-18 step computed 43.5 ms under step sync
against 14.5 ms alone: each bucket of the overlapped reduction crossed to the CPU in blocking
copies inside backward's hooks, and the GPU waited at each one. This times, on one device, a step
(forward, backward, the reduction of a job of one rank, the gradients back) in each way the
reducer can take them, against the step with no reduction at all:

    per-parameter   overlapped 0.5 MB buckets, each gradient copied to the CPU on its own (before 2026-11-30)
    staged          the same buckets, each gathered on the device first and crossing in one copy
    staged, unpinned  the same into pageable CPU memory (what pinning gives)
    one bucket      no overlap: every gradient gathered on the device after backward, one copy
    25 MB buckets   overlapped, DDP's default bucket size

and, apart, the step with no reduction run back to back (the device synchronized once after them
all): what the host's wait at each step's end costs the device (a job times each step and reads
its loss there).

Run: horovodrun -np 1 -H localhost:1 --gloo python -m hvdhetero.bench.copies [--device auto]
[--batch 254] [--steps 20] [--warmup 3] [--out copies.json]. ci/gpu-check runs it on the lent GPU machine; on a
CPU it runs too (every way staged on the CPU: the device's code path, timed as a CPU's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import horovod.torch as hvd
import torch
import torch.nn.functional as F

from hvdhetero.rank import devices
from hvdhetero.rank.reducer import Reducer
from hvdhetero.recipes import models

WAYS = {
    "per-parameter": dict(stage=False, overlap=True, bucket_mb=0.5),
    "staged": dict(stage=True, overlap=True, bucket_mb=0.5),
    "staged, unpinned": dict(stage=True, overlap=True, bucket_mb=0.5, pin=False),
    "one bucket": dict(stage=True, overlap=False),
    "25 MB buckets": dict(stage=True, overlap=True, bucket_mb=25.0),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="as an inventory host's (auto: cuda, then mps, then cpu)")
    parser.add_argument("--batch", type=int, default=254)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    hvd.init()
    rank_device = devices.select(args.device)  # as a rank takes it (CUDA's index, a CPU's threads)
    device = rank_device.torch_device
    torch.manual_seed(0)
    model = models.resnet18_cifar(3, 10).to(device)
    x = torch.randn(args.batch, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (args.batch,), device=device)
    ways: dict[str, Reducer | None] = {"no reduction": None}
    ways.update({name: Reducer(model.parameters(), **kw) for name, kw in WAYS.items()})
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.warmup + args.steps):  # ways take turns, so the machine's drift falls on each alike
        for name, reducer in ways.items():  # (every overlapped Reducer hooks the parameters; an unarmed one passes)
            model.zero_grad(set_to_none=True)
            rank_device.synchronize()
            started = time.perf_counter()
            loss = F.cross_entropy(model(x), y)
            if reducer is not None and reducer.overlap:
                reducer.prepare(1.0)
            loss.backward()
            if reducer is not None:
                reducer.reduce(1.0)
            rank_device.synchronize()
            times[name].append(time.perf_counter() - started)
    result = {"device": rank_device.describe(), "model": "resnet18", "batch": args.batch, "steps": args.steps,
              "buckets": {name: len(r.buckets) for name, r in ways.items() if r is not None},
              "median_ms": {name: round(1e3 * statistics.median(t[args.warmup:]), 3) for name, t in times.items()}}
    result["back_to_back_ms"] = round(1e3 * back_to_back(model, x, y, rank_device, args.steps), 3)
    base = result["median_ms"]["no reduction"]
    print(f"{args.batch} samples of ResNet-18 on {rank_device.describe()}: median of {args.steps} steps, ms "
          "(x the step without)")
    for name, ms in result["median_ms"].items():
        buckets = result["buckets"].get(name)
        print(f"  {name:18s} {ms:9.2f}  {ms / base:5.2f}x" + (f"  ({buckets} bucket{'s' if buckets > 1 else ''})"
                                                                  if buckets else ""))
    ms = result["back_to_back_ms"]
    print(f"  {'back to back':18s} {ms:9.2f}  {ms / base:5.2f}x  (no reduction, the device synchronized once after "
          f"{args.steps} steps: each step above waits for it at its end, as a job's step does)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    hvd.shutdown()


def back_to_back(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, device, steps: int) -> float:
    """Seconds a step of "no reduction" (the same zero_grad, forward and backward) takes when
    `steps` of them run back to back and the device is synchronized once after them all: the
    host never waits for the device, against each way's step above, which waits at its end as a
    job's step does (its clock, its loss read). The median of three such runs; zero_grad
    (set_to_none: a few microseconds) is inside the time here, outside it above."""
    runs = []
    for _ in range(3):
        device.synchronize()
        started = time.perf_counter()
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
        device.synchronize()
        runs.append((time.perf_counter() - started) / steps)
    return statistics.median(runs)


if __name__ == "__main__":
    main()
