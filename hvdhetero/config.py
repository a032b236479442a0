"""What one training run does: the user's choices, shared by the launcher and every rank.

Torch-free, so the launcher builds the ranks' flags from the same dataclass the ranks parse.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field

from hvdhetero.errors import ConfigError


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
    """Gradients on the wire: none (float32) or fp16."""
    overlap: bool = True
    """Start reducing gradient buckets while backward still runs (--no-overlap: after it)."""
    equal_split: bool = False
    """Give every rank the same batch (plain data parallelism) instead of balancing."""
    slowdown: float = 1.0
    """Straggler injection: the last rank sleeps (k-1) times its compute time every step."""
    micro_batch: str = "auto"
    """Most samples a rank runs forward/backward at once; its gradients accumulate over the
    chunks before the one allreduce. auto: each rank times a few chunk sizes on its device at
    start and keeps the fastest (a CPU is faster on cache-sized chunks than on a 2000-sample
    batch; a GPU keeps the whole batch); 0: the whole local batch; N: at most N."""
    hosts: dict = field(default_factory=dict)
    """Per host name (as in horovodrun -H): device, interface, slowdown, max_batch."""

    def flags(self) -> list[str]:
        """This config as `python -m hvdhetero.recipes.train` flags (hosts travel as --hosts-json)."""
        out: list[str] = []
        for name, value in asdict(self).items():
            flag = "--" + name.replace("_", "-")
            if name == "hosts":
                continue
            if isinstance(value, bool):
                out += [flag if value else "--no-" + flag[2:]]
            elif value != "":
                out += [flag, str(value)]
        return out


def check_micro_batch(value) -> str:
    """A --micro-batch setting as given (auto, 0 for the whole batch, or N), else ConfigError."""
    value = str(value)
    if value != "auto" and not value.isdigit():
        raise ConfigError(f"--micro-batch must be auto, 0 or a positive integer, got {value!r}")
    return value


def parse_args(argv: list[str] | None) -> TrainConfig:
    parser = argparse.ArgumentParser(prog="python -m hvdhetero.recipes.train", description="One rank of a hvdhetero job.")
    for f in TrainConfig.__dataclass_fields__.values():
        if f.name == "hosts":
            parser.add_argument("--hosts-json", default="{}", help="per-host settings (from the launcher)")
        elif f.type == "bool":
            parser.add_argument(f"--{f.name.replace('_', '-')}", action=argparse.BooleanOptionalAction,
                                default=f.default)
        else:
            kind = {"int": int, "float": float}.get(f.type, str)
            parser.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=f.default)
    args = vars(parser.parse_args(argv))
    args["hosts"] = json.loads(args.pop("hosts_json"))
    return TrainConfig(**args)
