"""A prepared job: the parts `job.prepare` made, and what one training step does with them.

    training = Training(config, me, records, ..., model=model, begun=begun, mode=(kind, H, ...))
    loader yields an Item   -> on_item (the step's clock), before_step (a checkpoint or commit due)
    job.backward(loss)      -> backward (rank/backward.py): on the last chunk the strategy reduces
    optimizer.step()        -> stepped (skip after an overflow), after_step (the round's end,
                               a checkpoint due)
    job.epochs' epoch ends  -> end_epoch (the epoch's record, checkpoint, commit, the end exchange)

The Job (rank/job.py) is the façade a script talks to; rank/resume.py, rank/elastic.py and
rank/evaluation.py are given this object (its parts, not the Job). What the ranks share in a
step is in `step_state` (rank/step_state.py); how their models stay one is `strategy`
(rank/strategy.py); where the job is, `train` (rank/registry.py's TrainState), and where a loop
over the loader stands, pass by pass, `passes` (rank/passes.py). What job.backward does is
rank/backward.py; what a step's end does with its seconds (records, balancer, the verdict
against one rank alone), rank/step_end.py; what a pass over the loader does as it begins and
ends (under a loop of the script's own, the epoch's record), rank/pass_end.py; the parameters
followed as the script changes what trains, rank/trainable.py.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import horovod.torch as hvd
import torch

from hvdhetero.config import JobConfig
from hvdhetero.policy.alone import AloneWatch
from hvdhetero.policy.checkpoints import CheckpointSchedule
from hvdhetero.rank import averaging, batches, collectives, elastic, resume, scaler
from hvdhetero.rank import backward, pass_end, step_end, trainable
from hvdhetero.rank.accumulation import Accumulation
from hvdhetero.rank.batch_function import BatchFunction, NextBatch
from hvdhetero.rank.counting import Counting
from hvdhetero.rank.deferral import Deferral
from hvdhetero.rank.positions import Positions
from hvdhetero.rank.loader import Item, Loader
from hvdhetero.rank.optimizer import JobOptimizer, mean_over_ranks
from hvdhetero.rank.passes import Passes
from hvdhetero.rank.records import RunRecords
from hvdhetero.rank.reducer import Reducer
from hvdhetero.rank.registry import PerRank, Registry, Scheduler, TrainState
from hvdhetero.rank.replicas import Replicas, Told
from hvdhetero.rank.sampler import WeightedBatchSampler
from hvdhetero.rank.start import Begun
from hvdhetero.rank.worker import Worker
from hvdhetero.rank.step_state import StepState
from hvdhetero.rank.turns import InTurn
from hvdhetero.rank.strategy import EveryStep, Rounds
from hvdhetero.rank.validate import Data
from hvdhetero.rank.sync import ParameterSync

class Training:
    """One rank's prepared job: model, optimizer, loader, balancer, strategy and records, and the
    hooks the loader and the optimizer call."""

    def __init__(self, config: JobConfig, me: Worker, records: RunRecords, train: TrainState, step_state: StepState,
                 loss_scale, *, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], reducer: Reducer,
                 data: Data, begun: Begun, mode: tuple[str, int, bool, str], schedulers: list, tracked: Registry,
                 device: torch.device):
        self.config, self.me, self.records, self.train, self.step_state = config, me, records, train, step_state
        self.loss_scale = loss_scale
        self.rank, self.size = hvd.rank(), hvd.size()
        self.is_main, self.run_dir = self.rank == 0, Path(config.run_dir)
        kind, every, overlap_sync, inner = mode
        self.model, self.balancer = model, begun.balancer
        self.reducer = reducer
        # every rank takes part in an epoch's short last step, with BatchNorm two samples at least: a
        # 1,400-sample epoch at batch 233 ends in 2 samples, which one device runs and two ranks got as 1 + 1
        self.sampler = WeightedBatchSampler(len(data.dataset), self.balancer.split, self.rank, seed=config.seed,
                                            shuffle=data.shuffle, drop_last=data.drop_last, draw=data.draw,
                                            own=data.own, min_share=batches.fewest_samples(model))
        self.passes = Passes(train)
        """Where a loop over the loader stands, pass by pass (rank/passes.py)."""
        self.loader = Loader(data.dataset, self.sampler, device, me.micro_batch, data.collate_fn, data.num_workers,
                             worker_init_fn=data.worker_init_fn, persistent_workers=data.persistent_workers,
                             prefetch_factor=data.prefetch_factor, on_item=self.on_item,
                             busy=lambda: self.me.busy_clock()(),
                             epoch=lambda: self.passes.epoch(self.in_epochs), before_step=self.before_step,
                             group=self.merged if inner == "by-speed" else None)
        self.sampler.first_draw()  # a sampler of the script's own: its count of steps an epoch, from what it draws
        self.loader.fewest = self.sampler.min_share
        self.accumulation = Accumulation(self.loader, me.micro_batch, auto=config.micro_batch == "auto",
                                         is_main=self.is_main, batch_norm=self.sampler.min_share > 1,
                                         whole=lambda step: records.write(
                                             "micro_batches", step=self.counted(step), micro_batches=None,
                                             reason="the script accumulates over batches of its own: whole shares"))
        """auto's chunks once the script stepped at its first step's end, whole shares where it accumulates."""
        called = data.dataset if isinstance(data.dataset, BatchFunction) else None
        if called:
            called.positions = Positions(called.fn, tracked.parts.values())
        self.batches: Loader | NextBatch = NextBatch(self.loader, step_state, model) if called else self.loader
        """What job.prepare returns: the loader, or for a batch function of the script's the function."""
        self.passes.loader, self.passes.one_pass = self.loader, called is not None
        if not called:
            self.loader.began = functools.partial(pass_end.begins, self)
            self.loader.after_pass = functools.partial(pass_end.ended, self)
            self.loader.backed = lambda: self.passes.backed
            self.loader.calls = lambda: self.backwards
            self.loader.left = functools.partial(pass_end.left, self)
            self.loader.again = lambda: self.passes.again
        self.optimizers = [JobOptimizer(o, step_state, before_step=functools.partial(self.stepped, index),
                                        after_step=self.after_step, mean_loss=self.mean_loss, flush=self.flush)
                           for index, o in enumerate(optimizers)]
        """The prepared optimizers: one, or several stepped in turn within each global step (a GAN's)."""
        self.optimizer = self.optimizers[0]
        self.in_turn = InTurn(optimizers, model) if len(optimizers) > 1 else None
        """Several optimizers (a GAN's): each skips on its own overflow, refuses unreduced gradients (rank/turns.py)."""
        self.deferral = Deferral(eligible=kind == "step" and self.in_turn is None and self.size > 1)
        """A script's own accumulation over batches: reduced once a step (rank/deferral.py)."""
        self.deferred_as = (1.0, True, 1.0, False)  # the deferred batches' unscale, common, rescale, overflow check
        scaler.install()  # a GradScaler of the script's own waits for a step's last chunk, counts its skips
        told = Told(records, self.is_main, "step" if kind == "step" else "round's exchange")
        replicas = Replicas(model, optimizers, records.who[2], told.differed, told.settings)
        self.strategy: EveryStep | Rounds = EveryStep(
            self.reducer, config.overlap, replicas
        ) if kind == "step" else Rounds(
            ParameterSync(model, kind, every, data.global_batch, config.compression, config.outer_lr,
                          config.outer_momentum, overlap_sync, settings=replicas),
            on_exchange=functools.partial(step_end.exchanged, self))
        if kind != "step" and inner == "by-speed" and data.num_workers:
            self.loader.lag = 2 * data.num_workers * every  # workers draw 2 chunks each ahead, a chunk may hold H steps
        self.parts = Registry(model=model, optimizer=PerRank(optimizers[0], self.rank),
                              scheduler=Scheduler(schedulers[0]) if schedulers else None,
                              loss_scale=loss_scale, sync=self.strategy, tracked=tracked, batches=called,
                              passes=self.passes)
        for i, optimizer in enumerate(optimizers[1:], start=2):  # a GAN's: step sync, rank 0's state kept
            self.parts.add(f"optimizer_{i}", PerRank(optimizer, self.rank))
        for i, scheduler in enumerate(schedulers[1:], start=2):
            self.parts.add(f"scheduler_{i}", Scheduler(scheduler))
        """What a checkpoint or a commit holds, by name (rank/registry.py)."""
        self.host_names: list[str] = collectives.allgather_object(records.who[1], "hvdhetero.host_names")
        """Per rank: its inventory host (checkpoints record them; a resume compares)."""
        self.schedule = CheckpointSchedule(config.checkpoint_every, config.checkpoint_minutes,
                                           config.keep_checkpoints)
        self.epochs, self.in_epochs, self.epochs_from = 1, False, 0
        """job.epochs' count, and whether it is iterating: only there do overlapped rounds end with the epochs;
        the epoch the live table counts as its first (a loop's range(1, n + 1): 1)."""
        self.loader_offset = 0
        """Inside job.epochs: the loader's step numbers less job.step's (`counted`), set as its loop starts."""
        self.count = Counting(self.is_main)
        """Where the live line says the loop stands in its epoch (rank/counting.py)."""
        self.resumed_own_loop: int | None = None
        """A --resume or an elastic restart past step 0: its step, until the second step after it
        (resume.own_loop_went_on); whether the script read job.step or job.epoch, and whether it
        tracks state of its own."""
        self.place_read, self.script_tracks = False, bool(tracked.parts)
        self.last_step_seconds = (0.0, 0.0)
        """This rank's last step: (compute incl. data and straggling, reduce incl. waiting)."""
        self.step_began = (0.0, 0.0, 0.0)  # the step's wall start, busy start, slept
        self.pass_end: pass_end.Pending | None = None
        """A pass's end held back until the batch its loop still held has trained (rank/pass_end.py)."""
        self.backwards = 0
        """job.backward calls so far: every rank's loop makes them alike (a pass's end waits by them)."""
        self.left_pass = False  # the loop left its last pass early (a break): the next counts afresh
        self.last_wall = 0.0  # the last step's wall seconds, start to start (all included)
        self.loader_at = 0
        """The loader's global steps before the step that begins now, or before the step in hand in
        a loop that fetches one batch ahead (train.step counts optimizer steps: fewer where the
        script accumulates gradients over several batches)."""
        self.grads_scaled = False
        """Whether .grad holds gradients times the job's loss scale (between a step's backward calls)."""
        self.trained: Item | None = None
        """The chunk the last job.backward's loss came from: the one handed out last, or in a loop
        that fetches one batch ahead the one it held (rank/passes.py)."""
        self.unshared: list[torch.nn.Parameter] = []
        """Parameters made inside a step's loop body, given rank 0's values after its reduction."""
        self.alone = AloneWatch()
        """Rank 0's steps against the fastest rank alone (policy/alone.py)."""
        self.slowdowns: list[float] = []
        """Every rank's slowdown on purpose (--slowdown, the inventory's `slowdown:`), as the start record says."""
        self.unstepped = 0
        """Steps reduced (a last chunk's job.backward) since the prepared optimizer last stepped."""
        self.before_steps: torch.Tensor | None = None
        """A few of the first parameter's values as the first of those steps was reduced."""
        self.again_at = -2
        """The last step reduced more than once (two losses backpropagated in turn, a GAN's three): the
        step times the ranks exchange cover its first backward only, no measure of the job against one rank."""

    check_reach = True
    """The next job.backward checks that its loss reaches the job's model (the first, and each
    job.epochs loop's first: rank/reaching.py)."""

    @property
    def one_pass(self) -> bool:
        """The loader draws from a batch function: one endless pass, not one an epoch."""
        return self.passes.one_pass

    @property
    def endless(self) -> bool:
        """The loader draws with no end (a batch function's, minGPT's sampler): the loop ends each pass."""
        return bool(self.sampler.draw and self.sampler.draw.endless)

    @property
    def elastic(self) -> bool:
        """Under --elastic, launched by the runner (which keeps the commits across resets)."""
        return elastic.running(self.config) is not None

    # -- the loader's hooks ------------------------------------------------------------------------

    def on_item(self, item: Item) -> None:
        """The loader hands out a chunk: the first of a step starts its clock (after straggling), as
        far back as the chunk's fetch began (its data is part of the rank's step: Loader.fetched)."""
        self.step_state.chunk_given(item)
        self.passes.handed(item)
        if item.chunk == 0:
            trainable.follow(self, before_forward=True)
            if not self.deferral.pending:  # (what a script's own accumulation left pending stays scaled)
                self.grads_scaled = False  # what .grad holds before the step's first backward: unscaled
            slept = self.me.straggle(item.share)
            (wall, busy), self.loader.fetched = self.loader.fetched, (0.0, 0.0)
            began = time.perf_counter() - slept - wall
            self.last_wall = began - self.step_began[0] if self.step_began[0] else 0.0  # the last step, start to start
            self.step_began = (began, self.me.busy_clock()() - busy, slept)

    def before_step(self, item: Item) -> None:
        """A step's first batch is about to be handed out: a periodic checkpoint due is taken now
        (every rank at the same step), and under --elastic a commit. Either goes on from the step
        that begins now, or, in a loop that fetches one batch ahead (apex's data_prefetcher, timm's
        PrefetchLoader: its pass's first job.backward comes with the next batch handed out already),
        from the step in hand, which has not trained yet (resumed from the batch ahead, it skipped
        one)."""
        if self.passes.ahead and self.passes.outermost:  # (a split moved since may cut a share into chunks now)
            self.accumulation.one_ahead(item)
        begins = self.passes.held or item
        self.loader_at = begins.step - begins.steps + 1  # loader steps, not optimizer steps (a script may accumulate)
        self.accumulation.step_begins(item, self.unstepped)
        if self.train.checkpoint_due:
            resume.save_checkpoint(self, epoch_done=False)
        if (self.elastic and self.train.step - self.train.last_commit >= self.config.commit_every
                and self.strategy.between_rounds):
            elastic.commit(self)

    def merged(self, step: int, left: int) -> int:
        """The loader's group: --inner-steps by-speed merges steps (Rounds.merge)."""
        sizes = self.sampler.batch_sizes
        return self.strategy.merge(step, left, sizes[self.rank], max(sizes), self.in_epochs, self.me.max_batch)

    # -- job.backward ------------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor, item: Item, **kwargs) -> None:
        """Backward of a chunk's loss (rank/backward.py)."""
        backward.backward(self, loss, item, **kwargs)

    # -- the optimizer's hooks ---------------------------------------------------------------------

    def stepped(self, index: int = 0) -> bool:
        """Prepared optimizer `index` asks whether to step: not when the step's reduced gradients
        overflowed (every rank skips alike; with several optimizers, its own: rank/turns.py).
        Called only once a step's last micro-batch is in (the prepared optimizer does nothing
        between them)."""
        state, turns = self.step_state, self.in_turn
        if state.item is not None and (not (state.reduced or state.stepped) or (turns and turns.unreduced(index))):
            raise RuntimeError("optimizer.step() without job.backward(loss) since the last step: call "
                               "job.backward(loss) instead of loss.backward(), or the ranks' gradients are "
                               "never reduced and their models drift apart")
        self.flush()  # a script's own accumulation that stepped sooner than its last step did
        state.reduced = False
        self.unstepped = 0
        skip = state.skip
        if turns is not None and state.item is not None:  # a GAN's: each optimizer on its own gradients
            skip = turns.overflowed(index)
            if self.loss_scale is not None and (not state.stepped or (skip and not state.skip)):
                self.loss_scale.update(skip)  # once a step: grown after a whole step, backed off once
            state.skip = state.skip or skip
        if state.stepped:  # a GAN's generator after its discriminator: the same global step
            return not skip
        state.updates += 1
        self.accumulation.updated()
        self.deferral.updated()
        self.train.step += (self.trained or state.item).steps if state.item is not None else 1
        state.stepped = turns is not None and state.item is not None
        return not skip

    def flush(self) -> None:
        """What a script's own accumulation left pending, reduced now (rank/backward.py)."""
        backward.flush(self)

    def mean_loss(self, loss):
        """A closure's loss as every rank's optimizer must see it (rank/optimizer.py's mean_over_ranks)."""
        return mean_over_ranks(loss, self.step_state, self.strategy.kind == "step")

    def after_step(self) -> None:
        """The prepared optimizer stepped (or skipped): with --sync local/diloco, count the step
        and, at a round's end, exchange parameters (rank/strategy.py); a checkpoint may be due."""
        item = self.trained or self.step_state.item if self.step_state.item is not None else None
        round_ended = self.strategy.always_one_model if item is None else self.strategy.after_step(
            item.share, self.last_step_seconds[0], item.steps, self.train.step, item.step, self._epoch_left(item))
        # Taken when the next step begins: after this step's scheduler.step(), the script's
        # job.log and whatever else it does between steps (the loader's before-hook). With
        # local/diloco only once a round has ended: mid-round its flush would expose an exchange,
        # shift the rounds, and a rank merging steps (--inner-steps by-speed) is not at a step
        # boundary the others share.
        if self.schedule.due(self.train.step, self.train.last_checkpoint) and round_ended:
            self.train.checkpoint_due = True
        pass_end.settle(self)  # a loop fetching one batch ahead trained the batch its pass's end held

    def counted(self, loader_step: int) -> int:
        """A loader step as the records count steps, job.step's: the loader numbers its steps from
        the loop's first epoch number times its length (range(1, n + 1)'s first step is its length,
        a script that resumed itself at its epoch 2 starts at twice it, its job.step at 0; a record
        at that step came before its epoch's)."""
        return loader_step - (self.loader_offset if self.in_epochs else 0)

    def _epoch_left(self, item: Item) -> int | None:
        """Steps of the epoch left after `item`'s, in the loader's numbering (None: outside job.epochs)."""
        steps = len(self.loader) if self.in_epochs else 0
        return (self.train.epoch + 1) * steps - 1 - item.step if steps else None

    def epoch_record(self) -> list[float]:
        """The epoch's record (a collective: job.epochs' epoch's end, or a pass's end in a loop of the
        script's own); every rank's mean step seconds."""
        return self.records.end_epoch(self.train.epoch, self.train.step, self.size, max(1, self.records.steps),
                                      self.sampler.batch_sizes, self.loss_scale.skipped if self.loss_scale else 0)

    # -- job.epochs --------------------------------------------------------------------------------

    def end_epoch(self, more: bool) -> None:
        """An epoch of job.epochs ended (`more`: another follows): its record, buffers averaged, a
        checkpoint and an elastic commit where due, and overlapped, the round ending with it."""
        pass_end.settle(self, now=True)
        self.strategy.pause()
        step_s = self.epoch_record()
        averaging.buffers(self.model)  # again after the pass's end (rank/pass_end.py): a forward since may move them
        self.schedule.retime(step_s[0])
        ended = self.count.epoch_ended(len(self.loader), self.endless, self.records.steps)
        if ended:  # the live line did not count to the epoch's end: its end marked now
            self.records.progress_ended(ended)
        # local/diloco: not every epoch (its flush would expose one exchange an epoch), only when due
        if (self.strategy.always_one_model or self.train.checkpoint_due
                or self.schedule.due(self.train.step, self.train.last_checkpoint)):
            resume.save_checkpoint(self, epoch_done=True)
        if self.elastic and self.strategy.between_rounds:
            elastic.commit(self, epoch_done=True)
        # Overlapped, a round of H steps or more ends with the epoch, its exchange launched after
        # the epoch's collectives (RoundClock.ends_with_epoch); what that blocked counts in the next epoch
        self.records.carried = self.strategy.end_epoch(self.train.step, more)
