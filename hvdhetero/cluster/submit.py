"""Start a job from the launcher: what `invoke train`, `invoke plan` and the time-to-accuracy
bench share, out of tasks.py so that it is one code with tests of its own.

    run_dir, results = submit(Request(hosts="h1,h2", script="train.py", settings={...}), runs=RUNS)

`submit` loads the inventory, picks the run directory, checks the request (bad input: exit 2
before anything starts), builds the horovodrun command, and unless it is a dry run checks the
remote hosts, ships the script's folder, writes launch.json (what --resume relaunches) and runs
the job under the supervisor (cluster/supervise.py), the watchdog's elastic side included.
`resumed` is `invoke train --resume`'s: the run's own request, with only the hosts allowed to
differ.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hvdhetero.cluster import inventory as inv
from hvdhetero.cluster import launch
from hvdhetero.cluster import run_dir as run_dirs
from hvdhetero.config import JobConfig
from hvdhetero.errors import ConfigError, HvdHeteroError


@dataclass
class Request:
    """What to run where: a script (or the built-in recipe's options) on inventory hosts, with
    the JobConfig settings every rank gets."""

    hosts: str | None
    inventory: str | None
    settings: dict[str, Any]
    script: str = ""
    workdir: str = ""
    recipe: list[str] = field(default_factory=list)
    """The built-in recipe's options (no script)."""
    script_args: list[str] = field(default_factory=list)
    """What followed `--` on the command line: the script's own arguments (or more recipe options)."""
    launcher: str = "horovodrun"
    """What starts the ranks: horovodrun (mpirun under pins.backend mpi) or ray (cluster/ray_cluster.py)."""
    ray_address: str = ""
    """With launcher ray: the cluster's IP:PORT (default: the one `invoke ray up` started)."""


class PreflightFailed(HvdHeteroError):
    """A host failed its pre-flight checks (the report above says which and how to fix it)."""

    def __init__(self, code: int):
        super().__init__("the pre-flight check failed: refusing to go on; fix the problems above")
        self.exit_code = code


def resumed(resume: str, runs: Path, hosts: str | None, inventory: str | None,
            changed: list[str], launcher: str = "", ray_address: str = "") -> tuple[Request, str]:
    """--resume RUN_DIR|latest: the run's own request from its launch.json (hosts, inventory and
    launcher as given, else the run's: the resume command a Ray run printed, without --launcher
    ray, relaunched it with horovodrun) and its folder; `changed` names the options given that a
    resume cannot change."""
    if changed:
        raise ConfigError(f"--resume continues the run with its own options; only --hosts, --inventory and "
                          f"--launcher may "
                          f"change, got {', '.join(changed)} (start a new run to change them)")
    run_dir, saved = run_dirs.resumable(resume, runs)
    if saved["script"] and not Path(saved["script"]).is_file():
        raise ConfigError(f"--resume {resume}: the run's script {saved['script']} (its {run_dirs.LAUNCH}) is not there "
                          "any more: put it back (a resume runs the same script with the same arguments), or start a "
                          "new run")
    return Request(hosts or saved["hosts"], inventory or saved.get("inventory") or None,
                   {**saved["settings"], "resume": True}, saved["script"],
                   saved["workdir"], saved["recipe"], saved["script_args"],
                   launcher or saved.get("launcher") or "horovodrun", ray_address), run_dir


def submit(request: Request, runs: Path, run_dir: str | None = None, *, name: str,
           recipe_check: Callable[[list[str], list], None] | None = None, dry_run: bool = False,
           verbose: bool = False, all_ranks: bool = False) -> tuple[str, list[dict]]:
    """Launch the request; returns the run directory and what rank 0 reported as results.
    `recipe_check(argv, hosts)` checks the built-in recipe's options (those after `--` too) before
    anything starts (recipes/options.py's check_argv: the launcher side imports no recipe). The
    horovodrun command is printed only with `dry_run` or `verbose`; the console shows rank 0's
    output (every rank's with `all_ranks`)."""
    script, settings = request.script, request.settings
    if request.workdir and not script:
        raise ConfigError(f"--workdir {request.workdir} goes with --script (the folder your script starts in); the "
                          "built-in recipe needs none")
    inventory = inv.load(request.inventory or inv.default_path())
    selected = inventory.select(request.hosts)
    run_dir = run_dirs.new(name, run_dir, runs)
    checked = not settings.get("resume") and not settings.get("plan_only") and selected[0].is_local
    if checked:  # (rank 0 on another host: its metrics and checkpoints are there, unchecked)
        run_dirs.fresh(run_dir)
    config = JobConfig(run_dir=run_dir, **settings)
    if config.tensorboard and selected[0].is_local and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("--tensorboard needs the tensorboard package here (rank 0's host): pip install "
                          "tensorboard (ci/setup installs it)")
    remote = not all(h.is_local for h in selected)
    if script:
        from hvdhetero.cluster import workdir as wd

        folder, rel = wd.locate(script, request.workdir,  # a remote host's newer Python may read what this cannot
                                syntax=any(h.is_local for h in selected) or inventory.pins.python == wd.THIS_PYTHON)
        digest = wd.digest(folder) if remote else None  # each host starts in its copy, named by content
        program = launch.script(rel, "~/" + wd.remote_dir(digest) if remote else str(folder), request.script_args)
    else:  # the recipe's options, those after -- too, checked here rather than on every rank
        if recipe_check is not None:
            recipe_check([*request.recipe, *request.script_args], selected)
        program = launch.recipe([*request.recipe, *request.script_args])
    if request.launcher == "ray":
        from hvdhetero.cluster import ray_cluster

        argv, env = ray_cluster.command(inventory, selected, config, program, request.ray_address or None)
    elif request.ray_address:
        raise ConfigError("--ray-address goes with --launcher ray")
    elif inventory.pins.mpi:
        from hvdhetero.cluster import mpi

        argv, env = mpi.command(inventory, selected, config, program)
    else:
        argv, env = launch.command(inventory, selected, config, program)
    if dry_run or verbose:
        print(launch.printable(argv, env))
    if dry_run:
        return run_dir, []
    launch.require(argv[0])  # (Ray's driver runs on the head: its own check)
    if remote:
        preflight(inventory, selected, accept_new=False)
        if script:
            for host, what in wd.ship(inventory, list(selected), folder, expect=digest).items():
                print(f"{host}: workdir {what}")
    if not settings.get("plan_only"):  # what --resume relaunches with (once the hosts passed their checks)
        run_dirs.write_launch(run_dir, [h.name for h in selected], selected[0].is_local,  # paths absolute: a
                              str(Path(script).resolve()) if script else "",  # resume may start elsewhere
                              str(Path(request.workdir).resolve()) if request.workdir else "",
                              request.recipe, request.script_args, settings,
                              str(Path(request.inventory or inventory.path).resolve()), request.launcher,
                              checked=checked)
    watch = None
    if config.elastic:  # the discovery script horovodrun runs, and the watchdog's elastic side
        from hvdhetero.cluster import elastic_hosts

        hosts = elastic_hosts.as_elastic_hosts(selected)
        elastic_hosts.write_discovery(Path(run_dir) / elastic_hosts.DISCOVERY, hosts, sys.executable)
        watch = elastic_hosts.Watch(hosts, config.min_hosts, elastic_hosts.kill_command(
            inventory, functools.partial(launch.ssh_argv, connect_s=5)))
    results = launch.run(argv, env, run_dir=None if settings.get("plan_only") else run_dir,
                         rank0_host=None if selected[0].is_local else selected[0].name, watch=watch,
                         rank_hosts=() if watch else launch.rank_hosts(selected), all_ranks=all_ranks,
                         stdin_pipe=request.launcher == "ray")
    if not settings.get("plan_only"):
        run_dirs.mark_ended(run_dir, results)  # every rank's script returned: what --resume says of the run
    return run_dir, results


def preflight(inventory, hosts, accept_new: bool) -> None:
    """`invoke check`'s checks, their report printed; PreflightFailed (its exit code) if a host fails."""
    from hvdhetero.cluster import preflight as checks

    results = checks.check(inventory, list(hosts), accept_new=accept_new)
    print(checks.report(results))
    code = checks.exit_code(results)
    if code:
        raise PreflightFailed(code)
