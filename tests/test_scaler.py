"""A GradScaler of the script's own with the optimizer job.prepare returned, without ranks
(rank/scaler.py): what torch's GradScaler does between a step's micro-batches, at its last
chunk, and on an overflow, driven as job.backward drives the step state. Across two real ranks:
tests/test_api.py (api_scalers.py)."""

from __future__ import annotations

import pytest
import torch

from hvdhetero.errors import ConfigError
from hvdhetero.rank import scaler as scaler_module
from hvdhetero.rank.optimizer import JobOptimizer
from hvdhetero.rank.step_state import StepState


def prepared(counted: list) -> tuple[torch.nn.Parameter, torch.optim.Optimizer, JobOptimizer]:
    scaler_module.install()
    w = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([w], lr=1.0)
    state = StepState()
    job_opt = JobOptimizer(optimizer, state, before_step=lambda: not state.skip,
                           after_step=lambda: counted.append(1))
    return w, optimizer, job_opt


def chunk(w, scaler, state, value: float, last: bool):
    """A chunk's scaled loss and its backward; the step state as job.backward leaves it."""
    (scaler.scale((w * value).sum())).backward()
    state.backward_done(last=last)


def test_between_chunks_the_scaler_waits_and_at_the_last_it_steps_once_on_the_whole_gradient():
    counted = []
    w, _, job_opt = prepared(counted)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=1)
    for i, last in enumerate([False, False, True]):
        chunk(w, scaler, job_opt.step_state, 1.0, last)
        scaler.unscale_(job_opt)
        scaler.step(job_opt)
        scaler.update()
        if not last:  # untouched: still scaled, accumulating; the scale as it was
            assert torch.equal(w.grad, torch.full((3,), 8.0 * (i + 1))) and scaler.get_scale() == 8.0
    assert torch.equal(w.detach(), torch.full((3,), 1.0 - 3.0)), "one step on the 3 chunks' unscaled sum"
    assert counted == [1] and scaler.get_scale() == 16.0, "counted once; grown once (growth_interval 1)"


def test_a_step_the_scaler_skips_is_counted_not_taken():
    counted = []
    w, optimizer, job_opt = prepared(counted)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    chunk(w, scaler, job_opt.step_state, float("inf"), True)
    scaler.step(optimizer)  # the script's own object: job.prepare routed it
    scaler.update()
    assert torch.equal(w.detach(), torch.ones(3)) and counted == [1] and scaler.get_scale() == 4.0


def test_one_scaler_for_the_prepared_optimizer_and_another_is_refused_between_chunks():
    counted = []
    w, _, job_opt = prepared(counted)
    other = torch.nn.Parameter(torch.ones(2))
    other_opt = torch.optim.SGD([other], lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    chunk(w, scaler, job_opt.step_state, 1.0, last=False)
    scaler.scale(other.sum()).backward()
    scaler.step(job_opt)
    scaler.step(other_opt)
    with pytest.raises(ConfigError, match="Use a GradScaler per optimizer, or --micro-batch 0"):
        scaler.update()


def test_a_scaler_with_an_optimizer_no_job_prepared_is_torchs():
    scaler_module.install()
    w = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([w], lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    scaler.scale(w.sum()).backward()
    scaler.step(optimizer)
    scaler.update()
    assert torch.equal(w.detach(), torch.zeros(3))
    with pytest.raises(AssertionError, match="No inf checks were recorded"):
        scaler.update()  # torch's own complaint, untouched
