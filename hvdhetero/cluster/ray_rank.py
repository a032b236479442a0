"""The Ray actor that runs one rank on its host (cluster/ray_driver.py creates one per slot,
pinned to the host's node): it starts the rank command horovodrun would, from that host's env,
keeps its output lines until the driver polls for them, and stops it when told.

The rank's environment is the driver's (Horovod's rendezvous, rank, size, our settings) over the
host's own allowlisted variables (PATH, HOME, ...: the Mac's on the Mac), never the Ray worker's
whole environment (Ray's own variables, OMP_NUM_THREADS=1). On Linux the rank dies with its actor
(PR_SET_PDEATHSIG): Ray ends an actor's children itself while the node lives, but not when the
node's raylet dies or hangs.

A module of its own (not the driver's __main__), so Ray finds the class by name on every host.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

from hvdhetero.cluster import supervise

FORWARDED = tuple(name for name in supervise.FORWARDED if name != "SSH_AUTH_SOCK")
"""What a rank takes from its host's own environment: what horovodrun forwards, less ssh's agent."""


def _die_with_parent() -> None:
    """In the rank's process, before exec: SIGKILL when the thread that started it ends."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def rank_env(own: dict[str, str], given: dict[str, str]) -> dict[str, str]:
    """The rank's environment: the host's allowlisted variables, then the driver's."""
    return {**{k: own[k] for k in FORWARDED if k in own}, **given}


class RankProcess:
    """One rank's process on this node (created as a Ray actor by the driver)."""

    def __init__(self):
        self._lines: list[str] = []
        self._lock = threading.Lock()
        self._code: int | None = None
        self._proc: subprocess.Popen | None = None

    def start(self, argv: list[str], env: dict[str, str], cwd: str | None) -> tuple[int, int]:
        """Start the rank; (this actor's pid, the rank's pid)."""
        started = threading.Event()

        def run():  # this thread lives as long as the rank's output: the rank's parent for PDEATHSIG
            try:
                self._proc = subprocess.Popen(
                    argv, env=rank_env(dict(os.environ), env), cwd=cwd or os.path.expanduser("~"),
                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                    errors="replace", bufsize=1, preexec_fn=_die_with_parent if sys.platform == "linux" else None)
            except OSError as err:
                with self._lock:
                    self._lines.append(f"hvdhetero: could not start the rank: {err}\n")
                    self._code = 127
                started.set()
                return
            started.set()
            self._proc.stdout.reconfigure(newline="\n")  # a progress bar's "\r" ends no line (lines.settled)
            for line in self._proc.stdout:
                with self._lock:
                    self._lines.append(line)
            code = self._proc.wait()
            with self._lock:  # after the last line: the driver sees every line before the exit code
                self._code = code

        threading.Thread(target=run, name="hvdhetero-rank", daemon=True).start()
        started.wait(60)
        return os.getpid(), self._proc.pid if self._proc else -1

    def poll(self) -> tuple[list[str], int | None]:
        """The lines written since the last poll, and the exit code once the rank has ended."""
        with self._lock:
            lines, self._lines = self._lines, []
            return lines, self._code

    def stop(self, grace_s: float = 5.0) -> int | None:
        """SIGTERM, then SIGKILL after `grace_s` (a stopped process ends too)."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return None if proc is None else proc.returncode
        proc.terminate()
        try:
            return proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait(timeout=10)
