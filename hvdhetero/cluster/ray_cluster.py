"""Ray as the cluster, launcher side: `invoke ray up | down | status` on the inventory's hosts,
and the command `invoke train --launcher ray` runs.

    results = up(inventory, hosts)      # the head on hosts[0], the others join it
    argv, env = command(inventory, hosts, config, program, address=None)

Each host's node is started, stopped and looked at by cluster/ray_node.py on that host (its own
env's Python, over the same checked ssh as everything else: keys only, known host keys,
commands as quoted lists). A training job on Ray runs a driver (cluster/ray_driver.py) on the
first host, itself a node of the cluster: it holds Horovod's Gloo rendezvous, starts one actor
per slot pinned to its host's node, each running the same rank command horovodrun would, and
prints their output as horovodrun does, so the launcher's supervisor (live table, rank logs,
failure messages, exit codes) is the same. The launcher itself needs no Ray.

Launcher side: imports neither torch nor ray.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from hvdhetero.cluster import launch, ray_node
from hvdhetero.cluster.inventory import Host, Inventory
from hvdhetero.config import JobConfig
from hvdhetero.errors import ConfigError

NODE_TIMEOUT_S = ray_node.START_TIMEOUT_S + 60
"""A node's up/down over ssh, ray start's own bound included."""


def check(inventory: Inventory, hosts: Sequence[Host], what: str = "a Ray cluster") -> None:
    """What Ray asks of the inventory, before anything is contacted."""
    launch.check_machines(inventory, hosts, "Ray")
    if inventory.pins.mpi:  # first: the Ray pin it would ask for next is of no use under mpi
        raise ConfigError(f"{inventory.path}: the Ray launcher starts Gloo ranks; pins.backend is mpi (mpirun "
                          "starts those): set backend: gloo, or train without --launcher ray")
    if not inventory.pins.ray:
        raise ConfigError(f"{inventory.path}: {what} needs Ray on every host: add `ray: \"{RAY_PIN}\"` under pins, "
                          f"then run invoke provision")


RAY_PIN = "2.60.0"
"""The Ray version the docs and tests name (the newest on the registry when this was written)."""


def on_host(inventory: Inventory, host: Host, args: Sequence[str]) -> list[str]:
    """The command running `python ARGS` with `host`'s env: directly for this machine, else over
    ssh with the inventory's key and known hosts (one quoted command line for the remote shell)."""
    command = [*launch.host_python(inventory, host), *args]
    if host.is_local:
        return command
    return [*launch.ssh_argv(inventory, host, connect_s=10), shlex.join(command)]


def node_argv(inventory: Inventory, host: Host, action: str, *flags: str) -> list[str]:
    """The command running ray_node ACTION on `host` (on_host)."""
    return on_host(inventory, host, ["-m", "hvdhetero.cluster.ray_node", action, "--name", host.name, *flags])


def _node(inventory: Inventory, host: Host, action: str, *flags: str) -> dict:
    """Run ray_node on `host`; its JSON answer ({"error": ...} when it or the ssh failed)."""
    argv = node_argv(inventory, host, action, *flags)
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=NODE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"name": host.name, "error": f"no answer within {NODE_TIMEOUT_S} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if lines:
        return json.loads(lines[-1])
    said = (proc.stderr.strip() or proc.stdout.strip())[-600:]
    if proc.returncode == launch.SSH_LOST:
        return {"name": host.name, "error": f"ssh to {host.address} failed: {said}"}
    return {"name": host.name, "error": f"exited with {proc.returncode}: {said} (is hvdhetero provisioned there? "
                                        f"invoke provision --hosts {host.name})"}


def node_ip(host: Host) -> list[str]:
    """`--node-ip` for a remote host: its inventory address as an IP (as the launcher resolves a
    name; the hosts share the LAN), so every node advertises the address the others reach it at."""
    if host.is_local:
        return []
    try:
        ip = socket.getaddrinfo(host.address, None, type=socket.SOCK_STREAM)[0][4][0]
    except OSError as err:
        raise ConfigError(f"host {host.name}: cannot resolve its address {host.address} ({err})") from None
    return ["--node-ip", ip]


def up(inventory: Inventory, hosts: Sequence[Host], port: int = ray_node.PORT) -> list[dict]:
    """The head on hosts[0], then the other hosts join it (in parallel); each node's answer."""
    check(inventory, hosts)
    ips = {h.name: node_ip(h) for h in hosts}
    head = _node(inventory, hosts[0], "up", "--head", "--port", str(port), "--cpus", str(hosts[0].slots),
                 *ips[hosts[0].name])
    if "error" in head:
        return [head, *({"name": h.name, "error": "not started: the head did not start"} for h in hosts[1:])]
    with ThreadPoolExecutor(max_workers=max(1, len(hosts) - 1)) as pool:
        joined = list(pool.map(lambda h: _node(inventory, h, "up", "--address", head["address"], "--cpus",
                                               str(h.slots), *ips[h.name]), hosts[1:]))
    return [head, *joined]


def down(inventory: Inventory, hosts: Sequence[Host]) -> list[dict]:
    """Every host's node stopped (all at once: each ends its own session, head or not)."""
    return _on_each(inventory, hosts, "down")


def status(inventory: Inventory, hosts: Sequence[Host]) -> list[dict]:
    return _on_each(inventory, hosts, "status")


def _on_each(inventory: Inventory, hosts: Sequence[Host], action: str) -> list[dict]:
    launch.check_machines(inventory, hosts, "Ray")
    with ThreadPoolExecutor(max_workers=len(hosts)) as pool:
        return list(pool.map(lambda h: _node(inventory, h, action), hosts))


def table(results: Sequence[dict]) -> str:
    """One line per host: what its node did or is, and where."""
    lines = []
    for r in results:
        if "error" in r:
            lines.append(f"{r['name']}: error: {r['error']}")
            continue
        role = "head" if r.get("head") else "worker"
        did = r.get("did") or ("up" if r.get("up") else "down")
        where = f" ({role}, cluster {r['address']}, session {r['sid']})" if r.get("sid") and did != "stopped" else ""
        extra = f" in {r['seconds']} s" if r.get("seconds") else ""
        extra += f", {r['processes']} processes" if r.get("processes") else ""
        lines.append(f"{r['name']}: {did}{extra}{where}")
    return "\n".join(lines)


def failed(results: Sequence[dict]) -> bool:
    return any("error" in r for r in results)


def command(inventory: Inventory, hosts: Sequence[Host], config: JobConfig, program: Sequence[str],
            address: str | None = None, launcher_python: str = sys.executable) -> tuple[list[str], dict[str, str]]:
    """(argv, env) of the Ray driver running the job on `hosts` (on hosts[0], which must be a node
    of the cluster): one rank per slot, each `python -m hvdhetero.rank.runner` from its host's env,
    as horovodrun would start it. `address` is the cluster's GCS IP:PORT; None takes the one
    `invoke ray up` recorded on hosts[0]."""
    check(inventory, hosts, "--launcher ray")
    if config.elastic:
        raise ConfigError("--elastic needs horovodrun (Horovod's elastic driver re-forms the job through its "
                          "rendezvous); the Ray launcher runs a fixed set of actors: drop --elastic or --launcher ray")
    settings = replace(config, hosts=launch.host_settings(hosts)).to_json()
    ranks = []
    for host in hosts:
        python = launch.host_python(inventory, host)
        for _ in range(host.slots):
            ranks.append({"rank": len(ranks), "host": host.name,
                          "cwd": os.getcwd() if host.is_local else None,  # horovodrun's local ranks start here
                          "argv": [*python, "-m", "hvdhetero.rank.runner", "--job-json", settings, *program]})
    plan = {"address": address, "head_name": hosts[0].name, "ranks": ranks,
            "hosts": [{"name": h.name, "address": h.address, "slots": h.slots} for h in hosts],
            "rendezvous": "127.0.0.1" if hosts[0].is_local else hosts[0].address,
            "env": {**launch.rank_env(config), "HOROVOD_GLOO_TIMEOUT_SECONDS": str(launch.GLOO_TIMEOUT_S)}}
    # Over ssh the driver ends when the launcher's ssh does (its stdin closes: --watch-stdin).
    watch = [] if hosts[0].is_local else ["--watch-stdin"]
    return on_host(inventory, hosts[0], ["-m", "hvdhetero.cluster.ray_driver", "--plan",
                                         json.dumps(plan, sort_keys=True), *watch]), {}
