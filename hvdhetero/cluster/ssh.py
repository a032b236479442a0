"""SSH to inventory hosts with Fabric: keys only, host keys checked, commands quoted.

Fabric's Connection installs paramiko's AutoAddPolicy (fabric#2071), which accepts any
unknown host key silently; every connection made here replaces it with a policy that refuses
unknown keys (showing the fingerprint to verify) unless the user opted in to accept new ones,
and loads the known_hosts file first, so a changed key is refused too. No password is ever
tried or prompted for, stdin is closed, and every wait has a timeout.

Remote commands are lists, joined with shlex: nothing from the inventory reaches a remote
shell unquoted.
"""

from __future__ import annotations

import base64
import hashlib
import os
import shlex
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import paramiko
from fabric import Connection

from hvdhetero.errors import HostKeyError, HvdHeteroError, SSHAuthError, UnreachableError
from hvdhetero.cluster.inventory import Host

CONNECT_TIMEOUT_S = 10
COMMAND_TIMEOUT_S = 1800  # a remote Horovod build is the longest step


def fingerprint(key: paramiko.PKey) -> str:
    """The SHA256 fingerprint as ssh-keygen -lf prints it."""
    digest = base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")
    return f"{key.get_name()} SHA256:{digest}"


def known_hosts_path(path: str | None) -> Path:
    return Path(os.path.expanduser(path or "~/.ssh/known_hosts"))


def _host_entry(host: Host) -> str:
    return host.address if host.port == 22 else f"[{host.address}]:{host.port}"


class _Policy(paramiko.MissingHostKeyPolicy):
    """Refuse an unknown key (naming its fingerprint), or with accept_new record it."""

    def __init__(self, host: Host, known_hosts: Path, accept_new: bool):
        self.host, self.known_hosts, self.accept_new = host, known_hosts, accept_new

    def missing_host_key(self, client, hostname, key):
        if not self.accept_new:
            raise HostKeyError(
                f"{self.host.name} ({self.host.address}): host key not in {self.known_hosts}: {fingerprint(key)}. "
                f"Check it on the host (ssh-keygen -lf /etc/ssh/ssh_host_{key.get_name().split('-')[-1]}_key.pub), "
                f"then connect once with ssh to record it, or pass --accept-new-host-keys")
        self.known_hosts.parent.mkdir(parents=True, exist_ok=True)
        with open(self.known_hosts, "a") as f:
            f.write(f"{_host_entry(self.host)} {key.get_name()} {key.get_base64()}\n")


@dataclass(frozen=True)
class Result:
    stdout: str
    stderr: str
    exited: int


def connect(host: Host, known_hosts: str | None = None, accept_new: bool = False,
            timeout: float = CONNECT_TIMEOUT_S) -> Connection:
    """An open connection to `host`, its key checked; our errors name the host and the fix."""
    path = known_hosts_path(known_hosts)
    kwargs = {"look_for_keys": host.identity is None, "allow_agent": True, "banner_timeout": timeout,
              "auth_timeout": timeout}
    if host.identity:
        kwargs["key_filename"] = [os.path.expanduser(host.identity)]
    conn = Connection(host.address, user=host.user, port=host.port, connect_timeout=timeout,
                      connect_kwargs=kwargs)
    conn.client = paramiko.SSHClient()  # fresh client: no AutoAddPolicy, no system-wide keys
    if path.exists():
        conn.client.load_host_keys(str(path))
    conn.client.set_missing_host_key_policy(_Policy(host, path, accept_new))
    where = f"{host.name} ({host.user + '@' if host.user else ''}{host.address}:{host.port})"
    try:
        conn.open()
    except HvdHeteroError:
        raise
    except paramiko.BadHostKeyException as e:
        raise HostKeyError(f"{where}: host key CHANGED: {path} has {fingerprint(e.expected_key)}, the host "
                           f"offers {fingerprint(e.key)}. If the host was reinstalled, remove the old line "
                           f"(ssh-keygen -R {_host_entry(host)} -f {path}); otherwise do not connect") from None
    except paramiko.AuthenticationException:
        key = host.identity or "your ssh keys/agent"
        raise SSHAuthError(f"{where}: no key accepted ({key}); add your public key to ~/.ssh/authorized_keys "
                           f"on the host (ssh-copy-id), passwords are never tried") from None
    except (socket.timeout, TimeoutError):
        raise UnreachableError(f"{where}: no answer within {timeout:g} s; is it on, on this network, "
                               "and is Remote Login / sshd enabled?") from None
    except (OSError, paramiko.SSHException) as e:
        reason = str(e).removeprefix("[Errno None] ")
        raise UnreachableError(f"{where}: cannot connect: {reason}; is it on, and is sshd listening?") from None
    return conn


def run(conn: Connection, argv: Sequence[str], timeout: float = COMMAND_TIMEOUT_S, env: dict | None = None
        ) -> Result:
    """Run `argv` (quoted word by word) on the host, stdin closed; never raises on exit codes."""
    command = shlex.join(str(a) for a in argv)
    if env:
        command = shlex.join(["env", *(f"{k}={v}" for k, v in env.items())]) + " " + command
    r = conn.run(command, hide=True, warn=True, in_stream=False, timeout=timeout, pty=False)
    return Result(r.stdout, r.stderr, r.exited)
