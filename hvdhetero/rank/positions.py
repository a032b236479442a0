"""What a batch function reads through that keeps a position of its own, and a checkpoint does not hold.

build-nanogpt's `job.prepare(model, optimizer, train_loader.next_batch)`: its `DataLoaderLite`
counts `current_position` and `current_shard` as it reads. A resume runs the script again from
its top, so the loader starts at the beginning of its data, and the run goes on from its
checkpoint on other batches than the stopped run would have read, without a word (a helper's
port saw step 80's loss differ). The job cannot put such a position back itself (it does not
know which attributes are a position, nor what else goes with them: the loader's shard in
memory), but it can see one move: an object the function is bound to, or names (a closure's
cell, a global the function's code reads), whose integer attributes changed between
`job.prepare` and a checkpoint, and that the script did not `job.track`. The checkpoint records
those; a resume from it says what to do (rank 0, once).

    watch = Positions(fn, tracked)   # at job.prepare: the candidates and their integers
    watch.moved()                    # at a checkpoint: ["train_loader (DataLoaderLite: current_position, ...)"]
    said(moved, step)                # at a resume: the line rank 0 prints
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable, Iterable
from typing import Any

_NOT_STATE = (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType, type,
              functools.partial)


def _candidates(fn: Callable) -> list[tuple[str, Any]]:
    """(name, object): what `fn` is bound to, or reads by name, that may keep a position."""
    found: list[tuple[str, Any]] = []
    while isinstance(fn, functools.partial):
        found += [("", a) for a in (*fn.args, *fn.keywords.values())]
        fn = fn.func
    code_of = fn
    if inspect.ismethod(fn):
        found.append((_name_of(fn.__self__, fn.__func__.__globals__), fn.__self__))
        code_of = fn.__func__
    code, globs = getattr(code_of, "__code__", None), getattr(code_of, "__globals__", {})
    if code is not None:
        cells = getattr(code_of, "__closure__", None) or ()
        for name, cell in zip(code.co_freevars, cells):
            try:
                found.append((name, cell.cell_contents))
            except ValueError:  # an empty cell
                pass
        found += [(name, globs[name]) for name in code.co_names if name in globs]
    return [(name or _name_of(obj, globs), obj) for name, obj in found if _may_keep(obj)]


def _may_keep(obj: Any) -> bool:
    """An instance with attributes of its own (not a module, function, class, array or tensor)."""
    return (not isinstance(obj, _NOT_STATE) and hasattr(obj, "__dict__") and not hasattr(obj, "shape")
            and bool(_integers(obj)))


def _integers(obj: Any) -> dict[str, int]:
    """Its public integer attributes (a DataLoader's iterator keeps private ones: a stream the
    script makes anew is its own to skip ahead in)."""
    try:
        return {k: v for k, v in vars(obj).items()
                if isinstance(v, int) and not isinstance(v, bool) and not k.startswith("_")}
    except TypeError:
        return {}


def _name_of(obj: Any, globs: dict) -> str:
    return next((name for name, value in globs.items() if value is obj and not name.startswith("_")), "")


class Positions:
    """The objects a batch function reads through, with their integer attributes at job.prepare."""

    def __init__(self, fn: Callable, tracked: Iterable[Any] = ()):
        kept = {id(o) for o in tracked}
        self.watched = [(name, obj, _integers(obj)) for name, obj in _candidates(fn) if id(obj) not in kept]

    def moved(self) -> list[str]:
        """Each watched object whose integers changed since, as `name (Type: attr, attr)`."""
        out = []
        for name, obj, before in self.watched:
            now = _integers(obj)
            changed = [k for k in before if now.get(k) != before[k]]
            if changed:
                kind = type(obj).__name__
                out.append(f"{name} ({kind}: {', '.join(changed)})" if name else f"a {kind} ({', '.join(changed)})")
        return out


def said(moved: list[str], step: int) -> str:
    """Rank 0's line at a resume from a checkpoint whose batch function read through `moved`."""
    what = "; ".join(moved)
    return (f"hvdhetero: resumed at step {step}, but the batch function reads through {what}, which kept a "
            "position of its own as the run trained and which the checkpoint does not hold: run again from the "
            "script's top, it starts where a fresh one does, so the batches from here are not those the stopped "
            "run would have read. Give it state_dict() (returning its position) and load_state_dict(state), and "
            "job.track(name, it) before job.prepare: a resume then reads on from where the checkpoint was taken "
            "(docs/api.md)")
