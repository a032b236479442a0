"""Ray as the cluster, on this machine: a real Ray head started by `invoke ray up` on the inventory's
`local` host (Ray installed into .venv by the same provisioning code as ci/setup, from pins.ray),
`invoke train --launcher ray` through it (the built-in recipe, a user's script, the same digests
as horovodrun), a rank's actor killed, and `invoke ray down` leaving nothing. The two-host
cluster on the namespaced test hosts is tests/test_ray_hosts.py. The command lists (the macOS
flag among them) are unit-tested at the end."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import ROOT, VENV_BIN, run_cmd
from hvdhetero import metrics
from hvdhetero.bench.recovery import job_pids
from hvdhetero.cluster import inventory as inv
from hvdhetero.cluster import ray_cluster, ray_node
from hvdhetero.config import JobConfig
from hvdhetero.errors import ConfigError
from hvdhetero.rank import checkpoint

RAY = "2.60.0"


def ray_inventory(path: Path, ray: str | None = RAY, env: Path = VENV_BIN.parent) -> Path:
    """The default inventory's `local` host (two CPU ranks), with pins.ray."""
    path.write_text('pins:\n  python: "3.11"\n  torch: "2.14.1"\n  torchvision: "0.29.1"\n  horovod: "0.28.1"\n'
                    + (f'  ray: "{ray}"\n' if ray else "") + "default_hosts: [local]\nhosts:\n  local:\n"
                    f"    address: localhost\n    device: cpu\n    slots: 2\n    env: {env}\n")
    return path


def ray_invoke(*args, inventory, timeout=600, check=True):
    return run_cmd([VENV_BIN / "invoke", *args[:1], "--inventory", inventory, *args[1:]], timeout=timeout,
                   check=check)


def test_train_through_ray_with_no_cluster_says_how_to_start_one(tmp_path):
    """No node on the host (the module's cluster is not used here): one message, exit 1."""
    inventory = ray_inventory(tmp_path / "inventory.yaml")
    state = ray_node.status("local")
    if state.get("up"):
        pytest.skip("a Ray node of hvdhetero's runs on `local` (this module's cluster)")
    proc = ray_invoke("train", "--launcher", "ray", "--run-dir", tmp_path / "run", inventory=inventory, check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "no Ray node of hvdhetero's is running on local" in proc.stdout + proc.stderr
    assert "invoke ray up --hosts local" in proc.stdout + proc.stderr
    # and nothing that reads as a failed training (it said "training failed" and "start the run again")
    assert "training failed" not in proc.stderr and "no checkpoint was written" not in proc.stderr, proc.stderr
    assert "error: the job did not start: its launcher refused it, saying why above" in proc.stderr, proc.stderr


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Ray in .venv (provision --local with pins.ray: what ci/setup runs), a head on `local`;
    stopped at the end, and nothing of it may be left."""
    inventory = ray_inventory(tmp_path_factory.mktemp("ray") / "inventory.yaml")
    setup = run_cmd([VENV_BIN / "python", "-m", "hvdhetero.cluster.provision", "--local", "--inventory", inventory],
                    timeout=1200, env={"PYTHONPATH": str(ROOT)})
    assert re.search(rf"^ray: (installing ray=={RAY}|{RAY} matches the pin)", setup.stdout, re.M), setup.stdout
    up = ray_invoke("ray", "up", inventory=inventory)
    match = re.search(r"^local: (started in [\d.]+ s|already up) \(head, cluster (\S+), session (\d+)\)$",
                      up.stdout, re.M)
    assert match, up.stdout + up.stderr
    sid = int(match.group(3))
    try:
        yield inventory, sid
    finally:
        down = ray_invoke("ray", "down", inventory=inventory, check=False)
        assert down.returncode == 0 and re.search(r"^local: stopped", down.stdout, re.M), down.stdout + down.stderr
        assert ray_node.session_pids(sid) == [], "processes of the Ray node are left after invoke ray down"


def test_ray_status_says_what_runs_where(cluster):
    inventory, sid = cluster
    status = ray_invoke("ray", "status", inventory=inventory)
    assert re.search(rf"^local: up, \d+ processes \(head, cluster \S+:{ray_node.PORT}, session {sid}\)$",
                     status.stdout, re.M), status.stdout
    again = ray_invoke("ray", "up", inventory=inventory)  # idempotent: the running node is kept
    assert re.search(rf"^local: already up \(head, .* session {sid}\)$", again.stdout, re.M), again.stdout


def test_digits_through_ray_ends_where_horovodrun_does(cluster, tmp_path):
    """Equal split and a fixed seed: the same job through horovodrun and through Ray's actors
    ends with identical parameters (what starts the ranks must not change what they compute)."""
    inventory, _ = cluster
    ends = {}
    for launcher in ("ray", "horovodrun"):
        run_dir = tmp_path / launcher
        proc = ray_invoke("train", "--launcher", launcher, "--epochs", "4", "--equal-split", "--run-dir", run_dir,
                          inventory=inventory)
        assert "Traceback" not in proc.stdout + proc.stderr
        ends[launcher] = metrics.records(run_dir / "metrics.jsonl")[-1]
    # (>= 95% through Ray: tests/test_ray_hosts.py, across the two hosts)
    assert ends["ray"]["test_accuracy"] >= 0.85, ends["ray"]
    assert len(set(ends["ray"]["param_digests"])) == 1
    assert ends["ray"]["param_digests"] == ends["horovodrun"]["param_digests"]
    assert metrics.records(tmp_path / "ray" / "metrics.jsonl")[0]["ranks"] == 2


def test_the_dry_run_prints_the_driver_with_each_ranks_command(cluster, tmp_path):
    """(A user's script through Ray trains in tests/test_ray_hosts.py, across the two hosts.)"""
    inventory, _ = cluster
    dry = ray_invoke("train", "--launcher", "ray", "--script", ROOT / "tests/scripts/user_train.py", "--dry-run",
                     inventory=inventory)
    assert "-m hvdhetero.cluster.ray_driver --plan" in dry.stdout and "hvdhetero.rank.runner" in dry.stdout
    assert "user_train.py" in dry.stdout and not (tmp_path / "run").exists()


def test_killing_a_ranks_actor_ends_the_job_in_words_within_30_s_and_leaves_nothing(cluster, tmp_path):
    inventory, _ = cluster
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([str(VENV_BIN / "invoke"), "train", "--inventory", str(inventory), "--launcher", "ray",
                             "--run-dir", str(run_dir), "--checkpoint-every", "20", "--script",
                             str(ROOT / "tests/scripts/paced_digits.py"), "--", "4", "0.05"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not checkpoint.listed(run_dir) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert checkpoint.listed(run_dir), "the run did not get going"
        rank = job_pids(run_dir)[1]
        actor = int(Path(f"/proc/{rank}/stat").read_text().rsplit(")", 1)[1].split()[1])  # the rank's parent
        assert "RankProcess" in Path(f"/proc/{actor}/cmdline").read_text()
        t0 = time.monotonic()
        os.kill(actor, signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1 and took < 30, (took, out[-3000:])
    assert len(re.findall(r"^error: rank 1 on host local lost its Ray actor", out, re.M)) == 1, out[-3000:]
    assert f"resume with: invoke train --resume {run_dir}" in out and "Traceback" not in out, out[-3000:]
    deadline = time.monotonic() + 15
    while job_pids(run_dir) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert job_pids(run_dir) == {}
    # and the run resumes through Ray from its checkpoint, by the command it printed: its launch.json names Ray
    # (the command went through horovodrun, another engine, without a word)
    dry = ray_invoke("train", "--resume", run_dir, "--dry-run", inventory=inventory)
    assert "-m hvdhetero.cluster.ray_driver --plan" in dry.stdout, dry.stdout[-2000:]
    resumed = ray_invoke("train", "--resume", run_dir, inventory=inventory)
    records = metrics.records(run_dir / "metrics.jsonl")
    assert records[-1]["event"] == "end" and [r["epoch"] for r in records if r["event"] == "epoch"][-1] == 3, \
        resumed.stdout[-2000:]  # epochs count from 0


def test_train_through_ray_is_refused_before_anything_starts_when_it_cannot_work(tmp_path):
    bare = ray_inventory(tmp_path / "bare.yaml", ray=None)
    proc = ray_invoke("train", "--launcher", "ray", "--run-dir", tmp_path / "r1", inventory=bare, check=False)
    assert proc.returncode == 2 and 'add `ray: "2.60.0"` under pins' in proc.stderr, proc.stderr
    pinned = ray_inventory(tmp_path / "ray.yaml")
    proc = ray_invoke("train", "--launcher", "ray", "--elastic", "--run-dir", tmp_path / "r2", inventory=pinned,
                      check=False)
    assert proc.returncode == 2 and "--elastic needs horovodrun" in proc.stderr, proc.stderr
    proc = ray_invoke("train", "--ray-address", "10.0.0.1:6380", "--run-dir", tmp_path / "r3", inventory=pinned,
                      check=False)
    assert proc.returncode == 2 and "--ray-address goes with --launcher ray" in proc.stderr, proc.stderr
    proc = ray_invoke("train", "--launcher", "mpirun", inventory=pinned, check=False)
    assert proc.returncode == 2 and "--launcher must be one of horovodrun, ray" in proc.stderr, proc.stderr
    assert not any((tmp_path / r / "metrics.jsonl").exists() for r in ("r1", "r2", "r3"))


# -- the commands, as data ---------------------------------------------------------------------

def test_ray_start_on_a_mac_sets_rays_macos_cluster_flag_and_on_linux_not():
    mac, mac_env = ray_node.start_command("mac", 1, "/Users/a/hvdhetero/.venv/bin/ray", "Darwin",
                                          address="192.168.1.20:6380")
    assert mac == ["/Users/a/hvdhetero/.venv/bin/ray", "start", "--address", "192.168.1.20:6380", "--num-cpus", "1",
                   "--object-store-memory", "100000000", "--disable-usage-stats", "--include-log-monitor=false",
                   "--temp-dir", "/tmp/hvdhetero-ray-mac", "--labels", "hvd.host=mac"]
    assert mac_env == {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}
    pc, pc_env = ray_node.start_command("pc", 2, "/home/a/.venv/bin/ray", "Linux", head_port=6380)
    assert pc == ["/home/a/.venv/bin/ray", "start", "--head", "--port", "6380", "--num-cpus", "2",
                  "--object-store-memory", "100000000", "--disable-usage-stats", "--include-log-monitor=false",
                  "--temp-dir", "/tmp/hvdhetero-ray-pc", "--labels", "hvd.host=pc", "--include-dashboard=false",
                  "--system-config", json.dumps(ray_node.HEALTH, sort_keys=True)]
    assert pc_env == {"RAY_USAGE_STATS_ENABLED": "0"}
    with pytest.raises(ValueError):
        ray_node.start_command("pc", 1, "ray", "Linux")


def mac_and_pc(tmp_path: Path) -> inv.Inventory:
    key = tmp_path / "id_ed25519"
    key.write_text("not a key\n")
    path = tmp_path / "inventory.yaml"
    path.write_text('pins:\n  python: "3.11"\n  torch: "2.14.1"\n  torchvision: "0.29.1"\n  horovod: "0.28.1"\n'
                    f'  ray: "{RAY}"\ndefault_hosts: [pc, mac]\nhosts:\n'
                    f"  pc:\n    address: 192.168.1.20\n    device: cuda\n    env: /home/a/venv\n    identity: {key}\n"
                    f"  mac:\n    address: 192.168.1.30\n    device: mps\n    user: anna\n    port: 2222\n"
                    f"    env: ~/hvdhetero/.venv\n")
    return inv.load(path)


def test_ray_up_reaches_each_host_over_the_checked_ssh_with_its_own_env(tmp_path):
    inventory = mac_and_pc(tmp_path)
    pc, mac = inventory.select("pc,mac")
    argv = ray_cluster.node_argv(inventory, mac, "up", "--address", "192.168.1.20:6380", "--cpus", "1")
    assert argv[:3] == ["ssh", "-p", "2222"] and "StrictHostKeyChecking=yes" in " ".join(argv)
    assert argv[-2] == "anna@192.168.1.30"
    assert argv[-1] == ("sh -c 'exec \"$HOME\"/hvdhetero/.venv/bin/python \"$@\"' sh -m hvdhetero.cluster.ray_node up "
                        "--name mac --address 192.168.1.20:6380 --cpus 1")
    argv = ray_cluster.node_argv(inventory, pc, "down")
    assert "-i" in argv and argv[-1] == "/home/a/venv/bin/python -m hvdhetero.cluster.ray_node down --name pc"


def test_the_driver_runs_on_the_first_host_and_each_rank_from_its_own_env(tmp_path):
    inventory = mac_and_pc(tmp_path)
    hosts = inventory.select("pc,mac")
    argv, env = ray_cluster.command(inventory, hosts, JobConfig(run_dir=str(tmp_path)), ["--module", "m", "--"])
    assert env == {} and argv[-2] == "192.168.1.20" and argv[-1].endswith(" --watch-stdin")
    plan = json.loads(re.search(r"--plan '(.*)' --watch-stdin$", argv[-1]).group(1))
    assert plan["rendezvous"] == "192.168.1.20" and plan["address"] is None and plan["head_name"] == "pc"
    assert [(r["rank"], r["host"], r["argv"][0]) for r in plan["ranks"]] == [(0, "pc", "/home/a/venv/bin/python"),
                                                                            (1, "mac", "sh")]
    assert plan["ranks"][1]["argv"][2] == 'exec "$HOME"/hvdhetero/.venv/bin/python "$@"'
    assert plan["env"]["HOROVOD_GLOO_TIMEOUT_SECONDS"] and "PATH" not in plan["env"]  # nothing of the launcher's env
    with pytest.raises(ConfigError, match="pins.backend is mpi"):
        ray_cluster.check(replace(inventory, pins=replace(inventory.pins, backend="mpi")), hosts)
    with pytest.raises(ConfigError, match="pins.backend is mpi"):  # not "add ray under pins" first, then this
        ray_cluster.check(replace(inventory, pins=replace(inventory.pins, backend="mpi", ray=None)), hosts)


def test_the_driver_gives_each_slot_horovodruns_variables():
    from hvdhetero.cluster import ray_driver

    plan = {"hosts": [{"name": "pc", "address": "192.168.1.20", "slots": 2},
                      {"name": "mac", "address": "192.168.1.30", "slots": 1}],
            "ranks": [{}, {}, {}], "rendezvous": "192.168.1.20", "env": {"PYTHONUNBUFFERED": "1"}}
    envs, slots = ray_driver.slot_env(plan, 4242)
    assert [(e["HOROVOD_RANK"], e["HOROVOD_LOCAL_RANK"], e["HOROVOD_HOSTNAME"], e["HOROVOD_CROSS_RANK"])
            for e in envs] == [("0", "0", "192.168.1.20", "0"), ("1", "1", "192.168.1.20", "0"),
                               ("2", "0", "192.168.1.30", "1")]
    assert {e["HOROVOD_SIZE"] for e in envs} == {"3"} and envs[2]["HOROVOD_LOCAL_SIZE"] == "1"
    assert {e["HOROVOD_GLOO_RENDEZVOUS_PORT"] for e in envs} == {"4242"}
    assert {e["HOROVOD_CONTROLLER"] for e in envs} == {"gloo"} and envs[0]["PYTHONUNBUFFERED"] == "1"


def test_a_host_missing_from_the_ray_cluster_is_named_with_the_command_that_adds_it():
    from hvdhetero.cluster import ray_driver

    nodes = [{"NodeID": "a" * 56, "Alive": True, "NodeManagerAddress": "192.168.1.20", "Labels": {"hvd.host": "pc"}},
             {"NodeID": "b" * 56, "Alive": False, "NodeManagerAddress": "192.168.1.30", "Labels": {"hvd.host": "mac"}}]
    hosts = [{"name": "pc", "address": "192.168.1.20"}, {"name": "mac", "address": "192.168.1.30"}]
    with pytest.raises(ray_driver.Refused, match=r"host mac has no live node .*pc at 192\.168\.1\.20.*"
                                                 r"invoke ray up --hosts pc,mac"):
        ray_driver.node_ids(nodes, hosts)
    nodes[1]["Alive"] = True
    nodes[1]["Labels"] = {}  # a user's own cluster: found by address
    assert ray_driver.node_ids(nodes, hosts) == {"pc": "a" * 56, "mac": "b" * 56}


def test_a_rank_gets_its_hosts_own_path_and_home_never_the_ray_workers_other_variables():
    from hvdhetero.cluster import ray_rank

    own = {"PATH": "/opt/homebrew/bin:/usr/bin", "HOME": "/Users/anna", "OMP_NUM_THREADS": "1",
           "RAY_RAYLET_PID": "7", "AWS_SECRET_ACCESS_KEY": "x"}
    env = ray_rank.rank_env(own, {"HOROVOD_RANK": "1"})
    assert env == {"PATH": "/opt/homebrew/bin:/usr/bin", "HOME": "/Users/anna", "HOROVOD_RANK": "1"}


def test_a_rank_killed_mid_print_has_its_cut_line_relayed_as_a_line_of_its_own():
    """The actor's rank writes a line, then half of one, and is killed (SIGKILL, as the OOM killer
    does): the driver relays the half line ended, so its exit line after it is read as one (under
    horovodrun a line cut so ran into the next and the rank's SIGKILL went unsaid)."""
    from hvdhetero.cluster import lines, ray_driver, ray_rank, supervise

    rank = ray_rank.RankProcess()  # the class Ray makes the actor of, run here as a plain object
    code = ("import os, signal, sys; sys.stdout.write('first\\na line cut sho'); sys.stdout.flush(); "
            "os.kill(os.getpid(), signal.SIGKILL)")
    rank.start([sys.executable, "-c", code], {"PATH": os.environ["PATH"]}, None)
    said, ended, deadline = [], None, time.monotonic() + 30
    while ended is None and time.monotonic() < deadline:
        got, ended = rank.poll()
        said += got
        time.sleep(0.05)
    said += rank.poll()[0]
    assert ended == -signal.SIGKILL and said == ["first\n", "a line cut sho"], (ended, said)
    relayed = ray_driver.relayed(1, said)
    assert relayed == "[1]<stdout>:first\n[1]<stdout>:a line cut sho\n", relayed
    relayed += f"Process 1 exit with status code {ended}.\n"  # what the driver says next
    read = [part for line in relayed.splitlines(keepends=True) for part in lines.untangled(line)]
    assert read == ["[1]<stdout>:first\n", "[1]<stdout>:a line cut sho\n", "Process 1 exit with status code -9.\n"]
    assert supervise.EXIT_LINE.match(read[-1]).groups() == ("1", "-9")
