"""`invoke bench`'s options, defined and checked once, before any job starts (exit 2 on a bad
value). bench runs one of three measurements, and each takes only some options; one given to
a measurement that ignores it is named rather than silently dropped:

    throughput   (default)           ranks alone, plain Horovod, hvdhetero (bench/throughput.py)
    allreduce    --allreduce          Gloo allreduce, uv build against tcp (bench/allreduce.py)
    to_accuracy  --to-accuracy A      seconds to a test accuracy (bench/accuracy.py)
    sweep        --sweep SPACE        a sweep across the hosts against the fastest alone (bench/sweep_bench.py)

Torch-free: the launcher imports it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from hvdhetero import checks
from hvdhetero.bench.accuracy import DEFAULT_WAYS, WAYS
from hvdhetero.cluster.launch import CYCLE_TIME_MS
from hvdhetero.config import COMPRESSIONS, INNER_STEPS, check_micro_batch, check_sync
from hvdhetero.errors import ConfigError
from hvdhetero.recipes.options import DATASETS, MODELS, RecipeOptions

TRANSPORTS = ("uv", "tcp")  # as hvdhetero/cluster/horovod_build.py builds them

USES = {
    "throughput": ("dataset", "model", "slowdown", "batch_size", "steps", "min_seconds", "repeats", "cycle_time_ms", "micro_batch",
                   "sync", "overlap_sync", "inner_steps", "compression", "out", "dry_run",
                   "verbose"),
    "allreduce": ("allreduce", "sizes_mb", "transports", "backends", "rounds", "repeats", "out"),
    "to_accuracy": ("to_accuracy", "seeds", "epochs", "repeat", "ways", "lr", "eval_global", "batch_size", "sync",
                    "overlap_sync", "inner_steps", "slowdown", "compression", "out", "verbose"),
    "sweep": ("sweep", "trials", "budget", "out"),
}
"""The options each measurement reads; any other given a value of its own is a mistake."""


@dataclass(frozen=True)
class BenchOptions:
    """Every option of `invoke bench` but --hosts and --inventory."""

    dataset: str = "digits"
    """What the throughput job trains on: digits (scikit-learn's, in memory), or mnist or cifar10
    as random images of their shape (a step's time does not depend on the pixels; no files)."""
    model: str = ""
    """cnn or resnet18 (ResNet-18 with the CIFAR stem); empty: the dataset's own."""
    slowdown: float = 1.0
    """The last rank acts this many times slower (straggler injection)."""
    batch_size: int = 2048
    """The global batch."""
    steps: int = 8
    """Timed steps per phase and repeat (at least)."""
    min_seconds: float = 6.0
    """Quick phases take more steps, to be timed over at least this long per repeat."""
    repeats: int | None = None
    """Rounds of all phases, medians reported (None: 5); with allreduce, timed allreduces (None: 10)."""
    cycle_time_ms: float = float(CYCLE_TIME_MS)
    """Horovod's HOROVOD_CYCLE_TIME for all phases alike (by default what every job runs at)."""
    micro_batch: str = "auto"
    """Chunk size of the solo and hvdhetero phases: auto, 0 (whole batch) or N."""
    sync: str = "step"
    """The hvdhetero phase's sync mode: step, local:H or diloco:H."""
    overlap_sync: bool = False
    """local/diloco: the exchange runs behind compute, applied one round late."""
    inner_steps: str = "same"
    """local/diloco: same, or by-speed (a slower rank takes fewer, bigger inner steps)."""
    compression: str = "none"
    """Gradients (step) or exchange (local/diloco) on the wire: none or fp16."""
    out: str = ""
    """Also write the results as JSON here."""
    dry_run: bool = False
    """Print the horovodrun command and exit (throughput: the one job; the others run several)."""
    verbose: bool = False
    """Also print each horovodrun command before it runs."""
    allreduce: bool = False
    """Measure Gloo allreduce throughput of the uv build against the tcp build instead."""
    sizes_mb: str = "1,16,64"
    """allreduce: buffer sizes in MB, comma-separated."""
    transports: str = "uv,tcp"
    """allreduce: the builds to compare, comma-separated."""
    backends: str = "gloo"
    """allreduce: gloo (horovodrun, each of --transports), mpi (our mpirun, Open MPI moving the bytes;
    needs pins.backend: mpi) or gloo,mpi: both on the same build and inputs."""
    rounds: int = 3
    """allreduce: jobs per transport, taking turns."""
    to_accuracy: float = 0.0
    """Measure seconds to this test accuracy instead (0: off)."""
    seeds: str = "0,1,2"
    """to_accuracy: comma-separated seeds, each way trained once per seed."""
    epochs: int = 30
    """to_accuracy: at most this many epochs per run."""
    repeat: int = 8
    """to_accuracy: passes over the training set per epoch."""
    ways: str = DEFAULT_WAYS
    """to_accuracy: which ways to train, comma-separated: alone (the first host), step, mode (--sync),
    alone-mode (the first host alone in --sync's mode: what the other hosts add to the same algorithm)."""
    lr: float = RecipeOptions.lr
    """to_accuracy: the built-in recipe's learning rate (lower: a longer race, more rounds in it)."""
    eval_global: bool = False
    """to_accuracy: with local/diloco, each epoch evaluates the global model, no exchange first."""
    sweep: str = ""
    """A sweep's space file (docs/sweep.md): time --trials trials of the built-in recipe swept across the hosts
    against the fastest host alone running the same trials, and the sweep with --prune; prints the ratio."""
    trials: int = 12
    """sweep: trials in each sweep."""
    budget: int = 4
    """sweep: epochs each trial trains."""

    def __post_init__(self):
        checks.types(self)
        if sum(map(bool, (self.allreduce, self.to_accuracy, self.sweep))) > 1:
            raise ConfigError("--allreduce, --to-accuracy and --sweep are different measurements: give one")
        unused = [checks.flag(f.name) for f in fields(self)
                  if f.name not in USES[self.mode] and getattr(self, f.name) != f.default]
        if unused:
            takes = ", ".join(checks.flag(u) for u in USES[self.mode] if u != self.mode)
            raise ConfigError(f"{', '.join(unused)} {'does' if len(unused) == 1 else 'do'} not apply to bench "
                              f"{self._named_mode}, which takes {takes}")
        checks.writable_file("out", self.out)
        if self.repeats is not None:
            checks.at_least("repeats", self.repeats, 1)
        getattr(self, f"_check_{self.mode}")()

    @property
    def mode(self) -> str:
        """Which measurement: throughput, allreduce or to_accuracy."""
        return ("allreduce" if self.allreduce else "to_accuracy" if self.to_accuracy else "sweep" if self.sweep
                else "throughput")

    @property
    def _named_mode(self) -> str:
        return {"throughput": "(ranks alone, plain Horovod, hvdhetero)", "allreduce": "--allreduce",
                "to_accuracy": "--to-accuracy", "sweep": "--sweep"}[self.mode]

    def _check_job(self) -> None:
        """What the throughput job and the to-accuracy runs share."""
        checks.at_least("slowdown", self.slowdown, 1, "how many times slower the last rank acts")
        checks.at_least("batch_size", self.batch_size, 1, "the global batch")
        checks.one_of("compression", self.compression, COMPRESSIONS)
        kind, _ = check_sync(self.sync)
        if self.overlap_sync and kind == "step":
            raise ConfigError(f"--overlap-sync needs --sync local:H or diloco:H, got --sync {self.sync}")
        checks.one_of("inner_steps", self.inner_steps, INNER_STEPS)
        if self.inner_steps != "same" and kind not in ("local", "diloco"):
            raise ConfigError(f"--inner-steps {self.inner_steps} needs --sync local:H or diloco:H, got --sync "
                              f"{self.sync}")
        return kind

    def _check_throughput(self) -> None:
        checks.one_of("dataset", self.dataset, DATASETS)
        if self.model:
            checks.one_of("model", self.model, MODELS, "or none: the dataset's own")
        if self._check_job() == "auto":
            raise ConfigError("bench measures one --sync mode: step, local:H or diloco:H (invoke plan predicts "
                              "them all and says which to use)")
        checks.at_least("steps", self.steps, 1, "timed steps per phase and repeat")
        checks.at_least("min_seconds", self.min_seconds, 0)
        checks.at_least("cycle_time_ms", self.cycle_time_ms, 0, "Horovod's HOROVOD_CYCLE_TIME")
        check_micro_batch(self.micro_batch)

    def _check_allreduce(self) -> None:
        for size in checks.numbers("sizes_mb", self.sizes_mb, float):
            checks.above("sizes_mb", size, 0, "buffer sizes in MB")
        transports = [t for t in self.transports.split(",") if t]
        if not transports or any(t not in TRANSPORTS for t in transports):
            raise ConfigError(f"--transports {self.transports}: choose from {', '.join(TRANSPORTS)}")
        backends = [b for b in self.backends.split(",") if b]
        if not backends or any(b not in ("gloo", "mpi") for b in backends):
            raise ConfigError(f"--backends {self.backends}: choose from gloo, mpi (comma-separated)")
        checks.at_least("rounds", self.rounds, 1, "jobs per transport")

    def _check_to_accuracy(self) -> None:
        checks.within("to_accuracy", self.to_accuracy, 0, 1, "a test accuracy such as 0.97", open_low=True,
                      open_high=True)
        if self._check_job() in ("auto", "step"):
            raise ConfigError("--to-accuracy compares step sync with a local/diloco mode: give --sync local:H or "
                              "diloco:H")
        for seed in self.seed_list:
            checks.within("seeds", seed, 0, 2**32 - 1)
        checks.at_least("epochs", self.epochs, 1)
        checks.at_least("repeat", self.repeat, 1)
        checks.above("lr", self.lr, 0, "the built-in recipe's learning rate")
        if not self.way_list or any(w not in WAYS for w in self.way_list):
            raise ConfigError(f"--ways {self.ways}: give some of {','.join(WAYS)}, comma-separated (e.g. alone,mode: "
                              "step sync over a slow link can take minutes a seed)")

    def _check_sweep(self) -> None:
        from hvdhetero.sweep import space

        space.load(self.sweep)  # SpaceError: file:line:key, exit 2
        checks.at_least("trials", self.trials, 2, "a sweep's trials (at least one per host)")
        checks.at_least("budget", self.budget, 1, "epochs a trial trains")

    @property
    def way_list(self) -> list[str]:
        return [w for w in self.ways.split(",") if w]

    @property
    def seed_list(self) -> list[int]:
        return checks.numbers("seeds", self.seeds, int)

    @property
    def size_list(self) -> list[float]:
        return checks.numbers("sizes_mb", self.sizes_mb, float)

    def backend_list(self) -> tuple[str, ...]:
        return tuple(b for b in self.backends.split(",") if b)

    @property
    def transport_list(self) -> list[str]:
        return [t for t in self.transports.split(",") if t]

    def throughput_flags(self) -> list[str]:
        """The throughput job's command line (bench/throughput.py parses it on every rank)."""
        kind, every = check_sync(self.sync)
        return ["--dataset", self.dataset, *(["--model", self.model] if self.model else []),
                "--slowdown", str(self.slowdown), "--batch-size", str(self.batch_size), "--steps", str(self.steps),
                "--min-seconds", str(self.min_seconds), "--repeats", str(self.repeats or 5),
                "--micro-batch", self.micro_batch, "--sync", kind if kind == "step" else f"{kind}:{every}",
                *(["--overlap-sync"] if self.overlap_sync else []), "--compression", self.compression,
                "--inner-steps", self.inner_steps, *(["--out", str(Path(self.out).resolve())] if self.out else [])]

    def fits(self, hosts) -> None:
        """The global batch can be dealt to the ranks of `hosts` (checks.batch_fits)."""
        if self.mode not in ("allreduce", "sweep"):
            checks.batch_fits(self.batch_size, hosts)
