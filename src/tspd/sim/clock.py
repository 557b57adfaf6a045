"""The virtual clock: one event queue that every simulated process shares.

An event is ``(time, seq, action, argument)`` on a heap; ``seq`` breaks ties in
the order events were scheduled, so a run is a pure function of its seed. Actions
are plain callables taking one argument (no closure is built per event on the hot
paths). The cores never read a clock; they are handed :attr:`EventQueue.now`.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

__all__ = ["Action", "EventQueue"]

Action = Callable[[Any], None]


class EventQueue:
    """A heap of pending actions and the current virtual time."""

    __slots__ = ("_heap", "_seq", "now", "steps")

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Action, Any]] = []
        self._seq = 0
        #: Events run so far.
        self.steps = 0

    def at(self, when: float, action: Action, argument: Any = None) -> None:
        """Run ``action(argument)`` at virtual time ``when`` (never in the past)."""
        self._seq += 1
        heapq.heappush(self._heap, (max(when, self.now), self._seq, action, argument))

    def after(self, delay: float, action: Action, argument: Any = None) -> None:
        """Run ``action(argument)`` ``delay`` seconds from now."""
        self.at(self.now + delay, action, argument)

    def next_time(self) -> float | None:
        """When the next event runs, or ``None`` when none is pending."""
        return self._heap[0][0] if self._heap else None

    def step(self) -> bool:
        """Run the next event; ``False`` when none was pending."""
        if not self._heap:
            return False
        when, _, action, argument = heapq.heappop(self._heap)
        self.now = when
        self.steps += 1
        action(argument)
        return True

    def __len__(self) -> int:
        return len(self._heap)
