"""What an asyncio host sees of tspd, whichever way Trio runs beside it.

tspd's peers and event services are Trio code. An asyncio engine reaches them
through a bridge: :class:`~tspd.hosts.guest.TrioGuest` (Trio in guest mode on the
host's own ``asyncio.run`` loop) or :class:`~tspd.hosts.aio.AioBridge` (the host
runs under ``trio_asyncio``). Both satisfy :class:`TrioBridge`, so engine code is
written once against this protocol and the entry point picks the bridge.

Rules that hold for both:

* ``await bridge.run(fn, *args)`` runs the Trio async function ``fn`` and returns
  its result; an ``Exception`` it raises is raised in the asyncio caller.
  Cancelling the asyncio awaitable cancels the Trio task, and the awaitable
  finishes only after that task has unwound (a transfer already in flight runs to
  its end first, as tspd never abandons one).
* ``await bridge.run_sync(fn, *args)`` runs a plain function in the Trio thread
  -- every scheduler-side peer method (``register_request``, ``abort``,
  ``hand_over``, ``send_preallocation``) -- since they read Trio's clock.
* ``await bridge.enter(cm)`` enters a Trio async context manager (a peer, the
  bootstrap server, a publisher) in the bridge's nursery and returns what it
  yields; it stays open until the bridge closes, then everything entered is
  exited newest first.
* KV events: publish with ``await bridge.run(publisher.apublish, events)`` and
  read a subscriber with ``async for item in bridge.iterate(subscriber)``.
* A Trio-side failure never leaves the asyncio side waiting: calls in flight
  when the bridge stops raise :class:`BridgeClosed`, and so does every later call.

:class:`TrioHost` is what the hosts that run Trio themselves -- the guest
(:class:`~tspd.hosts.guest.TrioGuest`) and the background thread
(:class:`~tspd.hosts.threads.TrioThread`) -- keep about that run.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol, TypeVar, cast

import trio

from tspd.core.errors import TspdError
from tspd.hosts.services import ServiceNursery

__all__ = ["BridgeClosed", "TrioBridge", "TrioHost", "iterate_via", "root_error"]

T = TypeVar("T")


class BridgeClosed(TspdError):
    """The Trio side of a host bridge stopped; the call did not run, or was cut short
    by the shutdown. The message names the bridge and, when it crashed, why."""


def root_error(exc: BaseException) -> BaseException:
    """``exc`` with one-exception groups unwrapped (what an operator should read)."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


class TrioHost:
    """A Trio run that a host started for code that is not Trio: its name, token,
    service nursery and crash (shared by the guest and the background thread)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._token: trio.lowlevel.TrioToken | None = None
        self._services: ServiceNursery | None = None
        self._crash: BaseException | None = None

    @property
    def name(self) -> str:
        """The name of the run in messages (and of its thread, if it has one)."""
        return self._name

    @property
    def token(self) -> trio.lowlevel.TrioToken:
        """The run's token, for :class:`tspd.shell.threadsafe.LoopPortal` and
        ``trio.from_thread`` calls from other threads."""
        if self._token is None:
            raise BridgeClosed(f"{self._name} has not started")
        return self._token

    def _require_services(self) -> ServiceNursery:
        if self._services is None:
            raise BridgeClosed(f"{self._name} has not started")
        return self._services

    def _closed_error(self, what: str) -> BridgeClosed:
        reason = f"; it crashed: {self._crash!r}" if self._crash is not None else ""
        error = BridgeClosed(f"{self._name} {what}{reason}")
        error.__cause__ = self._crash
        return error


class TrioBridge(Protocol):
    """The asyncio-facing face of a Trio bridge (see the module doc)."""

    async def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run the Trio async function ``fn(*args)``; result and error cross."""
        ...

    async def run_sync(self, fn: Callable[..., T], *args: Any) -> T:
        """Run the plain function ``fn(*args)`` in the Trio thread."""
        ...

    async def enter(self, cm: AbstractAsyncContextManager[T], *, name: str | None = None) -> T:
        """Hold a Trio async context manager open until the bridge closes."""
        ...

    async def start(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Start a ``task_status`` service in the bridge's nursery."""
        ...

    def iterate(self, source: AsyncIterable[T]) -> AsyncIterator[T]:
        """Iterate a Trio async iterable from asyncio code."""
        ...


async def _next_item(iterator: AsyncIterator[T]) -> tuple[bool, T | None]:
    """One step of ``iterator`` in Trio, with exhaustion as a value (a
    ``StopAsyncIteration`` must not cross a future)."""
    try:
        return True, await iterator.__anext__()
    except StopAsyncIteration:
        return False, None


async def iterate_via(
    run: Callable[..., Awaitable[Any]], source: AsyncIterable[T]
) -> AsyncIterator[T]:
    """Yield the items of the Trio async iterable ``source``, each fetched with
    ``run`` (a bridge's :meth:`TrioBridge.run`)."""
    iterator = aiter(source)
    while True:
        more, item = await run(_next_item, iterator)
        if not more:
            return
        yield cast(T, item)
