"""Free TCP ports on an explicit host, for endpoints that must be known before binding.

Some endpoints have to be chosen before the socket that uses them exists (the
replica-agreement ranks' PULL addresses, handed to every rank up front). Binding
port 0, reading the port and closing the socket (TokenSpeed's way,
docs/protocol.md#proto-zmq) races with every connection the host opens meanwhile:
the kernel hands out the same ephemeral range for outgoing connections, and a busy
host (a test suite, a demo's many ranks) can take the port before its owner binds
it. :func:`free_port` therefore picks a random port *below* the kernel's ephemeral
range (``/proc/sys/net/ipv4/ip_local_port_range``), which neither outgoing
connections nor port-0 binds ever use, and checks that it binds; only two callers
picking the same one of ~20,000 ports at once can still collide.
"""

from __future__ import annotations

import functools
import secrets
import socket
from pathlib import Path
from typing import Final

__all__ = ["free_port", "port_range"]

#: Lowest port :func:`free_port` picks (below: well-known and commonly configured
#: service ports).
LOWEST_PORT: Final = 10_000
#: Linux's default first ephemeral port, assumed when the kernel's range is unreadable.
DEFAULT_EPHEMERAL_LOW: Final = 32_768
#: Random ports tried before falling back to a port-0 probe.
_ATTEMPTS: Final = 64
_RANGE_FILE: Final = Path("/proc/sys/net/ipv4/ip_local_port_range")


@functools.cache
def port_range() -> range:
    """The ports :func:`free_port` picks from: from :data:`LOWEST_PORT` up to the
    kernel's first ephemeral port; empty when the ephemeral range starts lower."""
    try:
        low = int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = DEFAULT_EPHEMERAL_LOW
    return range(LOWEST_PORT, max(LOWEST_PORT, low))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago, from :func:`port_range`
    when it has one (chosen with ``secrets``, so forked processes do not pick
    alike); else, or after 64 taken ones, a port-0 probe's."""
    ports = port_range()
    for _ in range(_ATTEMPTS if ports else 0):
        port = ports[secrets.randbelow(len(ports))]
        if _binds(host, port):
            return port
    return _probe(host)


def _binds(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
        return True


def _probe(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        port = probe.getsockname()[1]
        assert isinstance(port, int)
        return port
