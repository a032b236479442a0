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

The Job is a façade: start-up is rank/start.py, the prepared parts and each step's hooks are
rank/training.py's Training, checkpoints rank/resume.py, evaluation rank/evaluation.py (none of
them imports the Job; docs/layout.md walks one step through them).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import horovod.torch as hvd
import torch

from hvdhetero.config import JobConfig
from hvdhetero.errors import ConfigError
from hvdhetero.policy.balancer import Balancer
from hvdhetero.rank import (averaging, checkpoint, clipping, collectives, current, devices, elastic, epochs,
                            evaluation, gathering, host, precision, preparing, records, reduction, saving,
                            scheduling, zeroing)
from hvdhetero.rank.carry import Carried
from hvdhetero.rank.records import RunRecords
from hvdhetero.rank.registry import Registry, TrainState, Values
from hvdhetero.rank.step_state import StepState
from hvdhetero.rank.strategy import EveryStep, Rounds
from hvdhetero.rank.training import Training

_NOT_OURS = ("job.backward() of a batch that the loader job.prepare() returned did not give (its pass over the epoch "
             "had ended two steps before, or none had begun): a DataLoader of the script's own feeds the loop, so "
             "every rank would train the whole batch, sharing nothing. Loop over the loader job.prepare() returned; "
             "one made anew each epoch (a curriculum's growing subset, pseudo-labels added) goes to job.prepare as a "
             "batch function over it (docs/api.md, 'A dataset that grows')")


class Job:
    """One rank's view of the job. Create it with `hvdhetero.init()`."""

    def __init__(self, config: JobConfig, pin: bool = True):
        self.config = config
        settings = host.settings(config.hosts)
        host.join(settings, pin=pin)
        self.rank, self.size, self.local_rank = hvd.rank(), hvd.size(), hvd.local_rank()
        self.is_main = self.rank == 0
        if config.deterministic:
            devices.deterministic()  # before the device's first kernel (cuBLAS reads its setting then)
        self.me = host.make_rank(settings, config.slowdown)
        self.device: torch.device = self.me.device.torch_device
        """Where this rank computes: move the model there before `prepare`."""
        self.precision = precision.resolve(config.precision, self.me.device.name)
        self.loss_scale = precision.LossScale() if self.precision.scaled else None
        self.autocasts = precision.Watch()
        """Who is inside job.autocast(): a first training forward outside any autocast is said (precision.py)."""
        self.run_dir = Path(config.run_dir)
        self.train_state = TrainState()
        """Where the job is (step, epoch, the checkpoints' and commits' steps: rank/registry.py)."""
        self.records = RunRecords(self.run_dir, self.is_main, config.tensorboard,
                                  report_progress="HOROVOD_RANK" in os.environ, step=lambda: self.train_state.step,
                                  who=(self.rank, records.host_name(settings), self.me.device.describe(), self.size),
                                  started=commits.started if (commits := elastic.running(config)) else None)
        """metrics.jsonl, TensorBoard, the live table's lines and the epoch's counters (rank/records.py)."""
        self.step_state = StepState()
        """Where this rank is inside a step (rank/step_state.py): shared with the prepared optimizer and scheduler."""
        self.strategy: EveryStep | Rounds = EveryStep(None, overlap=False)
        """How the ranks' models stay one (rank/strategy.py): step sync until prepare says otherwise."""
        self.training: Training | None = None
        """The prepared job: its parts and each step's hooks (rank/training.py); None before prepare."""
        self._tracked = Registry()
        """job.track(name, obj): the script's own state in every checkpoint."""
        self._stopping = False
        self._gathers = 0
        """job.gather's calls (the same count on every rank: it names each one's collective)."""
        self._last_norm = torch.tensor(0.0)
        self._carried: Carried | None = None
        """job.carry's state, every row's latest (rank/carry.py)."""
        self.left_epochs: str | None = None
        """The epoch whose loop body the script left early (break), as the loop and the live line number it:
        it has no record, the run's end no digests."""
        self.ended = self.closed = False
        """Whether the run's end record is written; whether `close` ran."""
        if (current.runner_seed is None and not current.plain) or \
                torch.initial_seed() in (current.runner_seed, current.rank_seed):  # (an elastic reset's: prepare's)
            torch.manual_seed(config.seed)  # else the script seeded torch itself (or runs plain): its seed stands

    # -- what a script calls ------------------------------------------------------------------

    def prepare(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, dataset, *,
                global_batch: int | None = None, collate_fn: Callable | None = None, num_workers: int | None = None,
                loss_fn: Callable | None = None, scheduler=None, batch_dim: int | None = None):
        """Make every rank start from rank 0's model and optimizer state, size each rank's share
        of `global_batch` by its measured speed, and return (model, optimizer, loader).

        `dataset`: a map-style dataset with `global_batch=`, or the script's training DataLoader,
        whose dataset, batch_size (as global_batch), shuffle, drop_last, collate_fn, num_workers and
        worker_init_fn are kept (rank/validate.py's data_arguments), or a function that returns one
        step's batch (rank/batch_function.py), its samples along `batch_dim` (1 for [sequence,
        batch] windows).

        `loss_fn(model, batch) -> loss` is how calibration times your real step before training;
        without it, a probe calls the model as training loops do (`model(batch[0])` for a tuple,
        `model(**batch)` for a dict whose keys forward takes, ...: calibrate.ProbeLoss) and
        backpropagates its loss or outputs; if any rank's probe fails, the ranks start from an
        equal split and balance from the first steps' timings instead.

        With micro-batches the loader yields a step's share in chunks and the optimizer steps on
        the last; an LR scheduler on the optimizer steps once per global step too (one stepped
        per epoch is stepped once); pass it as `scheduler=` so that checkpoints hold it.

        A GAN's two models, each with its optimizer: tuples of both, `job.prepare((netG, netD),
        (optD, optG), loader, scheduler=[...])`, each returned as passed; the optimizers step in
        turn within each global step (rank/turns.py), under step sync, in whole shares."""
        if self.training is not None:
            raise ConfigError("job.prepare() was already called: one prepare per job (a GAN's two models, each with "
                              "its optimizer, go in one call: job.prepare((netG, netD), (optG, optD), data)); models "
                              "trained one after another (a teacher, then its student) run as a job each (docs/api.md, "
                              "'Models trained one after another'); two data sources drawn in each step (a labelled "
                              "and an unlabelled loader) go in one batch function (docs/api.md, 'Two data sources in "
                              "one step')")
        return preparing.prepare(self, model, optimizer, dataset, global_batch=global_batch, collate_fn=collate_fn,
                                 num_workers=num_workers, loss_fn=loss_fn, scheduler=scheduler, batch_dim=batch_dim,
                                 tracked=self._tracked)

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """Backward of this chunk's loss (the mean over the batch the loader gave), then, on the
        step's last chunk, the weighted exact reduction of every gradient across ranks. `kwargs`
        go to torch's `loss.backward` (`retain_graph=True` for a second backward through the same
        graph; each call reduces what it added, so two losses backpropagated in turn sum as on one
        device)."""
        item = self.step_state.item
        if self.training is None or item is None or self.step_state.foreign():
            raise ConfigError(_NOT_OURS if self.training is not None else
                              "job.backward() needs job.prepare() first, and a batch from the loader it returned")
        self.training.backward(loss, item, **kwargs)

    def carry(self, state, dim: int = 1):
        """A state the loop carries from step to step for each row of a batch function's steps (an
        LSTM's (h, c) over [sequence, batch] windows), as computed for the rows handed out last:
        returned for the rows in hand, wherever the balancer or micro-batches moved them, detached;
        a row new to this rank starts from zeros (rank/carry.py). `dim`: the rows' dimension in
        the state (1 for nn.LSTM's and nn.GRU's hidden states, batch_first or not)."""
        t, item = self.training, self.step_state.item
        if t is None or not t.one_pass:
            raise ConfigError("job.carry(state) keeps a state for each row of a batch function's steps (job.prepare("
                              "model, optimizer, fn), whose rows go on from step to step); a dataset's samples are "
                              "drawn anew each epoch")
        if item is None:
            raise RuntimeError("job.carry() needs a batch from the function job.prepare() returned")
        if self._carried is None:
            self._carried = Carried(t.batches.loader.dataset.global_batch)
        return self._carried(state, item, dim)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor | None:
        """Clip the reduced gradients to `max_norm`, identically on every rank (the norm comes from
        the reduced CPU buffers, the same bytes everywhere). Returns the norm before clipping;
        between the micro-batches of a step (nothing is reduced yet) the last step's, 0 before the
        first (a loop that logs it every batch, as one-device loops do, gets a number)."""
        if self.training is None or self.step_state.accumulating or not self.step_state.reduced:
            return self._last_norm
        self.training.flush()  # a script's own accumulation, stepping sooner than predicted: reduced first
        self._last_norm = self.strategy.clip(max_norm, norm_type)
        return self._last_norm

    def autocast(self):
        """The device's mixed precision when the job's --precision asks for it; else nothing."""
        return self.autocasts.entered(self.precision)

    def epochs(self, n: int | range, start: int = 0):
        """The epoch numbers start..n-1 (`start`: where a script's own --resume goes on, as
        `range(args.start_epoch, args.epochs)`; a --resume of the job's own goes on from its
        checkpoint's, the later of the two); each ends with every rank's training loss and speed
        in the metrics and BatchNorm-style buffers averaged across ranks. After the last, the
        run's end record (every rank's parameter digest) is written. `n` may be the loop's own
        range, as the script had it (`job.epochs(range(1, args.epochs + 1))`): its numbers, as
        job.epochs(stop, start=its start), the live table counting the range's epochs (1/15 for
        the first of range(1, 16))."""
        given = n
        n, start = epochs.numbers(n, start)
        counted_from = start if isinstance(given, range) else 0
        start = epochs.rank_0s_start(start, self.size, self.is_main)
        self._stopping = False
        first = max(start, self.train_state.start_epoch)
        if first >= n and self.is_main and elastic.running(self.config) is None:
            where = ("at its newest checkpoint" if self.train_state.start_epoch >= n
                     else f"by the script's start epoch ({start})")
            said = f"the epochs of the loop's {given!r}" if isinstance(given, range) else f"its {n} epoch{'s' * (n != 1)}"
            print(f"hvdhetero: the run had finished {said} {where}; nothing left to train", flush=True)
        t = self.training
        if t is not None:  # overlapped rounds end with the epochs (RoundClock.due)
            t.epochs, t.in_epochs, t.epochs_from = n, True, counted_from
            # where the loader's numbering stands against job.step's as the loop starts: its first epoch's
            # first step, or a resumed checkpoint's place in it
            t.loader_offset = 0 if t.one_pass else max(t.loader.start_step, first * len(t.loader)) - t.train.step
            t.check_reach = True  # the loop's first job.backward: its loss must reach the job's model
        said_empty = False  # an epoch that took no step (said once)
        try:
            for epoch in range(first, n):
                self.epoch = epoch
                self.records.begin_epoch()
                try:
                    yield epoch
                except GeneratorExit:  # `break` or `return` out of the loop, or an exception through it
                    # the runner says which, once the script has ended: the number the loop got, the live line's count
                    self.left_epochs = f"{epoch} ({epoch - counted_from + 1}/{n - counted_from} on the live line)"
                    raise
                if t is not None and not self.records.steps and not said_empty:
                    said_empty = True
                    if self.is_main:
                        epochs.took_no_step(epoch, counted_from, n, t.one_pass, t.step_state.item)
                self._end_epoch(more=not self._stopping and epoch + 1 < n)
                if self._stopping:
                    break
        finally:
            if t is not None:
                t.in_epochs = False
        self._end()

    def stop(self) -> None:
        """End training after this epoch (early stopping): `job.epochs` yields no more and
        writes the run's end record. Every rank must decide alike: decide on what every rank
        sees the same, such as `job.evaluate`'s sums. (A loop of the script's own, with no
        job.epochs, ends by a `break` on every rank alike.)"""
        self._stopping = True

    def track(self, name: str, obj) -> None:
        """Save `obj.state_dict()` in every checkpoint and `obj.load_state_dict(...)` it on
        --resume (an EMA of the weights, a GradScaler of your own, a data iterator's position),
        or a dict of the script's own numbers (a running reward, a best score), put back into the
        same dict. Call it before job.prepare, which resumes; its state must be tensors and plain values."""
        if type(obj) is dict:  # (a module's state_dict() is an OrderedDict: loaded back into a copy, not the module)
            obj = Values(name, obj)
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise ConfigError(f"job.track({name!r}, ...) needs an object with state_dict() and load_state_dict(), or "
                              f"a dict of numbers (got a {type(obj).__name__})")
        if self.training is not None:
            raise ConfigError(f"job.track({name!r}, ...) after job.prepare: call it before, which restores it on "
                              "--resume")
        self._tracked.add(name, obj)

    def log(self, **scalars) -> None:
        """Record scalars (numbers or one-element tensors) in metrics.jsonl (rank 0), with the
        epoch and step; the last ones also go into the run's end record."""
        values = {k: (v.item() if isinstance(v, torch.Tensor) else v) for k, v in scalars.items()}
        self.records.log(self.train_state.epoch, self.train_state.step, values)

    @property
    def step(self) -> int:
        """Global optimizer steps taken so far (the same on every rank; with --inner-steps by-speed
        only at round and epoch ends: a merging rank's step jumps over the steps it merged)."""
        if self.training is not None:  # a loop of its own that counts from it goes on where a resume left off
            self.training.place_read = True
        return self.train_state.step

    @property
    def sync_gradients(self) -> bool:
        """Whether the batch the loader handed out last ends its step (its job.backward reduces,
        optimizer.step() updates): True once a step with micro-batches, for what a loop does once
        an optimizer step (an EMA's update); always True without them (accelerate's name)."""
        item = self.step_state.item
        return item is None or item.last

    @property
    def epoch(self) -> int:
        """The epoch in progress: job.epochs sets it; a loop of its own over the prepared loader
        (steps, not epochs) counts its passes that took a step, each dealt in a new order (a pass
        that takes none, as `next(iter(loader))` or rank 0's alone, starts no epoch)."""
        if self.training is not None:  # a loop of passes counted from it goes on where a resume left off
            self.training.place_read = True
        return self.train_state.epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        self.train_state.epoch = value

    @property
    def sync(self) -> str:
        """The sync mode in use: step, local:H or diloco:H (--sync auto as the plan chose; step
        before prepare)."""
        return self.strategy.name

    @property
    def balancer(self) -> Balancer | None:
        """How the shares are sized (after prepare; `.split` is every rank's share now)."""
        return self.training.balancer if self.training is not None else None

    @property
    def mpi_comm(self):
        """mpi4py's COMM_WORLD under pins.backend mpi, for a script's own MPI collectives
        (`job.mpi_comm.allreduce(x)`); None under Gloo."""
        return host.mpi_comm()

    @property
    def last_step_seconds(self) -> tuple[float, float]:
        """This rank's last step: (compute incl. data and straggling, reduce incl. waiting)."""
        return self.training.last_step_seconds if self.training is not None else (0.0, 0.0)

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
        t = self.training
        with collectives.within("job.evaluate()"):
            return evaluation.evaluate(fn, dataset, batch_size, collate_fn, exchange, strategy=self.strategy,
                                       model=t.model if t else None, split=t.balancer.split if t else [1] * self.size,
                                       step=self.train_state.step, device=self.device, autocast=self.autocast)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's rows of `tensor` (computed from this rank's batch, rows along dim 0), in
        rank order, for a loss over the whole global batch (SimCLR's NT-Xent, CLIP's similarity
        matrix): every rank computes that one loss and job.backward(loss) reduces one device's
        gradient of it, whatever the split (rank/gathering.py). Every rank calls it as often, in
        step sync, with each step's share whole (--micro-batch 0)."""
        t, item = self.training, self.step_state.item
        if t is None or item is None:
            raise RuntimeError("job.gather() needs a batch from the loader that job.prepare() returned")
        if item.chunks > 1:
            raise ConfigError(f"job.gather() on a micro-batch (chunk {item.chunk + 1} of {item.chunks}): a loss over "
                              "the whole global batch wants each rank's share whole, and another rank's step may come "
                              "in fewer chunks; run with --micro-batch 0")
        if not self.strategy.always_one_model:
            raise ConfigError(f"job.gather() under --sync {self.sync}: each rank steps on its own gradient there, "
                              "and a loss over the gathered batch is one device's only when the ranks' gradients are "
                              "reduced every step; use --sync step")
        self._gathers += 1
        return gathering.gather(tensor, sum(item.sizes) / item.share, self._gathers)

    def reduce(self, value, op: str = "sum"):
        """`value` (a number, a tensor on any device, or a dict, list or tuple of them) summed over
        the ranks, or their largest or smallest (`op="max"`, `"min"`), returned as it came on every
        rank: a count or a sum over each rank's share of the epoch (running_corrects, a DDP script's
        `dist.all_reduce(t)`) becomes the count over the whole epoch. Call it on every rank alike,
        after the loop over the prepared loader, not inside it (rank/reduction.py)."""
        t, item = self.training, self.step_state.item
        # (a batch function's calls keep one iterator open for the run: its loop is the script's own)
        part = t is not None and t.one_pass and item is not None and not item.last  # a step's chunk, not its last
        reduction.check(op, in_loop=t is not None and not t.one_pass and t.loader.iterating > 0,
                        part_of_step=f"chunk {item.chunk + 1} of its step's {item.chunks}" if part else "")
        with collectives.within("job.reduce()"):
            return reduction.reduce(value, op)

    def barrier(self) -> None:
        """Wait until every rank gets here ("rank 0 downloads, the others wait"): bounded by 6 times
        HVDHETERO_COLLECTIVE_TIMEOUT_S (an hour by default; a download may take long)."""
        collectives.barrier(limit=collectives.patient_timeout_s())

    def save(self, obj, name: str) -> Path:
        """Rank 0 writes `obj` (a state dict or anything torch.save takes) to the run directory,
        atomically; every rank gets the path. Call it on every rank: under local/diloco the ranks
        first make their models one (an exchange), and average BatchNorm-style buffers. Under
        step sync it is no collective (a script's `if job.is_main: job.save(...)`, the DDP habit,
        works): rank 0 writes rank 0's model, which is what a settle would give every rank
        (rank/replicas.py), with its own buffers, as DDP's rank 0 has them; each epoch's end
        averages them (job.epochs), so a save after the loop holds the averaged ones."""
        if not self.strategy.always_one_model:
            with collectives.within("job.save()"):
                self.strategy.one_model(self.train_state.step)
                if self.training is not None:
                    averaging.buffers(self.training.model)
        path = self.run_dir / name
        if self.is_main:
            checkpoint.save_object(obj, path)
        saving.saved(name, path)  # a torch.load(name) after it reads this, not the working folder's (rank/saving.py)
        return path

    def finish(self) -> None:
        """The script returned without job.epochs' end (a loop of its own, a `break`): rank 0's end
        record from what it holds (no digests) and every job.log for the launcher (a sweep's value).
        No collective: a rank that ended early must not wait on the others, who then fail and say so;
        but an overlapped round's exchange that every rank launched lands first (Rounds.land)."""
        if self.training is not None and not self.closed:
            with collectives.within("the script's end"):
                self.strategy.land()
        if self.is_main and self.training is not None and not self.ended and not self.closed:
            self.records.close_window(self.train_state.epoch, self.train_state.step)
            self.records.end(None, self.train_state.step, self._reductions())
            self.ended = True

    def close(self) -> None:
        """An elastic reset drops this Job: its files close (the next Job opens them again)."""
        self.closed = True
        self.records.close()
        if self.training is not None and self.training.one_pass:
            self.training.batches.close()  # the model's forward no longer reaches this job's batches
        clipping.release()  # torch's clip no longer calls this Job's (the next job.prepare takes it over)
        averaging.release()
        zeroing.release()
        scheduling.release()

    def _end_epoch(self, more: bool) -> None:
        if self.training is not None:
            self.training.end_epoch(more)
            return
        # a loop without a prepared job: its record only
        self.records.end_epoch(self.train_state.epoch, self.train_state.step, self.size, 1, None,
                               self.loss_scale.skipped if self.loss_scale else 0)

    def _end(self) -> None:
        """The run's end record: one model on every rank, every rank's parameter digest."""
        self.strategy.one_model(self.train_state.step)
        model = self.training.model if self.training is not None else None
        digest = evaluation.param_digest(model) if model is not None else ""
        digests = collectives.allgather_object(digest, "hvdhetero.digests", "the run's end record")
        self.records.end(digests, self.train_state.step, self._reductions())
        self.ended = True

    def _reductions(self) -> int | None:
        """Step sync: the gradient reductions this run made (Reducer.steps); else None."""
        t = self.training
        return t.reducer.steps if t is not None and t.strategy.kind == "step" else None
