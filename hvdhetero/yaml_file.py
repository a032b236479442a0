"""YAML files a user writes (inventory.yaml, a sweep's space file) read node by node: PyYAML's
plain load() forgets line numbers and silently keeps the last of duplicate keys, so the node
tree is composed instead and each scalar converted here, knowing where it came from. Every
error names the file, the line and the dotted key, and says what is allowed.
"""

from __future__ import annotations

import difflib
import math
from pathlib import Path
from typing import Any, Callable, Sequence

import yaml

from hvdhetero.errors import TOP, YamlFileError

KINDS = {"str": "a string", "int": "an integer", "float": "a number", "bool": "a boolean",
         "null": "empty", "timestamp": "a date"}


def got(node: yaml.Node) -> str:
    """How a message shows a rejected value: the text as written and what YAML made of it."""
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    return f"{node.value!r} ({KINDS.get(node.tag.rsplit(':', 1)[-1], node.tag)})"


def compose(path: Path, error: type[YamlFileError], missing: str, empty: str) -> yaml.Node:
    """The YAML node tree of the file; `error` (naming the file) if it is missing (`missing` says
    what to do), unreadable, not YAML, or empty (`empty` says what it needs)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        looked = "" if path.is_absolute() else f" (looked for {path.absolute()})"
        raise error(path, None, TOP, f"file not found{looked}; {missing}") from None
    except OSError as e:
        raise error(path, None, TOP, f"cannot read the file: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise error(path, None, TOP, f"not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        problem = getattr(e, "problem", None) or str(e)
        line = mark.line + 1 if mark else None
        raise error(path, line, TOP, f"not valid YAML: {problem}{_opened(e, line)}; check the indentation and quoting "
                    "here") from None
    if root is None:
        raise error(path, None, TOP, f"the file is empty; {empty}")
    return root


def _opened(e: yaml.YAMLError, line: int | None) -> str:
    """Where what PyYAML was reading began, when that is another line than the error's: an
    unclosed `[` is found only at the next line's key."""
    context, mark = getattr(e, "context", None), getattr(e, "context_mark", None)
    if not context or not context.startswith("while ") or mark is None or mark.line + 1 == line:
        return ""  # ("expected a single document in the stream": no place where something opened)
    closer = {"flow sequence": "']'", "flow mapping": "'}'", "quoted scalar": "closing quote"}
    what = context.removeprefix("while parsing a ").removeprefix("while scanning a ")
    hint = f": is its {closer[what]} missing?" if what in closer else ""
    return f" ({context} that starts on line {mark.line + 1}{hint})"


class Reader:
    """Turns the nodes of one file into values; every error (`error_type`) names the file, a line
    and a key."""

    error_type: type[YamlFileError] = YamlFileError

    def __init__(self, path: Path):
        self.path = path

    def error(self, node: yaml.Node, key: str, problem: str) -> YamlFileError:
        return self.error_type(self.path, node.start_mark.line + 1, key or TOP, problem)

    def mapping(self, node: yaml.Node, key: str, allowed: Sequence[str] | None, what: str = "") -> dict[str, tuple]:
        """{name: (key node, value node)}, rejecting duplicate keys and (if `allowed`) unknown ones;
        `what` says what the mapping maps (default: its allowed keys)."""
        if not isinstance(node, yaml.MappingNode):
            raise self.error(node, key, f"must be a mapping of {what or 'keys (' + ', '.join(allowed or ()) + ')'}, "
                             f"got {got(node)}")
        items: dict[str, tuple] = {}
        for k, v in node.value:
            if not isinstance(k, yaml.ScalarNode):
                raise self.error(k, key, f"keys must be plain names, got {got(k)}")
            dotted = f"{key}.{k.value}" if key else k.value
            if k.value in items:
                first = items[k.value][0].start_mark.line + 1
                raise self.error(k, dotted, f"{k.value!r} is set twice (first on line {first}); "
                                 "YAML would silently keep the last one, so delete one of them")
            if allowed is not None and k.value not in allowed:
                close = difflib.get_close_matches(k.value, allowed, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                allowed_keys = ", ".join(allowed)
                raise self.error(k, dotted, f"unknown key {k.value!r}; {hint}allowed keys: {allowed_keys}")
            items[k.value] = (k, v)
        return items

    def require(self, items: dict, names: Sequence[str], owner: yaml.Node, key: str) -> None:
        """Every one of `names` is in `items`; else an error on the line of `owner` (the parent key)."""
        for name in names:
            if name not in items:
                where = f"under {key}:" if key else "at the top level"
                dotted = f"{key}.{name}" if key else name
                raise self.error(owner, dotted, f"required key is missing; add {name}: {where}")

    def construct(self, node: yaml.Node, key: str, tags: Sequence[str], expected: str) -> Any:
        """The Python value of a scalar node whose YAML type is one of `tags`."""
        if not isinstance(node, yaml.ScalarNode) or node.tag.rsplit(":", 1)[-1] not in tags:
            raise self.error(node, key, f"must be {expected}, got {got(node)}")
        try:
            return yaml.constructor.SafeConstructor().construct_object(node)
        except (yaml.YAMLError, ValueError):  # an explicit tag on bad text, e.g. !!int abc
            raise self.error(node, key, f"must be {expected}, got {got(node)}") from None

    def integer(self, node: yaml.Node, key: str, low: int, high: int | None) -> int:
        expected = f"an integer >= {low}" if high is None else f"an integer from {low} to {high}"
        value = self.construct(node, key, ("int",), expected)  # the bool tag is not int: true is rejected
        if value < low or (high is not None and value > high):
            raise self.error(node, key, f"must be {expected}, got {got(node)}")
        return value

    def number(self, node: yaml.Node, key: str, low: float) -> float:
        expected = f"a number >= {low:g}"
        value = float(self.construct(node, key, ("int", "float"), expected))
        if not math.isfinite(value) or value < low:
            raise self.error(node, key, f"must be {expected}, got {got(node)}")
        return value

    def string(self, node: yaml.Node, key: str, rule: Callable[[str], Any], allowed: str) -> str:
        if isinstance(node, yaml.ScalarNode) and node.tag.endswith((":int", ":float")):
            # YAML reads 3.10 as the float 3.1: versions must be quoted to survive as written.
            raise self.error(node, key, f"must be {allowed}, got {got(node)}; quote it: \"{node.value}\"")
        value = self.construct(node, key, ("str",), allowed)
        if not rule(value):
            raise self.error(node, key, f"must be {allowed}, got {value!r}")
        return value
