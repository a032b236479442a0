"""This process's Job: `hh.init()` makes it once and returns it on every later call; an
elastic reset drops it, and the script's next `hh.init()` makes one for the new membership.
Kept on the rank side (not in the package's `__init__`), so that rank/elastic.py reaches it
without importing the package that imports the Job (nor the Job: what a reset needs of it is
`Droppable`)."""

from __future__ import annotations

from typing import Any, Protocol


class Droppable(Protocol):
    step: int

    def close(self) -> None: ...


job: Any = None
"""The Job (rank/job.py), once hh.init() made it."""
runner_seed: int | None = None
"""The seed the runner gave torch before the script began (None: a script launched without it,
which hh.init() seeds, unless it runs `plain`)."""
rank_seed: int | None = None
"""The seed job.prepare gave this rank's own stream (rank/preparing.py own_stream): an elastic reset
runs the script again from its top with it standing, and hh.init seeds that as the runner's."""
plain = False
"""Run with plain python (no launcher), no seed= given to hh.init(): a job of one rank that
seeds nothing, so the script's own torch.manual_seed (before hh.init() or after) stands, as on
one device (hh.init() seeded over it: the run was not the script's)."""


def drop() -> Droppable | None:
    """Forget this process's Job (an elastic reset) and return it."""
    global job
    dropped, job = job, None
    return dropped
