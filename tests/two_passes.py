"""ci/test's two passes (a plugin of tests/conftest.py): the tests marked `alone` one at a time,
then every other test on two pytest-xdist workers, by groups, the largest first."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

LONGEST_FIRST = ["hosts", "test_ported", "test_elastic", "checkpoints", "test_batch_function", "test_sweep",
                 "test_train", "test_script", "test_api", "provision-local", "test_mpi", "test_examples"]
"""Groups by their seconds in CI (the largest first, so that no worker is left with a long one at
the end); the others follow in file order."""

GROUPS = "HVDHETERO_PYTEST_GROUPS"
"""Where the workers write each test's group for the controller's scheduler (a JSON file)."""


def group(item) -> str:
    """The tests one worker runs, in file order: a module's own fixtures (a job, a cluster) run
    once. The test hosts are one set for the machine (ci/testhosts): every test on them is one
    group. Both Ray's local cluster and `provision --local` rewrite .venv's Ray and set-up stamp;
    test_checkpoint and test_failures share one EXACT run (exact_whole)."""
    module = Path(str(item.fspath)).stem
    if "hosts" in item.fixturenames or module == "test_testhosts":
        return "hosts"
    return {"test_ray": "provision-local", "test_preflight": "provision-local", "test_checkpoint": "checkpoints",
            "test_failures": "checkpoints"}.get(module, module)


def pytest_configure(config):
    if getattr(config.option, "dist", "no") == "loadgroup" and not os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ[GROUPS] = str(Path(tempfile.mkdtemp(prefix="hvdhetero-pytest-")) / "groups.json")  # workers inherit it


def pytest_unconfigure(config):
    if os.environ.get(GROUPS) and not os.environ.get("PYTEST_XDIST_WORKER"):
        shutil.rmtree(Path(os.environ.pop(GROUPS)).parent, ignore_errors=True)


def pytest_addoption(parser):
    parser.addoption("--machine", choices=["alone", "shared"],
                     help="alone: only the tests marked alone (one at a time; those on the test hosts excepted); "
                          "shared: every other (ci/test runs the first, then the second on two workers)")


def alone(item) -> bool:
    """Run in ci/test's first pass, one at a time: the test hosts' are one worker's, kept alone by
    the lock below."""
    return bool(item.get_closest_marker("alone")) and group(item) != "hosts"


def pytest_collection_modifyitems(config, items):
    if config.getoption("machine"):
        wanted = config.getoption("machine") == "alone"
        taken = {item: alone(item) == wanted for item in items}
        config.hook.pytest_deselected(items=[item for item, take in taken.items() if not take])
        items[:] = [item for item, take in taken.items() if take]
    if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get(GROUPS):
        first = {name: i for i, name in enumerate(LONGEST_FIRST)}
        items.sort(key=lambda item: first.get(group(item), len(first)))  # stable: file order within; alike in every worker
        written = Path(os.environ[GROUPS])
        partial = written.with_name(f"{written.name}.{os.getpid()}")
        partial.write_text(json.dumps({item.nodeid: group(item) for item in items}))
        os.replace(partial, written)  # every worker writes the same


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # before xdist's own, which reads a node id suffix pytest 9.2 drops
def pytest_xdist_make_scheduler(config, log):
    """--dist loadgroup by group(): each group runs on one worker, the groups in the workers'
    order, the next to the first worker nearly out of tests."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        groups: dict | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:  # written by then: workers write it before they report their collection
                self.groups = json.loads(Path(os.environ[GROUPS]).read_text())
            return self.groups.get(nodeid, nodeid.split("::")[0])

    return ByGroup(config, log)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under pytest-xdist a test marked `alone` (its assertions time something, or hang on speeds
    the ranks measured) runs with nothing beside it: it waits for the other worker's test to end
    and holds the next one back. Every other test holds the machine shared. Setup and teardown
    are inside, so a module's job run in a test's setup runs as that test does."""
    if not (os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get(GROUPS)):
        yield
        return
    with machine(Path(os.environ[GROUPS]).parent, alone=bool(item.get_closest_marker("alone"))):
        yield


@contextlib.contextmanager
def machine(folder: Path, alone: bool):
    """A fair readers-writer lock over flock(2): everyone passes the turnstile, in the order they
    came; a test alone holds it (no one passes behind it) until the shared tests before it are
    done and it has run. The kernel drops a dead worker's locks."""
    with open(folder / "turnstile", "a") as turnstile, open(folder / "machine", "a") as held:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(held, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)
            if alone:
                fcntl.flock(turnstile, fcntl.LOCK_UN)
