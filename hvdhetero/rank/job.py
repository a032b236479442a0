"""The Job behind the public API: what a training script talks to inside each rank.

    job = hh.init()
    model = Net().to(job.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    model, optimizer, loader = job.prepare(model, optimizer, train_set, global_batch=512)
    for epoch in job.epochs(20):
        for x, y in loader:                 # this rank's balanced share, on job.device
            with job.autocast():
                loss = F.cross_entropy(model(x), y)
            job.backward(loss)              # weighted exact reduction across ranks
            optimizer.step(); optimizer.zero_grad()
        job.log(loss=loss.item())
    job.save(model.state_dict(), "model.pt")

Behind those names: the balancer sizes each rank's share by its measured speed, the sampler
deals every epoch out once, the loader cuts a share into micro-batches, `backward` accumulates
them and on the step's last chunk reduces every gradient weighted by n_i / sum(n) (overlapped
with backward, fp16 on the wire if asked, loss-scaled if fp16), and the optimizer returned by
`prepare` steps once per global step and skips a step whose gradients overflowed anywhere.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import horovod.torch as hvd
import torch

from hvdhetero.config import JobConfig, check_sync
from hvdhetero.errors import ConfigError
from hvdhetero.rank import autosync, checkpoint, elastic, evaluation, host, precision, records, resume, validate
from hvdhetero.policy.balancer import Balancer
from hvdhetero.rank.calibrate import ProbeLoss, fallback_message, probe_error, split_from, timings, unchanged
from hvdhetero.rank.loader import Item, Loader
from hvdhetero.rank.optimizer import JobOptimizer
from hvdhetero.rank.records import RunRecords
from hvdhetero.rank.registry import PerRank, Registry, Scheduler, TrainState
from hvdhetero.rank.reducer import Reducer, average_buffers, broadcast_state
from hvdhetero.rank.sampler import WeightedBatchSampler
from hvdhetero.rank.step import micro_batch_for
from hvdhetero.rank.step_state import OncePerStep, StepState
from hvdhetero.rank.strategy import EveryStep, Rounds
from hvdhetero.rank.sync import ParameterSync


class Job:
    """One rank's view of the job. Create it with `hvdhetero.init()`."""

    def __init__(self, config: JobConfig, pin: bool = True):
        self.config = config
        self._host = host.settings(config.hosts)
        host.join(self._host, pin=pin)
        self.rank, self.size, self.local_rank = hvd.rank(), hvd.size(), hvd.local_rank()
        self.is_main = self.rank == 0
        self.me = host.make_rank(self._host, config.slowdown)
        self.device: torch.device = self.me.device.torch_device
        """Where this rank computes: move the model there before `prepare`."""
        self.precision = precision.resolve(config.precision, self.me.device.name)
        self.loss_scale = precision.LossScale() if self.precision.scaled else None
        self.run_dir = Path(config.run_dir)
        self.train = TrainState()
        """Where the job is (step, epoch, the checkpoints' and commits' steps: rank/registry.py)."""
        self.parts = Registry()
        """What a checkpoint or a commit holds, by name (filled by prepare; rank/registry.py)."""
        self.records = RunRecords(self.run_dir, self.is_main, config.tensorboard,
                                  report_progress="HOROVOD_RANK" in os.environ, step=lambda: self.step,
                                  who=(self.rank, records.host_name(self._host), self.me.device.describe(),
                                       self.size),
                                  started=elastic.active().started if self._elastic else None)
        """metrics.jsonl, TensorBoard, the live table's lines and the epoch's counters (rank/records.py)."""
        self._prepared = None
        self.step_state = StepState()
        """Where this rank is inside a step (rank/step_state.py): shared with the prepared optimizer and scheduler."""
        self._began = (0.0, 0.0, 0.0)  # wall start, busy start, slept
        self.strategy: EveryStep | Rounds = EveryStep(None, overlap=False)
        """How the ranks' models stay one (rank/strategy.py): step sync until prepare says otherwise."""
        self._epochs = 1
        self._in_epochs = False
        """Whether job.epochs is iterating: only there do overlapped rounds end with the epochs."""
        self._tracked = Registry()
        """job.track(name, obj): the script's own state in every checkpoint."""
        self._checkpoint_every = 0
        """Steps between periodic checkpoints (0: only at epochs' ends)."""
        self._stopping = False
        self.last_step_seconds = (0.0, 0.0)
        """This rank's last step: (compute incl. data and straggling, reduce incl. waiting)."""
        torch.manual_seed(config.seed)

    # -- what a script calls ------------------------------------------------------------------

    def prepare(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, dataset, *, global_batch: int,
                collate_fn: Callable | None = None, num_workers: int = 0, loss_fn: Callable | None = None,
                scheduler=None):
        """Make every rank start from rank 0's model and optimizer state, size each rank's share
        of `global_batch` by its measured speed, and return (model, optimizer, loader).

        `loss_fn(model, batch) -> loss` is how calibration times your real step before training;
        without it, a probe calls the model as training loops do (`model(batch[0])` for a tuple,
        `model(**batch)` for a dict whose keys forward takes, ...: calibrate.ProbeLoss) and
        backpropagates its loss or outputs; if any rank's probe fails, the ranks start from an
        equal split and balance from the first steps' timings instead.

        With micro-batches the loader yields a step's share in chunks and the optimizer steps on
        the last; an LR scheduler you step every batch must be passed as `scheduler=` so that it
        too steps once per global step (one stepped per epoch needs nothing)."""
        if self._prepared is not None:
            raise ConfigError("job.prepare() was already called: one model, optimizer and dataset per job")
        validate.prepare_arguments(model, optimizer, dataset, global_batch, self.device, self.size)
        broadcast_state(model, optimizer)
        cfg = self.config
        reducer = Reducer(model.parameters(), cfg.compression, overlap=cfg.overlap)
        probe = loss_fn or ProbeLoss()
        with unchanged(model):
            largest = min(global_batch, self.me.max_batch or global_batch)
            big = min(global_batch, len(dataset))
            measured, error = None, ""
            # the chunk size if tuning it fails: the setting's, else whole shares
            self.me.micro_batch = (int(cfg.micro_batch) or None) if cfg.micro_batch.isdigit() else None
            try:  # the user's model on the user's batches: whatever it raises, the job goes on
                self.me.micro_batch = micro_batch_for(cfg.micro_batch, model, dataset, self.me, largest,
                                                      probe, collate_fn)
                if not cfg.equal_split:
                    measured = timings(model, dataset, self.me, max(1, big // 4), big, probe, collate_fn)
            except Exception as err:  # noqa: BLE001 - any error of the user's model in a probe
                measured, error = None, probe_error(err)
            failed = hvd.allgather_object(error, name="hvdhetero.probe")
            caps = hvd.allgather_object(self.me.max_batch, name="hvdhetero.caps")
            balancer = Balancer(global_batch, self.size, caps=caps, merges=cfg.inner_steps == "by-speed")
            if measured is not None and not any(failed):
                split_from(balancer, model, dataset, self.me, *measured, loss_fn=probe, collate_fn=collate_fn)
        if any(failed) and self.is_main:
            print(fallback_message(failed, loss_fn is not None), flush=True)
        kind, every = check_sync(cfg.sync)
        overlap_sync, inner = cfg.overlap_sync, cfg.inner_steps
        if cfg.plan_only or kind == "auto":
            kind, every, overlap_sync, inner = autosync.choose(self, balancer, model, probe_failed=any(failed))
            if inner == "by-speed":  # the split balanced for merged steps, as the plan predicted it
                balancer.merges, balancer.merge_limit = True, every
                balancer.calibrate(balancer.overhead, balancer.seconds_per_sample)
        sampler = WeightedBatchSampler(len(dataset), balancer.split, self.rank, seed=cfg.seed, min_share=1)
        loader = Loader(dataset, sampler, self.device, self.me.micro_batch, collate_fn, num_workers,
                        on_item=self._on_item, epoch=lambda: self.epoch, before_step=self._before_step,
                        group=self._merged if inner == "by-speed" else None)
        wrapped = JobOptimizer(optimizer, self.step_state, before_step=self._stepped, after_step=self._after_step)
        if scheduler is not None:  # the user steps their own object: its step goes through the state
            scheduler.step = OncePerStep(scheduler.step, self.step_state)
        if kind != "step":
            # The balancer hears once a round, a mean of H steps: it may decide at every hearing
            # (at its default of every 5th, a K=12 job at H=4 spent 60 steps unbalanced).
            balancer.interval = 1
            # ...and each hearing is the mean of H steps: the steps a settled split needs before a
            # small, sustained imbalance is corrected count as rounds (20 rounds of 32 steps held a
            # 12x-slower rank 9% behind for the whole benchmark).
            balancer.settle = max(3, -(-balancer.settle // every))
        self.strategy = EveryStep(reducer, cfg.overlap) if kind == "step" else Rounds(
            ParameterSync(model, kind, every, global_batch, cfg.compression, cfg.outer_lr, cfg.outer_momentum,
                          overlap_sync), on_exchange=self._exchanged)
        if kind != "step" and inner == "by-speed":
            balancer.merge_limit = every
            if num_workers:  # workers draw 2 chunks each ahead, and a chunk may hold H steps
                loader.lag = 2 * num_workers * every
        self._prepared = _Prepared(model, wrapped, loader, reducer, balancer, sampler)
        self.parts = Registry(model=model, optimizer=PerRank(optimizer, self.rank),
                              scheduler=Scheduler(scheduler) if scheduler is not None else None,
                              loss_scale=self.loss_scale, sync=self.strategy, tracked=self._tracked)
        self._host_names = hvd.allgather_object(records.host_name(self._host),
                                                name="hvdhetero.host_names")
        """Per rank: its inventory host (checkpoints record them; a resume compares)."""
        # --elastic after a reset (or joining): the last commit, from memory; else --resume's checkpoint
        resumed = elastic.rejoin(self) if self._elastic else None
        if resumed is None and cfg.resume:
            resumed = resume.resume_from_disk(self)
        timed = not (cfg.equal_split or any(failed))  # else the step time is unknown until an epoch ends
        self._set_checkpoint_interval(balancer.step_time(balancer.split) if timed else 0.0)
        self._start_log(balancer, resumed)
        if self._elastic:
            elastic.commit(self, check_hosts=False)
        return model, wrapped, loader

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of this chunk's loss (the mean over the batch the loader gave), then, on the
        step's last chunk, the weighted exact reduction of every gradient across ranks."""
        item, p = self.step_state.item, self._prepared
        if p is None or item is None:
            raise RuntimeError("job.backward() needs a batch from the loader that job.prepare() returned")
        self.records.loss(float(loss.detach()), item.n)
        scale = item.n / item.share if item.chunks > 1 else 1.0
        if self.loss_scale is not None:
            scale *= self.loss_scale.scale
        weight = item.share / sum(item.sizes)
        unscale = 1.0 / self.loss_scale.scale if self.loss_scale is not None else 1.0
        if item.last:
            self.strategy.before_last_backward(weight * unscale)
        (loss * scale if scale != 1.0 else loss).backward()
        if not item.last:
            self.step_state.backward_done(last=False)
            return
        self.me.device.synchronize()
        began, busy0, slept = self._began
        self.me.finish_step(item.share, self.me.busy_clock()() - busy0, time.perf_counter() - began, slept)
        seconds = time.perf_counter() - began
        # Step sync: each rank's step time rides along with the gradients, and every rank gets all
        # of them. local:H / diloco:H: this rank steps on its own gradient, unscaled here, and skips alone.
        times, reduce_s, overflowed = self.strategy.reduce(weight, unscale, seconds, self.loss_scale is not None)
        self.last_step_seconds = (seconds, reduce_s)
        self.step_state.backward_done(last=True, overflowed=overflowed)
        if self.loss_scale is not None:
            self.loss_scale.update(overflowed)
        self.records.step_done(item.share, *self.last_step_seconds)
        if times is not None:
            self._rebalance(times, list(item.sizes), item)
        self._report(item)

    def _report(self, item: Item) -> None:
        """This rank's step for the launcher's live table (RunRecords.progress)."""
        p = self._prepared
        self.records.progress(samples=item.share, compute_s=self.last_step_seconds[0],
                              wait_s=self.last_step_seconds[1],
                              exchanged=(self.strategy.rounds, self.strategy.last_exchange_s),
                              split=p.sampler.batch_sizes,  # the split in effect (an epoch's short last step aside)
                              step=item.step % len(p.loader) + 1, steps=len(p.loader), epoch=self.epoch,
                              epochs=self._epochs)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor | None:
        """Clip the reduced gradients to `max_norm`, identically on every rank (the norm comes from
        the reduced CPU buffers, the same bytes everywhere). Returns the norm before clipping;
        None between the micro-batches of a step (nothing is reduced yet)."""
        p = self._prepared
        if p is None or self.step_state.accumulating or not self.step_state.reduced:
            return None
        return self.strategy.clip(max_norm, norm_type)

    def autocast(self):
        """The device's mixed precision when the job's --precision asks for it; else nothing."""
        return self.precision.autocast()

    def epochs(self, n: int):
        """The epoch numbers 0..n-1; each ends with every rank's training loss and speed in the
        metrics and BatchNorm-style buffers averaged across ranks. After the last, the run's end
        record (every rank's parameter digest) is written."""
        if n < 1:
            raise ConfigError(f"job.epochs(n) needs n >= 1, got {n}")
        self._epochs = n
        self._stopping = False
        if self.train.start_epoch >= n and self.is_main and not self._elastic:
            print(f"hvdhetero: the run had finished its {n} epochs at its newest checkpoint; nothing left to train",
                  flush=True)
        self._in_epochs = True  # overlapped rounds end with the epochs (RoundClock.due)
        try:
            for epoch in range(self.train.start_epoch, n):
                self.epoch = epoch
                self.records.begin_epoch()
                yield epoch
                self._end_epoch()
                if self._stopping:
                    break
        finally:
            self._in_epochs = False
        self._end()

    def stop(self) -> None:
        """End training after this epoch (early stopping): `job.epochs` yields no more and
        writes the run's end record. Every rank must decide alike: decide on what every rank
        sees the same, such as `job.evaluate`'s sums."""
        self._stopping = True

    def track(self, name: str, obj) -> None:
        """Save `obj.state_dict()` in every checkpoint and `obj.load_state_dict(...)` it on
        --resume (an EMA of the weights, a GradScaler of your own, a data iterator's position).
        Call it before job.prepare, which resumes; its state must be tensors and plain values."""
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise ConfigError(f"job.track({name!r}, ...) needs an object with state_dict() and load_state_dict()")
        if self._prepared is not None:
            raise ConfigError(f"job.track({name!r}, ...) after job.prepare: call it before, which restores it on "
                              "--resume")
        self._tracked.add(name, obj)

    def log(self, **scalars) -> None:
        """Record scalars (numbers or one-element tensors) in metrics.jsonl (rank 0), with the
        epoch and step; the last ones also go into the run's end record."""
        values = {k: (v.item() if isinstance(v, torch.Tensor) else v) for k, v in scalars.items()}
        self.records.log(self.epoch, self.step, values)

    @property
    def step(self) -> int:
        """Global optimizer steps taken so far (the same on every rank; with --inner-steps by-speed
        only at round and epoch ends: a merging rank's step jumps over the steps it merged)."""
        return self.train.step

    @step.setter
    def step(self, value: int) -> None:
        self.train.step = value

    @property
    def epoch(self) -> int:
        """The epoch in progress (job.epochs sets it)."""
        return self.train.epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        self.train.epoch = value

    @property
    def sync(self) -> str:
        """The sync mode in use: step, local:H or diloco:H (--sync auto as the plan chose; step
        before prepare)."""
        return self.strategy.name

    def evaluate(self, fn: Callable, dataset, *, batch_size: int = 256, collate_fn: Callable | None = None,
                 exchange: bool = True) -> dict:
        """Run `fn(batch) -> {name: sum}` over `dataset`, each rank on a disjoint part (sized by
        its speed), the prepared model in eval mode; returns every name's sum over all ranks.

        With --sync local/diloco the ranks' models differ between exchanges. By default the
        round in flight and the partial one are exchanged first, at once (one exchange not
        behind compute: `invoke plan` says what it costs); `exchange=False` evaluates the global
        model as of the last exchange that landed instead (what DiLoCo evaluates), with nothing
        but the sums on the link, and every rank trains on from its own model after. That model
        lacks the last rounds (1..2 overlapped, 0..1 not): use it to watch a run, and the
        default where the current model matters. Under step sync both are the one model."""
        return evaluation.evaluate(self, fn, dataset, batch_size, collate_fn, exchange)

    def barrier(self) -> None:
        """Wait until every rank gets here."""
        hvd.barrier()

    def save(self, obj, name: str) -> Path:
        """Rank 0 writes `obj` (a state dict or anything torch.save takes) to the run directory,
        atomically; every rank gets the path."""
        self.strategy.one_model(self.step)
        if self._prepared is not None:
            average_buffers(self._prepared.model)
        path = self.run_dir / name
        if self.is_main:
            checkpoint.save_object(obj, path)
        return path

    # -- called by the loader and the optimizer --------------------------------------------------

    def _before_step(self, item: Item) -> None:
        """The loader is about to hand out a step's first batch: a periodic checkpoint due is taken
        now (every rank at the same step)."""
        if self.train.checkpoint_due:
            resume.save_checkpoint(self, epoch_done=False)
        if self._elastic and self.step - self.train.last_commit >= self.config.commit_every and self._round_start:
            elastic.commit(self)

    def _on_item(self, item: Item) -> None:
        """The loader hands out a chunk: the first of a step starts its clock (after straggling)."""
        self.step_state.chunk_given(item)
        if item.chunk == 0:
            slept = self.me.straggle(item.share)
            self._began = (time.perf_counter() - slept, self.me.busy_clock()(), slept)

    def _stepped(self) -> bool:
        """The prepared optimizer asks whether to step: not when the step's reduced gradients
        overflowed (every rank skips alike). Called only once a step's last micro-batch is in
        (the prepared optimizer does nothing between them)."""
        state = self.step_state
        if self._prepared is not None and state.item is not None and not state.reduced:
            raise RuntimeError("optimizer.step() without job.backward(loss) since the last step: call "
                               "job.backward(loss) instead of loss.backward(), or the ranks' gradients are "
                               "never reduced and their models drift apart")
        state.reduced = False
        state.updates += 1
        self.step += state.item.steps if state.item is not None else 1
        return not state.skip

    def _after_step(self) -> None:
        """The prepared optimizer stepped (or skipped): with --sync local/diloco, count the step
        and, at a round's end, exchange parameters (rank/strategy.py); a checkpoint may be due."""
        item = self.step_state.item
        round_ended = self.strategy.always_one_model if item is None else self.strategy.after_step(
            item.share, self.last_step_seconds[0], item.steps, self.step, item.step, self._epoch_left(item))
        # Taken when the next step begins: after this step's scheduler.step(), the script's
        # job.log and whatever else it does between steps (the loader's before-hook). With
        # local/diloco only once a round has ended: mid-round its flush would expose an exchange,
        # shift the rounds, and a rank merging steps (--inner-steps by-speed) is not at a step
        # boundary the others share.
        if self._checkpoint_is_due() and round_ended:
            self.train.checkpoint_due = True

    def _checkpoint_is_due(self) -> bool:
        return bool(self._checkpoint_every) and self.step - self.train.last_checkpoint >= self._checkpoint_every

    def _rebalance(self, times: list[float], sizes: list[float], item: Item, after_step: int | None = None) -> None:
        """Every rank's step seconds (and the samples they took) to the balancer; a new split
        reaches the loader (and the metrics) for the step it takes effect at."""
        p = self._prepared
        if self.config.equal_split:
            return
        new = p.balancer.observe(times, sizes, step=item.step)
        if new:
            at = item.step if after_step is None else after_step
            self.records.write("split", step=p.loader.resplit(new, at), split=new, reason=p.balancer.reason,
                               fallback=p.balancer.fallback)

    def _epoch_left(self, item: Item) -> int | None:
        """Steps of the epoch left after `item`'s, in the loader's numbering (None: outside job.epochs)."""
        steps = len(self._prepared.loader) if self._prepared and self._in_epochs else 0
        return (self.epoch + 1) * steps - 1 - item.step if steps else None

    def _merged(self, step: int, left: int) -> int:
        """The loader's group: --inner-steps by-speed merges steps (Rounds.merge)."""
        sizes = self._prepared.sampler.batch_sizes
        return self.strategy.merge(step, left, sizes[self.rank], max(sizes), self._in_epochs, self.me.max_batch)

    def _exchanged(self, sync: ParameterSync, landed: tuple[list[float], list[float]] | None, after_step: int,
                   count: bool = True) -> None:
        """Rounds.on_exchange, after a round's end or a flush: its record in the metrics, and the
        round that landed (every rank's mean step seconds and samples per step in it) to the
        balancer. `count`: its seconds go to this epoch's communication time."""
        item, p = self.step_state.item, self._prepared
        if item is None:
            return
        if count:
            self.records.communicated(sync.last_exchange_s)
        self.records.write("exchange", step=self.step, round=sync.rounds, applied=sync.applied,
                           split=list(p.sampler.batch_sizes), seconds=round(sync.last_exchange_s, 4),
                           wait_s=round(sync.wait_s, 4), link_late=sync.link_late, inner_steps=sync.inner_steps)
        if landed is not None:
            self._rebalance(*landed, item, after_step)

    # -- metrics ---------------------------------------------------------------------------------

    def _start_log(self, balancer: Balancer, resumed: str | None = None) -> None:
        gathered = {k: hvd.allgather_object(v, name=f"hvdhetero.start.{k}") for k, v in {
            "hostnames": socket.gethostname(), "devices": self.me.device.describe(),
            "slowdowns": self.me.slowdown, "micro_batches": self.me.micro_batch,
            "precision": self.precision.note or str(self.precision.dtype or "float32")}.items()}
        self.records.write("start", config=asdict(self.config), ranks=self.size, **gathered,
                           host_names=self._host_names,
                           **({"resumed_from": resumed, "step": self.step} if resumed else {}),
                           overhead_s=balancer.overhead, seconds_per_sample=balancer.seconds_per_sample)
        self.records.write("split", epoch=0, step=0, split=balancer.split, reason=balancer.reason,
                           fallback=balancer.fallback)
        if self.precision.note:
            print(f"hvdhetero: rank {self.rank}: {self.precision.note}", flush=True)

    def _end_epoch(self) -> None:
        self.strategy.pause()
        steps = max(1, len(self._prepared.loader)) if self._prepared else 1
        stats, step_s = self.records.epoch_stats(self.size, steps)
        if self._prepared is not None:
            average_buffers(self._prepared.model)
        self.records.write("epoch", epoch=self.epoch, **stats,
                           split=self._prepared.sampler.batch_sizes if self._prepared else None,
                           skipped_steps=self.loss_scale.skipped if self.loss_scale else 0, step=self.step)
        if self._prepared is not None:
            self._set_checkpoint_interval(step_s[0])
            # local/diloco: not every epoch (its flush would expose one exchange an epoch), only when due
            if self.strategy.always_one_model or self.train.checkpoint_due or self._checkpoint_is_due():
                resume.save_checkpoint(self, epoch_done=True)
            if self._elastic and self._round_start:
                elastic.commit(self, epoch_done=True)
            # Overlapped, a round of H steps or more ends with the epoch, its exchange launched
            # after the epoch's collectives (RoundClock.ends_with_epoch); what that blocked counts in the
            # next epoch
            more = not self._stopping and self.epoch + 1 < self._epochs
            self.records.carried = self.strategy.end_epoch(self.step, more)

    # -- checkpoints (rank/resume.py takes and restores them; rank/checkpoint.py has the files' rules)

    def _set_checkpoint_interval(self, step_s: float) -> None:
        """Steps between periodic checkpoints: --checkpoint-every, or --checkpoint-minutes at
        `step_s` a step (the same number on every rank), whichever is sooner."""
        cfg = self.config
        by_time = round(cfg.checkpoint_minutes * 60 / step_s) if cfg.checkpoint_minutes and step_s > 0 else 0
        every = [n for n in (cfg.checkpoint_every, max(1, by_time) if by_time else 0) if n]
        self._checkpoint_every = min(every) if every and cfg.keep_checkpoints else 0

    @property
    def _round_start(self) -> bool:
        """Whether a commit may be taken now: always under step sync; with local/diloco only
        between rounds (every rank at the same step, none of its round unexchanged), so that a
        reset restarts a round from a state every rank agrees on (rank/elastic.py)."""
        return self.strategy.between_rounds

    @property
    def _elastic(self) -> bool:
        """Under --elastic, launched by the runner (which keeps the commits across resets)."""
        return self.config.elastic and elastic.active() is not None

    def close(self) -> None:
        """An elastic reset drops this Job: its files close (the next Job opens them again)."""
        self.records.close()

    def _end(self) -> None:
        self.strategy.one_model(self.step)
        model = self._prepared.model if self._prepared else None
        digest = evaluation.param_digest(model) if model is not None else ""
        digests = hvd.allgather_object(digest, name="hvdhetero.digests")
        self.records.end(digests)


class _Prepared:
    def __init__(self, model, optimizer, loader, reducer, balancer, sampler):
        self.model, self.optimizer, self.loader = model, optimizer, loader
        self.reducer, self.balancer, self.sampler = reducer, balancer, sampler
