"""The Ray driver of a training job (`invoke train --launcher ray`): runs on the job's first host,
a node of the Ray cluster, started by the launcher (cluster/ray_cluster.command: directly, or over
its ssh).

    python -m hvdhetero.cluster.ray_driver --plan '{...}' [--watch-stdin]

It does what horovodrun does for a Gloo job, with Ray placing and keeping the processes: holds
Horovod's rendezvous server (horovod.runner's own), gives every slot horovodrun's variables
(rank, local rank, size, the rendezvous address), starts one actor per slot pinned to its host's
node (the node `invoke ray up` labelled with the inventory name, else the node at the host's
address) and has it run the rank command; it prints the ranks' lines as horovodrun does
(`[R]<stdout>:...`) and, for a rank that fails, horovodrun's exit line, so the launcher's
supervisor reads it as it reads horovodrun. A rank whose actor or node dies is reported with
the exit code supervise.ACTOR_LOST; then, as after any failed rank, every other rank is stopped
and the driver exits 1. Every wait is bounded: the cluster's address is tried for 5 s, the
actors must start within 120 s, and a poll no actor answers within POLL_BOUND_S counts as lost.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import threading
import time

from hvdhetero.cluster import ray_node
from hvdhetero.cluster.supervise import ACTOR_LOST  # no process exit code exists then: said in words there
POLL_S = 0.2
POLL_BOUND_S = 20.0
LOSS_GRACE_S = 10.0
"""Ray's health check declares a node dead after ~5 s (cluster/ray_node.HEALTH); a dead raylet's
actors failed 3.9 s after it (issue 30's note)."""
START_BOUND_S = 120.0


class Refused(Exception):
    """The job cannot start on this cluster (the message says why and what to run)."""


def address_of(plan: dict) -> str:
    """The cluster to join: the plan's, else the one `invoke ray up` recorded on this host."""
    if plan.get("address"):
        return plan["address"]
    state = ray_node.status(plan["head_name"])
    if not state.get("up"):
        raise Refused(f"no Ray node of hvdhetero's is running on {plan['head_name']} (the job's first host): start "
                      f"the cluster with: invoke ray up --hosts {','.join(h['name'] for h in plan['hosts'])}")
    return state["address"]


def reachable(address: str, timeout_s: float = 5.0) -> None:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as err:
        raise Refused(f"no Ray cluster answers at {address} ({err}); start one with: invoke ray up, or pass the "
                      "address of yours with --ray-address IP:PORT") from None


def node_ids(nodes: list[dict], hosts: list[dict]) -> dict[str, str]:
    """Each host's Ray node id: the live node labelled with its inventory name, else the one at
    its address; Refused naming the hosts that have none."""
    alive = [n for n in nodes if n.get("Alive")]
    found, missing = {}, []
    for host in hosts:
        match = [n for n in alive if (n.get("Labels") or {}).get(ray_node.LABEL) == host["name"]] or \
                [n for n in alive if n.get("NodeManagerAddress") == host["address"]]
        if match:
            found[host["name"]] = match[0]["NodeID"]
        else:
            missing.append(host["name"])
    if missing:
        have = ", ".join(f"{(n.get('Labels') or {}).get(ray_node.LABEL) or '?'} at {n.get('NodeManagerAddress')}"
                         for n in alive) or "none"
        raise Refused(f"host {', '.join(missing)} has no live node in the Ray cluster (its nodes: {have}); start it "
                      f"with: invoke ray up --hosts {','.join(h['name'] for h in hosts)}")
    return found


def slot_env(plan: dict, port: int) -> tuple[list[dict[str, str]], list]:
    """Every rank's variables, in rank order, as horovodrun's Gloo launch sets them; and its slots."""
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.gloo_run import create_slot_env_vars

    hosts = parse_hosts(",".join(f"{h['address']}:{h['slots']}" for h in plan["hosts"]))
    slots = get_host_assignments(hosts, len(plan["ranks"]))
    common = {**plan["env"], "HOROVOD_GLOO_RENDEZVOUS_ADDR": plan["rendezvous"],
              "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port), "HOROVOD_CONTROLLER": "gloo",
              "HOROVOD_CPU_OPERATIONS": "gloo"}
    return [{**common, **create_slot_env_vars(slot)} for slot in slots], slots


def emit(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def relayed(rank: int, lines: list[str]) -> str:
    """A rank's lines as horovodrun tags them, each ended by a newline: the last line of a rank
    killed mid-print comes without one, and is ended here, so the next line relayed (another
    rank's, or its exit line) is never read as the rest of it (what cluster/lines.untangled
    repairs in horovodrun's own output)."""
    return "".join(f"[{rank}]<stdout>:{line if line.endswith(chr(10)) else line + chr(10)}" for line in lines)


def run(plan: dict) -> int:
    address = address_of(plan)
    reachable(address)
    try:
        import ray
    except ImportError:
        raise Refused(f"the env on {plan['head_name']} (the job's first host) has no Ray, yet a Ray cluster "
                      f"answers at {address}: set pins.ray in the inventory to that cluster's Ray version and run "
                      f"invoke provision --hosts {plan['head_name']}") from None
    from horovod.runner.http.http_server import RendezvousServer
    from ray.exceptions import ActorUnschedulableError, GetTimeoutError, RayActorError
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from hvdhetero.cluster.ray_rank import RankProcess

    ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING, configure_logging=False)
    nodes = node_ids(ray.nodes(), plan["hosts"])
    rendezvous = RendezvousServer()
    port = rendezvous.start()
    envs, slots = slot_env(plan, port)
    rendezvous.init(slots)
    remote = ray.remote(num_cpus=0, max_concurrency=4, max_restarts=0)(RankProcess)
    actors = [remote.options(scheduling_strategy=NodeAffinitySchedulingStrategy(nodes[r["host"]], soft=False),
                             name=f"hvdhetero-rank-{r['rank']}-{os.getpid()}").remote() for r in plan["ranks"]]
    try:
        try:
            ray.get([a.start.remote(r["argv"], env, r.get("cwd")) for a, r, env in zip(actors, plan["ranks"], envs)],
                    timeout=START_BOUND_S)
        except GetTimeoutError:
            raise Refused(f"the ranks' actors did not start within {START_BOUND_S:.0f} s (is every node alive? "
                          "invoke ray status)") from None
        except ActorUnschedulableError as err:
            raise Refused(f"Ray could not place a rank's actor: {str(err).splitlines()[0]}") from None
        return supervise(plan, actors, RayActorError)
    finally:
        stop(actors)
        rendezvous.stop()


def supervise(plan: dict, actors: list, actor_error: type) -> int:
    """Relay every rank's lines until all ended (0) or one failed (1). A rank that fails while
    another's actor is not answering waits up to LOSS_GRACE_S for Ray to say whether that actor
    is lost: a node's death reaches the surviving ranks (a broken collective) before Ray's health
    check reaches us, and the lost rank, not its peer's error, is the one to name."""
    import ray

    ended: set[int] = set()
    lost: dict[int, str] = {}
    failed: dict[int, int] = {}
    failing_since = None
    answered: set[int] = set()  # ranks whose actor answered since the first failure
    pending, asked = {}, {}
    while True:
        for rank, actor in enumerate(actors):
            if rank not in ended and rank not in pending and rank not in lost:
                pending[rank], asked[rank] = actor.poll.remote(), time.monotonic()
        ready, _ = ray.wait(list(pending.values()), num_returns=len(pending), timeout=POLL_S) if pending else ([], [])
        for rank in sorted(pending):
            if pending[rank] not in ready:
                if time.monotonic() - asked[rank] > POLL_BOUND_S:  # a node that stopped answering
                    lost[rank] = f"its actor did not answer for {POLL_BOUND_S:.0f} s"
                    del pending[rank]
                continue
            try:
                lines, code = ray.get(pending.pop(rank))
            except actor_error as err:
                lost[rank] = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300].rstrip('.')}"
                continue
            emit(relayed(rank, lines))
            if failing_since is not None:
                answered.add(rank)
            if code is None:
                continue
            if code != 0:
                failed[rank] = code
            ended.add(rank)
        if failed and failing_since is None:
            failing_since = time.monotonic()
        running = set(range(len(actors))) - ended - set(lost)
        settled = lost or (failed and (running <= answered or time.monotonic() - failing_since > LOSS_GRACE_S))
        if settled:
            for rank, why in sorted(lost.items()):  # a lost rank first: the others' errors follow from it
                host = plan["ranks"][rank]["host"]
                emit(f"hvdhetero ray: rank {rank}'s actor on {host} is gone ({why}; Ray's own words are in "
                     f"{plan.get('log', 'the driver log')})\n"
                     f"Process {rank} exit with status code {ACTOR_LOST}.\n")
            for rank, code in sorted(failed.items()):
                emit(f"Process {rank} exit with status code {code}.\n")
            return 1
        if len(ended) == len(actors):
            return 0


def stop(actors: list) -> None:
    """Every rank stopped (SIGTERM, SIGKILL after 5 s) and its actor ended: bounded."""
    import ray

    try:
        ray.wait([a.stop.remote() for a in actors], num_returns=len(actors), timeout=8)
    except Exception:  # noqa: BLE001 - an actor already gone; ray.kill below ends the rest
        pass
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001
            pass


def _watch_stdin() -> None:
    """Over ssh: the launcher's end closing our stdin means the job was stopped there."""
    def watch():
        while sys.stdin.buffer.read(65536):
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="hvdhetero-stdin", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hvdhetero.cluster.ray_driver")
    parser.add_argument("--plan", required=True)
    parser.add_argument("--watch-stdin", action="store_true")
    args = parser.parse_args(argv)
    plan = json.loads(args.plan)

    def stopped(signum, frame):
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, stopped)
    if args.watch_stdin:
        _watch_stdin()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Ray's own messages (a dead worker's page of advice, its warnings) go to a log on this host;
    # the console gets the ranks' lines and ours, on stdout.
    folder = ray_node.temp_dir(plan["head_name"])
    os.makedirs(folder, exist_ok=True)
    plan["log"] = os.path.join(folder, f"driver-{os.getpid()}.log")
    with open(plan["log"], "ab") as log:
        os.dup2(log.fileno(), 2)
    try:
        return run(plan)
    except Refused as err:
        emit(f"hvdhetero ray: {err}\n")
        return 2
    except BrokenPipeError:  # the launcher is gone
        return 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # Not through the interpreter's shutdown: the stdin watcher is blocked in a read, and Python
    # aborts ("could not acquire lock for <stdin>", exit 255 through ssh) finalizing under it.
    # The ranks and actors are stopped already (run's finally); Ray ends the job's leftovers.
    os._exit(code)
