"""Starting a job from the launcher (cluster/submit.py), without starting one: a dry run prints
the command and leaves nothing behind, bad requests are refused before anything starts, and
--resume's request is the run's own."""

from __future__ import annotations

import json
import re

import pytest

from conftest import ROOT
from hvdhetero.cluster import submit
from hvdhetero.errors import ConfigError
from hvdhetero.recipes.options import check_argv
from test_run_dir import a_run


@pytest.fixture(autouse=True)
def _in_checkout(monkeypatch):
    monkeypatch.chdir(ROOT)  # the default inventory.yaml, as invoke finds it
    monkeypatch.delenv("HVDHETERO_INVENTORY", raising=False)


def test_a_dry_run_prints_the_command_and_leaves_nothing_behind(tmp_path, capsys):
    request = submit.Request(None, None, {"seed": 5}, recipe=["--dataset", "digits"], script_args=["--repeat", "2"])
    run_dir, results = submit.submit(request, tmp_path, name="digits", recipe_check=check_argv, dry_run=True)
    out = capsys.readouterr().out
    assert results == [] and run_dir.startswith(str(tmp_path)) and run_dir.endswith("-digits")
    assert "horovodrun" in out and "--repeat 2" in out and '"seed": 5' in out.replace("\\", ""), out
    assert list(tmp_path.iterdir()) == [], "a dry run writes no run directory"


def test_a_workdir_without_a_script_is_refused_before_anything_starts(tmp_path):
    with pytest.raises(ConfigError, match="--workdir elsewhere goes with --script"):
        submit.submit(submit.Request(None, None, {}, workdir="elsewhere"), tmp_path, name="x", dry_run=True)
    assert list(tmp_path.iterdir()) == []


def test_recipe_options_after_the_separator_are_checked_on_the_launcher(tmp_path):
    with pytest.raises(ConfigError, match="--model"):
        submit.submit(submit.Request(None, None, {}, script_args=["--model", "nope"]), tmp_path, name="x",
                      recipe_check=check_argv, dry_run=True)


def test_resume_takes_the_runs_own_request_and_only_the_hosts_may_change(tmp_path):
    folder = a_run(tmp_path / "r")
    request, run_dir = submit.resumed(str(folder), tmp_path, hosts=None, inventory=None, changed=[])
    assert run_dir == str(folder)
    assert (request.hosts, request.recipe, request.script_args) == (["local"], ["--dataset", "digits"],
                                                                    ["--repeat", "2"])
    assert request.settings == {"seed": 3, "resume": True}
    assert submit.resumed(str(folder), tmp_path, hosts="h1", inventory=None, changed=[])[0].hosts == "h1"
    with pytest.raises(ConfigError, match="only --hosts, --inventory and --launcher may change, got --epochs, --seed"):
        submit.resumed(str(folder), tmp_path, hosts=None, inventory=None, changed=["--epochs", "--seed"])


def test_resume_takes_the_launcher_the_run_was_started_with_unless_another_is_given(tmp_path):
    """A run started with --launcher ray printed `resume with: invoke train --resume RUN_DIR`, and
    that command relaunched it with horovodrun, another engine, without a word."""
    from hvdhetero.cluster import run_dir

    run_dir.write_launch(tmp_path / "r", ["local"], True, "", "", [], [], {}, launcher="ray")
    (tmp_path / "r" / "checkpoints").mkdir()
    (tmp_path / "r" / "checkpoints" / "step-00000010.pt").write_bytes(b"")
    assert submit.resumed(str(tmp_path / "r"), tmp_path, None, None, [])[0].launcher == "ray"
    assert submit.resumed(str(tmp_path / "r"), tmp_path, None, None, [], launcher="horovodrun")[0].launcher == \
        "horovodrun"
    old = a_run(tmp_path / "old")  # a launch.json from before it was recorded: horovodrun's
    (old / "launch.json").write_text((old / "launch.json").read_text().replace('"launcher": "horovodrun"', '"x": 0'))
    assert "launcher" not in (old / "launch.json").read_text()
    assert submit.resumed(str(old), tmp_path, None, None, [])[0].launcher == "horovodrun"


def test_resume_takes_the_inventory_the_run_was_started_with_unless_another_is_given(tmp_path):
    """A run started with --inventory gpu.yaml resumes on its hosts: the default inventory.yaml
    has no host of that name (found on the GPU machine, issue 32)."""
    from hvdhetero.cluster import run_dir

    mine = tmp_path / "gpu.yaml"
    run_dir.write_launch(tmp_path / "r", ["gpu"], True, "", "", [], [], {}, inventory=str(mine))
    (tmp_path / "r" / "checkpoints").mkdir()
    (tmp_path / "r" / "checkpoints" / "step-00000010.pt").write_bytes(b"")
    assert submit.resumed(str(tmp_path / "r"), tmp_path, None, None, [])[0].inventory == str(mine)
    assert submit.resumed(str(tmp_path / "r"), tmp_path, None, "other.yaml", [])[0].inventory == "other.yaml"
    old = a_run(tmp_path / "old")  # a launch.json from before it was recorded: the default inventory
    (old / "launch.json").write_text((old / "launch.json").read_text().replace('"inventory": ""', '"x": 0'))
    assert submit.resumed(str(old), tmp_path, None, None, [])[0].inventory is None


def test_a_new_run_into_a_folder_with_an_earlier_runs_checkpoints_is_refused(tmp_path):
    """Its checkpoints would sit among the old run's, and its --resume would load the newest: the old run's."""
    folder = a_run(tmp_path / "r")
    request = submit.Request(None, None, {}, recipe=["--dataset", "digits"])
    with pytest.raises(ConfigError) as refused:
        submit.submit(request, tmp_path, str(folder), name="digits", recipe_check=check_argv, dry_run=True)
    said = str(refused.value)
    assert refused.value.exit_code == 2
    assert f"--run-dir {folder} holds an earlier run's checkpoints (newest step-00000010.pt, step 10)" in said
    assert f"invoke train --resume {folder}" in said and "its own folder" in said
    resumed, run_dir = submit.resumed(str(folder), tmp_path, hosts=None, inventory=None, changed=[])
    assert submit.submit(resumed, tmp_path, run_dir, name="digits", recipe_check=check_argv, dry_run=True)[0] == \
        str(folder), "--resume goes into it"
    (folder / "checkpoints" / "step-00000010.pt").unlink()
    assert submit.submit(request, tmp_path, str(folder), name="digits", recipe_check=check_argv,
                         dry_run=True)[0] == str(folder), "a folder without checkpoints takes a new run"


def test_resume_of_a_run_whose_script_moved_says_where_it_was_and_what_to_do(tmp_path):
    folder = a_run(tmp_path / "r")
    launched = json.loads((folder / "launch.json").read_text())
    (folder / "launch.json").write_text(json.dumps({**launched, "script": str(tmp_path / "gone.py")}))
    with pytest.raises(ConfigError, match=re.escape(f"the run's script {tmp_path / 'gone.py'} (its launch.json) is not "
                                                    "there any more: put it back")):
        submit.resumed(str(folder), tmp_path, hosts=None, inventory=None, changed=[])
