"""One scheduler iteration over a TP group: poll, MIN, conclude.

Every rank of an attention-TP group polls the same requests in the same order;
the values are agreed element-wise by MIN and every rank concludes with the agreed
list (docs/protocol.md#proto-replica-agreement). The ranks must all return the
same events (the same kinds for the same requests, in the same order): a
disagreement, or ranks tracking different numbers of requests, is an ``outcome``
violation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tspd.core.commands import Event
from tspd.sim.invariants import Check, Checker

__all__ = ["GroupCore", "iterate_group"]


class GroupCore(Protocol):
    """What an iteration needs of a core (both cores have it)."""

    def has_in_flight(self) -> bool: ...

    def poll_values(self, now: float) -> list[int]: ...

    def conclude(self, agreed: Sequence[int], now: float) -> list[Event]: ...


def iterate_group(
    checker: Checker, names: Sequence[str], cores: Sequence[GroupCore], now: float
) -> list[list[Event]] | None:
    """Run one iteration on every core of a group (``names`` are the ranks'); the
    events of every rank, or ``None`` when no rank had anything in flight."""
    if not any(core.has_in_flight() for core in cores):
        return None
    values = [core.poll_values(now) for core in cores]
    if len({len(v) for v in values}) != 1:
        checker.violate(Check.OUTCOME, names[0], f"ranks track different request counts: {values}")
    agreed = (
        values[0] if len(values) == 1 else [min(column) for column in zip(*values, strict=True)]
    )
    events = [core.conclude(agreed, now) for core in cores]
    if len(events) > 1:
        first = [(type(e), e.rid) for e in events[0]]
        for name, theirs in zip(names[1:], events[1:], strict=True):
            if [(type(e), e.rid) for e in theirs] != first:
                checker.violate(
                    Check.OUTCOME, name, f"rank events {theirs} differ from rank 0's {events[0]}"
                )
    return events
