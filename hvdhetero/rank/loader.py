"""The loader `job.prepare` returns: this rank's share of every global batch, on its device.

Each step of an epoch, the sampler hands this rank its share of the global batch (sized by the
balancer); the loader cuts it into micro-batches of at most `chunk` samples, collates each and
moves it to the rank's device. The job learns from `Item`s which chunk of which step the user's
code is working on, so that `job.backward` accumulates, reduces on the step's last chunk, and
knows every rank's sample count for the weights.

With DataLoader workers, batches are collated ahead in other processes: the indices of the next
`prefetch_factor x num_workers` chunks are drawn before the current step has ended. A new split
from the balancer therefore takes effect a fixed number of steps later, the same on every rank
(`lag`), never on a step whose indices some rank already drew: every sample of an epoch is
still seen once, and every rank agrees on every step's sizes.

With `--inner-steps by-speed` (local/diloco only) a rank merges consecutive steps: `group(step,
left)` says how many steps from `step` on (at most `left`, the epoch's rest) this rank takes as
one, and the loader yields their shares together as one step's chunks (`Item.steps` of them).
The global steps, their sizes and every sample's rank stay what they were; only how often the
rank's optimizer steps changes.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from hvdhetero.errors import ConfigError
from hvdhetero.rank import batches
from hvdhetero.rank.sampler import WeightedBatchSampler


@dataclass(frozen=True)
class Item:
    """Where a chunk sits: global step, its place among the step's chunks, this rank's samples
    in the chunk and in the whole step, and every rank's samples in the step."""

    step: int
    """The global step (with merged steps: the last of them)."""
    chunk: int
    chunks: int
    n: int
    share: int
    sizes: tuple[int, ...]
    steps: int = 1
    """Global steps this item's step spans (more than 1 only with merged steps)."""
    indices: tuple[int, ...] = field(default=(), repr=False, compare=False)
    """The chunk's samples: the dataset's indices (a batch function's: rows of its steps, rank/carry.py)."""

    @property
    def last(self) -> bool:
        return self.chunk == self.chunks - 1


class Loader:
    """Iterates one epoch (the job's current one): this rank's chunks, each on the device."""

    def __init__(self, dataset, sampler: WeightedBatchSampler, device: torch.device, chunk: int | None,
                 collate_fn: Callable | None = None, num_workers: int = 0, on_item: Callable | None = None,
                 epoch: Callable[[], int] = lambda: 0, before_step: Callable | None = None,
                 group: Callable[[int, int], int] | None = None, worker_init_fn: Callable | None = None,
                 persistent_workers: bool = False, prefetch_factor: int | None = None,
                 busy: Callable[[], float] = time.perf_counter):
        self.dataset, self.sampler, self.device, self.chunk = dataset, sampler, device, chunk
        self.collate_fn, self.num_workers, self.worker_init_fn = collate_fn, num_workers, worker_init_fn
        self.on_item = on_item or (lambda item: None)
        self.before_step = before_step or (lambda item: None)
        """Called before a step's first chunk is collated (a checkpoint taken there resumes at it)."""
        self.epoch = epoch
        self.again: Callable[[], int] = lambda: 0
        """The passes of this epoch begun before the new one, each after taking a step (a loop that
        takes the loader more than once an epoch: rank/passes.py): each deals an order of its own."""
        self.iterating = 0
        """Loops over this epoch's batches under way, or iterators over them still open (job.reduce
        is refused there: the ranks take different numbers of batches)."""
        self.group = group or (lambda step, left: 1)
        """(first global step, steps left in the epoch) -> how many steps this rank merges."""
        self.prefetch_factor = prefetch_factor or 2  # DataLoader's default
        self.lag = self.prefetch_factor * num_workers
        self.persistent_workers = persistent_workers and num_workers > 0
        self._workers: torch.utils.data.DataLoader | None = None
        """With persistent workers: the one DataLoader whose workers serve every epoch."""
        self._workers_for: _Pass | None = None
        """The pass under way that has those workers (one at a time)."""
        self._pending: list[tuple[int, list[int]]] = []
        self.start_step = 0
        """Resumed: the global steps before this one were taken (their samples are skipped)."""
        self.start_again = 0
        """Resumed inside job.epochs: the pass of its epoch the job went on in (`again`'s count); a
        pass after it in the same epoch deals its steps from the first (each numbered alike)."""
        self.fewest = 1
        """The fewest samples a chunk may hold (batches.fewest_samples: 2 with BatchNorm); a shorter
        last chunk of a step joins the one before."""
        self.after_pass: Callable[[int, bool], None] = lambda began, holding: None
        """Called when a loop has taken every batch of the epoch (not when it left the loop early),
        with what `began()` said as it started and whether the loop holds its last batch, not
        trained yet (it fetches one ahead: it backed some of the pass's batches, not all); every
        rank gets there after the same global step."""
        self.began: Callable[[], int] = lambda: 0
        self.backed: Callable[[], int] = lambda: 0
        """The chunks the job's job.backward calls came from so far, each once (asked as a pass
        begins and ends, and as a chunk is handed out)."""
        self.calls: Callable[[], int] = lambda: 0
        """job.backward calls so far (a chunk's loss backpropagated again is one more)."""
        self.left: Callable[[], None] = lambda: None
        """Called when a loop leaves a pass early (its iterator closed before the epoch's end)."""
        self._live: list[_Pass] = []
        """The passes under way (more than one: a look at a batch inside a pass, or one kept open)."""
        self._twins: list[_Pass] = []
        """The passes that handed out the job's latest chunk: the loop's, and another that handed out
        the same batch before its loss (a look kept open at a pass's first step; the loop after the
        CIFAR-10 tutorial's `dataiter`, left open): the one that hands out again is the loop's."""
        self._latest: tuple[Item | None, int, int] = (None, 0, 0)
        """The job's latest chunk, and `backed()` and `calls()` as it was handed out."""
        self.busy = busy
        """The rank's busy clock (Worker.busy_clock's: a one-thread CPU rank's thread time)."""
        self.fetched = (0.0, 0.0)
        """(wall, busy) seconds the chunk just handed out took to come: its collate (the dataset's
        __getitem__, a transform's augmentation) and copy without workers; the wait for it with
        them (none where they kept ahead; the first batch of a pass, their start, not counted). The
        step's clock starts that much earlier (Training.on_item): a rank slow at its data is slow."""

    def __len__(self) -> int:
        """Steps per epoch (the same on every rank)."""
        return len(self.sampler)

    @property
    def batch_size(self) -> int:
        """The global batch: one step's samples on every rank together, the DataLoader's batch_size
        as the script gave it, so that a one-device loop's arithmetic (`len(loader) *
        loader.batch_size`, samples seen) holds. What this rank holds of a step varies with the
        split (job.balancer.split); a batch's own is its length."""
        return self.sampler.global_batch

    def resplit(self, sizes: list[int], after_step: int) -> int:
        """Use `sizes` from the step `lag` steps after `after_step` on; returns that step."""
        at = after_step + 1 + self.lag
        self._pending.append((at, list(sizes)))
        return at

    def _chunks(self) -> Iterator[tuple[list[int], Item]]:
        """(indices, Item) for every chunk of this rank in the epoch, drawn as late as possible."""
        epoch = self.epoch()
        self._same_size(epoch)
        again = self.again()
        self.sampler.set_epoch(epoch, again)
        if again:  # a split decided in an earlier pass of the epoch: its steps are numbered alike in each
            self._apply_pending(float("inf"))
        order = self.sampler.order()
        steps = len(self.sampler)  # (after the draw: a batch sampler of the script's own counts its batches)
        # resumed: the steps taken are skipped (in the pass the job went on in, not the epoch's passes after it)
        step = max(0, min(steps, self.start_step - epoch * steps)) if again == self.start_again else 0
        while step < steps:
            self._apply_pending(epoch * steps + step)  # the split in force decides the merge
            merged = max(1, min(self.group(epoch * steps + step, steps - step), steps - step))
            if self._pending:  # a merged step never spans a change of split
                merged = max(1, min(merged, self._pending[0][0] - epoch * steps - step))
            indices, sizes = [], [0] * len(self.sampler.batch_sizes)
            for s in range(step, step + merged):
                self._apply_pending(epoch * steps + s)
                indices += self.sampler.step_indices(order, s)
                sizes = [a + b for a, b in zip(sizes, self.sampler.step_sizes(s, order))]
            step += merged
            parts = batches.cut(indices, self.chunk, self.fewest)
            for i, part in enumerate(parts):
                yield part, Item(epoch * steps + step - 1, i, len(parts), len(part), len(indices), tuple(sizes),
                                 merged, tuple(part))

    def _same_size(self, epoch: int) -> None:
        """A dataset that grew or shrank since job.prepare is refused at the next pass: its order
        and its steps are the prepared size's, so a grown one's new samples (self-training's
        pseudo-labels, added each epoch) were left out with nothing said, and a shrunk one's last
        indices were past its end. So is a SubsetRandomSampler's list of indices that moved (an
        active-learning loop's labelled indices, extended). A draw not over the whole dataset (a
        weighted sampler's, a sampler of the script's own, a batch function's rows) is not its length's."""
        draw = self.sampler.draw
        if draw is not None and draw.subset is not None:
            now, was, what = len(draw.source.indices) if draw.source is not None else len(draw.subset), \
                len(draw.subset), "the SubsetRandomSampler's indices"
        elif self.sampler.own is not None or (draw is not None and (draw.sampler is not None or draw.sequential)):
            return
        else:
            now, was, what = len(self.dataset), self.sampler.dataset_size, "the prepared loader's dataset"
        if now != was:
            change = f"{now - was} new samples would be left out" if now > was else \
                f"the last {was - now} indices of the prepared order are past its end" if draw is None else \
                f"{was - now} samples it no longer holds would still be dealt"
            raise ConfigError(
                f"{what} hold{'s' * (draw is None)} {now} samples as epoch {epoch + 1} begins, and held {was} at "
                f"job.prepare(): its order and its steps are those of {was} samples (every rank numbers an epoch's "
                f"steps alike, checkpoints and --resume too), so {change}. A dataset that grows or shrinks between "
                "epochs (pseudo-labels added, active learning) goes to job.prepare in a batch function that takes "
                "each step's batch from a DataLoader of your own over it, which sees it as it stands at each iter() "
                "(docs/api.md, 'A dataset that grows')")

    def _apply_pending(self, global_step: int) -> None:
        while self._pending and self._pending[0][0] <= global_step:
            self.sampler.set_batch_sizes(self._pending.pop(0)[1])

    def untrained(self):
        """This rank's batches of a pass that trains nothing (SWA's update_bn over the prepared
        loader): none of the training hooks (a step's clock, a checkpoint or commit due, the pass's
        end), as each rank reads its share."""
        hooks = self.on_item, self.before_step, self.after_pass, self.left
        self.on_item, self.before_step = (lambda item: None), (lambda item: None)
        self.after_pass = lambda began, holding: None
        self.left = lambda: None
        try:
            yield from self
        finally:
            self.on_item, self.before_step, self.after_pass, self.left = hooks

    def __iter__(self):
        self.iterating += 1
        began, before, handed = self.began(), self.backed(), 0
        me = _Pass()
        self._live.append(me)
        batches = self._batches(me)
        try:
            for batch in batches:
                handed += 1
                yield batch
            me.ran_out = True
        except GeneratorExit:  # the loop left the pass early (a break: its iterator dropped)
            try:
                batches.close()  # (its DataLoader iterator with it)
            finally:
                self.left()
            raise
        finally:
            self.iterating -= 1
            self._live.remove(me)
        self.after_pass(began, 0 < self.backed() - before < handed)

    def _handing(self, me: _Pass, item: Item) -> bool:
        """`me` hands `item` out: whether the step in hand is this chunk's (on_item: its clock and
        the loss that follows). A chunk of the job's begins its step if it is the step's first
        (before_step). A look at a batch inside the loop's pass (rank 0's `next(iter(loader))` to
        log a sample, after a step or before the loss, its iterator dropped or kept open) is none of
        the job's: no step begins there (a checkpoint or commit due waits for the loop's next batch,
        where the other ranks take it: taken at the look, it held the look's position), and the
        step in hand, its clock and the loss that follows stay the loop's (taken for the look's
        batch, the next pass's, a loss moved rank 0's epoch on to it, and a checkpoint held that).
        A look is a chunk of another pass than the one that handed out the job's latest chunk,
        while that one is under way, trains, and is in its step: it handed that chunk out since
        the job.backward before the last (a pass kept open and advanced now and then, rank 0's
        preview iterator, is no loop however many batches it handed out). The same batch handed
        out again by another pass before its loss is the step in hand, begun once (the twins);
        whichever hands out next after a job.backward is the loop's, and one that hands out again
        before it, beside a twin that trains, is a look (two batches looked at, an evaluation over
        the loader). A pass whose chunks were taken for looks and that hands out again after a
        job.backward, with no chunk of the twins' between, is the loop's (a break out of a pass
        kept in a variable, then a new pass: its chunks were looks for good). A pass that hands out
        the first chunk after the loop's pass that trained trains from there. A look once its
        loop's pass has run out (after the loop, or after a loop fetching ahead ran out with its
        last batch in hand) is no look here: it begins the next pass's first step (docs/api.md)."""
        latest, at, calls_at = self._latest
        backed, calls = self.backed(), self.calls()
        if backed > at:  # a job.backward since the job's latest chunk: its pass trains
            for twin in self._twins:
                twin.trains = True
        first, me.handed = not me.handed, me.handed + 1
        twins = [twin for twin in self._twins if twin in self._live]
        if me in twins:
            # a twin handing out again before the loss, beside the loop's pass (it trains): a look of two
            # batches, or an evaluation's pass
            if len(twins) > 1 and not me.trains and calls == calls_at and any(twin.trains for twin in twins):
                self._twins.remove(me)
                me.looked = calls
                return False
        elif twins and not any(twin.ran_out for twin in self._twins):
            if item == latest and backed == at:
                self._twins.append(me)
                return True
            # a look before, a job.backward since, and no chunk of the twins: `me` is the loop's pass (a break
            # out of a pass kept in a variable, then a new one: its passes were looks for good)
            went_on = me.looked is not None and calls > me.looked >= calls_at
            if not went_on and any(twin.trains for twin in twins) and backed - at <= 1:
                me.looked = calls
                return False
        if item.chunk == 0:
            self.before_step(item)
        # a pass's first chunk after the loop's pass that trained ran out trains too: a look before its first
        # loss (an evaluation over the prepared loader, a preview) is a look
        me.trains = me.trains or (first and any(twin.trains for twin in self._twins))
        self._twins, self._latest = [me], (item, backed, calls)
        return True

    def _batches(self, me: _Pass):
        if self.num_workers == 0:
            for indices, item in self._chunks():
                ours = self._handing(me, item)
                wall, busy = time.perf_counter(), self.busy()
                batch = batches.to_device(batches.collate(self.dataset, indices, self.collate_fn), self.device)
                if ours:
                    self.fetched = (time.perf_counter() - wall, self.busy() - busy)
                    self.on_item(item)
                yield batch
            return
        drawn: deque[Item] = deque()

        def index_lists():
            for indices, item in self._chunks():
                drawn.append(item)
                yield indices

        # Persistent workers serve one pass at a time: a look at a batch inside the loop's pass (its own
        # iter()) reset the loop's iterator onto the look's indices (DataLoader keeps one), and the loop
        # went on with the look's batches. Such a look gets workers of its own, for its batches alone; a
        # pass begun while a pass left open that is not the loop's holds them (the CIFAR-10 tutorial's
        # `dataiter`) gets persistent workers of its own, which the loop's passes after it keep.
        held = self._workers_for is not None
        shared = self.persistent_workers and (not held or self._workers_for not in self._twins)
        loader = self._workers if shared and not held else None
        if loader is None:
            loader = torch.utils.data.DataLoader(
                self.dataset, batch_sampler=_Once(index_lists()), num_workers=self.num_workers,
                worker_init_fn=self.worker_init_fn, collate_fn=self.collate_fn or torch.utils.data.default_collate,
                persistent_workers=shared, prefetch_factor=self.prefetch_factor)
            if shared:
                self._workers = loader
        else:  # the same workers, this epoch's indices: iter() below starts them on it
            loader.batch_sampler.it = index_lists()
        if shared:
            self._workers_for = me
        try:
            batches_in, first = iter(loader), True
            while True:
                wall, busy = time.perf_counter(), self.busy()
                try:
                    batch = next(batches_in)
                except StopIteration:
                    break
                self.fetched = (0.0, 0.0) if first else (time.perf_counter() - wall, self.busy() - busy)
                first = False
                item = drawn.popleft()  # in order: the oldest drawn item is this batch's
                if self._handing(me, item):
                    self.on_item(item)
                yield batches.to_device(batch, self.device)
        finally:
            if self._workers_for is me:
                self._workers_for = None


@dataclass(eq=False)
class _Pass:
    """A pass over the loader under way (its iterator open; each is itself alone: compared by identity)."""

    trains: bool = False
    """A job.backward came while the job's latest chunk was one it handed out (or the loop's pass
    before it trained, and it handed out the job's next chunk first)."""
    handed: int = 0
    """Its chunks handed out."""
    looked: int | None = None
    """Loader.calls() as it last handed out a look (None: none)."""
    ran_out: bool = False
    """It handed out every chunk of its epoch (a pass dropped early did not)."""


class _Once:
    """A one-pass iterable as a DataLoader batch_sampler (it only iterates it); persistent workers
    get each epoch's pass as a new `it` before iter()."""

    def __init__(self, it):
        self.it = it

    def __iter__(self):
        return self.it
