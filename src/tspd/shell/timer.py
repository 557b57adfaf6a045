"""The one timer task of a peer: sleep until the core's next deadline, then hand it ``now``.

The sans-IO cores never read a clock; they expose ``next_deadline()`` and take
``handle_timeout(now)``. :class:`DeadlineTimer` is the Trio side of that
contract (quinn's ``poll_timeout``/``handle_timeout``): one task sleeps until the
earliest deadline and calls back. Whenever core activity may have moved the
deadline earlier, the peer calls :meth:`DeadlineTimer.poke`, which reads
``next_deadline()`` (O(1) amortised in both cores) and wakes the task only when the
deadline is now earlier than the one it sleeps until: a deadline that stayed, or
moved later, needs nothing (the task wakes at the old one and re-reads). A woken
task re-reads the deadline after ``coalesce`` seconds, however often it is poked
meanwhile: pokes come in bursts, and the deadlines the timer guards (bootstrap,
waiting and session timeouts) are seconds long. Time is ``trio.current_time()``, so
``MockClock`` drives it in tests.

On a peer with requests coming one after another (one room in flight), every
request's deadline is later than the one the task already sleeps until: a poke
reads it and the task stays asleep, where it used to wake for every burst (about
every other room) and take two steps of the Trio loop each time.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import final

import trio

__all__ = ["DeadlineTimer"]


@final
class DeadlineTimer:
    """Calls ``on_timeout(now)`` at every deadline ``next_deadline()`` reports."""

    def __init__(
        self,
        next_deadline: Callable[[], float | None],
        on_timeout: Callable[[float], None],
        *,
        coalesce: float = 0.01,
    ) -> None:
        self._next_deadline = next_deadline
        self._on_timeout = on_timeout
        self._coalesce = coalesce
        self._poked = False
        self._wakeup = trio.Event()
        #: The deadline the task sleeps until (``math.inf``: none); ``-math.inf``
        #: while it is not asleep, when it re-reads the deadline anyway.
        self._armed = -math.inf
        #: Pokes that woke the task (for tests and benchmarks).
        self.wakeups = 0

    def poke(self) -> None:
        """The deadline may have moved earlier: wake the task if it did (O(1))."""
        if self._poked:
            return
        deadline = self._next_deadline()
        if deadline is not None and deadline < self._armed:
            self._poked = True
            self.wakeups += 1
            self._wakeup.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run until cancelled."""
        task_status.started()
        while True:
            self._poked = False
            now = trio.current_time()
            deadline = self._next_deadline()
            if deadline is not None and deadline <= now:
                self._on_timeout(now)
                await trio.lowlevel.checkpoint()
                continue
            self._armed = math.inf if deadline is None else deadline
            try:
                with trio.move_on_at(self._armed):
                    await self._wakeup.wait()
            finally:
                self._armed = -math.inf
            if self._wakeup.is_set():
                self._wakeup = trio.Event()
                # Pokes come in bursts (one per core call): take them together.
                await trio.sleep(self._coalesce)
