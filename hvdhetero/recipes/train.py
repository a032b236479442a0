"""One rank of a hvdhetero training job. horovodrun starts one of these per slot:

    invoke train                                   # 2 CPU ranks on this machine, digits
    invoke train --hosts mac,pc --dataset cifar10  # one rank per slot on each host
    invoke train --slowdown 3                      # the last rank acts 3x slower (experiments)
    invoke train --dry-run                         # print the horovodrun command instead

which runs `horovodrun -np N -H host:slots --gloo python -m hvdhetero.recipes.train ...`. Each rank
computes on its own device (mps, cuda or cpu); gradients meet on the CPU through Gloo, each
rank weighted by its share of the step's samples; the balancer sizes each rank's batch by its
measured speed.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from dataclasses import asdict
from pathlib import Path

import horovod.torch as hvd
import torch
import torch.nn.functional as F

from hvdhetero import netinfo, progress
from hvdhetero.rank import checkpoint
from hvdhetero.recipes import data
from hvdhetero.rank import devices
from hvdhetero.recipes import models
from hvdhetero.rank.balancer import Balancer
from hvdhetero.config import TrainConfig, parse_args
from hvdhetero.rank.reducer import Reducer, allreduce_sum, average_buffers, broadcast_state
from hvdhetero.rank.sampler import WeightedBatchSampler
from hvdhetero.rank.step import Rank, batch, forward_backward, micro_batch_for, probe_batch


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    host = cfg.hosts.get(os.environ.get("HOROVOD_HOSTNAME", ""), {})
    set_gloo_interface(host)
    pin_cpu_rank(host)
    hvd.init()  # Horovod: rendezvous with the other ranks
    try:
        me = make_rank(cfg, host)
        torch.manual_seed(cfg.seed)
        train_set, test_set, info = load_data(cfg)
        model = models.build(cfg.model or models.default_for(cfg.dataset), info).to(me.device.torch_device)
        optimizer = make_optimizer(cfg, model)
        broadcast_state(model, optimizer)
        reducer = Reducer(model.parameters(), cfg.compression, overlap=cfg.overlap)
        balancer = make_balancer(cfg, me, model, train_set)
        sampler = WeightedBatchSampler(len(train_set), balancer.split, hvd.rank(), seed=cfg.seed)
        log = start_log(cfg, me, balancer)
        started = time.perf_counter()
        for epoch in range(cfg.epochs):
            train_epoch(cfg, epoch, model, optimizer, reducer, balancer, sampler, train_set, me, log)
            average_buffers(model)
            test = evaluate(model, test_set, me.device)
            if log:
                log.write("eval", epoch=epoch, **test)
        finish(cfg, model, optimizer, test, time.perf_counter() - started, log)
    finally:
        hvd.shutdown()


def set_gloo_interface(host: dict) -> None:
    """Horovod: Gloo takes one interface name for all ranks, but each host may call its NIC
    differently (en0 on a Mac, enp3s0 on a PC). Use this host's from the inventory, else the
    NIC that routes to the launcher's rendezvous server."""
    iface = host.get("interface")
    rendezvous = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR")
    if not iface and rendezvous:
        iface = netinfo.interface_towards(rendezvous)
    if iface:
        os.environ["HOROVOD_GLOO_IFACE"] = iface


def pin_cpu_rank(host: dict) -> None:
    """CPU ranks sharing a machine get a core share each (horovodrun sets the local rank/size)."""
    if host.get("device", "auto") == "cpu":
        devices.pin_local_rank(int(os.environ.get("HOROVOD_LOCAL_RANK", 0)),
                               int(os.environ.get("HOROVOD_LOCAL_SIZE", 1)))


def train_epoch(cfg, epoch, model, optimizer, reducer, balancer, sampler, dataset, me, log) -> None:
    model.train()
    sampler.set_epoch(epoch)
    loss_sum = correct = samples = 0.0
    started = time.perf_counter()
    for step, indices in enumerate(sampler):
        sizes = sampler.step_sizes(step)
        weight = len(indices) / sum(sizes)
        optimizer.zero_grad(set_to_none=True)
        arm = (lambda: reducer.prepare(weight)) if cfg.overlap else None
        step_loss, step_correct, seconds = forward_backward(model, *batch(dataset, indices, me.device), me, arm)
        loss_sum, correct, samples = loss_sum + step_loss, correct + step_correct, samples + len(indices)
        # Each rank's step time rides along with the gradients: every rank gets all of them.
        times = reducer.reduce(weight, extras=one_hot(seconds))
        optimizer.step()
        if not cfg.equal_split:
            new = balancer.observe(times, sizes, step=epoch * len(sampler) + step)
            if new:
                sampler.set_batch_sizes(new)
                if log:
                    log.write("split", epoch=epoch, step=step, split=new)
        if hvd.rank() == 0:
            elapsed = time.perf_counter() - started
            progress.report(epoch=epoch, epochs=cfg.epochs, step=step + 1, steps=len(sampler),
                            loss=loss_sum / max(samples, 1), acc=correct / max(samples, 1),
                            samples_per_s=sampler.global_batch * (step + 1) / elapsed)
    loss_sum, correct, samples = allreduce_sum([loss_sum, correct, samples], "hvdhetero.train_stats")
    elapsed = time.perf_counter() - started
    if log:
        log.write("epoch", epoch=epoch, loss=loss_sum / samples, accuracy=correct / samples,
                  samples=int(samples), seconds=round(elapsed, 3), samples_per_s=samples / elapsed,
                  split=sampler.batch_sizes)


def one_hot(value: float) -> list[float]:
    out = [0.0] * hvd.size()
    out[hvd.rank()] = value
    return out


def make_rank(cfg: TrainConfig, host: dict) -> Rank:
    device = devices.select(host.get("device", "auto"), hvd.local_rank(), hvd.local_size())
    slowdown = float(host.get("slowdown") or 1.0)
    if hvd.rank() == hvd.size() - 1:
        slowdown *= cfg.slowdown
    return Rank(device=device, slowdown=slowdown, max_batch=host.get("max_batch"))


def make_balancer(cfg, me: Rank, model, dataset) -> Balancer:
    """The starting split: equal, or proportional to each rank's measured speed on this model."""
    largest = min(cfg.batch_size, me.max_batch or cfg.batch_size)
    me.micro_batch = micro_batch_for(cfg.micro_batch, model, dataset, me, largest)
    caps = hvd.allgather_object(me.max_batch, name="hvdhetero.caps")
    balancer = Balancer(cfg.batch_size, hvd.size(), caps=caps)
    if not cfg.equal_split:
        big = min(cfg.batch_size, len(dataset))
        calibrate(balancer, model, dataset, me, small=max(1, big // 4), big=big)
    return balancer


def calibrate(balancer: Balancer, model, dataset, me: Rank, small: int, big: int) -> None:
    """Time this rank at two batch sizes, which separates its per-step overhead a from its
    per-sample cost p; every rank's (a, p) reach every rank, which sets the first split; then
    one more probe at that split refines each p."""
    t_small, t_big = (probe_seconds(model, dataset, me, n) for n in (small, big))
    p = (t_big - t_small) / (big - small) if big > small else t_big / big
    p = max(p, 0.1 * t_big / big)  # timing noise must not make p vanish
    a = max(0.0, t_big - p * big)
    both = allreduce_sum(one_hot(a) + one_hot(p), "hvdhetero.calibrate")
    balancer.calibrate(both[: hvd.size()], both[hvd.size():])
    # Then time each rank at exactly its share: at K=10 the slow rank's share is far below
    # `small`, where the straight line through two probes misses by 10-20% (measured).
    sizes = list(balancer.split)
    mine = probe_seconds(model, dataset, me, sizes[hvd.rank()])
    balancer.refine(allreduce_sum(one_hot(mine), "hvdhetero.refine"), sizes)


def probe_seconds(model, dataset, me: Rank, n: int, steps: int = 5) -> float:
    """This rank's compute time (forward + backward, straggling included) for n samples of the
    real model: the median of a few probes after one warm-up. The model is left unchanged."""
    x, y = probe_batch(dataset, n, me.device)
    times = [forward_backward(model, x, y, me)[2] for _ in range(steps + 1)][1:]
    model.zero_grad(set_to_none=True)
    return sorted(times)[len(times) // 2]


@torch.no_grad()
def evaluate(model, dataset, device, batch_size: int = 256) -> dict:
    """Test loss and accuracy over the whole test set, each rank scoring a disjoint share."""
    model.eval()
    shares = WeightedBatchSampler(len(dataset), [batch_size] * hvd.size(), hvd.rank(), shuffle=False)
    loss = correct = count = 0.0
    for indices in shares:
        if not indices:
            continue
        x, y = batch(dataset, indices, device)
        out = model(x)
        loss += F.cross_entropy(out, y, reduction="sum").item()
        correct += (out.argmax(1) == y).sum().item()
        count += len(indices)
    loss, correct, count = allreduce_sum([loss, correct, count], "hvdhetero.eval")
    return {"test_loss": loss / count, "test_accuracy": correct / count, "test_samples": int(count)}


def load_data(cfg: TrainConfig):
    """Rank 0 of each host may download; the others wait for it, then read the same files."""
    if hvd.local_rank() == 0:
        loaded = data.load(cfg.dataset, cfg.data_dir, download=cfg.download, seed=cfg.seed)
    hvd.barrier()  # Horovod: nobody reads files rank 0 may still be writing
    if hvd.local_rank() != 0:
        loaded = data.load(cfg.dataset, cfg.data_dir, download=False, seed=cfg.seed)
    return loaded


def make_optimizer(cfg: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    if cfg.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=cfg.lr)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)
    raise ValueError(f"--optimizer must be adam or sgd, got {cfg.optimizer!r}")


def start_log(cfg, me: Rank, balancer: Balancer) -> checkpoint.MetricsLog | None:
    described = hvd.allgather_object(me.device.describe(), name="hvdhetero.rank.devices")  # all ranks
    slowdowns = hvd.allgather_object(me.slowdown, name="hvdhetero.slowdowns")
    hostnames = hvd.allgather_object(socket.gethostname(), name="hvdhetero.hostnames")
    micro = hvd.allgather_object(me.micro_batch, name="hvdhetero.micro_batches")
    if hvd.rank() != 0:
        return None
    log = checkpoint.MetricsLog(Path(cfg.run_dir) / "metrics.jsonl")
    log.write("start", config=asdict(cfg), ranks=hvd.size(), hostnames=hostnames, devices=described,
              slowdowns=slowdowns, micro_batches=micro,
              overhead_s=balancer.overhead, seconds_per_sample=balancer.seconds_per_sample)
    log.write("split", epoch=0, step=0, split=balancer.split)
    return log


def param_digest(model: torch.nn.Module) -> str:
    """sha256 of every parameter's bytes: equal digests mean bit-identical replicas."""
    h = hashlib.sha256()
    for name, p in model.state_dict().items():
        h.update(name.encode() + p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def finish(cfg, model, optimizer, test, seconds, log) -> None:
    """Record every rank's parameter digest; rank 0 saves the model and prints the summary."""
    digests = hvd.allgather_object(param_digest(model), name="hvdhetero.digests")
    if hvd.rank() != 0:
        return
    path = checkpoint.save(checkpoint.Snapshot(
        model={k: v.cpu() for k, v in model.state_dict().items()},
        optimizer=optimizer.state_dict(), epoch=cfg.epochs, step=0, config=asdict(cfg), metrics=test),
        Path(cfg.run_dir) / "model.pt")
    log.write("end", seconds=round(seconds, 3), param_digests=digests, checkpoint=str(path), **test)
    log.close()
    in_sync = "ranks in sync" if len(set(digests)) == 1 else "RANKS DIVERGED"
    print(f"hvdhetero: {cfg.dataset} on {hvd.size()} ranks, {cfg.epochs} epochs in {seconds:.1f} s: "
          f"test accuracy {test['test_accuracy']:.2%}, loss {test['test_loss']:.4f} ({in_sync}); "
          f"model {path}", flush=True)


if __name__ == "__main__":
    main()
