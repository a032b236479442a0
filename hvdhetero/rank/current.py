"""This process's Job: `hh.init()` makes it once and returns it on every later call; an
elastic reset drops it, and the script's next `hh.init()` makes one for the new membership.
Kept on the rank side (not in the package's `__init__`), so that rank/elastic.py reaches it
without importing the package that imports the Job."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hvdhetero.rank.job import Job

job: Job | None = None


def drop() -> Job | None:
    """Forget this process's Job (an elastic reset) and return it."""
    global job
    dropped, job = job, None
    return dropped
