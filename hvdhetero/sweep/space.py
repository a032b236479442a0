"""A sweep's search space, read from the user's YAML file: one entry per parameter the training
script takes as its own argument (`--lr=0.003`), each with exactly one distribution.

    lr:        {loguniform: [1.0e-4, 1.0e-1]}
    dropout:   {uniform: [0.0, 0.5]}
    hidden:    {int: [32, 256], step: 32}        # or log: true (not both)
    optimizer: {choice: [adam, sgd]}
    compile:   {choice: [true, false]}            # --compile=True / --compile=False
    use_bn:    {choice: [true, false], flag: true}   # --use_bn / nothing (argparse's store_true)
    amp:       {choice: [true, false], flag: both}   # --amp / --no-amp (argparse's BooleanOptionalAction)
    layers:    {int: [1, 3]}
    units_l2:  {int: [4, 128], when: {layers: {min: 2}}}   # tried (and passed) only where layers >= 2
    momentum:  {uniform: [0.0, 0.99], when: {optimizer: [sgd]}}   # only where optimizer is sgd

    space = load("space.yaml")                   # SpaceError (file:line:key, exit 2) if anything is off
    space.argv({"lr": 0.003, "optimizer": "adam"})   -> ["--lr=0.003", "--optimizer=adam"]
    load("space.yaml", "train.py").argv(...)     -> ["lr=0.003", "optimizer=adam"] for a Hydra app
    space.distributions()                        -> Optuna's, for study.ask()
    space.ask(study)                             -> a trial with the space's values (a conditional one's in order)

Every check runs when the file is read, before a trial starts: a bad space launches nothing.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from hvdhetero import yaml_file
from hvdhetero.errors import SpaceError

KINDS = ("uniform", "loguniform", "int", "choice")
OPTUNAS = {"float": "uniform: [low, high] (loguniform: [low, high] where Optuna's suggest_float had log=True; step: "
                    "N for its step)",
           "categorical": "choice: [values] (Optuna's suggest_categorical)",
           "discrete_uniform": "uniform: [low, high] with step: N", "int_uniform": "int: [low, high]"}
"""Optuna's names for a distribution, and ours: a study brought over writes them first."""
"""The distributions: a float in [low, high]; a float whose log is uniform (low > 0); an integer
in [low, high]; one of a list of values."""
OPTIONS = {"uniform": ("step",), "loguniform": (), "int": ("step", "log"), "choice": ("flag",)}
"""What each distribution takes besides its own key: a grid step, (int) a log scale, or (a choice
of true and false) whether the option is a flag that takes no value: `true` for `--NAME` or nothing,
`both` for `--NAME` or `--no-NAME`."""
NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]*(\.[A-Za-z][A-Za-z0-9_-]*)*")
"""A parameter's name: it becomes the script's option --NAME; dotted, a nested setting's
(minGPT's `--trainer.learning_rate=3e-4`)."""
EXAMPLE = "e.g. lr: {loguniform: [1.0e-4, 1.0e-1]}"


@dataclass(frozen=True)
class Param:
    """One parameter of the space, as written."""

    name: str
    kind: str
    low: float | int | None = None
    high: float | int | None = None
    step: float | int | None = None
    log: bool = False
    choices: tuple = ()
    line: int = 0
    flag: bool | str = False
    """A choice of true and false for an option that takes no value: true passes `--NAME`; false
    nothing (True: argparse's store_true), or `--no-NAME` ("both": argparse's
    BooleanOptionalAction, click's `--NAME/--no-NAME`), which a flag whose default is on needs."""
    when: tuple = ()
    """Conditions on earlier parameters, all of which must hold for this one to be tried and passed:
    (name, values or None, min or None, max or None) each (Optuna's `if n_layers > i:
    trial.suggest_int(...)`, a parameter a trial's other values leave unused)."""

    def applies(self, values: dict[str, Any]) -> bool:
        """Whether this parameter is tried where the earlier ones took `values`."""
        for name, allowed, low, high in self.when:
            if name not in values:
                return False
            value = values[name]
            if (allowed is not None and value not in allowed) or (low is not None and value < low) or \
                    (high is not None and value > high):
                return False
        return True

    def arg(self, value: Any, overrides: bool = False) -> list[str]:
        """The script's argument for `value`, one word: ["--NAME=text"]. argparse, click and fire
        read it as `--NAME text`; nanoGPT's configurator (`--key=value` globals) reads only this
        form; and a negative value cannot pass for an option. A flag's: ["--NAME"], or none or
        ["--no-NAME"]. A Hydra app's (`overrides`): ["NAME=text"], a flag's too (true/false)."""
        if overrides:
            return [f"{self.name}={override_value(value)}"]
        if self.flag:
            return [f"--{self.name}"] if value else [f"--no-{self.name}"] if self.flag == "both" else []
        return [f"--{self.name}={format_value(value)}"]


@dataclass(frozen=True)
class Space:
    path: Path
    params: tuple[Param, ...]
    script: str = ""
    overrides: bool = False
    """The script is a Hydra app (`@hydra.main` in it: `hydra_app`): its arguments are overrides,
    `optimizer.lr=0.01 optimizer=adam`, which it reads without dashes."""

    def argv(self, values: dict[str, Any]) -> list[str]:
        """The script's arguments for one trial's values, in the file's order (a conditional parameter
        the trial did not try: none, the script's default stands)."""
        return [a for p in self.params if p.name in values for a in p.arg(values[p.name], self.overrides)]

    def ask(self, study):
        """A new trial of `study` with a value for each parameter: all at once (study.ask with the
        space's distributions), or where some are conditional, each in the file's order where its
        conditions hold on the values before it (define-by-run, as an Optuna objective suggests)."""
        if not any(p.when for p in self.params):
            return study.ask(self.distributions())
        trial, values = study.ask(), {}
        for p in self.params:
            if not p.applies(values):
                continue
            if p.kind == "choice":
                values[p.name] = trial.suggest_categorical(p.name, p.choices)
            elif p.kind == "int":
                values[p.name] = trial.suggest_int(p.name, p.low, p.high, step=p.step or 1, log=p.log)
            else:
                values[p.name] = trial.suggest_float(p.name, p.low, p.high, step=p.step, log=p.kind == "loguniform")
        return trial

    def option(self, name: str, value: Any) -> str:
        """An argument of the sweep's own for the script (the budget's epochs) in the script's form."""
        return f"{name}={format_value(value)}" if self.overrides else f"--{name}={format_value(value)}"

    def hint(self, said: str) -> str:
        """What to change in the space where a trial's error (`said`) is the script's argparse
        refusing one of its parameters, which every trial would meet: a flag given a value
        ("argument -b/--use_bn: ignored explicit argument 'True'"), a value it does not take
        ("argument --opt: invalid choice: 'True'", "invalid float value"), an option it does not
        have ("unrecognized arguments: --lr=0.01", "ambiguous option: --lr=0.01 could match
        --lr_decay, --lr_warmup"); a Hydra app's config without the key; "" otherwise."""
        if "[overrides ...]" in said and "unrecognized arguments: --" in said and not self.overrides:
            return (f"; the script is a Hydra app (its usage ends in [overrides ...]), which takes key=value without "
                    f"dashes, but no @hydra.main was recognised in {self.script or 'the script'}: sweep the file that "
                    "has it (--script), and each trial passes NAME=VALUE")
        if self.overrides:
            return self._hydra_hint(said)
        for p in self.params:
            where = f"in {self.path} (line {p.line})"
            refused = re.search(rf"argument (?:\S+/)?--{re.escape(p.name)}: (.+)$", said)
            if refused and "ignored explicit argument" in refused.group(1) and p.kind == "choice" and not p.flag:
                return (f"; --{p.name} is a flag, which takes no value: write `{p.name}: {{choice: [true, false], "
                        f"flag: true}}` {where}, and each trial passes --{p.name} or nothing")
            if refused:
                return (f"; the script refuses a value of {p.name} ({refused.group(1).strip()}): give {p.name} {where} "
                        "only values the script takes")
            unknown = said.partition("unrecognized arguments:")[2].split()
            if p.flag == "both" and f"--no-{p.name}" in unknown:
                return (f"; the script has no --no-{p.name}: --{p.name} is a flag that is off unless given (argparse's "
                        f"store_true): write `flag: true` for {p.name} {where}, and each trial passes --{p.name} "
                        "or nothing")
            ambiguous = re.search(rf"ambiguous option: --{re.escape(p.name)}(=\S*)? could match", said)
            if ambiguous or any(a == f"--{p.name}" or a.startswith(f"--{p.name}=") for a in unknown):
                return (f"; the script has no option --{p.name}: name {p.name} {where} as the script's own option "
                        "(its --help lists them)")
        return ""

    def _hydra_hint(self, said: str) -> str:
        """What to change where a Hydra app refused a trial's overrides: a key its config lacks (the
        budget's `epochs` among them), an option its config group lacks."""
        missing = re.search(r"Could not override '([^']+)'|Key '([^']+)' is not in struct", said)
        key = missing and (missing.group(1) or missing.group(2))
        group = re.search(r"Could not find '([^']+)/([^'/]+)'", said)
        for p in self.params:
            where = f"in {self.path} (line {p.line})"
            if p.name == key:
                return (f"; the script's config has no key {key}: name {key} {where} as in its config (--cfg job "
                        f"prints it), or +{key} to add it")
            if group and p.name == group.group(1):
                return (f"; the script's config group {p.name} has no option {group.group(2)}: give {p.name} {where} "
                        f"only the group's options (the files of its {p.name}/ folder)")
        if key == "epochs":
            return ("; the script's config has no key epochs, which --budget sets (epochs=N): leave --budget out, or "
                    "give its config an epochs key")
        return ""

    def distributions(self) -> dict:
        """Optuna's distributions of the space (for study.ask(fixed_distributions=...))."""
        from optuna import distributions as d

        out = {}
        for p in self.params:
            if p.kind == "choice":
                out[p.name] = d.CategoricalDistribution(p.choices)
            elif p.kind == "int":
                out[p.name] = d.IntDistribution(p.low, p.high, log=p.log, step=p.step or 1)
            else:
                out[p.name] = d.FloatDistribution(p.low, p.high, log=p.kind == "loguniform", step=p.step)
        return out


def format_value(value: Any) -> str:
    """A value as the script reads it back: floats exactly (repr), booleans as Python writes them
    (True/False: nanoGPT's configurator evaluates them as literals, a `str2bool` type lowercases
    them, click's BOOL takes either case), the rest as written."""
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def hydra_app(script: str) -> bool:
    """Whether `script` is a Hydra app: it decorates a function with hydra's main, however it
    imported it (`import hydra [as h]` and `@hydra.main(`, `from hydra import main [as m]` and
    `@main(`)."""
    try:
        text = Path(script).read_text(errors="replace") if script else ""
    except OSError:
        return False
    names = [rf"{re.escape(m)}\.main" for m in ["hydra", *re.findall(r"^\s*import\s+hydra\s+as\s+(\w+)", text, re.M)]
             if re.search(r"^\s*import\s+(.*,\s*)?hydra\b", text, re.M)]
    names += [re.escape(m or "main") for m in
              re.findall(r"^\s*from\s+hydra\s+import\s+.*\bmain\b(?:\s+as\s+(\w+))?", text, re.M)]
    return bool(names) and re.search(rf"^\s*@\s*({'|'.join(names)})\s*\(", text, re.M) is not None


HYDRA_PLAIN = re.compile(r"[A-Za-z_][\w./-]*")
"""A string a Hydra override takes as it is; any other (a comma, a space, brackets, a number's
text, null) is quoted."""


def override_value(value: Any) -> str:
    """A value as a Hydra override reads it back: a string quoted where its grammar would read it
    otherwise (`'a,b'` is no list, `'1e-3'` no float, `'null'` no None)."""
    if isinstance(value, str) and (not HYDRA_PLAIN.fullmatch(value) or value.lower() in ("null", "true", "false",
                                                                                         "nan", "inf")):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return format_value(value)


def load(path: str | Path, script: str = "") -> Space:
    """Read and check a space file; SpaceError names the file, line and key of the first problem.
    `script`: the script the sweep runs (a Hydra app takes its values as overrides)."""
    return dataclasses.replace(_load(Path(path)), script=script, overrides=hydra_app(script))


def _load(path: Path) -> Space:
    root = yaml_file.compose(path, SpaceError, f"write one, {EXAMPLE} (one line per parameter)",
                             f"it needs at least one parameter, {EXAMPLE}")
    reader = _Reader(path)
    entries = reader.mapping(root, "", None, what="parameter names to distributions")
    if not entries:
        raise reader.error(root, "", f"names no parameter; {EXAMPLE}")
    params: dict[str, Param] = {}
    for name_node, node in entries.values():
        params[name_node.value] = reader.param(name_node, node, params)
    return Space(path, tuple(params.values()))


class _Reader(yaml_file.Reader):
    error_type = SpaceError

    def param(self, name_node: yaml.Node, node: yaml.Node, before: dict[str, Param]) -> Param:
        name = name_node.value
        if not NAME.fullmatch(name):
            raise self.error(name_node, name, "a parameter's name becomes the script's option --NAME: a letter, "
                             "then letters, digits, '_' or '-', dotted for a nested setting (trainer.lr)")
        allowed = (*KINDS, "step", "log", "flag", "when")
        for key, _ in node.value if isinstance(node, yaml.MappingNode) else ():
            if isinstance(key, yaml.ScalarNode) and key.value in OPTUNAS:
                raise self.error(key, name, f"{key.value!r} is Optuna's name: write {OPTUNAS[key.value]}")
        items = self.mapping(node, name, allowed, what="one distribution (uniform, loguniform, int or choice) "
                             "and its options")
        kinds = [k for k in KINDS if k in items]
        if len(kinds) != 1:
            named = f"it names {' and '.join(kinds)}" if kinds else "it names none"
            raise self.error(node, name, f"needs exactly one distribution of {', '.join(KINDS)}; {named}")
        kind = kinds[0]
        when = self.when(items["when"], name, before) if "when" in items else ()
        for option in ("step", "log", "flag"):
            if option in items and option not in OPTIONS[kind]:
                takes = ", ".join(OPTIONS[kind]) or "nothing"
                raise self.error(items[option][0], f"{name}.{option}", f"{kind} takes {takes} besides its "
                                 f"{'values' if kind == 'choice' else 'range'}"
                                 + ("; for a log scale use loguniform" if option == "log" and kind == "uniform"
                                    else ""))
        key = f"{name}.{kind}"
        line = name_node.start_mark.line + 1
        if kind == "choice":
            choices = self.choices(items[kind][1], key)
            forms = (f"true (--{name} or nothing), false or both (--{name} or --no-{name}, argparse's "
                     "BooleanOptionalAction)")
            flag = "flag" in items and self.construct(items["flag"][1], f"{name}.flag", ("bool", "str"), forms)
            if isinstance(flag, str) and flag != "both":
                raise self.error(items["flag"][1], f"{name}.flag", f"must be {forms}, got {flag!r}")
            if flag and not all(isinstance(c, bool) for c in choices):
                raise self.error(items["flag"][1], f"{name}.flag", "a flag (--NAME or nothing) is a choice of true "
                                 f"and false; {name} lists {', '.join(map(format_value, choices))}")
            return Param(name, kind, choices=choices, line=line, flag=flag, when=when)
        integer = kind == "int"
        low, high = self.bounds(items[kind][1], key, integer)
        if kind == "loguniform" and low <= 0:
            raise self.error(items[kind][1], key, f"a log scale needs low > 0, got {format_value(low)}")
        log = False
        if "log" in items:
            log = self.construct(items["log"][1], f"{name}.log", ("bool",), "true or false")
            if log and low <= 0:
                raise self.error(items["log"][1], f"{name}.log", f"a log scale needs low > 0, got {low}")
        step = None
        if "step" in items:
            step_key = f"{name}.step"
            if log:
                raise self.error(items["step"][1], step_key, "log and step do not go together (Optuna takes one "
                                 "or the other); drop one")
            step = (self.integer(items["step"][1], step_key, 1, None) if integer else
                    self.positive(items["step"][1], step_key))
            if step > high - low:
                raise self.error(items["step"][1], step_key, f"is larger than the range {format_value(low)} .. "
                                 f"{format_value(high)}")
        return Param(name, kind, low, high, step, log, line=line, when=when)

    def when(self, item: tuple, name: str, before: dict[str, Param]) -> tuple:
        """A parameter's `when:`: each earlier parameter it depends on, with the values (a list) or
        the range ({min: .., max: ..}, for a number) in which this one is tried."""
        key_node, node = item
        key = f"{name}.when"
        shape = "e.g. when: {n_layers: {min: 2}} or when: {optimizer: [sgd]}"
        entries = self.mapping(node, key, None, what=f"earlier parameters to the values they must take ({shape})")
        if not entries:
            raise self.error(node, key, f"names no parameter; {shape}")
        out = []
        for parent_node, condition in entries.values():
            parent = before.get(parent_node.value)
            where = f"{key}.{parent_node.value}"
            if parent is None:
                raise self.error(parent_node, where, f"{parent_node.value!r} is no parameter above {name} in the file: "
                                 "a condition names one written before it (whose value is known by then)")
            if isinstance(condition, yaml.SequenceNode):
                values = self.choices(condition, where)
                if parent.kind == "choice":
                    bad = [v for v in values if v not in parent.choices]
                    if bad:
                        raise self.error(condition, where, f"{format_value(bad[0])} is none of {parent.name}'s "
                                         f"choices ({', '.join(map(format_value, parent.choices))})")
                elif parent.kind != "int" or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
                    raise self.error(condition, where, f"{parent.name} is a number in a range: give the range, "
                                     "{min: .., max: ..}" + (" (or a list of its integers)" if parent.kind == "int"
                                                             else ""))
                out.append((parent.name, values, None, None))
                continue
            if parent.kind == "choice":
                raise self.error(condition, where, f"{parent.name} is a choice: list the values in which {name} is "
                                 f"tried, e.g. [{format_value(parent.choices[0])}]")
            bounds = self.mapping(condition, where, ("min", "max"), what="{min: .., max: ..} (either or both)")
            if not bounds:
                raise self.error(condition, where, "give min, max or both")
            low, high = (self.construct(bounds[b][1], f"{where}.{b}", ("int", "float"), "a number")
                         if b in bounds else None for b in ("min", "max"))
            out.append((parent.name, None, low, high))
        return tuple(out)

    def bounds(self, node: yaml.Node, key: str, integer: bool) -> tuple:
        what = "integers" if integer else "numbers"
        if not isinstance(node, yaml.SequenceNode) or len(node.value) != 2:
            raise self.error(node, key, f"must be a list of two {what}, [low, high], got "
                             f"{yaml_file.got(node) if not isinstance(node, yaml.SequenceNode) else f'{len(node.value)} values'}")
        tags = ("int",) if integer else ("int", "float")
        low, high = (self.construct(n, key, tags, f"{what[:-1]} (low and high are {what})") for n in node.value)
        if not integer:
            low, high = float(low), float(high)
            if not (math.isfinite(low) and math.isfinite(high)):
                raise self.error(node, key, "low and high must be finite numbers")
        if low >= high:
            raise self.error(node, key, f"low must be below high, got [{format_value(low)}, {format_value(high)}]")
        return low, high

    def positive(self, node: yaml.Node, key: str) -> float:
        value = float(self.construct(node, key, ("int", "float"), "a number > 0"))
        if not (math.isfinite(value) and value > 0):
            raise self.error(node, key, f"must be a number > 0, got {yaml_file.got(node)}")
        return value

    def choices(self, node: yaml.Node, key: str) -> tuple:
        if not isinstance(node, yaml.SequenceNode) or not node.value:
            raise self.error(node, key, "must be a non-empty list of values, e.g. [adam, sgd]")
        values, seen = [], {}
        for entry in node.value:
            value = self.construct(entry, key, ("str", "int", "float", "bool"), "a plain value (text, number or "
                                   "true/false)")
            text = format_value(value)
            if text in seen:
                raise self.error(entry, key, f"{text!r} is listed twice (first on line {seen[text]})")
            seen[text] = entry.start_mark.line + 1
            values.append(value)
        return tuple(values)
