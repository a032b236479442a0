"""Reading inventory.yaml: where the file is (default_path) and load(), which turns it into
the records of inventory_records.py. PyYAML's node tree is walked key by key, each value checked
against a rule, so an error names the file, the line and the key and says what is allowed;
duplicate and unknown keys are errors too. Loading contacts nothing and writes nothing (it only
looks whether an `identity:` key file exists). Import it from hvdhetero.cluster.inventory.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable

import yaml

from hvdhetero.cluster.inventory_records import (BACKENDS, DEVICES, MPI_OPS, OPENMPI_SERIES, TRANSPORTS, Host,
                                                 Inventory, Pins)
from hvdhetero import yaml_file
from hvdhetero.cluster import checkout
from hvdhetero.errors import InventoryError

ENV_VAR = "HVDHETERO_INVENTORY"


def default_path() -> Path:
    """$HVDHETERO_INVENTORY if set, else inventory.yaml in the current directory, else the
    checkout's (`invoke -r ~/hvdhetero train` from a project folder of one's own)."""
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR]).expanduser()
    here = Path("inventory.yaml")
    return checkout.INVENTORY if not here.exists() and checkout.INVENTORY.is_file() else here


def load(path: str | Path) -> Inventory:
    """Read and validate an inventory file; any problem raises InventoryError."""
    path = Path(path)
    root = _compose(path)
    reader = _Reader(path)
    top = reader.mapping(root, "", ("pins", "default_hosts", "known_hosts", "hosts"))
    reader.require(top, ("pins", "hosts"), root, "")
    pins = reader.pins(*top["pins"])
    hosts_node = top["hosts"][1]
    hosts = tuple(reader.host(k, v) for k, v in reader.mapping(hosts_node, "hosts", None,
                                                                   what="host names to host settings").values())
    if not hosts:
        raise reader.error(hosts_node, "hosts", "is empty; define at least one host, "
                           "e.g. local: {address: localhost}")
    default = reader.default_hosts(top.get("default_hosts", (None, None))[1], hosts, root)
    known_hosts = None
    if "known_hosts" in top:
        known_hosts = reader.string(top["known_hosts"][1], "known_hosts", _PATH.fullmatch,
                                    "a path to a known_hosts file, e.g. ~/.ssh/known_hosts")
    return Inventory(path=path, pins=pins, hosts=hosts, default_hosts=default, known_hosts=known_hosts)


# --- validation -------------------------------------------------------------------------------
# PyYAML's plain load() forgets line numbers and silently keeps the last of duplicate keys, so we
# compose the node tree instead and convert each scalar ourselves, knowing where it came from.

_TOP = yaml_file.TOP
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*\.?")
_HOST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")  # safe in CLI lists and horovodrun -H
_USER = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}")
_NIC = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,14}")  # Linux caps NIC names at 15 chars
_VERSION = re.compile(r"[0-9][0-9A-Za-z.+_-]*")
_PYTHON = re.compile(r"[0-9]+\.[0-9]+")
_PATH = re.compile(r"[A-Za-z0-9_./~+-]+")
_URL = re.compile(r"https?://[^\s'\"`$\\;|&<>]+")
# name==version and nothing else; the name starts with a letter or digit, so no pin reads as a pip option.
_PACKAGE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*==[A-Za-z0-9.+!_-]+")
_PACKAGE_HELP = 'pin each package exactly as name==version, e.g. packages: ["einops==0.8.1"]'
# Installed by provisioning itself, from these: a second pin in pins.packages could only disagree.
_PINNED_ELSEWHERE = {"torch": "pins.torch", "torchvision": "pins.torchvision", "horovod": "pins.horovod",
                     "hvdhetero": "this checkout", "openmpi": "pins.openmpi", "mpi4py": "pins.mpi4py",
                     "ray": "pins.ray"}
_VERSION_HELP = 'a version such as "2.14.1" or "2.14.1+cu130" (digits, letters, ".", "+", "_", "-")'
_got = yaml_file.got


def _is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        # Digits and dots only is a mistyped IPv4 address (999.1.1.1), not a hostname.
        return bool(_HOSTNAME.fullmatch(text)) and not re.fullmatch(r"[0-9.]+", text)


def _package_key(name: str) -> str:
    """A package name as pip compares names (PEP 503): Sentence_Piece and sentence-piece are one."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _text(rule: Callable[[str], Any], allowed: str) -> Callable[[_Reader, yaml.Node, str], str]:
    return lambda reader, node, key: reader.string(node, key, rule, allowed)


def _int(low: int, high: int | None = None) -> Callable[[_Reader, yaml.Node, str], int]:
    return lambda reader, node, key: reader.integer(node, key, low, high)


_HOST_RULES: dict[str, Callable[[_Reader, yaml.Node, str], Any]] = {
    "address": _text(_is_address, "a hostname, IPv4 or IPv6 address (no spaces, quotes or shell chars)"),
    "user": _text(_USER.fullmatch, "a user name: a letter or '_', then letters, digits, '_.-' (32 at most)"),
    "port": _int(1, 65535),
    "identity": lambda reader, node, key: reader.key_file(node, key),
    "device": _text(lambda text: all(d in DEVICES for d in text.split(",")),
                    f"one of {', '.join(DEVICES)}, or one per slot, comma-separated (cuda,cpu: a GPU rank and a "
                    "CPU rank on one machine)"),
    "slots": _int(1),
    "interface": _text(_NIC.fullmatch, "a NIC name such as en0 or enp3s0: 1-15 letters, digits, '_.-' "
                                       "(no '/', ':' or spaces)"),
    "env": _text(_PATH.fullmatch, "a venv path such as .venv or ~/hvdhetero/.venv (no spaces)"),
    "python": _text(_PATH.fullmatch, "an interpreter name or path, e.g. python3.11"),
    "torch": _text(_VERSION.fullmatch, _VERSION_HELP),
    "torchvision": _text(_VERSION.fullmatch, _VERSION_HELP),
    "torch_index_url": _text(_URL.fullmatch, "an http(s) URL without spaces, quotes or shell chars"),
    "max_batch": _int(1),
    "slowdown": lambda reader, node, key: reader.number(node, key, 1.0),
    "wheelhouse": _text(_PATH.fullmatch, "a directory of wheels on that host (no spaces)"),
}
_HOST_DEFAULTS = {f.name: f.default for f in fields(Host)}
assert set(_HOST_RULES) == set(_HOST_DEFAULTS) - {"name", "line"}, "every Host field needs a rule"


def _compose(path: Path) -> yaml.Node:
    """The YAML node tree of the file; InventoryError if it is missing, unreadable or empty."""
    shipped = checkout.INVENTORY
    source = shipped if shipped.is_file() else "the inventory.yaml at the root of the hvdhetero repository"
    return yaml_file.compose(path, InventoryError, f"create it from {source} (its `local` host runs two CPU ranks "
                             f"here), or point ${ENV_VAR} at yours", "it needs at least pins: and hosts:")


class _Reader(yaml_file.Reader):
    """Turns the nodes of one inventory file into values; every error names the file, a line and a key."""

    error_type = InventoryError

    def key_file(self, node: yaml.Node, key: str) -> str:
        """An ssh private key's path as written (~ kept: ssh expands it), naming a file that
        exists here; relative paths start where ssh starts them, in the current directory."""
        value = self.string(node, key, _PATH.fullmatch, "a path to an ssh private key, e.g. ~/.ssh/id_ed25519")
        path = Path(os.path.expanduser(value))
        if not path.is_file():
            shown = value if str(path) == value else f"{value} ({path.absolute()})"
            what = "is a directory, not a key file" if path.is_dir() else "does not exist"
            raise self.error(node, key, f"{shown} {what}; point it at your ssh private key (ssh-keygen -t "
                             f"ed25519 -f {value} makes one, ssh-copy-id -i {value} installs it on the host), or "
                             "remove identity: to let ssh use your agent and ~/.ssh/config")
        return value

    def pins(self, key_node: yaml.Node, node: yaml.Node) -> Pins:
        names = [f.name for f in fields(Pins)]
        choices = {"transport": (TRANSPORTS, "uv (Mac + Linux clusters) or tcp (Linux-only, stock Horovod)"),
                   "backend": (BACKENDS, "gloo (horovodrun, the default) or mpi (mpirun; docs/mpi.md)"),
                   "mpi_ops": (MPI_OPS, "mpi (Open MPI's TCP moves the bytes, the default) or gloo (our Gloo "
                                        "transport moves them under MPI's control; docs/mpi.md)")}
        optional = ("openmpi", "mpi4py", "ray")
        versions = [n for n in names if n not in ("python", "packages", *choices)]
        items = self.mapping(node, "pins", names)
        self.require(items, ["python", *(v for v in versions if v not in optional)], key_node, "pins")
        python = self.string(items["python"][1], "pins.python", _PYTHON.fullmatch,
                             'a minor version such as "3.11"')
        rest = {name: self.string(items[name][1], f"pins.{name}", _VERSION.fullmatch, _VERSION_HELP)
                for name in versions if name in items}
        if "openmpi" in rest and not rest["openmpi"].startswith(OPENMPI_SERIES):
            raise self.error(items["openmpi"][1], "pins.openmpi",
                             f"{rest['openmpi']!r} is not Open MPI {OPENMPI_SERIES}x; Open MPI 5.0.x hangs in "
                             "MPI_Init when a Mac (arm64) and a PC (x86_64) share a job (open-mpi/ompi#12947): "
                             'use openmpi: "4.1.8"')
        for name, (allowed, help_) in choices.items():
            if name in items:
                rest[name] = self.string(items[name][1], f"pins.{name}", allowed.__contains__, help_)
        if "packages" in items:
            rest["packages"] = self.packages(items["packages"][1])
        return Pins(python=python, **rest)

    def packages(self, node: yaml.Node) -> tuple[str, ...]:
        """pins.packages: a list of exact pins, each package once; left blank means none."""
        key = "pins.packages"
        if node.tag.endswith(":null"):
            return ()
        if not isinstance(node, yaml.SequenceNode):
            raise self.error(node, key, f"must be a list, got {_got(node)}; {_PACKAGE_HELP}")
        pins: list[str] = []
        first: dict[str, tuple[str, int]] = {}  # normalized name -> (pin, line)
        for entry in node.value:
            if not (isinstance(entry, yaml.ScalarNode) and entry.tag.endswith(":str")):
                raise self.error(entry, key, f"each entry must be a string, got {_got(entry)}; {_PACKAGE_HELP}")
            pin, line = entry.value, entry.start_mark.line + 1
            if not _PACKAGE.fullmatch(pin):
                raise self.error(entry, key, f"{pin!r} is not an exact pin; {_PACKAGE_HELP} "
                                 "(no version ranges, URLs, extras, spaces or shell characters)")
            name = _package_key(pin.split("==", 1)[0])
            if name in _PINNED_ELSEWHERE:
                raise self.error(entry, key, f"{pin!r}: {name} is installed from {_PINNED_ELSEWHERE[name]}; "
                                 "remove it from pins.packages")
            if name in first:
                other, other_line = first[name]
                raise self.error(entry, key, f"{pin!r} pins {name} again ({other!r} on line {other_line}); "
                                 "pin each package once")
            first[name] = (pin, line)
            pins.append(pin)
        return tuple(pins)

    def host(self, name_node: yaml.Node, node: yaml.Node) -> Host:
        name, key = name_node.value, f"hosts.{name_node.value}"
        if not _HOST_NAME.fullmatch(name):
            raise self.error(name_node, key, f"bad host name {name!r}: use letters, digits, '_' and '-', "
                             "starting with a letter or digit (it goes into --hosts lists and horovodrun -H)")
        items = self.mapping(node, key, list(_HOST_RULES))
        self.require(items, ("address",), name_node, key)
        values = {}
        for field, (_, value_node) in items.items():
            if _HOST_DEFAULTS[field] is None and value_node.tag.endswith(":null"):
                values[field] = None  # `user:` left blank means "not set"
            else:
                values[field] = _HOST_RULES[field](self, value_node, f"{key}.{field}")
        per_slot = values.get("device", "auto").split(",")
        if len(per_slot) > 1 and len(per_slot) != values.get("slots", 1):
            raise self.error(items["device"][1], f"{key}.device", f"names {len(per_slot)} devices for "
                             f"{values.get('slots', 1)} slots: give one device for the host, or one per slot")
        return Host(name=name, line=name_node.start_mark.line + 1, **values)

    def default_hosts(self, node: yaml.Node | None, hosts: tuple[Host, ...], root: yaml.Node
                      ) -> tuple[str, ...]:
        known = [h.name for h in hosts]
        if node is None:
            if "local" in known:
                return ("local",)
            raise self.error(root, "default_hosts", "not set and there is no host named 'local'; add e.g. "
                             f"default_hosts: [{known[0]}] (the hosts used when no --hosts is given)")
        entries = node.value if isinstance(node, yaml.SequenceNode) else [node]
        if not entries:
            raise self.error(node, "default_hosts", f"is empty; list at least one of: {', '.join(known)}")
        names: list[str] = []
        for entry in entries:
            name = self.string(entry, "default_hosts", _HOST_NAME.fullmatch, "a host name or a list of them")
            if name not in known:
                raise self.error(entry, "default_hosts", f"names {name!r}, which is not under hosts:; "
                                 f"known hosts: {', '.join(known)}")
            if name in names:
                raise self.error(entry, "default_hosts", f"lists {name!r} twice; name each host once")
            names.append(name)
        return tuple(names)
