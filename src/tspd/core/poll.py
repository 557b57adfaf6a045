"""``TransferPoll``: a room's status, on the wire and in the replica agreement (spec §7.1)."""

from __future__ import annotations

import enum

__all__ = ["TransferPoll"]


class TransferPoll(enum.IntEnum):
    """Room status values. The integer values are wire values and their order is
    the MIN order of the replica agreement (spec §7.7)."""

    FAILED = 0
    BOOTSTRAPPING = 1
    BOOTSTRAPPED = 2
    WAITING_FOR_INPUT = 3
    TRANSFERRING = 4
    SUCCESS = 5

    @classmethod
    def from_wire(cls, value: int) -> TransferPoll:
        """Map an agreed or received integer to a status; unknown values read as
        ``FAILED`` (R-pd's ``TransferPoll::from_wire``)."""
        try:
            return cls(value)
        except ValueError:
            return cls.FAILED

    @property
    def label(self) -> str:
        """The name TokenSpeed prints, e.g. ``TransferPoll.Bootstrapping``."""
        return "TransferPoll." + "".join(p.capitalize() for p in self.name.split("_"))
