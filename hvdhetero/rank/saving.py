"""`torch.save(obj, "model.pth")` of the script's own, written atomically on a rank.

A one-device script saves to a path and often loads it straight back (PyTorch's quickstart saves
model.pth, then makes a new model and loads it). Every rank runs that code, and the ranks on one
host (the `local` host's two) write the same file at the same moment: one truncates and rewrites
what the other is reading, which fails in torch's loader ("Cannot use weights_only=True with files
saved in the legacy .tar format", "PytorchStreamReader failed reading zip archive"): 2 loads in 30
failed when two local ranks saved and loaded a 2.7 MB state dict after a barrier.

Replaced once a process by the runner, before the script runs: a save to a path of a regular file
(or of none yet) goes to a temporary file in the same folder, renamed over the path when written
whole, with the mode torch's own would leave it with (an existing file's, else open()'s). A
reader then finds the old file or the new one, never half of one; the ranks' models are one, so
either is the same. A file object, a symlink, a folder that cannot take the temporary file:
torch's own save, as it was.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch


def install() -> None:
    """Replace torch.save (once a process)."""
    torchs = torch.save
    if getattr(torchs, "_hvdhetero_torch", None) is not None:
        return
    umask = os.umask(0)
    os.umask(umask)

    def save(obj, f, *args, **kwargs):
        if not isinstance(f, (str, os.PathLike)):
            return torchs(obj, f, *args, **kwargs)
        path = Path(f)
        if path.is_symlink() or (path.exists() and not path.is_file()) or not os.access(path.parent or ".", os.W_OK):
            return torchs(obj, f, *args, **kwargs)
        mode = path.stat().st_mode & 0o777 if path.exists() else 0o666 & ~umask  # what torch's leaves it with
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        try:
            torchs(obj, tmp, *args, **kwargs)
            os.chmod(tmp, mode)  # not mkstemp's 0600
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return None

    save.__doc__, save.__qualname__, save.__wrapped__ = torchs.__doc__, torchs.__qualname__, torchs
    save._hvdhetero_torch = torchs
    torch.save = save
