"""--precision per device (rank/precision.py): what each device runs for the job's request, and
what the rank's log line says where that is not what was asked."""

from __future__ import annotations

import pytest
import torch

from hvdhetero.rank import precision


@pytest.mark.parametrize("requested, device, fast, dtype", [
    ("fp16", "cuda", True, torch.float16), ("bf16", "cuda", True, torch.bfloat16),
    ("fp16", "mps", True, torch.float16), ("bf16", "mps", True, torch.float16),
    ("fp16", "cpu", True, torch.bfloat16), ("bf16", "cpu", True, torch.bfloat16),
    ("fp16", "cpu", False, None), ("bf16", "cpu", False, None), ("fp32", "cpu", True, None),
])
def test_each_device_runs_what_it_does_fast(requested, device, fast, dtype):
    taken = precision.resolve(requested, device, fast_bf16=fast)
    assert taken.dtype == dtype
    assert taken.scaled == (dtype == torch.float16), "float16 alone needs a loss scale"


def test_a_cpu_that_emulates_bf16_runs_fp32_and_says_why():
    """An AVX2-only CPU (a desktop Core i9's, this VM's) has torch emulate bfloat16: a ResNet-18
    step took 33x its float32 time under bf16 autocast. Its ranks run float32, said once."""
    note = precision.resolve("fp16", "cpu", fast_bf16=False).note
    assert note == ("--precision fp16 runs as fp32 on cpu (this CPU has no native bf16 or fp16: torch emulates "
                    "them, many times slower)")
    assert precision.resolve("fp16", "cpu", fast_bf16=True).note == ("--precision fp16 runs as bf16 on cpu (no fast "
                                                                    "fp16 there)")
    assert precision.resolve("fp16", "cpu").dtype == (torch.bfloat16 if precision.cpu_has_fast_bf16() else None)
    with precision.resolve("bf16", "cpu", fast_bf16=False).autocast():
        assert not torch.is_autocast_enabled("cpu")
