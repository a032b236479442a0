"""job.gather (rank/gathering.py): a loss over the whole global batch, SimCLR's NT-Xent over all 2N
views, computed on every rank from every rank's rows, reduces to one device's gradient."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import ROOT, VENV_BIN, run_cmd
from test_train import _one_rank_inventory

SCRIPT = ROOT / "tests" / "scripts" / "contrastive.py"


@pytest.mark.alone
def test_a_gathered_contrastive_loss_on_two_uneven_ranks_trains_as_one_process(tmp_path):
    """48 steps of tests/scripts/contrastive.py on two ranks, rank 1 slow at its data (2 ms a
    sample: the split goes to [61, 3], then [63, 1]), against one process on the whole batch: the
    same last loss and the same parameters to float32 rounding (measured 1e-7 of weights ~0.3).
    Each rank's NT-Xent over its own share alone (the naive port, --no-gather) ended 0.03 away:
    fewer negatives, another loss. The gather's wait for the slow rank is left out of the step's
    time: counted in, both ranks' steps took the slow one's time and the split stayed [32, 32]."""
    two, one = tmp_path / "two", tmp_path / "one"
    out = run_cmd([VENV_BIN / "invoke", "train", "--script", SCRIPT, "--run-dir", two, "--", "--slow-data", "0.002"],
                  timeout=300).stdout
    alone = run_cmd([VENV_BIN / "invoke", "train", "--script", SCRIPT, "--inventory", _one_rank_inventory(tmp_path),
                     "--run-dir", one], timeout=300).stdout
    splits = [r["split"] for r in map(json.loads, (two / "metrics.jsonl").read_text().splitlines())
              if r["event"] == "split"]
    assert any(a != b for a, b in splits), splits  # uneven: the scale of each rank's gradient is tested
    last = [float(text.split("last loss ")[1].split()[0]) for text in (out, alone)]
    assert abs(last[0] - last[1]) < 1e-5, last
    a, b = (torch.load(d / "params.pt", weights_only=True) for d in (two, one))
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5
