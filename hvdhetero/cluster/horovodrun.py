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

Launcher side: imports Horovod's runner (no torch).
"""

from __future__ import annotations

import importlib.util
import runpy
import sys
from pathlib import Path

from horovod.runner import launch

from hvdhetero.cluster.horovod_build import MARKER_MODULE

_asked = launch.gloo_built


def gloo_built(verbose: bool = False) -> bool:
    """horovodrun's `gloo_built`, answered from our build's marker where it is installed."""
    if importlib.util.find_spec(f"horovod.{MARKER_MODULE}") is not None:
        return True
    return _asked(verbose=verbose)


def main() -> None:
    launch.gloo_built = gloo_built  # horovodrun's run_controller and elastic launch look it up here
    script = Path(sys.executable).parent / "horovodrun"
    sys.argv[0] = str(script)
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
