"""This checkout's own places, as the launcher finds them: its root (tasks.py, inventory.yaml,
pyproject.toml, the hvdhetero package) and the env ci/setup makes there."""

from __future__ import annotations

import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv"
INVENTORY = ROOT / "inventory.yaml"


def invoke(cwd: Path | None = None) -> str:
    """How to call this checkout's tasks from `cwd` (the current folder): `invoke` where Invoke
    finds this tasks.py (the checkout or a folder inside it), else `invoke -r ROOT` (a project
    folder of one's own, as the README's `invoke -r ~/hvdhetero train --script train.py`): a
    command a message offers to copy must run where the user stands."""
    here = (cwd or Path.cwd()).resolve()
    if here == ROOT or ROOT in here.parents:
        return "invoke"
    home = Path.home()
    inside = str(ROOT.relative_to(home)) if home in ROOT.parents else None
    safe = inside is not None and shlex.quote(inside) == inside  # (a `~/` quoted is not expanded)
    return f"invoke -r {'~/' + inside if safe else shlex.quote(str(ROOT))}"
