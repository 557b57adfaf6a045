"""``TransferPoll``: a room's status, on the wire and in the replica agreement.

The values are those of docs/protocol.md#proto-transfer-poll.
"""

from __future__ import annotations

import enum
import random

__all__ = ["FaultInjection", "TransferPoll"]


class TransferPoll(enum.IntEnum):
    """Room status values. The integer values are wire values and their order is
    the MIN order of the replica agreement (docs/protocol.md#proto-replica-agreement)."""

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


class FaultInjection:
    """TokenSpeed's poll-time fault injection (``DISAGGREGATION_TEST_FAILURE_PROB``):
    each unconcluded request's local poll value turns ``Failed`` with probability
    ``prob`` before the replica agreement. For tests of failure handling only.

    ``seed`` makes the draws reproducible; the core passes no clock or global
    state in, so a seeded run repeats exactly.
    """

    __slots__ = ("_draw", "prob")

    def __init__(self, prob: float, seed: int | None = None) -> None:
        self.prob = prob
        self._draw = random.Random(seed).random

    def fires(self) -> bool:
        """Whether this request's value is replaced by ``Failed`` this poll."""
        return self._draw() < self.prob

    def reason(self, room: int) -> str:
        """The failure reason recorded for ``room`` when it fires."""
        return (
            f"Request {room} failed by fault injection "
            f"(DISAGGREGATION_TEST_FAILURE_PROB={self.prob}); unset it outside tests"
        )
