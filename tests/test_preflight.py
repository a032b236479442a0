"""`invoke check`'s verdicts from the facts hosts report: pure, no SSH (tests/test_multihost.py
runs the real thing against sshd hosts)."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from conftest import ROOT, VENV_BIN
from hvdhetero.cluster import horovod_build
from hvdhetero.cluster import inventory as inv
from hvdhetero.cluster import launch
from hvdhetero.cluster import preflight
from hvdhetero.cluster import remote_provision
from hvdhetero.cluster.inventory import Host, Inventory, Pins
from hvdhetero.config import JobConfig
from hvdhetero.errors import ConfigError

PINS = Pins(python="3.11", torch="2.14.1", torchvision="0.29.1", horovod="0.28.1", transport="uv")
PATCHES = horovod_build.patch_set_hash(horovod_build.patch_files())
HOSTS = (Host(name="mac", address="10.0.0.2", device="mps"), Host(name="pc", address="10.0.0.3"))
INVENTORY = Inventory(path=Path("/x/inventory.yaml"), pins=PINS, hosts=HOSTS,
                      default_hosts=("mac", "pc"), known_hosts=None)


def facts(transport="uv", patch_set=PATCHES, horovod="0.28.1", packages=None):
    return {"python": "3.11", "torch": "2.14.1", "torchvision": "0.29.1", "hvdhetero": "0.1.0", "digest": "d",
            "horovod": {"horovod": horovod, "patch_set": patch_set, "key": "k", "transport": transport},
            "nics": ["en0", "lo"], "reach": {}, "packages": packages or {}}


def verdicts(mac: dict, pc: dict, pins: Pins = PINS):
    inventory = Inventory(path=INVENTORY.path, pins=pins, hosts=INVENTORY.hosts, default_hosts=("mac", "pc"),
                          known_hosts=None)
    results = [preflight.HostFacts(HOSTS[0], facts=mac), preflight.HostFacts(HOSTS[1], facts=pc)]
    preflight.problems(inventory, results, "d")
    return results


def test_matching_builds_pass_and_the_report_names_the_transport():
    mac, pc = verdicts(facts(), facts())
    assert (mac.status, mac.problems, pc.status, pc.problems) == ("ok", [], "ok", [])
    assert "transport uv" in preflight.report([mac, pc]).splitlines()[0]


def test_a_host_with_the_other_transport_is_named_with_the_fix():
    """Stock Linux Horovod (tcp) cannot talk to a Mac (uv): check says which host to rebuild."""
    mac, pc = verdicts(facts(), facts(transport="tcp"))
    assert mac.problems == [] and pc.status == "failed"
    (problem,) = pc.problems
    assert problem.startswith("pc: Horovod built with Gloo transport tcp, pins.transport is uv (mac has uv)")
    assert "cannot connect; re-provision pc: run: invoke provision --hosts pc" in problem
    assert preflight.exit_code([mac, pc]) == 1


def test_a_host_with_another_patch_set_is_named():
    mac, pc = verdicts(facts(patch_set="0" * 64), facts())
    assert pc.problems == []
    (problem,) = mac.problems
    assert problem.startswith(f"mac: Horovod built with patch set 000000000000, this checkout's is {PATCHES[:12]} "
                              f"(pc has {PATCHES[:12]}); re-provision mac")


def test_tcp_pins_flag_the_uv_hosts():
    tcp = Pins(**{**PINS.__dict__, "transport": "tcp"})
    mac, pc = verdicts(facts(), facts(transport="tcp"), pins=tcp)
    assert pc.problems == [] and "Gloo transport uv, pins.transport is tcp (pc has tcp)" in mac.problems[0]


def test_horovod_version_and_stock_build_are_problems():
    mac, pc = verdicts(facts(horovod="0.28.0"), {**facts(), "horovod": None})
    assert mac.problems[0].startswith("mac: Horovod 0.28.0, pins.horovod is 0.28.1")
    assert pc.problems == ["pc: Horovod there is not our patched build; run: invoke provision --hosts pc"]


PACKAGES = Pins(**{**PINS.__dict__, "packages": ("einops==0.8.1", "sentencepiece==0.2.0")})


def test_matching_packages_pass_and_a_local_build_tag_satisfies_a_bare_pin():
    mac, pc = verdicts(facts(packages={"einops": "0.8.1", "sentencepiece": "0.2.0"}),
                       facts(packages={"einops": "0.8.1+local", "sentencepiece": "0.2.0"}), pins=PACKAGES)
    assert (mac.status, mac.problems, pc.status, pc.problems) == ("ok", [], "ok", [])


def test_a_missing_or_other_package_version_is_named_with_the_fix():
    mac, pc = verdicts(facts(packages={"einops": "0.8.1", "sentencepiece": "0.1.99"}),
                       facts(packages={"einops": None, "sentencepiece": "0.2.0"}), pins=PACKAGES)
    assert mac.problems == ["mac: sentencepiece 0.1.99, expected 0.2.0 (pc has 0.2.0); run: invoke provision --hosts mac"]
    assert pc.problems == ["pc: einops not installed, expected 0.8.1 (mac has 0.8.1); run: invoke provision --hosts pc"]
    assert (mac.status, pc.status, preflight.exit_code([mac, pc])) == ("failed", "failed", 1)
    assert "pc: failed: pc: einops not installed" in preflight.report([mac, pc])


def test_a_package_missing_everywhere_is_named_on_every_host():
    mac, pc = verdicts(facts(packages={"sentencepiece": "0.2.0"}), facts(packages={"sentencepiece": "0.2.0"}),
                       pins=PACKAGES)
    assert mac.problems == ["mac: einops not installed, expected 0.8.1 (pc has none); run: invoke provision --hosts mac"]
    assert pc.problems == ["pc: einops not installed, expected 0.8.1 (mac has none); run: invoke provision --hosts pc"]


def test_the_probe_reports_each_pinned_package_version():
    """The facts script itself, run by this interpreter: the pinned names it is given, found or None."""
    argv = [sys.executable, "-c", preflight.ENV_FACTS_PY, "{}", remote_provision.STAMP,
            json.dumps(["PyYAML", "hvdhetero-no-such-package"])]
    out = json.loads(subprocess.run(argv, capture_output=True, text=True, check=True, timeout=60).stdout)
    assert out["packages"] == {"PyYAML": metadata.version("PyYAML"), "hvdhetero-no-such-package": None}


# --- what check and train both refuse from the inventory alone --------------------------------

TWO_HOSTS = """pins: {{python: "3.11", torch: "2.14.1", torchvision: "0.29.1", horovod: "0.28.1"}}
default_hosts: [a, b]
hosts:
  a: {{address: {a}}}
  b: {{address: 192.0.2.2, {b}}}
"""
# id: (host a's address, host b's extra settings, what the message must say); 192.0.2.0/24 is
# TEST-NET-1, reached by nothing: a connection attempt could only time out.
REFUSED = {
    "env paths differ": ("192.0.2.1", "env: /opt/other", "envs differ (a: .venv, b: /opt/other); give them the "
                                                         "same `env` path"),
    "ssh ports differ": ("192.0.2.1", "port: 2222", "port a: 22, b: 2222"),
    "ssh keys differ": ("192.0.2.1", "identity: {key}", "identity a: None, b: {key}"),
    "one address twice": ("192.0.2.2", "slots: 1", "hosts a, b share an address"),
    "local in a multi-host job": ("localhost", "slots: 1", "host 'a' is this machine"),
}


@pytest.mark.parametrize("address, extra, message", REFUSED.values(), ids=REFUSED.keys())
def test_check_refuses_what_train_refuses_before_connecting(tmp_path, monkeypatch, address, extra, message):
    key = tmp_path / "id_b"
    key.write_text("a key\n")
    path = tmp_path / "inventory.yaml"
    path.write_text(TWO_HOSTS.format(a=address, b=extra.format(key=key)))
    inventory = inv.load(path)
    hosts = inventory.select("a,b")
    with pytest.raises(ConfigError) as train:
        launch.command(inventory, hosts, JobConfig(), launch.recipe([]))
    monkeypatch.setattr(preflight, "gather", lambda *a: pytest.fail("check connected to a host"))
    with pytest.raises(ConfigError) as check:
        preflight.check(inventory, list(hosts))
    assert str(check.value) == str(train.value)
    assert message.format(key=key) in str(check.value) and check.value.exit_code == 2


def test_invoke_check_names_hosts_whose_env_paths_differ(tmp_path):
    """The report: `check` said 'all hosts ready' for them, then `train` refused them."""
    path = tmp_path / "inventory.yaml"
    path.write_text(TWO_HOSTS.format(a="192.0.2.1", b="env: /opt/other"))
    proc = subprocess.run([str(VENV_BIN / "invoke"), "check", "--inventory", str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "envs differ (a: .venv, b: /opt/other)" in proc.stderr
    assert "all hosts ready" not in proc.stdout and "unreachable" not in proc.stdout  # nothing was contacted


def test_invoke_check_on_the_default_inventory_reads_its_local_host_without_ssh(tmp_path):
    """A new user's first `invoke check`: the `local` host (address localhost, which train starts
    without SSH) was asked for an sshd on port 22 and failed, exit 3. Its env is read here, the
    checkout's own (its digest stamp aside); a local env that is missing is named with the fix."""
    proc = subprocess.run([str(VENV_BIN / "invoke"), "check"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("local: ok: Python 3.11, torch ") and "check: all hosts ready" in proc.stdout
    path = tmp_path / "inventory.yaml"  # a copy elsewhere: its relative env is that folder's .venv, none
    path.write_text((ROOT / "inventory.yaml").read_text())
    proc = subprocess.run([str(VENV_BIN / "invoke"), "check", "--inventory", str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"local: failed: {path}: host 'local' has env '.venv', but {tmp_path / '.venv/bin/python'} does not " \
           f"exist; set `env: {ROOT / '.venv'}` for it" in proc.stdout and "sshd" not in proc.stdout, proc.stdout


def test_invoke_provision_sets_up_a_local_host_here_without_ssh():
    """`invoke provision` on the default inventory asked localhost:22 for an sshd and failed, exit
    3, where the local host's env is this checkout's, which ci/setup made: it is checked here."""
    proc = subprocess.run([str(VENV_BIN / "invoke"), "provision"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "local: setup: nothing to change, env is up to date" in proc.stdout and "sshd" not in proc.stdout
    assert proc.stdout.splitlines()[-1].split() == ["local", "ok", "nothing", "changed"], proc.stdout


def test_invoke_check_refuses_a_missing_identity_as_an_inventory_error(tmp_path):
    path = tmp_path / "inventory.yaml"
    path.write_text(TWO_HOSTS.format(a="192.0.2.1", b=f"identity: {tmp_path / 'nokey'}"))
    proc = subprocess.run([str(VENV_BIN / "invoke"), "check", "--inventory", str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"error: {path}:5: key 'hosts.b.identity': {tmp_path / 'nokey'} does not exist" in proc.stderr
    assert proc.stdout == ""  # no host was contacted, none reported


MPI_PINS = Pins(python="3.11", torch="2.14.1", torchvision="0.29.1", horovod="0.28.1", backend="mpi")


def mpi_facts(build_mpi="openmpi-4.1.8", openmpi="4.1.8", mpi4py="4.1.2"):
    f = facts()
    f["horovod"]["mpi"] = build_mpi
    f["mpi"] = {"openmpi": openmpi, "mpi4py": mpi4py}
    return f


def test_backend_mpi_passes_hosts_with_the_mpi_build_and_the_report_names_it():
    mac, pc = verdicts(mpi_facts(), mpi_facts(), pins=MPI_PINS)
    assert (mac.problems, pc.problems) == ([], [])
    assert "transport uv, openmpi-4.1.8)" in preflight.report([mac, pc]).splitlines()[0]


def test_a_host_whose_horovod_lacks_mpi_or_whose_mpi_differs_is_named_with_the_fix():
    mac, pc = verdicts(mpi_facts(), mpi_facts(build_mpi="", openmpi=None, mpi4py=None), pins=MPI_PINS)
    assert mac.problems == [] and pc.status == "failed"
    fix = "run: invoke provision --hosts pc"
    assert pc.problems == [
        f"pc: openmpi not installed, pins.openmpi is 4.1.8 (backend mpi) (mac has 4.1.8); {fix}",
        f"pc: mpi4py not installed, pins.mpi4py is 4.1.2 (backend mpi) (mac has 4.1.2); {fix}",
        f"pc: Horovod built without MPI, pins.backend is mpi with openmpi 4.1.8 (mac has openmpi-4.1.8); "
        f"re-provision pc: {fix}"]
    _, other = verdicts(mpi_facts(), mpi_facts(build_mpi="openmpi-4.1.7", openmpi="4.1.7"), pins=MPI_PINS)
    assert [p.split(";")[0] for p in other.problems] == [
        "pc: openmpi 4.1.7, pins.openmpi is 4.1.8 (backend mpi) (mac has 4.1.8)",
        "pc: Horovod built with openmpi-4.1.7, pins.backend is mpi with openmpi 4.1.8 (mac has openmpi-4.1.8)"]


def test_an_mpi_build_passes_a_gloo_inventory():
    """An MPI build runs Gloo jobs too (horovodrun sets HOROVOD_CONTROLLER=gloo)."""
    mac, pc = verdicts(mpi_facts(), facts())
    assert (mac.problems, pc.problems) == ([], [])


def test_check_under_mpi_accepts_hosts_whose_envs_ports_and_keys_differ(tmp_path, monkeypatch):
    """horovodrun needs one env path, port and key for all hosts; mpirun (our agent) does not."""
    hosts = (Host(name="mac", address="10.0.0.2", env="~/a"), Host(name="pc", address="10.0.0.3", env="/b", port=2222))
    inventory = Inventory(path=tmp_path / "inventory.yaml", pins=MPI_PINS, hosts=hosts, default_hosts=("mac", "pc"))
    monkeypatch.setattr(preflight, "gather", lambda inv_, h, hs, accept_new: preflight.HostFacts(h, facts=mpi_facts()))
    monkeypatch.setattr(remote_provision, "source_digest", lambda: "d")
    results = preflight.check(inventory, list(hosts))
    assert [r.problems for r in results] == [[], []]
    gloo = Inventory(path=tmp_path / "inventory.yaml", pins=PINS, hosts=hosts, default_hosts=("mac", "pc"))
    with pytest.raises(ConfigError, match="hosts' envs differ"):
        preflight.check(gloo, list(hosts))


def test_with_pins_ray_a_host_without_that_ray_is_named_with_the_fix_and_without_the_pin_ray_is_not_asked():
    pins = Pins(python="3.11", torch="2.14.1", torchvision="0.29.1", horovod="0.28.1", ray="2.60.0")
    with_ray, without = facts(), facts()
    with_ray["ray"] = "2.60.0"
    mac, pc = verdicts(with_ray, without, pins=pins)
    assert mac.problems == [] and pc.problems == [
        "pc: ray not installed, pins.ray is 2.60.0 (mac has 2.60.0); run: invoke provision --hosts pc"]
    assert "transport uv), Ray 2.60.0, interface (auto)" in preflight.report([mac])  # the version check compared
    older = {**facts(), "ray": "2.59.0"}
    _, pc = verdicts(with_ray, older, pins=pins)
    assert pc.problems[0].startswith("pc: ray 2.59.0, pins.ray is 2.60.0 (mac has 2.60.0)")
    assert [v.problems for v in verdicts(with_ray, without)] == [[], []]  # no pins.ray: Ray is nobody's business


def test_a_host_that_connects_then_times_out_is_its_own_status_not_a_traceback(monkeypatch):
    """`invoke check` reports every host: one whose command times out after the connection was
    made (a Mac going to sleep) is 'unreachable' with the reason, as one that refuses the
    connection is, instead of a traceback ending the check."""
    import contextlib

    from invoke.exceptions import CommandTimedOut
    from invoke.runners import Result

    def timed_out(*args, **kwargs):
        raise CommandTimedOut(Result(command="sh -c 'printf %s \"$HOME\"'", exited=-1, hide=("stdout", "stderr")), 30)

    monkeypatch.setattr(preflight.ssh, "connect", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(preflight.ssh, "run", timed_out)
    mac = HOSTS[0]
    facts = preflight.gather(INVENTORY, mac, list(HOSTS))
    assert facts.status == "unreachable" and facts.error.startswith("mac: connected, then CommandTimedOut"), facts
