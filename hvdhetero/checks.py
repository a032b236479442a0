"""The checks every options dataclass runs at construction (config.JobConfig,
recipes/options.RecipeOptions, bench/options.BenchOptions), with one wording for all of them:
the option as the command line spells it, the value given and what is allowed.

    checks.types(self)                                  # each field holds its annotated type
    checks.at_least("epochs", self.epochs, 1, "passes over the training set")
    checks.one_of("optimizer", self.optimizer, ("adam", "sgd"))

Each raises ConfigError (exit 2). Torch-free: the launcher runs them before it starts
anything, and the rank side runs the same ones on what it is handed.
"""

from __future__ import annotations

import ast
import inspect
import math
import types as _types
import typing
from dataclasses import fields
from pathlib import Path

from hvdhetero.errors import ConfigError


def flag(name: str) -> str:
    """A field's name as the command line spells the option: batch_size -> --batch-size."""
    return "--" + name.replace("_", "-")


_KIND = {int: "an integer", float: "a number", str: "a string", bool: "true or false", dict: "a mapping",
         tuple: "a list", list: "a list"}


def types(obj) -> None:
    """Every field of the dataclass `obj` holds the type it is annotated with. An int is a fine
    float (and is made one: 5 -> 5.0, as JSON may hand it back); a bool is no int (True would
    pass for 1 silently); `X | None` also takes None."""
    hints = typing.get_type_hints(type(obj))
    for f in fields(obj):
        value, allowed = getattr(obj, f.name), _members(hints[f.name])
        if not any(_is(value, t) for t in allowed):
            wanted = " or ".join(dict.fromkeys("None" if t is type(None) else _KIND.get(t, t.__name__)
                                               for t in allowed))
            raise ConfigError(f"{flag(f.name)} must be {wanted}, got {value!r} ({type(value).__name__})")
        if float in allowed and isinstance(value, int):
            object.__setattr__(obj, f.name, float(value))  # frozen dataclasses too: still constructing


def _members(hint) -> tuple[type, ...]:
    if typing.get_origin(hint) in (typing.Union, _types.UnionType):
        return tuple(t for h in typing.get_args(hint) for t in _members(h))
    return (typing.get_origin(hint) or hint,)


def _is(value, wanted: type) -> bool:
    if wanted is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if wanted is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, wanted)


def _num(x) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def _about(meaning: str) -> str:
    return f" ({meaning})" if meaning else ""


def at_least(name: str, value, low, meaning: str = "") -> None:
    """`value` is a finite number >= low (nan and inf fail too: neither is a setting)."""
    if not (math.isfinite(value) and value >= low):
        raise ConfigError(f"{flag(name)} must be {_KIND[type(value)]} >= {_num(low)}{_about(meaning)}, got {value!r}")


def above(name: str, value, low, meaning: str = "") -> None:
    """`value` is a finite number > low."""
    if not (math.isfinite(value) and value > low):
        raise ConfigError(f"{flag(name)} must be {_KIND[type(value)]} > {_num(low)}{_about(meaning)}, got {value!r}")


def within(name: str, value, low, high, meaning: str = "", *, open_low: bool = False,
           open_high: bool = False) -> None:
    """`value` lies in the interval from low to high; `open_*` leaves that end out."""
    ok = math.isfinite(value) and (value > low if open_low else value >= low) \
        and (value < high if open_high else value <= high)
    if not ok:
        interval = f"{'(' if open_low else '['}{_num(low)}, {_num(high)}{')' if open_high else ']'}"
        raise ConfigError(f"{flag(name)} must be {_KIND[type(value)]} in {interval}{_about(meaning)}, "
                          f"got {value!r}")


def one_of(name: str, value, allowed, meaning: str = "") -> None:
    """`value` is one of the `allowed` names."""
    if value not in allowed:
        names = ", ".join(repr(a) if a == "" else str(a) for a in allowed)
        raise ConfigError(f"{flag(name)} must be one of {names}{_about(meaning)}, got {value!r}")


def integer(name: str, value) -> int | None:
    """An option Invoke hands over as text (its default None meaning "not given") as an int."""
    if value is None or isinstance(value, int):
        return value
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{flag(name)} must be an integer, got {value!r}") from None


def batch_fits(batch_size: int, hosts) -> None:
    """A global batch of `batch_size` can be dealt to the ranks of `hosts` (inventory Hosts):
    a sample at least to each, and no more than the hosts' max_batch caps hold together."""
    ranks = sum(h.slots for h in hosts)
    if batch_size < ranks:
        raise ConfigError(f"--batch-size {batch_size} is less than the {ranks} ranks of the hosts selected: every "
                          f"rank needs a sample per step; give --batch-size {ranks} or more")
    if all(h.max_batch for h in hosts) and sum(h.max_batch * h.slots for h in hosts) < batch_size:
        caps = ", ".join(f"{h.name}: {h.slots} x {h.max_batch}" for h in hosts)
        raise ConfigError(f"--batch-size {batch_size} is more than the hosts' max_batch caps hold together ({caps}, "
                          f"{sum(h.max_batch * h.slots for h in hosts)} samples a step); lower --batch-size or add a "
                          "host without a cap")


def numbers(name: str, text: str, kind: type = int) -> list:
    """A comma-separated list of `kind` (--seeds 0,1,2; --sizes-mb 1,16), at least one."""
    try:
        values = [kind(s) for s in str(text).split(",") if s.strip()]
    except ValueError:
        values = None
    if not values or (kind is float and not all(map(math.isfinite, values))):
        raise ConfigError(f"{flag(name)} must be comma-separated {'integers' if kind is int else 'numbers'}, "
                          f"e.g. {'0,1,2' if kind is int else '1,16,64'}; got {text!r}")
    return values


def writable_file(name: str, path: str) -> None:
    """`path` can be written at the end of a long run: its folder exists and it is no folder."""
    if not path:
        return
    target = Path(path).expanduser()
    if target.is_dir():
        raise ConfigError(f"{flag(name)} {path}: is a directory; name a file to write, e.g. {target / 'out.json'}")
    if not target.resolve().parent.is_dir():
        raise ConfigError(f"{flag(name)} {path}: the folder {target.resolve().parent} does not exist; create it "
                          "first (the file is written when the run ends)")


def field_docs(cls) -> dict[str, str]:
    """The docstring under each field of the dataclass `cls`, as its source has it (Python
    keeps none at run time): the one text for a field's --help and its documentation."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for stmt, after in zip(body, body[1:]):
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) \
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            docs[stmt.target.id] = " ".join(str(after.value.value).split())
    return docs
