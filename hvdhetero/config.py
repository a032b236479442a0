"""What a job's engine does: the user's choices that every rank shares, whatever script it runs.

Torch-free: the launcher builds it from the command line and hands it to every rank (as JSON,
through `python -m hvdhetero.rank.runner --job-json`), and `hh.init()` reads it there. The
script's own options (dataset, epochs, learning rate...) are the script's business: they travel
as its command-line arguments.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from hvdhetero import checks
from hvdhetero.errors import ConfigError

ENV_VAR = "HVDHETERO_JOB"
"""Where the runner leaves the job's JSON for `hh.init()` in the same process."""

COMPRESSIONS = ("none", "fp16")
PRECISIONS = ("fp32", "bf16", "fp16")
INNER_STEPS = ("same", "by-speed")


@dataclass(frozen=True)
class JobConfig:
    """The engine's settings for one job; every rank gets the same one from the launcher."""

    run_dir: str = "runs/latest"
    """metrics.jsonl and whatever `job.save` writes go here (rank 0)."""
    seed: int = 0
    """Seeds torch, the shuffling and dropout on every rank (rank 0's initial weights win); a
    script that seeds torch itself keeps its own seed (the shuffling still follows --seed)."""
    env: str = ""
    """Environment variables for every rank, comma-separated: NAME=VALUE, or NAME alone for the
    value it has here (as mpirun -x), e.g. OMP_NUM_THREADS=4,WANDB_MODE. Nothing else of this
    shell's environment reaches a rank (secrets stay here, and each host keeps its own HOME and
    PATH); the values are on the ranks' command lines, so pass no secrets this way."""
    deterministic: bool = False
    """Kernels that repeat their bits (torch.use_deterministic_algorithms, cuDNN deterministic,
    cuBLAS's fixed workspace): on a CUDA rank, a run and its resume then end bit-exact, as CPU
    ranks do anyway; some CUDA kernels are slower so. An operation without such a kernel warns."""
    compression: str = "none"
    """Gradients on the wire: none (float32) or fp16."""
    overlap: bool = True
    """Start reducing gradient buckets while backward still runs (False: after it)."""
    equal_split: bool = False
    """Give every rank the same batch (plain data parallelism) instead of balancing."""
    slowdown: float = 1.0
    """Straggler injection: the last rank sleeps (k-1) times its busy time every step, its data's
    fetch included (the median of its last steps of that size; a one-thread CPU rank's is its
    thread's CPU time, so a busy machine's waits are not multiplied)."""
    micro_batch: str = "auto"
    """Most samples a rank runs forward/backward at once; its gradients accumulate over the
    chunks before the one allreduce. auto: each rank times a few chunk sizes on its device at
    start and keeps the fastest (a CPU is faster on cache-sized chunks than on a 2000-sample
    batch; a GPU keeps the whole batch), from the second step on, and whole shares for a script
    that accumulates over batches of its own; 0: the whole local batch; N: at most N, cut evenly."""
    precision: str = "fp32"
    """Mixed precision inside `job.autocast()`: fp32 (off), bf16 or fp16, mapped per device
    (rank/precision.py): fp16 with loss scaling on CUDA and MPS, bf16 on CPU and CUDA."""
    sync: str = "step"
    """How often the ranks meet: step (gradients reduced every step), local:H (each rank steps
    alone; every H steps the parameters are averaged, weighted by the samples each processed),
    diloco:H (every H steps the weighted mean of the ranks' parameter changes is the gradient of
    an outer Nesterov SGD step) or auto (the start-up calibration times the hosts and the link
    and takes the mode invoke plan advises for them)."""
    overlap_sync: bool = False
    """local/diloco: the round's exchange runs in the background while the next round computes
    and is applied one round late (rank/sync.py says what that delay means)."""
    inner_steps: str = "same"
    """local/diloco: same (every rank takes the round's H optimizer steps, each on its share of
    that step's global batch) or by-speed (a slower rank merges consecutive steps' shares into
    one optimizer step about as big as the fastest rank's, so it takes fewer inner steps a round,
    in proportion to its speed; a small share's per-step costs are paid once per merge)."""
    outer_lr: float = 0.7
    """diloco: the outer optimizer's learning rate (DiLoCo's published 0.7)."""
    outer_momentum: float = 0.9
    """diloco: the outer optimizer's Nesterov momentum (DiLoCo's published 0.9)."""
    checkpoint_every: int = 0
    """Also checkpoint every this many steps (0: only by time and at every epoch's end)."""
    checkpoint_minutes: float = 5.0
    """Checkpoint at least this often (converted to steps from the measured step time; 0: off)."""
    keep_checkpoints: int = 3
    """The newest this many checkpoints are kept in RUN_DIR/checkpoints (0: no checkpoints)."""
    resume: bool = False
    """Continue the run in run_dir from its newest checkpoint that loads."""
    elastic: bool = False
    """Horovod elastic: a host that dies or goes silent is dropped and the others continue from
    their last commit; a host that comes back rejoins at a commit (docs/failures.md, Elastic)."""
    min_hosts: int = 1
    """With elastic: the job ends (with the usual failure message) when fewer hosts are left."""
    commit_every: int = 10
    """With elastic: every rank keeps an in-memory commit of everything a resume needs every this
    many steps (and at every epoch's end); a failure redoes at most this many steps, and a host
    that comes back joins at the next commit. With local/diloco a commit waits for a round's end
    (overlapped: for the round in flight to land), so a failure redoes up to this plus H-1."""
    tensorboard: bool = False
    """Rank 0 also writes the metrics as TensorBoard scalars under run_dir/tensorboard."""
    plan_only: bool = False
    """`invoke plan`: job.prepare measures the ranks and the link, prints the plan and ends the
    job (the script goes no further)."""
    hosts: dict = field(default_factory=dict)
    """Per host name (as in horovodrun -H): device, interface, slowdown, max_batch."""

    def __post_init__(self):
        object.__setattr__(self, "micro_batch", check_micro_batch(self.micro_batch))  # hh.init(micro_batch=64)
        checks.types(self)
        checks.within("seed", self.seed, 0, 2**32 - 1, "numpy and scikit-learn take no other seeds")
        env_items(self.env)
        if check_sync(self.sync)[0] in ("step", "auto") and self.overlap_sync:
            raise ConfigError(f"--overlap-sync needs --sync local:H or diloco:H, got --sync {self.sync} (step sync "
                              "overlaps each step's reduction with backward already; auto decides itself)")
        if self.inner_steps not in INNER_STEPS:
            raise ConfigError(f"--inner-steps must be one of {', '.join(INNER_STEPS)}, got {self.inner_steps!r}")
        if self.inner_steps != "same" and check_sync(self.sync)[0] not in ("local", "diloco"):
            raise ConfigError(f"--inner-steps {self.inner_steps} needs --sync local:H or diloco:H, got --sync "
                              f"{self.sync} (under step sync every rank takes every step)")
        if not (math.isfinite(self.outer_lr) and self.outer_lr > 0 and 0 <= self.outer_momentum < 1):
            raise ConfigError(f"--outer-lr must be > 0 and --outer-momentum in [0, 1), got {self.outer_lr!r} and "
                              f"{self.outer_momentum!r}")
        if self.compression not in COMPRESSIONS:
            raise ConfigError(f"--compression must be one of {', '.join(COMPRESSIONS)}, got {self.compression!r}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"--precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.checkpoint_every < 0 or not self.checkpoint_minutes >= 0 or self.keep_checkpoints < 0:
            raise ConfigError(f"--checkpoint-every, --checkpoint-minutes and --keep-checkpoints must be >= 0, got "
                              f"{self.checkpoint_every!r}, {self.checkpoint_minutes!r}, {self.keep_checkpoints!r}")
        checks.at_least("commit_every", self.commit_every, 1, "steps between elastic commits")
        checks.at_least("min_hosts", self.min_hosts, 1, "hosts the job needs to go on")
        if not self.elastic and (self.min_hosts != 1 or self.commit_every != 10):
            raise ConfigError(f"--min-hosts and --commit-every go with --elastic, got --min-hosts {self.min_hosts} "
                              f"--commit-every {self.commit_every} without it")
        if self.elastic and check_sync(self.sync)[0] == "auto":
            raise ConfigError("--elastic needs a fixed --sync mode, got --sync auto (the plan would be made anew "
                              "for every membership and could change the mode mid-run); run invoke plan and pass "
                              "the mode it advises: --sync step, local:H or diloco:H")
        if not (math.isfinite(self.slowdown) and self.slowdown >= 1.0):
            raise ConfigError(f"--slowdown must be a number >= 1 (how many times slower the last rank acts), "
                              f"got {self.slowdown!r}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "JobConfig":
        values = json.loads(text)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"job settings: unknown keys {unknown}; allowed: {', '.join(sorted(known))} "
                              "(is the launcher's hvdhetero the same version as this host's?)")
        return cls(**values)

    @classmethod
    def from_env(cls) -> "JobConfig":
        """The job's settings the runner left in ENV_VAR; the defaults where none (a script run
        without the launcher: a job of one rank)."""
        text = os.environ.get(ENV_VAR)
        return cls.from_json(text) if text else cls.alone(sys.argv[0] if sys.argv else "")

    @staticmethod
    def launched() -> bool:
        """Whether the launcher started this process (else plain python: a job of one rank)."""
        return bool(os.environ.get(ENV_VAR))

    @classmethod
    def alone(cls, script: str) -> "JobConfig":
        """A script run with plain python: a job of one rank, in a new run directory of its own,
        runs/<time>-<script> under $HVDHETERO_RUNS, else under ./runs, as `invoke train` names one
        (every plain run went to runs/latest, each run's metrics and checkpoints among the last's)."""
        base = Path(os.environ.get("HVDHETERO_RUNS") or "runs") / run_name(Path(script).stem or "python")
        folder, n = base, 1
        while folder.exists():  # two runs started in one second
            n += 1
            folder = base.with_name(f"{base.name}-{n}")
        return cls(run_dir=str(folder))


def run_name(name: str) -> str:
    """A new run's folder name, <time>-<name>, as `invoke train` and a plain python run make it."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{name}"


SYNC_KINDS = ("step", "local", "diloco", "auto")


def check_sync(value: str) -> tuple[str, int]:
    """A --sync setting as (kind, every H steps): step, local:H, diloco:H or auto (chosen at
    job.prepare from measured speeds and link: policy/plan.py); else ConfigError."""
    kind, _, every = str(value).partition(":")
    if kind in ("step", "auto") and not every:
        return kind, 1
    if kind in ("local", "diloco") and every.isdigit() and int(every) >= 1:
        return kind, int(every)
    raise ConfigError(f"--sync must be step, auto, local:H or diloco:H with H a positive integer (steps "
                      f"between exchanges), got {value!r}")


ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
ENV_ITEM = re.compile(r",(?=\s*[A-Za-z_][A-Za-z0-9_]*\s*(?:=|,|$))")
"""Where --env's items part: at a comma before a NAME= or a bare NAME (CUDA-style lists in a
value, "a=0,1", stay whole)."""
MACHINE_OWN = ("HOME", "PATH", "TMPDIR", "USER", "LOGNAME", "SSH_AUTH_SOCK")
"""The launcher's variables that no rank's command line carries: each host has its own
(cluster/horovodrun.py leaves them out of horovodrun's rank commands)."""
ENV_REFUSED = {*MACHINE_OWN, "CUDA_VISIBLE_DEVICES"}
"""Names --env does not take: each host's own, and a CUDA host's GPU is the inventory's `device`
(cuda:1)."""


def env_items(value: str) -> list[tuple[str, str | None]]:
    """An --env setting as [(NAME, VALUE or None for this shell's value)]; else ConfigError."""
    items = []
    for item in filter(None, (part.strip() for part in ENV_ITEM.split(str(value)))):
        name, eq, given = item.partition("=")
        if not ENV_NAME.fullmatch(name):
            raise ConfigError(f"--env: {item!r} is not NAME or NAME=VALUE (names are letters, digits and _, "
                              "not starting with a digit; items are separated by commas)")
        if name in ENV_REFUSED:
            raise ConfigError(f"--env {name}: each host keeps its own " + (
                "GPUs: choose one with the host's `device: cuda:N` in the inventory" if name == "CUDA_VISIBLE_DEVICES"
                else f"{name} (a Mac's is not a PC's)"))
        items.append((name, given if eq else None))
    return items


def check_micro_batch(value) -> str:
    """A --micro-batch setting as given (auto, 0 for the whole batch, or N), else ConfigError."""
    value = str(value)
    if value != "auto" and not value.isdigit():
        raise ConfigError(f"--micro-batch must be auto, 0 or a positive integer, got {value!r}")
    return value
