"""A run's folder from the launcher's side (cluster/run_dir.py): launch.json written and read
back, and the run --resume continues, refused with the reason when it cannot be."""

from __future__ import annotations

import json
import os
import re

import pytest

from hvdhetero.cluster import run_dir
from hvdhetero.errors import ConfigError


def a_run(folder, checkpoint=True, rank0_local=True):
    run_dir.write_launch(folder, ["local"], rank0_local, "", "", ["--dataset", "digits"], ["--repeat", "2"],
                         {"seed": 3, "resume": True})
    if checkpoint:
        (folder / "checkpoints").mkdir()
        (folder / "checkpoints" / "step-00000010.pt").write_bytes(b"")
    return folder


def test_launch_json_holds_what_resume_relaunches_with(tmp_path):
    folder, saved = run_dir.resumable(str(a_run(tmp_path / "r")), tmp_path)
    assert folder == str(tmp_path / "r")
    assert saved == {"hosts": ["local"], "rank0_local": True, "script": "", "workdir": "",
                     "recipe": ["--dataset", "digits"], "script_args": ["--repeat", "2"], "settings": {"seed": 3},
                     "inventory": "", "launcher": "horovodrun"}


def test_latest_is_the_newest_run_with_a_checkpoint(tmp_path):
    old, new, empty = a_run(tmp_path / "old"), a_run(tmp_path / "new"), a_run(tmp_path / "empty", checkpoint=False)
    os.utime(old, (1, 1))
    assert run_dir.resumable("latest", tmp_path)[0] == str(new)
    os.utime(new, (0, 0))
    assert run_dir.resumable("latest", tmp_path)[0] == str(old), "by time, not by name"
    assert empty.exists()


@pytest.mark.parametrize("make, says", [
    (lambda d: None, "no such folder"),
    (lambda d: d.mkdir(), "launch.json not found (not a run directory invoke train wrote)"),
    (lambda d: (d.mkdir(), (d / "launch.json").write_text('{"hosts": ["loc')), "is not the JSON invoke train writes"),
    (lambda d: a_run(d, checkpoint=False), "the run has no checkpoint in"),
])
def test_a_run_that_cannot_be_resumed_is_refused_with_the_reason(tmp_path, make, says):
    make(tmp_path / "r")
    with pytest.raises(ConfigError, match=re.escape(says)) as refused:
        run_dir.resumable(str(tmp_path / "r"), tmp_path)
    assert refused.value.exit_code == 2 and str(tmp_path / "r") in str(refused.value)


def test_rank_0_on_another_host_keeps_the_checkpoints_there(tmp_path):
    folder = a_run(tmp_path / "r", checkpoint=False, rank0_local=False)
    assert run_dir.resumable(str(folder), tmp_path)[1]["rank0_local"] is False


def test_no_run_to_resume_under_runs(tmp_path):
    with pytest.raises(ConfigError, match=f"--resume latest: no run under {tmp_path} has a checkpoint"):
        run_dir.resumable("latest", tmp_path)


def test_a_new_run_goes_under_runs_unless_given(tmp_path):
    assert run_dir.new("digits", None, tmp_path).startswith(str(tmp_path / "20"))
    assert run_dir.new("digits", "rel", tmp_path) == str((tmp_path.cwd() / "rel").resolve())
    assert json.dumps(run_dir.LAUNCH) == '"launch.json"'


def test_only_a_run_whose_ranks_all_returned_is_finished_for_resume(tmp_path):
    """A run's end record in metrics.jsonl is not its end: the script's code after its loop (a
    test evaluation, an export) may still fail, and its resume runs that again. The launcher
    marks a clean end; a run marked so is not relaunched, checkpoints or not, rank 0 here or not,
    unless a checkpoint holds a later step (saved past the end)."""
    failed_after = a_run(tmp_path / "failed")
    (failed_after / "metrics.jsonl").write_text(json.dumps({"event": "epoch", "time": 1.0, "epoch": 0, "step": 10})
                                                + "\n" + json.dumps({"event": "end", "time": 2.0}) + "\n")
    assert run_dir.finished(failed_after) == "" and run_dir.resumable(str(failed_after), tmp_path)
    for folder in (failed_after, a_run(tmp_path / "unsaved", checkpoint=False),
                   a_run(tmp_path / "remote", checkpoint=False, rank0_local=False)):
        run_dir.mark_ended(folder, [{"event": "log"}, {"event": "end", "step": 10, "seconds": 1.0}])
        with pytest.raises(run_dir.Finished, match="trained to its end"):
            run_dir.resumable(str(folder), tmp_path)
    assert run_dir.finished(failed_after) == "1 epoch, step 10" and run_dir.finished(tmp_path / "remote") == "step 10"
    (failed_after / "checkpoints" / "step-000000011.pt").write_bytes(b"")
    assert run_dir.finished(failed_after) == "", "a checkpoint past the end: the rank side says what is left"
    run_dir.write_launch(failed_after, ["local"], True, "", "", [], [], {})  # --run-dir reused, or a resume
    assert run_dir.finished(failed_after) == "", "a launch under way: the earlier run's end is past"
    with pytest.raises(run_dir.Finished, match=re.escape("start a new run (--epochs for how long)")):
        run_dir.resumable(str(tmp_path / "unsaved"), tmp_path)  # the recipe's
    script = tmp_path / "script"  # a script's: --epochs is the recipe's (refused with --script)
    run_dir.write_launch(script, ["local"], True, "/w/train.py", "", [], ["--epochs", "3"], {})
    run_dir.mark_ended(script, [{"event": "end", "step": 10}])
    with pytest.raises(run_dir.Finished, match=re.escape("start a new run (invoke train --script /w/train.py, the "
                                                         "script's own option for how long after --)")):
        run_dir.resumable(str(script), tmp_path)
    run_dir.mark_ended(tmp_path / "nothing", [{"event": "end", "step": 1}])
    assert not (tmp_path / "nothing").exists(), "no run directory: no marker"


def test_a_new_run_goes_only_where_no_earlier_run_trained(tmp_path):
    """A folder whose run trained (metrics with epochs or logs, no checkpoint left) or trained to
    its end is refused, saying how to go on: the new run's metrics would run on from the old
    run's and invoke report drew both as one. A run that stopped before training leaves start
    records and live lines only: the new run starts them anew. A file where the folder goes, or
    above it, is named."""
    def folder_with(name, *records):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        return folder

    start = {"event": "start", "time": 1.0, "ranks": 2}
    trained = folder_with("trained", start, {"event": "epoch", "time": 2.0, "epoch": 0})
    with pytest.raises(ConfigError, match=re.escape(f"--run-dir {trained} holds an earlier run that trained (metrics"
                                                    ".jsonl, progress.jsonl) and kept no checkpoint to resume from: "
                                                    f"give the new run its own folder (or delete {trained} first; a "
                                                    "script that resumes itself from a file here: launch it into a "
                                                    "new --run-dir, pointing it at that file)")):
        run_dir.fresh(trained)
    looped = folder_with("looped", start)  # a loop of its own that never called job.log: its live lines only
    (looped / "progress.jsonl").write_text('{"at": 1.0, "progress": {"step": 4, "loss": 2.5}}\n')
    with pytest.raises(ConfigError, match="holds an earlier run that trained"):
        run_dir.fresh(looped)
    ended = a_run(tmp_path / "ended", checkpoint=False)
    (ended / "ended.json").write_text('{"step": 12}')
    with pytest.raises(ConfigError, match=re.escape(f"--run-dir {ended} holds a run that trained to its end "
                                                    "(step 12)")):
        run_dir.fresh(ended)
    stopped = folder_with("stopped", start)
    (stopped / "rank-0.log").write_text("Traceback ...\n")
    run_dir.fresh(stopped)
    run_dir.write_launch(stopped, ["local"], True, "", "", [], [], {"seed": 1}, checked=True)
    assert sorted(p.name for p in stopped.iterdir()) == ["launch.json"], "the stopped run's leftovers went"
    for settings, checked in (({"seed": 1, "resume": True}, True), ({"seed": 1}, False)):
        kept = folder_with(f"kept-{checked}", start)  # a resume's; a new run fresh did not check (rank 0 remote)
        run_dir.write_launch(kept, ["local"], True, "", "", [], [], settings, checked=checked)
        assert (kept / "metrics.jsonl").is_file(), "a resume, or an unchecked folder, keeps the run's metrics"
    (tmp_path / "afile").write_text("")
    with pytest.raises(ConfigError, match=re.escape(f"--run-dir {tmp_path / 'afile'} is a file: name a folder")):
        run_dir.fresh(tmp_path / "afile")
    with pytest.raises(ConfigError, match=re.escape(f"{tmp_path / 'afile'} is a file, not a folder")):
        run_dir.fresh(tmp_path / "afile" / "run")
    with pytest.raises(ConfigError, match=re.escape("--resume " + str(tmp_path / "afile") + ": a file, not a run "
                                                    "directory")):
        run_dir.resumable(str(tmp_path / "afile"), tmp_path)


def test_a_folder_that_cannot_be_written_is_said_before_the_launch(tmp_path):
    """(/sys: no folder can be made there, root or not; a read-only disk says so alike.)"""
    with pytest.raises(ConfigError, match=r"--run-dir /sys/hvdhetero-run: cannot write there \(.+\): name a folder "
                                          "you can write to") as refused:
        run_dir.write_launch("/sys/hvdhetero-run", ["local"], True, "", "", [], [], {})
    assert refused.value.exit_code == 2


def test_resume_of_a_run_that_kept_no_checkpoints_says_why(tmp_path):
    folder = tmp_path / "r"
    run_dir.write_launch(folder, ["local"], True, "", "", [], [], {"keep_checkpoints": 0})
    with pytest.raises(ConfigError, match=re.escape("(it kept none: --keep-checkpoints 0); start it again")):
        run_dir.resumable(str(folder), tmp_path)
    from hvdhetero.cluster import supervise

    assert supervise.resume_hint(folder) == (f"\n  the run keeps no checkpoint (--keep-checkpoints 0; run directory "
                                             f"{folder}): a new run starts from the beginning")
