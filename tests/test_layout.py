"""The package's layout rules: the launcher side (hvdhetero/cluster) never imports torch or
horovod, so `invoke --list`, `check` and `--dry-run` start without them; the rank side
(hvdhetero/rank) never opens SSH or imports Invoke; the public API module imports nothing heavy
until a script calls it."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from conftest import ROOT

PACKAGE = ROOT / "hvdhetero"
FORBIDDEN = {
    "cluster": {"torch", "torchvision", "horovod", "ray", "hvdhetero.rank", "hvdhetero.recipes", "hvdhetero.bench"},
    # pure arithmetic both sides import: nothing heavy, nothing of either side
    "policy": {"torch", "torchvision", "horovod", "numpy", "fabric", "paramiko", "invoke", "hvdhetero.cluster",
               "hvdhetero.rank", "hvdhetero.recipes", "hvdhetero.bench"},
    "rank": {"fabric", "paramiko", "invoke", "hvdhetero.cluster", "hvdhetero.recipes", "hvdhetero.bench"},
    # sweeps are the launcher's, like cluster/: they start one-host jobs through it
    "sweep": {"torch", "torchvision", "horovod", "ray", "hvdhetero.rank", "hvdhetero.recipes", "hvdhetero.bench"},
}


def imported_modules(path) -> set[str]:
    """Every module an `import` or `from ... import` in the file names, at any depth (a lazy
    import inside a function counts too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


OWN_PROCESS = {"cluster/ray_driver.py": {"horovod.runner", "ray"}, "cluster/ray_rank.py": set(),
               "cluster/horovodrun.py": {"horovod.runner"}}
"""Cluster modules that run on a host as processes of their own, never imported by the launcher
(the test below holds them to it): the Ray driver is to a Ray job what horovodrun is to a Gloo
job, and holds Horovod's rendezvous server; ray_rank is its actor class, loaded by Ray's workers;
cluster/horovodrun.py is horovodrun itself, less a slow self-check."""


def violations(side: str) -> list[str]:
    out = []
    for path in sorted((PACKAGE / side).rglob("*.py")):
        allowed = OWN_PROCESS.get(str(path.relative_to(PACKAGE)), set())
        for name in imported_modules(path):
            if any(name == a or name.startswith(a + ".") for a in allowed):
                continue
            for bad in FORBIDDEN[side]:
                if name == bad or name.startswith(bad + "."):
                    out.append(f"{path.relative_to(ROOT)} imports {name}")
    return out


@pytest.mark.parametrize("side", sorted(FORBIDDEN))
def test_each_side_imports_only_what_it_may(side):
    assert (PACKAGE / side).is_dir()
    assert violations(side) == []


def test_the_modules_that_run_as_their_own_process_are_imported_by_no_launcher_module():
    own = {"hvdhetero." + m[:-3].replace("/", ".") for m in OWN_PROCESS}
    importers = [f"{path.relative_to(ROOT)} imports {name}" for side in ("cluster", "policy", "rank")
                 for path in sorted((PACKAGE / side).rglob("*.py")) if str(path.relative_to(PACKAGE)) not in OWN_PROCESS
                 for name in imported_modules(path) if name in own]
    importers += [f"tasks.py imports {name}" for name in imported_modules(ROOT / "tasks.py") if name in own]
    assert importers == []


def test_the_rule_check_sees_a_violation(tmp_path, monkeypatch):
    """The checker itself: a cluster module importing torch lazily is caught."""
    bad = tmp_path / "hvdhetero" / "cluster"
    bad.mkdir(parents=True)
    (bad / "oops.py").write_text("def f():\n    import torch.nn as nn\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path / "hvdhetero")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert violations("cluster") == ["hvdhetero/cluster/oops.py imports torch.nn"]


def test_launcher_modules_load_without_torch_or_horovod():
    modules = sorted(f"hvdhetero.{side}.{p.stem}" for side in ("cluster", "policy")
                     for p in (PACKAGE / side).glob("*.py") if p.stem != "__init__")
    code = (f"import sys, importlib; [importlib.import_module(m) for m in {modules!r}]; import hvdhetero, tasks; "
            "print(sorted({'torch', 'horovod', 'torchvision'} & {m.split('.')[0] for m in sys.modules}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_every_concept_sits_in_its_side_folder():
    """A newcomer finds the module from the concept's name and knows which process runs it."""
    where = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")}
    for module in ("cluster/inventory.py", "cluster/launch.py", "cluster/ssh.py", "cluster/provision.py",
                   "cluster/preflight.py", "cluster/horovod_build.py", "rank/devices.py", "rank/reducer.py",
                   "policy/balancer.py", "policy/plan.py", "policy/split.py", "policy/round_clock.py",
                   "rank/sampler.py", "rank/worker.py", "rank/checkpoint.py", "rank/training.py", "rank/start.py",
                   "rank/strategy.py", "rank/registry.py", "cluster/submit.py", "policy/checkpoints.py",
                   "recipes/data.py", "recipes/models.py", "bench/throughput.py", "bench/allreduce.py"):
        assert module in where, module


def module_graph(package=None) -> dict[str, set[str]]:
    """{module: the package's modules it imports}, lazy imports inside functions included and
    `if TYPE_CHECKING:` blocks left out (they never run); `from hvdhetero import progress` is an
    edge to hvdhetero.progress, not to the package."""
    package = package or PACKAGE
    modules = {".".join(p.relative_to(package.parent).with_suffix("").parts).removesuffix(".__init__"): p
               for p in package.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and getattr(node.test, "id", "") == "TYPE_CHECKING" for n in ast.walk(node)}
        edges = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = {f"{node.module}.{a.name}" for a in node.names} & set(modules)
                edges |= subs | ({node.module} if len(subs) < len(node.names) else set())
        graph[name] = (edges & set(modules)) - {name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles in `graph`: each strongly connected set of two modules or more."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_of_the_package_imports_itself_in_a_circle():
    """Each module's dependencies point one way (a lazy import inside a function counts: it
    runs, and the circle it closes is what the next refactor trips over)."""
    assert circles(module_graph()) == []


def test_the_circle_check_sees_a_circle(tmp_path):
    pkg = tmp_path / "hvdhetero"
    (pkg / "rank").mkdir(parents=True)
    (pkg / "__init__.py").write_text("def init():\n    from hvdhetero.rank.job import Job\n")
    (pkg / "rank" / "__init__.py").write_text("")
    (pkg / "rank" / "job.py").write_text("from hvdhetero.rank import elastic\n")
    (pkg / "rank" / "elastic.py").write_text("import hvdhetero\nfrom typing import TYPE_CHECKING\n"
                                           "if TYPE_CHECKING:\n    from hvdhetero.rank.job import Job\n")
    assert circles(module_graph(pkg)) == [["hvdhetero", "hvdhetero.rank.elastic", "hvdhetero.rank.job"]]


def job_reaches(package=None) -> list[str]:
    """Where the rank side reaches into the Job: a module of hvdhetero/rank other than job.py that
    imports it (an annotation-only import counts: the module was written against the Job), and
    any `job._private` outside job.py in the package."""
    package = package or PACKAGE
    found = []
    for path in sorted(package.rglob("*.py")):
        where = path.relative_to(package.parent).as_posix()
        if where == "hvdhetero/rank/job.py":
            continue
        if where.startswith("hvdhetero/rank/") and "hvdhetero.rank.job" in imported_modules(path):
            found.append(f"{where} imports the Job")
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if "job._" in line:
                found.append(f"{where}:{i} reads a private Job attribute")
    return found


def test_the_job_is_a_facade_nothing_on_the_rank_side_reaches_into():
    """rank/ parts are given what they use (rank/training.py's Training, its TrainState, records):
    none imports the Job or reads its privates, so a part can change without the Job and the
    next engine can drive the same parts."""
    assert job_reaches() == []


def test_the_facade_check_sees_a_reach(tmp_path):
    pkg = tmp_path / "hvdhetero"
    (pkg / "rank").mkdir(parents=True)
    (pkg / "rank" / "job.py").write_text("class Job:\n    _x = 1\n")
    (pkg / "rank" / "resume.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                          "    from hvdhetero.rank.job import Job\n")
    (pkg / "bench.py").write_text("def f(job):\n    return job._x\n")
    assert job_reaches(pkg) == ["hvdhetero/bench.py:2 reads a private Job attribute",
                                "hvdhetero/rank/resume.py imports the Job"]


def test_invoke_list_says_each_task_in_a_whole_sentence():
    """`invoke --list` shows a task's first docstring line: one cut mid-sentence read "predict
    samples/s for" and "prints E and ratios (or"."""
    proc = subprocess.run([sys.executable, "-m", "invoke", "--list"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    said: dict[str, str] = {}  # task: its line, its wrapped lines rejoined
    for line in proc.stdout.splitlines()[2:]:
        if line.startswith("  ") and not line.startswith("   "):
            name, said[name] = (line.split(None, 1) + [""])[:2]
        elif line.strip():
            said[name] += " " + line.strip()
    assert proc.returncode == 0 and len(said) >= 12, proc.stdout + proc.stderr
    assert [name for name, text in said.items() if not text.endswith(".")] == [], proc.stdout
