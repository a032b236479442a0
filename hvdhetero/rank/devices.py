"""The accelerator a rank computes on: CUDA, MPS (Apple silicon) or CPU.

Each family is one small class behind the same few methods, so `train.py` never branches on
the device. Gradients are reduced on the CPU by Horovod over Gloo whatever the device is;
this module only decides where the forward and backward passes run.

    device = select(cfg.device, local_rank=hvd.local_rank(), local_size=hvd.local_size())
    model.to(device.torch_device)
"""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import warnings
from collections.abc import Mapping
from typing import ClassVar

import torch

from hvdhetero.errors import ConfigError

# PyTorch reads this once, when `import torch` registers the MPS kernels, so the launcher must
# put it in every rank's environment; setting it later in the rank has no effect on that rank.
MPS_ENV = {"PYTORCH_ENABLE_MPS_FALLBACK": "1"}

AUTO_ORDER = ("cuda", "mps", "cpu")


class Device:
    """One accelerator family; subclasses fill in the few calls the trainer makes."""

    name: ClassVar[str]

    @classmethod
    def is_available(cls) -> bool:
        """Whether this machine's torch can compute on this family."""
        raise NotImplementedError

    @property
    def torch_device(self) -> torch.device:
        """The `torch.device` to move the model and batches to."""
        return torch.device(self.name)

    def setup(self, local_rank: int, local_size: int) -> None:
        """Claim this rank's share of the device; `local_size` ranks share this host."""

    def synchronize(self) -> None:
        """Wait for queued kernels, so wall-clock timings measure finished work."""

    def memory_allocated(self) -> int:
        """Bytes of device memory held by tensors (0 where not tracked)."""
        return 0

    def describe(self) -> str:
        """A one-line, human-readable name for logs and reports."""
        return self.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.describe()!r})"


class CPUDevice(Device):
    """Compute on the host CPU."""

    name = "cpu"

    @classmethod
    def is_available(cls) -> bool:
        """The CPU is always there."""
        return True

    def setup(self, local_rank: int, local_size: int) -> None:
        """Split the cores among co-located ranks so they don't oversubscribe them. The cores
        this process may use, not the machine's: a rank pinned to one core (by pin_local_rank,
        or a host whose sshd is pinned, as the test hosts are) runs one thread, not two that
        take turns on it."""
        machine = os.cpu_count() or 1
        mine = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else machine
        # Pinned to a share already: that share is this rank's; else the ranks here split the machine.
        torch.set_num_threads(mine if mine < machine else max(1, machine // max(1, local_size)))

    def describe(self) -> str:
        """e.g. 'cpu (8 threads)', 'cpu (1 thread)'."""
        threads = torch.get_num_threads()
        return f"cpu ({threads} thread{'s' if threads != 1 else ''})"


class CUDADevice(Device):
    """Compute on one NVIDIA GPU."""

    name = "cuda"

    def __init__(self) -> None:
        self.index = 0

    @classmethod
    def is_available(cls) -> bool:
        """A CUDA build of torch that sees at least one GPU."""
        return torch.cuda.is_available()

    @property
    def torch_device(self) -> torch.device:
        """`cuda:<index>` for the GPU this rank was given."""
        return torch.device("cuda", self.index)

    def setup(self, local_rank: int, local_size: int) -> None:
        """One GPU per local rank, wrapping round when ranks outnumber GPUs."""
        self.index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(self.index)

    def synchronize(self) -> None:
        """Wait for this GPU's stream."""
        torch.cuda.synchronize(self.index)

    def memory_allocated(self) -> int:
        """Bytes held by tensors on this GPU."""
        return torch.cuda.memory_allocated(self.index)

    def describe(self) -> str:
        """e.g. 'cuda:0 (NVIDIA GeForce RTX 4070 Ti)'."""
        return f"cuda:{self.index} ({torch.cuda.get_device_name(self.index)})"


class MPSDevice(Device):
    """Compute on an Apple-silicon GPU through Metal."""

    name = "mps"

    @classmethod
    def is_available(cls) -> bool:
        """macOS on Apple silicon with an MPS build of torch."""
        return torch.backends.mps.is_available()

    def setup(self, local_rank: int, local_size: int) -> None:
        """Make unsupported ops fall back to the CPU instead of raising."""
        if os.environ.get("PYTORCH_ENABLE_MPS_FALLBACK") != "1":
            warnings.warn(
                "PYTORCH_ENABLE_MPS_FALLBACK was not 1 when torch was imported, so ops MPS "
                "lacks will raise in this rank; the launcher should set it (devices.MPS_ENV).",
                stacklevel=2,
            )
        # Too late for this process, but DataLoader workers are spawned and re-import torch.
        for key, value in MPS_ENV.items():
            os.environ.setdefault(key, value)

    def synchronize(self) -> None:
        """Wait for the Metal command queue."""
        torch.mps.synchronize()

    def memory_allocated(self) -> int:
        """Bytes held by tensors in Metal memory."""
        return torch.mps.current_allocated_memory()

    def describe(self) -> str:
        """e.g. 'mps (Apple M2)'."""
        return f"mps ({_mac_chip()})"


def _mac_chip() -> str:
    # platform.processor() only says "arm"; the chip's marketing name comes from sysctl.
    try:
        out = subprocess.run(
            ["sysctl", "-n", "machdep.cpu.brand_string"],
            capture_output=True, text=True, timeout=5, check=True,
        )
        return out.stdout.strip() or platform.processor()
    except (OSError, subprocess.SubprocessError):
        return platform.processor() or platform.machine()


DEVICES: dict[str, type[Device]] = {cls.name: cls for cls in (CUDADevice, MPSDevice, CPUDevice)}


def available() -> dict[str, bool]:
    """Which device families this machine's torch can use, e.g. {'cuda': False, 'mps': True, 'cpu': True}."""
    return {name: DEVICES[name].is_available() for name in AUTO_ORDER}


def resolve(requested: str, available: Mapping[str, bool], *, host: str = "this machine") -> str:
    """The device name to use: `requested` itself, or for 'auto' the first available of AUTO_ORDER."""
    name = requested.strip().lower()
    have = [n for n in AUTO_ORDER if available.get(n)]
    have_text = ", ".join(have) or "none"
    if name == "auto":
        if not have:
            raise ConfigError(f"device 'auto': no device is available on {host} (not even the CPU)")
        return have[0]
    if name not in DEVICES:
        raise ConfigError(f"unknown device {requested!r}; allowed: auto, {', '.join(AUTO_ORDER)}")
    if not available.get(name):
        raise ConfigError(
            f"device {name!r} was requested but is not available on {host} "
            f"(available: {have_text}). Set `device:` for this host in inventory.yaml "
            f"to one of {have_text}, or to `auto`."
        )
    return name


def select(requested: str = "auto", local_rank: int = 0, local_size: int = 1) -> Device:
    """Resolve `requested` on this machine, set the device up for this rank and return it."""
    name = resolve(requested, available(), host=socket.gethostname())
    # Denormal floats (|x| < 1.2e-38) take x86 CPUs ~100x longer per operation. Adam and the
    # outer optimizer drive small weights and moments into that range within minutes: a CPU
    # rank's step then slowed from 70 to 200 ms over one benchmark (the 12x-slower pair went
    # from 1.05x to 0.80x the fast rank alone). Flushing them to zero costs no accuracy, and
    # it applies to every rank's CPU work (the sync's float32 global model included).
    torch.set_flush_denormal(True)
    device = DEVICES[name]()
    device.setup(local_rank, local_size)
    return device


CUBLAS_DETERMINISTIC = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
"""cuBLAS repeats its results only with a fixed workspace (NVIDIA's cuBLAS reproducibility notes);
read when this process first uses cuBLAS, so it is set before any CUDA work."""


def deterministic() -> None:
    """--deterministic: kernels that give the same bits on every run, where PyTorch has them (CUDA's
    defaults include convolutions and scatters that add in whatever order threads finish, so
    two runs, or a run and its resume, part in the last bits). An operation with no such kernel
    warns and runs as it is; CPU kernels are deterministic already."""
    for key, value in CUBLAS_DETERMINISTIC.items():
        os.environ.setdefault(key, value)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


ACCELERATORS = ("cuda", "mps")
"""The devices whose ranks compute off the CPU (core_shares)."""
ACCELERATOR_CORES = 2
"""Cores a GPU rank keeps on a machine it shares with CPU ranks: its host-side work (the Python
loop, kernel launches, copies, Horovod's and Gloo's threads) runs on them, and torch gives it as
many threads. The CPU ranks split the rest (16 cores, `device: cuda,cpu`: 2 and 14, where an
even split left the CPU rank 8 and the GPU rank's 16 threads floating over all of them)."""


def core_shares(named: list[str], cores: list[int]) -> list[list[int]]:
    """Each local rank's cores, `named` holding each local rank's device (cpu, cuda, mps, auto):
    an even split, or with GPU ranks beside CPU ranks, ACCELERATOR_CORES for each GPU rank and an
    even split of the rest among the others (an even split where too few cores are left)."""
    gpus = [i for i, name in enumerate(named) if name in ACCELERATORS]
    if len(gpus) == len(named) or len(cores) - ACCELERATOR_CORES * len(gpus) < len(named) - len(gpus):
        gpus = []  # no CPU rank to leave cores to, or too few cores: an even split
    kept = ACCELERATOR_CORES * len(gpus)
    others = [i for i in range(len(named)) if i not in gpus]
    share = (len(cores) - kept) // len(others)
    by_rank = {i: cores[k * ACCELERATOR_CORES:(k + 1) * ACCELERATOR_CORES] for k, i in enumerate(gpus)}
    by_rank |= {i: cores[kept + k * share:kept + (k + 1) * share] for k, i in enumerate(others)}
    return [by_rank[i] for i in range(len(named))]


def pin_local_rank(local_rank: int, local_size: int, named: list[str] | None = None) -> list[int] | None:
    """Give each CPU rank on a machine its own share of the cores (`named`: each local rank's
    device, core_shares). Called before hvd.init(), so Horovod's background thread and Gloo's
    share the rank's cores instead of preempting the other rank's compute. Returns the cores
    taken, None where it does not apply."""
    if local_size <= 1 or not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    mine = core_shares(named or ["cpu"] * local_size, cores)[local_rank]
    if not mine:
        return None
    os.sched_setaffinity(0, mine)
    return mine
