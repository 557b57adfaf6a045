"""The trio-asyncio path, for asyncio hosts that can start under ``trio_asyncio``.

An asyncio engine whose entry point may change by one line runs with Trio as the
outer loop and its own asyncio code unchanged on trio-asyncio's loop (the first of
the two asyncio bridges of docs/architecture.md#threads)::

    # was: asyncio.run(engine_main())
    result = run_aio_host(engine_main)        # engine_main(bridge) is asyncio code

    async def engine_main(bridge: AioBridge) -> None:
        server = await bridge.enter(open_bootstrap_server(host="127.0.0.1"))
        peer = await bridge.enter(open_prefill_peer(config, engine, arena, settings=...))
        await bridge.run_sync(peer.register_request, "req-1", 7)
        events = await bridge.run(peer.poll)

:class:`AioBridge` is a :class:`~tspd.hosts.bridge.TrioBridge`, the same face
as the guest-mode :class:`~tspd.hosts.guest.TrioGuest`, so engine code is
written once. Calls cross with ``trio_asyncio.trio_as_aio`` (about 51 µs each):
results and errors cross, and cancelling the asyncio awaitable cancels the Trio
task. A host that already runs ``trio.run`` opens the bridge itself inside
``trio_asyncio.open_loop()`` with :func:`open_aio_bridge`.

Importing ``trio_asyncio`` replaces asyncio's loop policy and
``get_running_loop`` for the whole process (after it, ``asyncio.run`` runs
trio-asyncio's own loop, and Trio guest mode cannot start there). So this module
imports it only when a bridge is opened, and a process uses one path or the
other, never both.

Under a plain ``asyncio.run()`` this path cannot work (trio-asyncio needs Trio
outside); :func:`open_aio_bridge` refuses with :class:`BridgeClosed` naming the
guest-mode alternative instead of failing deep inside trio-asyncio.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from functools import partial
from typing import Any, TypeVar, final

import trio

from tspd.hosts.bridge import BridgeClosed, iterate_via
from tspd.hosts.services import ServiceNursery
from tspd.shell.nursery import single_error

__all__ = ["AioBridge", "open_aio_bridge", "run_aio_host"]

T = TypeVar("T")

#: How long closing the bridge lets the entered services exit in order.
CLOSE_TIMEOUT = 10.0


def _trio_asyncio() -> Any:
    """trio-asyncio, imported on first use (see the module doc for why)."""
    import trio_asyncio  # type: ignore[import-untyped]

    return trio_asyncio


@final
class AioBridge:
    """Trio services for asyncio code running on trio-asyncio's loop; get one from
    :func:`open_aio_bridge` or :func:`run_aio_host`. Methods are called from asyncio
    code."""

    def __init__(self, services: ServiceNursery, *, name: str) -> None:
        self._services = services
        self._name = name
        self._open = True

    @property
    def name(self) -> str:
        """The name the bridge's messages use."""
        return self._name

    @property
    def running(self) -> bool:
        """Whether the bridge still accepts calls."""
        return self._open

    async def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run the Trio async function ``fn(*args)`` and return its result; its error
        is raised here, and cancelling this awaitable cancels the Trio task."""
        if not self._open:
            raise BridgeClosed(f"{self._name} is closed; the call was not run")
        result: T = await _trio_asyncio().trio_as_aio(fn)(*args)
        return result

    async def run_sync(self, fn: Callable[..., T], *args: Any) -> T:
        """Run the plain function ``fn(*args)`` as Trio code (peer methods read
        Trio's clock)."""

        async def call() -> T:
            return fn(*args)

        return await self.run(call)

    async def enter(self, cm: AbstractAsyncContextManager[T], *, name: str | None = None) -> T:
        """Enter the Trio async context manager ``cm`` in the bridge's nursery and
        return what it yields; it is exited (newest first) when the bridge closes."""
        return await self.run(partial(self._services.enter, name=name), cm)

    async def start(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Start a ``task_status`` service in the bridge's nursery; returns its
        started value."""
        return await self.run(self._services.start, fn, *args)

    def iterate(self, source: AsyncIterable[T]) -> AsyncIterator[T]:
        """Iterate the Trio async iterable ``source`` from asyncio code."""
        return iterate_via(self.run, source)


@asynccontextmanager
async def open_aio_bridge(
    *, name: str = "the tspd trio-asyncio bridge"
) -> AsyncIterator[AioBridge]:
    """Trio side: a bridge for the asyncio code of this trio-asyncio loop.

    Call it inside ``trio_asyncio.open_loop()`` (or under ``trio_asyncio.run``).
    Leaving the block exits the entered services newest first, then cancels the
    started ones. Raises :class:`BridgeClosed` when no trio-asyncio loop is open.
    """
    if _trio_asyncio().current_loop.get() is None:
        raise BridgeClosed(
            f"{name} needs a trio-asyncio loop: call it inside trio_asyncio.open_loop() or "
            "under trio_asyncio.run(); a host that must keep asyncio.run() uses "
            "tspd.hosts.guest.open_trio_guest instead"
        )
    with single_error():
        async with trio.open_nursery() as nursery:
            services = ServiceNursery(nursery, owner=name)
            bridge = AioBridge(services, name=name)
            try:
                yield bridge
            finally:
                bridge._open = False
                await services.close_within(CLOSE_TIMEOUT, shield=True)
                nursery.cancel_scope.cancel()


def run_aio_host(
    main: Callable[..., Awaitable[T]], *args: Any, name: str = "the tspd trio-asyncio bridge"
) -> T:
    """Run the asyncio coroutine function ``main(bridge, *args)`` under trio-asyncio
    with a bridge open, and return its result: the one-line replacement for
    ``asyncio.run(main(*args))``."""

    async def trio_main() -> T:
        async with open_aio_bridge(name=name) as bridge:
            result: T = await _trio_asyncio().aio_as_trio(main)(bridge, *args)
            return result

    with single_error():
        result: T = _trio_asyncio().run(trio_main)
    return result
