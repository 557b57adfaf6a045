"""A demo rank's failed rooms, counted per peer session instead of logged per room.

When the peer a demo Decode rank faces goes wrong — a Prefill that dies, writes
another seed's pattern, or refuses every room — every room from it fails, and the
peer's per-room log lines (one WARNING per failed room, plus one ERROR per failed
bootstrap fetch) would bury everything else on stderr: a Prefill killed mid-run
of a 60,000-room Decode printed 57,000 lines. :class:`SessionFailures` keeps
stderr to a few lines per session instead:

* :meth:`~SessionFailures.collapse` filters a peer logger while the rank runs: of
  the WARNING and ERROR lines about one session (a failed room of it, or a line
  naming its address), only the first of each kind is written — a kind is the line
  with its numbers blanked, so ``room 7 failed: …`` and ``room 8 failed: …`` are
  one kind — and the others are counted;
* :meth:`~SessionFailures.add` counts each failed room under its session, with the
  reasons by kind;
* at the end, :meth:`~SessionFailures.log_summary` writes **one** line per failed
  session with the count of rooms it failed, and :meth:`~SessionFailures.as_dict`
  gives the same for the rank's ``done`` report line.

Every room keeps its own JSON ``room`` line (reason and trace included) on stdout:
only the human-facing log is collapsed.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

from tspd.log import fields

__all__ = ["SessionFailures", "reason_kind"]

_NUMBER = re.compile(r"\d+")
#: Distinct line kinds remembered per rank; beyond it, new kinds are counted too.
_MAX_KINDS: Final = 1024
#: Reason kinds a session's summary line names (its ``done`` record has them all).
_SUMMARY_KINDS: Final = 3


def reason_kind(text: str) -> str:
    """``text`` with every number blanked to ``N``: what rooms failing the same way
    have in common (``room 7 failed: …`` and ``room 8 failed: …`` are one kind)."""
    return _NUMBER.sub("N", text)


@dataclass(slots=True)
class _Session:
    first_room: int
    first_reason: str
    rooms: int = 0
    kinds: Counter[str] = field(default_factory=Counter)


class _Collapse(logging.Filter):
    """Passes the first WARNING+ line of each kind per session, counts the others."""

    def __init__(self, owner: SessionFailures) -> None:
        super().__init__()
        self._owner = owner
        self._seen: set[tuple[str, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        message = record.getMessage()
        session = self._owner.session_about(getattr(record, "room", None), message)
        if session is None:
            return True
        kind = (session, reason_kind(message))
        if kind not in self._seen and len(self._seen) < _MAX_KINDS:
            self._seen.add(kind)
            return True
        self._owner.held_back[session] += 1
        return False


class SessionFailures:
    """Failed rooms of one demo rank per peer session (see the module docstring).

    ``peer`` names what a session is in log lines (``"Prefill"``: the Prefill
    instance a Decode rank's rooms came from). ``session_of`` maps a room to its
    session; ``sessions`` are the session addresses known up front, so that a peer
    line naming one (``fetching parallel info from Prefill bootstrap ADDR failed``)
    counts for it. Nothing here is thread-safe: the rank's Trio thread owns it (log
    records from other threads only pass through the filter's counters).
    """

    def __init__(
        self,
        session_of: Callable[[int], str | None],
        sessions: Iterable[str] = (),
        *,
        peer: str = "Prefill",
    ) -> None:
        self.peer = peer
        self._session_of = session_of
        self._sessions = tuple(sessions)
        self._failed: dict[str, _Session] = {}
        #: Log lines written by the peer about each session and not shown.
        self.held_back: Counter[str] = Counter()

    def session_about(self, room: object, message: str) -> str | None:
        """The session a log line is about: its room's, else one its text names."""
        if isinstance(room, int):
            return self._session_of(room)
        for session in self._sessions:
            if session in message:
                return session
        return None

    @contextlib.contextmanager
    def collapse(self, logger: logging.Logger) -> Iterator[None]:
        """While the block runs, ``logger`` writes one line of each kind per session
        (see the module docstring) and counts the rest in :attr:`held_back`."""
        collapse = _Collapse(self)
        logger.addFilter(collapse)
        try:
            yield
        finally:
            logger.removeFilter(collapse)

    def add(self, room: int, reason: str) -> None:
        """Count ``room``, failed with ``reason``, under its session."""
        session = self._session_of(room) or "unknown"
        entry = self._failed.get(session)
        if entry is None:
            entry = self._failed[session] = _Session(room, reason)
        entry.rooms += 1
        entry.kinds[reason_kind(reason)] += 1

    def counts(self) -> dict[str, int]:
        """Failed rooms per session."""
        return {session: entry.rooms for session, entry in self._failed.items()}

    def as_dict(self) -> dict[str, dict[str, Any]]:
        """Per session: the rooms it failed, the first one and its reason, the
        failed rooms by reason kind and the log lines held back (for a report)."""
        sessions = set(self._failed) | {s for s, n in self.held_back.items() if n}
        out: dict[str, dict[str, Any]] = {}
        for session in sorted(sessions):
            entry = self._failed.get(session)
            out[session] = {
                "rooms": entry.rooms if entry else 0,
                "first_room": entry.first_room if entry else None,
                "first_reason": entry.first_reason if entry else None,
                "reasons": dict(entry.kinds.most_common()) if entry else {},
                "log_lines_held_back": self.held_back[session],
            }
        return out

    def log_summary(self, logger: logging.Logger, rooms: int) -> None:
        """One WARNING line per session that failed rooms (or whose log lines were
        held back): how many of the rank's ``rooms`` it failed, the first, the
        commonest reasons and how many of its log lines were not shown."""
        for session, entry in self.as_dict().items():
            kinds = "; ".join(
                f"{count} × {kind}"
                for kind, count in list(entry["reasons"].items())[:_SUMMARY_KINDS]
            )
            held = entry["log_lines_held_back"]
            logger.warning(
                "%s %s failed %d of %d rooms%s%s%s",
                self.peer,
                session,
                entry["rooms"],
                rooms,
                f" (first: room {entry['first_room']}: {entry['first_reason']})"
                if entry["rooms"]
                else "",
                f"; by reason: {kinds}" if kinds else "",
                f"; {held} repeated log lines about it were not shown "
                "(every room's reason is in its JSON report line)"
                if held
                else "",
                extra=fields(session=session, rooms_failed=entry["rooms"]),
            )
