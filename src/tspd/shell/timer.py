"""The one timer task of a peer: sleep until the core's next deadline, then hand it ``now``.

The sans-IO cores never read a clock; they expose ``next_deadline()`` and take
``handle_timeout(now)``. :class:`DeadlineTimer` is the Trio side of that
contract (quinn's ``poll_timeout``/``handle_timeout``): one task sleeps until the
earliest deadline and calls back; whenever core activity may have moved the
deadline earlier, the peer calls :meth:`DeadlineTimer.poke` and the task
re-reads it. Time is ``trio.current_time()``, so ``MockClock`` drives it in tests.
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
    ) -> None:
        self._next_deadline = next_deadline
        self._on_timeout = on_timeout
        self._sleeping_until = math.inf
        self._wakeup = trio.Event()

    def poke(self) -> None:
        """The deadline may have moved earlier: re-read it (cheap; call freely)."""
        deadline = self._next_deadline()
        if deadline is not None and deadline < self._sleeping_until:
            self._wakeup.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run until cancelled."""
        task_status.started()
        while True:
            deadline = self._next_deadline()
            self._sleeping_until = math.inf if deadline is None else deadline
            with trio.move_on_at(self._sleeping_until):
                await self._wakeup.wait()
            self._wakeup = trio.Event()
            self._sleeping_until = -math.inf  # pokes are moot while we run the callback
            now = trio.current_time()
            deadline = self._next_deadline()
            if deadline is not None and deadline <= now:
                self._on_timeout(now)
