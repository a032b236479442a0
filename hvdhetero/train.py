"""One rank of a hvdhetero training job. horovodrun starts one of these per slot:

    invoke train                                   # 2 CPU ranks on this machine, digits
    invoke train --hosts mac,pc --dataset cifar10  # one rank per slot on each host
    invoke train --dry-run                         # print the horovodrun command instead

which runs `horovodrun -np N -H host:slots --gloo python -m hvdhetero.train ...`. Each rank
computes on its own device (mps, cuda or cpu); gradients meet on the CPU through Gloo.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import horovod.torch as hvd
import torch
import torch.nn.functional as F

from hvdhetero import checkpoint, data, devices, models, progress
from hvdhetero.reducer import Reducer, allreduce_sum, average_buffers, broadcast_state
from hvdhetero.sampler import WeightedBatchSampler, proportional_split


@dataclass(frozen=True)
class TrainConfig:
    """What one training run does; every rank gets the same one from the launcher."""

    dataset: str = "digits"
    model: str = ""
    """Empty: the dataset's default (cnn for digits/mnist, resnet18 for cifar10)."""
    epochs: int = 10
    batch_size: int = 64
    """Global batch: the sum of all ranks' local batches."""
    lr: float = 1e-3
    optimizer: str = "adam"
    seed: int = 0
    data_dir: str = "data"
    download: bool = False
    run_dir: str = "runs/latest"
    compression: str = "none"
    hosts: dict = field(default_factory=dict)
    """Per host name (as in horovodrun -H): device, interface, slowdown, max_batch."""


@dataclass
class EpochStats:
    loss: float = 0.0
    correct: float = 0.0
    samples: float = 0.0
    compute_s: float = 0.0


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    host = cfg.hosts.get(os.environ.get("HOROVOD_HOSTNAME", ""), {})
    if host.get("interface"):
        # Horovod: Gloo takes one interface name; each host may call its NIC differently.
        os.environ["HOROVOD_GLOO_IFACE"] = host["interface"]
    hvd.init()  # Horovod: rendezvous with the other ranks
    is_main = hvd.rank() == 0
    try:
        device = devices.select(host.get("device", "auto"), hvd.local_rank(), hvd.local_size())
        torch.manual_seed(cfg.seed)
        train_set, test_set, info = load_data(cfg)
        model = models.build(cfg.model or models.default_for(cfg.dataset), info).to(device.torch_device)
        optimizer = make_optimizer(cfg, model)
        broadcast_state(model, optimizer)
        reducer = Reducer(model.parameters(), cfg.compression)
        split = proportional_split(cfg.batch_size, [1.0] * hvd.size(), minimum=1)
        sampler = WeightedBatchSampler(len(train_set), split, hvd.rank(), seed=cfg.seed)
        described = gather_devices(device)  # a collective: every rank takes part
        log = checkpoint.MetricsLog(Path(cfg.run_dir) / "metrics.jsonl") if is_main else None
        if log:
            log.write("start", config=asdict(cfg), ranks=hvd.size(), devices=described)
        started = time.perf_counter()
        for epoch in range(cfg.epochs):
            train_epoch(cfg, epoch, model, optimizer, reducer, sampler, train_set, device, host, log)
            average_buffers(model)
            test = evaluate(model, test_set, device)
            if log:
                log.write("eval", epoch=epoch, **test)
        finish(cfg, model, optimizer, test, time.perf_counter() - started, log)
    finally:
        hvd.shutdown()


def train_epoch(cfg, epoch, model, optimizer, reducer, sampler, dataset, device, host, log) -> EpochStats:
    model.train()
    sampler.set_epoch(epoch)
    stats, started = EpochStats(), time.perf_counter()
    for step, indices in enumerate(sampler):
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        if indices:  # the last step of an epoch may leave this rank no samples
            x, y = batch(dataset, indices, device)
            out = model(x)
            loss = F.cross_entropy(out, y)
            loss.backward()
            stats.loss += loss.item() * len(indices)
            stats.correct += (out.argmax(1) == y).sum().item()
            stats.samples += len(indices)
        device.synchronize()
        compute = time.perf_counter() - t0
        stats.compute_s += compute
        if host.get("slowdown", 1.0) > 1.0:  # straggler injection: sleep, steal no CPU
            time.sleep((host["slowdown"] - 1.0) * compute)
        sizes = sampler.step_sizes(step)
        reducer.reduce(len(indices) / sum(sizes))
        optimizer.step()
        if hvd.rank() == 0:
            elapsed = time.perf_counter() - started
            progress.report(epoch=epoch, epochs=cfg.epochs, step=step + 1, steps=len(sampler),
                            loss=stats.loss / max(stats.samples, 1), acc=stats.correct / max(stats.samples, 1),
                            samples_per_s=sampler.global_batch * (step + 1) / elapsed)
    loss, correct, samples = allreduce_sum([stats.loss, stats.correct, stats.samples], "hvdhetero.train_stats")
    elapsed = time.perf_counter() - started
    if log:
        log.write("epoch", epoch=epoch, loss=loss / samples, accuracy=correct / samples, samples=int(samples),
                  seconds=round(elapsed, 3), samples_per_s=samples / elapsed, split=sampler.batch_sizes)
    return stats


@torch.no_grad()
def evaluate(model, dataset, device, batch_size: int = 256) -> dict:
    """Test loss and accuracy over the whole test set, each rank scoring a disjoint share."""
    model.eval()
    shares = WeightedBatchSampler(len(dataset), [batch_size] * hvd.size(), hvd.rank(), shuffle=False)
    loss = correct = 0.0
    count = 0
    for indices in shares:
        if not indices:
            continue
        x, y = batch(dataset, indices, device)
        out = model(x)
        loss += F.cross_entropy(out, y, reduction="sum").item()
        correct += (out.argmax(1) == y).sum().item()
        count += len(indices)
    loss, correct, count = allreduce_sum([loss, correct, float(count)], "hvdhetero.eval")
    return {"test_loss": loss / count, "test_accuracy": correct / count, "test_samples": int(count)}


def batch(dataset, indices, device):
    if isinstance(dataset, torch.utils.data.TensorDataset):
        x, y = (t[indices] for t in dataset.tensors)
    else:
        x, y = torch.utils.data.default_collate([dataset[i] for i in indices])
    return x.to(device.torch_device), y.to(device.torch_device)


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


def param_digest(model: torch.nn.Module) -> str:
    """sha256 of every parameter's bytes: equal digests mean bit-identical replicas."""
    h = hashlib.sha256()
    for name, p in model.state_dict().items():
        h.update(name.encode() + p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def gather_devices(device) -> list[str]:
    return hvd.allgather_object(device.describe(), name="hvdhetero.devices")


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


def parse_args(argv: list[str] | None) -> TrainConfig:
    parser = argparse.ArgumentParser(prog="python -m hvdhetero.train", description=__doc__.split("\n")[0])
    for f in TrainConfig.__dataclass_fields__.values():
        if f.name == "hosts":
            parser.add_argument("--hosts-json", default="{}", help="per-host settings (from the launcher)")
        elif f.type == "bool":
            parser.add_argument(f"--{f.name.replace('_', '-')}", action="store_true")
        else:
            kind = {"int": int, "float": float}.get(f.type, str)
            parser.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=f.default)
    args = vars(parser.parse_args(argv))
    args["hosts"] = json.loads(args.pop("hosts_json"))
    return TrainConfig(**args)


if __name__ == "__main__":
    main()
