"""What `invoke sweep` was asked (the Request, kept as sweep.json), the `invoke train` command of
one trial, and the checks that refuse a sweep before it starts: a trial's own refusals, asked
for every host and each end of every parameter (exit 2, nothing written)."""

from __future__ import annotations

import math
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hvdhetero import checks
from hvdhetero.errors import ConfigError, LaunchError, SpaceError
from hvdhetero.sweep import space as spaces


@dataclass
class Request:
    """What `invoke sweep` was asked (sweep.json: --resume reads it back)."""

    inventory: str
    hosts: list[str]
    space: str
    trials: int
    metric: str = "test_loss"
    mode: str = "min"
    budget: int = 0
    """Epochs a trial runs (the recipe's --epochs; a script gets --epochs N); 0: the recipe's or the script's own."""
    prune: bool = False
    seed: int = 0
    script: str = ""
    workdir: str = ""
    recipe: list[str] = field(default_factory=list)
    script_args: list[str] = field(default_factory=list)
    env: str = ""
    """Each trial's invoke train --env (OMP_NUM_THREADS=1,...)."""
    enqueued: list[dict] = field(default_factory=list)
    """Parameters the first trials take, in order, before the sampler asks (invoke bench --sweep:
    the fastest host alone runs the very trials the sweep ran)."""

    def check(self) -> None:
        checks.integer("trials", self.trials)
        if self.trials < 1:
            raise ConfigError(f"--trials must be at least 1, got {self.trials}")
        checks.one_of("mode", self.mode, ("min", "max"))
        if not self.metric.isidentifier():
            raise ConfigError(f"--metric must be the name a script logs with job.log(NAME=...), got {self.metric!r}")
        if self.budget < 0:
            raise ConfigError(f"--budget must be epochs > 0 (0: the script's own), got {self.budget}")
        if self.env:
            from hvdhetero.config import env_items

            env_items(self.env)  # its own errors, naming --env

    def trial_args(self, space: spaces.Space, values: dict[str, Any]) -> list[str]:
        """What follows `--` in a trial's invoke train: the script's (or recipe's) arguments, the budget, the values."""
        budget = [space.option("epochs", self.budget)] if self.budget and self.script else []
        return [*self.script_args, *budget, *space.argv(values)]


def train_command(tasks_root: Path, request: Request, host: str, run_dir: Path, args: list[str],
                  dry_run: bool = False) -> list[str]:
    """One trial: invoke train on `host` alone."""
    what = ["--script", request.script, *(["--workdir", request.workdir] if request.workdir else [])] \
        if request.script else request.recipe
    return [sys.executable, "-m", "invoke", "--search-root", str(tasks_root), "train", "--inventory",
            request.inventory, "--hosts", host, "--run-dir", str(run_dir), *what,
            *(["--env", request.env] if request.env else []),
            *(["--dry-run"] if dry_run else []), "--", *args]


def extremes(space: spaces.Space) -> list[dict[str, Any]]:
    """Values that reach each end of every parameter (each choice), the others at their low end:
    what the checks before a sweep try. A conditional parameter's ends come with its conditions
    met (the earlier parameters it names at a value where it applies), and each set of values
    holds only the parameters that apply there, as a trial's would."""
    def low(p):
        return p.choices[0] if p.kind == "choice" else p.low

    by_name = {p.name: p for p in space.params}

    def met(values: dict[str, Any], p: spaces.Param) -> dict[str, Any]:
        for name, allowed, lo, hi in p.when:
            parent = by_name[name]
            if allowed is not None:
                values[name] = allowed[0]
            elif lo is not None:  # at its lowest where it applies (an int parent's next whole value)
                value = max(lo, parent.low)
                values[name] = math.ceil(value) if parent.kind == "int" else value
            elif hi is not None:
                value = min(hi, parent.high)
                values[name] = math.floor(value) if parent.kind == "int" else value
            values = met(values, parent)
        return values

    def used(values: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for p in space.params:
            if p.applies(out):
                out[p.name] = values[p.name]
        return out

    base = {p.name: low(p) for p in space.params}
    out = [used(base)]
    for p in space.params:
        for value in (p.choices[1:] if p.kind == "choice" else (p.high,)):
            out.append(used(met({**base, p.name: value}, p)))
        if p.when:  # its low end too, where it applies
            out.append(used(met(dict(base), p)))
    return out


def check_before(request: Request, space: spaces.Space, tasks_root: Path, recipe_check,
                 recipe_flags: list[str]) -> None:
    """Everything a trial would refuse, refused before the sweep starts (exit 2): a parameter the
    built-in recipe does not take (`recipe_flags`: its options), the recipe's checks
    (`recipe_check`) with each end of every parameter on every host, and invoke train's own
    checks of one trial per host (--dry-run: nothing contacted or written)."""
    request.check()
    if not request.script:
        from hvdhetero.cluster import inventory as inv

        for p in space.params:
            if f"--{p.name}" not in recipe_flags:
                raise SpaceError(space.path, p.line, p.name, f"the built-in recipe has no option --{p.name}; it "
                                 f"takes {', '.join(f[2:] for f in recipe_flags)} (or sweep your own --script)")
        hosts = inv.load(request.inventory).select(request.hosts)
        for values in extremes(space):
            for host in hosts:
                try:
                    recipe_check([*request.recipe, *request.trial_args(space, values)], [host])
                except ConfigError as err:
                    p = next((p for p in space.params if f"--{p.name}" in str(err)), space.params[0])
                    raise SpaceError(space.path, p.line, p.name, f"the built-in recipe refuses "
                                     f"{' '.join(space.argv(values))} on host {host.name}: {err}"
                                     f"{space.hint(str(err))}") from None
    for host in request.hosts:
        with tempfile.TemporaryDirectory(prefix="hvdhetero-sweep-check-") as scratch:  # a run folder, never made
            proc = subprocess.run(train_command(tasks_root, request, host, Path(scratch) / "trial",
                                                request.trial_args(space, extremes(space)[0]), dry_run=True),
                                  capture_output=True, text=True, timeout=120)
        if proc.returncode:
            said = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
            error = ConfigError if proc.returncode == 2 else LaunchError
            raise error(f"a trial on host {host} would fail: {said[-1] if said else f'exit {proc.returncode}'}")
