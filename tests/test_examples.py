"""The scripts in examples/ run as a user runs them, `invoke train --script examples/NAME.py`,
on two real ranks, on tiny or synthetic data (no download here)."""

from __future__ import annotations

import pytest
import torch

from conftest import ROOT, VENV_BIN, run_cmd
from hvdhetero import metrics
from hvdhetero.rank import precision

pytestmark = pytest.mark.slow


def train_example(name, run_dir, *args, job=()):
    proc = run_cmd([VENV_BIN / "invoke", "train", "--script", ROOT / "examples" / name, "--run-dir", run_dir,
                    *job, "--", *args], timeout=600)
    records = metrics.records(run_dir / "metrics.jsonl")
    end = records[-1]
    assert end["event"] == "end" and len(set(end["param_digests"])) == 1, "ranks in sync"
    return proc, records


def test_mnist_cnn_with_dataloader_workers(tmp_path):
    proc, records = train_example("mnist.py", tmp_path, "--fake-data", "512", "--epochs", "2", "--batch-size", "64",
                                  "--workers", "1")
    assert [r["epoch"] for r in records if r["event"] == "log"] == [0, 1]
    assert "epoch 1: test accuracy" in proc.stdout
    assert sum(r["samples"] for r in records if r["event"] == "epoch") == 2 * 512, "every sample once per epoch"
    torch.load(tmp_path / "mnist_cnn.pt", weights_only=True)


@pytest.mark.alone
def test_cifar10_resnet18_with_mixed_precision_a_per_batch_cosine_and_checkpointing(tmp_path):
    proc, records = train_example("cifar10_resnet.py", tmp_path, "--fake-data", "64", "--epochs", "1",
                                  "--batch-size", "16", "--workers", "1", "--checkpointing",
                                  job=["--precision", "fp16", "--micro-batch", "8", "--slowdown", "3"])
    start = records[0]
    # Unequal shares (the last rank 3x slower) run unequal numbers of chunks, so BatchNorm's
    # num_batches_tracked differed by rank and the end digests with it (seen in CI when a busy
    # machine moved an equal split): integer buffers now come from rank 0.
    assert any(s[0] > s[1] for s in (r["split"] for r in records if r["event"] == "split")), records
    taken = "bf16" if precision.cpu_has_fast_bf16() else "fp32"  # an AVX2-only CPU emulates bf16: fp32
    assert all(note.startswith(f"--precision fp16 runs as {taken} on cpu (") for note in start["precision"]), start
    assert f"runs as {taken} on cpu" in proc.stdout, "the mapping is said on the console"
    assert start["micro_batches"] == [8, 8]
    lr = [r["lr"] for r in records if r["event"] == "log"][-1]
    assert lr < 1e-3, "OneCycle ran its steps once per global step (4), not per micro-batch, to its end"
    state = torch.load(tmp_path / "resnet18_cifar10.pt", weights_only=True)
    assert state["stem.0.weight"].dtype == torch.float32


def test_char_transformer_on_a_text_file_every_machine_has(tmp_path):
    proc, records = train_example("char_transformer.py", tmp_path, "--epochs", "3", "--max-chars", "3000",
                                  "--block", "32", "--batch-size", "64", job=["--micro-batch", "0"])
    bits = [r["test_bits_per_char"] for r in records if r["event"] == "log"]
    loss = [r["loss"] for r in records if r["event"] == "epoch"]
    assert len(bits) == 3 and all(0 < b < 8 for b in bits), bits  # 3,000 characters: held-out text overfits
    assert loss[-1] < loss[0] * 0.9, loss  # it learns the training text
    assert "sample: " in proc.stdout
