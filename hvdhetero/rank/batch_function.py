"""A batch function of the script's own in place of a dataset: nanoGPT's `get_batch('train')`,
which draws random windows of a token file with torch's generator and returns (x, y), the whole
batch of one step as one device takes it.

    model, optimizer, get_train_batch = job.prepare(model, optimizer, lambda: get_batch("train"))
    X, Y = get_train_batch()        # this rank's rows of the step's global batch, on job.device

Every rank calls the function once a global step and keeps its own rows, sized by speed as a
DataLoader's samples are (the global batch: the rows one call returns). The calls must draw
alike on every rank, so the function runs on a random stream of its own: torch's, NumPy's and
Python's global generators are swapped for the stream's around each call, the stream starting
from rank 0's generators as they were at `job.prepare` and held in every checkpoint. A rank-0
evaluation that calls `get_batch('val')` in between draws from the script's own generators and
moves no rank's stream. A function that keeps a position of its own (a file read in order) reads
it once a step on every rank alike.

A step's batch is drawn once on each rank: a call is a `Loader` chunk whose indices are rows of
the step (row j of the endless sequence is row j % B of step j // B), so micro-batches, the
balancer's re-splits and a resume's skipped steps work as they do for a dataset. Calibration's
probes time the first step's batch, cycled.

nanoGPT fetches the next batch right after the forward pass, before the backward of the one in
hand (to overlap the copy with compute). `NextBatch` therefore hands a batch fetched while the
one before still waits for its job.backward over to the job (the loader's hooks: the step's
clock, a checkpoint due) at the model's next forward in training mode, the point a plain loop
fetches it: after the loop body of the step before (its scheduler.step(), its job.log), before
the new step's forward. A script that never calls the model it prepared (a GAN's two, a
submodule called alone) gets each batch's hooks as it fetches it.

A checkpoint holds the stream after the newest draw and the batches drawn and not yet passed
(tensors, on the CPU): a resume uses those as they were and draws on from there, exact for a
function of the generators and for one that keeps a position of its own (job.track'ed) alike.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from typing import Any

import torch

from hvdhetero.errors import ConfigError
from hvdhetero.rank import batches, collectives
from hvdhetero.rank.loader import Item, Loader
from hvdhetero.rank.positions import Positions
from hvdhetero.rank.sampler import Draw
from hvdhetero.rank.step_state import StepState

STEPS = 10**12
"""Global steps a batch function's endless sequence holds (a loop of the script's own ends it)."""


class BatchFunction:
    """The function as a map-style dataset of rows: `dataset[j]` is the row's index, `collate`
    turns a run of them into that part of their step's batch. Its steps are drawn in order, each
    once, and kept until a later step is asked for."""

    def __init__(self, fn: Callable[[], Any], batch_dim: int = 0):
        self.fn = fn
        self.dim = batch_dim
        """The dimension the samples lie along in every tensor the function returns (1 for
        [sequence, batch] windows: word_language_model's `get_batch`, an LSTM without batch_first)."""
        self.stream = _states()
        """The generators' states the next draw starts from (rank 0's at prepare: `shared`)."""
        self.next_step = 0
        """The step the stream draws next."""
        self.drawn: dict[int, tuple[Any, dict]] = {}
        """step -> (its global batch, the stream before it), for the steps not yet passed."""
        self.global_batch = 0
        self.positions: Positions | None = None
        """What the function reads through that keeps a position of its own (rank/positions.py)."""
        self.moved: list[str] = []
        """Those that had moved at the checkpoint a resume loaded."""

    def shared(self, data, ranks: int, is_main: bool = False):
        """`data` (validate.Data) once every rank's stream starts from rank 0's generators and the
        first step is drawn: its rows are the global batch, the sequence an endless one of them.
        A collective: every rank calls it in job.prepare (rank 0, `is_main`, says what it sees)."""
        self.stream = collectives.broadcast_object(self.stream, 0, "hvdhetero.batch_fn", "job.prepare()")
        first = self.batch(0)
        self.measure(first)
        if ranks > 1 and is_main and (square := _square_beside(first, self.dim)):
            print(square, flush=True)
        if self.global_batch < ranks:
            raise ConfigError(f"job.prepare(model, optimizer, fn): the batch function returned {self.global_batch} "
                              f"sample(s), fewer than the ranks ({ranks}): return one step's whole batch (every "
                              "rank takes its share of it)")
        return dataclasses.replace(data, global_batch=self.global_batch,
                                   draw=Draw(self.global_batch * STEPS, sequential=True, endless=True))

    def __len__(self) -> int:
        """One step's rows: what calibration's probes cycle through (they draw nothing more); the
        loader's sequence goes on past it (validate.data_arguments' Draw of STEPS steps)."""
        return max(1, self.global_batch)

    def __getitem__(self, row: int) -> int:
        return row

    def collate(self, rows: list[int]):
        """Rows of the sequence (one rank's part of one step, or of consecutive steps merged)."""
        if not rows:
            raise RuntimeError("internal: a batch function's chunk of no rows")
        b = self.global_batch
        parts, start = [], 0
        while start < len(rows):
            step = rows[start] // b
            stop = start
            while stop < len(rows) and rows[stop] // b == step and rows[stop] == rows[start] + stop - start:
                stop += 1
            parts.append(batches.take(self.batch(step), rows[start] - step * b, rows[stop - 1] - step * b + 1,
                                      self.dim))
            start = stop
        return parts[0] if len(parts) == 1 else _joined(parts, self.dim)

    def measure(self, first) -> None:
        """The global batch: the samples of the first step's batch along the batch dimension.
        Refused, saying what to change, where its tensors do not all hold that many (each rank keeps
        its rows of every tensor): a [sequence, batch] window returned beside its flattened targets,
        taken along the first dimension, would hand a rank some of the window's time steps and a
        few of its targets."""
        dim = self.dim
        try:
            self.global_batch = n = batches.size(first, dim)
        except TypeError as e:
            raise ConfigError(f"job.prepare(model, optimizer, fn): the batch function returned no tensor "
                              f"{'' if not dim else f'with a dimension {dim} '}({type(first).__name__}): "
                              "it must return one step's batch, as one device takes it (a tensor, or a tuple or "
                              f"dict of tensors with the samples along the {_nth(dim)} dimension)") from e
        for t in batches.tensors(first):
            if t.layout != torch.strided:
                raise ConfigError(
                    f"job.prepare(model, optimizer, fn): the batch function returned a {t.layout} tensor of shape "
                    f"{tuple(t.shape)} (a graph's adjacency, say), whose rows cannot be dealt to the ranks: keep "
                    "what every sample shares out of the batch function (a graph: every rank holds it whole) and "
                    "return the samples, as a graph's training node indices (docs/api.md, 'Parameters by hand, one "
                    "graph'); a sparse input of one row a sample goes dense (.to_dense())")
            if t.dim() > dim and t.shape[dim] != n:
                shapes = ", ".join(str(tuple(x.shape)) for x in batches.tensors(first))
                k = t.shape[dim] // n if not dim and t.shape[dim] % n == 0 else 0
                laid = (f" A second source's {k} samples to each of the {n} (FixMatch's unlabelled batch beside "
                        f"the labelled, drawn apart from them) go as .view({n}, {k}, ...), and .flatten(0, 1) after "
                        f"the call: each rank keeps {k} of them a row (docs/api.md, 'Two data sources in one "
                        f"step'); {k} views of each sample (torch.cat of augmented copies) go as "
                        f"torch.stack(views, 1), which keeps a sample's views in its row." if k > 1 else "")
                raise ConfigError(
                    f"job.prepare(model, optimizer, fn): the batch function returned tensors of shapes {shapes}, "
                    f"which do not all hold the same number of samples along the {_nth(dim)} dimension ({n} in the "
                    "first): each rank keeps its share of the samples of every tensor. "
                    + ("Where the batch is the second dimension ([sequence, batch], an LSTM or a Transformer "
                       "without batch_first), pass job.prepare(..., batch_dim=1); a tensor every sample shares (a "
                       "table, class weights) stays out of the batch function." + laid if not dim else
                       "Return every tensor with the samples along that dimension, or flat (the batch's "
                       f"[..., {n}] laid out row by row, as .view(-1) makes it)."))
            if dim and t.dim() <= dim and (t.numel() % n or not t.numel()):
                raise ConfigError(
                    f"job.prepare(model, optimizer, fn, batch_dim={dim}): the batch function returned a tensor of "
                    f"shape {tuple(t.shape)}, which has no dimension {dim} and is not the batch ({n} samples) laid "
                    f"out flat (a multiple of {n} values, as .view(-1) of [sequence, {n}] makes it): return it with "
                    f"the samples along dimension {dim}")

    def batch(self, step: int):
        """Step `step`'s global batch: drawn now, with the steps before it that were never asked
        for (a resume's from the checkpoint's stream), or as drawn before."""
        if step not in self.drawn:
            if step < self.next_step:
                raise RuntimeError(f"internal: the batch function's step {step} was drawn and dropped")
            while self.next_step <= step:
                before = self.stream
                batch = self._call()
                if self.global_batch and batches.size(batch, self.dim) != self.global_batch:
                    raise ConfigError(f"the batch function returned {batches.size(batch, self.dim)} samples at step "
                                      f"{self.next_step}, {self.global_batch} at the first: it must return one "
                                      "step's whole batch, the same size every step (the global batch; a "
                                      "DataLoader's short last batch goes with drop_last=True)")
                self.drawn[self.next_step] = (batch, before)
                self.next_step += 1
        for passed in [s for s in self.drawn if s < step]:
            del self.drawn[passed]
        return self.drawn[step][0]

    def _call(self):
        """The function, on this object's stream: the script's generators as they were after. A
        StopIteration (`lambda: next(stream)` at a stream's end) ends the batches (Exhausted)."""
        own = _states()
        _set_states(self.stream)
        try:
            batch = self.fn()
            self.stream = _states()
        except StopIteration as end:
            raise Exhausted(self.next_step) from end
        finally:
            _set_states(own)
        return batch

    def state_dict(self) -> dict:
        """The stream after the newest draw, and the steps drawn and not yet passed with their
        batches (on the CPU). A batch that is not tensors in tuples, lists and dicts (it would not
        load with weights_only=True) is left out: the stream before the oldest such step is kept
        instead, and a resume draws again from there."""
        if all(_plain_tensors(batch) for batch, _ in self.drawn.values()):
            held = {step: batches.to_device(batch, torch.device("cpu")) for step, (batch, _) in self.drawn.items()}
            return {"step": self.next_step, "stream": self.stream, "held": held, "moved": self._moved()}
        step = min(self.drawn)
        return {"step": step, "stream": self.drawn[step][1], "held": {}, "moved": self._moved()}

    def _moved(self) -> list[str]:
        return self.positions.moved() if self.positions is not None else []

    def load_state_dict(self, state: dict) -> None:
        self.drawn = {int(step): (batch, None) for step, batch in state.get("held", {}).items()}
        self.moved = list(state.get("moved", []))
        self.next_step, self.stream = int(state["step"]), state["stream"]


class Exhausted(Exception):
    """The batch function raised StopIteration (a stream's end) when drawing step `step`."""

    def __init__(self, step: int):
        super().__init__(f"the batch function's stream ended at step {step}")
        self.step = step


class NextBatch:
    """What job.prepare returns for a batch function: each call, this rank's next chunk of the
    endless sequence on its device (a step's share, or its micro-batches in turn). It iterates
    too (`for x, y in batches:`), until the function raises StopIteration (`lambda: next(stream)`
    at the stream's end: every rank reads the same stream, so every rank ends at the same step);
    a call then raises StopIteration, as next() does. A later call (the next epoch's loop) calls
    the function again for the step it could not draw: a stream the script made anew goes on
    there, and one it did not ends that loop at once."""

    def __init__(self, loader: Loader, step_state: StepState, model: torch.nn.Module):
        self.loader, self.state = loader, step_state
        self.on_item, self.before_step = loader.on_item, loader.before_step
        loader.on_item, loader.before_step = self._handed, self._beginning
        self.waiting: list[tuple[Callable, Item]] = []
        """Hooks of a batch fetched ahead (nanoGPT's), run at the model's next forward."""
        self.forwards = False
        """The script calls the prepared model (in training mode): its forward hands a batch fetched ahead over."""
        self._hook = model.register_forward_pre_hook(Unsaved(self._forward))
        self._it = None

    def __call__(self):
        if self.waiting:  # fetched twice before a forward: the older one is the job's now
            self.release()
        if self._it is None:
            self._it = iter(self.loader)
        try:
            return next(self._it)
        except Exhausted as end:  # the next call calls the function again, for that step: a stream made anew goes on
            self._it, self.loader.start_step = None, end.step
            raise StopIteration(str(end)) from None

    def __iter__(self):
        return self

    def __next__(self):
        return self()

    def _ahead(self) -> bool:
        """Whether a batch fetched now comes ahead of the one in hand (which still waits for its
        job.backward, in a script whose forwards say when it moves on)."""
        return self.forwards and self.state.item is not None and not self.state.backed

    def _forward(self, module: torch.nn.Module, args) -> None:
        if module.training:  # (an evaluation between steps is not the next step's forward)
            self.forwards = True
            if self.waiting:
                self.release()

    def close(self) -> None:
        """The job is over (an elastic reset drops it): the model no longer calls this object."""
        self._hook.remove()

    def _beginning(self, item: Item) -> None:
        if self._ahead() or self.waiting:
            self.waiting.append((self.before_step, item))
        else:
            self.before_step(item)

    def _handed(self, item: Item) -> None:
        if self._ahead() or self.waiting:
            self.loader.fetched = (0.0, 0.0)  # fetched inside the step in hand: its time is that step's
            self.waiting.append((self.on_item, item))
        else:
            self.on_item(item)

    def release(self) -> None:
        """The batch fetched ahead becomes the job's current one (the loader's hooks for it run)."""
        waiting, self.waiting = self.waiting, []
        for hook, item in waiting:
            hook(item)


class Unsaved:
    """A hook on the script's model that a copy of the model does not carry: `torch.save(model, f)`
    (word_language_model saves its best model whole) or `copy.deepcopy(model)` (an EMA made from it)
    pickles it as a hook that does nothing and names nothing of hvdhetero (`{}.get(module, args)`
    returns the args), not this job's batches and loader (whose batch function, a lambda, does not
    pickle at all)."""

    def __init__(self, hook: Callable):
        self.hook = hook

    def __call__(self, module, args):
        return self.hook(module, args)

    def __reduce__(self):
        return getattr, ({}, "get")


def _states() -> dict:
    """The global generators' states, as plain values and tensors (a checkpoint loads them with
    weights_only=True)."""
    states = {"torch": torch.get_rng_state(), "python": _plain(random.getstate())}
    try:
        import numpy as np
    except ImportError:
        return states
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    states["numpy"] = [name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(gauss)]
    return states


def _set_states(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(_tuples(states["python"]))
    if "numpy" in states:
        import numpy as np
        name, keys, pos, has_gauss, gauss = states["numpy"]
        np.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, gauss))


def _square_beside(first, dim: int) -> str:
    """Rank 0's note where the first batch holds an [n, n] tensor beside an [n, F] one (GAT's dense
    adjacency returned with the features): each rank keeps its rows of it, every column still
    naming all n samples, and the model failed in torch's words alone (a size mismatch)."""
    tensors = list(batches.tensors(first))
    n = batches.size(first, dim)
    squares = [t for t in tensors if t.dim() == 2 and t.shape[0] == t.shape[1] == n and n > 1]
    others = [t for t in tensors if t.dim() == 2 and t.shape[0] == n and t.shape[1] != n]
    if dim or not squares or not others:
        return ""
    return (f"hvdhetero: the batch function returns a {list(squares[0].shape)} tensor beside "
            f"{list(others[0].shape)}: each rank keeps its rows of every tensor, so of this one a few rows over all "
            f"{n} columns. A graph's adjacency (every node's neighbours) stays out of the batch: every rank holds it "
            "whole, and the batch is the training nodes' indices (docs/api.md, 'Parameters by hand, one graph')")


def _plain_tensors(batch) -> bool:
    """Whether `batch` is tensors in tuples, lists and dicts alone (what weights_only loads)."""
    if isinstance(batch, torch.Tensor):
        return True
    if type(batch) in (tuple, list):
        return all(_plain_tensors(b) for b in batch)
    if type(batch) is dict:
        return all(isinstance(k, (str, int)) and _plain_tensors(v) for k, v in batch.items())
    return False


def _plain(value):
    return [_plain(v) for v in value] if isinstance(value, tuple) else value


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _joined(parts: list, dim: int = 0, widths: list[int] | None = None):
    """Consecutive steps' rows as one batch (a rank that merges steps: --inner-steps by-speed),
    joined along the batch dimension (a flat tensor's rows side by side, flat again)."""
    if widths is None:
        widths = [batches.size(p, dim) for p in parts]
    first = parts[0]
    if isinstance(first, torch.Tensor):
        flat = dim and first.dim() <= dim
        try:
            if flat:
                return torch.cat([p.reshape(-1, w) for p, w in zip(parts, widths)], 1).reshape(-1)
            return torch.cat(parts, dim)
        except RuntimeError as e:
            shapes = ", ".join(str(tuple(p.shape)) for p in parts)
            raise ConfigError(f"the batch function's steps have different shapes ({shapes}), which --inner-steps "
                              "by-speed cannot merge into one batch: use --inner-steps same") from e
    if isinstance(first, (tuple, list)):
        return type(first)(_joined(list(column), dim, widths) for column in zip(*parts))
    if isinstance(first, dict):
        return {k: _joined([p[k] for p in parts], dim, widths) for k in first}
    raise ConfigError(f"the batch function returns a {type(first).__name__}, which hvdhetero cannot join over "
                      "steps merged by --inner-steps by-speed: return a tensor, a tuple or a dict of tensors, or "
                      "use --inner-steps same")


def _nth(dim: int) -> str:
    return ("first", "second", "third")[dim] if dim < 3 else f"{dim + 1}th"
