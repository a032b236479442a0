"""rank/registry.py: what a checkpoint holds, part by part, without ranks."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from hvdhetero.errors import ConfigError
from hvdhetero.rank.registry import Registry, Values


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


def test_a_dict_of_the_scripts_own_numbers_round_trips_into_the_same_dict():
    """job.track("stats", stats): an RL script's running reward (NumPy's float64, as np.mean gives
    it) is saved as Python's float, reads back with weights_only=True and lands in the dict the
    script holds, a tensor's values copied into the tensor it holds; a value a checkpoint cannot
    hold is refused at job.track, naming its key."""
    stats = {"running": np.float64(0.25), "best": torch.tensor([1.5]), "episodes": 40, "last": [np.float32(2.0)]}
    buffer = io.BytesIO()
    torch.save(Registry(stats=Values("stats", stats)).state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert type(saved["stats"]["running"]) is float
    best = torch.tensor([0.0])  # held by the script elsewhere too: filled in place
    fresh = {"running": 0.0, "best": best, "episodes": 0, "last": []}
    Registry(stats=Values("stats", fresh)).load_state_dict(saved)
    assert fresh["running"] == 0.25 and fresh["best"] is best and best.item() == 1.5 and fresh["episodes"] == 40
    assert fresh["last"] == [2.0] and type(fresh["last"][0]) is float
    with pytest.raises(ConfigError, match=r"job.track\('stats', a dict\): its 'env' holds a object"):
        Values("stats", {"running": 0.0, "env": object()})


def test_an_averaged_model_no_checkpoint_holds_is_found_once_and_a_tracked_one_never():
    """rank/averaging.unsaved: what the first checkpoint's line names (a helper's DDPM port left its
    EMA out of job.track: --resume made it again, its 84 updates' average started over, unsaid)."""
    from torch.optim.swa_utils import AveragedModel

    from hvdhetero.rank import averaging

    averaging.install()  # as job.prepare does: updates recorded with the model they averaged
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    ema, tracked, of_part, other = (AveragedModel(m) for m in (model, model, model[0], torch.nn.Linear(3, 2)))
    holder = torch.nn.ModuleDict({"ema": tracked})  # job.track'ed inside a module of the script's own
    for _ in range(3):
        ema.update_parameters(model)
        tracked.update_parameters(model)
    of_part.update_parameters(model[0])  # an EMA of a part of the model
    stranger = torch.nn.Linear(3, 2)
    other.update_parameters(stranger)  # of another model: not the job's
    assert averaging.unsaved(model, [model, holder]) == [3, 1]
    assert averaging.unsaved(model, [model, holder]) == [], "said once"
