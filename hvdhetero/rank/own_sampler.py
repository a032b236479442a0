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

    def _draw(self, epoch: int, seed: int) -> Any:
        """Rank 0: the draw as lists of plain ints, or the refusal's words (said on every rank)."""
        saved = _states()
        try:
            torch.default_generator.manual_seed(seed)  # the CPU's alone: a device's generator is the rank's
            random.seed(seed)
            _numpy_seed(seed)
            if hasattr(self.source, "set_epoch"):
                self.source.set_epoch(epoch)
            drawn = list(iter(self.source))
        finally:
            _set_states(saved)
        if not self.batches:
            kept, what = [int(i) for i in drawn], "indices"
        else:
            kept = [b for b in ([int(i) for i in b] for b in drawn) if len(b) >= self.min_share * self.ranks]
            what = f"batches (of {self.min_share * self.ranks} samples or more)"
            if not kept:
                return (f"job.prepare(): {self.name()} gave no batch of {self.min_share * self.ranks} samples or more "
                        f"in epoch {epoch}: every rank takes at least {self.min_share} of each")
        if self.count is not None and len(kept) != self.count:
            return (f"{self.name()} gave {len(kept)} {what} in epoch {epoch}, and {self.count} in the first: "
                    "hvdhetero numbers an epoch's steps alike every epoch (checkpoints, --resume); give it as many "
                    "each epoch (drop_last, or a fixed count)")
        return kept


def _states() -> tuple:
    import numpy as np

    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def _set_states(states: tuple) -> None:
    import numpy as np

    torch.set_rng_state(states[0])
    random.setstate(states[1])
    np.random.set_state(states[2])


def _numpy_seed(seed: int) -> None:
    import numpy as np

    np.random.seed(seed % 2 ** 32)
