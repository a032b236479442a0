"""backend mpi: the `mpirun` command for a set of inventory hosts, as data `(argv, env)`, and the
ssh agent Open MPI starts its daemons through.

We build mpirun's command ourselves (`horovodrun --mpi` 0.28.1 passes a flag Open MPI 5 rejects
and forwards PATH/HOME, wrong on a Mac + PC pair). One app context per host, so each host runs
its own env's interpreter (`/Users/a/...` on a Mac, `/home/a/...` on a PC); TCP only and the same
on every host (`--mca pml ob1 --mca btl tcp,self`: the macOS wheel has nothing else); no core
binding (the ranks pin their own threads); `-x` only for our allowlisted variables, never the
launcher's whole environment. Open MPI reaches a remote host through `plm_rsh_agent`, this
module's `agent`: the same ssh as everything else (keys only, host key checked, each host's
user, port and key from the inventory) running the host's own env's `orted`.

Launcher side: never imports torch or horovod (`invoke train --dry-run` prints the command).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from hvdhetero.cluster import launch
from hvdhetero.cluster.inventory import Host, Inventory
from hvdhetero.config import JobConfig
from hvdhetero.errors import ConfigError, LaunchError

AGENT_HOSTS = "HVDHETERO_MPI_HOSTS"
"""The agent's table, {address: {"ssh": ssh argv, "env": the host's env path}}, in mpirun's
environment (the agent is mpirun's child; it is not forwarded to ranks)."""

TCP_ONLY = ["--mca", "pml", "ob1", "--mca", "btl", "tcp,self"]


def command(inventory: Inventory, hosts: Sequence[Host], config: JobConfig, program: Sequence[str],
            launcher_python: str = sys.executable, as_root: bool | None = None) -> tuple[list[str], dict[str, str]]:
    """(argv, env) of `mpirun` running the rank runner once per slot of `hosts`, one app context
    per host with that host's interpreter; `program` is launch.script(...)'s or recipe(...)'s."""
    check_hosts(inventory, hosts)
    if config.elastic:
        raise ConfigError(f"{inventory.path}: --elastic needs pins.backend: gloo (Horovod elastic re-forms the "
                          "job through Gloo's rendezvous; an MPI job's size is fixed at MPI_Init); drop --elastic "
                          "or set backend: gloo")
    mpirun = str(Path(launcher_python).parent / "mpirun")
    root = os.geteuid() == 0 if as_root is None else as_root
    env = {**launch.rank_env(config), "HOROVOD_CONTROLLER": "mpi", "HOROVOD_CPU_OPERATIONS": inventory.pins.mpi_ops,
           "HOROVOD_GLOO_TIMEOUT_SECONDS": str(launch.GLOO_TIMEOUT_S)}
    argv = [mpirun, *(["--allow-run-as-root"] if root else []), "--tag-output", "--bind-to", "none", *TCP_ONLY]
    remote = [h for h in hosts if not h.is_local]
    interfaces = {h.interface for h in hosts if h.interface}
    if interfaces and all(h.interface for h in hosts):
        # The daemons' list (mpirun's own NIC towards them included) may name NICs a host lacks;
        # the ranks' (btl) may not: a name unknown on a host disables TCP there and MPI_Init
        # fails, so each rank sets its own host's NIC (runner: OMPI_MCA_btl_tcp_if_include).
        daemons = {*interfaces, launch.launcher_interface(remote[0])} if remote else interfaces
        argv += ["--mca", "oob_tcp_if_include", ",".join(sorted(daemons))]
    if remote:
        env[AGENT_HOSTS] = json.dumps({h.address: {"ssh": launch.ssh_argv(inventory, h), "env": h.env}
                                       for h in remote}, sort_keys=True)
        # --noprefix: no daemon at the launcher's own env path; the agent runs each host's own.
        argv += ["--noprefix", "--mca", "plm_rsh_agent", f"{launcher_python} -m hvdhetero.cluster.mpi",
                 "--mca", "plm_rsh_no_tree_spawn", "1"]
    # -x in every app context: Open MPI 4.1 gave a later context's ranks on another host none of
    # the variables named before the first (rank 1 ran with Horovod's defaults, not ours).
    forwarded = [arg for name in sorted(env) if name != AGENT_HOSTS for arg in ("-x", name)]
    settings = replace(config, hosts=launch.host_settings(hosts)).to_json()
    for i, host in enumerate(hosts):
        argv += [*([":"] if i else []), *forwarded, "-np", str(host.slots), "-H", f"{host.address}:{host.slots}",
                 *launch.host_python(inventory, host), "-m", "hvdhetero.rank.runner", "--mpi-host", host.address, "--job-json", settings, *program]
    return argv, env


def check_hosts(inventory: Inventory, hosts: Sequence[Host]) -> None:
    """What an MPI job asks of its hosts, from the inventory alone. Unlike horovodrun, hosts may
    differ in env path, ssh user, port and key (the agent takes each host's own)."""
    launch.check_machines(inventory, hosts, "mpirun")
    named = [h for h in hosts if h.interface]
    if named and len(named) < len(hosts):
        bare = ", ".join(h.name for h in hosts if not h.interface)
        raise ConfigError(f"{inventory.path}: with backend mpi either every host names its `interface` or none "
                          f"does (Open MPI takes one list of NICs for all hosts); {bare} names none")


def remote_env(env: str) -> str:
    """A host's env path as its own shell reads it: `~/x` or `x` is under that host's home."""
    if env.startswith("/"):
        return env.rstrip("/")
    rel = env[2:] if env.startswith("~/") else env
    return '"$HOME"/' + rel.rstrip("/")  # the inventory admits only [A-Za-z0-9_./~+-] in env paths


def agent_command(table: dict, args: Sequence[str]) -> list[str]:
    """The ssh command for what Open MPI asked: `args` is [options..., HOST, command...]; the
    command (Open MPI's daemon) runs from the host's own env, with OPAL_PREFIX pointing there."""
    for i, arg in enumerate(args):
        if arg in table:
            host, command = table[arg], list(args[i + 1:])
            break
    else:
        raise LaunchError(f"the MPI ssh agent was asked for none of the job's hosts ({', '.join(table)}): "
                          f"{shlex.join(args)}")
    env = remote_env(host["env"])
    setup = f"OPAL_PREFIX={env}; export OPAL_PREFIX; PATH={env}/bin:$PATH; export PATH; "
    return [*host["ssh"], setup + " ".join(command)]


def main(argv: Sequence[str] | None = None) -> int:
    """`plm_rsh_agent`: ssh to the host Open MPI names, the inventory's way."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        ssh = agent_command(json.loads(os.environ[AGENT_HOSTS]), args)
    except (KeyError, ValueError, LaunchError) as err:
        print(f"hvdhetero mpi agent: {err}", file=sys.stderr)
        return 2
    os.execvp(ssh[0], ssh)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main())
