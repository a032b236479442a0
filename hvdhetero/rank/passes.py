"""Where a loop over the prepared loader stands, pass by pass (rank/training.py's part).

    passes = Passes(train)                 # the job's TrainState: its epoch moves here
    passes.loader, passes.one_pass = ...   # once made
    iter(loader)        -> passes.epoch(in_epochs): the epoch the new pass deals
                           passes.begun(): the pass's own counts start
    a chunk handed out  -> passes.handed(item)
    job.backward        -> passes.backward(item): whether the pass is found to fetch one batch
                           ahead, and the chunk its loss came from
    a pass left early   -> passes.left()
    a step taken        -> passes.stepped(item, in_epochs)

Inside job.epochs a pass deals job.epochs' epoch. Outside it, as a DataLoader reshuffles at every
`iter()`, a pass begun after a step was taken in the epoch's deals the next epoch, and one begun
before deals the epoch again: the job's epoch moves only when a pass takes its first step, as
every rank does. What each got wrong before:
- a loop over steps, not epochs, dealt the same order every pass (a split decided in its last
  steps never came);
- the DDP tutorial's `next(iter(loader))` before its loop counted every epoch twice;
- a pass rank 0 took alone (counting its share) moved its epoch ahead of the other ranks';
- a pass of the script's own after job.epochs dealt job.epochs' last epoch again.

A loop that fetches one batch ahead (apex's data_prefetcher, timm's PrefetchLoader) hands the next
batch out before the forward of the one in hand: its pass's first job.backward comes with a second
chunk handed out already. From then on a checkpoint or an elastic commit goes on from the chunk in
hand (`held`), not from the one being handed out (resumed from the batch ahead, it skipped one).
Only the outermost pass counts (Loader.iterating == 1): a look at a batch inside a pass counts nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hvdhetero.rank.registry import TrainState

if TYPE_CHECKING:
    from hvdhetero.rank.loader import Item, Loader


class Passes:
    """The epoch each pass over the loader deals, on one rank."""

    def __init__(self, train: TrainState):
        self.train = train
        self.loader: Loader | None = None
        """The prepared loader (set once made: it asks `epoch` at each pass)."""
        self.one_pass = False
        """A batch function's loader: one endless pass, its rows by global step."""
        self.stepped_in: int | None = None
        """The epoch of the last step taken (None: none since the start or a resume)."""
        self.again = 0
        """Inside job.epochs: the passes of its epoch begun before the one under way, each of which
        took a step (FixMatch's labelled loader restarted with iter() within an epoch). Each deals
        an order of its own: the same order every pass had a small labelled set seen alike 5 times
        an epoch, where one device reshuffles it at every iter()."""
        self._began: tuple[int, bool] | None = None  # the epoch the last pass dealt, and whether it took a step
        self._loaded: tuple[int, int] | None = None  # a resume's pass, until job.epochs' first pass takes it
        self.ahead = False
        """The loop fetches one batch ahead: its pass's first job.backward came with a second chunk
        handed out (kept into the next pass while one is still in hand)."""
        self._chunks = self._backwards = 0  # the chunks the pass handed out, and the ones backed since it began
        self._item: Item | None = None  # the chunk the pass handed out last
        self._before: Item | None = None  # and the one before it (a pass's or the pass before's)
        self._item_pass: tuple[int, int] | None = None  # the pass that handed `_item` out
        self._backed: Item | None = None  # the chunk the last job.backward's loss came from
        self.backed = 0
        """Chunks a job.backward came from so far, each once (a GAN's three losses a batch, LBFGS's
        closure evaluated again: one): a pass that backed fewer than it was handed holds its last."""

    def epoch(self, in_epochs: bool) -> int:
        """The epoch a new pass deals (the sampler's shuffle and the global step numbers follow it)."""
        if self.one_pass:  # a batch function's: its rows by global step, whatever job.epochs says
            return 0
        if in_epochs:
            if not self.outermost:  # a look at a batch inside the pass under way: its order, nothing counted
                return self.train.epoch  # (rank 0's alone had moved its passes' orders off the others')
            if self._loaded is not None:  # resumed: the pass under way at the checkpoint goes on
                (epoch, self.again), self._loaded = self._loaded, None
                self._began = epoch, False
            if self._began is None or self._began[0] != self.train.epoch:
                self.again = 0
            elif self._began[1]:  # (one that took no step, a look at the first batch, deals the same again)
                self.again += 1
            self._began = self.train.epoch, False
            return self.train.epoch
        self.again, self._began = 0, None
        if self.stepped_in is None:  # none taken yet: where the loader stands, resumed (a checkpoint taken as
            # a pass's first step came holds the epoch before, and the loader at the new pass)
            return max(self.train.epoch, self.loader.start_step // len(self.loader))
        return self.stepped_in + 1

    def state_dict(self) -> dict[str, int] | None:
        """A checkpoint's or commit's part: inside job.epochs, the epoch the pass under way deals and
        how many of its passes came before it (a resume mid-epoch of FixMatch's labelled loader,
        restarted within each epoch, deals that pass's order again, not the epoch's first pass's)."""
        held = self._item_pass if self.held is not None else self.dealing  # (one fetched ahead: the held one's)
        return None if held is None else {"epoch": held[0], "again": held[1]}

    def load_state_dict(self, state: dict[str, int] | None) -> None:
        """The pass under way at the checkpoint is the one the resumed loop begins (its first pass
        deals it where the job goes on in that epoch; one taken at an epoch's end goes on in the
        next). None: no pass of job.epochs' was under way (a loop of the script's own, or a
        checkpoint from before passes were kept)."""
        self._loaded = (state["epoch"], state["again"]) if state else None
        if self.loader is not None:
            self.loader.start_again = state["again"] if state else 0

    def stepped(self, item: Item, in_epochs: bool) -> None:
        """A step of a pass was taken (every rank takes it): outside job.epochs, the epoch its pass
        deals is the job's from now on."""
        if self.one_pass:
            return
        epoch = item.step // len(self.loader)
        if in_epochs and self._began is not None:
            self._began = self._began[0], True
        if not in_epochs and (self.stepped_in is None or epoch > self.train.epoch):
            self.train.epoch = epoch
        self.stepped_in = epoch

    @property
    def outermost(self) -> bool:
        """The loader is in one pass, the loop's own (not a look at a batch inside a pass under way)."""
        return self.loader is not None and self.loader.iterating == 1

    @property
    def dealing(self) -> tuple[int, int] | None:
        """job.epochs' pass dealing now: its epoch and `again` (None outside job.epochs)."""
        return None if self._began is None else (self._began[0], self.again)

    @property
    def held(self) -> Item | None:
        """In a loop that fetches one batch ahead, the chunk its pass handed out last (None
        elsewhere): before a step begins, the one in hand, not trained yet; once that one's
        job.backward came, the one ahead, the loader's latest step."""
        return self._item if self.ahead else None

    def in_hand(self, item: Item) -> Item:
        """The chunk a job.backward's loss came from, `item` the one handed out last: in a loop that
        fetches one batch ahead, while its pass goes on, the one handed out before it (its share
        and the step's split weigh the gradient: the batch ahead's, where the split changed between
        them, were another's); at its pass's end, the last. (A look at a batch inside the pass,
        taken before the loss, hands out none of the job's chunks: Loader._handing.)"""
        if self.ahead and self.outermost and self._before is not None:
            return self._before
        return item

    def begun(self) -> None:
        """A pass begins (iter()): its counts start, a chunk still in hand kept (an endless cycle's
        prefetcher holds the last pass's batch as it takes the next)."""
        if not self.outermost:
            return
        held = self._chunks - self._backwards if self.ahead else 0
        self.ahead = held > 0
        self._chunks, self._backwards = max(0, held), 0

    def handed(self, item: Item) -> None:
        """The loader hands a chunk out."""
        if self.outermost:
            self._chunks, self._before, self._item = self._chunks + 1, self._item, item
            self._item_pass = self.dealing

    def backward(self, item: Item) -> tuple[bool, Item]:
        """A job.backward, `item` the chunk handed out last: whether it finds the loop fetching one
        batch ahead (the pass's first, a second chunk handed out already; decided once; only a
        backward decides: a pass with none, rank 0's alone counting its share, is no prefetcher),
        and the chunk its loss came from (in_hand). The pass counts the chunks backed, not the
        calls: a GAN's two losses, a closure evaluated again, are one chunk's."""
        found = self._backwards == 0 and self._chunks > 1 and not self.one_pass and not self.ahead
        if found:
            self.ahead = True
        trained = self.in_hand(item)
        if trained is not self._backed:
            self._backwards, self._backed, self.backed = self._backwards + 1, trained, self.backed + 1
        return found, trained

    def left(self) -> None:
        """The loop left its pass early (a `break`, the prefetcher holding a batch dropped with it):
        nothing of the pass is in hand, and the next pass is looked at afresh (a look inside a
        pass dropped, rank 0's `next(iter(loader))`, leaves the loop's pass as it is)."""
        if self.outermost:
            self.ahead, self._chunks, self._backwards, self._item, self._before = False, 0, 0, None, None
