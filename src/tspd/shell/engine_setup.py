"""A transfer engine's setup calls, made from Trio without stalling the loop.

Writes go through :class:`~tspd.shell.offload.EngineRunner`. The other engine calls
— building an engine, registering and unregistering memory, closing it — are made
here, the way the engine's :attr:`~tspd.engines.base.TransferEngine.blocking_setup`
asks:

* **In a worker thread** (``trio.to_thread.run_sync``) when it may block: Mooncake's
  ``initialize`` opens its listener (and RDMA devices), and registering memory pins
  it, which takes seconds for gigabytes on RDMA. Every other task of the loop —
  sockets, timers, heartbeats, other peers — keeps running meanwhile.
* **Inline**, with no checkpoint, when it does not: the in-process engines of
  :mod:`tspd.engines.memory` update a dict (well under a microsecond, measured
  there). Staying inline keeps their callers' order of events unchanged, and keeps
  tests under ``trio.testing.MockClock(autojump_threshold=0)`` deterministic: a
  thread hop would leave every task waiting, and autojump would move virtual time
  and fire timeouts meanwhile.

Cancellation:

* **Registration is never abandoned** (``abandon_on_cancel=False``): a cancel that
  arrives while the engine registers waits for it, the caller learns the region is
  registered, and the cancellation lands at its next checkpoint — so the teardown
  that follows unregisters it. An abandoned registration would finish unseen and
  pin the memory until the process ends.
* **Teardown runs even when cancelled, and is bounded.**
  :func:`unregister_on_exit` and :func:`close_engine` run in a cancel scope shielded
  from outside cancellation, with a deadline (``limit`` seconds, default
  :data:`TEARDOWN_TIMEOUT`): a cancelled peer still deregisters its arena, and an
  engine that hangs cannot hang shutdown forever. Past the deadline the call is
  abandoned — it goes on in its worker thread — and an ERROR log tells the operator
  what is still registered.

:func:`open_mooncake_engine` (and :func:`open_engine` for any engine) builds an
engine in a worker thread and closes it through :func:`close_engine`: use it
wherever async code owns a Mooncake engine.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Final, TypeAlias, TypeVar

import trio

from tspd.engines.base import (
    AsyncTransferEngine,
    TransferEngine,
    TransferError,
    setup_blocks,
)
from tspd.engines.mooncake import DEFAULT_MAX_DESCRIPTORS, MooncakeEngine
from tspd.log import component_logger

__all__ = [
    "TEARDOWN_TIMEOUT",
    "SetupEngine",
    "close_engine",
    "open_engine",
    "open_mooncake_engine",
    "register_memory",
    "unregister_memory",
    "unregister_on_exit",
]

log = component_logger("engine")

TEARDOWN_TIMEOUT: Final = 60.0
"""Seconds a teardown call (unregistration on exit, close) may take before tspd
stops waiting for it: twice Mooncake's default transfer timeout, and far beyond the
few seconds unpinning gigabytes takes."""

#: Anything with the setup calls: a synchronous engine or the shell's async view of one.
SetupEngine: TypeAlias = TransferEngine | AsyncTransferEngine

_E = TypeVar("_E", bound=TransferEngine)


async def register_memory(engine: SetupEngine, addr: int, length: int) -> None:
    """``engine.register_memory(addr, length)``, in a worker thread when the engine's
    setup blocks, else inline. Never abandoned: when this returns, the region is
    registered, even if a cancel arrived meanwhile (it lands at the next
    checkpoint); the engine's :class:`~tspd.engines.base.TransferError` propagates."""
    if setup_blocks(engine):
        await trio.to_thread.run_sync(engine.register_memory, addr, length, abandon_on_cancel=False)
    else:
        engine.register_memory(addr, length)


async def unregister_memory(engine: SetupEngine, addr: int) -> None:
    """``engine.unregister_memory(addr)`` while running (a sleep, for instance), in a
    worker thread when the engine's setup blocks, else inline; never abandoned, like
    :func:`register_memory`. On the way out use :func:`unregister_on_exit`."""
    if setup_blocks(engine):
        await trio.to_thread.run_sync(engine.unregister_memory, addr, abandon_on_cancel=False)
    else:
        engine.unregister_memory(addr)


async def _teardown(call: Callable[[], None], *, blocks: bool, limit: float) -> bool:
    """Run ``call`` inline, or in a worker thread shielded from outside cancellation
    for at most ``limit`` seconds; ``False`` when it was abandoned at the deadline.
    Its exceptions propagate."""
    if not blocks:
        call()
        return True
    with trio.move_on_after(limit, shield=True):
        await trio.to_thread.run_sync(call, abandon_on_cancel=True)
        return True
    return False


async def unregister_on_exit(
    engine: SetupEngine,
    addr: int,
    *,
    what: str,
    limit: float = TEARDOWN_TIMEOUT,
    logger: logging.Logger | None = None,
) -> bool:
    """Unregister ``addr`` while shutting down (see the module docstring): runs even
    when the caller is cancelled, gives up after ``limit`` seconds, and raises
    nothing. A refusal is logged as a WARNING, a timeout as an ERROR, both on
    ``logger`` (default ``tspd.engine``) naming ``what`` (``"the Prefill arena"``).
    Returns whether the region was unregistered."""
    logger = logger or log
    try:
        done = await _teardown(
            lambda: engine.unregister_memory(addr), blocks=setup_blocks(engine), limit=limit
        )
    except TransferError as err:
        logger.warning("could not deregister %s on shutdown: %s", what, err)
        return False
    if not done:
        logger.error(
            "could not deregister %s (%#x) from transfer engine %s on shutdown: the call "
            "did not return within %gs, so shutdown went on without it (it continues in a "
            "worker thread) and the memory may still be registered. Close the engine or "
            "end the process before that memory is reused; an engine call that hangs "
            "usually means a hung device or driver.",
            what,
            addr,
            engine.session_id,
            limit,
        )
    return done


async def close_engine(
    engine: SetupEngine,
    *,
    limit: float = TEARDOWN_TIMEOUT,
    logger: logging.Logger | None = None,
) -> bool:
    """``engine.close()`` while shutting down: inline, or in a worker thread that
    runs even when the caller is cancelled and is given up after ``limit`` seconds
    (an ERROR on ``logger``, default ``tspd.engine``). Returns whether it closed;
    the engine's own errors propagate."""
    done = await _teardown(engine.close, blocks=setup_blocks(engine), limit=limit)
    if not done:
        (logger or log).error(
            "closing transfer engine %s did not return within %gs, so shutdown went on "
            "without it (the call continues in a worker thread); the memory it "
            "registered may still be pinned until the process ends.",
            engine.session_id,
            limit,
        )
    return done


@asynccontextmanager
async def open_engine(
    build: Callable[[], _E], *, close_limit: float = TEARDOWN_TIMEOUT
) -> AsyncIterator[_E]:
    """The engine ``build()`` returns, built in a worker thread (building is not
    abandoned: a cancel lands once it is built, and the engine is then closed) and
    closed on exit with :func:`close_engine`. An error from ``build`` propagates
    (Mooncake: :class:`~tspd.engines.base.EngineUnavailable`)."""
    engine = await trio.to_thread.run_sync(build, abandon_on_cancel=False)
    try:
        yield engine
    finally:
        await close_engine(engine, limit=close_limit)


@asynccontextmanager
async def open_mooncake_engine(
    host: str,
    *,
    metadata_server: str = "P2PHANDSHAKE",
    protocol: str = "tcp",
    device: str = "",
    max_descriptors: int = DEFAULT_MAX_DESCRIPTORS,
    close_limit: float = TEARDOWN_TIMEOUT,
) -> AsyncIterator[MooncakeEngine]:
    """A :class:`~tspd.engines.mooncake.MooncakeEngine` (same arguments) for the
    duration of the block, built and closed in worker threads (:func:`open_engine`).
    Wrap it in :class:`~tspd.shell.offload.EngineRunner` to write through it."""

    def build() -> MooncakeEngine:
        return MooncakeEngine(
            host,
            metadata_server=metadata_server,
            protocol=protocol,
            device=device,
            max_descriptors=max_descriptors,
        )

    async with open_engine(build, close_limit=close_limit) as engine:
        yield engine
