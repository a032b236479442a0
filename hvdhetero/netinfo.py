"""Which local network interface leads to an address (launcher side and rank side)."""

from __future__ import annotations

import socket


def local_address_towards(address: str, port: int = 9) -> str:
    """The local IP the kernel would use to reach `address`. A UDP connect sends no packet."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((address, port))
        return s.getsockname()[0]


def interface_towards(address: str) -> str | None:
    """The name of the NIC that routes to `address`, or None if it cannot be told."""
    import psutil  # installed with Horovod; imported here so the launcher starts without it

    try:
        ip = local_address_towards(socket.gethostbyname(address))
    except OSError:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == ip for a in addrs):
            return name
    return None
