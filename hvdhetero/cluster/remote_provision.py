"""`invoke provision`: bring every host's env to the inventory's pins over SSH, in parallel.

Per host: detect OS, arch and Python -> a plan (a list of steps, each a check command and an
action command; pure, so tests and --dry-run show it) -> run it: a step whose check passes
changes nothing. So a second run reports every host "ok, nothing changed". At the end one
table, every host's result, whatever happened to the others.

The launcher ships what a host cannot fetch for itself: a wheel of this very checkout of
hvdhetero (hosts run the same code, compared by a digest of its sources) and the Horovod sdist
(checked against its published sha256), which the host then builds with our patches.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from hvdhetero.cluster import horovod_build
from hvdhetero.cluster.checkout import ROOT
from hvdhetero.cluster import ssh
from hvdhetero.errors import (BuildError, HostKeyError, HvdHeteroError, SSHAuthError, UnreachableError,
                              group_exit_code)
from hvdhetero.cluster.inventory import Host, Inventory, Pins

STAMP = ".hvdhetero-provisioned.json"

# Printed by the host's interpreter before anything is installed: what the plan depends on.
FACTS_PY = r"""
import json, os, platform, shutil, subprocess, sys
tools = {t: bool(shutil.which(t)) for t in ("c++", "make", "cmake", "patch", "pkg-config")}
try:  # Gloo's uv transport links libuv statically, found through pkg-config
    tools["libuv"] = subprocess.run(["pkg-config", "--exists", "libuv"], timeout=20).returncode == 0
except (OSError, subprocess.SubprocessError):
    tools["libuv"] = False
print(json.dumps({"system": platform.system(), "machine": platform.machine(),
                  "python": "%d.%d" % sys.version_info[:2], "home": os.path.expanduser("~"),
                  "root": hasattr(os, "geteuid") and os.geteuid() == 0, "tools": tools}))
"""

# Run by the env's Python in checks: is `name` installed at `pin` (a +local build tag satisfies a bare pin)?
SAME_PY = ("import sys; from importlib import metadata as m\n"
           "def same(name, pin):\n"
           "    try: v = m.version(name)\n"
           "    except m.PackageNotFoundError: return False\n"
           "    return v == pin or ('+' not in pin and v.split('+')[0] == pin)\n")


@dataclass(frozen=True)
class Step:
    """One idempotent step: skipped when `check` exits 0, else `action` runs (and must succeed).
    No action: a verification, whose check failing fails the host with what the check said."""

    name: str
    action: tuple[str, ...]
    check: tuple[str, ...] | None = None
    env: tuple[tuple[str, str], ...] = ()
    upload: tuple[str, str] | None = None
    """(local path, remote path) copied before the action runs."""


@dataclass
class HostReport:
    host: str
    status: str = "ok"  # ok | changed | failed | unreachable | refused
    changes: list[str] = field(default_factory=list)
    reason: str = ""


def source_digest() -> str:
    """sha256 over this checkout's package files: hosts must run exactly this code."""
    h = hashlib.sha256()
    for path in sorted((ROOT / "hvdhetero").rglob("*")):
        if path.is_file() and path.suffix in (".py", ".patch"):
            h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    h.update((ROOT / "pyproject.toml").read_bytes())
    return h.hexdigest()[:16]


def remote_path(path: str, home: str) -> str:
    """A host path from the inventory, absolute on that host (~ and relative = its home)."""
    if path.startswith("~"):
        path = path[2:] if path.startswith("~/") else ""
    return posixpath.normpath(path if path.startswith("/") else posixpath.join(home, path))


def missing_tools(facts: dict, transport: str = "uv") -> list[str]:
    """Build tools the host lacks; pkg-config and libuv only matter for the uv transport."""
    optional = () if transport == "uv" else ("pkg-config", "libuv")
    return [t for t, ok in facts["tools"].items() if not ok and t not in optional]


def system_packages_command(facts: dict) -> list[str]:
    """The command that installs the build tools Horovod needs on that OS."""
    if facts["system"] == "Darwin":
        return ["brew", "install", "cmake", "libuv", "pkg-config"]  # the compiler: xcode-select --install
    sudo = [] if facts.get("root") else ["sudo", "-n"]
    return [*sudo, "apt-get", "install", "-y", "g++", "make", "cmake", "patch", "pkg-config", "libuv1-dev"]


def plan(host: Host, pins: Pins, facts: dict, digest: str, wheel: str, sdist: str) -> list[Step]:
    """The steps that bring `host` (as `facts` describe it) to the pins. Pure."""
    if facts["python"] != pins.python:
        raise BuildError(f"{host.name}: {host.python} is Python {facts['python']}, pins.python is {pins.python}: "
                         f"install Python {pins.python} there and set python: python{pins.python} for this host")
    if facts["system"] == "Darwin" and pins.transport != "uv":
        raise BuildError(f"{host.name}: macOS has only Gloo's uv transport, pins.transport is {pins.transport}: "
                         "set transport: uv under pins: (it works between macOS and Linux)")
    env = remote_path(host.env, facts["home"])
    py = posixpath.join(env, "bin", "python")
    pip_env: dict[str, str] = {}
    if host.wheelhouse:
        pip_env.update(PIP_NO_INDEX="1", PIP_FIND_LINKS=remote_path(host.wheelhouse, facts["home"]))
    if host.torch_index_url:
        pip_env["PIP_EXTRA_INDEX_URL"] = host.torch_index_url
    if facts["system"] == "Darwin":
        # Wheels built here must run on the macOS the host has, arm64 builds included.
        pip_env["MACOSX_DEPLOYMENT_TARGET"] = "13.0"
    penv = tuple(sorted(pip_env.items()))
    torch, vision = host.torch_version(pins), host.torchvision_version(pins)
    cache = posixpath.join(facts["home"], ".cache", "hvdhetero")
    # Per host name: test hosts share one disk, and two uploads must not race on one file.
    remote_wheel = posixpath.join(cache, "upload", host.name, posixpath.basename(wheel))
    remote_sdist = posixpath.join(cache, "sdist", posixpath.basename(sdist))
    versions_match = f"{SAME_PY}sys.exit(0 if same('torch', {torch!r}) and same('torchvision', {vision!r}) else 1)"
    stamp_matches = (f"import json, sys; d = json.load(open({posixpath.join(env, STAMP)!r})); "
                     f"sys.exit(0 if d.get('digest') == {digest!r} else 1)")
    sha = horovod_build.SDIST_SHA256[pins.horovod]
    sdist_ok = (f"import hashlib, sys; sys.exit(0 if hashlib.sha256(open({remote_sdist!r}, 'rb').read())"
                f".hexdigest() == {sha!r} else 1)")
    wanted = pins.package_versions()
    packages_match = f"{SAME_PY}sys.exit(0 if all(same(n, v) for n, v in {wanted!r}.items()) else 1)"
    packages = [Step(f"packages {' '.join(pins.packages)}", check=(py, "-c", packages_match),
                     action=(py, "-m", "pip", "install", "--quiet", *pins.packages), env=penv)] if wanted else []
    # backend mpi: Open MPI first, then mpi4py (its wheel loads the MPI it finds in the env); then Ray if pinned.
    engines = [Step(f"{name} {version}",
                    check=(py, "-c", f"{SAME_PY}sys.exit(0 if same({name!r}, {version!r}) else 1)"),
                    action=(py, "-m", "pip", "install", "--quiet", f"{name}=={version}"), env=penv)
               for name, version in {**pins.mpi_packages(), **pins.ray_packages()}.items()]  # pins.ray: Ray last
    build = ("--transport", pins.transport, *(["--mpi"] if pins.mpi else []))
    return [
        Step("venv", check=("test", "-x", py), action=(host.python, "-m", "venv", env)),
        Step(f"torch {torch}", check=(py, "-c", versions_match),
             action=(py, "-m", "pip", "install", "--quiet", f"torch=={torch}", f"torchvision=={vision}"), env=penv),
        Step("hvdhetero", check=(py, "-c", stamp_matches), upload=(wheel, remote_wheel),
             action=("sh", "-c", 'set -e; "$1" -m pip install --quiet --force-reinstall --no-deps "$2"; '
                     '"$1" -m pip install --quiet "$2"; printf %s "$3" > "$4"', "sh", py, remote_wheel,
                     json.dumps({"digest": digest}), posixpath.join(env, STAMP)), env=penv),
        *packages,
        *engines,
        Step("horovod sdist", check=(py, "-c", sdist_ok), upload=(sdist, remote_sdist), action=("true",)),
        Step(f"horovod {pins.horovod} ({pins.transport}{', mpi' if pins.mpi else ''})",
             check=(py, "-m", "hvdhetero.cluster.horovod_build", "--check", *build),
             action=(py, "-m", "hvdhetero.cluster.horovod_build", "--install", *build), env=penv),
        Step(f"verify build{' (mpi)' if pins.mpi else ''} and device {host.device}", action=(), check=(
            py, "-c", horovod_build.VERIFY_PY,
            json.dumps({"mpi": pins.mpi, "devices": list(dict.fromkeys(host.device.split(",")))}))),
    ]


def build_artifacts(workdir: Path) -> tuple[str, str]:
    """(hvdhetero wheel of this checkout, verified Horovod sdist) on the launcher."""
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                           "-w", str(workdir), str(ROOT)], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise BuildError(f"could not build a wheel of {ROOT}:\n{proc.stderr[-3000:]}")
    wheel = next(workdir.glob("hvdhetero-*.whl"))
    sdist = horovod_build.fetch_sdist(sys.executable, horovod_build.HOROVOD_VERSION, horovod_build.default_cache())
    return str(wheel), str(sdist)


def provision_host(inventory: Inventory, host: Host, artifacts: tuple[str, str], digest: str, *,
                   accept_new: bool = False, install_system: bool = False, dry_run: bool = False,
                   log=print) -> HostReport:
    report = HostReport(host.name)
    try:
        conn = ssh.connect(host, inventory.known_hosts, accept_new=accept_new)
    except (HostKeyError, SSHAuthError) as e:
        return HostReport(host.name, "refused", reason=str(e))
    except UnreachableError as e:
        return HostReport(host.name, "unreachable", reason=str(e))
    try:
        with conn:
            r = ssh.run(conn, [host.python, "-c", FACTS_PY], timeout=60)
            if r.exited != 0:
                raise BuildError(f"{host.name}: cannot run {host.python}: {(r.stderr or r.stdout).strip()[-500:]}; "
                                 "install Python or set python: for this host")
            facts = json.loads(r.stdout.strip().splitlines()[-1])
            missing = missing_tools(facts, inventory.pins.transport)
            if missing:
                cmd = system_packages_command(facts)
                if not install_system or dry_run:
                    raise BuildError(f"{host.name}: missing {', '.join(missing)}; install with: "
                                     f"{' '.join(cmd)} (or rerun with --install-system-packages)")
                _do(conn, host, Step("system packages", action=tuple(cmd)), report, log)
            for step in plan(host, inventory.pins, facts, digest, *artifacts):
                if dry_run:
                    log(f"{host.name}: {step.name}: check {ssh.shlex.join(step.check or ())} "
                        f"else {ssh.shlex.join(step.action)}")
                    continue
                _do(conn, host, step, report, log)
    except HvdHeteroError as e:
        report.status, report.reason = "failed", str(e)
    except Exception as e:  # noqa: BLE001 - a step timed out, the connection dropped: this host failed, not all
        report.status, report.reason = "failed", f"{host.name}: {type(e).__name__}: {str(e).strip()[-300:]}"
    return report


UPLOAD_IDLE_S = 120
"""An upload (a wheel, the checkout) that moves nothing for this long fails that host's provision
(a Mac gone to sleep mid-upload), instead of waiting for the kernel's TCP timeout or for ever."""


def _do(conn, host: Host, step: Step, report: HostReport, log) -> None:
    if step.check is not None:
        checked = ssh.run(conn, step.check, env=dict(step.env))
        if checked.exited == 0:
            return
        if not step.action:
            said = (checked.stderr or checked.stdout).strip().splitlines()[-15:]
            raise BuildError(f"{host.name}: {step.name} failed (exit {checked.exited}):\n" + "\n".join(said))
    log(f"{host.name}: {step.name} ...")
    started = time.monotonic()
    if step.upload:
        local, remote = step.upload
        ssh.run(conn, ["mkdir", "-p", posixpath.dirname(remote)])
        conn.sftp().get_channel().settimeout(UPLOAD_IDLE_S)  # paramiko's SFTP waits for ever on a silent host
        conn.put(local, remote)
    r = ssh.run(conn, step.action, env=dict(step.env))
    if r.exited != 0:
        detail = (r.stderr or r.stdout).strip().splitlines()[-15:]
        raise BuildError(f"{host.name}: step '{step.name}' failed (exit {r.exited}):\n" + "\n".join(detail))
    report.status = "changed"
    report.changes.append(step.name)
    log(f"{host.name}: {step.name}: done in {time.monotonic() - started:.0f} s")


def provision(inventory: Inventory, hosts: list[Host], *, accept_new: bool = False,
              install_system: bool = False, dry_run: bool = False, log=print) -> list[HostReport]:
    """Provision `hosts` in parallel; one report per host, in order. A local host (address
    localhost, which train starts without SSH) is set up here, as ci/setup does it."""
    log = whole_lines(log)
    reports = {h.name: _provision_here(inventory, h, dry_run, log) for h in hosts if h.is_local}
    remote = [h for h in hosts if not h.is_local]
    if remote:
        with tempfile.TemporaryDirectory(prefix="hvdhetero-wheel-") as tmp:
            artifacts = build_artifacts(Path(tmp))
            digest = source_digest()
            with ThreadPoolExecutor(max_workers=len(remote)) as pool:
                futures = [pool.submit(provision_host, inventory, h, artifacts, digest, accept_new=accept_new,
                                       install_system=install_system, dry_run=dry_run, log=log) for h in remote]
                reports.update((h.name, f.result()) for h, f in zip(remote, futures))
    return [reports[h.name] for h in hosts]


def _provision_here(inventory: Inventory, host: Host, dry_run: bool, log) -> HostReport:
    """A local host's env brought to the pins on this machine (cluster/provision.py's setup_local,
    what ci/setup runs): `invoke provision` asked localhost:22 for an sshd and failed, exit 3."""
    from hvdhetero.cluster import provision as here

    if dry_run:
        log(f"{host.name}: a local host: its env is set up here as ci/setup does; a dry run changes nothing")
        return HostReport(host.name)
    try:
        changed = here.setup_local(inventory.path, host.name, log=lambda line: log(f"{host.name}: {line}"))
    except HvdHeteroError as e:
        return HostReport(host.name, "failed", reason=str(e))
    return HostReport(host.name, "changed" if changed else "ok", changes=changed)


def whole_lines(log):
    """`log` called by one host's thread at a time: print writes a line's text and its newline
    separately, and two hosts finishing a step in the same second printed
    "h2: hvdhetero ...h1: torch 2.14.1: done in 56 s" (a CI run's provision)."""
    lock = threading.Lock()

    def one_at_a_time(line: str) -> None:
        with lock:
            log(line)
    return one_at_a_time


def exit_code(results) -> int:
    return group_exit_code(r.status for r in results)


def table(reports: list[HostReport]) -> str:
    width = max(len(r.host) for r in reports)
    lines = [f"{'host':{width}}  status       what"]
    for r in reports:
        what = ", ".join(r.changes) if r.status == "changed" else (
            "nothing changed" if r.status == "ok" else r.reason.splitlines()[0] if r.reason else "")
        lines.append(f"{r.host:{width}}  {r.status:11}  {what}")
        lines += [f"{'':{width}}               {line}" for line in r.reason.splitlines()[1:]]
    return "\n".join(lines)
