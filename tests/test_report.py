"""invoke report: figures and a self-contained report.html from run directories.

The readers and series are checked on hand-written metrics files (every number known); the
figures and the command on two real 2-rank runs of the built-in recipe, step sync and local:4,
trained once for the module."""

from __future__ import annotations

import base64
import html
import json
import os
import re
import shutil
import time

import pytest

from conftest import ROOT, VENV_BIN, run_cmd
from hvdhetero.bench import figures, report, runs, series
from hvdhetero.errors import ConfigError
from test_sweep import trials

FIGURES = ["loss.png", "accuracy.png", "samples_per_s.png", "split.png", "step_time.png"]


# -- hand-written runs ------------------------------------------------------------------------------

def _start(t=100.0, sync="step", **extra):
    return {"event": "start", "time": t, "config": {"sync": sync, "overlap_sync": False}, "ranks": 2,
            "hostnames": ["m1", "p1"], "devices": ["mps", "cuda"], **extra}


def _epoch(t, epoch, step, split, rank_samples, compute, comm, loss=1.0, seconds=2.0):
    return {"event": "epoch", "time": t, "epoch": epoch, "loss": loss, "samples": sum(rank_samples),
            "seconds": seconds, "samples_per_s": sum(rank_samples) / seconds, "split": split, "step": step,
            "rank_samples": rank_samples, "compute_s": compute, "comm_s": comm}


TWO_EPOCHS = [
    _start(host_names=["mac", "pc"]),
    {"event": "split", "time": 100.0, "epoch": 0, "step": 0, "split": [16, 48]},
    _epoch(102.0, 0, 10, [16, 48], [160, 480], [1.0, 0.5], [0.2, 0.7], loss=2.0),
    {"event": "split", "time": 103.0, "step": 15, "split": [20, 44]},
    {"event": "log", "time": 103.0, "epoch": 1, "step": 15, "test_accuracy": 0.5},
    _epoch(104.0, 1, 20, [20, 44], [180, 460], [1.2, 0.4], [0.1, 0.8], loss=1.0),
    {"event": "log", "time": 104.1, "epoch": 1, "step": 20, "test_accuracy": 0.8, "test_loss": 0.5},
    {"event": "end", "time": 104.2, "seconds": 5.0},
]


def write_run(folder, records, launch=None, tail=""):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    if launch is not None:
        (folder / "launch.json").write_text(json.dumps(launch))
    return folder


def old_format(records):
    """The same run as metrics written before epochs carried steps, per-rank samples and times."""
    drop = ("step", "rank_samples", "compute_s", "comm_s", "host_names")
    return [{k: v for k, v in r.items() if not (k in drop and r["event"] in ("epoch", "start"))} for r in records]


def test_samples_per_s_of_each_rank_add_up_to_the_job(tmp_path):
    run = runs.read_run(write_run(tmp_path / "a", TWO_EPOCHS))
    total, per_rank = series.throughput(run)
    assert total.values == [320.0, 320.0] and total.seconds == [2.0, 4.0] and total.epochs == [1.0, 2.0]
    assert [s.label for s in per_rank] == ["rank 0: mac, mps", "rank 1: pc, cuda"]
    assert [s.values for s in per_rank] == [[80.0, 90.0], [240.0, 230.0]]
    # metrics of older runs: each rank's samples from the epoch's split
    old = runs.read_run(write_run(tmp_path / "old", old_format(TWO_EPOCHS)))
    assert [s.values for s in series.throughput(old)[1]] == [[80.0, 100.0], [240.0, 220.0]]
    assert old.ranks == ["rank 0: m1, mps", "rank 1: p1, cuda"]  # socket host names before host_names


def test_step_time_splits_compute_communication_and_the_rest_per_rank(tmp_path):
    run = runs.read_run(write_run(tmp_path / "a", TWO_EPOCHS))
    # 20 steps in 4.0 s of epochs; mac: 2.2 s compute, 0.3 s communication, the rest 1.5 s
    (mac, *mac_ms), (pc, *pc_ms) = series.step_times(run)
    assert mac == "rank 0: mac, mps" and mac_ms == pytest.approx([110.0, 15.0, 75.0])
    assert pc_ms == pytest.approx([45.0, 75.0, 80.0])
    assert series.step_times(runs.read_run(write_run(tmp_path / "old", old_format(TWO_EPOCHS)))) is None


def test_a_run_resumed_on_more_hosts_shows_every_rank_each_where_it_ran(tmp_path):
    """Stopped after epoch 0 on mac and pc, resumed on three hosts (rank 1 now on box): the third
    rank is in the headline and every figure from its start on, with a gap before (a helper's
    report of such a run named two ranks beside a split of three)."""
    three = {**_start(t=200.0, resumed_from="runs/x/checkpoints/step-000000010.pt"), "ranks": 3,
             "host_names": ["mac", "box", "pc"], "devices": ["mps", "cpu", "cuda"]}
    records = [*TWO_EPOCHS[:3], three, {"event": "split", "time": 200.0, "step": 10, "split": [16, 8, 40]},
               _epoch(202.0, 1, 20, [16, 8, 40], [160, 80, 400], [1.0, 0.8, 0.5], [0.2, 0.3, 0.6]),
               {"event": "end", "time": 202.5, "seconds": 2.5}]
    run = runs.read_run(write_run(tmp_path / "r", records))
    assert run.ranks == ["rank 0: mac, mps", "rank 1: pc, cuda, then box, cpu", "rank 2: pc, cuda"]
    assert report.headline(run)["ranks"] == "; ".join(run.ranks) and report.headline(run)["final split"] == "16/8/40"
    _, per_rank = series.throughput(run)
    assert [s.values[1] for s in per_rank] == [80.0, 40.0, 200.0]
    assert per_rank[2].values[0] != per_rank[2].values[0], "no third rank in epoch 0: a gap (NaN)"
    assert [s.values[-1] for s in series.split_series(run)] == [16, 8, 40]
    _, (_, *second), (_, *third) = series.step_times(run)
    assert third == pytest.approx([50.0, 60.0, 90.0]), "its 10 steps alone: 0.5 s, 0.6 s and the rest of 2.0 s"
    assert second[0] == pytest.approx((0.5 + 0.8) / 20 * 1000), "rank 1 over both epochs' 20 steps"
    assert figures._time_label([run], (1.0, "s")).endswith("(wall clock: the pause before a resume included)")
    assert figures._time_label([runs.read_run(write_run(tmp_path / "a", TWO_EPOCHS))], (1.0, "s")) == \
        "time since training started (s)"


def test_split_and_logged_scalars_over_time_and_epochs(tmp_path):
    run = runs.read_run(write_run(tmp_path / "a", TWO_EPOCHS))
    mac, pc = series.split_series(run)
    assert (mac.seconds, mac.values, pc.values) == ([0.0, 3.0, 4.0], [16, 20, 20], [48, 44, 44])
    acc, = series.scalar_series(run, series.is_accuracy)
    # the first log halfway through epoch 1 (step 15 of 10..20): 1.5 epochs completed
    assert (acc.label, acc.epochs, acc.values) == ("test accuracy", [1.5, 2.0], [0.5, 0.8])
    assert acc.seconds == pytest.approx([3.0, 4.1])
    assert [s.label for s in series.scalar_series(run, series.is_loss)] == ["train loss (epoch mean)", "test loss"]


def test_headline_numbers_and_the_sync_mode_auto_chose(tmp_path):
    head = report.headline(runs.read_run(write_run(tmp_path / "a", TWO_EPOCHS)))
    assert head["finished"] == "yes" and head["sync"] == "step" and head["hosts"] == "mac, pc"
    assert head["global batch"] == "64" and head["final split"] == "20/44" and head["steps"] == "20"
    assert head["samples/s (all epochs)"] == "320" and head["final test accuracy"] == "80.00%"
    assert head[report.WALL] == "5.0 s" and head["final train loss"] == "1"
    # the recipe's own clocks, said as the script's and as durations, beside the job's two
    timed = [*TWO_EPOCHS[:-1], {"event": "log", "time": 104.2, "epoch": 1, "step": 20, "train_seconds": 3.21,
                                "elapsed_seconds": 3.9}, TWO_EPOCHS[-1]]
    head = report.headline(runs.read_run(write_run(tmp_path / "timed", timed)))
    assert (head["train seconds (the script's last job.log)"], head["elapsed seconds (the script's last job.log)"],
            head[report.EPOCHS_TIME]) == ("3.2 s", "3.9 s", "4.0 s"), head
    assert not any(k.startswith("final") and "seconds" in k for k in head), head
    assert [report.duration(s) for s in (0.03412, 59.94, 3000, 7002)] == ["0.0341 s", "59.9 s", "50 min", "1 h 57 min"]
    unfinished = [_start(sync="auto"), {"event": "plan", "time": 99.0, "chose": "diloco:32 overlapped"},
                  *TWO_EPOCHS[1:-1]]
    run = runs.read_run(write_run(tmp_path / "auto", unfinished))
    assert run.label == "auto (auto -> diloco:32 overlapped)"
    assert report.headline(run)["finished"] == "no (last record at 4.1 s)"
    # stopped after epoch 0 (kept up to its checkpoint at 102.0), resumed at 200.0: both stretches' wall time,
    # where the end record's own 2.5 s (the resumed stretch) read less than the epochs' 4.0 s of training
    resumed = [*TWO_EPOCHS[:3], _start(t=200.0), _epoch(202.0, 1, 20, [20, 44], [180, 460], [1.2, 0.4], [0.1, 0.8]),
               {"event": "end", "time": 202.5, "seconds": 2.5}]
    resumed[3]["resumed_from"] = "runs/x/checkpoints/step-000000010.pt"
    head = report.headline(runs.read_run(write_run(tmp_path / "resumed", resumed)))
    assert head[report.WALL] == "4.5 s" and head[report.EPOCHS_TIME] == "4.0 s", head
    assert head["resumed"] == "at step ?, 100 s after the start", head
    # an --elastic reset's start record is no new launch: the end record's seconds count from the first Job
    elastic = [*resumed[:3], _start(t=103.0, resumed_from="elastic commit at step 10"), *resumed[4:5],
               {"event": "end", "time": 202.5, "seconds": 102.5}]
    assert report.headline(runs.read_run(write_run(tmp_path / "elastic", elastic)))[report.WALL] == "102.5 s"


def test_a_torn_last_line_is_left_out_and_any_other_bad_line_named(tmp_path):
    run = runs.read_run(write_run(tmp_path / "torn", TWO_EPOCHS, tail='{"event": "epo'))
    assert run.torn_last_line and len(run.epochs) == 2
    lines = [json.dumps(r) for r in TWO_EPOCHS]
    lines[2] = lines[2][:30]
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=r"bad/metrics.jsonl:3: not a metrics record"):
        runs.read_run(tmp_path / "bad")


@pytest.mark.parametrize("records, problem", [
    ([], "has no start record (the file is empty)"),
    (TWO_EPOCHS[:2], "has no finished epoch and no job.log record yet: nothing to plot. job.epochs(n) writes"),
    ([{"event": "start", "time": 1.0}], "a start record lacks ranks"),
])
def test_a_metrics_file_without_what_the_report_needs_is_named(tmp_path, records, problem):
    write_run(tmp_path / "r", records)
    with pytest.raises(ConfigError, match=re.escape(f"{tmp_path}/r/metrics.jsonl") + ".*" + re.escape(problem)):
        runs.read_run(tmp_path / "r")


def test_default_output_folders(tmp_path):
    assert runs.default_out([tmp_path / "a"]) == tmp_path / "a" / "report"
    assert runs.default_out([tmp_path / "a", tmp_path / "b", tmp_path / "c"]) == tmp_path / "a" / "report-vs-b-c"
    with pytest.raises(ConfigError, match="is given twice"):
        runs.read_runs([tmp_path / "a", tmp_path / "x" / ".." / "a"])


def test_a_run_without_the_step_times_is_named_not_drawn(tmp_path):
    """An old run beside a new one: the step-time figure has the new one's bars and says which
    run lacks them; no accuracy logged anywhere: no accuracy figure."""
    new = [r for r in TWO_EPOCHS if r["event"] != "log"]
    both = runs.read_runs([write_run(tmp_path / "new", new), write_run(tmp_path / "old", old_format(new))])
    drawn = {f.path.name: f for f in figures.draw_all(both, tmp_path / "new")}
    assert sorted(drawn) == sorted(set(FIGURES) - {"accuracy.png"})
    bars = drawn["step_time.png"].series["where each rank's step goes"]
    assert bars == ["compute", "communication", "other", "new (step)\nrank 0: mac, mps", "new (step)\nrank 1: pc, cuda"]
    assert "Not timed" in drawn["step_time.png"].caption and "old (step)" in drawn["step_time.png"].caption


LOOPED = [  # nanoGPT's loop: no job.epochs, job.log every 10 iterations
    _start(host_names=["mac", "pc"]),
    {"event": "split", "time": 100.0, "epoch": 0, "step": 0, "split": [16, 48]},
    *({"event": "log", "time": 100.0 + step / 10, "epoch": 0, "step": step, "loss": 4.0 - step / 10, "lr": 6e-4}
      for step in (10, 20, 30)),
    {"event": "split", "time": 102.5, "step": 25, "split": [20, 44]},
]


def test_a_run_that_loops_on_its_own_is_drawn_from_what_it_logged(tmp_path):
    """A script that loops over steps without job.epochs (nanoGPT's while loop) has no epoch
    records: its job.log scalars are drawn against time and steps, the split over time, and the
    headline says why no epoch is counted; beside a run with epochs the steps axis serves both."""
    looped = runs.read_run(write_run(tmp_path / "looped", LOOPED))
    head = report.headline(looped)
    assert head["epochs"] == "none recorded (the script loops on its own, without job.epochs)", head
    assert head["steps"] == "30 at the last job.log" and head["final split"] == "20/44" and head["final loss"] == "1"
    assert head["finished"] == "no (last record at 3.0 s)"
    loss, = series.scalar_series(looped, series.is_loss)
    assert (loss.steps, loss.values, loss.seconds) == ([10, 20, 30], [3.0, 2.0, 1.0], pytest.approx([1.0, 2.0, 3.0]))
    drawn = {f.path.name: f for f in figures.draw_all([looped], tmp_path / "looped")}
    assert sorted(drawn) == ["loss.png", "split.png"], sorted(drawn)
    assert drawn["loss.png"].series == {"loss against time": ["loss"], "loss against steps": ["loss"]}
    assert "No epoch records in looped (step)" in drawn["loss.png"].caption
    assert drawn["split.png"].series["samples per step"] == ["rank 0: mac, mps", "rank 1: pc, cuda"]
    both = runs.read_runs([write_run(tmp_path / "epochs", TWO_EPOCHS), tmp_path / "looped"])
    drawn = {f.path.name: f for f in figures.draw_all(both, tmp_path / "epochs")}
    assert sorted(drawn) == sorted(FIGURES), sorted(drawn)
    assert drawn["loss.png"].series["loss against steps"] == ["epochs (step): train loss (epoch mean)",
                                                              "epochs (step): test loss", "looped (step): loss"]
    assert drawn["samples_per_s.png"].series["whole job"] == ["epochs (step): all ranks"]
    assert "looped (step)" in drawn["step_time.png"].caption and "Not timed" not in drawn["step_time.png"].caption


def test_a_run_that_loops_on_its_own_without_a_job_log_is_drawn_from_its_live_lines(tmp_path):
    """A loop of the script's own that never calls job.log (a port left as it was) has neither
    epoch nor log records: the report draws rank 0's live lines' loss (progress.jsonl, which the
    launcher keeps), one point a step, and the headline says where it came from."""
    folder = write_run(tmp_path / "live", [_start(), {"event": "split", "time": 100.0, "step": 0, "split": [16, 48]},
                                           {"event": "end", "time": 104.0, "seconds": 4.0}])
    with pytest.raises(ConfigError, match=r"without one, rank 0's live lines' loss, from progress.jsonl, which this "
                                          r"run has none of"):
        runs.read_run(folder)
    lines = [{"at": 100.5 + i / 2, "progress": {"rank": 0, "step": step, "epoch": 0, "loss": loss}}
             for i, (step, loss) in enumerate([(1, 3.0), (1, 2.5), (2, 2.0), (3, 1.0)])]
    (folder / "progress.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines)
                                           + '{"at": 104.0, "result": {"loss": 1.0}}\n{"at": 104.1, "progr')
    live = runs.read_run(folder)
    loss, = series.scalar_series(live, series.is_loss)
    assert (loss.steps, loss.values, loss.seconds) == ([1, 2, 3], [2.5, 2.0, 1.0], pytest.approx([1.0, 1.5, 2.0]))
    head = report.headline(live)
    assert head["steps"].startswith("3 at the last live line (the script calls no job.log") and \
        head["final live loss"] == "1", head
    assert sorted(f.path.name for f in figures.draw_all([live], folder)) == ["loss.png", "split.png"]


WINDOWS = [  # what step sync writes at each of LOOPED's job.log calls: the steps since the one before
    {"event": "window", "time": 100.0 + step / 10, "epoch": 0, "step": step, "steps": 10, "seconds": 1.0,
     "samples": 640, "samples_per_s": 640.0, "rank_samples": [160, 480], "compute_s": [0.5, 0.6],
     "comm_s": [0.4, 0.3]} for step in (10, 20, 30)]


def test_a_run_that_loops_on_its_own_has_its_speed_from_the_steps_between_its_job_logs(tmp_path):
    """Step sync writes a window record at each job.log of a loop without job.epochs (every
    rank's samples and seconds since the last one, as an epoch record has them): samples/s of the
    job and of each rank, where each rank's step goes, and the headline's samples/s."""
    looped = runs.read_run(write_run(tmp_path / "looped", LOOPED[:-1] + WINDOWS + LOOPED[-1:]))
    total, per_rank = series.throughput(looped)
    assert total.values == [640.0] * 3 and [s.values for s in per_rank] == [[160.0] * 3, [480.0] * 3]
    assert total.steps == [10, 20, 30] and total.seconds == pytest.approx([1.0, 2.0, 3.0])
    assert series.step_times(looped) == [("rank 0: mac, mps", *map(pytest.approx, (50.0, 40.0, 10.0))),
                                         ("rank 1: pc, cuda", *map(pytest.approx, (60.0, 30.0, 10.0)))]
    assert report.headline(looped)["samples/s (between job.log calls)"] == "640"
    drawn = {f.path.name: f for f in figures.draw_all([looped], tmp_path / "looped")}
    assert sorted(drawn) == ["loss.png", "samples_per_s.png", "split.png", "step_time.png"], sorted(drawn)
    assert drawn["samples_per_s.png"].series["each rank"] == ["rank 0: mac, mps", "rank 1: pc, cuda"]
    assert "the steps between two job.log calls" in drawn["samples_per_s.png"].caption

# -- the command on real runs ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Two real 2-rank runs of digits, 2 epochs: step sync and local:4."""
    base = tmp_path_factory.mktemp("runs")
    for name, sync in (("steprun", "step"), ("localrun", "local:4")):
        run_cmd([VENV_BIN / "invoke", "train", "--epochs", "2", "--sync", sync, "--keep-checkpoints", "0",
                 "--run-dir", base / name], timeout=300)
    return base / "steprun", base / "localrun"


def report_cmd(*args, env=None):
    return run_cmd([VENV_BIN / "invoke", "report", *args], timeout=120, check=False, env=env)


@pytest.mark.slow
def test_epochs_carry_each_ranks_samples_and_its_compute_and_communication(two_runs):
    for folder in two_runs:
        run = runs.read_run(folder)
        for e in run.epochs:
            assert sum(e["rank_samples"]) == e["samples"] and min(e["rank_samples"]) > 0
            assert len(e["compute_s"]) == len(e["comm_s"]) == 2 and min(e["compute_s"]) > 0
            assert min(e["comm_s"]) > 0  # the allreduce every step; local:4 the exchanges
            assert sum(e["compute_s"]) / 2 + min(e["comm_s"]) < e["seconds"]
        assert [e["step"] for e in run.epochs] == [r["step"] for r in run.logs]


@pytest.mark.slow
def test_report_on_one_run_writes_the_figures_and_a_self_contained_page(two_runs):
    """`invoke report RUN_DIR`, the run directory given as written (not behind `--`)."""
    step_run, _ = two_runs
    proc = report_cmd(step_run)
    assert proc.returncode == 0, proc.stderr
    out = step_run / "report"
    assert sorted(p.name for p in out.iterdir()) == sorted(FIGURES + ["report.html"])
    page = (out / "report.html").read_text()
    for name in FIGURES:
        png = (out / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 15_000, name
        assert base64.b64encode(png).decode() in page, f"{name} is not inlined in report.html"
        assert str(out / name) in proc.stdout
    end = runs.read_run(step_run).end
    assert f"{end['test_accuracy']:.2%}" in page and "--dataset digits --epochs 2" in page
    assert "<th>sync</th><td>step</td>" in page and f"report: {out / 'report.html'}" in proc.stdout
    assert "src=\"report" not in page and "<img src=\"data:image/png;base64," in page  # nothing beside it needed


def test_a_script_looping_over_iterations_is_swept_and_reported_from_what_it_logged(tmp_path):
    """tests/scripts/step_loop.py trains as nanoGPT's train.py does (a while loop over iterations,
    the loader's iterator renewed, no job.epochs) and logs its loss every 5 iterations. A sweep of
    it takes each trial's last logged loss (it ended "without logging --metric loss" before: the
    values came only with job.epochs' end), the trial's run ends with rank 0's end record, and
    `invoke report` on it draws the log and the split and says why there is no epoch (it refused
    the run before)."""
    space, folder = tmp_path / "space.yaml", tmp_path / "sweep"
    space.write_text("log-interval: {choice: [5]}\n")
    proc = run_cmd([VENV_BIN / "invoke", "sweep", "--script", ROOT / "tests" / "scripts" / "step_loop.py", "--space",
                    space, "--trials", "1", "--metric", "loss", "--mode", "min", "--run-dir", folder, "--",
                    "--max-iters", "30"], timeout=300)
    trial, = trials(folder)
    run_dir = folder / trial["run_dir"]
    run = runs.read_run(run_dir)
    assert [r["step"] for r in run.logs] == [5, 10, 15, 20, 25, 30] and run.logs[-1]["loss"] < run.logs[0]["loss"] / 10
    assert trial["state"] == "complete" and trial["value"] == run.logs[-1]["loss"], (trial, proc.stdout[-2000:])
    # rank 0's end record when the script returned: its seconds and last scalars, no digests (no collective)
    assert run.end["loss"] == run.logs[-1]["loss"] and run.end["seconds"] > 0 and "param_digests" not in run.end
    proc = report_cmd(run_dir)
    assert proc.returncode == 0, proc.stderr
    # its speed from the steps between its job.log calls: a window record at each, and at its end
    assert [(w["step"], w["steps"], sum(w["rank_samples"])) for w in run.windows] == [(5, 5, 320), (10, 5, 320), (
        15, 5, 320), (20, 5, 320), (25, 5, 320), (30, 5, 320)], run.windows
    assert all(0 < c and 0 <= m for w in run.windows for c, m in zip(w["compute_s"], w["comm_s"])), run.windows
    assert sorted(p.name for p in (run_dir / "report").iterdir()) == ["loss.png", "report.html", "samples_per_s.png",
                                                                      "split.png", "step_time.png"]
    page = html.unescape((run_dir / "report" / "report.html").read_text())
    assert "none recorded (the script loops on its own, without job.epochs)" in page
    assert "30 at the last job.log" in page and "No epoch records in 000 (step)" in page
    assert "<th>finished</th><td>yes</td>" in page, page[:3000]


@pytest.mark.slow
def test_two_runs_are_overlaid_in_every_figure(two_runs, tmp_path):
    both = runs.read_runs(list(two_runs))
    page, drawn = report.write(both, tmp_path)
    series = {f.path.name: f.series for f in drawn}
    assert sorted(series) == sorted(FIGURES)
    a, b = "steprun (step)", "localrun (local:4)"
    ranks = ["rank 0: local, cpu (1 thread)", "rank 1: local, cpu (1 thread)"]
    for axes in ("loss against time", "loss against epochs"):
        assert series["loss.png"][axes] == [f"{r}: {s}" for r in (a, b)
                                            for s in ("train loss (epoch mean)", "test loss")]
    assert series["accuracy.png"]["accuracy against epochs"] == [f"{a}: test accuracy", f"{b}: test accuracy"]
    assert series["samples_per_s.png"]["whole job"] == [f"{a}: all ranks", f"{b}: all ranks"]
    assert series["samples_per_s.png"]["each rank"] == [f"{r}: {n}" for r in (a, b) for n in ranks]
    assert series["split.png"]["samples per step"] == [f"{r}: {n}" for r in (a, b) for n in ranks]
    assert series["step_time.png"]["where each rank's step goes"] == [
        "compute", "communication", "other", *(f"{r}\n{n}" for r in (a, b) for n in ranks)]
    text = page.read_text()
    assert f"<th>{a}</th><th>{b}</th>" in text and "<tr class=diff><th>sync</th><td>step</td><td>local:4</td>" in text


@pytest.mark.slow
@pytest.mark.parametrize("words", [["{a}", "{b}"], ["--", "{a}", "{b}"], ["{a}", "--out", "{out}", "{b}"]])
def test_the_command_on_two_runs_writes_into_the_first(two_runs, words, tmp_path):
    """As plain words, behind `--`, and with an option between them."""
    step_run, local_run = two_runs
    named = {"a": step_run, "b": local_run, "out": tmp_path / "out"}
    proc = report_cmd(*[w.format(**named) for w in words])
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "out" if "--out" in words else step_run / "report-vs-localrun"
    assert sorted(p.name for p in out.iterdir()) == sorted(FIGURES + ["report.html"])
    assert min((out / n).stat().st_size for n in FIGURES) > 15_000
    assert "localrun (local:4)" in (out / "report.html").read_text(), "both runs are in it"
    shutil.rmtree(out)


@pytest.mark.slow
def test_without_run_directories_the_newest_run_is_reported(two_runs, tmp_path):
    for folder in two_runs:
        shutil.copytree(folder, tmp_path / folder.name, ignore=shutil.ignore_patterns("report*"))
    (tmp_path / "localrun" / "metrics.jsonl").touch()  # the newest that trained
    failed = write_run(tmp_path / "20261129-161525-mnist", [])  # newer: `--dataset mnist` without --download
    os.utime(failed / "metrics.jsonl", (time.time() + 5, time.time() + 5))
    proc = report_cmd(env={"HVDHETERO_RUNS": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "localrun" / "report" / "report.html").is_file()
    assert not (tmp_path / "steprun" / "report").exists() and not (failed / "report").exists()
    assert f"report: passing over the newer {failed}: metrics.jsonl has no start record (the file is empty): the " \
        "run stopped before training began" in proc.stderr, proc.stderr


# -- bad input: exit 2, the path named, nothing written ----------------------------------------------

@pytest.mark.parametrize("make, named", [
    (lambda d: None, "run directory {d} not found"),
    (lambda d: d.mkdir(), "{d}/metrics.jsonl not found"),
    (lambda d: write_run(d, []), "{d}/metrics.jsonl has no start record (the file is empty)"),
    (lambda d: write_run(d, TWO_EPOCHS[:2], tail="not json\n" + json.dumps(TWO_EPOCHS[2]) + "\n"),
     "{d}/metrics.jsonl:3: not a metrics record"),
])
def test_a_bad_run_directory_exits_2_naming_it_and_writes_nothing(tmp_path, make, named):
    good = write_run(tmp_path / "good", TWO_EPOCHS)
    bad = tmp_path / "bad"
    make(bad)
    proc = report_cmd("--", good, bad)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert named.format(d=bad) in proc.stderr and "Traceback" not in proc.stderr
    assert not (good / "report-vs-bad").exists() and sorted(p.name for p in good.iterdir()) == ["metrics.jsonl"]


def test_no_run_under_runs_exits_2(tmp_path):
    proc = report_cmd(env={"HVDHETERO_RUNS": str(tmp_path)})
    assert proc.returncode == 2 and f"no run under {tmp_path} has a metrics.jsonl" in proc.stderr
    write_run(tmp_path / "never-started", [])
    proc = report_cmd(env={"HVDHETERO_RUNS": str(tmp_path)})
    assert proc.returncode == 2 and f"no run under {tmp_path} has anything to report yet; the newest: " in proc.stderr
    assert "never-started/metrics.jsonl has no start record" in proc.stderr and "Traceback" not in proc.stderr


def test_the_launcher_does_not_load_matplotlib():
    """`invoke --list` and the launcher's commands stay light: matplotlib only when a report is drawn."""
    probe = ("import sys, tasks; from hvdhetero.bench import report, runs; "
             "print('matplotlib' in sys.modules)")
    assert run_cmd([VENV_BIN / "python", "-c", probe], cwd=ROOT, timeout=60).stdout.strip() == "False"
