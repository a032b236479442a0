"""Shared test helpers: the checkout, its venv, and running real commands with a time limit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent


def run_cmd(argv, *, timeout=600, cwd=ROOT, env=None, check=True) -> subprocess.CompletedProcess:
    """Run a real command; on failure show its output in the assertion."""
    proc = subprocess.run([str(a) for a in argv], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    if check and proc.returncode != 0:
        pytest.fail(f"{argv} exited {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


requires_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root: creates network namespaces and runs sshd (CI runs as root)")
