"""Mixed precision per device, and a loss scale every rank agrees on.

`--precision` is one choice for the job; each device runs what it does well:

    requested   cuda            mps             cpu
    fp32        float32         float32         float32
    bf16        bfloat16        float16 + scale bfloat16
    fp16        float16 + scale float16 + scale bfloat16

A CPU has no fast float16 matmul in torch (autocast on the CPU takes bfloat16), so fp16 maps to
bf16 there; MPS takes float16 (its bfloat16 needs macOS 14 and is slower on M1/M2), so bf16 maps
to fp16 there. A CPU without native bfloat16 (AVX2 only, as desktop Core i9s: no AVX512-BF16 or
AMX) has torch emulate it: a ResNet-18 step under bf16 autocast took 5.6 s against 0.17 s in
float32 (33x, 8 CIFAR images, one thread), so such a CPU runs float32. Each mapping is said once
in the rank's log line.

float16 needs loss scaling (small gradients underflow). The scale must be the same on every
rank, and a step whose gradients overflowed on *any* rank must be skipped by *every* rank, or
the replicas part. Both follow from where the overflow shows: an inf or NaN in one rank's
gradient is inf or NaN in the reduced sum on every rank (IEEE addition propagates them, and the
allreduce hands every rank the same bytes), so each rank checks the reduced gradients, reaches
the same verdict, and updates an identical scale. Gradients are still reduced in float32 (or
fp16 on the wire when asked), unscaled before they leave the device buffer.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_NATIVE = {"cuda": {"bf16", "fp16"}, "mps": {"fp16"}, "cpu": {"bf16"}}


@dataclass(frozen=True)
class Precision:
    """What `job.autocast()` does on this rank."""

    requested: str
    device: str
    dtype: torch.dtype | None
    """Autocast dtype, None for float32 (autocast off)."""

    @property
    def scaled(self) -> bool:
        """float16 needs a loss scale."""
        return self.dtype == torch.float16

    @property
    def note(self) -> str:
        """How the request was mapped on this device, for the log ('' when taken as asked)."""
        taken = {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[self.dtype]
        if taken == self.requested:
            return ""
        if taken == "fp32":
            return (f"--precision {self.requested} runs as fp32 on {self.device} (this CPU has no native bf16 or "
                    "fp16: torch emulates them, many times slower)")
        return f"--precision {self.requested} runs as {taken} on {self.device} (no fast {self.requested} there)"

    @staticmethod
    def note_of(said: str) -> bool:
        """Whether `said` (what the start record holds of a rank's precision) is a note, not a dtype."""
        return said.startswith("--precision ")

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device, dtype=self.dtype)


class Watch:
    """Whether the script trains under the mixed precision --precision asks for: job.autocast()
    counts who is inside it, and the model's first training forward after job.prepare (training
    mode, gradients on) outside it and outside any autocast of the script's own on the rank's
    device is said once by rank 0: such a script trains in float32 whatever --precision says."""

    def __init__(self):
        self.inside = 0

    @contextlib.contextmanager
    def entered(self, precision: Precision):
        """job.autocast(): `precision`'s autocast, counted."""
        self.inside += 1
        try:
            with precision.autocast():
                yield
        finally:
            self.inside -= 1

    def first_forward(self, model: torch.nn.Module, precision: Precision, is_main: bool,
                      record=lambda: None) -> None:
        """After the probes (which call the model themselves): look at the script's first training
        forward (`record()`: the metrics' word that the job trains in float32, whatever the start
        record's precision says)."""
        if precision.requested == "fp32" or not is_main:
            return

        from hvdhetero.rank.batch_function import Unsaved

        def seen(module, args):
            if not module.training or not torch.is_grad_enabled():
                return
            handle.remove()
            if not self.inside and not torch.is_autocast_enabled(precision.device):
                print(outside(precision.requested), flush=True)
                record()
        # a copy of the model (an EMA made from it, torch.save of it whole) carries a hook that does nothing
        handle = model.register_forward_pre_hook(Unsaved(seen))


def outside(requested: str) -> str:
    """Rank 0's line for Watch: a training forward under no autocast."""
    return (f"hvdhetero: --precision {requested} applies inside `with job.autocast():`, and the model's first "
            "training forward ran outside it (and outside any torch.autocast of the script's own): the job trains "
            "in float32. Put the forward pass and the loss under `with job.autocast():` (docs/api.md)")


def resolve(requested: str, device: str, fast_bf16: bool | None = None) -> Precision:
    """The precision a `device` rank runs for the job's `requested` one (`fast_bf16`: whether a
    CPU computes bfloat16 natively; None: this machine's, `cpu_has_fast_bf16`)."""
    if requested == "fp32":
        return Precision(requested, device, None)
    native = _NATIVE.get(device, {"bf16"})
    if device == "cpu" and not (cpu_has_fast_bf16() if fast_bf16 is None else fast_bf16):
        return Precision(requested, device, None)
    taken = requested if requested in native else next(iter(sorted(native)))
    return Precision(requested, device, _DTYPES[taken])


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX on x86, BF16 on Arm), as
    oneDNN reports it; where torch cannot say, assumed so."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return True


@dataclass
class LossScale:
    """A dynamic loss scale, updated identically on every rank from the reduced gradients'
    verdict: halve on an overflow (and skip that step), double after `interval` clean steps."""

    scale: float = 2.0 ** 16
    interval: int = 2000
    clean: int = 0
    skipped: int = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "interval": self.interval, "clean": self.clean, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.interval, self.clean, self.skipped = (state["scale"], state["interval"], state["clean"],
                                                               state["skipped"])

    def update(self, overflowed: bool) -> None:
        if overflowed:
            self.scale = max(self.scale / 2.0, 1.0)
            self.clean = 0
            self.skipped += 1
            return
        self.clean += 1
        if self.clean >= self.interval:
            self.scale *= 2.0
            self.clean = 0
