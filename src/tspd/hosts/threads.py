"""Plain-thread hosts: a Trio loop in a background thread that owns the peers.

An engine whose scheduler is a loop in an ordinary thread (no event loop at all)
starts :func:`open_trio_thread`; the returned :class:`TrioThread` runs ``trio.run``
in a daemon thread whose nursery holds the peers, the bootstrap server and the
KV-event services. The scheduler then talks to them through thread-safe facades
whose entry points never wait for a transfer (docs/architecture.md#threads):

* :class:`ThreadedPrefill` -- ``register_request``, ``abort``, ``record_usage``,
  ``hand_over``, ``stage_remote_decode`` / ``hand_over_remote_decode`` and
  ``arm_layerwise`` post into the Trio loop and return a
  ``concurrent.futures.Future`` at once (ignore it, or call ``result()`` for the
  error the call raised); ``poll()`` waits only for the poll round itself (the TP
  group's agreement), never for a transfer.
* :class:`ThreadedDecode` -- ``register_request`` and ``send_preallocation`` post,
  ``poll()`` as above.
* Both have ``wait_for_activity(timeout)``: block until the peer saw something
  arrive (one wake from the Trio thread, no polling), then ``poll()``.
* :class:`ThreadedSubscriber` -- ``get(timeout)`` returns the next KV-event item or
  ``None``. Publishing needs no facade: :class:`~tspd.shell.kv_publisher.KVEventPublisher`
  ``publish`` / ``publish_nowait`` are thread-safe already.

Calls posted from one thread run in the order they were posted. If the Trio
thread crashed, later calls fail with :class:`~tspd.hosts.bridge.BridgeClosed`
naming the crash, and closing the host re-raises it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, contextmanager, suppress
from functools import partial
from typing import Any, TypeVar, final

import trio

from tspd.core.commands import Event
from tspd.core.manifest import BlockManifest
from tspd.hosts.bridge import BridgeClosed, root_error
from tspd.hosts.services import ServiceNursery
from tspd.shell.decode import DecodePeer
from tspd.shell.kv_subscriber import KVEventSubscriber, SubscriberItem
from tspd.shell.nursery import single_error
from tspd.shell.prefill import ExtendRow, PrefillPeer, RemoteDecodeRow

__all__ = [
    "ThreadedDecode",
    "ThreadedPrefill",
    "ThreadedSubscriber",
    "TrioFuture",
    "TrioThread",
    "open_trio_thread",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: How long closing the host lets the entered services exit in order.
CLOSE_TIMEOUT = 10.0

#: How long ``poll()`` waits for one poll round before raising ``TimeoutError``.
POLL_TIMEOUT = 30.0


@final
class TrioFuture(concurrent.futures.Future[T]):
    """The future of a Trio task started from another thread.

    Unlike a plain ``concurrent.futures.Future``, :meth:`cancel` also works while
    the task runs: it cancels the task's Trio cancel scope and returns ``True``;
    once the task has unwound, :meth:`result` raises
    ``concurrent.futures.CancelledError`` (and :meth:`cancelled` stays ``False``,
    as the future was already running).
    """

    def __init__(self) -> None:
        super().__init__()
        self._cancel_hook: Callable[[], None] | None = None
        self._cancel_requested = False

    def cancel(self) -> bool:
        """Cancel the call: before it started, as any future; while it runs, by
        cancelling its Trio task. ``False`` once it finished."""
        if super().cancel():
            return True
        hook = self._cancel_hook
        if hook is None or self.done():
            return False
        self._cancel_requested = True
        hook()
        return True


@final
class TrioThread:
    """A Trio run in a background thread; get one from :func:`open_trio_thread`.

    Every method is called from other threads (never from the Trio thread itself:
    the blocking ones would deadlock and raise ``RuntimeError`` there).
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._token: trio.lowlevel.TrioToken | None = None
        self._services: ServiceNursery | None = None
        self._nursery: trio.Nursery | None = None
        self._stop: trio.Event | None = None
        self._ready = threading.Event()
        self._crash: BaseException | None = None
        self._finished = threading.Event()
        self._thread = threading.Thread(target=self._thread_main, name=name, daemon=True)

    @property
    def name(self) -> str:
        """The name of the thread and of the host in messages."""
        return self._name

    @property
    def token(self) -> trio.lowlevel.TrioToken:
        """The Trio run's token (for :class:`tspd.shell.threadsafe.LoopPortal`)."""
        if self._token is None:
            raise BridgeClosed(f"{self._name} has not started")
        return self._token

    @property
    def running(self) -> bool:
        """Whether the Trio thread is up and accepts calls."""
        return self._ready.is_set() and not self._finished.is_set()

    # -- blocking calls (setup, teardown, rare queries) ------------------------------

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any, timeout: float | None = None) -> T:
        """Run the Trio async function ``fn(*args)`` and wait for its result; its
        error is raised here. ``timeout`` (seconds) cancels it and raises
        ``TimeoutError``. Blocks the caller: not for a scheduler's hot path."""

        async def bounded() -> T:
            if timeout is None:
                return await fn(*args)
            try:
                with trio.fail_after(timeout):
                    return await fn(*args)
            except trio.TooSlowError:
                raise TimeoutError(
                    f"{self._name}: {getattr(fn, '__qualname__', fn)} did not finish within "
                    f"{timeout} s"
                ) from None

        try:
            result: T = trio.from_thread.run(bounded, trio_token=self.token)
        except trio.RunFinishedError:
            raise self._closed_error("has stopped; the call was not run") from None
        return result

    def call_sync(self, fn: Callable[..., T], *args: Any) -> T:
        """Run the plain function ``fn(*args)`` in the Trio thread and wait for it
        (a quick call into a peer; it must not wait for anything itself)."""
        try:
            return trio.from_thread.run_sync(fn, *args, trio_token=self.token)
        except trio.RunFinishedError:
            raise self._closed_error("has stopped; the call was not run") from None

    def enter(self, cm: AbstractAsyncContextManager[T], *, name: str | None = None) -> T:
        """Enter the Trio async context manager ``cm`` in the host's nursery and
        return what it yields; it is exited (newest first) when the host closes."""
        value: T = self.call(partial(self._require_services().enter, name=name), cm)
        return value

    def start(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Start a ``task_status`` service in the host's nursery; returns its started
        value. It runs until the host closes."""
        return self.call(self._require_services().start, fn, *args)

    # -- non-blocking calls (a scheduler's hot path) --------------------------------

    def post(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """Run the plain function ``fn(*args)`` in the Trio thread soon and return at
        once; its result or error lands in the future. Posts run in order."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(*args))
            except Exception as exc:
                future.set_exception(exc)

        self._post_or_fail(future, run)
        return future

    def submit(self, fn: Callable[..., Awaitable[T]], *args: Any) -> TrioFuture[T]:
        """Start the Trio async function ``fn(*args)`` as a task and return at once;
        its result or error lands in the future. ``future.cancel()`` cancels the task
        even while it runs (see :class:`TrioFuture`). A host shutdown fails it with
        :class:`BridgeClosed`."""
        future: TrioFuture[T] = TrioFuture()

        def spawn() -> None:
            if self._nursery is None or future.done():
                if not future.done():
                    future.set_exception(self._closed_error("is closing; the call was not run"))
                return
            try:
                self._nursery.start_soon(self._task, future, fn, args, name=fn)
            except RuntimeError:
                future.set_exception(self._closed_error("is closing; the call was not run"))

        self._post_or_fail(future, spawn)
        return future

    # -- lifetime --------------------------------------------------------------------

    def start_thread(self, timeout: float = 30.0) -> None:
        """Start the Trio thread and wait until its nursery is up."""
        self._thread.start()
        self._ready.wait(timeout)
        if self._crash is not None:
            self._finished.wait(timeout)
            with single_error():
                raise self._crash
        if not self._ready.is_set():
            raise TimeoutError(f"{self._name} did not start within {timeout} s")

    def close(self, timeout: float = CLOSE_TIMEOUT + 5.0) -> None:
        """Exit the entered services newest first, stop the Trio run and join the
        thread; re-raises a crash of the Trio thread."""
        token = self._token
        stop = self._stop
        if token is not None and stop is not None and not self._finished.is_set():
            with suppress(trio.RunFinishedError):
                token.run_sync_soon(stop.set)
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"{self._name} did not stop within {timeout} s")
        if self._crash is not None:
            with single_error():
                raise self._crash

    # -- internals -------------------------------------------------------------------

    def _require_services(self) -> ServiceNursery:
        if self._services is None:
            raise BridgeClosed(f"{self._name} has not started")
        return self._services

    def _closed_error(self, what: str) -> BridgeClosed:
        reason = f"; it crashed: {self._crash!r}" if self._crash is not None else ""
        error = BridgeClosed(f"{self._name} {what}{reason}")
        error.__cause__ = self._crash
        return error

    def _post_or_fail(self, future: concurrent.futures.Future[Any], fn: Callable[[], None]) -> None:
        if self._token is None:
            future.set_exception(self._closed_error("has not started; the call was not run"))
            return
        try:
            self._token.run_sync_soon(fn)
        except trio.RunFinishedError:
            future.set_exception(self._closed_error("has stopped; the call was not run"))

    async def _task(
        self,
        future: TrioFuture[T],
        fn: Callable[..., Awaitable[T]],
        args: tuple[Any, ...],
    ) -> None:
        scope = trio.CancelScope()
        future._cancel_hook = lambda: self._cancel_from_any_thread(scope)
        if not future.set_running_or_notify_cancel():
            return
        try:
            with scope:
                try:
                    future.set_result(await fn(*args))
                except Exception as exc:
                    future.set_exception(exc)
        finally:
            if not future.done():
                if future._cancel_requested:
                    future.set_exception(
                        concurrent.futures.CancelledError(
                            f"{getattr(fn, '__qualname__', fn)} was cancelled in {self._name}"
                        )
                    )
                else:
                    future.set_exception(self._closed_error("stopped before the call finished"))

    def _cancel_from_any_thread(self, scope: trio.CancelScope) -> None:
        if self._token is None:
            return
        try:
            self._token.run_sync_soon(scope.cancel)
        except trio.RunFinishedError:
            return

    def _thread_main(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:
            self._crash = root_error(exc)
            log.error("%s crashed: %r", self._name, exc)
        finally:
            self._finished.set()
            self._ready.set()

    async def _main(self) -> None:
        self._stop = trio.Event()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._services = ServiceNursery(nursery, owner=self._name)
            self._token = trio.lowlevel.current_trio_token()
            self._ready.set()
            await self._stop.wait()
            with trio.move_on_after(CLOSE_TIMEOUT) as scope:
                await self._services.aclose()
            if scope.cancelled_caught:
                log.error(
                    "%s: services %s did not close within %.0f s; cancelling them",
                    self._name,
                    ", ".join(self._services.held) or "(none)",
                    CLOSE_TIMEOUT,
                )
            self._nursery = None
            nursery.cancel_scope.cancel()


@contextmanager
def open_trio_thread(*, name: str = "tspd-trio") -> Iterator[TrioThread]:
    """Run a Trio loop in a background thread for the duration of the block.

    Leaving the block exits the entered services newest first, cancels the rest,
    joins the thread and re-raises a crash of the Trio thread (unless the block is
    raising already; then the crash is logged and the block's error wins).
    """
    host = TrioThread(name)
    host.start_thread()
    try:
        yield host
    except BaseException:
        try:
            host.close()
        except BaseException as exc:
            log.error("%s failed while the host was failing: %r", name, exc)
        raise
    host.close()


class _ActivityWake:
    """A blocking, bounded wait for a peer's activity from a plain thread: the peer
    sets a ``threading.Event`` from its Trio thread whenever something arrived
    (a message, a transfer outcome, a lookup, a timer), so a scheduler thread
    sleeps until then instead of polling on a timer -- one wake, no round trip."""

    def __init__(self, host: TrioThread, peer: PrefillPeer | DecodePeer) -> None:
        self._wake = threading.Event()
        host.call_sync(lambda: setattr(peer, "on_activity", self._wake.set))

    def wait_for_activity(self, timeout: float) -> bool:
        """Block until the peer saw activity since the last call, at most ``timeout``
        seconds; ``True`` when it did (then poll), ``False`` on timeout."""
        if self._wake.wait(timeout):
            self._wake.clear()
            return True
        return False


@final
class ThreadedPrefill(_ActivityWake):
    """A Prefill peer's scheduler- and forward-side API for plain threads.

    Wrap a peer entered in a :class:`TrioThread`:
    ``ThreadedPrefill(host, host.enter(open_prefill_peer(...)))``.
    """

    def __init__(self, host: TrioThread, peer: PrefillPeer) -> None:
        super().__init__(host, peer)
        self._host = host
        self.peer = peer
        self._outbox = host.call_sync(lambda: peer.outbox)

    def register_request(self, rid: str, room: int) -> concurrent.futures.Future[None]:
        """Track request ``rid`` on ``room`` (posted; never waits)."""
        return self._host.post(self.peer.register_request, rid, room)

    def abort(self, room: int, reason: str) -> concurrent.futures.Future[None]:
        """Fail ``room`` with ``reason``, telling its destinations (posted)."""
        return self._host.post(self.peer.abort, room, reason)

    def record_usage(
        self, room: int, cached_tokens: int, logprob: float | None = None
    ) -> concurrent.futures.Future[None]:
        """Record the request's cache hit and logprob for its status (posted)."""
        return self._host.post(self.peer.record_usage, room, cached_tokens, logprob)

    def hand_over(self, rows: Sequence[RemoteDecodeRow]) -> concurrent.futures.Future[None]:
        """The prompts' KV is written: queue their transfers (posted; the future
        settles when they are queued, not when they finish -- ``poll`` says that)."""
        return self._outbox.hand_over(rows)

    def stage_remote_decode(self, rows: Sequence[RemoteDecodeRow]) -> None:
        """Stage a plan's remote decode, handed over by :meth:`hand_over_remote_decode`."""
        self._outbox.stage_remote_decode(rows)

    def hand_over_remote_decode(self) -> concurrent.futures.Future[None]:
        """Hand over the staged rows (posted)."""
        return self._outbox.hand_over_remote_decode()

    def arm_layerwise(self, rows: Sequence[ExtendRow]) -> concurrent.futures.Future[int | None]:
        """Arm layerwise chunks for the coming forward (posted)."""
        return self._outbox.arm_layerwise(rows)

    def poll_nowait(self) -> TrioFuture[list[Event]]:
        """Start one poll round and return at once; the events land in the future."""
        return self._host.submit(self.peer.poll)

    def poll(self, timeout: float = POLL_TIMEOUT) -> list[Event]:
        """One poll round (docs/protocol.md#proto-prefill-poll): waits for the TP
        group's agreement, never for a transfer. Raises ``TimeoutError`` after
        ``timeout`` seconds."""
        return self._host.call(self.peer.poll, timeout=timeout)

    def statistics(self) -> dict[str, int]:
        """The peer's table sizes and counters."""
        return self._host.call_sync(self.peer.statistics)


@final
class ThreadedDecode(_ActivityWake):
    """A Decode peer's scheduler-side API for plain threads.

    Wrap a peer entered in a :class:`TrioThread`:
    ``ThreadedDecode(host, host.enter(open_decode_peer(...)))``.
    """

    def __init__(self, host: TrioThread, peer: DecodePeer) -> None:
        super().__init__(host, peer)
        self._host = host
        self.peer = peer

    def register_request(
        self, rid: str, room: int, bootstrap_addr: str
    ) -> concurrent.futures.Future[None]:
        """Track ``rid`` for ``room`` at the Prefill instance ``bootstrap_addr``
        (posted; routing starts in the Trio thread)."""
        return self._host.post(self.peer.register_request, rid, room, bootstrap_addr)

    def send_preallocation(
        self,
        room: int,
        manifest: BlockManifest | Mapping[str, Sequence[int]],
        *,
        prefix_len: int = 0,
        prompt_len: int | None = None,
    ) -> concurrent.futures.Future[None]:
        """Pre-allocate ``room`` with its Prefill ranks (posted)."""

        def send() -> None:
            self.peer.send_preallocation(
                room, manifest, prefix_len=prefix_len, prompt_len=prompt_len
            )

        return self._host.post(send)

    def poll_nowait(self) -> TrioFuture[list[Event]]:
        """Start one poll round and return at once; the events land in the future."""
        return self._host.submit(self.peer.poll)

    def poll(self, timeout: float = POLL_TIMEOUT) -> list[Event]:
        """One poll round (docs/protocol.md#proto-decode-poll); waits for the agreement only."""
        return self._host.call(self.peer.poll, timeout=timeout)

    def statistics(self) -> dict[str, int]:
        """The peer's table sizes and counters."""
        return self._host.call_sync(self.peer.statistics)


@final
class ThreadedSubscriber:
    """A KV-event subscriber read from a plain thread.

    Wrap one entered in a :class:`TrioThread`:
    ``ThreadedSubscriber(host, host.enter(open_kv_subscriber(sources)))``.
    """

    def __init__(self, host: TrioThread, subscriber: KVEventSubscriber) -> None:
        self._host = host
        self.subscriber = subscriber

    def get(self, timeout: float) -> SubscriberItem | None:
        """The next item, or ``None`` when none arrived within ``timeout`` seconds or
        the subscriber closed."""

        async def receive() -> SubscriberItem | None:
            with trio.move_on_after(timeout):
                try:
                    return await self.subscriber.receive()
                except (trio.EndOfChannel, trio.ClosedResourceError):
                    return None
            return None

        return self._host.call(receive)
