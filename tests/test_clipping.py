"""rank/clipping.py without ranks: which calls of torch.nn.utils.clip_grad_norm_ the job takes
over (the whole model, as one-device scripts clip) and which stay torch's."""

from __future__ import annotations

import pytest
import torch

from hvdhetero.rank import clipping


@pytest.fixture
def taken():
    """A model of two layers whose every parameter the job reduces; its clip records its calls."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    for p in model.parameters():
        p.grad = torch.full_like(p, 3.0)
    calls = []
    clipping.take_over(lambda max_norm, norm_type: calls.append((max_norm, norm_type)) or torch.tensor(7.0),
                       list(model.parameters()))
    yield model, calls
    clipping.release()


def test_the_whole_model_is_the_jobs_clip(taken):
    model, calls = taken
    assert float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)) == 7.0
    assert float(torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 2, 1)) == 7.0
    assert calls == [(1.0, 2.0), (2.0, 1.0)]
    assert all(torch.equal(p.grad, torch.full_like(p, 3.0)) for p in model.parameters()), "the job's clip clips"
    with pytest.raises(RuntimeError, match="is non-finite, so it cannot be clipped"):
        clipping.take_over(lambda *a: torch.tensor(float("inf")), list(model.parameters()))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)


def test_a_part_of_the_model_and_a_job_that_ended_are_torchs(taken):
    model, calls = taken
    torch.nn.utils.clip_grad_norm_(model[0].parameters(), 1.0)
    assert calls == [] and norm(model[0]) == pytest.approx(1.0, rel=1e-5), "torch clipped the first layer"
    assert float(model[1].weight.grad[0, 0]) == 3.0
    clipping.release()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    assert calls == [] and norm(model) == pytest.approx(1.0, rel=1e-5), "torch clipped the model"


def norm(module) -> float:
    return float(torch.cat([p.grad.reshape(-1) for p in module.parameters()]).norm())
