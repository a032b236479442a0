"""One host's Ray node: started, stopped and looked at on that host, by its own env's Python
(`invoke ray up|down|status` runs this module over the inventory's ssh; cluster/ray_cluster.py).

    python -m hvdhetero.cluster.ray_node up --name pc --cpus 1 --head --port 6380
    python -m hvdhetero.cluster.ray_node up --name mac --cpus 1 --address 192.168.1.20:6380
    python -m hvdhetero.cluster.ray_node down --name mac
    python -m hvdhetero.cluster.ray_node status --name pc

Each prints one JSON line (what it did, the node's address and session) and exits 0, or says
why not and exits 1. `ray start` runs in a session of its own, and every process of the node
(GCS, raylet, workers, the ranks they start) stays in it, so `down` ends exactly this node's
processes: `ray stop` would end every Ray process on the machine (another user's, or the other
test host's: the namespaced test hosts share one pid space). The node's temp dir is its own
(`/tmp/hvdhetero-ray-NAME`: short, as Ray's socket paths must be).

Launcher-free and torch-free; `ray` itself is only run, never imported.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

PORT = 6380
"""The head's GCS port (Ray's default 6379 is Redis's, often taken)."""
OBJECT_STORE_BYTES = 100_000_000
"""Ray's object store on each node: the job moves nothing through it (ranks talk Gloo)."""
HEALTH = {"health_check_period_ms": 1000, "health_check_timeout_ms": 1000, "health_check_failure_threshold": 5}
"""The head declares a node dead after ~5 s without an answer (Ray's default took 64 s for a
frozen node: measured, issue 30); a job's actors on it fail then, and the job ends."""
LABEL = "hvd.host"
"""The node label naming the inventory host it runs on (the launcher pins each rank's actor by it)."""
STATE = "hvdhetero-node.json"
"""In the node's temp dir: its session id and address, written by `up`, read by `down` and `status`."""
START_TIMEOUT_S = 120
STOP_GRACE_S = 5


def temp_dir(name: str) -> str:
    """The node's own temp dir on its host."""
    return f"/tmp/hvdhetero-ray-{name}"


def start_command(name: str, cpus: int, ray: str, system: str, head_port: int | None = None,
                  address: str | None = None, node_ip: str | None = None) -> tuple[list[str], dict[str, str]]:
    """(argv, env) of `ray start` for this host's node: the head (`head_port`) or one joining the
    head at `address`; `node_ip` is the address the other hosts reach this one at (the inventory's:
    Ray's own pick is the NIC of the default route, which may not be the one the hosts share, or
    none at all, and then 127.0.0.1). `system` is platform.system() of the host: a Mac (Darwin) node needs
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1, Ray's own switch for multi-node clusters on macOS, which
    Ray calls experimental ("at your own risk"); without it `ray start` refuses to join."""
    if (head_port is None) == (address is None):
        raise ValueError("a node is either the head (head_port) or joins one (address)")
    argv = [ray, "start", *(["--head", "--port", str(head_port)] if head_port is not None else ["--address", address]),
            "--num-cpus", str(cpus), "--object-store-memory", str(OBJECT_STORE_BYTES),
            "--disable-usage-stats", "--include-log-monitor=false", "--temp-dir", temp_dir(name),
            "--labels", f"{LABEL}={name}", *(["--node-ip-address", node_ip] if node_ip else [])]
    if head_port is not None:
        argv += ["--include-dashboard=false", "--system-config", json.dumps(HEALTH, sort_keys=True)]
    env = {"RAY_USAGE_STATS_ENABLED": "0"}
    if system == "Darwin":
        env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "1"
    return argv, env


def session_pids(sid: int) -> list[int]:
    """The processes of session `sid` (pgrep -s: Linux and macOS)."""
    found = subprocess.run(["pgrep", "-s", str(sid)], capture_output=True, text=True, timeout=10)
    return [int(p) for p in found.stdout.split()]


def _state(name: str) -> dict | None:
    path = Path(temp_dir(name)) / STATE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def up(name: str, cpus: int, head_port: int | None, address: str | None, node_ip: str | None = None) -> dict:
    state = _state(name)
    if state and session_pids(state["sid"]):
        return {**state, "did": "already up"}
    ray = str(Path(sys.executable).parent / "ray")
    if not Path(ray).exists():
        raise RuntimeError(f"{ray} not found: this env has no Ray; set pins.ray in the inventory and run "
                           "invoke provision")
    argv, env = start_command(name, cpus, ray, platform.system(), head_port, address, node_ip)
    Path(temp_dir(name)).mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    # A session of its own: every process of this node (and what its workers start) is in it.
    proc = subprocess.Popen(argv, env={**os.environ, **env}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=START_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _stop_session(proc.pid)
        raise RuntimeError(f"ray start did not finish within {START_TIMEOUT_S} s; stopped it") from None
    if proc.returncode != 0:
        _stop_session(proc.pid)
        tail = "\n".join(line for line in out.splitlines() if line.strip())[-1500:]
        raise RuntimeError(f"ray start exited with {proc.returncode}:\n{tail}")
    state = {"name": name, "sid": proc.pid, "head": head_port is not None,
             "address": address or f"{node_ip or _node_ip(name)}:{head_port}", "system": platform.system()}
    (Path(temp_dir(name)) / STATE).write_text(json.dumps(state))
    return {**state, "did": "started", "seconds": round(time.monotonic() - started, 1)}


def _node_ip(name: str) -> str:
    """The head's address as Ray recorded it (the routable one it picked)."""
    try:
        return (Path(temp_dir(name)) / "ray_current_cluster").read_text().strip().rsplit(":", 1)[0]
    except OSError:
        return "?"


def _stop_session(sid: int) -> tuple[int, list[int]]:
    """SIGTERM to every process of the session, SIGKILL to those left after STOP_GRACE_S:
    (how many needed SIGKILL, the pids still there after it)."""
    killed = 0
    for sig, wait in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 5)):
        pids = session_pids(sid)
        if not pids:
            break
        killed = len(pids) if sig == signal.SIGKILL else 0
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while session_pids(sid) and time.monotonic() < deadline:
            time.sleep(0.2)
    return killed, session_pids(sid)


def down(name: str) -> dict:
    state = _state(name)
    if not state:
        return {"name": name, "did": "not up"}
    running = len(session_pids(state["sid"]))
    killed, left = _stop_session(state["sid"]) if running else (0, [])
    if left:
        raise RuntimeError(f"processes of the node are still running after SIGKILL: {left}")
    (Path(temp_dir(name)) / STATE).unlink(missing_ok=True)
    return {"name": name, "did": "stopped" if running else "not running", "processes": running, "killed": killed}


def status(name: str) -> dict:
    state = _state(name)
    if not state:
        return {"name": name, "up": False}
    pids = session_pids(state["sid"])
    return {**state, "up": bool(pids), "processes": len(pids)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hvdhetero.cluster.ray_node", description=__doc__.split("\n")[0])
    parser.add_argument("action", choices=("up", "down", "status"))
    parser.add_argument("--name", required=True, help="the inventory host this node runs on")
    parser.add_argument("--cpus", type=int, default=1)
    parser.add_argument("--head", action="store_true")
    parser.add_argument("--port", type=int, default=PORT)
    parser.add_argument("--address", default=None, help="the head's IP:PORT (a joining node)")
    parser.add_argument("--node-ip", default=None, help="this host's address as the other hosts reach it")
    args = parser.parse_args(argv)
    try:
        if args.action == "up":
            if not args.head and not args.address:
                raise RuntimeError("a node that is not the head joins one: give --address HEAD_IP:PORT")
            result = up(args.name, args.cpus, args.port if args.head else None, None if args.head else args.address,
                        args.node_ip)
        elif args.action == "down":
            result = down(args.name)
        else:
            result = status(args.name)
    except (RuntimeError, OSError, subprocess.SubprocessError) as err:
        print(json.dumps({"name": args.name, "error": str(err)}), flush=True)
        return 1
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
