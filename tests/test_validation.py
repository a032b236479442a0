"""Every bad option value of `invoke train`, `plan` and `bench` ends before anything starts:
exit 2 within seconds, the option named, no traceback, no run directory, no horovodrun.

The commands run without --dry-run, through the real CLI, on a venv whose `horovodrun` only
leaves a mark (the launcher takes horovodrun from beside its own interpreter): a value that
slipped through would start it, and the test would say so. The last test shows the mark does
appear for good values.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from conftest import ROOT, VENV_BIN
from hvdhetero.bench.options import BenchOptions
from hvdhetero.config import JobConfig
from hvdhetero.errors import ConfigError
from hvdhetero.recipes.options import TRAIN_SAMPLES, RecipeOptions

SCRIPT = "tests/scripts/slow_step.py"  # any script of ours: the rows never get as far as running it

ROWS = [  # (task, argv, what the message must name); {tmp} is the test's folder
    ("train", ["--epochs", "0"], "--epochs"),
    ("train", ["--epochs", "-1"], "--epochs"),
    ("train", ["--epochs", "x"], "--epochs"),
    ("train", ["--batch-size", "1"], "--batch-size"),  # 2 ranks: one would get no sample
    ("train", ["--batch-size", "5000"], "--batch-size"),  # digits has 1,437 training samples
    ("train", ["--dataset", "imagenet"], "--dataset"),
    ("train", ["--model", "vit"], "--model"),
    ("train", ["--lr", "-1"], "--lr"),
    ("train", ["--lr", "nan"], "--lr"),
    ("train", ["--optimizer", "rmsprop"], "--optimizer"),
    ("train", ["--compression", "bf16"], "--compression"),
    ("train", ["--precision", "fp8"], "--precision"),
    ("train", ["--slowdown", "-3"], "--slowdown"),
    ("train", ["--slowdown", "0.5"], "--slowdown"),
    ("train", ["--slowdown", "inf"], "--slowdown"),
    ("train", ["--seed", "-1"], "--seed"),
    ("train", ["--sync", "local:0"], "--sync"),
    ("train", ["--sync", "diloco"], "--sync"),
    ("train", ["--overlap-sync"], "--overlap-sync"),  # with step sync
    ("train", ["--outer-momentum", "1"], "--outer-momentum"),
    ("train", ["--micro-batch", "-1"], "--micro-batch"),
    ("train", ["--keep-checkpoints", "-1"], "--keep-checkpoints"),
    ("train", ["--checkpoint-minutes", "nan"], "--checkpoint-minutes"),
    ("train", ["--hosts", "capped", "--batch-size", "64"], "max_batch caps"),  # 2 x 16 samples a step at most
    ("train", ["--hosts", "nosuch"], "--hosts"),
    ("train", ["--hosts", ","], "--hosts"),
    ("train", ["--script", "missing.py"], "--script"),
    ("train", ["--script", SCRIPT, "--dataset", "mnist"], "--dataset"),  # the recipe's, not the script's
    ("train", ["--workdir", "{tmp}"], "--workdir"),  # without --script
    ("train", ["--", "--repeat", "0"], "--repeat"),  # the recipe's own options after -- too
    ("train", ["--", "--no-such-option"], "--no-such-option"),
    ("train", ["--resume", "{tmp}/not-a-run"], "--resume"),
    ("train", ["--resume", "{tmp}/broken-run"], "--resume"),
    ("train", ["--resume", "latest"], "--resume"),
    ("plan", ["--batch-size", "0"], "--batch-size"),
    ("plan", ["--dataset", "imagenet"], "--dataset"),
    ("plan", ["--precision", "fp8"], "--precision"),
    ("plan", ["--micro-batch", "x"], "--micro-batch"),
    ("plan", ["--out", "{tmp}/no-such-folder/plan.json"], "--out"),
    ("plan", ["--script", "missing.py"], "--script"),
    ("bench", ["--hosts", "nosuch"], "--hosts"),
    ("bench", ["--repeats", "0"], "--repeats"),
    ("bench", ["--repeats", "x"], "--repeats"),
    ("bench", ["--batch-size", "1"], "--batch-size"),
    ("bench", ["--steps", "0"], "--steps"),
    ("bench", ["--min-seconds", "-1"], "--min-seconds"),
    ("bench", ["--cycle-time-ms", "-1"], "--cycle-time-ms"),
    ("bench", ["--slowdown", "0.5"], "--slowdown"),
    ("bench", ["--sync", "local:0"], "--sync"),
    ("bench", ["--sync", "auto"], "--sync"),
    ("bench", ["--out", "{tmp}"], "--out"),  # a folder
    ("bench", ["--seeds", "1"], "--seeds"),  # only --to-accuracy takes seeds
    ("bench", ["--to-accuracy", "1.5", "--sync", "local:4"], "--to-accuracy"),
    ("bench", ["--to-accuracy", "0.9", "--sync", "local:4", "--seeds", "x"], "--seeds"),
    ("bench", ["--to-accuracy", "0.9", "--sync", "local:4", "--epochs", "0"], "--epochs"),
    ("bench", ["--to-accuracy", "0.9", "--sync", "local:4", "--batch-size", "20000"], "--batch-size"),
    ("bench", ["--allreduce", "--sizes-mb", "x"], "--sizes-mb"),
    ("bench", ["--allreduce", "--rounds", "0"], "--rounds"),
    ("bench", ["--allreduce", "--transports", "quic"], "--transports"),
    ("bench", ["--allreduce", "--slowdown", "3"], "--slowdown"),  # the allreduce bench has no straggler
]


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory) -> dict:
    """A venv whose horovodrun marks a file and fails, an inventory whose `local` host uses it,
    and the folders --resume rows name."""
    tmp = tmp_path_factory.mktemp("validation")
    venv = tmp / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(VENV_BIN / "python")
    (venv / "lib").symlink_to(VENV_BIN.parent / "lib")
    (venv / "pyvenv.cfg").write_text((VENV_BIN.parent / "pyvenv.cfg").read_text())
    mark = tmp / "horovodrun-started"
    # Python, as pip writes horovodrun: the launcher runs it as a script (cluster/horovodrun.py)
    (venv / "bin" / "horovodrun").write_text(f"#!/usr/bin/env python3\nimport sys\n"
                                            f"open({str(mark)!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
                                            "sys.exit(1)\n")
    (venv / "bin" / "horovodrun").chmod(0o755)
    inventory = tmp / "inventory.yaml"
    inventory.write_text(f"""pins: {{python: "3.11", torch: "2.14.1", torchvision: "0.29.1", horovod: "0.28.1"}}
hosts:
  local: {{address: localhost, device: cpu, slots: 2, env: {venv}}}
  capped: {{address: localhost, device: cpu, slots: 2, env: {venv}, max_batch: 16}}
""")
    (tmp / "not-a-run").mkdir()
    (tmp / "broken-run").mkdir()
    (tmp / "broken-run" / "launch.json").write_text('{"hosts": ["local"], "sett')
    return {"tmp": tmp, "python": venv / "bin" / "python", "mark": mark, "inventory": inventory}


def invoke(sandbox: dict, task: str, argv: list[str], timeout: float = 20) -> tuple[int, str, float]:
    """Run `invoke TASK ARGV` with the sandbox's interpreter; (exit code, output, seconds)."""
    env = {**os.environ, "HVDHETERO_INVENTORY": str(sandbox["inventory"]),
           "HVDHETERO_RUNS": str(sandbox["tmp"] / "runs"), "PYTHONPATH": str(ROOT)}
    t0 = time.monotonic()
    proc = subprocess.Popen([str(sandbox["python"]), "-m", "invoke", task, *argv], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever it started goes too
        out, _ = proc.communicate()
        pytest.fail(f"invoke {task} {' '.join(argv)} still ran after {timeout} s:\n{out[-3000:]}")
    return proc.returncode, out, time.monotonic() - t0


@pytest.mark.parametrize("task, argv, named", ROWS, ids=[f"{t} {' '.join(a)}" for t, a, _ in ROWS])
def test_a_bad_value_is_refused_before_anything_starts(sandbox, task, argv, named):
    tmp = sandbox["tmp"]
    argv = [a.replace("{tmp}", str(tmp)) for a in argv]
    run_dir = tmp / "run"
    if task == "train" and "--resume" not in argv:  # --resume takes the run's own directory
        argv = [*argv[:argv.index("--")], "--run-dir", str(run_dir), *argv[argv.index("--"):]] if "--" in argv \
            else [*argv, "--run-dir", str(run_dir)]
    code, out, seconds = invoke(sandbox, task, argv)
    assert code == 2, out
    assert named in out, out
    assert "Traceback" not in out, out
    assert seconds < 15, f"took {seconds:.1f} s"
    assert not sandbox["mark"].exists(), f"horovodrun was started:\n{sandbox['mark'].read_text()}\n{out}"
    assert not run_dir.exists() and not (tmp / "runs").exists(), "a run directory was written"
    assert sum(1 for line in out.splitlines() if line.startswith("error: ")) == 1, out  # one message, no more


def test_the_table_covers_the_three_tasks():
    tasks = [t for t, _, _ in ROWS]
    assert len(ROWS) >= 25 and all(tasks.count(t) >= 6 for t in ("train", "plan", "bench"))


def test_good_values_do_reach_horovodrun(sandbox, tmp_path):
    """The sandbox's mark works: the same invocations with good values start horovodrun (which
    fails at once here), so the rows above show a bad value stopping before it."""
    run_dir = tmp_path / "run"
    code, out, _ = invoke(sandbox, "train", ["--epochs", "2", "--batch-size", "2", "--run-dir", str(run_dir)])
    assert code == 1 and sandbox["mark"].read_text().count("\n") == 1, out
    launch = json.loads((run_dir / "launch.json").read_text())
    assert launch["recipe"][:4] == ["--dataset", "digits", "--epochs", "2"]
    # the inventory found by default ($HVDHETERO_INVENTORY here) is the one a --resume takes, wherever it runs
    assert launch["inventory"] == str(sandbox["inventory"].resolve()), launch
    code, out, _ = invoke(sandbox, "bench", ["--repeats", "1", "--steps", "1"])
    assert code == 1 and sandbox["mark"].read_text().count("\n") == 2, out
    sandbox["mark"].unlink()


def test_a_launcher_that_is_not_installed_is_said_before_a_run_directory_is_written(sandbox, tmp_path):
    """pins.backend mpi set after ci/setup ran without it: the env has no mpirun. Said with the
    way out, and no run directory with a launch.json alone is left behind."""
    inventory = tmp_path / "mpi.yaml"
    inventory.write_text(sandbox["inventory"].read_text().replace('horovod: "0.28.1"', 'horovod: "0.28.1", backend: mpi'))
    run_dir = tmp_path / "run"
    code, out, _ = invoke(sandbox, "train", ["--inventory", str(inventory), "--run-dir", str(run_dir)])
    assert code == 1 and f"error: {sandbox['python'].parent / 'mpirun'} not found: run ci/setup (or invoke " \
        "provision) first" in out, out
    assert not run_dir.exists() and "Traceback" not in out, out


def test_the_recipe_on_a_rank_refuses_by_the_same_definition():
    """The recipe parses its command line into the RecipeOptions the launcher checked: a value
    that reached a rank some other way is refused there with the same words."""
    proc = subprocess.run([str(VENV_BIN / "python"), "-m", "hvdhetero.recipes.train", "--epochs", "0"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip() == ("python -m hvdhetero.recipes.train: error: --epochs must be an integer >= 1 "
                                   "(passes over the training set), got 0")


def test_options_round_trip_through_the_recipe_command_line():
    for options in (RecipeOptions(), RecipeOptions(dataset="cifar10", model="resnet18", epochs=3, batch_size=512,
                                                   lr=0.1, optimizer="sgd", download=True, repeat=2,
                                                   target_accuracy=0.9)):
        assert RecipeOptions.parse(options.argv()) == options
    assert RecipeOptions(lr=1).lr == 1.0 and isinstance(RecipeOptions(lr=1).lr, float)


def test_the_digits_size_the_launcher_checks_batches_against_is_the_loaders():
    from hvdhetero.recipes import data  # torch: imported only here

    train, _, _ = data.load("digits", "unused")
    assert len(train) == TRAIN_SAMPLES["digits"]


@pytest.mark.parametrize("cls, values, message", [
    (RecipeOptions, {"epochs": "3"}, "--epochs must be an integer, got '3' (str)"),
    (JobConfig, {"seed": True}, "--seed must be an integer, got True (bool)"),
    (JobConfig, {"slowdown": "2"}, "--slowdown must be a number, got '2' (str)"),
    (BenchOptions, {"repeats": 2.5}, "--repeats must be an integer or None, got 2.5 (float)"),
])
def test_the_dataclasses_check_types_too(cls, values, message):
    """From Python (hh.init(**overrides), a hand-edited launch.json) no CLI casts the values first."""
    with pytest.raises(ConfigError) as raised:
        cls(**values)
    assert str(raised.value) == message


def test_numbers_are_taken_as_their_kind():
    config = JobConfig(micro_batch=64, checkpoint_minutes=5)  # as hh.init(micro_batch=64) or JSON hands them
    assert (config.micro_batch, config.checkpoint_minutes) == ("64", 5.0)
    assert JobConfig.from_json(config.to_json()) == config
