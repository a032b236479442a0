"""Each option declared once (hvdhetero/options.py): a documented dataclass field is an option
of the Invoke task with its default and its docstring as --help, and nothing else needs writing."""

from __future__ import annotations

from dataclasses import dataclass, fields

import pytest
from invoke.tasks import Task

from conftest import VENV_BIN, run_cmd
from hvdhetero.config import JobConfig
from hvdhetero.options import Option, Options, field_docs, from_fields


@dataclass(frozen=True)
class Settings:
    steps: int = 8
    """Timed steps (at least)."""
    label: str = "x"
    """A name,
    on two lines."""


def test_a_documented_field_becomes_a_task_option_with_its_default_type_and_help():
    declared = Options(from_fields(Settings), Option("dry_run", False, "print and exit"))
    seen = {}

    @declared.body
    def job(c, **given):
        seen.update(given)

    task = Task(job, help=declared.help)
    arguments = {a.name: a for a in task.get_arguments()}
    assert set(arguments) == {"steps", "label", "dry_run"}
    assert arguments["steps"].kind is int and arguments["steps"].default == 8
    assert arguments["label"].help == "A name, on two lines." and arguments["dry_run"].kind is bool
    job(None, steps=3)
    assert seen == {"steps": 3, "label": "x", "dry_run": False}


def test_a_field_without_a_docstring_or_declared_twice_is_refused():
    @dataclass
    class Bare:
        n: int = 1

    with pytest.raises(ValueError, match="Bare.n has no docstring"):
        from_fields(Bare)
    with pytest.raises(ValueError, match="--steps declared twice"):
        Options(from_fields(Settings), Option("steps", 1, "again"))


def test_every_engine_option_is_a_train_option_documented_by_its_field():
    """A JobConfig field is an `invoke train` option, its --help the field's docstring."""
    out = run_cmd([VENV_BIN / "invoke", "--help", "train"], timeout=60).stdout
    docs = field_docs(JobConfig)
    engine = [f.name for f in fields(JobConfig) if f.name not in ("run_dir", "overlap", "resume", "plan_only",
                                                                   "hosts")]
    for name in engine:
        flag = "--" + name.replace("_", "-")
        assert flag in out, flag
        assert docs[name].split()[0] in out.split(flag, 1)[1][:200], (flag, docs[name])
    assert "--dataset" in out and "built-in recipe: digits" in out
