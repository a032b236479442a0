"""--elastic on the launcher: horovodrun's elastic flags, the host-discovery script it runs every
second, and what the watchdog does with a rank that died or went silent (`Watch`).

    hosts = as_elastic_hosts(selected)                  # a local host's slots become hosts
    argv += flags(hosts, RUN_DIR/discover-hosts.py, min_hosts)
    write_discovery(run_dir, hosts, sys.executable)     # lists the hosts that answer now

Horovod elastic drops a whole host when one of its ranks fails, so the slots of one local host
are run as separate hosts (`localhost` and `127.0.0.1`, both this machine to horovodrun); it
drops a host whose rank exits, never one that is merely frozen, so a silent rank is killed (here
or over SSH: SIGKILL ends a stopped process too), and its host comes back after a cooldown if
the discovery script still lists it. Launcher side: torch-free.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from hvdhetero.cluster.console import HOROVOD_LOOP_ERROR
from hvdhetero.cluster.inventory import Host, Inventory
from hvdhetero.cluster.lines import tagged, without_heartbeat
from hvdhetero.errors import ConfigError
from hvdhetero.progress import ALIVE_TAG, ERROR_TAG

DISCOVERY = "discover-hosts.py"
LOCAL_ALIASES = ("localhost", "127.0.0.1")
"""Two names horovodrun runs here without SSH, so two hosts for Horovod on one machine."""
COOLDOWN_S = (5, 60)
"""--blacklist-cooldown-range: a dropped host that the discovery script lists again is tried
again after 10-15 s, then after longer (doubling, at most 60 s) if it fails again."""
ELASTIC_TIMEOUT_S = 60
"""How long horovodrun waits for --min-hosts hosts (at start and after a host was dropped)."""
GLOO_TIMEOUT_S = 20
"""Gloo's timeout under --elastic (rendezvous and every receive; HVDHETERO_GLOO_TIMEOUT_S
overrides). Our build's Gloo `uv` transport does not fail a pending receive when its peer's
connection closes (the `tcp` transport does): a survivor notices a killed peer only when this
runs out (60 s at the non-elastic value, measured). Horovod's background loop talks to every
peer every few ms whatever the step is doing, so only a dead, frozen or cut-off peer trips it,
or one chunk of an allreduce taking longer than this: a 23 MB chunk (ResNet-18, 2 ranks) on a
link under ~10 Mbit/s; raise it there."""
SILENT_S = 15.0
"""A rank silent this long (3 heartbeats missed) is killed (HVDHETERO_SILENT_S overrides): before
the survivors' Gloo timeout, so that Horovod has dropped its host when they re-form the job."""
PROBE_TIMEOUT_S = 2.0
KILL_TIMEOUT_S = 10.0
RETRY_S = 5.0


def as_elastic_hosts(hosts: Sequence[Host]) -> list[Host]:
    """The hosts as Horovod elastic sees them: one local host's slots (at most 2) as 1-slot hosts
    named NAME-1, NAME-2; remote hosts as they are."""
    if len(hosts) == 1 and hosts[0].is_local and hosts[0].slots > 1:
        h = hosts[0]
        if h.slots > len(LOCAL_ALIASES):
            raise ConfigError(f"--elastic on this machine alone runs at most {len(LOCAL_ALIASES)} ranks (as hosts "
                              f"{' and '.join(LOCAL_ALIASES)}); host '{h.name}' has slots: {h.slots}")
        return [replace(h, name=f"{h.name}-{i + 1}", address=LOCAL_ALIASES[i], slots=1) for i in range(h.slots)]
    return list(hosts)


def flags(hosts: Sequence[Host], discovery: str | Path, min_hosts: int) -> list[str]:
    """horovodrun's elastic flags instead of -np/-H: start on every host, go on with at least
    `min_hosts` (the ones with the fewest slots counted), let a dropped host back after a cooldown."""
    if min_hosts > len(hosts):
        raise ConfigError(f"--min-hosts {min_hosts} is more than the {len(hosts)} hosts of the job "
                          f"({', '.join(h.name for h in hosts)})")
    total = sum(h.slots for h in hosts)
    min_np = sum(sorted(h.slots for h in hosts)[:min_hosts])
    return ["-np", str(total), "--min-np", str(min_np), "--max-np", str(total),
            "--host-discovery-script", shlex.quote(str(discovery)),  # horovodrun runs it through a shell
            "--blacklist-cooldown-range", *map(str, COOLDOWN_S), "--elastic-timeout", str(ELASTIC_TIMEOUT_S)]


_SCRIPT = '''#!{python}
"""hvdhetero --elastic: the hosts Horovod may use now, one host:slots a line (written by invoke
train; horovodrun runs it every second). A remote host is listed when its SSH port accepts a TCP
connection within {timeout} s; this machine always is."""
import json
import socket
from concurrent.futures import ThreadPoolExecutor

HOSTS = json.loads({hosts})


def answers(host):
    if host["local"]:
        return True
    try:
        socket.create_connection((host["address"], host["port"]), timeout={timeout}).close()
        return True
    except OSError:
        return False


with ThreadPoolExecutor(len(HOSTS)) as pool:
    for host, ok in zip(HOSTS, pool.map(answers, HOSTS)):
        if ok:
            print(f"{{host['address']}}:{{host['slots']}}")
'''


def discovery_script(hosts: Sequence[Host], python: str) -> str:
    listed = [{"address": h.address, "slots": h.slots, "port": h.port, "local": h.is_local} for h in hosts]
    return _SCRIPT.format(python=python, hosts=repr(json.dumps(listed)), timeout=PROBE_TIMEOUT_S)


def write_discovery(path: str | Path, hosts: Sequence[Host], python: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(discovery_script(hosts, python))
    path.chmod(0o755)
    return path


class TooFew(Exception):
    """A rank exited and fewer than --min-hosts hosts are left."""


class ScriptFailed(Exception):
    """A rank's script raised (its summary line): no host failure, the job ends."""

    def __init__(self, failure: dict):
        super().__init__(failure)
        self.failure = failure


class Watch:
    """The launcher's side of --elastic: every rank process's host and pid (from its heartbeat);
    a silent one killed, a dead one noted; says when fewer than `min_hosts` hosts are left."""

    def __init__(self, hosts: Sequence[Host], min_hosts: int, kill_argv: Callable[[Host, int], list[str]],
                 say: Callable[[str], None] = print):
        self.hosts = {h.name: h for h in hosts}
        self.min_hosts, self.kill_argv, self.say = min_hosts, kill_argv, say
        self.pids: dict[int, tuple[str, int]] = {}
        """rank (as horovodrun numbers the process) -> (host name, pid)."""
        self.pending: dict[tuple[str, int], float] = {}
        """(host, pid) still to kill (its host did not answer) -> when to try again."""
        self.dropped: list[dict] = []
        self._lock = threading.Lock()

    def beat(self, beat: dict) -> None:
        if "pid" in beat:
            self.pids[beat["rank"]] = (beat["host"], beat["pid"])

    def silent(self, rank: int, seconds: float) -> None:
        host, pid = self.pids.get(rank, ("?", 0))
        self.dropped.append({"rank": rank, "host": host, "what": f"no response for {seconds:.0f} s", "at": time.time()})
        self.say(f"hvdhetero: elastic: rank {rank} on host {host}: no response for {seconds:.0f} s (frozen, asleep "
                 f"or cut off): stopping it; the others go on from their last commit")
        if pid:  # over SSH this may take seconds: the watchdog goes on meanwhile
            with self._lock:
                self.pending[(host, pid)] = time.monotonic() + KILL_TIMEOUT_S + RETRY_S  # being tried
            threading.Thread(target=self._kill, args=(host, pid), name="hvdhetero-kill", daemon=True).start()

    def exited(self, rank: int, what: str) -> None:
        host, _ = self.pids.pop(rank, ("?", 0))
        if any(d["rank"] == rank and d["host"] == host for d in self.dropped[-1:]):
            return  # the one we stopped
        self.dropped.append({"rank": rank, "host": host, "what": what, "at": time.time()})
        self.say(f"hvdhetero: elastic: rank {rank} on host {host} {what}: host dropped; the others go on from their "
                 "last commit")

    def read(self, body: str, exit_line: bool = False) -> bool:
        """One of horovodrun's lines (`body`: without the rank prefix): a heartbeat tells this
        watch its rank's pid; a script's own error ends the job (ScriptFailed: not a host's
        failure). False: the line stays off the console (it is in the rank's log): horovodrun's
        exit line (`exit_line`, said in words by `exited`) and Horovod's reset noise."""
        if exit_line or noise(body):
            return False
        if ALIVE_TAG in body:
            _, beat = without_heartbeat(body)
            if beat is not None:
                self.beat(beat)
        elif body.startswith(ERROR_TAG) and (failures := tagged(body, ERROR_TAG)):  # none: cut short
            raise ScriptFailed(failures[0])
        return True

    def ended(self) -> str:
        """Why the job ended after all, and the hosts dropped before (for its failure message)."""
        if not self.dropped:
            return ""
        before = "; ".join(f"rank {d['rank']} on {d['host']} ({d['what']})" for d in self.dropped[:-1])
        return (f"\n  elastic: fewer than --min-hosts {self.min_hosts} hosts were left"
                + (f" (dropped before: {before})" if before else ""))

    def too_few(self, alive: dict) -> bool:
        """Fewer than min_hosts hosts have a rank that beats."""
        return len({host for _, host in alive.values()}) < self.min_hosts

    def tick(self) -> None:
        """Retry killing what could not be killed yet (a host that answers again)."""
        now = time.monotonic()
        with self._lock:
            due = [key for key, when in self.pending.items() if when <= now]
            for key in due:
                self.pending[key] = now + KILL_TIMEOUT_S + RETRY_S  # being tried
        for host, pid in due:
            threading.Thread(target=self._kill, args=(host, pid), name="hvdhetero-kill", daemon=True).start()

    def finish(self, within: float = 30.0) -> list[str]:
        """At the end: keep trying the kills still pending for up to `within` seconds; warns of
        and returns what is left (host: pid), which ends itself at its next heartbeat once it
        runs again (its launcher gone)."""
        deadline = time.monotonic() + within
        while self.pending and time.monotonic() < deadline:
            time.sleep(1.0)
            self.tick()
        with self._lock:
            left = [f"{host}: pid {pid}" for host, pid in self.pending]
        for what in left:
            print(f"warning: could not stop the silent rank on {what} (its host does not answer); it ends itself "
                  "at its next heartbeat, its launcher gone", file=sys.stderr)
        return left

    def _kill(self, host_name: str, pid: int) -> None:
        host = self.hosts.get(host_name)
        if host is None:  # not a host of this job: no pid of ours to kill (never a local process by chance)
            with self._lock:
                self.pending.pop((host_name, pid), None)
            return
        if host.is_local:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            with self._lock:
                self.pending.pop((host_name, pid), None)
            return
        try:
            done = subprocess.run(self.kill_argv(host, pid), capture_output=True, text=True, timeout=KILL_TIMEOUT_S)
            ok = done.returncode == 0 or "No such process" in done.stderr
        except subprocess.TimeoutExpired:
            ok = False
        with self._lock:
            if ok:
                self.pending.pop((host_name, pid), None)
            else:
                self.pending[(host_name, pid)] = time.monotonic() + RETRY_S


def kill_command(inventory: Inventory, ssh_argv: Callable[[Inventory, Host], list[str]]):
    """(host, pid) -> the ssh command that SIGKILLs `pid` there (keys only, host key checked)."""
    def argv(host: Host, pid: int) -> list[str]:
        return [*ssh_argv(inventory, host), shlex.join(["kill", "-KILL", str(pid)])]
    return argv


def noise(body: str) -> bool:
    """What a rank prints when a peer fails and Horovod resets, or the shell when it is killed
    (it stays in the rank logs)."""
    return HOROVOD_LOOP_ERROR in body or body.strip() == "Killed"


def gloo_timeout() -> int:
    return int(os.environ.get("HVDHETERO_GLOO_TIMEOUT_S") or GLOO_TIMEOUT_S)
