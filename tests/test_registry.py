"""rank/registry.py: what a checkpoint holds, part by part, without ranks."""

from __future__ import annotations

import torch

from hvdhetero.rank.registry import Registry


def test_a_scaler_rank_0_held_disabled_loads_as_nothing_into_an_enabled_one():
    """job.track("scaler", scaler) keeps rank 0's state: on a Mac rank 0's GradScaler("cuda") is
    disabled and saves {}, which the CUDA rank's enabled one would refuse ("The source state dict
    is empty") at --resume. It keeps its own; a state with values still loads."""
    disabled, enabled = torch.amp.GradScaler("cpu", enabled=False), torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    saved = Registry(scaler=disabled).state_dict()
    assert saved == {"scaler": {}}
    Registry(scaler=enabled).load_state_dict(saved)
    assert enabled.get_scale() == 2.0 ** 10
    Registry(scaler=enabled).load_state_dict(Registry(scaler=torch.amp.GradScaler("cpu", init_scale=8.0)).state_dict())
    assert enabled.get_scale() == 8.0
