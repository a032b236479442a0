"""A task's command-line options, declared once: as documented dataclass fields (JobConfig,
RecipeOptions, BenchOptions), whose defaults become the Invoke task's parameters and whose
docstrings become its `--help`, as torchtitan declares its config.

    TRAIN = Options(JobConfig.fields(exclude=...), RecipeOptions ..., hosts=Extra(None, "..."))

    @TRAIN.task()
    def train(c, **given): ...          # invoke train --help lists every option with its docstring

Adding an engine option is then one field with its docstring in JobConfig: `invoke train`,
`--resume` (which takes the run's own options) and the ranks get it from there.
Torch-free: the launcher imports it.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from dataclasses import MISSING, dataclass, fields
from typing import Any, Callable


@dataclass(frozen=True)
class Option:
    name: str
    default: Any
    help: str


def field_docs(cls: type) -> dict[str, str]:
    """Each field of dataclass `cls` with the string literal that follows it in the class body
    (its docstring), whitespace collapsed."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def from_fields(cls: type, only: tuple[str, ...] = (), exclude: tuple[str, ...] = (),
                prefix: str = "") -> list[Option]:
    """Options for the fields of dataclass `cls` (`only` these, in their order, or all but
    `exclude`), their defaults and docstrings (behind `prefix`)."""
    docs = field_docs(cls)
    by_name = {f.name: f for f in fields(cls)}
    missing = [n for n in (*only, *exclude) if n not in by_name]
    if missing:
        raise ValueError(f"{cls.__name__} has no fields {missing}")
    names = only or [n for n in by_name if n not in exclude]
    out = []
    for name in names:
        f = by_name[name]
        if f.default is MISSING:
            raise ValueError(f"{cls.__name__}.{name} has no plain default to put on the command line")
        if name not in docs:
            raise ValueError(f"{cls.__name__}.{name} has no docstring: an option's --help is its docstring")
        doc = docs[name]
        out.append(Option(name, f.default, prefix + (doc[:1].lower() + doc[1:] if prefix else doc)))
    return out


class Options:
    """A task's options in order: dataclass fields and the task's own (`Option`s)."""

    def __init__(self, *groups: list[Option] | Option):
        self.options: dict[str, Option] = {}
        for group in groups:
            for option in [group] if isinstance(group, Option) else group:
                if option.name in self.options:
                    raise ValueError(f"option --{option.name.replace('_', '-')} declared twice")
                self.options[option.name] = option

    @property
    def help(self) -> dict[str, str]:
        return {name: o.help for name, o in self.options.items()}

    def defaults(self, names=None) -> dict[str, Any]:
        return {n: o.default for n, o in self.options.items() if names is None or n in names}

    def signature(self) -> inspect.Signature:
        """c, then every option as a keyword parameter with its default (what Invoke parses)."""
        params = [inspect.Parameter("c", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        params += [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=o.default)
                   for n, o in self.options.items()]
        return inspect.Signature(params)

    def body(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn(c, **given)` with the options' signature (given: every option, defaults filled in)."""
        sig = self.signature()

        @functools.wraps(fn)
        def with_options(*args, **kwargs):
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            given = dict(bound.arguments)
            return fn(given.pop("c"), **given)

        with_options.__signature__ = sig
        del with_options.__wrapped__  # inspect.signature reads __signature__, not fn's
        return with_options
