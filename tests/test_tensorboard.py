"""train --tensorboard: the run's metrics as TensorBoard scalars, read back with TensorBoard's
own reader."""

from __future__ import annotations

import pytest

from conftest import VENV_BIN, run_cmd
from hvdhetero.rank.tensorboard import scalars


def test_which_records_become_which_scalars():
    epoch = {"epoch": 0, "step": 23, "loss": 0.5, "samples_per_s": 900.0, "seconds": 2.0, "rank_samples": [1200, 237],
             "split": [53, 11]}
    assert dict(scalars("epoch", epoch)) == {"train/loss": 0.5, "train/samples_per_s": 900.0,
                                             "rank0/samples_per_s": 600.0, "rank1/samples_per_s": 118.5,
                                             "rank0/share": 53, "rank1/share": 11}
    window = {"epoch": 0, "step": 30, "steps": 10, "samples_per_s": 640.0, "seconds": 1.0, "rank_samples": [160, 480]}
    assert dict(scalars("window", window)) == {"train/samples_per_s": 640.0, "rank0/samples_per_s": 160.0,
                                               "rank1/samples_per_s": 480.0}  # a loop of its own: no epoch loss
    log = {"epoch": 1, "step": 46, "test_accuracy": 0.9, "note": "text", "done": True, "time": 1.0}
    assert scalars("log", log) == [("test_accuracy", 0.9)]
    assert scalars("checkpoint", {"step": 3, "seconds": 0.1}) == []


@pytest.mark.slow
def test_a_run_with_tensorboard_writes_every_epoch_and_log_scalar(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_cmd([VENV_BIN / "invoke", "train", "--epochs", "3", "--sync", "local:4", "--tensorboard", "--run-dir",
             tmp_path], timeout=600)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/samples_per_s", "rank0/samples_per_s", "rank1/samples_per_s", "rank0/share",
            "test_accuracy", "sync/exchange_s"} <= tags, tags
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [23, 46, 69] and loss[-1].value < loss[0].value, loss
    assert len(events.Scalars("test_accuracy")) == 3 and events.Scalars("test_accuracy")[-1].value > 0.8
