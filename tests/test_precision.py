"""--precision per device (rank/precision.py): what each device runs for the job's request, and
what the rank's log line says where that is not what was asked."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from conftest import ROOT, VENV_BIN, run_cmd
from hvdhetero import metrics
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


def test_a_training_forward_outside_any_autocast_is_said_once(capsys):
    """--precision bf16 applies inside job.autocast(): a script whose first training forward runs
    outside it, and outside a torch.autocast of its own, trains in float32 (a user saw losses
    equal to fp32's to 1e-9 and nothing said). Evaluation and no_grad forwards decide nothing."""
    asked = precision.resolve("bf16", "cpu", fast_bf16=False)  # float32 here all the same: job.autocast() counts
    for way, said in [("outside", True), ("job.autocast", False), ("own autocast", False)]:
        watch, model = precision.Watch(), torch.nn.Linear(4, 2)
        watch.first_forward(model, asked, is_main=True)
        model.eval()
        model(torch.zeros(1, 4))
        model.train()
        with torch.no_grad():
            model(torch.zeros(1, 4))
        for _ in range(2):
            if way == "outside":
                model(torch.zeros(1, 4))
            elif way == "job.autocast":
                with watch.entered(asked):
                    model(torch.zeros(1, 4))
            else:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    model(torch.zeros(1, 4))
        out = capsys.readouterr().out
        assert out == (precision.outside("bf16") + "\n" if said else ""), (way, out)
    assert precision.outside("bf16").startswith("hvdhetero: --precision bf16 applies inside `with job.autocast():`")
    # an EMA made from the model before its first training forward, or the model saved whole then: the
    # copy's hook does nothing (a closure did not pickle, and a copy's said it again at its forwards)
    import copy
    import io

    watch, model = precision.Watch(), torch.nn.Linear(4, 2)
    watch.first_forward(model, asked, is_main=True)
    torch.save(model, io.BytesIO())
    ema = copy.deepcopy(model)
    ema(torch.zeros(1, 4))
    assert capsys.readouterr().out == ""
    model(torch.zeros(1, 4))
    assert capsys.readouterr().out == precision.outside("bf16") + "\n"


def test_a_script_without_job_autocast_is_told_where_precision_applies(tmp_path):
    """The check as a script meets it (job.prepare installs it): plain python, one rank."""
    for flag in ("", "--autocast"):
        proc = run_cmd([VENV_BIN / "python", ROOT / "tests" / "scripts" / "autocast_or_not.py", *([flag] if flag else [])],
                       timeout=120, env={"HVDHETERO_RUNS": str(tmp_path / "runs")})
        assert "done 8 steps" in proc.stdout, proc.stdout + proc.stderr
        assert proc.stdout.count(precision.outside("bf16")) == (0 if flag else 1), proc.stdout
        run = Path(re.search(r"its run directory (\S+)", proc.stderr).group(1))
        said = metrics.records(run / "metrics.jsonl", "precision")  # what a report reads: not the start record's
        assert said == ([] if flag else [{**said[0], "step": 0, "autocast": False, "trained": "float32"}]), said
