"""`horovodrun` as every job starts it: the horovodrun beside this interpreter, less one slow
self-check.

    python -m hvdhetero.cluster.horovodrun -np 2 -H localhost:2 --gloo ... (horovodrun's own flags)

Before each job horovodrun asks whether its build has Gloo by importing horovod.torch, all of
torch, in a forked child: 1.4-1.8 s of every job's start here, before any rank exists. Our own
build answers that question without torch: it is only ever built with HOROVOD_WITH_GLOO=1
(cluster/horovod_build.py; the build fails without Gloo, and `invoke provision` checks
`horovodrun --check-build`), and it carries a marker module saying it is ours. So where the
marker is there the answer is yes; a Horovod without it (stock, or the user's own) is asked the
slow way, as horovodrun would. Everything else is horovodrun's own code, run from its script.

A process of its own (the launcher never imports Horovod): it imports Horovod's runner, not torch.
"""

from __future__ import annotations

import importlib.util
import runpy
import sys
from pathlib import Path

from hvdhetero.cluster.horovod_build import MARKER_MODULE


def ours() -> bool:
    """Whether the Horovod this interpreter imports is our build (it carries the marker)."""
    return importlib.util.find_spec(f"horovod.{MARKER_MODULE}") is not None


def main() -> None:
    from horovod.runner import launch  # this process is horovodrun: the launcher never imports it

    asked = launch.gloo_built
    # horovodrun's run_controller and its elastic launch look the check up in its module
    launch.gloo_built = lambda verbose=False: ours() or asked(verbose=verbose)
    script = Path(sys.executable).parent / "horovodrun"
    sys.argv[0] = str(script)
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
