"""The provisioning plan is a pure function of a host's detected facts: tests read it whole."""

from __future__ import annotations

import dataclasses
import shlex

import pytest

from hvdhetero.cluster import remote_provision as rp
from hvdhetero.errors import BuildError
from hvdhetero.cluster.inventory import Host, Pins

PINS = Pins(python="3.11", torch="2.14.1", torchvision="0.29.1", horovod="0.28.1")
LINUX = {"system": "Linux", "machine": "x86_64", "python": "3.11", "home": "/home/alice", "root": False,
         "tools": {"c++": True, "make": True, "cmake": True, "patch": True, "pkg-config": True, "libuv": True}}
MAC = {**LINUX, "system": "Darwin", "machine": "arm64", "home": "/Users/alice",
       "tools": {"c++": True, "make": True, "cmake": False, "patch": True, "pkg-config": True, "libuv": True}}


def names(steps):
    return [s.name for s in steps]


def test_linux_plan_steps_and_paths():
    host = Host(name="pc", address="192.168.1.20", env="~/hvdhetero/.venv", python="python3.11",
                torch_index_url="https://download.pytorch.org/whl/cu130")
    steps = rp.plan(host, PINS, LINUX, "d1g3st", "/tmp/w/hvdhetero-0.1.0-py3-none-any.whl", "/c/horovod-0.28.1.tar.gz")
    assert names(steps) == ["venv", "torch 2.14.1", "hvdhetero", "horovod sdist", "horovod 0.28.1 (uv)",
                            "verify build", "verify device auto"]
    venv = steps[0]
    assert venv.check == ("test", "-x", "/home/alice/hvdhetero/.venv/bin/python")
    assert venv.action == ("python3.11", "-m", "venv", "/home/alice/hvdhetero/.venv")
    torch = steps[1]
    assert torch.action[-2:] == ("torch==2.14.1", "torchvision==0.29.1")
    assert dict(torch.env) == {"PIP_EXTRA_INDEX_URL": "https://download.pytorch.org/whl/cu130"}
    assert steps[2].upload == ("/tmp/w/hvdhetero-0.1.0-py3-none-any.whl",
                               "/home/alice/.cache/hvdhetero/upload/pc/hvdhetero-0.1.0-py3-none-any.whl")
    assert steps[4].name == "horovod 0.28.1 (uv)"
    assert steps[4].action == ("/home/alice/hvdhetero/.venv/bin/python", "-m", "hvdhetero.cluster.horovod_build",
                               "--install", "--transport", "uv")
    assert steps[4].check[-3:] == ("--check", "--transport", "uv")


def test_darwin_arm64_plan_and_system_packages():
    host = Host(name="mac", address="macbook.local", env="hvd/.venv", device="mps", wheelhouse="~/wheels")
    steps = rp.plan(host, PINS, MAC, "d", "/w/hvdhetero.whl", "/c/horovod-0.28.1.tar.gz")
    assert steps[0].action == ("python3", "-m", "venv", "/Users/alice/hvd/.venv")
    assert dict(steps[1].env) == {"MACOSX_DEPLOYMENT_TARGET": "13.0", "PIP_FIND_LINKS": "/Users/alice/wheels",
                                  "PIP_NO_INDEX": "1"}
    assert steps[-1].name == "verify device mps" and "select('mps')" in steps[-1].check[-1]
    assert rp.missing_tools(MAC) == ["cmake"]
    assert rp.system_packages_command(MAC) == ["brew", "install", "cmake", "libuv", "pkg-config"]
    assert rp.system_packages_command(LINUX)[:3] == ["sudo", "-n", "apt-get"]


def test_tcp_transport_is_refused_for_a_mac_with_the_fix():
    tcp = dataclasses.replace(PINS, transport="tcp")
    with pytest.raises(BuildError, match=r"mac: macOS has only Gloo's uv transport, pins.transport is tcp: "
                                         r"set transport: uv under pins:"):
        rp.plan(Host(name="mac", address="m"), tcp, MAC, "d", "/w.whl", "/s.tar.gz")
    assert rp.plan(Host(name="pc", address="p"), tcp, LINUX, "d", "/w.whl", "/s.tar.gz")[4].name == "horovod 0.28.1 (tcp)"


def test_libuv_is_a_build_requirement_of_the_uv_transport_only():
    bare = {**LINUX, "tools": {**LINUX["tools"], "pkg-config": False, "libuv": False}}
    assert rp.missing_tools(bare, "uv") == ["pkg-config", "libuv"]
    assert rp.missing_tools(bare, "tcp") == []
    assert "libuv1-dev" in rp.system_packages_command(bare) and "pkg-config" in rp.system_packages_command(bare)


def test_wrong_python_is_refused_with_the_fix():
    with pytest.raises(BuildError, match=r"pc: python3 is Python 3.10, pins.python is 3.11: install Python 3.11"):
        rp.plan(Host(name="pc", address="h"), PINS, {**LINUX, "python": "3.10"}, "d", "/w.whl", "/s.tar.gz")


@pytest.mark.parametrize("path,home,expected", [
    ("~/a/.venv", "/home/x", "/home/x/a/.venv"), ("a/b", "/Users/y", "/Users/y/a/b"),
    ("/opt/env/", "/home/x", "/opt/env"), ("~", "/home/x", "/home/x"),
])
def test_remote_path(path, home, expected):
    assert rp.remote_path(path, home) == expected


def test_hostile_values_stay_single_words():
    """Values that validation would reject, forced in: each still travels as one quoted word."""
    evil = "/tmp/x; touch /tmp/pwned $(id) `id`"
    host = Host(name="pc", address="h", env=evil, python="python3 && rm -rf /", wheelhouse=evil)
    for step in rp.plan(host, PINS, LINUX, "d", "/w.whl", "/s.tar.gz"):
        for argv in (step.action, step.check or ()):
            assert shlex.split(shlex.join(argv)) == list(argv)
    assert rp.plan(host, PINS, LINUX, "d", "/w.whl", "/s.tar.gz")[0].action[0] == "python3 && rm -rf /"


def test_exit_codes_rank_failed_over_refused_over_unreachable():
    r = lambda s: rp.HostReport("h", s)  # noqa: E731
    assert rp.exit_code([r("ok"), r("changed")]) == 0
    assert rp.exit_code([r("unreachable"), r("ok")]) == 3
    assert rp.exit_code([r("unreachable"), r("refused")]) == 4
    assert rp.exit_code([r("refused"), r("failed")]) == 1
