"""hvdhetero: one PyTorch model trained across MPS, CUDA and CPU machines with Horovod over Gloo.

The public API a training script uses (see README "Your own model"):

    import hvdhetero as hh
    job = hh.init()
    model, optimizer, loader = job.prepare(model, optimizer, train_set, global_batch=512)
    for epoch in job.epochs(10):
        for x, y in loader:
            with job.autocast():
                loss = F.cross_entropy(model(x), y)
            job.backward(loss)
            optimizer.step(); optimizer.zero_grad()

Launched with `invoke train --script my_train.py`. Nothing else in the package is public.
Importing it is cheap: torch and Horovod load when a script calls `init()` (the launcher side,
hvdhetero.cluster, never loads them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["init", "Job"]

if TYPE_CHECKING:
    from hvdhetero.rank.job import Job


def init(**overrides) -> "Job":
    """Join the job (rendezvous with the other ranks), set up this rank's device and settings,
    and return the Job. The settings come from `invoke train` (the job's --seed, --precision,
    --compression, ...); `overrides` (e.g. `seed=1`) change them for this script. Run without the
    launcher, the script is a job of one rank. Calling it again returns the same Job. In a DataLoader
    worker that a Mac spawns (it runs the script's top level again) it joins nothing: rank/spawned.py."""
    from hvdhetero.rank import current

    if current.job is None:
        from hvdhetero.rank import spawned

        if spawned.in_spawned_child():  # never a second join under the rank's name
            if spawned.running_the_top_level_again():  # a DataLoader worker a Mac spawned, starting
                return spawned.InSpawnedChild()
            raise RuntimeError(spawned.STARTED_BY_THE_SCRIPT)
        from dataclasses import replace

        from hvdhetero.config import JobConfig
        from hvdhetero.rank.job import Job

        config, launched = JobConfig.from_env(), JobConfig.launched()
        current.plain = not launched and "seed" not in overrides
        current.job = Job(replace(config, **overrides) if overrides else config)
        if not launched:
            import sys

            print(f"hvdhetero: run without invoke train: a job of one rank, its run directory "
                  f"{current.job.config.run_dir}", file=sys.stderr, flush=True)
    return current.job


def __getattr__(name: str):
    if name == "Job":
        from hvdhetero.rank.job import Job

        return Job
    raise AttributeError(f"module 'hvdhetero' has no attribute {name!r}")
