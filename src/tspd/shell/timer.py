"""The one timer task of a peer: sleep until the core's next deadline, then hand it ``now``.

The sans-IO cores never read a clock; they expose ``next_deadline()`` and take
``handle_timeout(now)``. :class:`DeadlineTimer` is the Trio side of that
contract (quinn's ``poll_timeout``/``handle_timeout``): one task sleeps until the
earliest deadline and calls back. Whenever core activity may have moved the
deadline earlier, the peer calls :meth:`DeadlineTimer.poke`; the task re-reads
the deadline at most once per ``coalesce`` seconds, however often it is poked,
because ``next_deadline()`` may cost time in proportion to the rooms a core
holds and the deadlines it guards (bootstrap, waiting and session timeouts) are
seconds long. Time is ``trio.current_time()``, so ``MockClock`` drives it in tests.
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

    def poke(self) -> None:
        """The deadline may have moved earlier: have the task re-read it (O(1))."""
        if not self._poked:
            self._poked = True
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
            with trio.move_on_at(math.inf if deadline is None else deadline):
                await self._wakeup.wait()
            if self._wakeup.is_set():
                self._wakeup = trio.Event()
                # Pokes come in bursts (one per core call): take them together.
                await trio.sleep(self._coalesce)
