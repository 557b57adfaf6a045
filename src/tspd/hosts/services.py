"""Long-lived Trio services held open on behalf of a host that is not Trio code.

A host bridge (the asyncio guest, the trio-asyncio bridge, the background Trio
thread) lets foreign code start tspd's services -- peers, the bootstrap server,
the KV-event publisher and subscriber -- and keep using them after the call that
started them returned. Those services are Trio async context managers
(``open_prefill_peer(...)``) or ``task_status`` functions; :class:`ServiceNursery`
runs each one in a task of a nursery the bridge owns and hands back what it
yields. When the bridge closes, the held context managers are exited one at a
time in reverse order of entry (a peer leaves before the bootstrap server it
registered with), so each shuts down as it would at the end of an ``async with``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeVar, final

import trio

__all__ = ["ServiceNursery"]

log = logging.getLogger(__name__)

T = TypeVar("T")


@final
class _Held:
    """One entered context manager: ``stop`` ends it, ``done`` says it ended."""

    __slots__ = ("done", "name", "stop")

    def __init__(self, name: str) -> None:
        self.name = name
        self.stop = trio.Event()
        self.done = trio.Event()


@final
class ServiceNursery:
    """Holds async context managers and ``task_status`` services open in one nursery.

    Every method runs in the Trio thread. :meth:`aclose` exits the held context
    managers last-in first-out; tasks started with :meth:`start` end when the
    owner cancels the nursery.
    """

    def __init__(self, nursery: trio.Nursery, *, owner: str) -> None:
        self._nursery = nursery
        self._owner = owner
        self._held: list[_Held] = []
        self._closed = False

    @property
    def held(self) -> tuple[str, ...]:
        """The names of the context managers still held, in order of entry."""
        return tuple(h.name for h in self._held if not h.done.is_set())

    async def enter(self, cm: AbstractAsyncContextManager[T], *, name: str | None = None) -> T:
        """Enter ``cm`` in a task of its own and return what it yields; it stays
        entered until :meth:`aclose` (or the nursery is cancelled). An error from
        entering it is raised here."""
        if self._closed:
            raise RuntimeError(f"{self._owner} is closing; {cm!r} was not entered")
        held = _Held(name or type(cm).__name__)
        value: T = await self._nursery.start(self._hold, cm, held, name=f"hold {held.name}")
        self._held.append(held)
        return value

    async def start(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """``nursery.start(fn, *args)``: run a ``task_status`` service until the
        nursery is cancelled and return the value it reported as started."""
        if self._closed:
            raise RuntimeError(f"{self._owner} is closing; {fn!r} was not started")
        return await self._nursery.start(fn, *args)

    async def aclose(self) -> None:
        """Exit every held context manager, newest first, each to its end."""
        self._closed = True
        while self._held:
            held = self._held[-1]  # still listed in ``held`` while it closes
            held.stop.set()
            await held.done.wait()
            self._held.pop()

    async def close_within(self, seconds: float, *, shield: bool = False) -> None:
        """:meth:`aclose`, for at most ``seconds`` (``shield``: even while the caller
        is cancelled); the services still held then are logged, and the owner
        cancels them with its nursery."""
        with trio.move_on_after(seconds, shield=shield) as scope:
            await self.aclose()
        if scope.cancelled_caught:
            log.error(
                "%s: services %s did not close within %.0f s; cancelling them",
                self._owner,
                ", ".join(self.held) or "(none)",
                seconds,
            )

    @staticmethod
    async def _hold(
        cm: AbstractAsyncContextManager[T],
        held: _Held,
        *,
        task_status: trio.TaskStatus[T] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        try:
            async with cm as value:
                task_status.started(value)
                await held.stop.wait()
        finally:
            held.done.set()
