"""Everything a resume needs, taken from a prepared job (rank/training.py) and put back into
one: the state of a checkpoint on disk (`save_checkpoint`, `resume_from_disk`) and of an
elastic commit in memory (rank/elastic.py) alike.

    state = snapshot(t, rng=..., optimizer=...)   # model, optimizer, scheduler, loss scale,
                                                  # sync state, split, position, RNG, config,
                                                  # metrics offset, job.track'ed objects
    restore(t, state, rng=...)                    # into the prepared objects, in place

A state holds tensors and plain values only, so it round-trips through torch.save and
torch.load(weights_only=True): nothing is ever unpickled. The files' own rules (atomic writes,
the newest K kept, the newest that loads) are rank/checkpoint.py's.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import torch

from hvdhetero.errors import ConfigError, briefly
from hvdhetero.rank import checkpoint
from hvdhetero.rank import averaging, collectives, positions
from hvdhetero.rank.reducer import to_cpu

if TYPE_CHECKING:
    from hvdhetero.rank.training import Training


def snapshot(t: Training, *, rng: Any, optimizer: Any, epoch_done: bool = False,
             landing: bool = False) -> dict[str, Any]:
    """The job's state now: its position (TrainState), every registered part (model, scheduler,
    loss scale, sync strategy, job.track'ed objects: rank/registry.py) and what a resume compares
    or redoes. `rng` is every rank's random states (a checkpoint) or this rank's (an elastic
    commit); `optimizer` the optimizer state to keep (under local/diloco every rank's in a
    checkpoint, this rank's own in a commit). Under local/diloco only between rounds, nothing in
    flight (ParameterSync.state_dict says so otherwise), unless `landing`: an overlapped elastic
    commit whose round is in flight, its global model (what the exchange carries, left out here)
    and sync state put in when it lands (rank/elastic.py)."""
    parts = t.parts.state_dict(leave_out=("optimizer", "sync") if landing else ("optimizer",))
    if landing:
        out = t.strategy.exchanged_names(t.model)
        parts["model"] = {name: x for name, x in parts["model"].items() if name not in out}
        parts["sync"] = None
    loader_step = (t.train.epoch + 1) * len(t.loader) if epoch_done else t.loader_at
    if epoch_done and t.one_pass and t.step_state.item is not None:  # a batch function's rows go on by
        loader_step = t.step_state.item.step + 1  # global step: after the step in hand (one fetched ahead waits)
    return {"format": checkpoint.FORMAT, **t.train.state_dict(epoch_done), "loader_step": loader_step,
            "loader_steps": len(t.loader), "size": t.size,
            "hosts": t.host_names, **parts, "optimizer": optimizer, "split": list(t.sampler.batch_sizes),
            "rng": rng, "config": asdict(t.config), "metrics_offset": t.records.offset(),
            "epochs_from": t.epochs_from if t.in_epochs else None}  # None: a loop of the script's own


def restore(t: Training, state: dict[str, Any], rng: dict[str, Any] | None) -> None:
    """Put `state` back into the job's registered parts, in place, and continue from its position;
    `rng` is this rank's random states to restore (None: draw new ones from the seed and step)."""
    t.passes.load_state_dict(None)  # (a part whose state is None loads nothing: an elastic restore's pass reset)
    t.parts.load_state_dict(state)
    # The split is the one calibrated now (balancer and loader agree on it; with --equal-split it
    # is the run's). The same hosts get their random states back; others draw from the seed.
    if rng is not None:
        checkpoint.set_rng_state(rng)
    else:
        torch.manual_seed(t.config.seed * 1_000_003 + state["step"] * 101 + t.rank)
    t.train.load_state_dict(state)
    t.strategy.restart(t.train.step)  # local/diloco: the rounds start again at the checkpoint's step
    t.loader.start_step = loader_step(state, len(t.loader) if state.get("loader_steps") else 0, t.train.step)
    t.loader_at = t.loader.start_step  # a commit taken before the next step (an elastic rejoin's) holds it: it held 0
    t.resumed_own_loop = t.train.step or None  # the script runs again from its top: own_loop_went_on looks
    t.count.partial = not state.get("epoch_done")  # the live line counts no epoch's steps from its rest
    called = t.parts.parts.get("batches")
    if t.is_main and called is not None and called.moved:  # a position of the script's own starts afresh
        print(positions.said(called.moved, t.train.step), flush=True)


def loader_step(state: dict[str, Any], steps: int, step: int) -> int:
    """The loader step to go on from, counted with this run's `steps` an epoch: a checkpoint's
    epoch and step within it, where the run that wrote it had another count (`loader_steps`: an
    epoch's short last step kept or left out by the ranks' number, a sampler of the script's own
    leaving out batches too short for them all) -- counted with the old number, a resume on
    another host set skipped steps of its epoch that were never trained. A checkpoint from
    before `loader_steps` is read as it was; one from before `loader_step`: the optimizer's step
    (no accumulation known)."""
    at = state.get("loader_step", step)
    before = state.get("loader_steps")
    if not before or not steps or before == steps:
        return at
    return (at // before) * steps + min(at % before, steps)


def save_checkpoint(t: Training, epoch_done: bool) -> None:
    """Everything a resume needs, written by rank 0 (every rank's part gathered), atomically; the
    newest --keep-checkpoints kept. With local/diloco the ranks first agree on one model."""
    if not t.config.keep_checkpoints:
        return
    started, step = time.perf_counter(), t.train.step
    t.strategy.one_model(step)
    rngs = collectives.allgather_object(checkpoint.rng_state(t.me.device.name), "hvdhetero.ckpt.rng", "a checkpoint")
    # step sync: every rank's optimizer state is the same; local/diloco: each rank's own
    optimizer = t.optimizer.state_dict()
    if t.strategy.own_optimizers:
        optimizer = collectives.allgather_object(to_cpu(optimizer), "hvdhetero.ckpt.optimizer", "a checkpoint")
    path = checkpoint.path_for(t.run_dir, step)
    if t.is_main:
        checkpoint.save_object(snapshot(t, rng=rngs, optimizer=optimizer, epoch_done=epoch_done), path)
        checkpoint.keep_newest(t.run_dir, t.config.keep_checkpoints)
        tracked = t.parts.parts["tracked"]
        unsaved = averaging.unsaved(t.model, [t.model, *tracked.parts.values()])
        if unsaved:
            several = len(unsaved) > 1
            print(f"hvdhetero: {f'{len(unsaved)} AveragedModels' if several else 'an AveragedModel'} of the model "
                  f"(an EMA or SWA, {' and '.join(str(n) for n in unsaved)} updates averaged) "
                  f"{'are' if several else 'is'} in no checkpoint: make {'each' if several else 'it'} before "
                  "job.prepare and job.track('ema', ema) so that --resume goes on with the average; a resume makes "
                  f"{'them' if several else 'it'} again from the model, the average started over", flush=True)
    t.train.last_checkpoint, t.train.checkpoint_due = step, False
    t.records.write("checkpoint", epoch=t.train.epoch, step=step, path=str(path),
                    seconds=round(time.perf_counter() - started, 4))


def resume_from_disk(t: Training) -> str:
    """--resume: every rank continues from rank 0's newest checkpoint that loads."""
    found = checkpoint.newest(t.run_dir) if t.is_main else None
    # rank 0 loaded it with weights_only; the others read its bytes the same way (nothing unpickled)
    newest = {"path": str(found[0]) if found else None, "state": found[1] if found else None} if t.is_main else None
    sent = collectives.broadcast_loadable(newest, "hvdhetero.resume")
    path, state = sent["path"], sent["state"]
    if state is None:
        raise ConfigError(f"--resume: no checkpoint in {t.run_dir / checkpoint.FOLDER} loads (the run wrote "
                          "none yet, or they were removed)")
    hosts = t.host_names
    same = state.get("hosts") == hosts
    try:
        restore(t, state, state["rng"][t.rank] if same else None)
    except (RuntimeError, ValueError, KeyError) as err:  # a model or optimizer that changed shape or parts
        raise ConfigError(f"--resume: {path} does not fit what the script builds now ({briefly(err, 2, 300)}): the"
                          " script's model or optimizer changed since the checkpoint. A resume continues the "
                          "same script: put it back as it was, or start a new run") from None
    # what the run wrote after it is redone; the record of this checkpoint, written after its state, stays
    t.records.truncate(state["metrics_offset"], keep=lambda r: r.get("event") == "checkpoint"
                       and r.get("step") == state["step"])
    counted_from = state.get("epochs_from", 0)  # (a checkpoint before it was kept: 0)
    if t.is_main:
        change = "" if same else f"; was {', '.join(state.get('hosts') or '?')}, now {', '.join(hosts)}"
        # as the live line counts; one taken at an epoch's end is after it (the next may be past the run's last)
        epoch = "" if counted_from is None else f"after epoch {t.train.epoch - counted_from}, " if state.get(
            "epoch_done") else f"epoch {t.train.epoch - counted_from + 1}, "
        print(f"hvdhetero: resuming from {path} ({epoch}step {t.train.step}{change})", flush=True)
    return path


def own_loop_went_on(t: Training) -> None:
    """A step after a --resume or an elastic restart (which runs the script again from its top),
    called from the step's reduction until the second one: where the script, now in a loop of its
    own (no job.epochs), neither read job.step or job.epoch in its first iteration nor keeps state
    of its own (job.track), its loop most likely counts from 0 again and trains its whole length
    again; rank 0 says so once. (A heuristic: a read for a log line hides it, a loop that counts
    itself and also reads job.step is not told; it never tells a loop that does go on.)"""
    if t.train.step <= t.resumed_own_loop:  # the first step: its iteration has not ended yet
        return
    at, t.resumed_own_loop = t.resumed_own_loop, None
    if t.is_main and not (t.in_epochs or t.place_read or t.script_tracks):
        print(f"hvdhetero: the job went on from step {at} (a --resume, or --elastic's restart of the script), and the "
              "script's own loop (no job.epochs) read neither job.step nor job.epoch: one that counts from 0 again "
              f"trains its whole length again, {at} steps more than asked. Count it by the job's place: `while "
              "job.step < max_steps:` for a loop over steps, `for epoch in job.epochs(n):` for one over passes, or "
              "keep its own counter with job.track (docs/api.md)", flush=True)
