"""This checkout's own places, as the launcher finds them: its root (tasks.py, inventory.yaml,
pyproject.toml, the hvdhetero package) and the env ci/setup makes there."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv"
INVENTORY = ROOT / "inventory.yaml"
