"""Entering a peer's Trio loop from an engine's own threads without waiting.

An inference engine's forward thread hands work to a peer (stage and hand over a
remote decode, arm layerwise chunks) and must never wait for a transfer
(docs/architecture.md#threads). :class:`LoopPortal` posts a synchronous callable into the Trio loop
with ``TrioToken.run_sync_soon`` and returns a ``concurrent.futures.Future`` at
once: the caller may ignore it, poll it, or block on ``result()`` when it wants
the error the call raised. Calls run in the order they were posted.

The futures are :class:`LazyFuture`: a ``concurrent.futures.Future`` that makes
its ``Condition`` only when a thread waits on it. A scheduler posts a few calls a
room and mostly ignores their futures; a plain ``Future`` brought eleven objects
for the garbage collector each (a ``Condition``, its ``RLock`` and bound methods,
the waiter and callback lists), a ``LazyFuture`` that nobody waits on brings two.
"""

from __future__ import annotations

import concurrent.futures
import concurrent.futures._base
import threading
import typing
from collections.abc import Callable
from typing import Any, Final, TypeVar, final

import trio

from tspd.core.errors import TspdError

__all__ = ["LazyFuture", "LoopPortal", "PeerClosed", "fulfil"]

T = TypeVar("T")


class PeerClosed(TspdError):
    """The peer's Trio loop is gone; the call was not run."""


#: Guards every LazyFuture's first Condition against its fast paths (held for a
#: few byte codes at a time).
_LAZY_LOCK: Final = threading.Lock()
#: The attributes a LazyFuture makes on first use.
_LAZY_ATTRS: Final = frozenset(("_condition", "_waiters", "_done_callbacks"))
_PENDING: Final = concurrent.futures._base.PENDING
_RUNNING: Final = concurrent.futures._base.RUNNING
_FINISHED: Final = concurrent.futures._base.FINISHED


class LazyFuture(concurrent.futures.Future[T]):
    """A ``concurrent.futures.Future`` whose ``Condition`` (and waiter and callback
    lists) are made the first time anything needs them: ``result()``, ``done()``,
    ``cancel()``, a callback, ``concurrent.futures.wait``. Until then the producer
    marks it running and sets its outcome under one module lock; once the
    Condition exists every method is the standard one. The lock makes the two
    exclusive: an outcome set without the Condition is seen by whoever makes it,
    and one set after goes through it and wakes the waiters."""

    def __init__(self) -> None:  # the base's __init__ would make the Condition now
        self._state = _PENDING
        self._result = None
        self._exception = None

    def __getattr__(self, name: str) -> Any:
        if name not in _LAZY_ATTRS:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        attrs = self.__dict__
        with _LAZY_LOCK:
            if "_condition" not in attrs:
                attrs["_waiters"] = []
                attrs["_done_callbacks"] = []
                attrs["_condition"] = threading.Condition()  # last: the fast paths look
        return attrs[name]

    def done(self) -> bool:
        """Whether the call finished or was cancelled."""
        with _LAZY_LOCK:
            if "_condition" not in self.__dict__:  # cancelling makes it: not cancelled
                return self._state == _FINISHED
        return super().done()

    def _finished_unwatched(self) -> bool:
        """Finished while nothing made the Condition (then no waiter needs it)."""
        with _LAZY_LOCK:
            return "_condition" not in self.__dict__ and self._state == _FINISHED

    def _settle(self, result: T | None, exception: BaseException | None) -> bool:
        """Set the outcome without the Condition when none was made and none is set
        yet; ``False`` when the standard path must run instead."""
        with _LAZY_LOCK:
            if "_condition" in self.__dict__ or self._state not in (_PENDING, _RUNNING):
                return False
            self._result, self._exception, self._state = result, exception, _FINISHED
            return True

    def result(self, timeout: float | None = None) -> T:
        """The call's result, or its error raised; waits at most ``timeout`` seconds
        (``None``: no limit) and raises ``TimeoutError`` after that."""
        if not self._finished_unwatched():
            return super().result(timeout)
        if self._exception is not None:
            try:
                raise self._exception
            finally:
                del self  # no cycle through the traceback (as the base does)
        return typing.cast(T, self._result)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The call's error, or ``None`` if it returned; waits like :meth:`result`."""
        return self._exception if self._finished_unwatched() else super().exception(timeout)

    def set_running_or_notify_cancel(self) -> bool:
        """Mark the call running; ``False`` if it was cancelled first (the producer's
        side, as on any ``Future``)."""
        with _LAZY_LOCK:
            if "_condition" not in self.__dict__ and self._state == _PENDING:
                self._state = _RUNNING
                return True
        return super().set_running_or_notify_cancel()

    def set_result(self, result: T) -> None:
        """Set the call's result (the producer's side)."""
        if not self._settle(result, None):
            super().set_result(result)

    def set_exception(self, exception: BaseException | None) -> None:
        """Set the call's error (the producer's side)."""
        if not self._settle(None, exception):
            super().set_exception(exception)


def fulfil(future: concurrent.futures.Future[T], fn: Callable[[], T]) -> None:
    """Run ``fn()`` into ``future`` (a posted call, in the Trio thread): its result
    or its error, unless the future was cancelled before it ran."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn())
    except Exception as exc:
        future.set_exception(exc)


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
        future: concurrent.futures.Future[T] = LazyFuture()
        if not self._open:
            future.set_exception(PeerClosed(f"{self._name} is closed; the call was dropped"))
            return future

        def run() -> None:
            if self._open:
                fulfil(future, fn)
            elif future.set_running_or_notify_cancel():
                future.set_exception(PeerClosed(f"{self._name} closed before the call ran"))

        try:
            self._token.run_sync_soon(run)
        except trio.RunFinishedError:
            future.set_exception(PeerClosed(f"{self._name} has stopped; the call was dropped"))
        return future
