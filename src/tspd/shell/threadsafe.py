"""Entering a peer's Trio loop from an engine's own threads without waiting.

An inference engine's forward thread hands work to a peer (stage and hand over a
remote decode, arm layerwise chunks) and must never wait for a transfer
(docs/architecture.md#threads). :class:`LoopPortal` posts a synchronous callable into the Trio loop
with ``TrioToken.run_sync_soon`` and returns a ``concurrent.futures.Future`` at
once: the caller may ignore it, poll it, or block on ``result()`` when it wants
the error the call raised. Calls run in the order they were posted.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import TypeVar, final

import trio

from tspd.core.errors import TspdError

__all__ = ["LoopPortal", "PeerClosed"]

T = TypeVar("T")


class PeerClosed(TspdError):
    """The peer's Trio loop is gone; the call was not run."""


@final
class LoopPortal:
    """Posts calls from any thread into one Trio run, in order, without waiting."""

    def __init__(self, token: trio.lowlevel.TrioToken, *, name: str) -> None:
        self._token = token
        self._name = name
        self._open = True

    def close(self) -> None:
        """Refuse later calls (the peer is shutting down)."""
        self._open = False

    def post(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``fn()`` in the Trio thread soon; its result or error lands in the future."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        if not self._open:
            future.set_exception(PeerClosed(f"{self._name} is closed; the call was dropped"))
            return future

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            if not self._open:
                future.set_exception(PeerClosed(f"{self._name} closed before the call ran"))
                return
            try:
                future.set_result(fn())
            except Exception as exc:
                future.set_exception(exc)

        try:
            self._token.run_sync_soon(run)
        except trio.RunFinishedError:
            future.set_exception(PeerClosed(f"{self._name} has stopped; the call was dropped"))
        return future
