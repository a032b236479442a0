"""The horovodrun command for a set of inventory hosts, as data: `(argv, env)`.

`command()` is pure (tests assert on its list, `--dry-run` prints it); `run()` executes it.
Launcher side: never imports torch or horovod, so `invoke train --dry-run` starts instantly.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from dataclasses import replace

from hvdhetero import netinfo, progress
from hvdhetero.cluster import console, elastic, live
from hvdhetero.config import JobConfig
from hvdhetero.errors import ConfigError, LaunchError
from hvdhetero.cluster.inventory import Host, Inventory

# Every network wait of a job is bounded: the rendezvous and Gloo's own operations.
START_TIMEOUT_S = 120
GLOO_TIMEOUT_S = 120

RANK_ENV = {
    "PYTHONUNBUFFERED": "1",  # rank output reaches the console as it happens
    "PYTORCH_ENABLE_MPS_FALLBACK": "1",  # MPS ranks: run unsupported ops on the CPU
    # A collective that some rank never joins (a dead or diverged peer) ends the job
    # instead of hanging it: Horovod warns after 60 s and shuts down after 120 s.
    "HOROVOD_STALL_CHECK_TIME_SECONDS": "60",
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "120",
}


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
        hosts = elastic.as_elastic_hosts(hosts)
        discovery = (Path(config.run_dir) / elastic.DISCOVERY, config.min_hosts)
    settings = replace(config, hosts=host_settings(hosts)).to_json()
    return job(inventory, hosts, ["hvdhetero.rank.runner", "--job-json", settings, *program], launcher_python,
               hosts_json=False, elastic_discovery=discovery)


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
        elastic_discovery: tuple[Path, int] | None = None) -> tuple[list[str], dict[str, str]]:
    """(argv, env) of `horovodrun --gloo` running `python -m MODULE FLAGS` once per slot; with
    `elastic_discovery` (the discovery script's path, --min-hosts) in elastic mode."""
    if elastic_discovery is None:
        check_hosts(inventory, hosts)
    local = [h for h in hosts if h.is_local]
    horovodrun = str(Path(launcher_python).parent / "horovodrun")
    argv = [
        horovodrun,
        *(elastic.flags(hosts, *elastic_discovery) if elastic_discovery else
          ["-np", str(sum(h.slots for h in hosts)), "-H", ",".join(f"{h.address}:{h.slots}" for h in hosts)]),
        "--gloo",
        "--start-timeout", str(START_TIMEOUT_S),
        "--gloo-timeout-seconds", str(elastic.gloo_timeout() if elastic_discovery else GLOO_TIMEOUT_S),
    ]
    env = dict(RANK_ENV)
    if local:
        python = [env_python(inventory, hosts[0])]
        if not Path(python[0]).exists():
            raise ConfigError(f"{inventory.path}: host '{hosts[0].name}' has env {hosts[0].env!r}, but "
                              f"{python[0]} does not exist; run ci/setup, or fix env: (relative paths start "
                              "at the inventory file's directory)")
    else:
        argv += ssh_flags(inventory, hosts)
        env["HOROVOD_SSH_OPTIONS"] = ssh_options(inventory, keepalive=elastic_discovery is not None)
        python = remote_python(hosts[0].env)
    argv += [*python, "-m", *module_and_flags]
    if hosts_json:
        argv += ["--hosts-json", json.dumps(host_settings(hosts), sort_keys=True)]
    return argv, env


def check_hosts(inventory: Inventory, hosts: Sequence[Host]) -> None:
    """What one horovodrun job asks of the hosts it runs on, from the inventory alone (nothing
    contacted): `invoke check` refuses the same hosts `invoke train` would, naming them."""
    if not hosts:
        raise ConfigError(f"{inventory.path}: no hosts selected; name some with --hosts")
    addresses = [h.address for h in hosts]
    shared = [h.name for h in hosts if addresses.count(h.address) > 1]
    if shared:
        raise ConfigError(f"{inventory.path}: hosts {', '.join(shared)} share an address; horovodrun needs one "
                          "entry per machine (raise `slots` instead)")
    local = [h for h in hosts if h.is_local]
    if local and len(hosts) > 1:
        raise ConfigError(f"{inventory.path}: host '{local[0].name}' is this machine (address "
                          f"{local[0].address}); a multi-host job needs every host's LAN address")
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
    nic = netinfo.interface_towards(hosts[0].address)
    if nic is None:
        raise ConfigError(f"cannot tell which network interface of this machine reaches {hosts[0].name} "
                          f"({hosts[0].address}); is it on this network?")
    return flags + ["--network-interfaces", nic]


def ssh_options(inventory: Inventory, keepalive: bool = False) -> str:
    """Options for horovodrun's ssh (our Horovod patch 0004): keys only, host keys checked. With
    `keepalive` (--elastic) the ssh session of a rank whose host stops answering ends after 20 s,
    so that Horovod sees that rank fail and drops its host (it waits on a frozen one forever)."""
    known = os.path.expanduser(inventory.known_hosts or "~/.ssh/known_hosts")
    alive = ["-o ServerAliveInterval=5", "-o ServerAliveCountMax=4"] if keepalive else []
    return " ".join(["-o BatchMode=yes", "-o PasswordAuthentication=no", "-o StrictHostKeyChecking=yes",
                     f"-o UserKnownHostsFile={shlex.quote(known)}", f"-o ConnectTimeout={START_TIMEOUT_S // 4}",
                     *alive])


# What horovodrun may forward to remote ranks: it copies its own environment into every rank's
# command line, so it gets this allowlist, never the launcher's whole environment (secrets).
FORWARDED = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "SSH_AUTH_SOCK", "TMPDIR")


def forwarded_env(env: dict[str, str]) -> dict[str, str]:
    return {**{k: os.environ[k] for k in FORWARDED if k in os.environ}, **env}


def printable(argv: Sequence[str], env: dict[str, str]) -> str:
    """The command as one shell line a user can copy."""
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items())), *map(shlex.quote, argv)])


def run(argv: Sequence[str], env: dict[str, str], cwd: str | Path | None = None,
        run_dir: str | Path | None = None, rank0_host: str | None = None,
        watch: elastic.Watch | None = None, rank_hosts: Sequence[str] = ()) -> list[dict]:
    """Run the job in the foreground, its ranks' output relayed to the console; returns the
    results rank 0 reported (progress.RESULT_TAG). A rank that fails, dies or goes silent for
    progress.SILENT_S ends the job with one message naming it (and, for a training run with a
    `run_dir`, its newest checkpoint and the command that resumes); nothing of the job is left
    running on this machine. The ranks' progress is a live table on the console (cluster/live.py);
    with a `run_dir`, every rank's whole output is kept there as rank-N.log. Under elastic (a
    `watch`) a rank that dies or goes silent is dropped instead (a silent one killed) while at
    least --min-hosts hosts are left."""
    if not Path(argv[0]).exists():
        raise LaunchError(f"{argv[0]} not found: run ci/setup (or invoke provision) first")
    silent_s = float(os.environ.get("HVDHETERO_SILENT_S") or (elastic.SILENT_S if watch else progress.SILENT_S))
    logs = console.RankLogs(run_dir) if run_dir is not None else None
    try:
        return _run(argv, env, cwd, run_dir, rank0_host, watch, silent_s, logs, rank_hosts)
    finally:
        if watch is not None:
            watch.finish()  # a silent rank whose host did not answer yet: killed once it does (bounded)


def _run(argv, env, cwd, run_dir, rank0_host, watch: elastic.Watch | None, silent_s: float,
         logs: console.RankLogs | None, rank_hosts: Sequence[str]) -> list[dict]:
    alive: dict[int, tuple[float, str]] = {}
    exits: dict[int, int] = {}
    with subprocess.Popen(list(argv), env=forwarded_env(env), cwd=cwd, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1) as proc:
        results: list[dict] = []
        try:
            failures = console.relay(_watched(proc, alive, exits, silent_s, logs, watch),
                                     live.display_for(sys.stdout), results=results, alive=alive)
        except _Silent as silent:
            _stop(proc)
            raise LaunchError(f"rank {silent.rank} on host {silent.host}: no response for {silent.seconds:.0f} s "
                              f"(frozen, asleep or cut off); the job was stopped" + _ended(watch)
                              + _output_hint(logs, silent.rank) + resume_hint(run_dir, rank0_host)) from None
        except elastic.TooFew:
            _stop(proc)
            last = watch.dropped[-1]
            raise LaunchError(f"rank {last['rank']} on host {last['host']} {last['what']}; the other ranks were "
                              f"stopped" + _ended(watch) + resume_hint(run_dir, rank0_host)) from None
        except elastic.ScriptFailed as failed:  # a script's own error is no host failure: the job ends
            _stop(proc)
            raise LaunchError(console.failure_summary([failed.failure]) + resume_hint(run_dir, rank0_host)) from None
        except BaseException:  # Ctrl-C, or anything else: the job must not outlive the launcher
            _stop(proc)
            raise
        finally:
            if logs is not None:
                logs.close()
    for failure in failures:
        if logs is not None and logs.has(failure["rank"]):
            failure["log"] = str(logs.path(failure["rank"]))
    if watch is not None and proc.returncode == 0:  # ranks were dropped, the job went on
        return results
    first = next(iter(exits.items()), None)
    if failures and not (first and (_signalled(first[1]) or first[1] == SSH_LOST)):
        raise LaunchError(console.failure_summary(failures) + resume_hint(run_dir, rank0_host))
    if proc.returncode != 0 or failures:  # a rank killed first: the others' errors follow from it
        # a rank's host from its heartbeats, else from where horovodrun put it (one that failed
        # before its first heartbeat)
        hosts = {**dict(enumerate(rank_hosts)), **{r: h for r, (_, h) in alive.items()}}
        rank = next(iter(exits), None)
        raise LaunchError(died(exits, hosts, proc.returncode) + _ended(watch) + _output_hint(logs, rank)
                          + resume_hint(run_dir, rank0_host))
    return results


def _output_hint(logs: console.RankLogs | None, rank: int | None) -> str:
    """Where the rank's whole output is, if it was kept."""
    if logs is None or rank is None or not logs.has(rank):
        return ""
    return f"\n  its output: {logs.path(rank)}"


SSH_LOST = 255
"""ssh's own exit code: the connection to the host failed or was cut (a rank on another host)."""


def _signalled(code: int) -> bool:
    """An exit code that means a signal ended the process (-N from Python, 128+N from a shell;
    signals go up to 64, so 255 is ssh's, not a signal's)."""
    return code < 0 or 128 < code <= 128 + 64


EXIT_LINE = re.compile(r"^Process (\d+) exit with status code (-?\d+)\.")


def _ended(watch: elastic.Watch | None) -> str:
    return watch.ended() if watch is not None else ""


class _Silent(Exception):
    def __init__(self, rank: int, host: str, seconds: float):
        super().__init__(rank, host, seconds)
        self.rank, self.host, self.seconds = rank, host, seconds


def _watched(proc: subprocess.Popen, alive: dict, exits: dict, silent_s: float,
             logs: console.RankLogs | None = None, watch: elastic.Watch | None = None):
    """horovodrun's lines as they come (read by a thread), checking at least once a second that
    no rank seen so far has been silent for `silent_s`; notes the exit codes horovodrun prints;
    every line goes to the rank logs, if kept. Under elastic (`watch`) a silent rank is killed and
    a dead one dropped, until fewer than --min-hosts hosts are left."""
    lines: queue.Queue = queue.Queue()

    def read():
        try:
            for line in proc.stdout:
                lines.put(line)
        finally:
            lines.put(None)

    threading.Thread(target=read, name="hvdhetero-relay", daemon=True).start()
    while True:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            line = ""
        if line is None:
            return
        if line:
            if logs is not None:
                logs.write(line)
            match = EXIT_LINE.match(line)
            if match:
                exits.setdefault(int(match.group(1)), int(match.group(2)))
                if watch is not None:
                    rank = int(match.group(1))
                    watch.exited(rank, _what(int(match.group(2))))
                    alive.pop(rank, None)
                    if watch.too_few(alive):
                        raise elastic.TooFew()
            prefix = progress.PREFIX.match(line)
            if watch is not None and not watch.read(line[prefix.end():] if prefix else line, bool(match)):
                continue  # horovodrun's exit line (the watch said it in words), Horovod's reset noise
            # Once a rank has ended, the rest is horovodrun stopping the others (its traceback,
            # the survivors' broken collectives): only our tagged lines go on to the relay.
            if watch is not None or not exits or any(tag in line for tag in (progress.ERROR_TAG, progress.RESULT_TAG,
                                                                             progress.ALIVE_TAG)):
                yield line
        now = time.monotonic()
        for rank, (seen, host) in sorted(alive.items()):
            if now - seen > silent_s and proc.poll() is None:
                if watch is None:
                    raise _Silent(rank, host, now - seen)
                watch.silent(rank, now - seen)
                del alive[rank]
                if watch.too_few(alive):
                    raise _Silent(rank, host, now - seen)
        if watch is not None:
            watch.tick()


def _stop(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """End horovodrun and everything it started: SIGTERM (it stops its ranks: SIGTERM, then
    SIGKILL after 5 s, which ends a stopped process too), SIGKILL if it is still there."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def died(exits: dict[int, int], hosts: dict[int, str], returncode: int) -> str:
    """What horovodrun reported of the first rank that ended badly, in words."""
    if not exits:
        return f"training failed: horovodrun exited with {returncode} (see the rank output above)"
    rank, code = next(iter(exits.items()))  # horovodrun prints the first one first
    return f"rank {rank} on host {hosts.get(rank, '?')} {_what(code)}; the other ranks were stopped"


def _what(code: int) -> str:
    """A rank's exit code in words: killed by signal 9 (SIGKILL), exited with code 1."""
    if code == SSH_LOST:
        return "was cut off (exit 255: ssh lost the connection to its host: down, asleep or off the network)"
    if not _signalled(code):
        return f"exited with code {code}"
    signum = -code if code < 0 else code - 128
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    return f"killed by signal {signum} ({name})"


def resume_hint(run_dir: str | Path | None, rank0_host: str | None = None) -> str:
    """The newest checkpoint of a training run and the command that continues it (rank 0 writes
    them: on `rank0_host` when that is another machine)."""
    if run_dir is None:
        return ""
    folder = Path(run_dir) / "checkpoints"
    saved = sorted(folder.glob("step-*.pt")) if folder.is_dir() else []
    if not saved and rank0_host:
        return (f"\n  checkpoints, if any, are on {rank0_host} in {folder}"
                f"\n  resume with: invoke train --resume {shlex.quote(str(run_dir))}")
    if not saved:
        return f"\n  no checkpoint was written yet (run directory {run_dir}); start the run again"
    step = int(saved[-1].stem.split("-")[1])
    return (f"\n  newest checkpoint: {saved[-1]} (step {step})"
            f"\n  resume with: invoke train --resume {shlex.quote(str(run_dir))}")


def sync_command(inventory: Inventory, host: Host, src: str, dest: str) -> list[str]:
    """rsync over ssh pushing directory `src` to `dest` on `host` (relative = its home), with
    the same ssh rules as everything else: keys only, host key checked, no prompt."""
    ssh = ssh_argv(inventory, host, with_target=False)
    target = f"{host.user + '@' if host.user else ''}{host.address}"
    if ":" in host.address:
        target = f"{host.user + '@' if host.user else ''}[{host.address}]"
    # --protect-args: the remote path reaches the remote side as data, not through its shell.
    return ["rsync", "-a", "--protect-args", "--timeout=60", "-e", shlex.join(ssh),
            src.rstrip("/") + "/", f"{target}:{dest}"]


def ssh_argv(inventory: Inventory, host: Host, with_target: bool = True, connect_s: int | None = None) -> list[str]:
    """ssh to `host` with the same rules as everything else: keys only, host key checked, no
    prompt; `connect_s` bounds the connection (ssh takes an option's first value)."""
    argv = ["ssh", "-p", str(host.port), *([f"-oConnectTimeout={connect_s}"] if connect_s else []),
            *ssh_options(inventory).split()]
    if host.identity:
        argv += ["-i", os.path.expanduser(host.identity)]
    if with_target:
        argv += [f"{host.user + '@' if host.user else ''}{host.address}"]
    return argv
