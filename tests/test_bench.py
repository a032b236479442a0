"""`invoke bench` keeps its interface: one job, three phases, the JSON scripts rely on."""

import json
import statistics

import pytest

from conftest import ROOT, VENV_BIN, run_cmd


def test_solo_and_hvdhetero_run_next_to_each_other_in_turns_then_the_engine_and_horovod_last():
    from hvdhetero.bench.throughput import phase_order

    names = ["solo", "horovod", "hvdhetero", "engine"]
    orders = [phase_order(names, r) for r in range(4)]
    assert orders[0] == orders[2] == ["solo", "hvdhetero", "engine", "horovod"]
    assert orders[1] == orders[3] == ["hvdhetero", "solo", "engine", "horovod"]


@pytest.mark.alone
@pytest.mark.slow
def test_bench_writes_the_documented_json(tmp_path):
    out, scratch = tmp_path / "bench.json", tmp_path / "tmp"
    scratch.mkdir()
    proc = run_cmd([VENV_BIN / "invoke", "bench", "--slowdown", "3", "--steps", "1", "--repeats", "3",
                    "--min-seconds", "0.3", "--batch-size", "256", "--out", out], timeout=600,
                   env={"TMPDIR": str(scratch)})
    # The hvdhetero phase's checkpoints (its run folder in TMPDIR) are gone with the run
    assert not list(scratch.glob("hvdhetero-bench-*")), list(scratch.iterdir())
    result = json.loads(out.read_text())
    assert result["config"]["slowdown"] == 3.0 and result["config"]["ranks"] == 2
    # Quick phases took more than --steps 1, to be timed over >= 0.3 s a round; the slow rank
    # alone needs fewer steps for that than the fast one.
    timed = result["config"]["timed_steps"]
    assert timed["solo"][0] > 1 and timed["solo"][0] >= timed["solo"][1] and timed["hvdhetero"] > 1, timed
    assert len(result["solo"]["per_rank_samples_per_s"]) == 2
    solo = result["solo"]
    assert solo["samples_per_s"] == pytest.approx(sum(solo["per_rank_samples_per_s"]))
    assert len(solo["per_round_samples_per_s"]) == 3
    assert all(f < t for f, t in zip(solo["per_round_fastest"], solo["per_round_samples_per_s"]))
    for job in ("horovod", "hvdhetero", "engine"):
        r = result[job]
        rates = r["per_round_samples_per_s"]
        assert len(rates) == 3 and r["samples_per_s"] == pytest.approx(statistics.median(rates))
        assert sum(r["split"]) == 256
        # E and vs_fastest: medians of the ratios within each round (paired against drift)
        assert r["efficiency"] == pytest.approx(statistics.median(
            [j / s for j, s in zip(rates, solo["per_round_samples_per_s"])]))
        assert r["vs_fastest"] == pytest.approx(statistics.median(
            [j / f for j, f in zip(rates, solo["per_round_fastest"])]))
    assert result["horovod"]["split"] == [128, 128]
    # Where hvdhetero's step went, per rank: compute and reduce are parts of one step (in ms)
    steps = result["hvdhetero"]["per_rank_step_ms"]
    step_ms = [1e3 * 256 / r for r in result["hvdhetero"]["per_round_samples_per_s"]]
    assert len(steps) == 2, steps
    for r in steps:
        assert 0.2 * min(step_ms) < r["compute_ms"] and r["compute_ms"] + r["reduce_ms"] < 1.5 * max(step_ms), (r, step_ms)
        # every timed step (3 rounds, warm-up left out): compute and reduce happen within it
        assert len(r["steps_ms"]) == 3 * timed["hvdhetero"], (len(r["steps_ms"]), timed)
        assert all(c + d <= w + 0.02 for c, d, w in r["steps_ms"]), r["steps_ms"]
    assert "hvdhetero median step, ms per rank: compute" in proc.stdout
    assert "hvdhetero / plain horovod" in proc.stdout
    # The public API (hvdhetero) against the bare engine, paired within rounds
    assert result["api_overhead"] == pytest.approx(statistics.median(
        [e / o - 1 for e, o in zip(result["engine"]["per_round_samples_per_s"],
                                   result["hvdhetero"]["per_round_samples_per_s"])]))
    assert "public API overhead" in proc.stdout
    # Checkpoints as training writes them, timed, against the time between two by default
    saving = result["checkpoint"]
    assert saving["save_s"] > 0 and saving["bytes"] > 100_000 and saving["interval_s"] > 0
    assert saving["cost"] == pytest.approx(saving["save_s"] / (saving["save_s"] + saving["interval_s"]))
    assert "checkpoints at the default interval: " in proc.stdout


def test_bench_takes_a_sync_mode_for_the_hvdhetero_phase_and_refuses_a_bad_one():
    ok = run_cmd([VENV_BIN / "invoke", "bench", "--sync", "diloco:8", "--dry-run"], timeout=60)
    assert "--sync diloco:8" in ok.stdout
    bad = run_cmd([VENV_BIN / "invoke", "bench", "--sync", "diloco", "--dry-run"], timeout=60, check=False)
    assert bad.returncode == 2 and "--sync must be step, auto, local:H or diloco:H" in bad.stderr
    assert "horovodrun" not in bad.stdout
    auto = run_cmd([VENV_BIN / "invoke", "bench", "--sync", "auto", "--dry-run"], timeout=60, check=False)
    assert auto.returncode == 2 and "bench measures one --sync mode" in auto.stderr
    for flags, message in ((["--compression", "bf16"], "--compression must be one of none, fp16, got 'bf16'"),
                           (["--overlap-sync"], "--overlap-sync needs --sync local:H or diloco:H"),
                           (["--dataset", "imagenet"], "--dataset must be one of digits, mnist, cifar10"),
                           (["--model", "vit"], "--model must be one of cnn, resnet18")):
        refused = run_cmd([VENV_BIN / "invoke", "bench", *flags, "--dry-run"], timeout=60, check=False)
        assert refused.returncode == 2 and message in refused.stderr and "horovodrun" not in refused.stdout


def test_bench_runs_a_mode_whose_slow_rank_merges_steps(tmp_path):
    """--inner-steps by-speed: the slow rank's calls cover several global steps at once; the
    phases still end together on every rank (whole rounds), or this would hang or mismatch."""
    out = tmp_path / "bench.json"
    run_cmd([VENV_BIN / "invoke", "bench", "--slowdown", "3", "--steps", "4", "--repeats", "2", "--min-seconds",
             "0.3", "--batch-size", "256", "--sync", "local:4", "--inner-steps", "by-speed", "--out", out],
            timeout=600)
    result = json.loads(out.read_text())
    assert result["config"]["inner_steps"] == "by-speed" and result["config"]["timed_steps"]["hvdhetero"] % 4 == 0
    assert len(result["hvdhetero"]["per_round_samples_per_s"]) == 2 and result["hvdhetero"]["samples_per_s"] > 0


def test_bench_times_resnet18_on_cifar10_shaped_images_without_the_files(tmp_path):
    """The GPU check's model and inventory (ci/gpu-check): ResNet-18 with the CIFAR stem on random
    3x32x32 images, through every phase, no dataset files on any host; a device per slot
    (`device: cuda,cpu` there, `cpu,cpu` here: the bench refused a per-slot device on the GPU machine)."""
    out, inventory = tmp_path / "bench.json", tmp_path / "inventory.yaml"
    inventory.write_text((ROOT / "inventory.yaml").read_text().replace("device: cpu ", "device: cpu,cpu ")
                         .replace("env: .venv", f"env: {VENV_BIN.parent}"))
    assert "cpu,cpu" in inventory.read_text()
    proc = run_cmd([VENV_BIN / "invoke", "bench", "--inventory", inventory, "--dataset", "cifar10", "--model",
                    "resnet18", "--batch-size", "8", "--steps", "1", "--repeats", "1", "--min-seconds", "0",
                    "--out", out], timeout=600)
    result = json.loads(out.read_text())
    assert result["config"]["model"] == "resnet18" and result["config"]["dataset"] == "cifar10", result["config"]
    assert result["config"]["synthetic"] is True and sum(result["hvdhetero"]["split"]) == 8
    assert all(r > 0 for r in result["solo"]["per_rank_samples_per_s"]) and result["hvdhetero"]["samples_per_s"] > 0
    assert result["checkpoint"]["bytes"] > 40e6, "ResNet-18's 11M parameters and Adam's state were saved"
    assert "resnet18 on cifar10-shaped random images" in proc.stdout


def _job(rates, split):
    return {"per_round_samples_per_s": rates, "split": split, "micro_batches": [None] * len(split),
            "per_rank_step_ms": [{"compute_ms": 1.0, "reduce_ms": 0.1, "step_ms": 1.2, "mean_step_ms": 1.3}]}


@pytest.mark.parametrize("solo, ours, captured", [
    ([[100.0, 110.0]], [90.0, 99.0], None),  # one host: nothing slower to capture
    ([[100.0, 110.0], [20.0, 20.0]], [112.0, 121.0], 0.575),  # rounds: 12/20, 11/20
])
def test_the_report_takes_one_host_as_well_as_two(tmp_path, solo, ours, captured, capsys):
    """`invoke bench --hosts pc` (one rank) divided by zero: captured is (combined - fastest) /
    (sum - fastest), and with one rank there is no slower one."""
    from types import SimpleNamespace

    from hvdhetero.bench.summary import report

    args = SimpleNamespace(slowdown=1.0, sync="step", overlap_sync=False, inner_steps="same", compression="none",
                           dataset="digits", model="", batch_size=512, steps=8, min_seconds=6.0, repeats=2, warmup=2,
                           out=str(tmp_path / "b.json"))
    split = [512 // len(solo)] * len(solo)
    report(args, solo, _job([80.0, 90.0], split), _job(ours, split), _job(ours, split),
           {"solo": [10] * len(solo), "horovod": 8, "hvdhetero": 10, "engine": 10},
           {"save_s": 0.02, "interval_s": 30.0, "cost": 0.02 / 30.02, "bytes": 1000})
    result = json.loads((tmp_path / "b.json").read_text())
    assert result["config"]["ranks"] == len(solo)
    assert result["hvdhetero"]["vs_fastest"] == pytest.approx(statistics.median([o / s for o, s in zip(ours, solo[0])]))
    if captured is None:
        assert result["hvdhetero"]["captured"] is None and "captured" not in capsys.readouterr().out
    else:
        assert result["hvdhetero"]["captured"] == pytest.approx(captured, abs=0.01)
