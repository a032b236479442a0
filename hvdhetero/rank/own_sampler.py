"""A DataLoader's sampler or batch_sampler of the script's own: a bucket sampler that batches
sequences of similar lengths (seq2seq, speech: less padding, epochs 1.6x faster on one device in
a helper's port), a class-balanced sampler of its own. Every rank draws each epoch from it alike,
then each batch is dealt to the ranks by speed as any other (a batch of another length than the
nominal one in proportion to the split).

The draw runs under a random stream of the job's own, seeded by (--seed, epoch): torch's CPU
generator, Python's and NumPy's are swapped for it around the sampler's `set_epoch(epoch)` (if it
has one) and its iteration, so every rank draws the same batches, with no exchange (a lone pass
of rank 0's over the loader, which the API allows, would have waited for the others in one), and
a resumed run draws the epoch it stopped in again. That the ranks drew alike is checked once, at
job.prepare, where the first epoch is drawn: a sampler that keeps a generator or a rank of its own
is refused there. A batch too short to give every rank `min_share` samples is left out (a
bucket's last one or two samples), and every epoch must then hold as many batches as the first:
steps are numbered by epoch, from the first draw (its len() is not what counts).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch

from hvdhetero.errors import ConfigError
from hvdhetero.rank import checkpoint


@dataclass
class OwnDraw:
    """The script's sampler (`batches=False`: it yields indices, batched by the global batch) or
    batch sampler (`batches=True`: it yields each batch's index list)."""

    source: Any
    batches: bool
    ranks: int = 1
    min_share: int = 1
    count: int | None = None
    """Batches (or indices) an epoch, as the first draw held: every epoch must hold as many."""
    _drawn: tuple[int, Any] | None = field(default=None, repr=False)
    said_short: bool = False
    """Rank 0 said that short batches are left out (once a run)."""

    def name(self) -> str:
        return f"its {'batch_sampler' if self.batches else 'sampler'} {type(self.source).__name__}"

    def __post_init__(self):
        replicas = getattr(self.source, "num_replicas", None)
        if isinstance(replicas, int) and replicas > 1:
            raise ConfigError(f"job.prepare(): the DataLoader's {self.name()[4:]} draws for one of {replicas} "
                              "replicas (num_replicas, a DDP habit): make it for one process (num_replicas=1, "
                              "rank=0): hvdhetero deals each rank its part of every batch it draws")

    def declared(self) -> int:
        """Its len(): indices an epoch (a sampler) or batches (a batch sampler), before a draw."""
        try:
            return len(self.source)
        except TypeError:
            raise ConfigError(f"job.prepare(): the DataLoader's {self.name()[4:]} has no len(): hvdhetero counts "
                              "an epoch's steps before it draws; give it a __len__") from None

    def epoch(self, epoch: int, seed: int) -> Any:
        """This epoch's draw, a list of indices or of batches' index lists, the same on every rank
        (module docstring); drawn once an epoch."""
        if self._drawn is None or self._drawn[0] != epoch:
            drawn = self._draw(epoch, seed)
            if isinstance(drawn, str):
                raise ConfigError(drawn)
            self._drawn = (epoch, drawn)
            self.count = len(drawn) if self.count is None else self.count
        return self._drawn[1]

    def first(self, seed: int) -> None:
        """At job.prepare, on every rank: epoch 0 drawn, and every rank's draw the same (an exchange
        of a digest: prepare is the ranks' together)."""
        import hashlib

        import horovod.torch as hvd

        from hvdhetero.rank import collectives

        drawn = self.epoch(0, seed)
        if _is_main():
            running = self._running_generators(seed, drawn)
            if running:
                print(f"hvdhetero: {self.name()} draws from a generator of its own that runs on from epoch to epoch "
                      f"({running}), which no checkpoint holds: a --resume draws other batches than the stopped run "
                      "would have. Seed it from the epoch in set_epoch(epoch) (self.rng = np.random.default_rng(seed "
                      "+ epoch)), or draw from Python's, NumPy's or torch's global generators, which the job seeds "
                      "each epoch", flush=True)
        if not hvd.is_initialized() or hvd.size() == 1:
            return
        digest = hashlib.sha256(repr(drawn).encode()).hexdigest()
        digests = collectives.allgather_object(digest, "hvdhetero.own_sampler", f"the first draw of {self.name()}")
        if len(set(digests)) > 1:
            raise ConfigError(f"job.prepare(): {self.name()} drew other batches on rank "
                              f"{next(r for r, d in enumerate(digests) if d != digests[0])} than on rank 0 from the "
                              "same seed: it keeps a generator of its own (seeded by time, or by rank), or deals "
                              "one rank's part (a DDP habit: num_replicas, rank); draw with torch's, Python's or "
                              "NumPy's global generators, or with one seeded alike on every rank, for the whole batch")

    def _running_generators(self, seed: int, drawn: Any) -> str:
        """The generators of its own (attributes) whose running state its draw depends on, in words,
        or "": the first epoch drawn again with each moved on a number gives other batches. Their
        states are put back."""
        own = {name: g for name, g in vars(self.source).items() if _generator(g)} \
            if hasattr(self.source, "__dict__") else {}
        if not own:
            return ""
        saved = {name: _state_of(g) for name, g in own.items()}
        try:
            for g in own.values():
                _move_on(g)
            again = self._draw(0, seed)
        finally:
            for name, g in own.items():
                _set_state_of(g, saved[name])
        return "" if again == drawn else ", ".join(f"self.{name}: {type(g).__name__}" for name, g in own.items())

    def _draw(self, epoch: int, seed: int) -> Any:
        """The draw as lists of plain ints, or the refusal's words (`epoch` raises them)."""
        import numpy as np

        saved = checkpoint.rng_state()  # torch's CPU generator, NumPy's, Python's (a device's is the rank's)
        try:
            torch.default_generator.manual_seed(seed)
            random.seed(seed)
            np.random.seed(seed % 2 ** 32)
            if hasattr(self.source, "set_epoch"):
                self.source.set_epoch(epoch)
            drawn = list(iter(self.source))
        finally:
            checkpoint.set_rng_state(saved)
        if not self.batches:
            kept, what = [int(i) for i in drawn], "indices"
        else:
            batches = [[int(i) for i in b] for b in drawn]
            kept = [b for b in batches if len(b) >= self.min_share * self.ranks]
            what = f"batches (of {self.min_share * self.ranks} samples or more)"
            if len(kept) < len(batches) and not self.said_short and _is_main():
                self.said_short = True
                short = [b for b in batches if len(b) < self.min_share * self.ranks]
                print(f"hvdhetero: {self.name()} gave {len(short)} batch{'es' * (len(short) != 1)} of fewer than "
                      f"{self.min_share * self.ranks} samples in epoch {epoch} ({sum(map(len, short))} samples): each "
                      f"is left out, as every rank takes at least {self.min_share} of a batch, so they train nowhere; "
                      "fold a bucket's short last batch into another to keep them", flush=True)
            if not kept:
                return (f"job.prepare(): {self.name()} gave no batch of {self.min_share * self.ranks} samples or more "
                        f"in epoch {epoch}: every rank takes at least {self.min_share} of each")
        if self.count is not None and len(kept) != self.count:
            return (f"{self.name()} gave {len(kept)} {what} in epoch {epoch}, and {self.count} in the first: "
                    "hvdhetero numbers an epoch's steps alike every epoch (checkpoints, --resume); give it as many "
                    "each epoch (a fixed count of batches: a token budget's batches merged or split to it)")
        return kept


def _is_main() -> bool:
    import horovod.torch as hvd

    return not hvd.is_initialized() or hvd.rank() == 0


def _generator(g: Any) -> bool:
    import numpy as np

    return isinstance(g, (random.Random, np.random.Generator, np.random.RandomState, torch.Generator))


def _state_of(g: Any) -> Any:
    import numpy as np

    if isinstance(g, np.random.Generator):
        return g.bit_generator.state
    return g.get_state() if isinstance(g, (np.random.RandomState, torch.Generator)) else g.getstate()


def _set_state_of(g: Any, state: Any) -> None:
    import numpy as np

    if isinstance(g, np.random.Generator):
        g.bit_generator.state = state
    elif isinstance(g, (np.random.RandomState, torch.Generator)):
        g.set_state(state)
    else:
        g.setstate(state)


def _move_on(g: Any) -> None:
    """One number drawn from `g`: its running state moved on."""
    if isinstance(g, torch.Generator):
        torch.rand(1, generator=g)
    else:
        g.random()
