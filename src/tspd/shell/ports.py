"""Free TCP ports on an explicit host, for endpoints that must be known before binding.

Some endpoints have to be chosen before the socket that uses them exists (the
replica-agreement ranks' PULL addresses, handed to every rank up front). Like
TokenSpeed (docs/protocol.md#proto-zmq) this binds an ephemeral port, reads it and closes it: racy
in principle, so callers bind soon after.
"""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        port = probe.getsockname()[1]
        assert isinstance(port, int)
        return port
