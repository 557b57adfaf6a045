"""A peer's observability in one object: logs, metrics and traces of its core.

A Prefill or Decode peer's shell drains its core after every call. Of what comes
out, :class:`PeerObserver` takes the observable part, so the shell's own code only
moves bytes:

* every drained command → :meth:`PeerObserver.command`: a
  :class:`~tspd.core.commands.Log` becomes a log record and a
  :class:`~tspd.core.commands.RoomFailed` one WARNING line with its reason class
  (:func:`tspd.log.log_command`), both with ``side``/``rank``/``room`` fields;
  failures, timeouts and transfer chunks are counted;
* the scheduler's events from each poll → :meth:`PeerObserver.events`;
* each destination write the transfer workers finish → :meth:`PeerObserver.write`
  (the engine's write latency);
* the core's finished room traces (``core.drain_finished()``) →
  :meth:`PeerObserver.finished`: outcome, room and phase durations, transfer
  latency; a room that ran slow also gets one INFO line with its phases (failed
  rooms already had their WARNING line).

Without a :class:`~tspd.shell.metrics.TspdMetrics` it only logs. Hook-up in a
peer::

    observer = PeerObserver("prefill", rank, metrics=metrics)
    observer.watch(core, peer.statistics)         # gauges read at scrape time
    ...
    for command in core.drain_commands():
        observer.command(command)
        execute(command)
    observer.finished(core.drain_finished())
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol, final

from tspd.core.commands import Command, Event, Log, Rejected, RoomFailed
from tspd.core.trace import Outcome, RoomTrace, Side
from tspd.log import LogLimits, component_logger, fields, log_command
from tspd.shell.metrics import PeerMetrics, TspdMetrics

__all__ = ["ObservedCore", "PeerObserver"]

#: The commands that make a log line (:func:`tspd.log.log_command`); every other
#: command -- a message to send, a transfer chunk -- skips the logging call.
_LOGGED = (Log, RoomFailed, Rejected)


class ObservedCore(Protocol):
    """What :meth:`PeerObserver.watch` reads from a core (both cores have it)."""

    def rooms_by_state(self) -> dict[str, int]: ...

    def trace(self, room: int) -> RoomTrace | None: ...

    def recent_traces(self) -> list[RoomTrace]: ...


@final
class PeerObserver:
    """Logs, metrics and slow-room reports of one rank (see the module docstring).

    ``slow_after``: a successful room that lasted at least this many seconds gets an
    INFO line (``None``: never). Every method runs in the peer's Trio thread.
    """

    def __init__(
        self,
        side: Side | str,
        rank: int,
        *,
        metrics: TspdMetrics | None = None,
        logger: logging.Logger | None = None,
        slow_after: float | None = 5.0,
    ) -> None:
        self.side = Side(side)
        self.rank = rank
        self.log = logger or component_logger(str(self.side))
        self.metrics: PeerMetrics | None = (
            metrics.peer(self.side, rank) if metrics is not None else None
        )
        self.slow_after = slow_after
        self._context = {"side": str(self.side), "rank": rank}
        #: What peers can make this rank log is rate-limited (tspd.log.LogLimits).
        self.log_limits = LogLimits(self.log)

    def watch(
        self, core: ObservedCore, statistics: Callable[[], Mapping[str, int]] | None = None
    ) -> None:
        """Let the metrics endpoint read ``core``'s rooms by state and traces, and
        the peer's ``statistics`` (table sizes and counters), when scraped."""
        if self.metrics is not None:
            self.metrics.watch(
                rooms_by_state=core.rooms_by_state,
                statistics=statistics,
                trace=core.trace,
                recent_traces=core.recent_traces,
            )

    def close(self) -> None:
        """The peer stopped: its metrics endpoint stops reading it (its counts stay)."""
        if self.metrics is not None:
            self.metrics.close()

    def command(self, command: Command) -> bool:
        """Log and count one drained command; ``True`` when it was only for
        observing (a ``Log`` or ``RoomFailed``), ``False`` when the shell still has
        to carry it out."""
        if self.metrics is not None:
            self.metrics.observe_command(command)
        if not isinstance(command, _LOGGED):
            return False
        return log_command(self.log, command, limits=self.log_limits, **self._context)

    def internal_error(self, what: str) -> None:
        """A fault of tspd's own while handling ``what`` from a peer (call it in the
        ``except`` block): logged with its traceback, rate-limited since the peer may
        repeat the message; the caller's loop goes on."""
        self.log_limits.rejections.log(
            logging.ERROR,
            "*",
            "internal-error",
            "tspd failed handling %s, which was dropped: a bug, please report it with "
            "this traceback",
            what,
            exc_info=True,
            **self._context,
        )

    def write(self, session_id: str, nbytes: int, seconds: float) -> None:
        """A transfer worker wrote ``nbytes`` to ``session_id`` in ``seconds``."""
        if self.metrics is not None:
            self.metrics.observe_write(seconds)

    def events(self, events: Iterable[Event]) -> None:
        """Count the scheduler's events from one poll."""
        if self.metrics is not None:
            for event in events:
                self.metrics.observe_event(event)

    def finished(self, traces: Iterable[RoomTrace]) -> None:
        """Record rooms that ended (from the core's ``drain_finished()``)."""
        for trace in traces:
            if self.metrics is not None:
                self.metrics.observe_finished(trace)
            if (
                self.slow_after is not None
                and trace.outcome is Outcome.SUCCESS
                and trace.duration >= self.slow_after
                and self.log.isEnabledFor(logging.INFO)
            ):
                phases = " ".join(f"{k}={v:.3f}s" for k, v in trace.phases.items())
                self.log.info(
                    "room %d succeeded slowly in %.3fs: %s",
                    trace.room,
                    trace.duration,
                    phases,
                    extra=fields(room=trace.room, rid=trace.rid, **self._context),
                )
