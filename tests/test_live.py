"""The launcher's console during a run: rates from the ranks' own clocks (bursts of lines change
nothing), the live table on a terminal, plain lines elsewhere, and every rank's output in its
log. The pure parts without any process; then two short real 2-rank runs, one under a
pseudo-terminal."""

from __future__ import annotations

import fcntl
import io
import json
import os
import pty
import re
import select
import struct
import subprocess
import termios
import time

import pytest

from conftest import ROOT, VENV_BIN, run_cmd
from hvdhetero import progress
from hvdhetero.cluster import console, live


def record(rank, t, done, share=32, batch=64, **job):
    """A rank's progress line at its clock `t` after `done` steps of `share` samples, each 20 ms
    of compute and 10 ms of waiting."""
    return {"rank": rank, "host": "mac" if rank else "pc", "device": "cpu", "t": t, "n_steps": done,
            "n_samples": done * share, "compute_s": 0.02 * done, "wait_s": 0.01 * done, "share": share,
            "batch": batch, **job}


def test_the_gap_between_two_epochs_is_no_steps_time():
    """The script's evaluation between epochs (20 s here) counted in the next epoch's first rate:
    a user's live line said 30 samples/s and ETA 2:18 where 3 s of the run were left. The new
    epoch's rates are its own, the last epoch's until it has two lines."""
    board = live.Board()
    for i in range(6):  # epoch 0: 10 steps a second of 64 samples, 20 steps
        board.update(record(0, 100.0 + i, 10 * i, share=64, epoch=0, epochs=2, step=10 * i, steps=60))
    board.update(record(0, 125.0, 51, share=64, epoch=1, epochs=2, step=1, steps=60))  # after 20 s evaluating
    assert board.rows()[0].samples_per_s == pytest.approx(640.0)
    assert board.status().eta_epoch_s == pytest.approx(5.9)  # 59 steps at 10 a second
    board.update(record(0, 127.0, 71, share=64, epoch=1, epochs=2, step=21, steps=60))
    assert board.rows()[0].samples_per_s == pytest.approx(640.0)


def test_an_epoch_shorter_than_a_report_shows_rates_of_its_own():
    """The Quickstart's epochs, ported, take 24 steps in a quarter of a second: a rank printed an
    epoch's last line alone (its lines come at most every REPORT_S), and the table showed the epoch
    before's rates for it, two epochs' rows alike to the digit. A rank prints an epoch's first step
    too: here the second epoch's steps take twice the compute of the first's."""
    out = io.StringIO()
    reporter = progress.Reporter(0, "pc", "cpu", every=60.0, out=out)
    board = live.Board()
    for epoch, compute_s in ((0, 0.003), (1, 0.006)):
        for step in range(1, 25):
            reporter.step(samples=32, compute_s=compute_s, wait_s=0.001, share=32, batch=64, epoch_end=step == 24,
                          epoch=epoch, epochs=2, step=step, steps=24)
        lines = out.getvalue().splitlines()
        out.seek(0), out.truncate()
        assert [json.loads(line[len(progress.TAG):])["step"] for line in lines] == [1, 24]
        for line in lines:
            board.update(json.loads(line[len(progress.TAG):]))
        assert board.rows()[0].compute_ms == pytest.approx(1e3 * compute_s)


def test_rates_come_from_the_ranks_clocks_not_from_when_lines_arrive():
    """Ten seconds of two ranks' lines reach the launcher at once (a burst): rank 0 took 10 steps
    a second of 32 samples, rank 1 (another clock) 5 steps a second of 16."""
    board = live.Board()
    for i in range(11):
        board.update(record(0, 100.0 + i, 10 * i, epoch=0, epochs=2, step=10 * i, steps=200))
        board.update(record(1, 7000.5 + i, 5 * i, share=16))
    fast, slow = board.rows()
    assert (fast.host, fast.share, fast.batch) == ("pc", 32, 64)
    assert fast.samples_per_s == pytest.approx(320) and slow.samples_per_s == pytest.approx(80)
    assert fast.compute_ms == pytest.approx(20) and fast.wait_ms == pytest.approx(10)
    status = board.status()
    assert status.samples_per_s == pytest.approx(400)
    assert status.eta_epoch_s == pytest.approx(10) and status.eta_run_s == pytest.approx(30)  # 100 + 200 steps left


def test_every_ranks_share_is_from_rank_0s_latest_split():
    """Each rank's line is of its own moment: a split moved from [2, 2] to [1, 3] between rank 1's
    line and rank 0's showed shares 1/4 and 2/4 at once. Rank 0's line carries the split."""
    board = live.Board()
    board.update(record(1, 10.0, 5, share=2, batch=4))
    board.update(record(0, 20.0, 6, share=1, batch=4, split=[1, 3]))
    assert [(r.share, r.batch) for r in board.rows()] == [(1, 4), (3, 4)]
    board.update(record(2, 30.0, 6, share=9, batch=12))  # a rank the split does not know yet keeps its own
    assert [(r.share, r.batch) for r in board.rows()] == [(1, 4), (3, 4), (9, 12)]


def test_a_repeated_or_too_close_line_gives_no_wild_rate():
    board = live.Board()
    board.update(record(0, 5.0, 1))
    board.update(record(0, 5.0, 1))  # the same line twice
    board.update(record(0, 5.000001, 2))  # a microsecond later by the rank's clock
    assert not board.update({"rank": 0, "t": 7.0}) and not board.update({"rank": 2, "t": 7.0}), "a cut line"
    row, = board.rows()
    assert row.samples_per_s is None and row.steps_per_s is None
    assert row.compute_ms == pytest.approx(20), "per step, not per second: still right"
    board.update(record(0, 6.0, 11))
    assert board.rows()[0].samples_per_s == pytest.approx(10 * 32)


def test_rates_follow_the_last_seconds_of_the_rank():
    """The window is WINDOW_S of the rank's clock: a rank that slowed down shows its new speed."""
    board = live.Board(window_s=3.0)
    for i in range(10):  # 10 steps/s for 10 s
        board.update(record(0, float(i), 10 * i))
    for i in range(1, 6):  # then 2 steps/s
        board.update(record(0, 9.0 + i, 90 + 2 * i))
    assert board.rows()[0].steps_per_s == pytest.approx(2)


def test_under_elastic_a_dropped_hosts_row_goes_and_a_joined_one_comes():
    """Three ranks, then the host of rank 2 dropped: the survivors' records say the job's size is
    2 and rank 2's row goes; once it is back (size 3) it has a row again."""
    board = live.Board()
    for rank in range(3):
        board.update(record(rank, 1.0, 1, size=3))
    assert [r.rank for r in board.rows()] == [0, 1, 2]
    board.update(record(0, 50.0, 1, size=2))  # a Job for the new membership: its totals start again
    assert [r.rank for r in board.rows()] == [0, 1]
    board.update(record(2, 90.0, 1, size=3))
    assert [r.rank for r in board.rows()] == [0, 1, 2]


def test_plain_lines_print_a_block_once_every_rank_ended_the_epoch():
    out = io.StringIO()
    display = live.PlainLines(out, every=3600)
    position = {"epoch": 0, "epochs": 3, "steps": 20}
    display.update(record(1, 10.0, 0, share=30, step=1, **position))
    display.update(record(0, 50.0, 0, step=1, loss=2.3, **position))
    display.update(record(0, 51.0, 20, step=20, loss=0.41234, logged={"test_accuracy": 0.9, "test_samples": 360},
                          logged_epoch=None, **position))
    assert out.getvalue() == "", "no block yet: none is due, and rank 1 has not ended the epoch"
    display.update(record(1, 11.0, 20, share=30, step=20, **position))
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("epoch 1/3  step 20/20 (100%)  ETA 0:00 (run ETA 0:02)  loss 0.4123  test_accuracy 0.9000")
    assert lines[0].endswith("  1,240 samples/s")  # 20 steps x 32 + 20 x 30 in one second
    assert lines[1:] == [
        "  rank 0  pc   cpu  share 32/64      640 samples/s  compute 20.0 ms  comm/wait 10.0 ms per step",
        "  rank 1  mac  cpu  share 30/64      600 samples/s  compute 20.0 ms  comm/wait 10.0 ms per step"]


def test_a_scripts_own_epoch_loop_shows_its_epochs_without_a_total():
    """`for epoch in range(6)` rather than job.epochs: the ranks know no total (epochs None), so
    the line says `epoch 5`, not `epoch 5/1`, and no run ETA (it read `run -1:59` in epoch 5)."""
    board = live.Board()
    for i in range(11):
        board.update(record(0, 100.0 + i, 10 * i, epoch=4, epochs=None, step=10 * i, steps=200, loss=0.5))
    status = board.status()
    assert status.eta_epoch_s == pytest.approx(10) and status.eta_run_s is None
    line = live.status_line(status)
    assert line.startswith("epoch 5  step 100/200 (50%)  ETA 0:10  loss 0.5000"), line
    assert live.epoch_line(status).startswith("epoch 5 done: loss 0.5000,")
    board.update(record(0, 111.0, 110, epoch=4, epochs=6, step=110, steps=200))
    assert live.status_line(board.status()).startswith("epoch 5/6  step 110/200 (55%)  ETA 0:09 (run ETA 0:29)")


def test_an_endless_epoch_shows_its_steps_and_recent_loss_without_a_total_or_eta():
    """minGPT's sampler never runs out (num_samples=int(1e10)): the ranks send no total (steps
    None), so the line counts steps, gives no ETA (it read `ETA 1105:28:35`) and says its loss is
    the last batches' (the epoch's mean since step 1 read 0.43 where the script printed 0.24)."""
    board = live.Board()
    for i in range(11):
        board.update(record(0, 100.0 + i, 10 * i, epoch=0, epochs=None, step=10 * i, steps=None, loss=0.24,
                            logged={"train_loss": 0.2425}))
    status = board.status()
    assert status.eta_epoch_s is None and status.eta_run_s is None
    line = live.status_line(status)
    assert line.startswith(f"step 100  loss 0.2400 (last {progress.RECENT_BATCHES} batches)  train_loss 0.2425  "), line
    assert "ETA" not in line and "epoch" not in line
    # a batch function's stream in job.epochs(5): the epoch is known, its steps are not
    board.update(record(0, 112.0, 353, epoch=3, epochs=5, step=353, steps=None, loss=0.92))
    assert live.status_line(board.status()).startswith("epoch 4/5  step 353  loss 0.9200 (last "), board.status()


class Shown:
    """A display that records what the relay did with it."""

    def __init__(self):
        self.calls = []

    def update(self, r):
        self.calls.append(("update", r["rank"]))

    def echo(self, text):
        self.calls.append(("echo", text))

    def close(self):
        self.calls.append(("close",))


RELAYED = ["[0]<stdout>:" + progress.TAG + json.dumps(record(0, 1.0, 1)) + "\n",
           "[1]<stderr>:" + progress.ALIVE_TAG + json.dumps({"rank": 1, "host": "mac"}) + "\n",
           "[1]<stdout>:half a line" + progress.ALIVE_TAG + json.dumps({"rank": 1, "host": "mac"}) + "\n",
           "[0]<stdout>:hello\n",
           "[0]<stderr>:[2026-11-23 19:50:35: E operations.cc:697] [0]: Horovod background loop uncaught exception: "
           "[pair.cc:223] Connection to rank 1 lost: connection reset by peer\n",  # a peer's failure, seen by 0
           "[1]<stderr>:a warning of the script's own\n",
           "[1]<stdout>:hvdhetero: rank 1: fp16 on mps, loss-scaled\n",
           "[0]<stderr>:rank 0's own warning\n",
           "[0]<stderr>:Killed\n",  # its shell's, once it is SIGKILLed: the failure message says so, not a bare word
           "[1]<stdout>:" + progress.TAG + "{cut sho\n",
           "[0]<stdout>:" + progress.RESULT_TAG + '{"event": "end"}\n']


def test_the_relay_shows_rank_0s_lines_as_printed_and_holds_the_others_back():
    """Rank 0's prints as they are (stdout and stderr, no prefix); the other ranks' prints are
    in their logs, said once; our own messages from any rank; progress to the table, results
    and heartbeats to the launcher."""
    shown, alive, results = Shown(), {}, []
    failures = console.relay(RELAYED, shown, results=results, alive=alive,
                             hidden_note="hvdhetero: the other ranks' output is in run/rank-N.log")
    assert failures == [] and results == [{"event": "end"}] and set(alive) == {1}
    assert shown.calls == [("update", 0), ("echo", "hvdhetero: the other ranks' output is in run/rank-N.log\n"),
                           ("echo", "hello\n"), ("echo", "hvdhetero: rank 1: fp16 on mps, loss-scaled\n"),
                           ("echo", "rank 0's own warning\n"), ("close",)]


def test_failures_a_ranks_workers_wrote_into_one_line_are_each_read_and_a_cut_one_is_skipped():
    """A rank's DataLoader workers share its output: two failure lines written at once can reach
    the launcher as one line (it stopped the launcher with a JSONDecodeError). Each whole one is
    read; one cut short is left out; a result line likewise."""
    first, second = ({"rank": 0, "host": "pc", "error": f"RuntimeError: {n}", "frames": []} for n in ("a", "b"))
    spliced = progress.ERROR_TAG + json.dumps(first) + progress.ERROR_TAG + json.dumps(second)
    shown, results = Shown(), []
    failures = console.relay(["[0]<stdout>:" + spliced + "\n",
                              "[1]<stdout>:" + progress.ERROR_TAG + '{"rank": 1, "ho\n',
                              "[0]<stdout>:" + progress.RESULT_TAG + '{"event": "end"}{"cut\n'], shown, results=results)
    assert failures == [first, second] and results == [{"event": "end"}]

def test_a_result_line_mpirun_cut_into_pieces_is_joined_not_shown():
    """mpirun cuts a rank's line longer than its 4 KB read into pieces, the later ones on lines of
    their own without the rank's prefix: a 150-epoch run's result line (its every epoch's figures)
    reached the console as 6 lines of raw JSON, and the result was lost. A heartbeat of another
    rank may come between the pieces; a short line cut by its rank's end is left out, as before."""
    shown, results = Shown(), []
    result = {"event": "end", "history": [{"epoch": e, "test_loss": 0.0401795864105224} for e in range(300)]}
    line = "[1,0]<stdout>:" + progress.RESULT_TAG + json.dumps(result)
    pieces = [line[i:i + 4096] + "\n" for i in range(0, len(line), 4096)]
    assert len(pieces) > 3
    beat = "[1,1]<stderr>:" + progress.ALIVE_TAG + json.dumps({"rank": 1, "host": "pc", "pid": 7}) + "\n"
    cut = "[1,0]<stdout>:" + progress.TAG + '{"rank": 0, "ho\n'
    console.relay([pieces[0], beat, *pieces[1:], cut, "[1,0]<stdout>:epoch 150\n"], shown, results=results)
    assert results == [result]
    assert [c[1] for c in shown.calls if c[0] == "echo"] == ["epoch 150\n"]


def test_a_python_warning_is_said_once_by_the_rank_that_printed_it_first():
    """What a device of its own says reaches the console: the Mac's rank disabling a script's
    GradScaler("cuda"); a warning every rank prints comes once, as the first rank's (rank 0's own
    with its source line); a process that prints it again (a filter changed since) is not repeated
    either: a DataLoader's warning on the workers a rank's cores allow came 4 times."""
    shown = Shown()
    cuda = "UserWarning: torch.amp.GradScaler is enabled, but CUDA is not available.  Disabling."
    workers = "UserWarning: This DataLoader will create 2 worker processes in total."
    console.relay(["[1]<stderr>:/venv/torch/amp/grad_scaler.py:136: " + cuda + "\n",
                   "[1]<stderr>:  warnings.warn(\n",
                   "[0]<stderr>:/w/train.py:9: FutureWarning: old API\n",
                   "[0]<stderr>:  old()\n",
                   "[1]<stderr>:/venv/torch/amp/grad_scaler.py:136: " + cuda + "\n",
                   "[1]<stderr>:/w/train.py:9: FutureWarning: old API\n",
                   "[0]<stderr>:/venv/torch/amp/grad_scaler.py:136: " + cuda + "\n",
                   "[0]<stderr>:  warnings.warn(\n",
                   "[0]<stderr>:/venv/torch/utils/data/dataloader.py:431: " + workers + "\n",
                   "[0]<stderr>:  self.check_worker_number_rationality()\n",
                   "[0]<stdout>:epoch 1\n",
                   "[0]<stderr>:/venv/torch/utils/data/dataloader.py:431: " + workers + "\n",
                   "[0]<stderr>:  self.check_worker_number_rationality()\n",
                   "[0]<stderr>:/venv/torch/utils/data/dataloader.py:437: " + workers + "\n",
                   "[0]<stdout>:  indented, no warning's\n",
                   "[1]<stderr>:/venv/torch/utils/data/dataloader.py:431: " + workers + "\n",
                   "[0]<stderr>:/venv/torch/utils/data/dataloader.py:431: " + workers + "\n",
                   "[1]<stderr>:  self.check_worker_number_rationality()\n",
                   "[0]<stderr>:  self.check_worker_number_rationality()\n"],
                  shown, hidden_note="hvdhetero: the other ranks' output is in run/rank-N.log")
    assert [c[1] for c in shown.calls if c[0] == "echo"] == [
        "hvdhetero: the other ranks' output is in run/rank-N.log\n",
        "hvdhetero: rank 1 warned: " + cuda + "\n", "/w/train.py:9: FutureWarning: old API\n", "  old()\n",
        "/venv/torch/utils/data/dataloader.py:431: " + workers + "\n",
        "hvdhetero: rank 0's DataLoader workers share the cores it is pinned to (the ranks of one host each have "
        "their own: one of the `local` host's two has one), taking turns with its training; fewer workers, or none, "
        "may be as fast there\n", "  self.check_worker_number_rationality()\n",
        "epoch 1\n", "  indented, no warning's\n"]


def test_a_scripts_cuda_autocast_on_a_rank_without_cuda_is_said_to_run_in_float32_with_the_way_out():
    """A script written for the PC's GPU keeps `torch.autocast("cuda")`: torch turns it off on the
    Mac's mps rank (a warning) and that rank trains in float32, slower than it could. The console
    says so once, whichever rank it is, and names job.autocast() and --precision."""
    off = "UserWarning: CUDA is not available or torch_xla is imported. Disabling autocast."
    for rank in (1, 0):
        shown = Shown()
        console.relay([f"[{rank}]<stderr>:/venv/torch/amp/autocast_mode.py:285: {off}\n",
                       f"[{rank}]<stderr>:/venv/torch/amp/autocast_mode.py:285: {off}\n"],
                      shown, hidden_note="hvdhetero: the other ranks' output is in run/rank-N.log")
        said = [c[1] for c in shown.calls if c[0] == "echo" and "float32" in c[1]]
        assert len(said) == 1 and said[0].startswith(f"hvdhetero: rank {rank} runs the script's "
                                                     'torch.autocast("cuda") in float32'), shown.calls
        assert "job.autocast()" in said[0] and "--precision fp16 or bf16" in said[0]
    other = "UserWarning: In CPU autocast, but the target dtype is not supported. Disabling autocast."
    shown = Shown()
    console.relay([f"[1]<stderr>:/venv/torch/amp/autocast_mode.py:299: {other}\n"], shown, hidden_note="held back")
    assert not [c for c in shown.calls if c[0] == "echo" and "float32" in c[1]], shown.calls


def test_all_ranks_output_tags_every_other_ranks_line():
    shown = Shown()
    console.relay(RELAYED, shown, all_ranks=True, hidden_note="never shown: nothing is held back")
    assert [c[1] for c in shown.calls if c[0] == "echo"] == [
        "[rank 1] half a line\n", "hello\n", "[rank 1] a warning of the script's own\n",
        "hvdhetero: rank 1: fp16 on mps, loss-scaled\n", "rank 0's own warning\n"]


def test_after_an_elastic_reset_rank_0s_lines_are_those_of_the_new_rank_0():
    """--elastic renumbers the ranks when rank 0's host is dropped, but horovodrun keeps
    prefixing each process's lines with its launch-time rank: the new rank 0 prints as [1], and
    its progress records say which prefix is rank 0 now."""
    shown = Shown()
    console.relay(["[0]<stdout>:epoch 1 on the first rank 0\n",
                   "[1]<stdout>:" + progress.TAG + json.dumps(record(0, 1.0, 1)) + "\n",  # [1] is rank 0 now
                   "[1]<stdout>:epoch 2 on the new rank 0\n"], shown, hidden_note="hvdhetero: held back")
    assert [c[1] for c in shown.calls if c[0] == "echo"] == ["epoch 1 on the first rank 0\n",
                                                            "epoch 2 on the new rank 0\n"]


def test_rank_logs_keep_each_ranks_output_and_a_failures_traceback(tmp_path):
    logs = console.RankLogs(tmp_path / "run")
    failure = {"rank": 1, "host": "mac", "error": "ValueError: x", "frames": [],
               "traceback": "Traceback (most recent call last):\n  ...\nValueError: x\n"}
    for line in ["[0]<stdout>:epoch 1\n", "[1]<stderr>:" + progress.ALIVE_TAG + '{"rank": 1, "host": "mac"}\n',
                 "[1]<stderr>:a warning\n", "[0]<stdout>:" + progress.TAG + json.dumps(record(0, 1.0, 1)) + "\n",
                 "Process 1 exit with status code 1.\n",
                 "[1]<stdout>:" + progress.ERROR_TAG + json.dumps(failure) + "\n",
                 "[0]<stderr>:Terminated\n"]:
        logs.write(line)
    logs.close()
    assert logs.has(0) and logs.has(1)
    body = lambda rank: logs.path(rank).read_text().split("\n", 1)[1]  # noqa: E731 - after the header line
    assert body(0) == "epoch 1\nTerminated\n"
    assert body(1) == "a warning\nTraceback (most recent call last):\n  ...\nValueError: x\n"
    kept = [json.loads(line) for line in (tmp_path / "run" / console.PROGRESS_FILE).read_text().splitlines()]
    assert [k["progress"] for k in kept] == [record(0, 1.0, 1)] and kept[0]["at"] > 0


def test_rank_0s_progress_and_results_reach_the_launchers_progress_file_whichever_prefix_it_has(tmp_path):
    """invoke sweep reads a trial's epochs and logged scalars from RUN_DIR/progress.jsonl on the
    launcher: rank 0's records only (the record names its rank; --elastic renumbers prefixes),
    the end result with every job.log, a line cut short skipped."""
    logs = console.RankLogs(tmp_path)
    mine = {**record(0, 1.0, 1), "logged": {"test_loss": 0.5}, "logged_epoch": 0}
    end = {"event": "end", "seconds": 3.0, "logs": [{"epoch": 0, "step": 9, "test_loss": 0.5}]}
    for line in ["[0]<stdout>:" + progress.TAG + json.dumps(record(1, 1.0, 1)) + "\n",  # rank 1's, prefix 0
                 "[1]<stdout>:" + progress.TAG + json.dumps(mine) + "\n",
                 "[1]<stdout>:" + progress.TAG + '{"rank": 0, "t": 1\n',
                 "[1]<stdout>:" + progress.RESULT_TAG + json.dumps(end) + "\n"]:
        logs.write(line)
    logs.close()
    kept = [json.loads(line) for line in (tmp_path / console.PROGRESS_FILE).read_text().splitlines()]
    assert [k.get("progress") or k["result"] for k in kept] == [mine, end]
    assert kept[0]["at"] <= kept[1]["at"] <= time.time() + 0.001  # rounded to ms


# -- real runs --------------------------------------------------------------------------------------


def test_a_loop_that_leaves_each_epoch_early_is_counted_in_the_steps_it_takes(tmp_path):
    """Optuna's examples take the first N batches of each epoch and break: the live line said
    "step 5/24" and its ETA, and a sweep's estimate of the trial's end, counted steps never taken.
    From the second epoch on a pass counts as long as the first one was."""
    run_cmd([VENV_BIN / "invoke", "train", "--script", ROOT / "tests" / "scripts" / "leaves_early.py",
             "--run-dir", tmp_path / "run", "--keep-checkpoints", "0", "--", "--epochs", "3", "--batches", "5"],
            timeout=300)
    lines = [json.loads(line)["progress"] for line in (tmp_path / "run" / console.PROGRESS_FILE).read_text().splitlines()
             if "progress" in line]
    later = [(p["epoch"], p["step"], p["steps"]) for p in lines if p["epoch"] >= 1]
    assert later and all(steps == 5 and step <= 5 for _, step, steps in later), lines
    assert (2, 5, 5) in later, "the pass's last step ends its epoch on the live line"

ROW = r"^\s+{rank}  local\s+cpu \(\d+ threads?\)\s+\d+/64\s+[\d,]+\s+[\d.]+\s+[\d.]+\r?$"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def under_a_terminal(argv, columns=150, timeout=120) -> tuple[int, str]:
    """Run `argv` with a pseudo-terminal `columns` wide as its stdout and stderr; its exit code
    and everything it wrote."""
    main, sub = pty.openpty()
    fcntl.ioctl(sub, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    proc = subprocess.Popen([str(a) for a in argv], cwd=ROOT, stdin=subprocess.DEVNULL, stdout=sub, stderr=sub,
                            env={**os.environ, "TERM": "xterm-256color"}, start_new_session=True)
    os.close(sub)
    out, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([main], [], [], 1.0)[0]:
                try:
                    data = os.read(main, 65536)
                except OSError:  # EIO: every writer has gone
                    break
                if not data:
                    break
                out += data
            elif proc.poll() is not None:
                break
    finally:
        os.close(main)
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
        proc.wait(timeout=30)
    return proc.returncode, out.decode(errors="replace")


@pytest.mark.alone
@pytest.mark.slow
def test_a_terminal_shows_the_live_table_with_a_row_per_rank(tmp_path):
    code, out = under_a_terminal([VENV_BIN / "invoke", "train", "--epochs", "1", "--run-dir", tmp_path / "run"],
                                 columns=80)
    text = ANSI.sub("", out)
    assert code == 0, text[-3000:]
    assert re.search(r"^rank  host\s+device\s+share  samples/s  compute  comm/wait\r?$", text, re.M), text
    assert "compute, comm/wait: ms per step" in text
    assert re.search(ROW.format(rank=0), text, re.M) and re.search(ROW.format(rank=1), text, re.M), text[-3000:]
    # at 80 columns the status line goes on over a second line, not cropped
    assert re.search(r"epoch 1/1  step (\d+)/\1 \(100%\)  ETA 0:00 \(run ETA 0:00\)  loss \d\.\d{4}(  |\r?\n)"
                     r"[\d,]+ samples/s", text), text[-3000:]
    assert "epoch 1/1 done: loss " in text
    assert "\x1b[1A" in out, "drawn in place (the cursor goes back up), not printed again and again"
    assert "test accuracy" in text, "the recipe's own print comes through"
    assert "horovodrun" not in text and "<stdout>" not in text, "no command line, no horovodrun prefixes"


def test_the_live_table_of_a_mac_and_a_pc_fits_80_columns_a_row_a_rank():
    """The table a terminal shows, at 80 columns: each rank on one line, its numbers whole; at 60
    the names are cut with an ellipsis, never a number. (It wrapped `cpu (1 threads)` onto a
    second line at 80, and would have wrapped a CUDA device's name over four.)"""
    from rich.console import Console

    devices = {0: "cuda:0 (NVIDIA GeForce RTX 4070 Ti)", 1: "mps (Apple M2)"}
    for columns in (80, 60):
        display = live.LiveTable(io.StringIO())
        display.console = Console(file=io.StringIO(), width=columns, highlight=False)
        for t, done in ((10.0, 0), (12.0, 200)):
            for rank in (0, 1):
                display.board.update({**record(rank, t + rank, done, share=748 if rank else 1300, batch=2048),
                                      "host": "macbook-air" if rank else "pc", "device": devices[rank],
                                      "epoch": 0, "epochs": 3, "step": 5, "steps": 23})
        display.console.print(display.render())
        lines = display.console.file.getvalue().splitlines()
        assert max(len(line.rstrip()) for line in lines) <= columns, lines
        pc = next(line for line in lines if line.lstrip().startswith("0 "))
        mac = next(line for line in lines if line.lstrip().startswith("1 "))
        assert pc.split()[-4:] == ["1300/2048", "130,000", "20.0", "10.0"], lines
        assert mac.split()[-4:] == ["748/2048", "74,800", "20.0", "10.0"], lines
        assert lines[-1].strip() == "compute, comm/wait: ms per step" and "204,800 samples/s" in lines[0] + lines[1]
        if columns == 80:
            assert "cuda:0 (RTX 4070 Ti)" in pc and "mps (Apple M2)" in mac and "macbook-a…" in mac, lines
        else:
            assert "…" in mac, lines


@pytest.mark.slow
def test_a_log_gets_plain_lines_and_every_rank_its_log_file(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cmd([VENV_BIN / "invoke", "train", "--epochs", "1", "--run-dir", run_dir], timeout=120)
    out = proc.stdout + proc.stderr
    assert "\x1b[" not in out and "┃" not in out, "no terminal drawing in a log"
    assert re.search(r"^epoch 1/1  step (\d+)/\1 \(100%\)  ETA 0:00 .* [\d,]+ samples/s$", proc.stdout, re.M), out
    for rank in (0, 1):
        assert re.search(rf"^  rank {rank}  local  cpu \(\d+ threads?\)  share \d+/64 +[\d,]+ samples/s  "
                         r"compute [\d.]+ ms  comm/wait [\d.]+ ms per step$", proc.stdout, re.M), out
    assert "test accuracy" in (run_dir / "rank-0.log").read_text()
    assert (run_dir / "rank-1.log").exists()


@pytest.mark.parametrize("value, text", [(1725.1594789990272, "1,725.16"), (0.93125, "0.9313"), (12.5, "12.5000"),
                                         (3.2e-05, "3.2e-05"), (0.0, "0.0000"), (12000, "12,000"),
                                         (-2500.0, "-2,500.00"), (float("nan"), "nan"), (True, "True")])
def test_logged_scalars_read_as_a_person_writes_them(value, text):
    assert live.scalar(value) == text


def test_horovods_stall_warning_is_said_in_words_naming_the_missing_rank():
    """Horovod's stall inspector (stall_inspector.cc's format) names the ranks that have not
    joined a collective; the console says what that nearly always means in a script."""
    shown = Shown()
    console.relay(["[0]<stderr>:[2026-11-26 19:20:13.068681: W stall_inspector.cc:107] One or more tensors were "
                   "submitted to be reduced, gathered or broadcasted by subset of ranks and are waiting for remainder "
                   "of ranks for more than 60 seconds. This may indicate that different ranks are trying to submit "
                   "different tensors or that only subset of ranks is submitting tensors, which will cause "
                   "deadlock. \n",
                   "[0]<stderr>:Missing ranks:\n", "[0]<stderr>:1: [hvdhetero.replicas]\n",
                   "[0]<stderr>:0!: [grad.3, grad.4]\n", "[0]<stdout>:after\n"], shown)
    said = [c[1] for c in shown.calls if c[0] == "echo" and c[1].startswith("hvdhetero: ")]
    assert said[0].startswith("hvdhetero: rank 1 has not joined hvdhetero.replicas for 60 s, where the other ranks "
                              "wait: every rank must make the same calls"), said
    assert said[1] == ("hvdhetero: rank 0 has not joined grad.3, grad.4 for 60 s, where the other ranks wait (a call "
                       "only some ranks made?); Horovod ends the job if it does not come\n"), said
    assert len(said) == 2 and ("echo", "after\n") in shown.calls
