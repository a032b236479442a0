"""A state the loop carries from step to step for each row of a batch function's steps: an
LSTM's hidden state over pytorch/examples' word_language_model windows (truncated backpropagation
through time), where column j of the next window goes on from column j of this one.

    hidden = job.carry(repackage_hidden(hidden))    # this rank's columns' states, wherever they were

A rank holds the state of the rows it had in the chunk before (the shape the model returned). The
balancer moves rows between ranks (a new split), micro-batches cut a rank's share in chunks, and
either hands a rank other rows than the ones its state belongs to: kept as the rank's width
alone, with more than two ranks or in chunks the state went on silently in the wrong columns.
`Carried` keeps every row's latest state, written at the step it was computed for, and hands a
chunk its rows' states: those computed in the step before, zeros for a row new to this rank
(its state stays on the rank that had it; it starts afresh here, as torch's nn.LSTM does from a
hidden state of zeros). A state as wide as the whole global batch (the loop's own
`model.init_hidden(batch_size)`, at an epoch's start) starts every row from it.
"""

from __future__ import annotations

from typing import Any

import torch

from hvdhetero.errors import ConfigError


class Carried:
    """One rank's carried state: every row's latest, on the rank's device."""

    def __init__(self, global_batch: int):
        self.global_batch = global_batch
        self.rows: torch.Tensor | None = None
        """The rows (columns of the step's batch) the state handed out last belongs to."""
        self.step = -1
        """The global step those rows were handed out for."""
        self.kept: list[torch.Tensor] | None = None
        """Per tensor of the state: every row's latest, the rows along `dim`."""
        self.written: torch.Tensor | None = None
        """Per row: the step its kept state was computed for (-2: none)."""
        self.item = None
        """The chunk the last call was for: one call a chunk (one state, several tensors in a tuple)."""

    def __call__(self, state: Any, item, dim: int = 1) -> Any:
        """`state` (a tensor, or a tuple or list of them: nn.LSTM's (h, c)) as computed for the rows
        handed out last, swapped for this chunk's rows' (`item`: the chunk in hand), detached."""
        tensors = [state] if isinstance(state, torch.Tensor) else list(state)
        if not tensors or not all(isinstance(t, torch.Tensor) and t.dim() > dim for t in tensors):
            raise ConfigError(f"job.carry(state, dim={dim}): expected a tensor, or a tuple or list of tensors, each with "
                              f"its rows along dimension {dim} (nn.LSTM's (h, c): [layers, batch, hidden], dim=1)")
        if item is self.item:
            raise ConfigError("job.carry() twice for one batch: it keeps one state, computed for the rows in hand; "
                              "carry several as one tuple, job.carry((h, c, memory))")
        if item.steps > 1:
            raise ConfigError("job.carry(): this rank's batch merges several steps (--inner-steps by-speed): their "
                              "windows lie side by side, not one after another; use --inner-steps same")
        b = self.global_batch
        rows = torch.tensor([i % b for i in item.indices], dtype=torch.long)
        widths = {t.shape[dim] for t in tensors}
        if len(widths) != 1:
            raise ConfigError(f"job.carry(state): its tensors hold {sorted(widths)} rows along dimension {dim}: one "
                              "state of the same rows")
        width = widths.pop()
        if width == b and (self.rows is None or width != len(self.rows)):  # the loop's own start, all rows
            self.kept = [t.detach().clone() for t in tensors]
            self.written = torch.full((b,), item.step - 1, dtype=torch.long)
        elif self.rows is not None and width == len(self.rows):  # the rows handed out last, computed now
            self._keep(tensors, dim)
        elif self.rows is None and width == len(rows):  # a first state of this chunk's rows
            self._keep(tensors, dim, rows, item.step - 1)
        else:
            raise ConfigError(f"job.carry(state): the state holds {width} rows along dimension {dim}, where the rows "
                              f"handed out last were {0 if self.rows is None else len(self.rows)} and the global batch "
                              f"is {b}: pass the state the model returned for the batch in hand (or one as wide as "
                              "the global batch, to start every row afresh)")
        self.rows, self.step, self.item = rows, item.step, item
        fresh = self.written.index_select(0, rows) == item.step - 1  # computed in the step before
        out = []
        for kept in self.kept:
            taken = kept.index_select(dim, rows.to(kept.device))
            shape = [1] * taken.dim()
            shape[dim] = len(rows)
            out.append(torch.where(fresh.view(shape).to(taken.device), taken, torch.zeros_like(taken)))
        return out[0] if isinstance(state, torch.Tensor) else type(state)(out)

    def _keep(self, tensors: list[torch.Tensor], dim: int, rows: torch.Tensor | None = None,
              step: int | None = None) -> None:
        rows = self.rows if rows is None else rows
        step = self.step if step is None else step
        wholes = [(*t.shape[:dim], self.global_batch, *t.shape[dim + 1:]) for t in tensors]
        if self.kept is None or [tuple(k.shape) for k in self.kept] != wholes:  # a first state, or another kind
            self.kept = [t.new_zeros(shape) for t, shape in zip(tensors, wholes)]
            self.written = torch.full((self.global_batch,), -2, dtype=torch.long)
        for kept, t in zip(self.kept, tensors):
            kept.index_copy_(dim, rows.to(kept.device), t.detach().to(kept.dtype))
        self.written.index_fill_(0, rows, step)
