"""The exceptions hvdhetero raises on bad input or a failed step, and their exit codes.

Exit codes (documented in the README):
  0  success
  1  a step failed (a build, a training run, a rank died)
  2  bad input: inventory, config or command-line value; nothing was contacted or written
  3  a host could not be reached (down, no route, sshd not answering)
  4  SSH refused: a host key unknown or changed, or no key accepted
"""

from __future__ import annotations


def briefly(err: BaseException, lines: int = 1, width: int = 160) -> str:
    """An exception in one short line: its type and its message's first `lines` lines, joined
    (torch's state_dict errors put the detail on the second), cut to `width`."""
    text = " ".join(line.strip() for line in str(err).strip().splitlines()[:lines])
    text = text if len(text) <= width else text[:width - 3] + "..."
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


class HvdHeteroError(Exception):
    """Base class: a message for the user and the exit code the CLI ends with."""

    exit_code = 1


class ConfigError(HvdHeteroError):
    """A value given by the user (flag, config) is invalid."""

    exit_code = 2


TOP = "(top level)"
"""The key of a problem with the file as a whole (missing, not YAML, not a mapping)."""


class YamlFileError(ConfigError):
    """A YAML file the user wrote is malformed; the message names the file, line, key and what is allowed."""

    def __init__(self, path: str, line: int | None, key: str, problem: str):
        self.path, self.line, self.key, self.problem = str(path), line, key, problem
        where = f"{self.path}:{line}" if line is not None else self.path
        super().__init__(f"{where}: {problem}" if key == TOP else f"{where}: key '{key}': {problem}")


class InventoryError(YamlFileError):
    """inventory.yaml is malformed."""


class SpaceError(YamlFileError):
    """A sweep's space file is malformed."""


class BuildError(HvdHeteroError):
    """Building or installing our patched Horovod failed."""


class DataError(HvdHeteroError):
    """A dataset is missing or unreadable; the message says where to place the files."""

    exit_code = 2


class LaunchError(HvdHeteroError):
    """The distributed job could not be started or a rank failed."""


class UnreachableError(HvdHeteroError):
    """A host could not be reached over SSH."""

    exit_code = 3


class HostKeyError(HvdHeteroError):
    """A host's SSH key is not in known_hosts, or differs from the one recorded there."""

    exit_code = 4


class SSHAuthError(HvdHeteroError):
    """The host accepted none of our keys (we never try passwords)."""

    exit_code = 4


def group_exit_code(statuses) -> int:
    """One exit code for per-host results: 1 if a step failed anywhere, else 4 if SSH was
    refused, else 3 if a host was unreachable, else 0."""
    statuses = set(statuses)
    for status, code in (("failed", 1), ("refused", 4), ("unreachable", 3)):
        if status in statuses:
            return code
    return 0
