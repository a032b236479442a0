"""`invoke train --tensorboard`: rank 0 mirrors metrics.jsonl's numbers into TensorBoard.

The same records as metrics.jsonl (the one source the report reads too), as scalars against
the global step: the epoch's loss and samples/s (a loop of the script's own: each window's), each
rank's samples/s and share, every `job.log` value under its own name, and with --sync
local/diloco each exchange's seconds.
Written under RUN_DIR/tensorboard; `tensorboard --logdir runs` shows every run side by side.
"""

from __future__ import annotations

from pathlib import Path

from hvdhetero.errors import ConfigError

_NOT_SCALARS = {"time", "epoch", "step", "round", "applied"}


def scalars(event: str, fields: dict) -> list[tuple[str, float]]:
    """The (tag, value) pairs a metrics record shows in TensorBoard (none for most events)."""
    if event in ("epoch", "window"):  # a window: a loop of the script's own, the steps between two job.log calls
        out = [("train/loss", fields["loss"])] if event == "epoch" else []
        out.append(("train/samples_per_s", fields["samples_per_s"]))
        seconds = fields.get("seconds") or 0.0
        for rank, samples in enumerate(fields.get("rank_samples") or []):
            if seconds > 0:
                out.append((f"rank{rank}/samples_per_s", samples / seconds))
        out += [(f"rank{rank}/share", n) for rank, n in enumerate(fields.get("split") or [])]
        return out
    if event == "log":
        return [(name, value) for name, value in fields.items()
                if name not in _NOT_SCALARS and isinstance(value, (int, float)) and not isinstance(value, bool)]
    if event == "exchange":
        return [("sync/exchange_s", fields["seconds"]), ("sync/wait_s", fields["wait_s"])]
    if event == "split":
        return [(f"rank{rank}/share", n) for rank, n in enumerate(fields["split"])]
    return []


class TensorBoardLog:
    """Rank 0's event files; every record of `_write` goes through `write`."""

    def __init__(self, folder: str | Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ConfigError("--tensorboard needs the tensorboard package on rank 0's host: "
                              "pip install tensorboard (ci/setup installs it on the launcher)") from err
        self.writer = SummaryWriter(str(folder))

    def write(self, event: str, fields: dict, step: int) -> None:
        for tag, value in scalars(event, fields):
            self.writer.add_scalar(tag, float(value), fields.get("step", step))
        if event in ("epoch", "end"):
            self.writer.flush()

    def close(self) -> None:
        self.writer.close()
