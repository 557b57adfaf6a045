"""Per-room timelines: what happened to one room, where, and when.

Every process appends one line per thing that concerns a room — a state change
seen on a rank, a message sent, lost or duplicated, a write issued or landed, an
event the scheduler got, a fault — so that a violation can be explained by the
room's own story rather than by a log of the whole cluster. Appending is a list
append of a small tuple; text is formatted only when a timeline is printed.
"""

from __future__ import annotations

from collections import defaultdict

__all__ = ["Timeline"]


class Timeline:
    """Lines per room, in the order they were noted (which is time order)."""

    __slots__ = ("_lines",)

    def __init__(self) -> None:
        self._lines: defaultdict[int, list[tuple[float, str, str]]] = defaultdict(list)

    def note(self, room: int, now: float, where: str, what: str) -> None:
        """Record ``what`` happening to ``room`` at ``where`` (a process name)."""
        self._lines[room].append((now, where, what))

    def lines(self, room: int) -> list[tuple[float, str, str]]:
        """The room's lines so far."""
        return list(self._lines.get(room, ()))

    def format(self, room: int, *, limit: int = 400) -> str:
        """The room's timeline as text, one line per entry (the last ``limit``)."""
        lines = self._lines.get(room, [])
        shown = lines[-limit:]
        out = [f"timeline of room {room} ({len(lines)} entries):"]
        if len(lines) > len(shown):
            out.append(f"  ... {len(lines) - len(shown)} earlier entries left out")
        out.extend(f"  {t:12.6f}  {where:<14} {what}" for t, where, what in shown)
        return "\n".join(out)

    def __len__(self) -> int:
        return sum(len(lines) for lines in self._lines.values())
