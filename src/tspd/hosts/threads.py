"""Plain-thread hosts: a Trio loop in a background thread that owns the peers.

An engine whose scheduler is a loop in an ordinary thread (no event loop at all)
starts :func:`open_trio_thread`; the returned :class:`TrioThread` runs ``trio.run``
in a daemon thread whose nursery holds the peers, the bootstrap server and the
KV-event services. The scheduler then talks to them through thread-safe facades
whose entry points never wait for a transfer (docs/architecture.md#threads).

The Prefill and Decode facades (:class:`ThreadedPrefill`, :class:`ThreadedDecode`)
are not written out again: each method is declared from the peer method of the
same name, keeping its parameters, types and docstring, and only says how it
crosses -- *posted* (run in the Trio thread soon; a ``concurrent.futures.Future``
comes back at once: ignore it, or ``result()`` for the error the call raised),
*called* or *awaited* (the caller waits for the result), or for Prefill's forward
side through the peer's :class:`~tspd.shell.prefill.PrefillOutbox`. A facade's
``not_exposed`` names, with the reason, the public peer members it leaves out; a
test fails on any other that is missing. ``poll()`` never waits for a transfer. For a
group of one rank, the facade turns on the peer's eager conclusion
(:meth:`~tspd.shell.peer.RankPeer.conclude_eagerly`): the Trio thread concludes
as input arrives and after posted calls that leave events (and every 50 ms
while requests are in flight), and ``poll()`` takes those events in the calling
thread, never crossing.
An idle scheduler calls
``poll(wait=t)``, which sleeps until a conclusion brought events (at most ``t``
seconds); ``wait_for_activity(t)`` is the wake alone. A TP group's ``poll()``
waits for the group's agreement in the Trio thread.
:class:`ThreadedSubscriber` -- ``get(timeout)`` returns the next KV-event item or
``None``. Publishing needs no facade: :class:`~tspd.shell.kv_publisher.KVEventPublisher`
``publish`` / ``publish_nowait`` are thread-safe already.

Calls posted from one thread run in the order they were posted. If the Trio
thread crashed, later calls fail with :class:`~tspd.hosts.bridge.BridgeClosed`
naming the crash, and closing the host re-raises it.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import logging
import threading
import typing
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import AbstractAsyncContextManager, contextmanager, suppress
from functools import partial
from types import GenericAlias
from typing import Any, ClassVar, Concatenate, Generic, ParamSpec, Protocol, TypeVar, final

import outcome
import trio

from tspd.core.commands import Event
from tspd.hosts.bridge import TrioHost, root_error
from tspd.hosts.services import ServiceNursery
from tspd.shell.agreement import ReplicaAgreement
from tspd.shell.decode import DecodePeer
from tspd.shell.kv_subscriber import KVEventSubscriber, SubscriberItem
from tspd.shell.nursery import single_error
from tspd.shell.prefill import PrefillOutbox, PrefillPeer
from tspd.shell.threadsafe import LazyFuture, fulfil

__all__ = [
    "IDLE_CALL_RUNNERS",
    "ThreadedDecode",
    "ThreadedPeer",
    "ThreadedPrefill",
    "ThreadedSubscriber",
    "TrioFuture",
    "TrioThread",
    "open_trio_thread",
]

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")
P = ParamSpec("P")

#: Call runners kept parked between blocking calls (see :meth:`TrioThread.call`): a
#: scheduler's idle wait is such a call, several a room, and a task started and
#: ended for each cost the Trio thread ~20 µs a call (docs/architecture.md#threads).
IDLE_CALL_RUNNERS = 4

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


class _Failable(Protocol):
    """What the host's queue fails when the Trio thread cannot run an entry: a
    post's ``Future`` or a blocking call's :class:`_Waiter`."""

    def done(self) -> bool: ...

    def set_running_or_notify_cancel(self) -> bool: ...

    def set_exception(self, exception: BaseException | None) -> None: ...


@final
class _Waiter(Generic[T]):
    """A blocking call's outcome: the caller sleeps on a lock that the first outcome
    releases (a ``Future`` brings a ``Condition`` with an ``RLock``, which a
    scheduler's idle wait paid for on every crossing)."""

    __slots__ = ("_claim", "_error", "_ready", "_value")

    def __init__(self) -> None:
        self._claim = threading.Lock()  # taken by the first outcome; later ones drop
        self._ready = threading.Lock()
        self._ready.acquire()
        self._value: T | None = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._claim.locked()

    def set_running_or_notify_cancel(self) -> bool:
        return not self.done()

    def set_result(self, value: T) -> None:
        if self._claim.acquire(blocking=False):
            self._value = value
            self._ready.release()

    def set_exception(self, exception: BaseException | None) -> None:
        if self._claim.acquire(blocking=False):
            self._error = exception or RuntimeError("the call failed without an error")
            self._ready.release()

    def result(self) -> T:
        """Block until the outcome; return the value or raise the error (once)."""
        self._ready.acquire()
        error, self._error = self._error, None  # no cycle through the traceback
        if error is not None:
            raise error
        return typing.cast(T, self._value)


@final
class TrioThread(TrioHost):
    """A Trio run in a background thread; get one from :func:`open_trio_thread`.

    Every method is called from other threads (never from the Trio thread itself:
    the blocking ones would deadlock and raise ``RuntimeError`` there).
    """

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._nursery: trio.Nursery | None = None
        self._stop: trio.Event | None = None
        self._ready = threading.Event()
        self._finished = threading.Event()
        #: Posts waiting for the Trio thread, and whether a drain is queued there.
        self._posts: deque[tuple[_Failable, Callable[[], None]]] = deque()
        self._posts_lock = threading.Lock()
        self._drain_queued = False
        #: Call runners parked for the next blocking call (Trio thread only).
        self._idle_runners: list[trio.lowlevel.Task] = []
        self._thread = threading.Thread(target=self._thread_main, name=name, daemon=True)

    @property
    def running(self) -> bool:
        """Whether the Trio thread is up and accepts calls."""
        return self._ready.is_set() and not self._finished.is_set()

    # -- blocking calls (setup, teardown, rare queries) ------------------------------

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any, timeout: float | None = None) -> T:
        """Run the Trio async function ``fn(*args)`` and wait for its result; its
        error is raised here. ``timeout`` (seconds) cancels it and raises
        ``TimeoutError``. Blocks the caller (for a scheduler's idle wait, the setup
        and the teardown).

        It starts ``fn`` through the same queue as :meth:`post` -- after every post
        made before it, in the same wake-up of the Trio thread -- and hands the
        result back through a lock, not a ``Future``: a scheduler that posts a
        call and then waits pays one crossing, not two (docs/architecture.md#threads).
        ``fn`` runs on a *call runner*, a task of the host's that parks between
        calls (at most :data:`IDLE_CALL_RUNNERS` stay parked; overlapping calls get
        one each), not on a task spawned for it: a context variable a call sets is
        still set for the next call its runner serves."""

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

        waiter: _Waiter[T] = _Waiter()
        self._refuse_in_trio()
        self._enqueue(waiter, partial(self._run_call, waiter, bounded))
        return waiter.result()

    def call_sync(self, fn: Callable[..., T], *args: Any) -> T:
        """Run the plain function ``fn(*args)`` in the Trio thread and wait for it
        (a quick call into a peer; it must not wait for anything itself). It runs
        in order with :meth:`post` (see :meth:`call`)."""
        waiter: _Waiter[T] = _Waiter()

        def run() -> None:
            try:
                waiter.set_result(fn(*args))
            except BaseException as exc:  # delivered to the caller, as it raised it
                waiter.set_exception(exc)

        self._refuse_in_trio()
        self._enqueue(waiter, run)
        return waiter.result()

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
        once; its result or error lands in the future. Posts run in order, and
        before any call or submit made after them from the same thread.

        A burst of posts wakes the Trio thread once: they queue here and one
        callback runs every post queued by the time it runs (a scheduler that
        registers 256 requests in a row pays one wake-up, not 256)."""
        future: concurrent.futures.Future[T] = LazyFuture()
        self._enqueue(future, partial(fulfil, future, partial(fn, *args) if args else fn))
        return future

    def _enqueue(self, waiter: _Failable, run: Callable[[], None]) -> None:
        """Queue ``run`` for the Trio thread after every earlier post or call; the
        first entry of a burst wakes the thread, whose drain runs the lot."""
        with self._posts_lock:
            self._posts.append((waiter, run))
            if self._drain_queued:
                return
            self._drain_queued = True
        self._post_or_fail(waiter, self._drain_posts)

    def _refuse_in_trio(self) -> None:
        """A blocking call from a Trio task would block its run (this host's: for
        ever): refuse it, as ``trio.from_thread`` does."""
        try:
            trio.lowlevel.current_task()
        except RuntimeError:
            return
        raise RuntimeError(f"{self._name}: this is a blocking call; make it from a plain thread")

    def _drain_posts(self) -> None:
        """Run every queued post, in order (in the Trio thread)."""
        while True:
            with self._posts_lock:
                if not self._posts:
                    self._drain_queued = False
                    return
                _, run = self._posts.popleft()
            run()

    def submit(self, fn: Callable[..., Awaitable[T]], *args: Any) -> TrioFuture[T]:
        """Start the Trio async function ``fn(*args)`` as a task and return at once;
        its result or error lands in the future. ``future.cancel()`` cancels the task
        even while it runs (see :class:`TrioFuture`). A host shutdown fails it with
        :class:`BridgeClosed`."""
        future: TrioFuture[T] = TrioFuture()
        self._post_or_fail(future, partial(self._start, future, fn, self._task, future, fn, args))
        return future

    def _start(
        self, outcome: _Failable, name: object, task: Callable[..., Awaitable[None]], *args: Any
    ) -> None:
        """Start ``task(*args)`` in the host's nursery (in the Trio thread), unless
        ``outcome`` is settled already (a cancelled submit); fail it when the host is
        closing."""
        if outcome.done():
            return
        if self._nursery is not None:
            try:
                self._nursery.start_soon(task, *args, name=name)
                return
            except RuntimeError:
                pass
        outcome.set_exception(self._closed_error("is closing; the call was not run"))

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

    def _post_or_fail(self, future: _Failable, fn: Callable[[], None]) -> None:
        if self._token is None:
            self._fail_posts(future, "has not started; the call was not run")
            return
        try:
            self._token.run_sync_soon(fn)
        except trio.RunFinishedError:
            self._fail_posts(future, "has stopped; the call was not run")

    def _fail_posts(self, future: _Failable, why: str) -> None:
        """``future`` (and, when its callback was the posts' drain, every queued
        post) cannot run: fail it."""
        failed = [future]
        with self._posts_lock:
            if self._drain_queued:
                failed += [f for f, _ in self._posts if f is not future]
                self._posts.clear()
                self._drain_queued = False
        for f in failed:
            if not f.done() and f.set_running_or_notify_cancel():
                f.set_exception(self._closed_error(why))

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

    def _run_call(self, waiter: _Waiter[Any], fn: Callable[[], Awaitable[Any]]) -> None:
        """Run a blocking :meth:`call`'s ``fn`` (in the Trio thread): on a parked call
        runner when one is idle, else on a new one."""
        if waiter.done():
            return
        if self._idle_runners:
            trio.lowlevel.reschedule(self._idle_runners.pop(), outcome.Value((waiter, fn)))
            return
        self._start(waiter, "tspd call runner", self._call_runner, waiter, fn)

    async def _call_runner(self, waiter: _Waiter[Any], fn: Callable[[], Awaitable[Any]]) -> None:
        """A call runner: run one call, then park for the next while fewer than
        :data:`IDLE_CALL_RUNNERS` others are parked (a task spawned for each call
        cost the Trio thread a task's start and exit on every crossing)."""
        while True:
            await self._call_task(waiter, fn)
            if len(self._idle_runners) >= IDLE_CALL_RUNNERS:
                return
            task = trio.lowlevel.current_task()
            self._idle_runners.append(task)

            def abort(_: Any, task: trio.lowlevel.Task = task) -> trio.lowlevel.Abort:
                self._idle_runners.remove(task)
                return trio.lowlevel.Abort.SUCCEEDED

            waiter, fn = await trio.lowlevel.wait_task_rescheduled(abort)

    async def _call_task(self, waiter: _Waiter[T], fn: Callable[[], Awaitable[T]]) -> None:
        try:
            waiter.set_result(await fn())
        except Exception as exc:
            waiter.set_exception(exc)
        finally:
            if not waiter.done():  # cancelled: the host is closing
                waiter.set_exception(self._closed_error("stopped before the call finished"))

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
            # Posts whose drain the finished run never ran fail, rather than hang.
            with self._posts_lock:
                left = [future for future, _ in self._posts]
                self._posts.clear()
                self._drain_queued = False  # a later post finds the run over
            for future in left:
                if not future.done() and future.set_running_or_notify_cancel():
                    future.set_exception(self._closed_error("stopped before the call ran"))

    async def _main(self) -> None:
        self._stop = trio.Event()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._services = ServiceNursery(nursery, owner=self._name)
            self._token = trio.lowlevel.current_trio_token()
            self._ready.set()
            await self._stop.wait()
            await self._services.close_within(CLOSE_TIMEOUT)
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


# -- the peer facades, derived from the peers' API -----------------------------------


class _Peer(Protocol):
    """What the shared part of a facade uses of a peer."""

    on_activity: Callable[[], None] | None

    @property
    def agreement(self) -> ReplicaAgreement: ...

    async def poll(self) -> list[Event]: ...

    def poll_now(self) -> list[Event]: ...

    def conclude_eagerly(self, eager: bool = True) -> None: ...

    def take_ready(self) -> list[Event]: ...

    async def wait_for_activity(self) -> None: ...


PeerT = TypeVar("PeerT", bound=_Peer)
#: Covariant: a method a peer inherits (``RankPeer.poll``) binds to its facade.
PeerT_co = TypeVar("PeerT_co", bound=_Peer, covariant=True)


class ThreadedPeer(Generic[PeerT_co]):
    """What :class:`ThreadedPrefill` and :class:`ThreadedDecode` share: polling and
    waiting for the peer's activity from a plain thread.

    The rest of each facade is declared from its peer's methods (see the module
    doc); ``not_exposed`` names the public peer members it leaves out, and why.
    """

    #: Public members of the peer's API this facade leaves out, with the reason.
    not_exposed: ClassVar[Mapping[str, str]] = {}

    def __init__(self, host: TrioThread, peer: PeerT_co) -> None:
        self._host = host
        self.peer = peer
        self._wake = threading.Event()
        #: A group of one concludes its polls in the Trio thread as input arrives, so
        #: a poll takes their events without a crossing (RankPeer.conclude_eagerly).
        self._eager = peer.agreement.group_size == 1
        host.call_sync(self._attach)

    def _attach(self) -> None:
        self.peer.on_activity = self._wake.set
        if self._eager:
            self.peer.conclude_eagerly()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name, value in vars(cls).items():
            source = getattr(value, "_derived_from", None)
            if source is None:
                continue
            if source.__name__ != name:
                raise TypeError(f"{cls.__name__}.{name} is derived from {source.__qualname__}")
            value.__qualname__ = f"{cls.__qualname__}.{name}"

    def wait_for_activity(self, timeout: float) -> bool:
        """Block until the peer saw activity since the last call -- a message, a
        transfer outcome, a lookup, a timer; for a group of one, a conclusion that
        brought events -- at most ``timeout`` seconds; ``True`` when it did (then
        poll), ``False`` on timeout. The peer sets a ``threading.Event`` from its
        Trio thread: one wake, no polling, no round trip."""
        if self._wake.wait(timeout):
            self._wake.clear()
            return True
        return False

    def poll(self, timeout: float = POLL_TIMEOUT, *, wait: float = 0.0) -> list[Event]:
        """One poll round (the peer's ``poll``, docs/protocol.md#proto-prefill-poll and
        #proto-decode-poll), never waiting for a transfer. A TP group's round raises
        ``TimeoutError`` after ``timeout`` seconds (plus ``wait``).

        A group of one rank concludes eagerly (docs/architecture.md#threads): the
        Trio thread concludes after every input and every posted call that leaves
        events (a registration for a room past bootstrapping, an abort), and while
        requests are in flight at least every
        :data:`~tspd.shell.peer.EAGER_SWEEP_S`, so the round takes those events
        here and never crosses into the Trio thread. With ``wait`` (seconds) and no
        events waiting, it first sleeps until a conclusion brings some, at most
        ``wait``. A poll that finds nothing on a host that stopped raises
        :class:`~tspd.hosts.bridge.BridgeClosed`. A TP group's round waits for the
        group's agreement in the Trio thread; with ``wait`` it first waits there for
        the peer's activity, in the same crossing."""
        if self._eager:
            self._wake.clear()
            events = self.peer.take_ready()
            if not events and wait > 0 and self._wake.wait(wait):
                self._wake.clear()
                events = self.peer.take_ready()
            if not events and not self._host.running:
                raise self._host._closed_error("has stopped; nothing more will be concluded")
            return events
        if wait <= 0:
            return self._host.call(self.peer.poll, timeout=timeout)
        return self._host.call(self._poll_after_activity, wait, timeout=wait + timeout)

    def poll_nowait(self) -> TrioFuture[list[Event]]:
        """Start one poll round and return at once; the events land in the future."""
        return self._host.submit(self.peer.poll)

    async def _poll_after_activity(self, wait: float) -> list[Event]:
        with trio.move_on_after(wait):
            await self.peer.wait_for_activity()
        return await self.peer.poll()


def _derived(
    wrapper: Callable[P, R],
    source: Callable[..., Any],
    how: str,
    returns: Callable[[Any], Any] = lambda result: result,
) -> Callable[P, R]:
    """``wrapper`` as ``source`` looks -- name, parameters and types (for ``help()``,
    the API docs and IDEs), docstring -- with ``how`` it crosses appended and
    ``returns(the source's return type)`` as its return type."""
    signature = inspect.signature(source)
    try:
        hints = typing.get_type_hints(source)  # resolved where the source is defined
    except NameError:  # a name imported for type checking only: keep the strings
        hints = {}
    params = [
        p.replace(annotation=hints.get(n, p.annotation)) for n, p in signature.parameters.items()
    ]
    result = hints.get("return", signature.return_annotation)
    signature = signature.replace(
        parameters=params, return_annotation=returns(None if result is type(None) else result)
    )
    wrapper.__name__ = source.__name__
    wrapper.__doc__ = f"{inspect.cleandoc(source.__doc__ or '')}\n\n{how}"
    wrapper.__annotations__ = {
        p.name: p.annotation for p in params if p.annotation is not p.empty
    } | {"return": signature.return_annotation}
    vars(wrapper).update(__signature__=signature, _derived_from=source)
    return wrapper


def _posted(
    method: Callable[Concatenate[PeerT, P], R],
) -> Callable[Concatenate[ThreadedPeer[PeerT], P], concurrent.futures.Future[R]]:
    """The facade method for a quick peer call that the caller need not wait for."""

    def posted(
        self: ThreadedPeer[PeerT], /, *args: P.args, **kwargs: P.kwargs
    ) -> concurrent.futures.Future[R]:
        return self._host.post(partial(method, self.peer, *args, **kwargs))

    how = (
        "*Posted* into the Trio thread: returns a ``concurrent.futures.Future`` at once "
        "(ignore it, or call ``result()`` for the error the call raised)."
    )
    return _derived(
        posted, method, how, lambda result: GenericAlias(concurrent.futures.Future, result)
    )


def _called(
    method: Callable[Concatenate[PeerT, P], R],
) -> Callable[Concatenate[ThreadedPeer[PeerT], P], R]:
    """The facade method for a quick peer call whose result the caller waits for."""

    def called(self: ThreadedPeer[PeerT], /, *args: P.args, **kwargs: P.kwargs) -> R:
        return self._host.call_sync(partial(method, self.peer, *args, **kwargs))

    return _derived(called, method, "*Called* in the Trio thread; returns its result.")


def _awaited(
    method: Callable[Concatenate[PeerT, P], Awaitable[R]],
) -> Callable[Concatenate[ThreadedPeer[PeerT], P], R]:
    """The facade method for an async peer method: awaited in the Trio thread."""

    def awaited(self: ThreadedPeer[PeerT], /, *args: P.args, **kwargs: P.kwargs) -> R:
        return self._host.call(partial(method, self.peer, *args, **kwargs))

    how = "*Awaited* in the Trio thread; blocks the caller until it returns."
    return _derived(awaited, method, how)


def _outboxed(
    method: Callable[Concatenate[PrefillOutbox, P], R],
) -> Callable[Concatenate[ThreadedPrefill, P], R]:
    """The facade method for a forward-side call: the peer's outbox, from this thread."""

    def outboxed(self: ThreadedPrefill, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return method(self._outbox, *args, **kwargs)

    name = method.__name__
    how = f"Forward side, from any thread: :meth:`~tspd.shell.prefill.PrefillOutbox.{name}`"
    if hasattr(PrefillPeer, name):
        how += f", which posts :meth:`~tspd.shell.prefill.PrefillPeer.{name}` into the Trio thread"
    return _derived(outboxed, method, f"{how}; never waits.")


_TRANSFER_FEEDBACK = "transfer feedback from the peer's own workers, in the Trio thread"
_SESSION_ID = "fixed once the peer runs: read ``peer.session_id`` from any thread"
_POLL_NOW = "for the Trio thread: a group of one concludes eagerly; its poll() never crosses"
_EAGER = "the facade turns eager conclusion on for a group of one; poll() takes its events"


@final
class ThreadedPrefill(ThreadedPeer[PrefillPeer]):
    """A Prefill peer's scheduler- and forward-side API for plain threads.

    Wrap a peer entered in a :class:`TrioThread`:
    ``ThreadedPrefill(host, host.enter(open_prefill_peer(...)))``.
    """

    not_exposed: ClassVar[Mapping[str, str]] = {
        "chunk_succeeded": _TRANSFER_FEEDBACK,
        "chunk_failed": _TRANSFER_FEEDBACK,
        "wait_should_stop": _TRANSFER_FEEDBACK,
        "room_active": _TRANSFER_FEEDBACK,
        "outbox": "its methods are this facade's forward-side methods",
        "poll_now": _POLL_NOW,
        "conclude_eagerly": _EAGER,
        "eager": _EAGER,
        "take_ready": _EAGER,
        "session_id": _SESSION_ID,
    }

    def __init__(self, host: TrioThread, peer: PrefillPeer) -> None:
        super().__init__(host, peer)
        self._outbox = host.call_sync(lambda: peer.outbox)

    register_request = _posted(PrefillPeer.register_request)
    abort = _posted(PrefillPeer.abort)
    record_usage = _posted(PrefillPeer.record_usage)
    hand_over = _outboxed(PrefillOutbox.hand_over)
    stage_remote_decode = _outboxed(PrefillOutbox.stage_remote_decode)
    remote_decode_pending = _outboxed(PrefillOutbox.remote_decode_pending)
    hand_over_remote_decode = _outboxed(PrefillOutbox.hand_over_remote_decode)
    arm_layerwise = _outboxed(PrefillOutbox.arm_layerwise)
    has_in_flight = _called(PrefillPeer.has_in_flight)
    room_state = _called(PrefillPeer.room_state)
    trace = _called(PrefillPeer.trace)
    recent_traces = _called(PrefillPeer.recent_traces)
    statistics = _called(PrefillPeer.statistics)
    release_registration = _awaited(PrefillPeer.release_registration)
    restore_registration = _awaited(PrefillPeer.restore_registration)


@final
class ThreadedDecode(ThreadedPeer[DecodePeer]):
    """A Decode peer's scheduler-side API for plain threads.

    Wrap a peer entered in a :class:`TrioThread`:
    ``ThreadedDecode(host, host.enter(open_decode_peer(...)))``.
    """

    not_exposed: ClassVar[Mapping[str, str]] = {
        "server_key": "the push pool's CURVE key lookup (secure mode), in the Trio thread",
        "poll_now": _POLL_NOW,
        "conclude_eagerly": _EAGER,
        "eager": _EAGER,
        "take_ready": _EAGER,
        "session_id": _SESSION_ID,
    }

    register_request = _posted(DecodePeer.register_request)
    send_preallocation = _posted(DecodePeer.send_preallocation)
    has_in_flight = _called(DecodePeer.has_in_flight)
    room_state = _called(DecodePeer.room_state)
    trace = _called(DecodePeer.trace)
    recent_traces = _called(DecodePeer.recent_traces)
    statistics = _called(DecodePeer.statistics)


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
