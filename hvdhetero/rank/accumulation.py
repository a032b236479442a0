"""A script that accumulates gradients over several batches of its own, and micro-batches.

Micro-batches hand the loop body a step's share in chunks, so a loop that steps its optimizer
every k batches (`if (i + 1) % accum_steps == 0`) counts chunks: a rank cut into two chunks a
step stepped after every step, one cut into one after every second, and the ranks' models and
schedules went apart (a helper's port: its LR schedule ran to twice its length). Such a script
shows itself at its first step's end: it goes on to the next batch without stepping the
optimizer job.prepare returned. So under `--micro-batch auto` the loader hands out whole shares
until the first step's end, and cuts them into the chunks auto chose only once the script has
stepped there; one that went on without a step keeps whole shares (said once). An explicit
`--micro-batch N` is the user's: it stays, and the rank whose steps it cuts says what a count of
batches then counts (any rank: one cut in fewer chunks than another is the one left unstepped).

    accumulation = Accumulation(loader, me.micro_batch, auto=config.micro_batch == "auto", is_main=...,
                                whole=lambda step: records.write("micro_batches", step=step, ...))
    accumulation.step_begins(item, unstepped)   # a step's first chunk: steps reduced since the last update
    accumulation.updated()                      # the prepared optimizer stepped
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

from hvdhetero.errors import ConfigError
from hvdhetero.rank.loader import Item, Loader

WHOLE = ("hvdhetero: the script went on to its next batch without stepping the optimizer job.prepare returned "
         "(it accumulates gradients over several batches of its own, or updates by hand), so each rank runs its "
         "share whole: --micro-batch auto would hand the loop chunks, and a count of batches would count them. "
         "The live loss and the metrics show the loss given to job.backward (a script's loss / accum_steps as "
         "such); job.log the loss you want to see")


def in_chunks(chunks: int, chunk: int, batch_norm: bool) -> str:
    """Rank 0's line at its first step handed out in chunks."""
    samples = "1 sample" if chunk == 1 else f"{chunk} samples"
    return (f"hvdhetero: micro-batches: the loop body runs once a chunk ({chunks} chunks of at most {samples} in "
            "this rank's first such step), so a count of the script's own over the loader (tqdm's, MetricLogger's "
            "[i/len], i % log_interval) counts chunks and runs past len(loader), the steps; job.sync_gradients is "
            "True at a step's last chunk" + ("; BatchNorm normalises over each chunk (--micro-batch 0 or a larger "
                                             "one keeps its statistics a share's)" if batch_norm else ""))


def chunked(chunk: int) -> str:
    return (f"hvdhetero: the script went on to its next batch without stepping the optimizer job.prepare returned "
            f"(it accumulates gradients over several batches of its own), and --micro-batch {chunk} hands its loop "
            "each step's share in chunks: a count of batches counts chunks, which differ from rank to rank. Count "
            "steps with job.sync_gradients (True at a step's last chunk), or leave --micro-batch at auto (whole "
            "shares for such a script)")


class Accumulation:
    """Decides the loader's chunks around a script's own accumulation (the module's docstring)."""

    def __init__(self, loader: Loader, chunk: int | None, *, auto: bool, is_main: bool,
                 whole: Callable[[int], None] = lambda step: None, batch_norm: bool = False):
        self.loader, self.auto, self.is_main, self.whole = loader, auto, is_main, whole
        """`whole(step)`: auto's chunks were given up at that step (rank 0 records it)."""
        self.batch_norm = batch_norm
        self.told = False
        """Rank 0 said its loop body runs once a chunk (at its first step in chunks)."""
        self.deferred = chunk if auto and chunk else None
        """auto's chunk, handed out once the script has stepped at its first step's end."""
        if self.deferred:
            loader.chunk = None
        self.own = False
        """The script went on to a batch without stepping: it accumulates over several steps."""

    def updated(self) -> None:
        """The prepared optimizer stepped: auto's chunks from the steps not yet drawn on."""
        if self.deferred is not None:
            self.loader.chunk, self.deferred = self.deferred, None

    def one_ahead(self, item: Item) -> None:
        """The loop fetches one batch ahead (apex's data_prefetcher): its job.backward comes for the
        chunk before the one handed out last, so a step in chunks would be reduced a chunk early.
        auto's chunks are given up (whole shares: auto cuts from the second step on); an explicit
        --micro-batch that cuts a share is refused (at the loop's first job.backward, and at each
        step after, where a split that moved may cut one)."""
        self.deferred = None
        if self.loader.chunk and max(item.sizes) > self.loader.chunk:
            raise ConfigError(f"--micro-batch {self.loader.chunk} with a loop that fetches one batch ahead (apex's "
                              "data_prefetcher, timm's PrefetchLoader: the next batch comes before the forward of "
                              "the one in hand): job.backward would be taken for the chunk handed out last, and the "
                              "ranks' shares reduced a chunk early. Drop the prefetcher (the prepared loader hands "
                              "each batch out on the rank's device already), or --micro-batch")

    def step_begins(self, item: Item, unstepped: int) -> None:
        """A step's first chunk is handed out, `unstepped` steps reduced since the optimizer last
        stepped (more than none: the script accumulates over steps)."""
        if self.is_main and not self.told and item.chunks > 1 and self.loader.chunk:
            self.told = True
            print(in_chunks(item.chunks, self.loader.chunk, self.batch_norm), flush=True)
        if self.own or not unstepped:
            return
        self.own = True
        if self.deferred is not None:
            self.deferred = None
            if self.is_main:
                print(WHOLE, flush=True)
                self.whole(item.step)
        elif not self.auto and self.loader.chunk and max(item.sizes) > self.loader.chunk:  # some rank cuts its share
            if self.is_main:
                print(chunked(self.loader.chunk), flush=True)
            else:  # (the console relays a rank's warning once)
                warnings.warn(chunked(self.loader.chunk).removeprefix("hvdhetero: "), stacklevel=1)
