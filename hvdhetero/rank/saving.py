"""`torch.save(obj, "model.pth")` of the script's own, written atomically on a rank.

A one-device script saves to a path and often loads it straight back (PyTorch's quickstart saves
model.pth, then makes a new model and loads it). Every rank runs that code, and the ranks on one
host (the `local` host's two) write the same file at the same moment: one truncates and rewrites
what the other is reading, which fails in torch's loader ("Cannot use weights_only=True with files
saved in the legacy .tar format", "PytorchStreamReader failed reading zip archive"): 2 loads in 30
failed when two local ranks saved and loaded a 2.7 MB state dict after a barrier.

Replaced once a process by the runner, before the script runs: a save to a path of a writable
regular file (or of none yet) goes to a temporary file in the same folder, renamed over the path
when written whole, with the mode torch's own would leave it with (an existing file's, else
open()'s under the umask in force). A reader then finds the old file or the new one, never half of
one; the ranks' models are one, so either is the same. A file object, a symlink, a file torch
could not write (read-only), a folder that cannot take the temporary file or refuses the rename:
torch's own save, as it was.

A `torch.load` of the name the script gave `job.save` (a port of that quickstart that turned its
save into `job.save(state, "model.pth")` and kept `torch.load("model.pth")`) reads another file:
job.save wrote into the run directory, and the path is the working folder's, a file of an earlier
run (a stale model, evaluated silently) or none. Such a load is refused, naming both paths and the
way out, unless that file was written in this run (a torch.save of the script's own too, before or
after job.save).
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import torch

from hvdhetero.rank import checkpoint

_SAVED: dict[str, Path] = {}
"""job.save's names in this process (normalised), each with the path it wrote."""
_SINCE = time.time()
"""When this run began here (install() sets it, before the script runs): a file older is an earlier run's."""


def saved(name: str, path: Path) -> None:
    """job.save(obj, `name`) wrote `path` (on rank 0; every rank that calls it records it)."""
    _SAVED[os.path.normpath(name)] = Path(path)


def elsewhere(f) -> str | None:
    """Why a torch.load of `f` does not read what job.save wrote under that name, or None."""
    if not _SAVED or not isinstance(f, (str, os.PathLike)):
        return None
    name = os.path.normpath(os.fspath(f))
    if name not in _SAVED:
        return None
    wrote = _SAVED[name]
    here = Path(name).resolve()
    if here == wrote.resolve():
        return None
    try:
        written = here.stat().st_mtime
    except OSError:
        found = "no file"
    else:
        if written >= _SINCE - 2.0:  # written in this run (the script's own torch.save too)
            return None
        found = f"an older file, of {time.strftime('%Y-%m-%d %H:%M', time.localtime(written))}"
    return (f"torch.load({os.fspath(f)!r}) reads {here}, which is {found}: the script's job.save(..., {name!r}) "
            f"wrote its file to the run directory, {wrote} (on rank 0's host). Load that path "
            f"(os.path.join(job.run_dir, {name!r}), on rank 0), or keep torch.save(..., {name!r}) in place of "
            "job.save, which every rank writes whole and can read back")


def in_an_earlier_run(err: BaseException, run_dir: str) -> str:
    """For a FileNotFoundError of a relative path that an earlier run's job.save wrote (a script's own
    `--resume out/checkpoint.pt` after `job.save(..., "out/checkpoint.pt")`, which went into that run's
    directory): where the newest such file is, as a hint after the error; else ''."""
    name = getattr(err, "filename", None) if isinstance(err, FileNotFoundError) else None
    if not isinstance(name, str) or not name or os.path.isabs(name) or name.startswith(".."):
        return ""
    runs = Path(run_dir).parent
    try:
        import glob

        found = [(p.stat().st_mtime, p) for p in runs.glob(f"*/{glob.escape(os.path.normpath(name))}") if p.is_file()]
    except (OSError, ValueError):  # a name glob cannot take, a file gone meanwhile: no hint
        return ""
    if not found:
        return ""
    newest = max(found)[1]
    return (f" (job.save writes into the run directory: {newest} is the newest {name} under {runs}, an earlier "
            f"run's; pass its path)")


def install() -> None:
    """Replace torch.save (once a process)."""
    global _SINCE
    _SINCE = time.time()
    torchs = torch.save
    if getattr(torchs, "_hvdhetero_torch", None) is not None:
        return

    def save(obj, f, *args, **kwargs):
        if not isinstance(f, (str, os.PathLike)):
            return torchs(obj, f, *args, **kwargs)
        path = Path(f)
        exists = path.exists()
        if path.is_symlink() or (exists and not (path.is_file() and os.access(path, os.W_OK))) \
                or not os.access(path.parent, os.W_OK):  # a link, a file torch could not write: torch's own
            return torchs(obj, f, *args, **kwargs)
        try:  # made as open() makes a file: the umask in force now applies
            fd, tmp = checkpoint.temporary_beside(path)
            os.close(fd)
        except OSError:  # a name too long with the suffix, a folder that takes no new file
            return torchs(obj, f, *args, **kwargs)
        try:
            torchs(obj, str(tmp), *args, **kwargs)
            if exists:  # the mode torch's own save leaves it with
                with contextlib.suppress(OSError):  # (a filesystem without modes: vfat)
                    os.chmod(tmp, path.stat().st_mode & 0o777)
            try:
                os.replace(tmp, path)
            except OSError:  # a rename this folder refuses (sticky, another user's file): torch's own save
                tmp.unlink(missing_ok=True)
                return torchs(obj, f, *args, **kwargs)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return None

    save.__doc__, save.__qualname__, save.__wrapped__ = torchs.__doc__, torchs.__qualname__, torchs
    save._hvdhetero_torch = torchs
    torch.save = save
    torchl = torch.load

    def load(f, *args, **kwargs):
        if said := elsewhere(f):
            raise FileNotFoundError(said)
        return torchl(f, *args, **kwargs)

    load.__doc__, load.__qualname__, load.__wrapped__ = torchl.__doc__, torchl.__qualname__, torchl
    torch.load = load
