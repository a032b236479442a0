"""`horovodrun` as every job starts it: the horovodrun beside this interpreter, less one slow
self-check.

    python -m hvdhetero.cluster.horovodrun -np 2 -H localhost:2 --gloo ... (horovodrun's own flags)

Before each job horovodrun asks whether its build has Gloo by importing horovod.torch, all of
torch, in a forked child: 1.4-1.8 s of every job's start here, before any rank exists. Our own
build answers that question without torch: it is only ever built with HOROVOD_WITH_GLOO=1
(cluster/horovod_build.py; the build fails without Gloo, and `invoke provision` verifies
`hvd.gloo_built()`: horovod_build.VERIFY_PY), and it carries a marker module saying it is ours. So where the
marker is there the answer is yes; a Horovod without it (stock, or the user's own) is asked the
slow way, as horovodrun would. Everything else is horovodrun's own code, run from its script.

horovodrun also writes its own environment into every rank's command line (`env K=V ... python
...`), remote hosts included. The launcher gives it an allowlist (cluster/supervise.py FORWARDED:
no secrets), but the machine-specific part of that list -- HOME, PATH, TMPDIR, USER, LOGNAME,
SSH_AUTH_SOCK -- must stay on the launcher: a Mac rank given the PC's HOME=/home/anna looked
for its env and its workdir (`~/...`, expanded by the rank) under /home/anna. Local ranks inherit
them from horovodrun itself; a remote rank keeps what its own sshd gave it.

horovodrun stops its ranks when SIGINT or SIGTERM sets a threading.Event from a signal handler.
Ctrl-C reaches horovodrun with the terminal's process group and the launcher's SIGTERM follows at
once: where the second signal landed while the first handler held the Event's lock, the handler
ran again inside it and waited on that lock forever, so the ranks trained on (and their output
went nowhere) until the launcher killed horovodrun 15 s later (seen: 12 more epochs, 14.5 s).
`one_shutdown_signal` gives it a handler that ignores both signals before it sets the event.

A process of its own (the launcher never imports Horovod): it imports Horovod's runner, not torch.
"""

from __future__ import annotations

import importlib.util
import runpy
import signal
import sys
import threading
from pathlib import Path

from hvdhetero.cluster.horovod_build import MARKER_MODULE
from hvdhetero.config import MACHINE_OWN


def ours() -> bool:
    """Whether the Horovod this interpreter imports is our build (it carries the marker)."""
    return importlib.util.find_spec(f"horovod.{MARKER_MODULE}") is not None


def keep_hosts_own_env() -> None:
    """horovodrun's rank commands leave MACHINE_OWN out (Horovod's own list of what it never
    exports, where it leaves out its secret key)."""
    from horovod.runner.common.util import env as env_util

    env_util.IGNORE_REGEXES.update(f"{name}$" for name in MACHINE_OWN)


def one_shutdown_signal() -> None:
    """horovodrun's register_shutdown_event (static and elastic jobs alike), whose handler cannot
    be entered twice: it ignores SIGINT and SIGTERM before it sets the event (module docstring)."""
    from horovod.runner import gloo_run

    def register_shutdown_event() -> threading.Event:
        event = threading.Event()

        def shut_down(signum, frame):
            for s in (signal.SIGINT, signal.SIGTERM):
                signal.signal(s, signal.SIG_IGN)  # before event.set takes its lock: no second handler inside it
            event.set()

        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, shut_down)
        return event

    gloo_run.register_shutdown_event = register_shutdown_event


def main() -> None:
    from horovod.runner import launch  # this process is horovodrun: the launcher never imports it

    keep_hosts_own_env()
    one_shutdown_signal()

    asked = launch.gloo_built
    # horovodrun's run_controller and its elastic launch look the check up in its module
    launch.gloo_built = lambda verbose=False: ours() or asked(verbose=verbose)
    script = Path(sys.executable).parent / "horovodrun"
    sys.argv[0] = str(script)
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
