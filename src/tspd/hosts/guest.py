"""Trio in guest mode on a running asyncio loop, for hosts that keep ``asyncio.run()``.

Most inference engines are asyncio programs whose entry point is
``asyncio.run(main())`` and cannot change. :func:`open_trio_guest` starts a Trio
run *inside* that loop with ``trio.lowlevel.start_guest_run``: Trio's scheduler
ticks are callbacks on the asyncio loop (its I/O wait runs in a helper thread),
so Trio tasks and asyncio tasks run concurrently in the same thread. The
resulting :class:`TrioGuest` is a :class:`~tspd.hosts.bridge.TrioBridge`.

How a call crosses (the guest-mode bridge of docs/architecture.md#threads): the asyncio
side posts "start this task" into Trio with ``TrioToken.run_sync_soon``; the task runs
in the guest's nursery under a cancel scope of its own and settles an asyncio future
with its result or error. Cancelling the asyncio awaitable posts a cancellation of that
scope and waits until the task has unwound. When the guest stops -- closed by the host
or because a service crashed -- every call still in flight fails with
:class:`~tspd.hosts.bridge.BridgeClosed`, and leaving the ``async with`` block re-raises
the crash (unless the block itself is raising, which then wins and the crash is logged).
Measured cost: about 143 µs per call.

This module is not sans-IO; it imports asyncio on purpose and nothing in
``tspd.core`` or ``tspd.shell`` depends on it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from functools import partial
from typing import Any, TypeVar, final

import outcome
import trio

from tspd.hosts.bridge import TrioHost, iterate_via, root_error
from tspd.hosts.services import ServiceNursery
from tspd.shell.nursery import single_error

__all__ = ["TrioGuest", "open_trio_guest"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: How long leaving :func:`open_trio_guest` lets the services close in order before
#: the guest's nursery is cancelled outright.
CLOSE_TIMEOUT = 10.0


def _consume(future: asyncio.Future[Any]) -> None:
    """Mark a future's outcome as seen (its caller stopped waiting for it)."""
    if not future.cancelled():
        future.exception()


@final
class _Call:
    """One asyncio → Trio call: its future, and the Trio cancel scope once it runs."""

    __slots__ = ("cancel_requested", "future", "scope")

    def __init__(self, future: asyncio.Future[Any]) -> None:
        self.future = future
        self.scope: trio.CancelScope | None = None
        self.cancel_requested = False

    def cancel(self) -> None:
        """Trio thread: the asyncio caller was cancelled; cancel the task too."""
        self.cancel_requested = True
        if self.scope is not None:
            self.scope.cancel()


@final
class TrioGuest(TrioHost):
    """A Trio run hosted by the running asyncio loop; get one from :func:`open_trio_guest`.

    Every method is called from asyncio code on the host loop.
    """

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._nursery: trio.Nursery | None = None
        self._stop: trio.Event | None = None
        self._active: set[_Call] = set()
        self._closing = False
        self._finished = False

    @property
    def running(self) -> bool:
        """Whether the guest run still accepts calls."""
        return self._token is not None and not self._finished and not self._closing

    # -- the bridge ----------------------------------------------------------------

    async def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run the Trio async function ``fn(*args)`` in the guest and return its
        result; its error is raised here. Cancelling this awaitable cancels the
        Trio task and returns once it unwound."""
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        call = _Call(future)
        self._post(self._spawn, call, fn, args)
        try:
            await asyncio.wait([future])
        except asyncio.CancelledError:
            future.add_done_callback(_consume)
            self._post_quietly(call.cancel)
            await asyncio.wait([future])
            raise
        return future.result()

    async def run_sync(self, fn: Callable[..., T], *args: Any) -> T:
        """Run the plain function ``fn(*args)`` inside the Trio run (peer methods
        read Trio's clock, so they cannot be called from asyncio code directly)."""

        async def call() -> T:
            return fn(*args)

        return await self.run(call)

    async def enter(self, cm: AbstractAsyncContextManager[T], *, name: str | None = None) -> T:
        """Enter the Trio async context manager ``cm`` in the guest's nursery and
        return what it yields; it is exited (newest first) when the guest closes."""
        return await self.run(partial(self._require_services().enter, name=name), cm)

    async def start(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Start a ``task_status`` service in the guest's nursery; returns its
        started value. It runs until the guest closes."""
        return await self.run(self._require_services().start, fn, *args)

    def iterate(self, source: AsyncIterable[T]) -> AsyncIterator[T]:
        """Iterate the Trio async iterable ``source`` (a KV-event subscriber) from
        asyncio code, one item per crossing."""
        return iterate_via(self.run, source)

    # -- internals -------------------------------------------------------------------

    def _post(self, fn: Callable[..., object], *args: Any) -> None:
        if self._token is None or self._finished or self._closing or self._crash is not None:
            raise self._closed_error("is closed; the call was not run")
        try:
            self._token.run_sync_soon(fn, *args)
        except trio.RunFinishedError:
            raise self._closed_error("has stopped; the call was not run") from None

    def _post_quietly(self, fn: Callable[..., object], *args: Any) -> None:
        if self._token is None:
            return
        try:
            self._token.run_sync_soon(fn, *args)
        except trio.RunFinishedError:
            return

    def _spawn(self, call: _Call, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...]) -> None:
        """Trio thread: start the call's task, unless it was cancelled already."""
        if call.cancel_requested:
            call.future.cancel()
            return
        if self._nursery is None or self._closing:
            call.future.set_exception(self._closed_error("is closing; the call was not run"))
            return
        try:
            self._nursery.start_soon(self._runner, call, fn, args, name=fn)
        except RuntimeError:
            call.future.set_exception(self._closed_error("is closing; the call was not run"))

    async def _runner(
        self, call: _Call, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...]
    ) -> None:
        future = call.future
        self._active.add(call)
        try:
            with trio.CancelScope() as scope:
                call.scope = scope
                if call.cancel_requested:
                    scope.cancel()
                try:
                    value = await fn(*args)
                except Exception as exc:
                    if not future.done():
                        future.set_exception(exc)
                else:
                    if not future.done():
                        future.set_result(value)
        finally:
            self._active.discard(call)
            if not future.done():
                if call.cancel_requested:
                    future.cancel()
                else:
                    future.set_exception(self._closed_error("stopped before the call finished"))

    async def _main(self, ready: asyncio.Future[None]) -> None:
        """The guest run: a root nursery for calls and services until told to stop."""
        self._stop = trio.Event()
        try:
            await self._serve(ready)
        except BaseException as exc:
            self._crash = root_error(exc)
            raise

    async def _serve(self, ready: asyncio.Future[None]) -> None:
        assert self._stop is not None
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._services = ServiceNursery(nursery, owner=self._name)
            self._token = trio.lowlevel.current_trio_token()
            if self._closing:
                self._stop.set()
            elif not ready.done():
                ready.set_result(None)
            await self._stop.wait()
            self._closing = True
            for call in list(self._active):
                if call.scope is not None:
                    call.scope.cancel()
            await self._services.close_within(CLOSE_TIMEOUT)
            nursery.cancel_scope.cancel()

    def _request_stop(self) -> None:
        """Trio thread: begin the orderly close."""
        if self._stop is not None:
            self._stop.set()


@asynccontextmanager
async def open_trio_guest(*, name: str = "the tspd Trio guest") -> AsyncIterator[TrioGuest]:
    """Run Trio as a guest of the running asyncio loop for the duration of the block.

    The guest's nursery holds what :meth:`TrioGuest.enter` and
    :meth:`TrioGuest.start` began; leaving the block cancels calls still in flight,
    exits the entered services newest first and waits for the Trio run to end.
    A crash inside the guest is raised on exit (a one-exception group unwrapped).
    """
    loop = asyncio.get_running_loop()
    guest = TrioGuest(name)
    ready: asyncio.Future[None] = loop.create_future()
    finished: asyncio.Future[outcome.Outcome[None]] = loop.create_future()

    def done(result: outcome.Outcome[None]) -> None:
        guest._finished = True
        if isinstance(result, outcome.Error):
            guest._crash = root_error(result.error)
        if not finished.done():
            finished.set_result(result)

    trio.lowlevel.start_guest_run(
        guest._main,
        ready,
        run_sync_soon_threadsafe=loop.call_soon_threadsafe,
        run_sync_soon_not_threadsafe=loop.call_soon,
        done_callback=done,
        host_uses_signal_set_wakeup_fd=True,
    )
    try:
        pending: list[asyncio.Future[Any]] = [ready, finished]
        await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        await _stop_guest(guest, finished)
        raise
    if not ready.done():
        ready.cancel()
        _raise_crash(finished.result())
    try:
        yield guest
    except BaseException:
        result = await _stop_guest(guest, finished)
        if isinstance(result, outcome.Error):
            log.error("%s crashed while the host was failing: %r", name, root_error(result.error))
        raise
    _raise_crash(await _stop_guest(guest, finished))


async def _stop_guest(
    guest: TrioGuest, finished: asyncio.Future[outcome.Outcome[None]]
) -> outcome.Outcome[None]:
    """Ask the guest to close and wait until its run ended, even if this task is
    cancelled meanwhile (the loop must not stop under a live Trio run)."""
    if guest._token is None:
        guest._closing = True  # _serve sees it as soon as it starts, and stops
    else:
        guest._post_quietly(guest._request_stop)
    cancelled = False
    while not finished.done():
        try:
            await asyncio.wait([finished])
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return finished.result()


def _raise_crash(result: outcome.Outcome[None]) -> None:
    if isinstance(result, outcome.Error):
        with single_error():
            result.unwrap()
