"""The parameters a step trains, followed as the script changes them after job.prepare: a
fine-tuning script that unfreezes its backbone, a head made after prepare, a GAN's discriminator
thawed and frozen every step. Called by the prepared job (rank/training.py) as a step's first
chunk is handed out and at its first backward.

    follow(t, before_forward=True)   # the reducer's set follows requires_grad; new ones take rank 0's
    share(params)                    # parameters made after prepare take rank 0's values
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hvdhetero.errors import ConfigError
from hvdhetero.rank.reducer import broadcast_tensors

if TYPE_CHECKING:
    from hvdhetero.rank.training import Training


def follow(t: Training, before_forward: bool) -> None:
    """As a step's first chunk is handed out (`before_forward`), and again at its first backward
    (a change the loop body made in between): the parameters that now need a gradient are the
    ones reduced (step sync: Reducer.follow); a fine-tuning script that unfreezes its backbone
    after job.prepare had its gradients never reduced, the ranks' backbones apart. Parameters
    prepare never saw (a new head) take rank 0's values: before the forward where the change
    came between steps, else after this step's reduction (the forward used each rank's own
    then; autograd forbids changing them before its backward). Under local/diloco the ranks
    first exchange what they have (one model), then the rounds carry the new set
    (ParameterSync.retarget); a change inside a step's loop body is refused there."""
    if not t.reducer.trainable_changed(t.model):  # the reducer follows them under every sync mode
        return
    t.flush()  # what a script's own accumulation left pending: reduced over the set it was computed for
    before = len(t.reducer.params)
    if t.strategy.kind != "step":
        if not before_forward:
            raise ConfigError(f"the model's trainable parameters changed inside a step's loop body (requires_grad "
                              f"set or cleared after the batch came) under --sync {t.strategy.name}, whose "
                              "rounds follow such a change only between steps: make it before the loop over the "
                              "batches (at an epoch's start), or use --sync step")
        item = t.step_state.item
        if t.config.inner_steps == "by-speed" and item is not None and item.step % len(t.loader):
            raise ConfigError(f"the model's trainable parameters changed in the middle of an epoch under --sync "
                              f"{t.strategy.name} --inner-steps by-speed, where a rank that merges steps "
                              "reaches the change at another step than the others: make it at an epoch's start "
                              "(before the loop over the batches)")
    new = t.reducer.follow(t.model)
    if t.strategy.kind != "step":  # rounds: one model now, then exchanges over the new set
        t.strategy.one_model(t.train.step)
        share(new)
        t.strategy.sync.retarget(t.model)
    elif before_forward:  # a head made after prepare: each rank's own initial values until now
        share(new)
    else:
        t.unshared = new
    if not t.reducer.returned:  # a set trained before (a GAN's D thawed and frozen every step): said once
        t.records.write("trainable", step=t.train.step, before=before, now=len(t.reducer.params),
                        new=len(new), elements=sum(p.numel() for p in t.reducer.params))


def share(params: list[torch.nn.Parameter]) -> None:
    """Parameters made after job.prepare (each rank's own initial values) take rank 0's."""
    broadcast_tensors(params, 0, "hvdhetero.new_params", "giving every rank rank 0's new parameters")
