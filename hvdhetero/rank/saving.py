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
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

import torch


def install() -> None:
    """Replace torch.save (once a process)."""
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
        tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:  # made as open() makes a file: the umask in force now applies
            os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
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
