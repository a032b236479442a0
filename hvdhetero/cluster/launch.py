"""The horovodrun command for a set of inventory hosts, as data: `(argv, env)`.

`command()` is pure (tests assert on its list, `--dry-run` prints it); `run()` executes it
(cluster/supervise.py, re-exported here with the rest of what running a job needs).
Launcher side: never imports torch or horovod, so `invoke train --dry-run` starts instantly.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from dataclasses import replace

from hvdhetero import netinfo
from hvdhetero.cluster import checkout, console, elastic_hosts
from hvdhetero.config import JobConfig, env_items
from hvdhetero.errors import ConfigError
from hvdhetero.cluster.inventory import Host, Inventory
# Running the command lives in supervise.py; tasks.py, bench/ and tests call it as launch.run etc.
from hvdhetero.cluster.supervise import (EXIT_LINE, FORWARDED, SSH_LOST, died, forwarded_env, require,  # noqa: F401
                                         resume_hint, run)

# Every network wait of a job is bounded: the rendezvous and Gloo's own operations.
START_TIMEOUT_S = 120
GLOO_TIMEOUT_S = 120

# Horovod's background thread negotiates with every other rank once a cycle, whether or not
# anything is queued; at its default of 1 ms that took ~16% of a one-core host's compute
# (digits, 8 Mbit, diloco:64: 147 us a sample on the fast rank against 123 us at 5 ms,
# the same as 20 and 50 ms). Step sync runs as fast at 5 ms as at 1 ms (`invoke bench
# --cycle-time-ms 1|5` on h1,h2: 9,312 / 9,319 samples/s). `invoke bench` times at it too.
CYCLE_TIME_MS = 5

RANK_ENV = {
    "PYTHONUNBUFFERED": "1",  # rank output reaches the console as it happens
    "PYTORCH_ENABLE_MPS_FALLBACK": "1",  # MPS ranks: run unsupported ops on the CPU
    # A collective that some rank never joins (a dead or diverged peer): Horovod warns after 60 s
    # (the console says it in words) and is asked to shut down after 120 s, which it did not
    # always do; a rank's own wait is bounded too (rank/reducer.py COLLECTIVE_TIMEOUT_S).
    "HOROVOD_STALL_CHECK_TIME_SECONDS": str(console.STALL_CHECK_S),  # its warning is said in words there
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": str(console.STALL_SHUTDOWN_S),
    "HOROVOD_CYCLE_TIME": str(CYCLE_TIME_MS),
}


def rank_env(config: JobConfig) -> dict[str, str]:
    """What every rank's environment gets: RANK_ENV and the user's --env (NAME alone takes its
    value here: ConfigError if this shell has none)."""
    env = dict(RANK_ENV)
    for name, value in env_items(config.env):
        if value is None and name not in os.environ:
            raise ConfigError(f"--env {name}: not set in this shell (export it, or give it a value: "
                              f"--env {name}=VALUE)")
        env[name] = os.environ[name] if value is None else value
    return env


def env_python(inventory: Inventory, host: Host) -> str:
    """The interpreter of `host`'s env: a local relative env lives next to the inventory;
    a remote one is left as written (`~` and relative paths mean that host's home)."""
    if not host.is_local:
        return f"{host.env.rstrip('/')}/bin/python"
    env = Path(os.path.expanduser(host.env))
    if not env.is_absolute():
        env = inventory.path.parent.resolve() / env
    return str(env / "bin" / "python")


def host_settings(hosts: Sequence[Host]) -> dict[str, dict]:
    """What each rank needs to know about its own host, keyed by the name horovodrun uses.
    Hosts that are this machine under several names (--elastic runs the local host's slots as
    localhost and 127.0.0.1) get their share of its cores, [index, count], as ranks of one host
    get theirs from Horovod's local rank and size."""
    local = [h.address for h in hosts if h.is_local]
    return {
        h.address: {"name": h.name, "device": h.device, "interface": h.interface, "slowdown": h.slowdown,
                    "max_batch": h.max_batch,
                    **({"machine_share": [local.index(h.address), len(local)]} if len(local) > 1 and h.is_local
                       else {})}
        for h in hosts
    }


def rank_hosts(hosts: Sequence[Host]) -> list[str]:
    """Each rank's host name, in rank order, as horovodrun places them without --elastic
    (-H a:2,b:1: ranks 0-1 on a, rank 2 on b)."""
    return [h.name for h in hosts for _ in range(h.slots)]


RECIPE = "hvdhetero.recipes.train"
"""The built-in training script (a user of the public API like any other)."""


def command(inventory: Inventory, hosts: Sequence[Host], config: JobConfig, program: Sequence[str],
            launcher_python: str = sys.executable) -> tuple[list[str], dict[str, str]]:
    """(argv, env) of `horovodrun --gloo` running a training script on `hosts`, one rank per
    slot, through the rank-side runner: `program` is `script(...)`'s or `recipe(...)`'s list."""
    check_hosts(inventory, hosts)
    discovery = None
    if config.elastic:  # a local host's slots run as hosts of their own (Horovod drops whole hosts)
        hosts = elastic_hosts.as_elastic_hosts(hosts)
        discovery = (Path(config.run_dir) / elastic_hosts.DISCOVERY, config.min_hosts)
    settings = replace(config, hosts=host_settings(hosts)).to_json()
    return job(inventory, hosts, ["hvdhetero.rank.runner", "--job-json", settings, *program], launcher_python,
               hosts_json=False, elastic_discovery=discovery, env=rank_env(config))


def recipe(args: Sequence[str]) -> list[str]:
    """The runner's arguments for the built-in recipe with its own `args`."""
    return ["--module", RECIPE, "--", *args]


def script(path: str, workdir: str, args: Sequence[str]) -> list[str]:
    """The runner's arguments for a user's script at `path` (relative to `workdir`, where each
    rank starts; ~ is each host's home) with its own `args`."""
    return ["--workdir", workdir, "--script", path, "--", *args]


def bench_command(inventory: Inventory, hosts: Sequence[Host], flags: Sequence[str],
                  launcher_python: str = sys.executable) -> tuple[list[str], dict[str, str]]:
    """(argv, env) of the benchmark job (hvdhetero.bench.throughput) on `hosts`."""
    return job(inventory, hosts, ["hvdhetero.bench.throughput", *flags], launcher_python)


def job(inventory: Inventory, hosts: Sequence[Host], module_and_flags: Sequence[str],
        launcher_python: str = sys.executable, hosts_json: bool = True,
        elastic_discovery: tuple[Path, int] | None = None,
        env: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """(argv, env) of `horovodrun --gloo` running `python -m MODULE FLAGS` once per slot; with
    `elastic_discovery` (the discovery script's path, --min-hosts) in elastic mode."""
    if elastic_discovery is None:
        check_hosts(inventory, hosts)
    local = [h for h in hosts if h.is_local]
    argv = [
        launcher_python, "-m", "hvdhetero.cluster.horovodrun",  # horovodrun, less a 1.5-s self-check
        *(elastic_hosts.flags(hosts, *elastic_discovery) if elastic_discovery else
          ["-np", str(sum(h.slots for h in hosts)), "-H", ",".join(f"{h.address}:{h.slots}" for h in hosts)]),
        "--gloo",
        "--start-timeout", str(START_TIMEOUT_S),
        "--gloo-timeout-seconds", str(elastic_hosts.gloo_timeout() if elastic_discovery else GLOO_TIMEOUT_S),
    ]
    env = dict(RANK_ENV if env is None else env)
    if local:
        python = [local_python(inventory, hosts[0])]
    else:
        argv += ssh_flags(inventory, hosts)
        env["HOROVOD_SSH_OPTIONS"] = ssh_options(inventory, keepalive=elastic_discovery is not None)
        python = remote_python(hosts[0].env)
    argv += [*python, "-m", *module_and_flags]
    if hosts_json:
        argv += ["--hosts-json", json.dumps(host_settings(hosts), sort_keys=True)]
    return argv, env


def local_python(inventory: Inventory, host: Host) -> str:
    """The local `host`'s env interpreter; ConfigError with the fix if there is none."""
    python = env_python(inventory, host)
    if not Path(python).exists():
        ours = checkout.VENV
        fix = (f"set `env: {ours}` for it (relative paths start at the inventory file's directory; this "
               "checkout's env is there)" if (ours / "bin" / "python").exists() and Path(python).parents[1] != ours
               else "run ci/setup, or fix env: (relative paths start at the inventory file's directory)")
        raise ConfigError(f"{inventory.path}: host '{host.name}' has env {host.env!r}, but {python} does not "
                          f"exist; {fix}")
    return python


def host_python(inventory: Inventory, host: Host) -> list[str]:
    """`host`'s env interpreter as the start of a command run on that host: the local path (it must
    exist), or what the remote shell runs (remote_python)."""
    return [local_python(inventory, host)] if host.is_local else remote_python(host.env)


def check_machines(inventory: Inventory, hosts: Sequence[Host], launcher: str) -> None:
    """What any job's `launcher` (horovodrun, mpirun) asks of its hosts: some, each machine once,
    and this machine alone or not at all."""
    if not hosts:
        raise ConfigError(f"{inventory.path}: no hosts selected; name some with --hosts")
    addresses = [h.address for h in hosts]
    shared = [h.name for h in hosts if addresses.count(h.address) > 1]
    if shared:
        raise ConfigError(f"{inventory.path}: hosts {', '.join(shared)} share an address; {launcher} needs one "
                          "entry per machine (raise `slots` instead)")
    local = [h for h in hosts if h.is_local]
    if local and len(hosts) > 1:
        raise ConfigError(f"{inventory.path}: host '{local[0].name}' is this machine (address "
                          f"{local[0].address}); a multi-host job needs every host's LAN address")


def check_hosts(inventory: Inventory, hosts: Sequence[Host]) -> None:
    """What one horovodrun job asks of the hosts it runs on, from the inventory alone (nothing
    contacted): `invoke check` refuses the same hosts `invoke train` would, naming them."""
    check_machines(inventory, hosts, "horovodrun")
    if len({h.env for h in hosts}) > 1:
        raise ConfigError(f"{inventory.path}: horovodrun runs one command on every host, but the hosts' envs "
                          f"differ ({_each(hosts, 'env')}); give them the same `env` path")
    if len({h.port for h in hosts}) > 1 or len({h.identity for h in hosts}) > 1:
        raise ConfigError(f"{inventory.path}: horovodrun uses one ssh port and one key for all hosts, but the "
                          f"selected hosts differ (port {_each(hosts, 'port')}; identity "
                          f"{_each(hosts, 'identity')}); align them or use an ~/.ssh/config Host entry per host")


def _each(hosts: Sequence[Host], key: str) -> str:
    """Every host's value of `key`: "mac: .venv, pc: /opt/env"."""
    return ", ".join(f"{h.name}: {getattr(h, key)}" for h in hosts)


def remote_python(env: str) -> list[str]:
    """The env's python on every host. A path under ~ or relative names each host's home, which
    differs (/Users/a on a Mac, /home/a on Linux), so the host's own shell expands $HOME."""
    if env.startswith("/"):
        return [f"{env.rstrip('/')}/bin/python"]
    rel = env[2:] if env.startswith("~/") else env
    # The inventory only admits [A-Za-z0-9_./~+-] in env paths: safe inside this script.
    return ["sh", "-c", f'exec "$HOME"/{rel.rstrip("/")}/bin/python "$@"', "sh"]


def ssh_flags(inventory: Inventory, hosts: Sequence[Host]) -> list[str]:
    """horovodrun's ssh port, identity and NIC list: it takes one port and one key for all hosts."""
    flags = []
    ports, keys = {h.port for h in hosts}, {h.identity for h in hosts}  # one each: check_hosts saw to it
    if ports != {22}:
        flags += ["--ssh-port", str(ports.pop())]
    if keys != {None}:
        flags += ["--ssh-identity-file", os.path.expanduser(keys.pop())]
    # horovodrun binds its rendezvous server to the address of "the first" NIC given, looked up
    # on the launcher (and it keeps them in a set: any one may come first), so name only the
    # launcher's own NIC towards the hosts; each rank then sets its host's NIC (train.py).
    return flags + ["--network-interfaces", launcher_interface(hosts[0])]


def launcher_interface(host: Host) -> str:
    """This machine's NIC towards `host` (what a launcher's own servers must listen on)."""
    nic = netinfo.interface_towards(host.address)
    if nic is None:
        raise ConfigError(f"cannot tell which network interface of this machine reaches {host.name} "
                          f"({host.address}); is it on this network?")
    return nic


def ssh_options(inventory: Inventory, keepalive: bool = False) -> str:
    """Options for horovodrun's ssh (our Horovod patch 0004), one shell string: keys only, host
    keys checked. With `keepalive` (--elastic) the ssh session of a rank whose host stops
    answering ends after 20 s, so that Horovod sees that rank fail and drops its host (it waits
    on a frozen one forever)."""
    return shlex.join(ssh_option_args(inventory, keepalive))


def ssh_option_args(inventory: Inventory, keepalive: bool = False) -> list[str]:
    """ssh_options as argv words (a known_hosts path with a space in it stays one word)."""
    known = os.path.expanduser(inventory.known_hosts or "~/.ssh/known_hosts")
    if any(c.isspace() for c in known):  # ssh reads this option's value as a list of files
        known = f'"{known}"'
    alive = ["ServerAliveInterval=5", "ServerAliveCountMax=4"] if keepalive else []
    options = ["BatchMode=yes", "PasswordAuthentication=no", "StrictHostKeyChecking=yes",
               f"UserKnownHostsFile={known}", f"ConnectTimeout={START_TIMEOUT_S // 4}", *alive]
    return [word for option in options for word in ("-o", option)]


def printable(argv: Sequence[str], env: dict[str, str]) -> str:
    """The command as one shell line a user can copy."""
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items())), *map(shlex.quote, argv)])


def push_command(inventory: Inventory, host: Host, src: str, dest: str) -> list[str]:
    """rsync over ssh pushing directory `src` to `dest` on `host` (relative = its home), with
    the same ssh rules as everything else: keys only, host key checked, no prompt."""
    ssh = ssh_argv(inventory, host, with_target=False)
    target = f"{host.user + '@' if host.user else ''}{host.address}"
    if ":" in host.address:
        target = f"{host.user + '@' if host.user else ''}[{host.address}]"
    # --protect-args: the remote path reaches the remote side as data, not through its shell.
    return ["rsync", "-a", "--protect-args", "--timeout=60", "-e", shlex.join(ssh),
            src.rstrip("/") + "/", f"{target}:{dest}"]


def push(inventory: Inventory, hosts: Sequence[Host], src: str, dest: str) -> dict[str, str]:
    """`invoke push-data`: rsync folder `src` to `dest` on every remote host (local ones have it);
    per host the error ("" when it worked). ConfigError if `src` is no folder."""
    if not Path(src).is_dir():
        raise ConfigError(f"{src} is not a directory (push-data --src names the folder to push)")
    errors = {}
    for host in hosts:
        if not host.is_local:
            proc = subprocess.run(push_command(inventory, host, src, dest), stdin=subprocess.DEVNULL,
                                  capture_output=True, text=True, timeout=3600)
            failed = proc.stderr.strip()[-300:] or f"rsync exited {proc.returncode}"
            errors[host.name] = failed if proc.returncode else ""
    return errors


def ssh_argv(inventory: Inventory, host: Host, with_target: bool = True, connect_s: int | None = None) -> list[str]:
    """ssh to `host` with the same rules as everything else: keys only, host key checked, no
    prompt; `connect_s` bounds the connection (ssh takes an option's first value)."""
    argv = ["ssh", "-p", str(host.port), *([f"-oConnectTimeout={connect_s}"] if connect_s else []),
            *ssh_option_args(inventory)]
    if host.identity:
        argv += ["-i", os.path.expanduser(host.identity)]
    if with_target:
        argv += [f"{host.user + '@' if host.user else ''}{host.address}"]
    return argv
