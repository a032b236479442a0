"""The workdir of `invoke train --script`: which files ship, their digest, and the copy's
commands. The pure parts run on folders in tmp_path; copying to real hosts is in test_multihost."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hvdhetero.cluster import launch, workdir
from hvdhetero.cluster.inventory import Host, Inventory, Pins
from hvdhetero.errors import ConfigError, LaunchError

PINS = Pins(python="3.11", torch="2.9.1", torchvision="0.24.1", horovod="0.28.1")


def inventory(*hosts: Host) -> Inventory:
    return Inventory(path=Path("/x/inventory.yaml"), pins=PINS, hosts=hosts,
                     default_hosts=tuple(h.name for h in hosts), known_hosts="/x/known_hosts")


def project(root: Path) -> Path:
    """A small script folder with the clutter a real one has."""
    (root / "models").mkdir(parents=True)
    (root / "train.py").write_text("print('train')\n")
    (root / "models" / "net.py").write_text("NET = 1\n")
    (root / "run.sh").write_text("#!/bin/sh\n")
    (root / "run.sh").chmod(0o755)
    for junk in ("__pycache__/train.cpython-311.pyc", ".git/HEAD", "runs/1/model.pt", ".venv/bin/python",
                 "venv/x", ".pytest_cache/v", "models/old.pyc"):
        (root / junk).parent.mkdir(parents=True, exist_ok=True)
        (root / junk).write_text("not shipped")
    return root


def names(folder: Path) -> list[str]:
    return [p.as_posix() for p in workdir.files(folder)]


def test_files_are_the_folder_without_caches_git_envs_and_runs(tmp_path):
    assert names(project(tmp_path / "p")) == ["models/net.py", "run.sh", "train.py"]


def test_digest_is_stable_and_ignores_mtimes(tmp_path):
    folder = project(tmp_path / "p")
    first = workdir.digest(folder)
    assert re.fullmatch(r"[0-9a-f]{16}", first)
    os.utime(folder / "train.py", (1_000_000, 1_000_000))
    assert workdir.digest(folder) == first
    shutil.copytree(folder, tmp_path / "elsewhere")  # fresh mtimes, another path
    assert workdir.digest(tmp_path / "elsewhere") == first


@pytest.mark.parametrize("change", [
    lambda p: (p / "train.py").write_text("print('changed')\n"),
    lambda p: (p / "train.py").rename(p / "main.py"),
    lambda p: (p / "models" / "net.py").chmod(0o755),
    lambda p: (p / "run.sh").chmod(0o644),
    lambda p: (p / "notes.txt").write_text(""),
], ids=["content", "name", "executable-bit-set", "executable-bit-cleared", "new-empty-file"])
def test_digest_changes_with_what_ships(tmp_path, change):
    folder = project(tmp_path / "p")
    before = workdir.digest(folder)
    change(folder)
    assert workdir.digest(folder) != before


def test_ignored_files_do_not_change_the_digest(tmp_path):
    folder = project(tmp_path / "p")
    before = workdir.digest(folder)
    (folder / "__pycache__" / "net.cpython-311.pyc").write_text("new")
    (folder / ".git" / "index").write_text("new")
    (folder / "runs" / "2").mkdir()
    (folder / "runs" / "2" / "metrics.jsonl").write_text("{}")
    assert workdir.digest(folder) == before


def test_hvdheteroignore_globs_match_the_path_or_any_component(tmp_path):
    folder = project(tmp_path / "p")
    (folder / "data" / "mnist").mkdir(parents=True)
    (folder / "data" / "mnist" / "train.idx").write_text("big")
    (folder / "models" / "ckpt.pt").write_text("big")
    (folder / "models" / "keep.pt").write_text("small")
    (folder / "wandb" / "run").mkdir(parents=True)
    (folder / "wandb" / "run" / "log").write_text("")
    (folder / ".hvdheteroignore").write_text("# big things\ndata/\n\nmodels/ckpt*\n  wandb  \n")
    assert names(folder) == [".hvdheteroignore", "models/keep.pt", "models/net.py", "run.sh", "train.py"]


def test_a_symlink_inside_the_folder_ships_as_what_it_points_to(tmp_path):
    folder = project(tmp_path / "p")
    (folder / "latest.py").symlink_to("train.py")
    (folder / "nets").symlink_to("models", target_is_directory=True)
    assert names(folder) == ["latest.py", "models/net.py", "nets/net.py", "run.sh", "train.py"]


def test_a_symlink_out_of_the_folder_is_refused_naming_it_and_the_fix(tmp_path):
    folder = project(tmp_path / "p")
    (tmp_path / "datasets").mkdir()
    (folder / "data").symlink_to(tmp_path / "datasets")
    root = re.escape(str(folder.resolve()))
    with pytest.raises(ConfigError, match=(
            f"^{root}: data is a symlink to {re.escape(str((tmp_path / 'datasets').resolve()))}, outside the "
            f"folder, so the hosts would not get it; copy what it points to into the folder, or list data in "
            rf"{root}/\.hvdheteroignore \(datasets belong on each host: invoke push-data --src DIR\)$")) as err:
        workdir.digest(folder)
    assert err.value.exit_code == 2
    (folder / ".hvdheteroignore").write_text("data\n")  # the fix the message names
    assert names(folder) == [".hvdheteroignore", "models/net.py", "run.sh", "train.py"]


def test_a_dangling_symlink_is_refused(tmp_path):
    folder = project(tmp_path / "p")
    (folder / "gone.py").symlink_to("nowhere.py")
    with pytest.raises(ConfigError, match=r": gone\.py is a symlink to nowhere\.py, which does not exist; remove it"):
        workdir.files(folder)


def test_a_symlink_loop_is_refused(tmp_path):
    folder = project(tmp_path / "p")
    (folder / "models" / "up").symlink_to("..", target_is_directory=True)
    with pytest.raises(ConfigError, match=r": models/up is a symlink back to .*, a loop; remove it"):
        workdir.files(folder)


def test_a_folder_over_the_size_limit_is_refused_naming_the_size_and_the_way_out(tmp_path, monkeypatch):
    folder = project(tmp_path / "p")
    (folder / "data").mkdir()
    (folder / "data" / "blob").write_bytes(b"x" * 3_000_000)
    monkeypatch.setattr(workdir, "MAX_BYTES", 2_000_000)
    root = re.escape(str(folder.resolve()))
    with pytest.raises(ConfigError, match=(
            rf"^{root}: too big to ship to every host: 3\.0 MB in \d files so far, over the limit of 2\.0 MB or "
            rf"20000 files \(largest: data 3\.0 MB, .*\)\. List what the ranks do not need in "
            rf"{root}/\.hvdheteroignore \(one glob per line\), or pass --workdir a smaller folder; datasets "
            r"belong on each host: invoke push-data --src DIR$")) as err:
        workdir.digest(folder)
    assert err.value.exit_code == 2


def test_a_folder_over_the_file_limit_is_refused(tmp_path, monkeypatch):
    folder = project(tmp_path / "p")
    monkeypatch.setattr(workdir, "MAX_FILES", 2)
    with pytest.raises(ConfigError, match=r"too big to ship to every host: 0\.0 MB in 3 files so far, over the "
                                          r"limit of 200\.0 MB or 2 files \(largest: "):
        workdir.digest(folder)


def test_remote_dir_is_named_by_the_digest_under_each_hosts_home():
    assert workdir.remote_dir("0123456789abcdef") == ".hvdhetero/workdirs/0123456789abcdef"


def test_ship_to_local_hosts_only_contacts_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(workdir.ssh, "connect", lambda *a, **k: pytest.fail("contacted a host"))
    here = Host(name="local", address="localhost", slots=2)
    # not even read: the local ranks start in the folder itself
    assert workdir.ship(inventory(here), [here], tmp_path / "no such folder") == {}


def test_every_host_that_cannot_be_reached_is_named_in_one_error(tmp_path):
    """Loopback addresses with nothing listening: refused at once, no network needed."""
    with socket.socket() as s:
        s.bind(("127.0.0.2", 0))
        port = s.getsockname()[1]
    hosts = [Host(name="a", address="127.0.0.2", port=port), Host(name="b", address="127.0.0.3", port=port)]
    folder = project(tmp_path / "p")
    with pytest.raises(LaunchError) as err:
        workdir.ship(inventory(*hosts), hosts, folder)
    assert str(err.value).splitlines() == [
        f"could not ship the workdir {folder.resolve()} to a, b:",
        f"  a (127.0.0.2:{port}): cannot connect: Unable to connect to port {port} on 127.0.0.2; is it on, and is "
        "sshd listening?",
        f"  b (127.0.0.3:{port}): cannot connect: Unable to connect to port {port} on 127.0.0.3; is it on, and is "
        "sshd listening?",
    ]


def test_the_copy_is_sync_commands_rsync_limited_to_the_hashed_files():
    pc = Host(name="pc", address="192.168.1.20", user="me", port=2222, identity="/k/id_ed25519")
    inv = inventory(pc)
    argv = workdir.copy_command(inv, pc, Path("/home/me/proj"), Path("/tmp/list"), ".hvdhetero/workdirs/x.tmp-1")
    sync = launch.push_command(inv, pc, "/home/me/proj", ".hvdhetero/workdirs/x.tmp-1/")
    assert argv == ["rsync", "--files-from=/tmp/list", "--from0", "--copy-links", *sync[1:]]
    assert argv[-2:] == ["/home/me/proj/", "me@192.168.1.20:.hvdhetero/workdirs/x.tmp-1/"]
    assert "-o StrictHostKeyChecking=yes" in argv[argv.index("-e") + 1]


@pytest.mark.skipif(shutil.which("rsync") is None, reason="needs rsync (ci/setup installs it)")
def test_the_copy_ships_exactly_what_was_hashed(tmp_path):
    """The copy's rsync flags, run to a local folder (rsync ignores -e there): the copy holds
    the listed files, a symlink as what it points to, and has the same digest."""
    folder = project(tmp_path / "p")
    (folder / "latest.py").symlink_to("train.py")
    listing = tmp_path / "list"
    listing.write_bytes(b"".join(os.fsencode(p.as_posix()) + b"\0" for p in workdir.files(folder)))
    pc = Host(name="pc", address="192.168.1.20")
    argv = workdir.copy_command(inventory(pc), pc, folder, listing, "unused")
    subprocess.run([*argv[:-1], str(tmp_path / "copy")], check=True, timeout=60)
    assert names(tmp_path / "copy") == names(folder)
    assert not (tmp_path / "copy" / "latest.py").is_symlink()
    assert workdir.digest(tmp_path / "copy") == workdir.digest(folder)


def test_a_one_file_folder_is_copied_into_a_folder(tmp_path):
    """rsync copies a lone listed file *as* a destination without a trailing slash: the copy
    command always names a directory."""
    folder = tmp_path / "p"
    folder.mkdir()
    (folder / "train.py").write_text("print('hi')\n")
    listing = tmp_path / "list"
    listing.write_bytes(b"train.py\0")
    pc = Host(name="pc", address="192.168.1.20")
    argv = workdir.copy_command(inventory(pc), pc, folder, listing, ".hvdhetero/workdirs/x.tmp-1")
    assert argv[-1] == "192.168.1.20:.hvdhetero/workdirs/x.tmp-1/"
    subprocess.run([*argv[:-1], str(tmp_path / "copy") + "/"], check=True, timeout=60)
    assert (tmp_path / "copy" / "train.py").read_text() == "print('hi')\n"


def finalize(home: Path, tmp: str, final: str) -> None:
    subprocess.run([sys.executable, "-c", workdir.FINALIZE_PY, tmp, final, workdir.MARKER], cwd=home,
                   check=True, timeout=60)


def test_a_copy_appears_whole_under_its_name_and_a_second_one_is_dropped(tmp_path):
    """Two launchers (or two test hosts sharing a home) may copy the same digest at once."""
    final = workdir.remote_dir("0123456789abcdef")
    for n in (1, 2):
        (tmp_path / f"{final}.tmp-{n}").mkdir(parents=True)
        (tmp_path / f"{final}.tmp-{n}" / "train.py").write_text(f"copy {n}")
    finalize(tmp_path, f"{final}.tmp-1", final)
    finalize(tmp_path, f"{final}.tmp-2", final)
    assert sorted(p.name for p in (tmp_path / final).iterdir()) == [workdir.MARKER, "train.py"]
    assert (tmp_path / final / "train.py").read_text() == "copy 1"
    assert [p.name for p in (tmp_path / workdir.WORKDIRS).iterdir()] == ["0123456789abcdef"]


def test_a_copy_without_its_marker_is_replaced(tmp_path):
    final = workdir.remote_dir("0123456789abcdef")
    (tmp_path / final).mkdir(parents=True)
    (tmp_path / final / "half.py").write_text("interrupted")
    (tmp_path / f"{final}.tmp-1").mkdir()
    (tmp_path / f"{final}.tmp-1" / "train.py").write_text("whole")
    finalize(tmp_path, f"{final}.tmp-1", final)
    assert sorted(p.name for p in (tmp_path / final).iterdir()) == [workdir.MARKER, "train.py"]
    assert [p.name for p in (tmp_path / workdir.WORKDIRS).iterdir()] == ["0123456789abcdef"]
