"""The horovodrun command as data: argv and env for the inventory's hosts."""

import json
from pathlib import Path

import pytest

from hvdhetero.cluster import inventory as inv
from hvdhetero.cluster import launch
from hvdhetero.config import TrainConfig
from hvdhetero.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


def test_local_command_is_two_cpu_ranks_over_gloo():
    inventory = inv.load(ROOT / "inventory.yaml")
    options = TrainConfig(epochs=3, run_dir="/tmp/run")
    argv, env = launch.command(inventory, inventory.select(None), options,
                               launcher_python="/opt/venv/bin/python")
    assert argv == [
        "/opt/venv/bin/horovodrun", "-np", "2", "-H", "localhost:2", "--gloo",
        "--start-timeout", "120", "--gloo-timeout-seconds", "120",
        str(ROOT / ".venv" / "bin" / "python"), "-m", "hvdhetero.recipes.train",
        "--dataset", "digits", "--epochs", "3", "--batch-size", "64", "--lr", "0.001",
        "--optimizer", "adam", "--seed", "0", "--data-dir", "data", "--no-download", "--run-dir", "/tmp/run",
        "--compression", "none", "--overlap", "--no-equal-split", "--slowdown", "1.0", "--micro-batch", "auto",
        "--hosts-json", json.dumps({"localhost": {"device": "cpu", "interface": None, "max_batch": None,
                                                  "slowdown": 1.0}}, sort_keys=True),
    ]
    assert env == {"PYTHONUNBUFFERED": "1", "PYTORCH_ENABLE_MPS_FALLBACK": "1",
                   "HOROVOD_STALL_CHECK_TIME_SECONDS": "60", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "120"}


def test_flags_round_trip_into_the_rank_config():
    from hvdhetero.recipes.train import parse_args  # the rank parses exactly what the launcher wrote

    options = TrainConfig(dataset="mnist", model="cnn", epochs=2, batch_size=96, lr=0.05,
                                  optimizer="sgd", download=True, run_dir="r", compression="fp16")
    cfg = parse_args(options.flags() + ["--hosts-json", '{"a": {"device": "mps"}}'])
    assert (cfg.dataset, cfg.model, cfg.epochs, cfg.batch_size, cfg.lr, cfg.optimizer, cfg.download,
            cfg.run_dir, cfg.compression) == ("mnist", "cnn", 2, 96, 0.05, "sgd", True, "r", "fp16")
    assert cfg.hosts == {"a": {"device": "mps"}}


def test_printable_command_quotes_every_word():
    line = launch.printable(["horovodrun", "--hosts-json", '{"a": 1}'], {"X": "a b"})
    assert line == "X='a b' horovodrun --hosts-json '{\"a\": 1}'"


def _two_hosts(tmp_path, first="localhost", env_b="~/env"):
    path = tmp_path / "inventory.yaml"
    path.write_text(f"""pins: {{python: "3.11", torch: "2.14.1", torchvision: "0.29.1", horovod: "0.28.1"}}
default_hosts: [a]
hosts:
  a: {{address: {first}, env: ~/env}}
  b: {{address: 10.0.0.2, env: {env_b}}}
""")
    return inv.load(path)


def test_local_host_cannot_join_a_multi_host_job(tmp_path):
    inventory = _two_hosts(tmp_path)
    with pytest.raises(ConfigError, match="host 'a' is this machine .*LAN address"):
        launch.command(inventory, inventory.select("a,b"), TrainConfig())


def test_hosts_with_different_env_paths_are_refused(tmp_path):
    inventory = _two_hosts(tmp_path, first="10.0.0.1", env_b="/opt/other")
    with pytest.raises(ConfigError, match="give them the same `env` path"):
        launch.command(inventory, inventory.select("a,b"), TrainConfig())


def test_sync_command_checks_host_keys_and_quotes_paths(tmp_path):
    path = tmp_path / "inventory.yaml"
    path.write_text("""pins: {python: "3.11", torch: "2.14.1", torchvision: "0.29.1", horovod: "0.28.1"}
known_hosts: /k/known_hosts
default_hosts: [pc]
hosts:
  pc: {address: 192.168.1.20, user: alice, port: 2222, identity: /k/id}
""")
    inventory = inv.load(path)
    argv = launch.sync_command(inventory, inventory.host("pc"), "data dir/", "~/data")
    assert argv[:4] == ["rsync", "-a", "--protect-args", "--timeout=60"]
    assert argv[-2:] == ["data dir/", "alice@192.168.1.20:~/data"]
    ssh = argv[argv.index("-e") + 1]
    assert ssh.startswith("ssh -p 2222 -o BatchMode=yes") and "-o StrictHostKeyChecking=yes" in ssh
    assert "-o UserKnownHostsFile=/k/known_hosts" in ssh and ssh.endswith("-i /k/id")
