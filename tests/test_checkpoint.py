"""Periodic checkpoints and --resume: atomic files, the newest that loads, and a run killed
mid-epoch that resumes to exactly the parameters of an uninterrupted one."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import EXACT, ROOT, VENV_BIN, run_cmd
from hvdhetero import metrics
from hvdhetero.policy.checkpoints import RETIME, CheckpointSchedule
from hvdhetero.rank import checkpoint


def test_a_commit_taken_right_after_a_restore_holds_the_restored_loader_position():
    """An --elastic rejoin restores the last commit, then commits at once (before any step): that
    commit held loader step 0, not the restored 18, so a second reset before the next commit
    dealt the epoch again from its start. The parts are stand-ins; resume.restore is the job's."""
    from types import SimpleNamespace

    from hvdhetero.rank import resume
    from hvdhetero.rank.counting import Counting
    from hvdhetero.rank.passes import Passes
    from hvdhetero.rank.registry import TrainState

    train = TrainState()
    t = SimpleNamespace(parts=SimpleNamespace(load_state_dict=lambda state: None, parts={}), train=train,
                        strategy=SimpleNamespace(restart=lambda step: None), passes=Passes(train),
                        loader=SimpleNamespace(start_step=0), loader_at=0, config=SimpleNamespace(seed=0), rank=0,
                        is_main=True, count=Counting(True))
    resume.restore(t, {"step": 12, "epoch": 3, "epoch_done": False, "loader_step": 18}, rng=None)
    assert (t.train.step, t.train.epoch, t.loader.start_step, t.loader_at) == (12, 3, 18, 18)
    assert t.count.partial, "the epoch's rest: no epoch's count for the live line"


def test_a_file_job_save_writes_has_the_mode_torch_save_gives_it(tmp_path):
    """job.save's model (and a checkpoint) is readable as torch.save's is under the umask in force:
    it was 0o600, a temporary file's mode, where torch.save left 0o644."""
    before = os.umask(0o022)
    try:
        checkpoint.save_object({"w": torch.ones(2)}, tmp_path / "model.pt")
        torch.save({"w": torch.ones(2)}, tmp_path / "torch.pt")
    finally:
        os.umask(before)
    modes = [(tmp_path / name).stat().st_mode & 0o777 for name in ("model.pt", "torch.pt")]
    assert modes == [0o644, 0o644], [oct(m) for m in modes]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt", "torch.pt"]  # no temporary file left


@pytest.mark.parametrize("every_steps, minutes, keep, step_s, expected", [
    (25, 0, 3, 0.5, 25),      # --checkpoint-every alone
    (0, 1, 3, 0.5, 120),      # one minute at 0.5 s a step
    (25, 1, 3, 0.5, 25),      # both: the sooner
    (500, 1, 3, 0.5, 120),
    (0, 10, 3, 0.0, 0),       # minutes, but no step time yet: nothing periodic until one is measured
    (0, 1, 3, 600.0, 1),      # a step longer than the interval: every step, never 0
    (25, 1, 0, 0.5, 0),       # --keep-checkpoints 0: none
])
def test_the_checkpoint_interval_is_the_sooner_of_steps_and_minutes(every_steps, minutes, keep, step_s, expected):
    schedule = CheckpointSchedule(every_steps, minutes, keep)
    schedule.retime(step_s)
    assert schedule.every == expected
    if expected:
        assert not schedule.due(100 + expected - 1, last_checkpoint=100)
        assert schedule.due(100 + expected, last_checkpoint=100)
    else:
        assert not schedule.due(10_000, last_checkpoint=0)


def train(*args, run_dir: Path, timeout=600, check=True):
    return run_cmd([VENV_BIN / "invoke", "train", *args, "--run-dir", run_dir, "--", "--repeat", "4"],
                   timeout=timeout, check=check)


def killed_after_step(args: list[str], run_dir: Path, step: int) -> None:
    """Start `invoke train` and SIGKILL its whole process group once a checkpoint at or after
    `step` exists (mid-epoch: 90 steps an epoch here)."""
    proc = subprocess.Popen([str(VENV_BIN / "invoke"), "train", *args, "--run-dir", str(run_dir), "--", "--repeat",
                             "4"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if any(int(p.stem.split("-")[1]) >= step for p in checkpoint.listed(run_dir)):
                break
            time.sleep(0.02)
        assert proc.poll() is None, "the run ended before it could be killed"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def end_record(run_dir: Path) -> dict:
    records = metrics.records(run_dir / "metrics.jsonl")
    assert records[-1]["event"] == "end", records[-1]
    return records[-1]


@pytest.mark.slow
@pytest.mark.parametrize("mode", [[], ["--sync", "diloco:4"]], ids=["step", "diloco"])
def test_a_run_killed_mid_epoch_resumes_to_the_same_parameters(tmp_path, mode, request):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    if mode:
        train(*EXACT, *mode, run_dir=whole)
    else:  # step sync: the session's undisturbed EXACT run (test_failures' reference too)
        whole = request.getfixturevalue("exact_whole")
    killed_after_step([*EXACT, *mode], cut, 50)
    newest = checkpoint.newest(cut)
    assert newest is not None and 50 <= newest[1]["step"] < 270 and not newest[1]["epoch_done"], newest[0]
    proc = run_cmd([VENV_BIN / "invoke", "train", "--resume", cut], timeout=600)
    assert f"resuming from {newest[0]} (epoch 1, step {newest[1]['step']})" in proc.stdout
    a, b = end_record(whole), end_record(cut)
    assert a["param_digests"] == b["param_digests"] and a["test_accuracy"] == b["test_accuracy"], (a, b)
    # the metrics continue where the checkpoint was taken: every epoch once, one start per launch
    records = metrics.records(cut / "metrics.jsonl")
    assert [r["epoch"] for r in records if r["event"] == "epoch"] == [0, 1, 2]
    starts = [r for r in records if r["event"] == "start"]
    assert len(starts) == 2 and starts[1]["resumed_from"] == str(newest[0])
    # the recipe's clock counts on from the checkpoint's (job.track): its seconds are the whole run's
    clock, last = newest[1]["tracked"]["clock"], [r for r in records if r["event"] == "log"][-1]
    assert last["elapsed_seconds"] > clock["elapsed"] > 0 and last["train_seconds"] > clock["trained"] > 0, clock


def test_checkpoints_are_kept_newest_k_hold_what_a_resume_needs_and_a_finished_run_resumes_to_nothing(tmp_path):
    train("--epochs", "2", "--checkpoint-every", "20", "--keep-checkpoints", "2", run_dir=tmp_path)
    kept = checkpoint.listed(tmp_path)
    # 90 steps an epoch: 20, 40, 60, 80, 90 (its end), 110, ..., 170, 180: N steps after the last one
    assert [p.name for p in kept] == ["step-000000170.pt", "step-000000180.pt"], kept
    state = checkpoint.load(kept[-1])  # weights_only: nothing unpickled
    assert state["epoch_done"] and state["step"] == 180 and state["size"] == 2
    assert {"model", "optimizer", "rng", "split", "config", "metrics_offset", "sync", "scheduler"} <= set(state)
    assert len(state["rng"]) == 2 and state["config"]["seed"] == 0
    assert not list((tmp_path / "checkpoints").glob(".*tmp")), "no temporary file left"
    # resumed, the finished run says so and launches nothing (it said "resuming ... (epoch 3, ...)")
    before = (tmp_path / "metrics.jsonl").read_bytes()
    proc = run_cmd([VENV_BIN / "invoke", "train", "--resume", tmp_path], timeout=60)
    assert f"the run in {tmp_path} trained to its end (2 epochs, step 180); nothing is left to resume" in proc.stdout
    assert "resuming from" not in proc.stdout and (tmp_path / "metrics.jsonl").read_bytes() == before


def test_a_loop_of_its_own_is_retimed_from_its_slowest_ranks_whole_steps():
    """No epoch's end retimes a loop of the script's own: every RETIME steps the slowest rank's
    mean whole step does (each step's first, before any step ended, counts nothing)."""
    schedule = CheckpointSchedule(0, 1, 3)
    schedule.retime(0.015)  # the calibrated step: the model's compute alone
    assert schedule.every == 4000
    schedule.paced([0.0, 0.0])
    for _ in range(RETIME - 1):
        schedule.paced([0.04, 0.05])
    assert schedule.every == 4000, "not before RETIME steps"
    schedule.paced([0.06, 0.05])
    assert schedule.every == round(60 / ((0.05 * (RETIME - 1) + 0.06) / RETIME))  # about 1,190 steps a minute

def test_a_loop_of_its_own_checkpoints_every_so_many_minutes_of_its_measured_steps(tmp_path):
    """A script looping over iterations (tests/scripts/step_loop.py, no job.epochs) has no epoch's end
    to turn --checkpoint-minutes into steps: the start's calibrated step (the model's compute alone,
    over ten times faster than a whole step here) made 0.3 s hundreds of steps, and none came. The steps'
    own pace, every rank's alike, now sets it from step 32 on."""
    run_cmd([VENV_BIN / "invoke", "train", "--script", ROOT / "tests" / "scripts" / "step_loop.py", "--run-dir",
             tmp_path, "--checkpoint-minutes", "0.005", "--keep-checkpoints", "100", "--", "--max-iters", "300",
             "--log-interval", "100"], timeout=300)
    taken = [r for r in metrics.records(tmp_path / "metrics.jsonl") if r["event"] == "checkpoint"]
    end = metrics.records(tmp_path / "metrics.jsonl")[-1]
    assert taken and all(r["step"] > 32 for r in taken), (taken, end)
    assert [p.name for p in checkpoint.listed(tmp_path)] == [f"step-{r['step']:09d}.pt" for r in taken]

def test_a_job_of_one_rank_checkpoints_every_so_many_minutes_within_its_first_epoch(tmp_path):
    """A job of one rank (plain python, a sweep's trial on a one-slot host) is not timed at start:
    there is no split to size. Its first epoch's own steps set --checkpoint-minutes' interval from
    step 32 on, not that epoch's end, which may be hours away."""
    script = tmp_path / "one_epoch.py"
    script.write_text(
        "import torch\nfrom torch import nn\nfrom torch.utils.data import TensorDataset\nimport hvdhetero as hh\n"
        f"job = hh.init(run_dir={str(tmp_path / 'run')!r}, checkpoint_minutes=0.002, keep_checkpoints=100)\n"
        "model = nn.Linear(4, 1)\noptimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "data = TensorDataset(torch.randn(3200, 4), torch.randn(3200, 1))\n"
        "model, optimizer, loader = job.prepare(model, optimizer, data, global_batch=16)\n"
        "for epoch in job.epochs(1):\n    for x, y in loader:\n        optimizer.zero_grad()\n"
        "        job.backward(nn.functional.mse_loss(model(x), y))\n        optimizer.step()\n")
    run_cmd([VENV_BIN / "python", script], cwd=tmp_path, timeout=120)
    records = metrics.records(tmp_path / "run" / "metrics.jsonl")
    assert records[0]["ranks"] == 1
    taken = [r["step"] for r in records if r["event"] == "checkpoint"]
    assert any(32 < step < 200 for step in taken), taken  # the epoch's 200 steps: its end's is not the first


@pytest.mark.parametrize("kind", ["hand", "timm"])
def test_a_scheduler_not_torchs_steps_once_a_step_checkpoints_and_stays_out_of_the_scripts_own_save(tmp_path, kind):
    """scheduler= of another kind than torch's (tests/scripts/own_scheduler.py): a class of the
    script's own with no state_dict() stopped the job at its first checkpoint (AttributeError);
    timm's kind, whose state_dict() is its __dict__, carried our once-a-step `step` into the
    script's own torch.save, which torch.load(weights_only=True) refused. Now each steps once a
    step (20 steps in 2 epochs), the checkpoints hold its schedule, and the script's save loads."""
    proc = run_cmd([VENV_BIN / "invoke", "train", "--script", ROOT / "tests" / "scripts" / "own_scheduler.py",
                    "--run-dir", tmp_path, "--checkpoint-every", "5", "--keep-checkpoints", "10", "--micro-batch", "25",
                    "--", "--kind", kind], timeout=300)
    assert "epoch 1 loss" in proc.stdout and "schedule at 40" in proc.stdout, proc.stdout[-2000:]
    if kind == "timm":
        assert "own checkpoint's scheduler: {'n': 40}" in proc.stdout, proc.stdout[-2000:]
    for path in checkpoint.listed(tmp_path):
        state = torch.load(path, weights_only=True)
        assert state["scheduler"]["n"] == state["step"], (path.name, state["scheduler"])
        if kind == "hand":
            assert state["scheduler"] == {"warmup": 5, "total": 40, "lr": 0.05, "n": state["step"]}


def test_the_newest_checkpoint_that_loads_is_taken_and_those_passed_over_are_said(tmp_path, capsys):
    model = torch.nn.Linear(2, 2)
    for step in (10, 20, 30):
        checkpoint.save_object({"format": checkpoint.FORMAT, "step": step, "model": model.state_dict()},
                               checkpoint.path_for(tmp_path, step))
    checkpoint.path_for(tmp_path, 30).write_bytes(b"cut short")  # a copy cut short
    torch.save({"format": checkpoint.FORMAT, "step": 40, "hostile": Path("/")}, checkpoint.path_for(tmp_path, 40))
    path, state = checkpoint.newest(tmp_path)  # 40 needs unpickling a Path: refused by weights_only
    assert path.name == "step-000000020.pt" and state["step"] == 20
    said = capsys.readouterr().out.splitlines()
    assert [line.split(" does not load")[0] for line in said] == [
        f"hvdhetero: {checkpoint.path_for(tmp_path, 40)}", f"hvdhetero: {checkpoint.path_for(tmp_path, 30)}"], said
    assert all(line.endswith("passed over for the one before") for line in said), said
    checkpoint.keep_newest(tmp_path, 1)
    assert [p.name for p in checkpoint.listed(tmp_path)] == ["step-000000040.pt"]


@pytest.mark.parametrize("resume, says", [("latest-does-not-exist", "no such folder"), ("latest", "no run under")])
def test_resume_of_something_that_is_not_a_run_exits_2(resume, says, tmp_path):
    proc = run_cmd([VENV_BIN / "invoke", "train", "--resume", resume], cwd=ROOT, check=False, timeout=60,
                   env={"HVDHETERO_RUNS": str(tmp_path)})
    assert proc.returncode == 2 and says in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_resume_of_a_run_without_a_checkpoint_exits_2(tmp_path):
    (tmp_path / "launch.json").write_text(json.dumps({"hosts": ["local"]}))
    proc = run_cmd([VENV_BIN / "invoke", "train", "--resume", tmp_path], check=False, timeout=60)
    assert proc.returncode == 2 and "has no checkpoint" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_resume_with_other_options_than_the_hosts_exits_2_naming_them(tmp_path):
    (tmp_path / "launch.json").write_text(json.dumps({"hosts": ["local"]}))
    proc = run_cmd([VENV_BIN / "invoke", "train", "--resume", tmp_path, "--epochs", "5", "--sync", "local:4"],
                   check=False, timeout=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "--epochs, --sync" in out and "only --hosts, --inventory and --launcher" in out, out
    proc = run_cmd([VENV_BIN / "invoke", "train", "--resume", tmp_path, "--sync=step"], check=False, timeout=60)
    assert proc.returncode == 2 and "got --sync (start a new run" in proc.stdout + proc.stderr, "its default, as much"


@pytest.mark.alone
@pytest.mark.slow
def test_rank_0_killed_mid_save_20_times_leaves_a_newest_checkpoint_that_loads_and_resumes(tmp_path):
    """SIGKILL the saving process 20 times at random moments (mostly inside torch.save, fsync or
    the rename): every time, the newest checkpoint on disk loads and is the last save reported
    done or the one after it, the newest 3 are kept, and an interrupted save's temporary file
    is gone after the next save; then the run resumes from the newest."""
    import random

    run = tmp_path / "run"
    train("--epochs", "1", "--checkpoint-every", "5", "--checkpoint-minutes", "0", run_dir=run)
    rng = random.Random(7)
    done, unsaved_kills, saves = checkpoint.newest(run)[1]["step"], 0, 0
    # save_loop.py forks each saver from one process that imported torch once (see there)
    server = subprocess.Popen([str(VENV_BIN / "python"), str(ROOT / "tests/scripts/save_loop.py"), str(run)],
                              cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    bound = threading.Timer(300, server.kill)  # a read that never ends sees the server gone ("") instead
    bound.start()
    try:
        for kill in range(20):
            server.stdin.write("go\n")
            server.stdin.flush()
            ready = server.stdout.readline().split()
            assert ready[0] == "ready", ready
            time.sleep(rng.uniform(0.0, 0.5))
            os.kill(int(ready[1]), signal.SIGKILL)
            said = []  # by the saver, before it died
            while (line := server.stdout.readline()) not in ("ended\n", ""):  # "": the server died
                said.append(line)
            assert line == "ended\n", said
            reported = [int(line.split()[1]) for line in said if line.startswith("saved")]
            saves += len(reported)
            unsaved_kills = 0 if reported else unsaved_kills + 1
            done = reported[-1] if reported else done
            path, state = checkpoint.newest(run)
            assert state["step"] in (done, done + 1), (kill, path, done)  # +1: killed after the rename
            done = state["step"]
            assert len(checkpoint.listed(run)) <= 4, checkpoint.listed(run)  # 3 kept, + 1 before keep_newest ran
            temporary = list((run / checkpoint.FOLDER).glob(".step-*.tmp"))
            assert len(temporary) <= unsaved_kills + 1, (kill, temporary)
    finally:
        bound.cancel()
        server.kill()
        server.wait(timeout=30)
    assert saves >= 5, f"only {saves} saves completed in 20 runs: the kills did not interleave with saves"
    out = run_cmd([VENV_BIN / "invoke", "train", "--resume", run], timeout=600)
    assert f"step {done})" in out.stdout and "nothing left to train" in out.stdout, out.stdout[-2000:]
    # taken at the last epoch's end: after it (it said "epoch 3" of a 2-epoch run, the one that would come next)
    assert re.search(rf"resuming from \S+ \(after epoch \d+, step {done}\)", out.stdout), out.stdout[-2000:]


@pytest.mark.slow
def test_a_run_resumes_on_fewer_ranks_and_the_split_is_made_for_them(tmp_path):
    """Killed on two ranks; resumed with another inventory whose host has one slot (the Mac left
    at home): the run continues from the newest checkpoint to its end on one rank, the split made
    for one rank (the checkpoint's two-rank split is not forced on it)."""
    run_dir = tmp_path / "run"
    killed_after_step(["--epochs", "2", "--checkpoint-every", "25", "--checkpoint-minutes", "0"], run_dir, 50)
    newest = checkpoint.newest(run_dir)
    assert newest is not None and not newest[1]["epoch_done"], newest
    inventory = tmp_path / "one.yaml"
    inventory.write_text((ROOT / "inventory.yaml").read_text().replace("slots: 2", "slots: 1")
                         .replace("env: .venv", f"env: {ROOT / '.venv'}"))
    proc = run_cmd([VENV_BIN / "invoke", "train", "--resume", run_dir, "--inventory", inventory], timeout=600)
    assert f"resuming from {newest[0]}" in proc.stdout, proc.stdout[-3000:]
    records = metrics.records(run_dir / "metrics.jsonl")
    starts = [r for r in records if r["event"] == "start"]
    assert [s["ranks"] for s in starts] == [2, 1], starts
    after = [r for r in records if r["event"] == "epoch" and r["time"] > starts[1]["time"]]
    assert after and all(len(r["split"]) == 1 for r in after), after
    assert records[-1]["event"] == "end" and records[-1]["test_accuracy"] > 0.9, records[-1]


def format_run(run_dir: Path, sync: str, resume: bool = False) -> dict:
    proc = run_cmd([VENV_BIN / "python", ROOT / "tests/jobs/checkpoint_format.py", run_dir, sync,
                    *(["--resume"] if resume else [])], timeout=120)
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("FORMAT_END "))[11:])


@pytest.mark.parametrize("sync", ["step", "diloco:2"])
def test_a_checkpoint_written_before_the_registry_resumes_to_the_same_end(tmp_path, sync):
    """tests/data/checkpoints/ holds mid-epoch checkpoints that main wrote at 12ac92f (before
    checkpoints were taken over rank/registry.py's parts) with tests/jobs/checkpoint_format.py:
    resumed by today's code, the run ends with the parameters, schedule and tracked state of an
    uninterrupted run of today's code (which equals that commit's, bit for bit).

    Bit for bit on the kind of CPU that wrote them; on another kind (an AMD EPYC with AVX-512
    here, against the machine of 12ac92f) float32 kernels round the steps before the checkpoint
    differently in the last bit: the ends then differ by ~1e-7 relative (measured: 4.6e-8 step,
    1.1e-7 diloco), where a part left unrestored moves them by orders of magnitude more (the
    random states not restored: 2.5e-2)."""
    kept = ROOT / "tests/data/checkpoints" / sync.split(":")[0]
    whole = format_run(tmp_path / "whole", sync)
    (tmp_path / "cut" / "checkpoints").mkdir(parents=True)
    for saved in kept.glob("step-*.pt"):
        (tmp_path / "cut" / "checkpoints" / saved.name).write_bytes(saved.read_bytes())
    resumed = format_run(tmp_path / "cut", sync, resume=True)
    assert whole["step"] == 12 and whole["seen"] == 12, whole
    for key in ("lr", "seen", "step"):
        assert resumed[key] == whole[key], (key, resumed[key], whole[key])
    a, b = (torch.tensor(run["params"], dtype=torch.float64) for run in (whole, resumed))
    relative = float((a - b).norm() / a.norm())
    assert resumed["digest"] == whole["digest"] or relative <= 1e-6, relative


def test_a_gpu_ranks_random_state_is_saved_and_put_back(monkeypatch, tmp_path):
    """A CUDA rank's generator (its dropout draws from it) is in the rank's saved random states,
    loads with weights_only and is set back on resume (a resume was not bit-exact on an H200:
    it was missing; issue 32). torch.cuda is stood in for here, which has no GPU; tests/gpu runs
    the real one. A CPU rank saves none and asks torch.cuda nothing (a CUDA context there would
    take the GPU rank's memory)."""
    state = torch.arange(16, dtype=torch.uint8)
    put, asked = [], []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: asked.append(1) or state.clone())
    assert "cuda" not in checkpoint.rng_state("cpu") and not asked
    saved = checkpoint.rng_state("cuda")
    path = tmp_path / "rng.pt"
    checkpoint.save_object({"rng": [saved]}, path)
    loaded = torch.load(path, weights_only=True)["rng"][0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda new: put.append(new))
    checkpoint.set_rng_state(loaded)
    assert len(put) == 1 and torch.equal(put[0], state)


def test_a_resume_into_a_script_whose_model_changed_says_so_not_a_size_mismatch_alone(tmp_path):
    """A job of one rank checkpoints, stops, and its script's model is made wider before
    --resume: torch's size-mismatch traceback came with no word of why (and the console's resume
    command that failed alike); now the checkpoint is named, torch's detail kept, and what to do."""
    script = tmp_path / "widths.py"
    script.write_text(
        "import sys\nimport torch\nfrom torch import nn\nfrom torch.utils.data import TensorDataset\n"
        "import hvdhetero as hh\nwidth, resume = int(sys.argv[1]), sys.argv[2] == 'resume'\n"
        "job = hh.init(run_dir='run', checkpoint_every=5, resume=resume)\n"
        "model = nn.Sequential(nn.Linear(4, width), nn.Linear(width, 1))\n"
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "data = TensorDataset(torch.randn(320, 4), torch.randn(320, 1))\n"
        "model, optimizer, loader = job.prepare(model, optimizer, data, global_batch=16)\n"
        "for epoch in job.epochs(2):\n    for i, (x, y) in enumerate(loader):\n        optimizer.zero_grad()\n"
        "        job.backward(nn.functional.mse_loss(model(x), y))\n        optimizer.step()\n"
        "        if epoch == 1 and i == 3 and not resume:\n            raise SystemExit('stopped mid-run')\n")
    stopped = run_cmd([VENV_BIN / "python", script, "8", "new"], cwd=tmp_path, timeout=120, check=False)
    assert stopped.returncode == 1 and (tmp_path / "run" / "checkpoints" / "step-000000020.pt").is_file()
    resumed = run_cmd([VENV_BIN / "python", script, "16", "resume"], cwd=tmp_path, timeout=120, check=False)
    assert resumed.returncode == 1, resumed.stdout
    assert ("ConfigError: --resume: run/checkpoints/step-000000020.pt does not fit what the script builds now "
            "(RuntimeError: Error(s) in loading state_dict for Sequential: size mismatch for 0.weight") \
        in resumed.stderr
    assert "the script's model or optimizer changed since the checkpoint" in resumed.stderr, resumed.stderr[-2000:]


def test_a_resume_cuts_the_metrics_back_but_keeps_the_record_of_the_checkpoint_it_resumed_from(tmp_path):
    """A checkpoint holds the metrics' length when its state was taken; its own record comes right
    after. A resume cuts what came later, that record kept where it is the one resumed from (a
    torn, undecodable or non-object line after the offset is cut with the rest)."""
    log = metrics.MetricsLog(tmp_path / "metrics.jsonl")
    log.write("start", ranks=2)
    offset = log.offset()
    log.write("checkpoint", step=8, path="step-000000008.pt")
    log.write("epoch", epoch=1)
    resumed_from = lambda r: r.get("event") == "checkpoint" and r.get("step") == 8  # noqa: E731
    log.truncate(offset, keep=resumed_from)
    assert [r["event"] for r in metrics.records(tmp_path / "metrics.jsonl")] == ["start", "checkpoint"]
    log.truncate(offset, keep=lambda r: r.get("step") == 16)  # another checkpoint's: cut too
    assert [r["event"] for r in metrics.records(tmp_path / "metrics.jsonl")] == ["start"]
    for tail in ("[1, 2]\n", '{"event": "checkpoint", "step": 8', "\xff\n"):
        with open(tmp_path / "metrics.jsonl", "a") as f:
            f.write(tail)
        log.truncate(offset, keep=resumed_from)
        assert (tmp_path / "metrics.jsonl").stat().st_size == offset, tail
    log.close()


def test_a_checkpoint_resumed_with_another_count_of_steps_an_epoch_goes_on_at_its_epochs_step():
    """A checkpoint written with 11 steps an epoch (2 ranks: a bucket sampler's batch of 2 kept)
    and resumed where an epoch counts 10 (3 ranks leave it out), 3 steps into epoch 3: it goes on
    at epoch 3's step 3 as now counted (33 read as 10 an epoch skipped 3 steps never trained)."""
    from hvdhetero.rank.resume import loader_step

    assert loader_step({"loader_step": 36, "loader_steps": 11}, 10, 99) == 33
    assert loader_step({"loader_step": 36, "loader_steps": 11}, 11, 99) == 36
    assert loader_step({"loader_step": 43, "loader_steps": 11}, 10, 99) == 40  # its last step: past the new epoch's end
    assert loader_step({"loader_step": 36}, 10, 99) == 36  # a checkpoint from before the count was kept
    assert loader_step({}, 10, 99) == 99
