"""The error types of the sans-IO core.

Every error raised by :mod:`tspd.core` is a :class:`TspdError`. Error messages that
the protocol fixes (docs/protocol.md#proto-reference) are reproduced verbatim,
because peers and operators match on them.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "ContractError",
    "PlanError",
    "ProtocolError",
    "TspdError",
    "WireError",
]


class TspdError(Exception):
    """Root of every error tspd raises on purpose."""


class WireError(TspdError, ValueError):
    """A message or payload from a peer is malformed.

    Every decoder in :mod:`tspd.core` raises this (or a subclass) and nothing else
    for bad input; ``str(err)`` is the specification's exact message.
    """


class ContractError(WireError):
    """A cache transfer contract, block manifest or selection is invalid
    (TokenSpeed's ``CacheContractError``)."""


class PlanError(TspdError, ValueError):
    """A transfer route or copy plan cannot be built (incompatible peers,
    unsupported topology, a copy that would leave an arena)."""


class ConfigError(TspdError, ValueError):
    """A configuration value (topology, environment variable, endpoint) is invalid."""


class ProtocolError(TspdError):
    """A room state machine was driven with a trigger its state does not allow."""
