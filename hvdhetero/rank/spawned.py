"""hh.init() in a child process that multiprocessing started by spawning: a DataLoader worker on a
Mac, where spawn is Python's default. Such a child runs the script's top level again (as
`__mp_main__`, so that the dataset's classes defined there unpickle), and with it a module-level
`job = hh.init()`. Joining the job there would start Horovod once more under the rank's name; a
top level that also trains (no `if __name__ == "__main__":`) would then run job.prepare's
collectives from the worker, and the real rank, waiting for its batches, was reported frozen
after 45 s. So the child gets a stand-in: what a module level reads of a job (its rank and size,
is_main False, a CPU device: a worker collates on the CPU), and, for anything it
would do, an error that says where the training must go instead. A child the script starts to
train in (DDP's torch.multiprocessing.spawn) is told to train in the rank's process instead.
"""

from __future__ import annotations

import multiprocessing
import os
import sysconfig
import traceback

import torch

STDLIB = (sysconfig.get_paths()["stdlib"], "<")
"""Where the frames of the child's start are (multiprocessing's, runpy's, the `-c` it runs): not the script's."""


def in_spawned_child() -> bool:
    """Whether this process is a child that multiprocessing started (a DataLoader worker), not a
    rank: the rank, however launched (horovodrun, mpirun, Ray), is a process of its own."""
    return multiprocessing.current_process().name != "MainProcess" or multiprocessing.parent_process() is not None


def running_the_top_level_again() -> bool:
    """Whether this spawned child is still starting: running the script's top level again (what
    spawn does before it calls the child's target), not the target itself."""
    return bool(getattr(multiprocessing.current_process(), "_inheriting", False))


STARTED_BY_THE_SCRIPT = (
    "hh.init() ran in a process the script started itself (torch.multiprocessing.spawn or a "
    "multiprocessing.Process, DDP's way to start one process per GPU): invoke train starts one process per rank "
    "already; call the training function once, directly (main(0, 1) for mp.spawn(main, nprocs=...)), and "
    "hvdhetero shares its gradients (docs/api.md, 'From a DDP script')")
"""hh.init() in a child the script's own code started, once the child runs its target."""


class InSpawnedChild:
    """What hh.init() returns in such a child: read, not used."""

    def __init__(self) -> None:
        self.rank = int(os.environ.get("HOROVOD_RANK", 0))
        self.size = int(os.environ.get("HOROVOD_SIZE", 1))
        self.local_rank = int(os.environ.get("HOROVOD_LOCAL_RANK", 0))
        self.is_main = False  # never: a top level's `if job.is_main:` (a logger's run, a download) runs once
        self.device = torch.device("cpu")

    def __getattr__(self, name: str):
        if name.startswith("__"):  # copy, pickle and the like look for these
            raise AttributeError(name)
        what = (f"job.{name} ran in a process that multiprocessing started by spawning (a DataLoader worker: a Mac "
                "spawns them), which runs the script's top level again: keep hh.init() there if you like, but put "
                "the training under `if __name__ == \"__main__\":` (or in a main() called there), as a script with "
                "DataLoader workers on a Mac needs on one device too")
        if "HOROVOD_RANK" in os.environ:  # launched: the console says it as this rank's failure, the worker ends
            from hvdhetero.config import JobConfig
            from hvdhetero.rank import runner

            config = JobConfig.from_env()
            # the whole stack stays out of the line: each of the rank's workers writes one, and a line
            # under PIPE_BUF (4 KiB) reaches the rank's shared output whole
            runner.fail(config, f"RuntimeError: {what}",
                        [f for f in traceback.extract_stack()[:-1] if not f.filename.startswith(STDLIB)])
        raise RuntimeError(what)
