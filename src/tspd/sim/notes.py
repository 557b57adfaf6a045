"""What a simulated shell does with the commands both cores emit alike.

:class:`~tspd.core.commands.RoomFailed` goes onto its room's timeline (a failure
without a reason, or whose class is ``other``, is an ``outcome`` violation); a
:class:`~tspd.core.commands.Log` naming a room goes onto that room's timeline, and a
warning or error naming none among the cluster's events; ``CloseRoute`` needs
nothing (there are no sockets); any other command — ``Rejected``, or whatever a
newer core emits — goes onto the timeline of the room it names, if any, so that the
simulator keeps working while the cores grow new commands.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from tspd.core.commands import CloseRoute, Command, Log, LogLevel, RoomFailed
from tspd.core.reasons import ReasonClass
from tspd.sim.invariants import Check

if TYPE_CHECKING:
    from tspd.sim.cluster import Cluster

__all__ = ["record"]

#: Levels worth a line among the cluster events when a log names no room.
LOUD: Final = frozenset({LogLevel.WARNING, LogLevel.ERROR})


def record(cluster: Cluster, where: str, command: Command, touched: set[int], now: float) -> None:
    """Note ``command`` of process ``where``; rooms it changed join ``touched``."""
    kind = type(command)
    if kind is RoomFailed:
        assert isinstance(command, RoomFailed)
        touched.add(command.room)
        cluster.timeline.note(command.room, now, where, f"failed: {command.reason}")
        if not command.reason:
            cluster.checker.violate(Check.OUTCOME, where, "failed without a reason", command.room)
        elif command.reason_class is ReasonClass.OTHER:
            # Every failure path of the cores types its cause where it arises.
            cluster.checker.violate(
                Check.OUTCOME,
                where,
                f"failed with an untyped reason: {command.reason}",
                command.room,
            )
    elif kind is Log:
        assert isinstance(command, Log)
        if command.room is not None:
            if command.level is not LogLevel.DEBUG:
                cluster.timeline.note(command.room, now, where, command.message)
        elif command.level in LOUD:
            cluster.log(where, command.message)
    elif kind is not CloseRoute:
        room = getattr(command, "room", None)
        if isinstance(room, int):
            message = getattr(command, "message", None) or type(command).__name__
            cluster.timeline.note(room, now, where, str(message))
