"""The folder a user's script starts in, shipped to every remote host under its content digest.

`invoke train --script PATH` runs each remote rank in `~/.hvdhetero/workdirs/<digest>/`, a copy
of the script's folder (or `--workdir`). The name is a digest of exactly the files copied, so an
unchanged folder is found on the host and not copied again, and two versions never mix:

    d = digest(folder)                     # what the rank's --workdir names: "~/" + remote_dir(d)
    ship(inventory, hosts, folder)         # {"pc": "copied", "mac": "unchanged"}

A copy goes over the same checked SSH as everything else (rsync as launch.push_command builds
it) into a temporary sibling, which is renamed into place with its completion marker already
inside, so a half-copied folder is never used; a leftover temporary folder is harmless.

Launcher side: never imports torch or horovod.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import stat
import subprocess
import sys
import tempfile
import warnings
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from fnmatch import fnmatchcase
from pathlib import Path

from hvdhetero.cluster import launch, ssh
from hvdhetero.cluster.inventory import Host, Inventory
from hvdhetero.errors import ConfigError, HvdHeteroError, LaunchError

WORKDIRS = ".hvdhetero/workdirs"
"""Where the copies live on each host, relative to its home."""
MARKER = ".hvdhetero-complete"
"""Present in a copy once it is whole; the launcher trusts no copy without it."""
IGNORE_FILE = ".hvdheteroignore"
"""In the folder: one glob per line of what stays behind; `#` starts a comment."""
ALWAYS_IGNORED = (".git", "__pycache__", ".venv", "venv", "runs", ".pytest_cache", "*.pyc")

# A workdir holds code and small files; datasets go to each host once with `invoke push-data`.
MAX_BYTES = 200 * 1000**2
MAX_FILES = 20_000

CHECK_TIMEOUT_S = 60  # each small remote command (test, mkdir, the rename)
COPY_TIMEOUT_S = 1200  # the whole rsync; rsync's own --timeout ends a stalled one sooner
MAX_PARALLEL = 8

# Run by the host's Python from its home: put the copied folder in place, marker inside, with one
# atomic rename. Test hosts (and a launcher racing another) may share one home: whoever renames
# second finds a complete copy there and drops its own.
FINALIZE_PY = """\
import os, shutil, sys
tmp, final, marker = sys.argv[1:]
os.makedirs(tmp, exist_ok=True)  # rsync creates nothing for an empty file list
open(os.path.join(tmp, marker), "w").close()
for _ in range(3):
    try:
        os.rename(tmp, final)
        sys.exit(0)
    except OSError:
        if os.path.isfile(os.path.join(final, marker)):
            shutil.rmtree(tmp, ignore_errors=True)
            sys.exit(0)
        try:  # a copy without its marker was never used: set it aside
            os.rename(final, tmp + ".stale")
            shutil.rmtree(tmp + ".stale", ignore_errors=True)
        except OSError:
            pass
sys.exit("cannot rename %s to %s" % (tmp, final))
"""


THIS_PYTHON = "%d.%d" % sys.version_info[:2]
"""The launcher's Python, as pins.python names a version."""


def locate(script: str, workdir: str = "", syntax: bool = True) -> tuple[Path, str]:
    """(the folder the ranks start in, the script's path inside it) for `invoke train --script
    SCRIPT [--workdir DIR]`: DIR, by default the script's own folder. `syntax`: this Python reads
    the script as the ranks' does (a local rank runs it, or pins.python is this one): one it
    cannot compile is refused here."""
    path = Path(script).resolve()
    if not path.is_file():
        raise ConfigError(f"--script {script}: no such file")
    if syntax:
        _compiles(script, path)
    folder = Path(workdir).resolve() if workdir else path.parent
    if not folder.is_dir():
        raise ConfigError(f"--workdir {workdir}: no such directory")
    if not path.is_relative_to(folder):
        raise ConfigError(f"--script {script} is not inside --workdir {folder}: the ranks start there, and only "
                          "that folder is shipped to the hosts")
    return folder, path.relative_to(folder).as_posix()


def _compiles(script: str, path: Path) -> None:
    """A script that is not valid Python is refused before any rank starts, with its line."""
    try:
        with warnings.catch_warnings():  # the script's own SyntaxWarnings are the ranks' to show
            warnings.simplefilter("ignore")
            compile(path.read_bytes(), str(path), "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as e:  # ValueError: a NUL byte
        line = getattr(e, "lineno", None)
        text = (getattr(e, "text", None) or "").strip()
        shown = f"\n    {text}" if text else ""
        raise ConfigError(f"--script {script}{f':{line}' if line else ''}: {type(e).__name__}: "
                          f"{getattr(e, 'msg', None) or e}{shown}\n  (Python {THIS_PYTHON} read it; nothing was "
                          "started)") from None


def ignore_patterns(folder: Path) -> tuple[str, ...]:
    """The built-in globs plus those of the folder's .hvdheteroignore (blank lines and # comments
    skipped; a trailing or leading / is dropped: `data/` means the folder data)."""
    path = Path(folder) / IGNORE_FILE
    try:
        lines = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read it as UTF-8 text ({e}); write one glob per line") from None
    own = (line.strip().strip("/") for line in lines if not line.strip().startswith("#"))
    return ALWAYS_IGNORED + tuple(p for p in own if p)


def is_ignored(rel: Path, patterns: Sequence[str]) -> bool:
    """True when a glob matches the relative path or any one of its components."""
    text = rel.as_posix()
    return any(fnmatchcase(text, p) or any(fnmatchcase(part, p) for part in rel.parts) for p in patterns)


def files(folder: Path) -> list[Path]:
    """The files to ship, relative to `folder`, sorted by POSIX path: everything not ignored,
    a symlink inside the folder standing for what it points to. ConfigError for a symlink out of
    the folder and for a folder over MAX_BYTES or MAX_FILES."""
    root = Path(folder).resolve()
    if not root.is_dir():
        raise ConfigError(f"{folder}: not a directory; the ranks start in a folder (the script's, or --workdir)")
    patterns = ignore_patterns(root)
    found: list[Path] = []
    size, by_top = 0, Counter()
    stack = [(Path(), frozenset([root]))]  # (folder to list, real folders above it: a loop guard)
    while stack:
        rel_dir, above = stack.pop()
        try:
            entries = sorted(e.name for e in os.scandir(root / rel_dir))
        except OSError as e:
            raise _unreadable(root, rel_dir, e) from None
        for name in entries:
            rel = rel_dir / name
            if is_ignored(rel, patterns):
                continue
            path = root / rel
            real = _followed(root, rel) if path.is_symlink() else path
            if path.is_dir():
                if real.resolve() in above:
                    raise ConfigError(f"{root}: {rel.as_posix()} is a symlink back to {real.resolve()}, a loop; "
                                      f"remove it, or list it in {root / IGNORE_FILE}")
                stack.append((rel, above | {real.resolve()}))
            elif path.is_file():
                try:
                    n = path.stat().st_size
                except OSError as e:
                    raise _unreadable(root, rel, e) from None
                size += n
                by_top[rel.parts[0]] += n
                found.append(rel)
                if size > MAX_BYTES or len(found) > MAX_FILES:
                    raise _too_big(root, size, len(found), by_top)
            # sockets and fifos are not files anyone can ship: left behind
    return sorted(found, key=Path.as_posix)


def digest(folder: Path) -> str:
    """16 hex digits of sha256 over `files(folder)`: each one's POSIX path, executable bit, size
    and contents. Stable across calls and machines; mtimes and ignored files do not count."""
    root = Path(folder).resolve()
    return _digest(root, files(root))


def remote_dir(d: str) -> str:
    """The copy's path on every host, relative to its home (the same string everywhere, since
    horovodrun runs one command line on all hosts; the rank expands it against its $HOME)."""
    assert re.fullmatch(r"[0-9a-f]{16}", d), d
    return f"{WORKDIRS}/{d}"


def copy_command(inventory: Inventory, host: Host, folder: Path, file_list: Path, dest: str) -> list[str]:
    """launch.push_command's rsync over the checked ssh, copying only the files named in
    `file_list` (NUL-separated, relative to `folder`) into the directory `dest`; a symlink is
    copied as what it points to. The trailing slash on `dest`: a lone file would otherwise be
    copied *as* `dest` (seen with a one-file folder)."""
    argv = launch.push_command(inventory, host, str(folder), dest.rstrip("/") + "/")
    return [argv[0], f"--files-from={file_list}", "--from0", "--copy-links", *argv[1:]]


def ship(inventory: Inventory, hosts: Sequence[Host], folder: Path, *, accept_new: bool = False,
         expect: str | None = None) -> dict[str, str]:
    """Put `folder` at ~/remote_dir(digest) on every remote host, in parallel: {host name:
    "copied" | "unchanged"}. Local hosts are skipped (their ranks start in `folder` itself).
    One LaunchError names every host that failed and why. `expect`: the digest the ranks'
    command line already names; a folder that changed since is refused, not shipped."""
    remote = [h for h in hosts if not h.is_local]
    if not remote:
        return {}
    root = Path(folder).resolve()
    paths = files(root)
    d = _digest(root, paths)
    if expect is not None and d != expect:
        raise LaunchError(f"{root} changed while the job was being launched (digest {expect}, now {d}); "
                          "run the command again")
    with tempfile.TemporaryDirectory(prefix="hvdhetero-workdir-") as tmp:
        listing = Path(tmp) / "files"
        listing.write_bytes(b"".join(os.fsencode(p.as_posix()) + b"\0" for p in paths))
        with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL, len(remote))) as pool:
            futures = [pool.submit(_ship_host, inventory, h, root, d, listing, accept_new) for h in remote]
            results = [f.result() for f in futures]
    failed = {h.name: why for h, (_, why) in zip(remote, results) if why}
    if failed:
        lines = [why if why.startswith(name) else f"{name}: {why}" for name, why in failed.items()]
        raise LaunchError(f"could not ship the workdir {root} to {', '.join(failed)}:\n  " + "\n  ".join(lines))
    return {h.name: status for h, (status, _) in zip(remote, results)}


def _ship_host(inventory: Inventory, host: Host, root: Path, d: str, listing: Path, accept_new: bool
               ) -> tuple[str, str]:
    """(status, "") or ("failed", why): one host's failure must not hide the others'."""
    try:
        return _copy_unless_there(inventory, host, root, d, listing, accept_new), ""
    except HvdHeteroError as e:  # unreachable, host key, auth: their messages name the host and the fix
        return "failed", str(e)
    except Exception as e:  # noqa: BLE001 - a timeout or a dropped connection, reported with the others
        return "failed", f"{host.name}: {type(e).__name__}: {e}"


def _copy_unless_there(inventory: Inventory, host: Host, root: Path, d: str, listing: Path,
                       accept_new: bool) -> str:
    final = remote_dir(d)
    with ssh.connect(host, inventory.known_hosts, accept_new=accept_new) as conn:
        if ssh.run(conn, ["test", "-f", f"{final}/{MARKER}"], timeout=CHECK_TIMEOUT_S).exited == 0:
            return "unchanged"
        _expect(host, "mkdir -p " + WORKDIRS, ssh.run(conn, ["mkdir", "-p", WORKDIRS], timeout=CHECK_TIMEOUT_S))
        tmp = f"{final}.tmp-{secrets.token_hex(6)}"
        argv = copy_command(inventory, host, root, listing, tmp)
        try:
            proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=COPY_TIMEOUT_S)
        except FileNotFoundError:
            raise LaunchError(f"{host.name}: rsync is not installed on this machine; install it "
                              "(apt-get install rsync; macOS has it)") from None
        except subprocess.TimeoutExpired:
            _remove(conn, tmp)
            raise LaunchError(f"{host.name}: copying {root} took over {COPY_TIMEOUT_S} s; is the network "
                              f"slow, or should {root / IGNORE_FILE} leave more behind?") from None
        if proc.returncode != 0:
            _remove(conn, tmp)
            detail = "\n".join(proc.stderr.strip().splitlines()[-5:])
            raise LaunchError(f"{host.name}: rsync exited {proc.returncode} (rsync must be installed on both "
                              f"machines):\n{detail}")
        _expect(host, "putting the copy in place",
                ssh.run(conn, [host.python, "-c", FINALIZE_PY, tmp, final, MARKER], timeout=CHECK_TIMEOUT_S))
    return "copied"


def _remove(conn, tmp: str) -> None:
    """Best effort: a leftover temporary copy is harmless, the error that caused it is not."""
    try:
        ssh.run(conn, ["rm", "-rf", tmp], timeout=CHECK_TIMEOUT_S)
    except Exception:  # noqa: BLE001
        pass


def _expect(host: Host, what: str, result: ssh.Result) -> None:
    if result.exited != 0:
        detail = (result.stderr or result.stdout).strip()[-500:]
        raise LaunchError(f"{host.name}: {what} failed (exit {result.exited}): {detail}")


def _digest(root: Path, paths: Sequence[Path]) -> str:
    h = hashlib.sha256()
    for rel in paths:
        try:
            with open(root / rel, "rb") as f:
                st = os.fstat(f.fileno())
                executable = b"1" if st.st_mode & stat.S_IXUSR else b"0"
                h.update(os.fsencode(rel.as_posix()) + b"\0" + executable + b"\0" + str(st.st_size).encode() + b"\0")
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
        except OSError as e:
            raise _unreadable(root, rel, e) from None
    return h.hexdigest()[:16]


def _followed(root: Path, rel: Path) -> Path:
    """Where the symlink `rel` leads, which must be an existing path inside `root`."""
    link = root / rel
    try:
        target = link.resolve(strict=True)
    except (OSError, RuntimeError):  # dangling, or a loop of links
        raise ConfigError(f"{root}: {rel.as_posix()} is a symlink to {os.readlink(link)}, which does not exist; "
                          f"remove it, or list it in {root / IGNORE_FILE}") from None
    if not target.is_relative_to(root):
        raise ConfigError(f"{root}: {rel.as_posix()} is a symlink to {target}, outside the folder, so the hosts "
                          f"would not get it; copy what it points to into the folder, or list {rel.as_posix()} "
                          f"in {root / IGNORE_FILE} (datasets belong on each host: invoke push-data --src DIR)")
    return target


def _unreadable(root: Path, rel: Path, error: OSError) -> ConfigError:
    return ConfigError(f"{root}: cannot read {rel.as_posix() or '.'}: {error.strerror or error}; make it "
                       f"readable, or list it in {root / IGNORE_FILE}")


def _too_big(root: Path, size: int, count: int, by_top: Counter) -> ConfigError:
    largest = ", ".join(f"{name} {_mb(n)}" for name, n in by_top.most_common(3))
    return ConfigError(
        f"{root}: too big to ship to every host: {_mb(size)} in {count} files so far, over the limit of "
        f"{_mb(MAX_BYTES)} or {MAX_FILES} files (largest: {largest}). List what the ranks do not need in "
        f"{root / IGNORE_FILE} (one glob per line), or pass --workdir a smaller folder; datasets belong on "
        "each host: invoke push-data --src DIR")


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"
