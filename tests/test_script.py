"""`invoke train --script`: a user's own script on two real ranks, launched as the built-in
recipe is, and what the user sees when it is wrong."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
import torch

from conftest import ROOT, VENV_BIN, left_running, run_cmd
from hvdhetero import metrics
from hvdhetero.cluster import failure

pytestmark = pytest.mark.slow
SCRIPTS = ROOT / "tests" / "scripts"


def test_a_users_own_script_trains_to_its_target_on_two_ranks(tmp_path):
    """Its own Dataset of dicts, model, loss, SGD with param groups, StepLR, clipping, a
    parameter only rank 0 gives a gradient; arguments after `--` reach it; the CSV it never
    closes holds every epoch (the rank's exit lets Python flush it)."""
    run_dir = tmp_path / "run"
    proc = run_cmd([VENV_BIN / "invoke", "train", "--script", SCRIPTS / "user_train.py", "--run-dir", run_dir,
                    "--", "--epochs", "12", "--history", tmp_path / "history"], timeout=600)
    records = metrics.records(run_dir / "metrics.jsonl")
    start, end = records[0], records[-1]
    assert start["event"] == "start" and start["ranks"] == 2
    logs = [r for r in records if r["event"] == "log"]
    assert [r["epoch"] for r in logs] == list(range(12)), "--epochs 12 reached the script"
    assert logs[-1]["lr"] == pytest.approx(0.1 * 0.5 ** 4), "the StepLR stepped once per epoch"
    assert end["test_accuracy"] >= 0.9, end
    assert len(set(end["param_digests"])) == 1, "ranks in sync"
    assert f"user script: test accuracy {end['test_accuracy']:.4f}" in proc.stdout  # rank 0's print, plain
    state = torch.load(run_dir / "model.pt", weights_only=True)
    assert set(state) >= {"head.weight", "only_rank_0"}
    for rank in (0, 1):
        rows = (tmp_path / f"history.{rank}").read_text().splitlines()
        assert [int(r.split(",")[0]) for r in rows] == list(range(12)), rows


def test_a_missing_script_or_one_that_is_not_python_is_refused_before_anything_starts(tmp_path):
    proc = run_cmd([VENV_BIN / "invoke", "train", "--script", tmp_path / "nope.py", "--run-dir", tmp_path / "r"],
                   check=False, timeout=60)
    assert proc.returncode == 2
    assert f"error: --script {tmp_path / 'nope.py'}: no such file" in proc.stderr
    assert "horovodrun" not in proc.stdout and not (tmp_path / "r").exists()
    # a syntax error: its line, as Python says it, before any rank starts (every rank failed with it)
    (tmp_path / "typo.py").write_text("import torch\nmodel = torch.nn.Linear(4, 2\nprint(model)\n")
    proc = run_cmd([VENV_BIN / "invoke", "train", "--script", tmp_path / "typo.py", "--run-dir", tmp_path / "r"],
                   check=False, timeout=60)
    said = proc.stderr[proc.stderr.index("error: "):].splitlines()
    assert proc.returncode == 2 and said[0].startswith(f"error: --script {tmp_path / 'typo.py'}:2: SyntaxError: "
                                                       "'(' was never closed"), proc.stderr
    assert said[1] == "    model = torch.nn.Linear(4, 2" and "nothing was started" in said[2], said
    assert "horovodrun" not in proc.stdout and not (tmp_path / "r").exists()


def test_a_module_the_rank_lacks_is_said_with_where_to_install_it():
    """torch's missing-package error as a rank's would be (the runner's path to the console is
    the DDP test's below): the console adds where the package goes, here and on remote hosts."""
    with pytest.raises(ModuleNotFoundError) as raised:
        import torchaudio_nowhere.io  # noqa: F401
    said = failure.summary([{"rank": 1, "host": "mac", "frames": ["train.py:3 in <module>: import torchaudio_nowhere.io"],
                             "error": f"{raised.type.__name__}: {raised.value}"}])
    assert "host mac has no module torchaudio_nowhere: a module of yours belongs in the --workdir folder" in said, said
    assert ".venv/bin/pip install torchaudio_nowhere, by its pip name) and into a remote host's through the " \
           "inventory's pins.packages (name==version), then invoke provision" in said, said
    older = failure.summary([{"rank": 1, "host": "mac", "frames": [],  # torchvision there, too old for the module
                              "error": "ModuleNotFoundError: No module named 'torchvision.transforms.v2'"}])
    assert "has no module torchvision.transforms.v2 (of torchvision: not there, or a version without it)" in older
    for other in ("ValueError: x", "ModuleNotFoundError: No module named '_lzma'"):  # Python's own C module: no pip
        assert "has no module" not in failure.summary([{"rank": 1, "host": "mac", "frames": [], "error": other}])


def test_a_script_outside_its_workdir_is_refused(tmp_path):
    proc = run_cmd([VENV_BIN / "invoke", "train", "--script", SCRIPTS / "user_train.py", "--workdir", tmp_path,
                    "--dry-run"], check=False, timeout=60)
    assert proc.returncode == 2 and "is not inside --workdir" in proc.stderr


def test_a_ddp_scripts_own_process_group_is_said_with_what_to_remove(tmp_path):
    """tests/scripts/ddp_habit.py calls init_process_group as a torchrun script does: torch's
    error (no RANK to start from), where, and what to remove. tests/scripts/mp_spawn_habit.py
    starts its processes as DDP does (mp.spawn): each is told that invoke train started the rank's
    already (it would have joined Horovod again under the rank's name). DDP or a DistributedSampler
    without a process group fail with torch's other error, which says the same (unit-checked)."""
    proc = run_cmd([VENV_BIN / "invoke", "train", "--script", SCRIPTS / "ddp_habit.py", "--run-dir", tmp_path / "run"],
                   check=False, timeout=120)
    assert proc.returncode == 1
    said = proc.stderr[proc.stderr.index("error: "):].splitlines()
    assert said[0].startswith("error: rank ") and "ValueError: Error initializing torch.distributed using env:// " \
                                                    "rendezvous: environment variable RANK expected" in said[0], said
    assert 'ddp_habit.py:14 in <module>: dist.init_process_group(backend="gloo")' in said[1], said
    hint = next(line for line in said if "starts torch.distributed itself" in line)
    assert "remove init_process_group, the DistributedDataParallel wrapper and the DistributedSampler" in hint
    assert "make a dist.all_reduce(t) of metrics t = job.reduce(t)" in hint
    proc = run_cmd([VENV_BIN / "invoke", "train", "--script", SCRIPTS / "mp_spawn_habit.py", "--run-dir",
                    tmp_path / "spawned"], check=False, timeout=120)  # DDP's mp.spawn(main, nprocs=2) kept
    said = proc.stderr[proc.stderr.index("error: "):].splitlines()
    assert proc.returncode == 1 and "failed: ProcessRaisedException: a process the script started failed: " \
        "RuntimeError: hh.init() ran in a process the script started itself (torch.multiprocessing.spawn" in said[0]
    assert "call the training function once, directly (main(0, 1)" in said[0], said
    assert "mp_spawn_habit.py:19 in <module>: mp.spawn(main, args=(2,), nprocs=2)" in said[1], said
    ddp = {"rank": 1, "host": "pc", "frames": [], "error": "ValueError: Default process group has not been "
           "initialized, please make sure to call init_process_group."}
    assert "starts torch.distributed itself" in failure.summary([ddp])
    assert "starts torch.distributed itself" not in failure.summary([{**ddp, "error": "ValueError: boom"}])
    local = failure.summary([{**ddp, "error": "KeyError: 'LOCAL_RANK'"}])  # torchrun's, read before the group
    assert "the script reads torchrun's LOCAL_RANK, which invoke train does not set: the rank is job.rank" in local
    assert "torchrun's" not in failure.summary([{**ddp, "error": "KeyError: 'LOCAL_RANKS'"}])
    for left in ("module", "no_sync"):  # DDP's wrapper dropped, still reached through
        said = failure.summary([{**ddp, "error": f"AttributeError: 'Net' object has no attribute '{left}'"}])
        assert "where that was DDP's wrapper, which a port drops: `model.module` is `model` now" in said, said


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: .cuda() does not fail here")
def test_a_device_the_script_names_itself_is_said_with_job_device_as_the_fix():
    """A port that kept `x.cuda()` fails on a rank without CUDA (the Mac; here, a PC without a
    driver) with torch's own words: the console adds what to use instead. torch's error is made
    here, as the rank's would be (the runner's path to the console is the DDP test's above)."""
    with pytest.raises((RuntimeError, AssertionError)) as raised:
        torch.zeros(1).cuda()
    cuda = {"rank": 1, "host": "mac", "frames": ["train.py:40 in <module>: x, y = x.cuda(), y.cuda()"],
            "error": f"{raised.type.__name__}: {raised.value}"}
    said = failure.summary([cuda])
    assert "the script names a device itself" in said and "which host mac has not" in said, said
    assert "with `.to(job.device)`, each rank's own device" in said
    mps = {**cuda, "error": "RuntimeError: PyTorch is not linked with support for mps devices"}
    assert "the script names a device itself" in failure.summary([mps])
    mixed = {**cuda, "error": "RuntimeError: Expected all tensors to be on the same device, but found at least two "
                              "devices, mps:0 and cpu!"}
    assert "use `device = job.device` for every `.to(device)`" in failure.summary([mixed])
    other = failure.summary([{**cuda, "error": "ValueError: boom"}])
    assert "names a device" not in other and "two devices" not in other

def test_dataloader_workers_a_mac_spawns_join_nothing_and_a_top_level_that_trains_is_told(tmp_path):
    """A Mac spawns DataLoader workers, which run the script's top level again: hh.init() there
    starts no second Horovod under the rank's name (each worker reads rank, size, a CPU device and
    is_main False),
    and the guarded script trains. Without `if __name__ == "__main__":` a worker would train too:
    its job.prepare ends the job at once, naming the guard and the line, where the rank waiting
    for its batches was reported frozen after 45 s."""
    out = tmp_path / "guarded"
    out.mkdir()
    run_cmd([VENV_BIN / "invoke", "train", "--script", SCRIPTS / "spawned_workers.py", "--run-dir", tmp_path / "run",
             "--keep-checkpoints", "0", "--", "--out", out], timeout=300)
    said = sorted(p.read_text() for p in out.iterdir())
    assert len(said) == 8, said  # 2 ranks x 2 workers x 2 epochs
    assert set(said) == {"InSpawnedChild 0 2 cpu False False", "InSpawnedChild 1 2 cpu False False"}, said
    assert metrics.records(tmp_path / "run" / "metrics.jsonl")[-1]["event"] == "end"
    (tmp_path / "unguarded").mkdir()
    proc = run_cmd([VENV_BIN / "invoke", "train", "--script", SCRIPTS / "spawned_workers.py", "--run-dir",
                    tmp_path / "run2", "--", "--out", tmp_path / "unguarded", "--no-main-guard"], check=False,
                   timeout=300)
    assert proc.returncode == 1
    said = proc.stderr[proc.stderr.index("error: "):].splitlines()
    assert "failed: RuntimeError: job.prepare ran in a process that multiprocessing started by spawning" in said[0]
    assert 'put the training under `if __name__ == "__main__":`' in said[0], said
    assert any(re.search(r"spawned_workers\.py:\d+ in train: model, optimizer, loader = job\.prepare\(", line)
               for line in said), said
    assert "no response for" not in proc.stdout + proc.stderr

def test_dry_run_shows_the_runner_and_the_scripts_arguments(tmp_path):
    proc = run_cmd([VENV_BIN / "invoke", "train", "--script", SCRIPTS / "user_train.py", "--dry-run", "--",
                    "--lr", "0.5"], timeout=60)
    assert f"--workdir {SCRIPTS} --script user_train.py -- --lr 0.5" in proc.stdout


def test_a_script_that_raises_on_one_rank_ends_in_one_summary(tmp_path):
    """The console: one summary (host, rank, exception, last frames), no walls; every rank's
    whole output, the traceback included, in the run directory's rank-N.log."""
    run_dir = tmp_path / "run"
    proc = run_cmd([VENV_BIN / "invoke", "train", "--script", SCRIPTS / "raises.py", "--run-dir", run_dir],
                   check=False, timeout=120)
    assert proc.returncode == 1
    assert "error: rank 1 on host local failed: ValueError: boom on purpose" in proc.stderr
    assert "raises.py:13 in <module>: load_config(job.rank)" in proc.stderr
    assert 'raises.py:8 in load_config: raise ValueError("boom on purpose")' in proc.stderr
    assert "runpy" not in proc.stderr and "the other ranks were stopped" in proc.stderr
    # rank 0, in a collective as rank 1 went, fails of it: said as a consequence, not a second bug
    assert "then also: rank 0" not in proc.stderr or \
        "then also: rank 0 (HorovodInternalError, left without rank 1)" in proc.stderr, proc.stderr
    said = failure.summary([{"rank": 1, "host": "mac", "frames": [], "error": "ValueError: boom"},
                            {"rank": 0, "host": "pc", "frames": [], "error": "HorovodInternalError: Horovod has been "
                             "shut down. This was caused by an exception on one of the ranks"},
                            {"rank": 2, "host": "pc", "frames": [], "error": "RuntimeError: CUDA out of memory"}])
    assert "then also: rank 0 (HorovodInternalError, left without rank 1), rank 2 (RuntimeError)" in said
    # rank 2 ended its script early; rank 1, then rank 0, were left in a collective without it
    said = failure.summary([{"rank": 1, "host": "mac", "frames": [], "error": "HorovodInternalError: shut down"},
                            {"rank": 0, "host": "pc", "frames": [], "error": "HorovodInternalError: shut down"}],
                           ended={2: (40, "pc")})
    assert said.startswith("rank 2 on host pc ended its script") and \
        "then also: rank 0 (HorovodInternalError, left without rank 2)" in said, said
    assert f"full traceback and output: {run_dir / 'rank-1.log'}" in proc.stderr
    output = proc.stdout + proc.stderr
    assert "Traceback" not in output and "Horovod detected" not in output, output  # no walls
    assert "<stderr>:" not in output, output  # nothing of the ranks' stderr (where tracebacks go)
    failed, waited = (run_dir / "rank-1.log").read_text(), (run_dir / "rank-0.log").read_text()
    assert "rank 1: loading its config\n" in failed and "rank 0: loading its config\n" in waited
    assert failed.count("Traceback (most recent call last):") == 1, failed
    assert 'raise ValueError("boom on purpose")\nValueError: boom on purpose\n' in failed, failed
    assert "@@hvdhetero" not in failed + waited, "heartbeats and tags are not the rank's output"
    assert not (left := left_running(run_dir)), f"no rank is left running: {left}"


def test_a_rank_that_stops_early_on_its_own_loss_is_named_with_the_way_out(tmp_path):
    """tests/scripts/stops_alone.py: rank 1 leaves its loop after epoch 1 on its own loss, its
    script ends, and rank 0's next reduction finds Horovod shut down. The console names rank 1's
    early end (after 8 steps) and job.stop(); rank 0's HorovodInternalError follows it."""
    run_dir = tmp_path / "run"
    proc = run_cmd([VENV_BIN / "invoke", "train", "--script", SCRIPTS / "stops_alone.py", "--run-dir", run_dir],
                   check=False, timeout=300)
    assert proc.returncode == 1
    said = proc.stderr[proc.stderr.index("error: "):].splitlines()
    assert said[0].startswith("error: rank 1 on host local ended its script after 8 steps while rank 0 on host "
                              "local went on: every rank must take the same steps"), proc.stderr
    if said[1].startswith("  rank 0 then gave no response"):  # Horovod's shutdown hung rank 0 whole (once in 15 CI runs)
        assert re.fullmatch(r"  rank 0 then gave no response for 4\d s; the job was stopped", said[1]), said
    else:
        assert said[1] == "  rank 0 then failed: HorovodInternalError: Horovod has been shut down", said
        assert "stops_alone.py" in said[2] and "job.backward(loss)" in said[2], said
    assert "rank 1: loss" in (run_dir / "rank-1.log").read_text()


@pytest.mark.parametrize("sync", ["step", "diloco:4"])
def test_a_backbone_unfrozen_mid_run_trains_as_one_model(tmp_path, sync):
    """tests/scripts/unfreezes.py unfreezes its backbone after the first epoch. Under step sync
    its gradients are reduced from then on: the ranks end with one model and no settle had to
    make them one (its gradients stayed each rank's own: they differed at every epoch's end).
    Under diloco:4 the rounds exchange it from then on (they carried the parameters trainable at
    prepare: the backbones ended apart, each rank's own)."""
    run_dir = tmp_path / "run"
    run_cmd([VENV_BIN / "invoke", "train", "--script", SCRIPTS / "unfreezes.py", "--sync", sync,
             "--run-dir", run_dir], timeout=300)
    records = metrics.records(run_dir / "metrics.jsonl")
    assert len(set(records[-1]["param_digests"])) == 1 and not [r for r in records if r["event"] == "settle"]
    trainable = [r for r in records if r["event"] == "trainable"]
    assert [(r["step"], r["before"], r["now"]) for r in trainable] == [(12, 2, 6)], trainable


@pytest.mark.parametrize("where, flags, said", [
    ("UNFREEZE_IN_LOOP=1", [], "changed inside a step's loop body (requires_grad set or cleared after the batch "
                               "came) under --sync local:4"),
    ("UNFREEZE_MID_EPOCH=1", ["--inner-steps", "by-speed"], "changed in the middle of an epoch under --sync local:4 "
                                                            "--inner-steps by-speed")])
def test_a_backbone_unfrozen_where_the_rounds_cannot_follow_is_refused(tmp_path, where, flags, said):
    """Rounds follow a change between steps; inside the loop body (after the batch came) they
    cannot, nor mid-epoch with --inner-steps by-speed, where a merging rank reaches it at another
    step (the ranks flushed at different steps and broke the next round)."""
    proc = run_cmd([VENV_BIN / "invoke", "train", "--script", SCRIPTS / "unfreezes.py", "--sync", "local:4", *flags,
                    "--env", where, "--run-dir", tmp_path / "run"], check=False, timeout=300)
    assert proc.returncode == 1 and "ConfigError: the model's trainable parameters " + said in proc.stderr, \
        proc.stderr[-2000:]


def test_a_script_written_for_one_gpu_runs_as_written_and_its_mistakes_are_said(tmp_path):
    """tests/scripts/wild.py: a BatchNorm CNN whose epoch ends in a 2-sample step (1 + 1 would
    make its BatchNorm1d refuse), a tqdm bar (one console line an epoch, not one a redraw), rank 0
    alone saving inside the loop (the DDP habit: no collective under step sync, no hang), and
    variables for the ranks given with --env (NAME=VALUE, or NAME for this shell's value;
    nothing else of this shell's environment reaches them), the optimizer it made stepped rather
    than job.prepare's; then two mistakes (below)."""
    import json
    import os

    run_dir, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WILD_SECRET": "not for the ranks"}
    proc = subprocess.run([VENV_BIN / "invoke", "train", "--script", SCRIPTS / "wild.py", "--run-dir", run_dir,
                           "--micro-batch", "40", "--equal-split", "--env", "WILD_TAG=from-the-flag,OMP_NUM_THREADS,WILD_LIST=0,1",
                           "--", "--out", out,
                           "--epochs", "3", "--break-at", "2", "--own-optimizer"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    bars = [line for line in proc.stdout.splitlines() if "it/s]" in line or "s/it]" in line]
    # one line a bar, as it ended: 6 steps of 3 chunks (at most 40: 39 + 39 + 38 or 39) each (tqdm's total is
    # len(loader), the steps, which the chunks pass: docs/api.md says so)
    assert [b.split(":")[0] for b in bars] == ["epoch 0", "epoch 1"] and "18it" in bars[-1], proc.stdout
    # said once, with what it means for the script's own counts and its BatchNorm (a MetricLogger printed [30/24])
    assert proc.stdout.count("hvdhetero: micro-batches: the loop body runs once a chunk (3 chunks of at most 40 "
                             "samples in this rank's first such step), so a count of the script's own") == 1, proc.stdout
    assert "; BatchNorm normalises over each chunk (--micro-batch 0" in proc.stdout
    assert sorted(p.name for p in run_dir.glob("epoch*.pt")) == ["epoch0-step2.pt", "epoch1-step2.pt"]
    assert "hvdhetero: the script left job.epochs' loop in epoch 2 (3/3 on the live line) (break or return)" in proc.stdout, proc.stdout
    assert set(torch.load(run_dir / "epoch1-step2.pt", weights_only=True)) >= {"1.running_mean", "1.running_var"}
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank in ranks:
        assert rank["env"] == {"WILD_TAG": "from-the-flag", "OMP_NUM_THREADS": "1", "WILD_LIST": "0,1",
                               "WILD_SECRET": None}, rank
        assert set(rank["sizes"]) <= {38, 39}, rank["sizes"]  # 116 or 117 in chunks of at most 40, evenly
        # job.clip_grad_norm_ between a step's chunks: the last step's norm, not None
        norms = rank["norms"]  # 0 before the first step's reduction (its first 2 chunks), then norms
        assert len(norms) == len(rank["sizes"]) and norms[:2] == [0, 0] and all(n > 0 for n in norms[2:]), norms
    assert sum(sum(r["sizes"]) for r in ranks) == 2 * 6 * 233, "two epochs of 6 whole steps; the last 2 left out"
    # loader.batch_size as the script gave it (the global batch): len(loader) * batch_size as on one device
    assert [(r["seen"], r["of"]) for r in ranks] == [(6 * 233, 1400)] * 2, ranks  # the 2 left: no whole step
    # The optimizer the script made, stepped on every chunk, updated once a step, on the reduced
    # gradients: 12 steps counted, one model (it updated between chunks, counted none, drifted)
    assert [r["steps"] for r in ranks] == [12, 12] and ranks[0]["final"] == ranks[1]["final"], ranks
    assert [r["ends"] for r in ranks] == [12, 12], "job.sync_gradients: once a step, of 3 chunks each"
    # torch's AveragedModel updated in the loop body: an EMA of the 12 steps, not of 36 chunks (it
    # decayed 3 times a step), and one EMA on both ranks
    assert [r["ema_updates"] for r in ranks] == [12, 12] and ranks[0]["ema"] == ranks[1]["ema"], ranks
    # and its BatchNorm statistics one on both ranks: the model's averaged ones (an EMA that copies them copied
    # each rank's own at its last update), or averaged (use_buffers=True: each rank averaged its own); SWA's
    # update_bn over the prepared loader (each rank its share) gives both ranks the statistics of every sample
    assert ranks[0]["ema_buffers"] == ranks[1]["ema_buffers"] == ranks[0]["buffers"] == ranks[1]["buffers"], ranks
    assert ranks[0]["averaged_buffers"] == ranks[1]["averaged_buffers"] != ranks[0]["buffers"], ranks
    assert ranks[0]["swa_buffers"] == ranks[1]["swa_buffers"] != ranks[0]["buffers"], ranks
    # a per-batch LR scheduler the script steps in the loop body, not passed to job.prepare: once a
    # step too (36 times before: a OneCycleLR sized for the run's steps raised "Tried to step ...
    # times"), and the console says once that the checkpoints do not hold it
    assert [r["warmup_steps"] for r in ranks] == [12, 12], ranks
    assert proc.stdout.count("hvdhetero: the LambdaLR on the job's optimizer is in no checkpoint: pass it as "
                             "job.prepare(..., scheduler=)") == 1, proc.stdout
    # its two EMAs, made after job.prepare and not job.track'ed, said once at the first checkpoint (a
    # resume would make them again from the model: their averages started over, without a word before)
    assert proc.stdout.count("hvdhetero: 2 AveragedModels of the model (an EMA or SWA, 6 and 6 updates averaged) "
                             "are in no checkpoint: make each before job.prepare and job.track('ema', ema)") == 1, \
        proc.stdout
    bad = subprocess.run([VENV_BIN / "invoke", "train", "--script", SCRIPTS / "wild.py", "--run-dir", tmp_path / "x",
                          "--env", "WILD_UNSET_HERE", "--", "--out", out], capture_output=True, text=True,
                         timeout=120, env={k: v for k, v in env.items() if k != "WILD_UNSET_HERE"})
    assert bad.returncode == 2 and "--env WILD_UNSET_HERE: not set in this shell" in bad.stderr, bad.stderr
    assert not (tmp_path / "x").exists()
    first = [json.loads((out / f"init{r}.json").read_text()) for r in (0, 1)]
    assert first[0] == first[1], "every rank starts from rank 0's weights"

    # A mistake: job.evaluate is a collective, and rank 0 evaluating alone waits for a rank 1
    # that never comes (it waits in its next step's gradients; Horovod's stall shutdown never
    # came). Both give up after HVDHETERO_COLLECTIVE_TIMEOUT_S (6 s here through --env; 10 min
    # by default), the first to say so naming its collective and what it means for the script,
    # and the job ends. The script seeds torch itself before hh.init() (2 here, 1 above): its
    # seed stands.
    proc = run_cmd([VENV_BIN / "invoke", "train", "--script", SCRIPTS / "wild.py", "--run-dir", tmp_path / "stalled",
                    "--env", "HVDHETERO_COLLECTIVE_TIMEOUT_S=6", "--", "--out", out, "--evaluate-on-rank-0-only",
                    "--seed", "2"], check=False, timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:]
    said = re.findall(r"StalledCollective: rank (\d) waited 6 s for the other ranks to join its collective \(([^)]*\)?)\)",
                      proc.stderr)
    assert said and set(said) <= {("0", "job.evaluate()"), ("1", "its gradients' reduction")}, proc.stderr
    assert "not under `if job.is_main:`" in proc.stderr
    second = json.loads((out / "init0.json").read_text())
    assert second != first[0], "the script's own torch.manual_seed counts (hh.init() reseeded with --seed before)"


def failed_once_then_resumed(tmp_path, script: str, every: int, failure: str, *args: str,
                             said: list | None = None) -> list[dict]:
    """`script` run with --checkpoint-every `every` (and `args` after --) fails once on rank 1
    (saying `failure`), then is resumed with --resume: the lines rank 0 wrote to OUT/rank0.jsonl;
    the resumed run's console output goes into `said`."""
    import json

    run_dir, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    first = run_cmd([VENV_BIN / "invoke", "train", "--script", SCRIPTS / script, "--run-dir", run_dir,
                     "--checkpoint-every", str(every), "--", "--out", out, *args], check=False, timeout=300)
    assert first.returncode == 1 and failure in first.stderr, first.stderr[-2000:]
    resumed = run_cmd([VENV_BIN / "invoke", "train", "--resume", run_dir], timeout=300)
    if said is not None:
        said.append(resumed.stdout + resumed.stderr)
    return [json.loads(line) for line in (out / "rank0.jsonl").read_text().splitlines()]


def test_a_resumed_script_that_accumulates_gradients_goes_on_from_the_checkpoints_batch(tmp_path):
    """Two batches per optimizer step, a checkpoint every 2 optimizer steps: the last one before
    rank 1 fails at epoch 2's batch 9 is taken as batch 8 begins (optimizer step 11). The
    resumed epoch runs batches 8-13, not all 14 again (a resume went to optimizer step 11's
    batch, 11, of the epoch before: the whole epoch redone, the schedule ahead). Its epochs count
    from 1, and the resume says epoch 2, as the live line counts (it said 3)."""
    said = []
    lines = failed_once_then_resumed(tmp_path, "accumulate.py", 2, "rank 1 fails once, in epoch 2", said=said)
    assert lines == [{"epoch": 1, "batches": 14, "step": 7}, {"epoch": 2, "batches": 6, "step": 14}], lines
    assert f"resuming from {tmp_path / 'run/checkpoints/step-000000011.pt'} (epoch 2, step 11)" in said[0], said[0]


def test_a_loop_of_its_own_resumed_from_a_checkpoint_taken_at_a_passs_first_step_goes_on(tmp_path):
    """tests/scripts/own_loop_resume.py: a max_steps loop (no job.epochs), a checkpoint every pass's
    4 steps, taken as pass 1's first step comes; rank 1 fails at step 5. Resumed, it trains steps
    4-11 (8 batches) in passes 1 and 2. The checkpoint held pass 0's epoch with the loader at pass 1,
    and the resumed run dealt pass 0's epoch past its end: nothing, for good."""
    said = []
    lines = failed_once_then_resumed(tmp_path, "own_loop_resume.py", 4, "rank 1 fails once, at step 5", said=said)
    assert lines == [{"step": 12, "epoch": 2, "batches": 8}], lines
    assert f"resuming from {tmp_path / 'run/checkpoints/step-000000004.pt'} (step 4)" in said[0], said[0][-2000:]
    assert "read neither job.step" not in said[0], "it counts by job.step: nothing to say"
    # the checkpoint resumed from keeps its record (written after the state it holds, cut with the rest)
    kept = metrics.records(tmp_path / "run" / "metrics.jsonl", "checkpoint")
    assert [r["step"] for r in kept] == [4, 8], kept  # (none as the run ends: the next step never begins)


def test_a_loop_fetching_a_batch_ahead_resumes_at_the_batch_it_had_in_hand(tmp_path):
    """apex's data_prefetcher fetches the next batch before the forward of the one in hand, so a
    checkpoint due after step 5 is taken as batch 7 is handed out, with batch 6 not trained yet.
    Resumed from it (rank 1 fails at step 7), the run trains batch 6 and on, each batch once,
    batch 6 the same samples as before the failure (it went on from batch 7: batch 6 never
    trained, and the loop ran a pass more to reach step 12)."""
    said = []
    lines = failed_once_then_resumed(tmp_path, "own_loop_resume.py", 2, "rank 1 fails once, at step 7", "--one-ahead",
                                     said=said)
    assert f"resuming from {tmp_path / 'run/checkpoints/step-000000006.pt'} (step 6)" in said[0], said[0][-2000:]
    assert lines == [{"step": 12, "epoch": 2, "batches": 6}], lines
    first, again = before_and_after(tmp_path / "out", 6, 12, 7)
    assert again[6] == pytest.approx(first[6], abs=1e-5), (first, again)  # the batch in hand at the checkpoint


def before_and_after(out, resumed_at: int, end: int, failed_at: int) -> tuple[dict, dict]:
    """own_loop_resume.py's OUT/batchesR.jsonl of a run that failed at step `failed_at` and was
    resumed at `resumed_at`: {step: its inputs' sum over both ranks (whatever the split)} of the
    first run and of the resumed one, once each rank is seen to train steps `resumed_at` to `end`
    after the resume and every step before the failure once."""
    first, again = {}, {}
    for rank in (0, 1):
        trained = [json.loads(line) for line in (out / f"batches{rank}.jsonl").read_text().splitlines()]
        steps = [b["step"] for b in trained]
        resumed = steps.index(resumed_at, steps.index(resumed_at) + 1)  # the resumed run's first batch
        assert steps[resumed:] == list(range(resumed_at, end)), steps
        # rank 1 failed before its line of step `failed_at`; rank 0 wrote it unless it was stopped first
        assert steps[:resumed] in (list(range(failed_at)), list(range(failed_at + 1))) if rank == 0 else \
            steps[:resumed] == list(range(failed_at)), (rank, steps)
        for run, part in ((first, trained[:resumed]), (again, trained[resumed:])):
            for b in part:
                run[b["step"]] = run.get(b["step"], 0.0) + b["sum"]
    return first, again


@pytest.mark.parametrize("look", ["--look", "--keep-look"])
def test_a_checkpoint_due_as_rank_0_looks_at_a_batch_goes_on_from_the_loops_batch(tmp_path, look):
    """Rank 0 alone takes `next(iter(loader))` after each optimizer step (a sample to log), so a
    checkpoint due after step 3 comes as its look begins, where the other rank's loop takes batch
    3. Resumed from it (rank 1 fails at step 5), the run trains batch 3 and on, batch 3 and 4 the
    samples they were before the failure: the checkpoint held the look's position (the next
    pass's first batch), and the resumed run skipped batch 3 and dealt every batch after it a
    step early. With --keep-look rank 0 looks before each loss instead, its look's iterator kept
    until the next: each loss was taken for the look's batch (the next pass's), rank 0's epoch moved
    on at every step, and the checkpoint held that (the resumed run trained to step 15, epoch 13)."""
    said = []
    lines = failed_once_then_resumed(tmp_path, "own_loop_resume.py", 3, "rank 1 fails once, at step 5", look,
                                     said=said)
    assert f"resuming from {tmp_path / 'run/checkpoints/step-000000003.pt'} (step 3)" in said[0], said[0][-2000:]
    assert lines == [{"step": 12, "epoch": 2, "batches": 9}], lines
    first, again = before_and_after(tmp_path / "out", 3, 12, 5)
    assert (again[3], again[4]) == pytest.approx((first[3], first[4]), abs=1e-5), (first, again)


def test_a_loader_restarted_within_each_epoch_resumes_in_the_pass_it_was_in(tmp_path):
    """FixMatch's labelled loader, restarted with iter() within each of job.epochs' epochs (6-step
    passes, 15 steps an epoch), each pass in an order of its own. The checkpoint is taken as step
    10 comes, in the epoch's second pass; rank 1 fails at step 14, in the third. Resumed, steps
    10-13 take the same samples as before the failure: the second pass's order from its fifth
    batch, then the third pass's from its first (a resume dealt the first pass's order, and every
    pass after it in the epoch skipped its first four batches)."""
    said = []
    lines = failed_once_then_resumed(tmp_path, "cycled_resume.py", 10, "rank 1 fails once, at step 14", said=said)
    assert f"resuming from {tmp_path / 'run/checkpoints/step-000000010.pt'} (epoch 1, step 10)" in said[0], \
        said[0][-2000:]
    assert lines == [{"step": 45, "epoch": 2}], lines
    runs: dict[int, dict[int, list[int]]] = {1: {}, 2: {}}  # run: step: the step's samples, both ranks'
    for rank in (0, 1):
        for line in (tmp_path / "out" / f"steps{rank}.jsonl").read_text().splitlines():
            took = json.loads(line)
            runs[took["run"]].setdefault(took["step"], []).extend(took["index"])
    assert sorted(runs[2]) == list(range(10, 45)), sorted(runs[2])
    assert all(len(index) == 32 for index in runs[2].values()), runs[2]
    for step in range(10, 14):
        assert sorted(runs[2][step]) == sorted(runs[1][step]), (step, runs[1], runs[2])
    passes = [frozenset(i for s in range(k, k + 6) for i in runs[1][s]) for k in (0, 6)]
    assert passes[0] == passes[1] == frozenset(range(192)), "each pass takes every sample once"
    assert [sorted(runs[1][s]) for s in range(6)] != [sorted(runs[1][s]) for s in range(6, 12)], "orders of their own"


def test_a_loop_fetching_a_batch_ahead_is_refused_micro_batches_at_its_first_step(tmp_path):
    """With --micro-batch 4 (8-sample shares in two chunks), the prefetcher's job.backward would be
    taken for the chunk handed out after it, each step reduced a chunk early (it trained 14
    batches in 16 steps, some twice): refused at the first job.backward, before it runs, saying
    what to drop."""
    out = tmp_path / "out"
    out.mkdir()
    proc = run_cmd([VENV_BIN / "invoke", "train", "--script", SCRIPTS / "own_loop_resume.py", "--run-dir",
                    tmp_path / "run", "--micro-batch", "4", "--equal-split", "--", "--out", out, "--one-ahead"],
                   check=False, timeout=300)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "--micro-batch 4 with a loop that fetches one batch ahead" in proc.stderr, proc.stderr[-2000:]
    assert "Drop the prefetcher" in proc.stderr, proc.stderr[-2000:]
    trained = [json.loads(line)["step"] for line in (out / "batches0.jsonl").read_text().splitlines()]
    assert trained == [0], trained  # written before its job.backward, which refused it


def test_a_pass_with_no_backward_is_no_loop_fetching_ahead(tmp_path):
    """Rank 0 alone counts its share in a pass of its own before the loop (no job.backward), in
    --micro-batch 4's chunks: its second step comes with no backward before it, which a loop
    fetching ahead also shows; nothing is refused, and the loop trains its 12 steps."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "failed-once").touch()  # (rank 1 failed before: it goes on)
    proc = run_cmd([VENV_BIN / "invoke", "train", "--script", SCRIPTS / "own_loop_resume.py", "--run-dir",
                    tmp_path / "run", "--micro-batch", "4", "--equal-split", "--", "--out", out, "--count-first"],
                   timeout=300)
    assert "COUNTED 32" in proc.stdout, proc.stdout[-2000:]  # its share, 8 a step in 4 steps
    assert json.loads((out / "rank0.jsonl").read_text())["step"] == 12


LOOKS = {"rank 0": [], "everyone": ["--everyone"], "rank 0, diloco overlapped": [],
         "rank 0, one batch ahead": ["--one-ahead"], "rank 0 inside the pass": ["--look-inside"],
         "rank 0 inside, one batch ahead": ["--look-inside", "--one-ahead"],
         "rank 0, one batch ahead, two models": ["--one-ahead", "--two-models"],
         "rank 0 between two models' steps": ["--two-models", "--look-between"],
         "rank 0 inside the pass, persistent workers": ["--look-inside", "--persistent-workers"]}


@pytest.mark.parametrize("who", LOOKS)
def test_a_plain_epoch_loop_after_a_look_left_open_writes_each_epochs_record(tmp_path, who):
    """tests/scripts/open_look.py: the CIFAR-10 tutorial's `dataiter` left open on the prepared
    loader (by rank 0 alone, or by every rank) before `for epoch in range(3)`. Each pass's end
    writes the epoch's record, a collective, on every rank alike (rank 0's passes, inside its open
    one, must not skip it where rank 1's take it: the job would stall there), its loss the epoch's,
    every rank's half of its samples in it, and one BatchNorm on every rank after the loop; under
    --sync diloco too (its replicas differ mid-round; its round of 5 steps ends mid-pass, its
    exchange in flight at the record). Rank 0's look inside each pass, before its batch 8's loss,
    counts nothing (rank 0's record had left out its first 9 steps, and named the epochs 1, 2, 3);
    a loop fetching one batch ahead ends each pass with its last batch in hand, which its record
    counts (it had 15 steps and 960 samples, the buffers averaged before that batch's forward),
    also where rank 0's look kept open makes its passes ones inside it, found fetching ahead on
    rank 1 alone (a wait decided by that had rank 0 write its record a step before rank 1), and
    with two models each stepped by its optimizer (a GAN's: two job.backward calls a batch had
    the pass end before its last batch trained, and that batch's step taken for the second
    optimizer's of the step before: 15 steps an epoch), and rank 0's look taken between the two
    models' steps (its batch had begun a step of its own on rank 0 alone, the second optimizer's
    step counted as one more: 17 steps and 1056 samples an epoch), and with persistent DataLoader
    workers (rank 0's look reset the loop's iterator onto the look's batches: IndexError)."""
    out = tmp_path / "out"
    out.mkdir()
    sync = ["--sync", "diloco:5", "--overlap-sync"] if "diloco" in who else []
    run_cmd([VENV_BIN / "invoke", "train", "--script", SCRIPTS / "open_look.py", "--run-dir", tmp_path / "run",
             "--equal-split", *sync, "--", "--out", out, *LOOKS[who]], timeout=300)
    records = metrics.records(tmp_path / "run" / "metrics.jsonl")
    epochs = [r for r in records if r["event"] == "epoch"]
    assert [(r["epoch"], r["step"], r["samples"], r["rank_samples"]) for r in epochs] == [
        (0, 16, 1024, [512, 512]), (1, 32, 1024, [512, 512]), (2, 48, 1024, [512, 512])], epochs
    rank_0 = json.loads((out / "losses.json").read_text())  # its share's mean: near the epoch's (both ranks')
    assert [r["loss"] for r in epochs] == pytest.approx(rank_0, rel=0.2) and rank_0 == sorted(rank_0, reverse=True)
    if not sync:  # (diloco's replicas are made one where the script asks: job.evaluate, job.save)
        buffers = [json.loads((out / f"buffers{rank}.json").read_text()) for rank in (0, 1)]
        assert buffers[0] == buffers[1], buffers


def test_a_loop_of_its_own_that_counts_its_passes_itself_is_told_when_resumed(tmp_path):
    """The same loop counting three passes itself: resumed at step 4, it runs three whole passes
    again (16 steps, not 12). The job cannot know what the loop counts, so rank 0 says, once its
    first iteration after the resume read neither job.step nor job.epoch, what goes on instead."""
    said = []
    lines = failed_once_then_resumed(tmp_path, "own_loop_resume.py", 4, "rank 1 fails once, at step 5", "--counted",
                                     said=said)
    assert lines == [{"step": 16, "epoch": 3, "batches": 12}], lines
    assert said[0].count("hvdhetero: the job went on from step 4 (a --resume, or --elastic's restart of the script), "
                         "and the script's own loop (no job.epochs) read neither job.step nor job.epoch") == 1, \
        said[0][-3000:]
    assert "4 steps more than asked" in said[0] and "`while job.step < max_steps:`" in said[0]


def test_a_rank_left_silent_after_another_ended_its_script_is_told_as_that_early_end(tmp_path):
    """Rank 1 ends its script after 8 steps; rank 0, left in a collective without it, stops
    answering (Horovod's shutdown hung a rank whole, its heartbeat too, once in CI): the console
    names rank 1's early end and what to do, then rank 0's silence, not a frozen rank 0 alone.
    A stand-in for horovodrun prints the ranks' lines, then nothing."""
    import sys

    from hvdhetero import progress
    from hvdhetero.cluster import supervise
    from hvdhetero.errors import LaunchError

    lines = [f"[0]<stderr>:{progress.ALIVE_TAG}" + '{"rank": 0, "host": "pc", "pid": 1}',
             f"[1]<stderr>:{progress.ALIVE_TAG}" + '{"rank": 1, "host": "mac", "pid": 2}',
             f"[1]<stdout>:{progress.done_line(8)}"]
    stand_in = f"import time\nprint({chr(10).join(lines)!r}, flush=True)\ntime.sleep(30)\n"
    with pytest.raises(LaunchError) as said:
        supervise._run([sys.executable, "-c", stand_in], {}, tmp_path, None, "pc", None, 2.0, None, ["pc", "mac"])
    text = str(said.value)
    assert text.startswith("rank 1 on host mac ended its script after 8 steps while rank 0 on host pc went on: every "
                           "rank must take the same steps"), text
    assert "\n  rank 0 then gave no response for 2 s; the job was stopped" in text, text


def test_a_launcher_that_refuses_the_job_is_not_told_as_a_failed_training(tmp_path):
    """The Ray driver with no node on the first host says why and exits 2 before any rank starts:
    the console added "training failed: the job's launcher exited with 2" and "no checkpoint was
    written yet; start the run again". A stand-in for the driver says its line and exits 2."""
    import sys

    from hvdhetero.cluster import supervise
    from hvdhetero.errors import LaunchError

    stand_in = "import sys\nprint('hvdhetero ray: no Ray node of hvdhetero\\'s is running on local', flush=True)\n" \
               "sys.exit(2)\n"
    with pytest.raises(LaunchError) as said:
        supervise._run([sys.executable, "-c", stand_in], {}, tmp_path, tmp_path, None, None, 30.0, None, ["local"])
    assert str(said.value) == "the job did not start: its launcher refused it, saying why above"


def test_open_mpis_help_blocks_about_a_rank_that_died_stay_off_the_console(tmp_path, capsys):
    """backend mpi, a rank killed: mpirun printed 21 lines of its own ("Primary job terminated
    normally, but 1 process returned...", "An MPI communication peer process has unexpectedly
    disconnected", a PMIX ERROR) before the one message that names the rank, which horovodrun's
    jobs get alone. A stand-in for mpirun prints the ranks' lines, then its own, and exits 1."""
    import sys

    from hvdhetero import progress
    from hvdhetero.cluster import supervise
    from hvdhetero.errors import LaunchError

    rule = "-" * 74
    lines = [f"[1,0]<stderr>:{progress.ALIVE_TAG}" + '{"rank": 0, "host": "local", "pid": 1}',
             f"[1,1]<stderr>:{progress.ALIVE_TAG}" + '{"rank": 1, "host": "local", "pid": 2}',
             "[1,0]<stdout>:epoch 1 done", rule, "Primary job  terminated normally, but 1 process returned",
             "a non-zero exit code. Per user-direction, the job has been aborted.", rule, rule,
             "An MPI communication peer process has unexpectedly disconnected.  This", "", "  Local host: vm", rule,
             "[vm:13891] PMIX ERROR: UNREACHABLE in file pmix_server.c at line 2198", rule,
             "mpirun noticed that process rank 1 with PID 2 on node vm exited on signal 9 (Killed).", rule]
    stand_in = f"import sys\nprint({chr(10).join(lines)!r}, flush=True)\nsys.exit(1)\n"
    with pytest.raises(LaunchError) as said:
        supervise._run([sys.executable, "-c", stand_in], {}, tmp_path, tmp_path, None, None, 30.0, None,
                       ["local", "local"])
    assert str(said.value).startswith("rank 1 on host local killed by signal 9 (SIGKILL)"), said.value
    shown = capsys.readouterr()
    assert "epoch 1 done" in shown.out and not any(word in shown.out + shown.err for word in (
        "Primary job", "peer process", "PMIX", "Local host", "mpirun noticed", "-----")), shown


def test_a_torch_load_of_a_name_job_save_wrote_elsewhere_is_refused_naming_both_files(tmp_path):
    """tests/scripts/save_load.py: the quickstart ported with job.save(state, "model.pth") and its
    torch.load("model.pth") kept. job.save wrote into the run directory, so the load read the
    working folder's model.pth: an older run's, evaluated without a word, or none. Each such load
    is refused naming both files and the way out; one the script's own torch.save wrote since loads."""
    import shutil
    import time

    folder, out, run = tmp_path / "project", tmp_path / "out", tmp_path / "run"
    folder.mkdir()
    out.mkdir()
    shutil.copy(SCRIPTS / "save_load.py", folder)
    torch.save({"old": torch.zeros(1)}, folder / "best.pth")
    os.utime(folder / "best.pth", (time.time() - 3600, time.time() - 3600))  # an earlier run's
    run_cmd([VENV_BIN / "invoke", "train", "--script", folder / "save_load.py", "--run-dir", run, "--", out],
            timeout=300)
    for r in (0, 1):
        said = json.loads((out / f"rank-{r}.json").read_text())
        assert said["best.pth"].startswith(f"torch.load('best.pth') reads {folder / 'best.pth'}, which is an older "
                                           "file, of "), said
        assert (f"job.save(..., 'best.pth') wrote its file to the run directory, {run / 'best.pth'} (on rank 0's "
                "host). Load that path (os.path.join(job.run_dir, 'best.pth'), on rank 0), or keep torch.save(..., "
                "'best.pth') in place of job.save") in said["best.pth"], said
        assert said["fresh.pth"] == ["bias", "weight"], said
        assert said["none.pth"].startswith(f"torch.load('none.pth') reads {folder / 'none.pth'}, which is no file"), said
    assert (run / "best.pth").is_file() and not (folder / "none.pth").exists()
    # a later run loading it by that name (a script's own --resume of its checkpoint) is told where it is
    proc = run_cmd([VENV_BIN / "invoke", "train", "--script", folder / "save_load.py", "--run-dir", tmp_path / "later",
                    "--", out, "--load", "none.pth"], check=False, timeout=300)
    assert proc.returncode == 1, proc.stdout[-2000:]
    assert (f"FileNotFoundError: [Errno 2] No such file or directory: 'none.pth' (job.save writes into the run "
            f"directory: {run / 'none.pth'} is the newest none.pth under {tmp_path}, an earlier run's; pass its "
            "path)") in proc.stdout + proc.stderr, proc.stdout[-2000:]


def test_the_hint_for_an_earlier_runs_file_names_that_file_and_only_it(tmp_path):
    from hvdhetero.rank import saving

    (tmp_path / "runs" / "a" / "out").mkdir(parents=True)
    (tmp_path / "runs" / "a" / "out" / "model1.pt").write_bytes(b"")
    (tmp_path / "runs" / "a" / "model[1].pt").write_bytes(b"")
    new = tmp_path / "runs" / "new"
    err = FileNotFoundError(2, "No such file or directory", "out/model1.pt")
    assert saving.in_an_earlier_run(err, str(new)).startswith(f" (job.save writes into the run directory: "
                                                              f"{tmp_path / 'runs/a/out/model1.pt'} is the newest")
    glob_like = FileNotFoundError(2, "No such file or directory", "out/model[1].pt")  # no glob: model1.pt is not it
    assert saving.in_an_earlier_run(glob_like, str(new)) == ""
    assert saving.in_an_earlier_run(FileNotFoundError(2, "x", "/abs/model1.pt"), str(new)) == ""
    assert saving.in_an_earlier_run(ValueError("out/model1.pt"), str(new)) == ""


def test_ranks_on_one_host_saving_and_loading_one_path_never_read_it_half_written(tmp_path):
    """tests/scripts/save_race.py: the quickstart's save-then-load, on both local ranks at once, 100
    times. torch's save truncated and rewrote the file another rank was loading: 2 loads in 30
    failed before saves to a path were made atomic (rank/saving.py). The file keeps the mode
    torch's own save gives it, and no temporary file is left."""
    out = tmp_path / "out"
    out.mkdir()
    run_cmd([VENV_BIN / "invoke", "train", "--script", SCRIPTS / "save_race.py", "--run-dir", tmp_path / "run", "--",
             out], timeout=300)
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in (0, 1)]
    umask = os.umask(0)
    os.umask(umask)
    for rank in ranks:
        assert rank["failed"] == [] and rank["mode"] == oct(0o666 & ~umask), rank
    assert sorted(p.name for p in out.iterdir()) == ["model.pth", "rank-0.json", "rank-1.json"], ranks


@pytest.mark.slow
def test_a_loop_that_updates_by_hand_is_told_its_optimizer_never_stepped(tmp_path):
    """tests/scripts/by_hand.py: makemore's `p.data += -lr * p.grad`. It trains (job.backward
    reduces), but the job counts steps by the prepared optimizer's step(): job.step, the metrics
    and checkpoints stood at 0 without a word. Rank 0 says so once, after 50 such steps where the
    parameters moved (a script accumulating over more batches than that moves none)."""
    said = "steps' gradients were reduced (job.backward) and the optimizer given to job.prepare never stepped"
    for accumulate, times in ((0, 1), (60, 0)):  # accumulating over 60 batches moves no parameter: no word
        proc = run_cmd([VENV_BIN / "invoke", "train", "--script", SCRIPTS / "by_hand.py", "--run-dir",
                        tmp_path / str(accumulate), "--", "--steps", "120", "--accumulate", accumulate], timeout=300)
        assert proc.stdout.count(said) == times and "final loss" in proc.stdout, proc.stdout[-3000:]
