"""inventory.yaml parsing and validation: the pure part of the launcher, tested without processes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import ROOT
from hvdhetero.errors import ConfigError, InventoryError
from hvdhetero.cluster.inventory import Host, Inventory, Pins, default_path, load

REPO_INVENTORY = Path(__file__).resolve().parent.parent / "inventory.yaml"
PINS = Pins(python="3.11", torch="2.14.1", torchvision="0.29.1", horovod="0.28.1")

# Lines 1-8; the malformed cases below append host keys from line 9 on.
BASE = """\
pins:
  python: "3.11"
  torch: "2.14.1"
  torchvision: "0.29.1"
  horovod: "0.28.1"
hosts:
  local:
    address: localhost
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "inventory.yaml"
    path.write_text(text)
    return path


def packages(value: str) -> str:
    """BASE with `packages: <value>` as line 2, under pins:."""
    return BASE.replace("pins:\n", f"pins:\n  packages: {value}\n")


@pytest.fixture
def ssh_key(tmp_path, monkeypatch) -> Path:
    """~/.ssh/id_ed25519 in a home of the test's own: an inventory's `identity:` must exist."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    key = tmp_path / "home" / ".ssh" / "id_ed25519"
    key.parent.mkdir(parents=True)
    key.write_text("not a real key: the loader only looks that the file is there\n")
    return key


def test_repo_inventory_loads_with_local_default():
    inv = load(REPO_INVENTORY)
    assert inv.pins == PINS
    assert inv.default_hosts == ("local",)
    (local,) = inv.select(None)
    assert (local.name, local.slots, local.device, local.env) == ("local", 2, "cpu", ".venv")
    assert local.is_local


def test_repo_inventory_examples_are_valid_when_uncommented(tmp_path, ssh_key):
    text = re.sub(r"^  # ", "  ", REPO_INVENTORY.read_text(), flags=re.M)
    inv = load(write(tmp_path, text))
    mac, pc = inv.select("mac,pc")
    assert inv.pins.packages == ("einops==0.8.1", "sentencepiece==0.2.0")
    assert (mac.device, mac.interface, mac.identity, mac.is_local) == ("mps", "en0", "~/.ssh/id_ed25519", False)
    assert (pc.device, pc.max_batch, pc.torch_version(inv.pins)) == ("cuda", 512, "2.14.1")


def test_full_host_parses_every_key(tmp_path, ssh_key):
    path = write(tmp_path, BASE + """\
  pc:
    address: 192.168.1.20
    user: alice
    port: 2222
    identity: ~/.ssh/id_ed25519
    device: cuda
    slots: 2
    interface: enp3s0
    env: ~/hvdhetero/.venv
    python: python3.11
    torch: "2.14.1+cu130"
    torchvision: "0.29.1+cu130"
    torch_index_url: https://download.pytorch.org/whl/cu130
    max_batch: 512
    slowdown: 2
""")
    inv = load(path)
    assert inv == Inventory(
        path=path,
        pins=PINS,
        hosts=(
            Host(name="local", address="localhost", line=7),
            Host(name="pc", address="192.168.1.20", user="alice", port=2222, identity="~/.ssh/id_ed25519",
                 device="cuda", slots=2, interface="enp3s0", env="~/hvdhetero/.venv", python="python3.11",
                 torch="2.14.1+cu130", torchvision="0.29.1+cu130",
                 torch_index_url="https://download.pytorch.org/whl/cu130", max_batch=512, slowdown=2.0, line=9),
        ),
        default_hosts=("local",),
    )
    pc = inv.host("pc")
    assert (pc.torch_version(PINS), pc.torchvision_version(PINS)) == ("2.14.1+cu130", "0.29.1+cu130")
    assert inv.host("local").torch_version(PINS) == "2.14.1"


def test_a_device_per_slot_gives_each_rank_of_the_host_its_own(tmp_path, monkeypatch):
    """`device: cuda,cpu` with slots: 2: the rank at local rank 0 takes CUDA, the next the CPU (a
    GPU machine's spare cores as a second rank); the rank reads it before Horovod starts."""
    from hvdhetero.rank import host as rank_host

    loaded = load(write(tmp_path, BASE + "    slots: 2\n    device: cuda,cpu\n"))
    (local,) = loaded.hosts
    assert (local.device, local.slots) == ("cuda,cpu", 2)
    for local_rank, device in ((0, "cuda"), (1, "cpu")):
        monkeypatch.setenv("HOROVOD_LOCAL_RANK", str(local_rank))
        assert rank_host.rank_device({"device": local.device}) == device
    assert rank_host.rank_device({"device": "mps"}) == "mps" and rank_host.rank_device({}) == "auto"


def test_optional_keys_left_blank_mean_unset(tmp_path):
    (host,) = load(write(tmp_path, BASE + "    user:\n    interface: ~\n")).hosts
    assert (host.user, host.interface) == (None, None)


@pytest.mark.parametrize("address", ["localhost", "127.0.0.1", "::1", "fe80::1", "macbook.local", "pc-1.lan."])
def test_valid_addresses(tmp_path, address):
    text = BASE.replace("address: localhost", f'address: "{address}"')
    assert load(write(tmp_path, text)).hosts[0].address == address


CASES = {  # id: (yaml text, line, dotted key, regex the message must match)
    "unknown host key suggests": (BASE + "    slot: 2\n", 9, "hosts.local.slot",
                                  r"unknown key 'slot'; did you mean 'slots'\? allowed keys: address, user"),
    "duplicate host key": (BASE + "    slots: 1\n    slots: 2\n", 10, "hosts.local.slots",
                           r"'slots' is set twice \(first on line 9\)"),
    "duplicate host": (BASE + "  local:\n    address: localhost\n", 9, "hosts.local",
                       r"set twice \(first on line 7\)"),
    "slots 0": (BASE + "    slots: 0\n", 9, "hosts.local.slots", r"must be an integer >= 1, got '0'"),
    "slots two": (BASE + "    slots: two\n", 9, "hosts.local.slots", r"integer >= 1, got 'two' \(a string\)"),
    "slots true": (BASE + "    slots: true\n", 9, "hosts.local.slots", r"got 'true' \(a boolean\)"),
    "slots float": (BASE + "    slots: 1.5\n", 9, "hosts.local.slots", r"integer >= 1, got '1.5' \(a number\)"),
    "port 70000": (BASE + "    port: 70000\n", 9, "hosts.local.port", r"integer from 1 to 65535, got '70000'"),
    "max_batch 0": (BASE + "    max_batch: 0\n", 9, "hosts.local.max_batch", r"integer >= 1, got '0'"),
    "slowdown 0.5": (BASE + "    slowdown: 0.5\n", 9, "hosts.local.slowdown", r"number >= 1, got '0.5'"),
    "slowdown fast": (BASE + "    slowdown: fast\n", 9, "hosts.local.slowdown", r"number >= 1, got 'fast'"),
    "device gpu": (BASE + "    device: gpu\n", 9, "hosts.local.device", r"auto, cpu, cuda, mps, or one per slot, "
                                                                          r"comma-separated .*, got 'gpu'"),
    "device per slot, one short": (BASE + "    slots: 3\n    device: cuda,cpu\n", 10, "hosts.local.device",
                                   r"names 2 devices for 3 slots: give one device for the host, or one per slot"),
    "device per slot, one unknown": (BASE + "    slots: 2\n    device: cuda,tpu\n", 10, "hosts.local.device",
                                     r"got 'cuda,tpu'"),
    "ray with a shell": (BASE.replace("pins:\n", "pins:\n  ray: 2.60.0;ls\n"), 2, "pins.ray",
                         r"a version such as"),
    "ray in packages": (BASE.replace("pins:\n", "pins:\n  packages: [\"ray==2.60.0\"]\n"), 2, "pins.packages",
                        r"pins\.ray"),
    "transport quic": (BASE.replace("pins:\n", "pins:\n  transport: quic\n"), 2, "pins.transport",
                       r"must be uv \(Mac \+ Linux clusters\) or tcp \(Linux-only, stock Horovod\), got 'quic'"),
    "python pin unquoted": (BASE.replace('"3.11"', "3.11"), 2, "pins.python",
                            r"got '3.11' \(a number\); quote it: \"3.11\""),
    "python 3.10 keeps its zero": (BASE.replace('"3.11"', "3.10"), 2, "pins.python", r"quote it: \"3.10\""),
    "torch pin with space": (BASE.replace('"2.14.1"', '"2.14 .1"'), 3, "pins.torch", r"got '2.14 .1'"),
    "missing pin": (BASE.replace('  horovod: "0.28.1"\n', ""), 1, "pins.horovod", r"required key is missing"),
    "unknown pin": (BASE.replace("pins:\n", "pins:\n  numpy: '2.0'\n"), 2, "pins.numpy",
                    r"unknown key 'numpy'; allowed keys: python, torch, torchvision, horovod"),
    "address injection": (BASE.replace("address: localhost", 'address: "localhost;rm -rf /"'), 8,
                          "hosts.local.address", r"got 'localhost;rm -rf /'"),
    "address bad ipv4": (BASE.replace("address: localhost", "address: 999.1.1.1"), 8, "hosts.local.address",
                         r"hostname, IPv4 or IPv6 address"),
    "user with dollar": (BASE + "    user: $USER\n", 9, "hosts.local.user", r"a user name.*got '\$USER'"),
    "interface slash": (BASE + "    interface: en0/1\n", 9, "hosts.local.interface", r"NIC name.*got 'en0/1'"),
    "interface too long": (BASE + "    interface: abcdefghijklmnop\n", 9, "hosts.local.interface", r"1-15"),
    "index url not http": (BASE + "    torch_index_url: ftp://x\n", 9, "hosts.local.torch_index_url", r"http"),
    "bad host name": (BASE + "  my.mac:\n    address: x\n", 9, "hosts.my.mac", r"bad host name 'my.mac'"),
    "missing address": (BASE + "  mac:\n    slots: 1\n", 9, "hosts.mac.address", r"required key is missing"),
    "host not a mapping": (BASE + "  mac: mac.local\n", 9, "hosts.mac", r"must be a mapping .*got 'mac.local'"),
    "hosts a list": (BASE.split("hosts:")[0] + "hosts:\n  - local\n", 7, "hosts",
                     r"mapping of host names to host settings, got a list"),
    "hosts empty": (BASE.split("hosts:")[0] + "hosts: {}\n", 6, "hosts", r"is empty"),
    "missing pins": ("hosts:\n  local:\n    address: localhost\n", 1, "pins",
                     r"required key is missing; add pins:"),
    "unknown top key suggests": ("\n\nhost:\n  x: 1\n", 3, "host", r"did you mean 'hosts'\?"),
    "yaml syntax error": (BASE + "    slots: [1\n", 10, "(top level)", r"not valid YAML"),
    "tab indentation": (BASE + "\tslots: 2\n", 9, "(top level)", r"not valid YAML"),
    "unclosed bracket found lines later": (BASE.replace("hosts:", "default_hosts: [local\nhosts:"), 7, "(top level)",
                                           r"not valid YAML: expected ',' or '\]', but got ':' \(while parsing a flow "
                                           r"sequence that starts on line 6: is its '\]' missing\?\); check"),
    "top level a list": ("- local\n- mac\n", 1, "(top level)",
                         r"must be a mapping of keys \(pins, default_hosts, known_hosts, hosts\), got a list"),
    "default unknown host": (BASE.replace("hosts:", "default_hosts: [local, mac]\nhosts:"), 6, "default_hosts",
                             r"names 'mac', which is not under hosts:; known hosts: local"),
    "default twice": (BASE.replace("hosts:", "default_hosts: [local, local]\nhosts:"), 6, "default_hosts",
                      r"lists 'local' twice"),
    "default empty": (BASE.replace("hosts:", "default_hosts: []\nhosts:"), 6, "default_hosts", r"is empty"),
    "no default and no local": (BASE.replace("local:", "mac:"), 1, "default_hosts",
                                r"no host named 'local'; add e.g. default_hosts: \[mac\]"),
    "package range": (packages('["einops>=0.8"]'), 2, "pins.packages",
                      r"^\S+: key 'pins.packages': 'einops>=0\.8' is not an exact pin; pin each package exactly as "
                      r"name==version, e\.g\. packages: \[\"einops==0\.8\.1\"\] \(no version ranges, URLs, extras, "
                      r"spaces or shell characters\)$"),
    "package unpinned": (packages("[einops]"), 2, "pins.packages", r"'einops' is not an exact pin; pin each package"),
    "package url": (packages('["einops @ https://x.org/einops.whl"]'), 2, "pins.packages",
                    r"'einops @ https://x\.org/einops\.whl' is not an exact pin; pin each package exactly"),
    "package with space": (packages('["einops == 0.8.1"]'), 2, "pins.packages",
                           r"'einops == 0\.8\.1' is not an exact pin; pin each package exactly as name==version"),
    "package semicolon": (packages('["einops==0.8.1; rm -rf ~"]'), 2, "pins.packages",
                          r"'einops==0\.8\.1; rm -rf ~' is not an exact pin"),
    "package command substitution": (packages('["einops==$(id)"]'), 2, "pins.packages",
                                     r"'einops==\$\(id\)' is not an exact pin"),
    "package read as a pip option": (packages('["--index-url==http://evil"]'), 2, "pins.packages",
                                     r"'--index-url==http://evil' is not an exact pin"),
    "packages not a list": (packages("einops==0.8.1"), 2, "pins.packages",
                            r"must be a list, got 'einops==0\.8\.1' \(a string\); pin each package exactly as "
                            r"name==version"),
    "package a number": (packages("[0.8]"), 2, "pins.packages",
                         r"each entry must be a string, got '0\.8' \(a number\); pin each package exactly"),
    "package twice as pip names it": (packages('\n    - sentencepiece==0.2.0\n    - einops==0.8.1\n'
                                               '    - SentencePiece==0.1.99\n'), 5, "pins.packages",
                                      r"'SentencePiece==0\.1\.99' pins sentencepiece again "
                                      r"\('sentencepiece==0\.2\.0' on line 3\); pin each package once$"),
    "package dash and underscore are one": (packages('[typing_extensions==4.12.2, Typing-Extensions==4.12.2]'), 2,
                                            "pins.packages", r"pins typing-extensions again"),
    "package torch pinned twice": (packages('["Torch==2.13.0"]'), 2, "pins.packages",
                                   r"'Torch==2\.13\.0': torch is installed from pins\.torch; remove it from "
                                   r"pins\.packages$"),
}


@pytest.mark.parametrize("text, line, key, match", CASES.values(), ids=CASES.keys())
def test_malformed_inventory(tmp_path, text, line, key, match):
    path = write(tmp_path, text)
    with pytest.raises(InventoryError, match=match) as raised:
        load(path)
    message = str(raised.value)
    assert message.startswith(f"{path}:{line}: ")
    # a problem of the file as a whole names no key: "inventory.yaml:10: not valid YAML: ..."
    assert f"key '{key}'" in message if key != "(top level)" else "key '" not in message, message
    assert (raised.value.line, raised.value.key) == (line, key)
    assert raised.value.exit_code == 2


def test_an_identity_that_does_not_exist_is_an_error_at_load(tmp_path, ssh_key):
    """Noticed in the file, naming line and key, rather than by a connection that fails later."""
    path = write(tmp_path, BASE + "  pc:\n    address: 192.0.2.1\n    identity: ~/.ssh/id_pc\n")
    with pytest.raises(InventoryError) as raised:
        load(path)
    message = str(raised.value)
    assert (raised.value.line, raised.value.key, raised.value.exit_code) == (11, "hosts.pc.identity", 2)
    assert message.startswith(f"{path}:11: key 'hosts.pc.identity': ~/.ssh/id_pc ({ssh_key.parent / 'id_pc'}) "
                              "does not exist; point it at your ssh private key (ssh-keygen -t ed25519 -f "
                              "~/.ssh/id_pc makes one"), message
    assert message.endswith("or remove identity: to let ssh use your agent and ~/.ssh/config")


def test_an_identity_under_home_or_absolute_loads_as_written(tmp_path, ssh_key):
    """~ is the launcher's home (ssh expands it likewise); the path stays as written."""
    text = BASE + f"  pc:\n    address: 192.0.2.1\n    identity: ~/.ssh/id_ed25519\n  mac:\n    address: 192.0.2.2\n" \
                  f"    identity: {ssh_key}\n"
    inv = load(write(tmp_path, text))
    assert [h.identity for h in inv.hosts] == [None, "~/.ssh/id_ed25519", str(ssh_key)]


def test_an_identity_that_is_a_folder_is_refused(tmp_path, ssh_key):
    path = write(tmp_path, BASE + f"    identity: {ssh_key.parent}\n")
    with pytest.raises(InventoryError, match=r"is a directory, not a key file; point it at your ssh private key"):
        load(path)


def test_packages_load_as_exact_pins_in_file_order(tmp_path):
    pins = load(write(tmp_path, packages('["sentencepiece==0.2.0", "einops==0.8.1", "Jinja2==3.1.4", '
                                         '"torch-geometric==2.6.1", "tzdata==2024.1", "x==1!2.0.post1+local_1"]'))).pins
    assert pins.packages == ("sentencepiece==0.2.0", "einops==0.8.1", "Jinja2==3.1.4", "torch-geometric==2.6.1",
                             "tzdata==2024.1", "x==1!2.0.post1+local_1")
    assert list(pins.package_versions().items())[:2] == [("sentencepiece", "0.2.0"), ("einops", "0.8.1")]
    assert pins == Pins(**{**PINS.__dict__, "packages": pins.packages})


@pytest.mark.parametrize("text", [BASE, packages("[]"), packages(""), packages("~")])
def test_packages_default_to_none(tmp_path, text):
    assert load(write(tmp_path, text)).pins.packages == ()


def test_transport_defaults_to_uv_and_takes_tcp(tmp_path):
    assert load(write(tmp_path, BASE)).pins.transport == "uv"
    assert load(write(tmp_path, BASE)).pins.ray is None  # no Ray unless asked for
    assert load(write(tmp_path, BASE.replace("pins:\n", 'pins:\n  ray: "2.60.0"\n'))).pins.ray == "2.60.0"
    tcp = load(write(tmp_path, BASE.replace("pins:\n", "pins:\n  transport: tcp\n")))
    assert tcp.pins.transport == "tcp"


def test_missing_file_says_how_to_create_it(tmp_path, monkeypatch):
    path = tmp_path / "nope.yaml"
    with pytest.raises(InventoryError, match=r"file not found; create it .*HVDHETERO_INVENTORY") as raised:
        load(path)
    assert str(raised.value).startswith(f"{path}: ")
    # invoke run from another folder (invoke -r): the folder it looked in, and the checkout's file to copy
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InventoryError) as raised:
        load("inventory.yaml")
    assert str(raised.value) == (f"inventory.yaml: file not found (looked for {tmp_path / 'inventory.yaml'}); create it "
                                 f"from {ROOT / 'inventory.yaml'} (its `local` host runs two CPU ranks here), or point "
                                 "$HVDHETERO_INVENTORY at yours"), str(raised.value)


def test_unreadable_or_empty_file(tmp_path):
    with pytest.raises(InventoryError, match="the file is empty"):
        load(write(tmp_path, "# only a comment\n"))
    with pytest.raises(InventoryError, match="cannot read the file: Is a directory"):
        load(tmp_path)
    (tmp_path / "latin1.yaml").write_bytes(b"pins: caf\xe9\n")
    with pytest.raises(InventoryError, match="not UTF-8 text"):
        load(tmp_path / "latin1.yaml")


def test_select_keeps_order_and_defaults(tmp_path):
    text = BASE + "  mac:\n    address: mac.local\n  pc:\n    address: 192.168.1.20\n"
    inv = load(write(tmp_path, text.replace("hosts:", "default_hosts: mac\nhosts:")))
    assert [h.name for h in inv.select("pc, mac")] == ["pc", "mac"]
    assert [h.name for h in inv.select(["mac", "pc"])] == ["mac", "pc"]
    assert [h.name for h in inv.select(None)] == ["mac"]


@pytest.mark.parametrize("names, match", [
    ("mac,gpu", r"inventory.yaml: no host named 'gpu'; the hosts defined there are: local, mac"),
    ("mac,mac", r"'mac' is selected twice"),
    ("", r"no hosts selected; name at least one of: local, mac"),
    ([], r"no hosts selected"),
    ("mac,,local", r"empty host name"),
])
def test_select_rejects(tmp_path, names, match):
    inv = load(write(tmp_path, BASE + "  mac:\n    address: mac.local\n"))
    with pytest.raises(ConfigError, match=match):
        inv.select(names)


def test_default_path(monkeypatch, tmp_path):
    monkeypatch.delenv("HVDHETERO_INVENTORY", raising=False)
    monkeypatch.chdir(tmp_path)  # a project folder of one's own, run with invoke -r: the checkout's
    assert default_path() == ROOT / "inventory.yaml"
    (tmp_path / "inventory.yaml").write_text(BASE)
    assert default_path() == Path("inventory.yaml")  # one of its own wins
    monkeypatch.setenv("HVDHETERO_INVENTORY", str(tmp_path / "cluster.yaml"))
    assert default_path() == tmp_path / "cluster.yaml"


def test_launcher_side_imports_no_torch_or_horovod():
    import subprocess
    import sys

    code = "import sys, hvdhetero.cluster.inventory; print(sorted({'torch', 'horovod'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_command_offered_to_copy_names_the_checkout_where_invoke_would_not_find_it(tmp_path):
    """`invoke` inside the checkout (or a folder of it); from anywhere else `invoke -r CHECKOUT`."""
    from hvdhetero.cluster import checkout

    assert checkout.invoke(ROOT) == checkout.invoke(ROOT / "docs") == "invoke"
    words = checkout.invoke(tmp_path).split()
    assert words[:2] == ["invoke", "-r"] and Path(words[2]).expanduser().resolve() == ROOT, words
