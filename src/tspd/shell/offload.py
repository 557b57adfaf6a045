"""Calling a blocking transfer engine from Trio, and waiting for producer steps.

:class:`EngineRunner` turns any synchronous :class:`~tspd.engines.base.TransferEngine`
into an :class:`~tspd.engines.base.AsyncTransferEngine`: each ``batch_write`` runs in
a worker thread via ``trio.to_thread.run_sync`` under a per-engine
``trio.CapacityLimiter`` (Mooncake's sync calls busy-spin a core each; on a small
host one or two concurrent writes is the useful limit).

Cancellation: a write is **never abandoned** (``abandon_on_cancel=False``). The
engine is reading this rank's registered memory and writing the peer's; if the
caller moved on, the memory could be released or reused (sleep/wake, a room that
ended) while the transfer still references it. A cancelled caller therefore waits
for the write to finish (bounded by ``MC_TRANSFER_TIMEOUT`` for Mooncake), and gets
its outcome: a ``TransferError`` if it failed, otherwise the cancellation is
delivered at the caller's next checkpoint.

:func:`wait_step` waits until a producer step counter has passed a target step
(spec §5.7). The default polls the counter on the Trio thread: a read is one
aligned 8-byte load, far cheaper than a thread hop, so the loop stays responsive
and the wait is cancellable at once. ``in_thread=True`` instead blocks a worker
thread with the same polling (for counters whose read may block); that thread is
abandoned on cancel, and a stop flag makes it exit within one poll interval so it
never outlives the wait by more than that.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Final, final

import trio

from tspd.core.schedule import step_ready
from tspd.engines.base import AddressList, TransferEngine

__all__ = ["DEFAULT_WRITE_CONCURRENCY", "EngineRunner", "wait_step"]

DEFAULT_WRITE_CONCURRENCY: Final = 2
"""Concurrent blocking writes per engine when no limiter is given."""

_FAST_POLLS: Final = 8
"""Zero-length sleeps before a step wait backs off to timed polls."""


@final
class EngineRunner:
    """An async front for a synchronous engine (see the module docstring).

    ``limiter`` bounds concurrent writes (threads) for this engine; the default
    allows :data:`DEFAULT_WRITE_CONCURRENCY`. Registration calls run inline: they
    are tens of microseconds and must happen in order with the caller's own state.
    """

    def __init__(
        self, engine: TransferEngine, *, limiter: trio.CapacityLimiter | None = None
    ) -> None:
        self.engine = engine
        self.limiter = (
            trio.CapacityLimiter(DEFAULT_WRITE_CONCURRENCY) if limiter is None else limiter
        )
        self._in_flight = 0

    @property
    def session_id(self) -> str:
        """The engine's session id."""
        return self.engine.session_id

    @property
    def in_flight(self) -> int:
        """Writes started and not yet finished (including those waiting for the limiter)."""
        return self._in_flight

    def register_memory(self, addr: int, length: int) -> None:
        """As :meth:`TransferEngine.register_memory`, inline."""
        self.engine.register_memory(addr, length)

    def unregister_memory(self, addr: int) -> None:
        """As :meth:`TransferEngine.unregister_memory`, inline."""
        self.engine.unregister_memory(addr)

    async def batch_write(
        self,
        peer_session: str,
        src: AddressList,
        dst: AddressList,
        lengths: AddressList,
    ) -> None:
        """Run :meth:`TransferEngine.batch_write` in a worker thread; never abandoned
        once started (a cancel that arrives while waiting for the limiter does cancel
        the write before it starts)."""
        self._in_flight += 1
        try:
            await trio.to_thread.run_sync(
                self.engine.batch_write,
                peer_session,
                src,
                dst,
                lengths,
                limiter=self.limiter,
                abandon_on_cancel=False,
            )
        finally:
            self._in_flight -= 1

    def close(self) -> None:
        """Close the engine. Call it only when no write is in flight."""
        self.engine.close()


async def wait_step(
    counter_read: Callable[[], int],
    target: int,
    *,
    poll: float = 0.001,
    in_thread: bool = False,
) -> int:
    """Return once ``step_ready(counter_read(), target)`` holds; returns the counter
    value that satisfied it.

    On the Trio thread (default) the first few polls are zero-length sleeps (a
    step is often just about to land), then one every ``poll`` seconds; under a
    ``MockClock`` the timed polls autojump. With ``in_thread=True`` a worker thread
    polls every ``poll`` seconds instead (see the module docstring). Bound the wait
    with ``trio.fail_after`` or a cancel scope: a step that never comes is waited
    for forever.
    """
    if poll <= 0:
        raise ValueError(f"step wait poll interval must be positive, got {poll}")
    if in_thread:
        return await _wait_step_in_thread(counter_read, target, poll)
    polls = 0
    while True:
        value = counter_read()
        if step_ready(value, target):
            await trio.lowlevel.checkpoint()
            return value
        await trio.sleep(0 if polls < _FAST_POLLS else poll)
        polls += 1


async def _wait_step_in_thread(counter_read: Callable[[], int], target: int, poll: float) -> int:
    stop = threading.Event()

    def spin() -> int:
        while not stop.is_set():
            value = counter_read()
            if step_ready(value, target):
                return value
            time.sleep(poll)
        return -1

    try:
        return await trio.to_thread.run_sync(spin, abandon_on_cancel=True)
    finally:
        stop.set()
