"""What a Prefill rank's peer and a Decode rank's peer share, written once.

:class:`RankPeer` is the base of :class:`~tspd.shell.prefill.PrefillPeer` and
:class:`~tspd.shell.decode.DecodePeer`, as :class:`~tspd.core.rank.RankCore` is of
their cores. It owns the parts of a running peer that do not depend on the side:

* **command execution**: after every core call the peer *pumps*
  (:meth:`RankPeer._pump`): each queued command is handed to the
  :class:`~tspd.shell.observe.PeerObserver` (logs, metrics) and then to the side's
  executor, an exhaustive ``match`` over the side's command union
  (:data:`~tspd.core.commands.PrefillCommand`,
  :data:`~tspd.core.commands.DecodeCommand`) ending in ``assert_never``, so a
  command a side cannot emit is a type error; then the rooms that ended go to the
  observer and the timer re-reads the core's deadline;
* **activity**: input from outside the scheduler (a message, a transfer outcome, a
  lookup, a timer) wakes :meth:`RankPeer.wait_for_activity` and
  :attr:`RankPeer.on_activity`; with eager conclusion (a group of one driven
  from a plain thread, :meth:`RankPeer.conclude_eagerly`) the peer concludes a
  poll after such input first and wakes them only when that brought events;
* the **timer** (:class:`~tspd.shell.timer.DeadlineTimer`) and the **push pool**
  (:class:`~tspd.shell.pushes.PushPool`) tasks;
* the **receive task** (:meth:`RankPeer._receive`): the only owner of the side's
  PULL socket, which hands the core each drained batch (in secure mode each message
  with its CURVE identity) and never dies of a message;
* the scheduler-side calls that read the same on both sides (:meth:`RankPeer.poll`,
  :meth:`RankPeer.has_in_flight`, :meth:`RankPeer.room_state`...).

:func:`open_rank_sockets` and :func:`open_peer_nursery` are the setup both
``open_*_peer`` functions share: the CURVE guard, push pool and bound PULL socket,
then the bootstrap client and the task nursery.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Final, Generic, Protocol, TypeVar

import trio
import zmq

from tspd.core.commands import Command, Event, Log, Rejected, RoomFailed
from tspd.core.machines import RoomState
from tspd.core.trace import RoomTrace, Side
from tspd.shell.agreement import ReplicaAgreement
from tspd.shell.bootstrap import BootstrapClient
from tspd.shell.nursery import single_error
from tspd.shell.observe import ObservedCore, PeerObserver
from tspd.shell.pushes import PushPool
from tspd.shell.security import CurveGuard, SecurityConfig
from tspd.shell.timer import DeadlineTimer
from tspd.shell.zmq import MAX_MESSAGE_FRAMES, TrioSocket, bind_free_port, open_socket

__all__ = [
    "EAGER_SWEEP_S",
    "INLINE_CONCLUDE_MAX",
    "RECENT_FAILURES",
    "PeerCore",
    "PeerSettings",
    "RankConfig",
    "RankPeer",
    "Receiver",
    "host_clock_offset",
    "open_peer_nursery",
    "open_rank_sockets",
]

#: How many recent room failures a peer keeps in ``failures``.
RECENT_FAILURES: Final = 1024

#: Seconds at most between two eager conclusions while requests are in flight
#: (:meth:`RankPeer.conclude_eagerly`), input or not: what only time brings -- a
#: bootstrap timeout, pages held past the quarantine -- reaches the scheduler within
#: this, without its polls crossing into the Trio thread. The timeouts it serves
#: are seconds long.
EAGER_SWEEP_S: Final = 0.05

#: With eager conclusion, input that arrives while at most this many requests are
#: tracked is concluded at once, in the step that brought it, rather than by the
#: conclusion task a scheduler pass later. A conclusion goes over every tracked
#: request, so under load one per burst of input is the cheaper; with a few
#: requests the task's extra step costs more than the conclusion itself, and delays
#: the event by a pass of the Trio loop. On the 2-core host (shared PD harness,
#: 6 interleaved pairs each) concluding in the call cut the Decode's CPU a room by
#: 6 % with 4 rooms in flight and cost 5 % more with 8, 13 % more with 16.
INLINE_CONCLUDE_MAX: Final = 4

#: The side's command union.
CmdT = TypeVar("CmdT", bound=Command)
CmdT_co = TypeVar("CmdT_co", bound=Command, covariant=True)


class RankConfig(Protocol):
    """What :class:`RankPeer` reads of its core's configuration."""

    @property
    def tp_rank(self) -> int: ...


class PeerCore(ObservedCore, Protocol[CmdT_co]):
    """What :class:`RankPeer` calls on its core (both cores have it); ``CmdT_co`` is
    the side's command union."""

    @property
    def config(self) -> RankConfig: ...

    def drain_commands(self) -> Sequence[CmdT_co]: ...

    def drain_finished(self) -> list[RoomTrace]: ...

    def next_deadline(self) -> float | None: ...

    def handle_timeout(self, now: float) -> None: ...

    def poll_values(self, now: float) -> list[int]: ...

    def conclude(self, agreed: Sequence[int], now: float) -> list[Event]: ...

    def has_in_flight(self) -> bool: ...

    def tracked_requests(self) -> int: ...

    def room_state(self, room: int) -> RoomState: ...

    #: Subtracted from the core's times in its events (:func:`host_clock_offset`).
    event_clock_offset: float


def host_clock_offset() -> float:
    """The running Trio clock minus the host's monotonic clock (``time.monotonic()``),
    for events' times (docs/architecture.md#event-times). Trio's own clock is
    ``perf_counter()`` plus a random offset; where ``perf_counter`` and ``monotonic``
    are the same clock (Linux: ``CLOCK_MONOTONIC``) that offset is exact. A clock
    that is not Trio's system clock (a test's ``MockClock``, virtual time) gives 0:
    events keep the Trio clock's times."""
    clock = trio.lowlevel.current_clock()
    offset = getattr(clock, "offset", None)
    if type(clock).__name__ != "SystemClock" or not isinstance(offset, float):
        return 0.0
    if (
        time.get_clock_info("perf_counter").implementation
        != time.get_clock_info("monotonic").implementation
    ):
        return trio.current_time() - time.monotonic()
    return offset


class Receiver(Protocol):
    """A core's handler of one received message (``receive_control``,
    ``receive_status``): ``sender`` is its CURVE identity in secure mode."""

    def __call__(self, frames: Sequence[bytes], now: float, sender: str | None = None) -> None: ...


class PeerSettings(Protocol):
    """What :func:`open_rank_sockets` reads of a side's settings."""

    @property
    def host(self) -> str: ...

    @property
    def push_sockets(self) -> int: ...

    @property
    def push_idle_ttl(self) -> float: ...

    @property
    def security(self) -> SecurityConfig | None: ...


class RankPeer(ABC, Generic[CmdT]):
    """The side-independent half of a rank's running peer (see the module
    docstring). ``CmdT`` is the side's command union; the side supplies its
    executor (:meth:`_execute`), its core's message handler (:meth:`_receiver`)
    and, where it needs one, what to forget about the requests a poll ended
    (:meth:`_concluded`). ``observer``: by default one that only logs.

    Every method runs in the peer's Trio thread.
    """

    core: PeerCore[CmdT]
    #: Which side this peer is (names its logs and metrics).
    _side: Side

    def __init__(
        self,
        core: PeerCore[CmdT],
        observer: PeerObserver | None,
        *,
        agreement: ReplicaAgreement,
        pushes: PushPool,
        curve: CurveGuard | None,
    ) -> None:
        self.core = core
        # Events carry their times on the host's monotonic clock.
        core.event_clock_offset = host_clock_offset()
        #: Secure mode's CURVE keys and ZAP domain (``None`` in plain mode).
        self.curve = curve
        #: Logs, metrics and traces of this rank (:mod:`tspd.shell.observe`).
        self.observer = observer or PeerObserver(self._side, core.config.tp_rank)
        self.agreement = agreement
        #: The most recent room failures (bounded; metrics and traces keep the rest).
        self.failures: deque[RoomFailed] = deque(maxlen=RECENT_FAILURES)
        self._pushes = pushes
        self._timer = DeadlineTimer(core.next_deadline, self._on_timeout)
        self._activity = trio.Event()
        #: Called (in the Trio thread) whenever :meth:`wait_for_activity` would wake;
        #: a thread host sets it to wake its scheduler thread without polling.
        self.on_activity: Callable[[], None] | None = None
        #: Eager conclusion (:meth:`conclude_eagerly`): polls already concluded in the
        #: Trio thread, oldest first, not yet taken by a poll.
        self._ready: deque[list[Event]] = deque()
        self._eager = False
        #: Input arrived since the last eager conclusion; the event wakes its task.
        self._due = False
        self._conclude_due = trio.Event()
        #: Seconds at most between eager conclusions while requests are in flight.
        self.eager_sweep: float = EAGER_SWEEP_S
        #: The eager conclusion task's wait: its deadline is ``eager_sweep`` after
        #: the wait began while requests are in flight, else none (``None`` while
        #: the task does not wait, or eager conclusion is off).
        self._sweep: trio.CancelScope | None = None
        #: Wakes signalled, and how many of them had been signalled when a poll last
        #: took the kept events: a wake whose events were taken is not waited for.
        self._signalled = 0
        self._taken = 0

    # -- command execution -------------------------------------------------------

    def _pump(self, *, activity: bool = False, conclude: bool = False, due: bool = False) -> None:
        """Execute, in order, every command the core queued, hand the rooms that
        ended to the observer and let the timer re-read the deadline; ``activity``
        marks input from outside the scheduler (a message, a transfer outcome, a
        lookup, a timer), ``due`` a scheduler call after which a poll would have
        events (the core's ``event_pending``). With eager conclusion either is
        concluded here at the end: with ``conclude`` (the receive task, after a
        message batch) or while at most :data:`INLINE_CONCLUDE_MAX` requests are
        tracked; else by the conclusion task, once for the burst."""
        if activity or due:
            if self._eager:
                self._due = True  # a conclusion, then the waiters' wake, follows
                if not conclude:
                    if self.core.tracked_requests() <= INLINE_CONCLUDE_MAX:
                        conclude = True
                    else:
                        self._conclude_due.set()
            elif activity:
                self._signal_activity()
        self._execute_queued()
        self.observer.finished(self.core.drain_finished())
        self._timer.poke()
        sweep = self._sweep
        if sweep is not None and sweep.deadline == math.inf and self.core.has_in_flight():
            # Requests in flight: the conclusion task sweeps from now on (a deadline
            # on its wait, so it need not wake for it now).
            sweep.deadline = trio.current_time() + self.eager_sweep
        if conclude:
            self._conclude_if_due()

    def _signal_activity(self) -> None:
        self._signalled += 1
        self._activity.set()
        if self.on_activity is not None:
            self.on_activity()

    def _execute_queued(self) -> None:
        """Drain the core's commands: each is logged and counted by the observer,
        then carried out by :meth:`_execute`."""
        observe, execute = self.observer.command, self._execute
        for command in self.core.drain_commands():
            observe(command)
            execute(command)

    @abstractmethod
    def _execute(self, command: CmdT) -> None:
        """Carry out one command the observer has seen: the side's exhaustive
        ``match`` over its command union, which hands the commands both sides share
        and need nothing more than observing to :meth:`_observed`."""

    def _observed(self, command: RoomFailed | Log | Rejected) -> None:
        """A command only for observing, which the observer logged and counted; a
        room failure is also kept in :attr:`failures`."""
        if isinstance(command, RoomFailed):
            self.failures.append(command)

    def _on_timeout(self, now: float) -> None:
        self.core.handle_timeout(now)
        self._pump(activity=True)

    async def _start_tasks(self, nursery: trio.Nursery) -> None:
        """Start the push pool, the timer and the eager conclusion task (the side
        starts its own tasks next)."""
        await nursery.start(self._pushes.run)
        await nursery.start(self._timer.run)
        await nursery.start(self._conclude_when_due)

    async def _conclude_when_due(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """The eager conclusion task: once per burst of input or due scheduler
        calls that were not concluded where they arrived (transfer outcomes,
        lookups, timers, a registration whose room is past bootstrapping, while
        more than :data:`INLINE_CONCLUDE_MAX` requests are tracked: whatever
        arrived before it runs), and at least every :data:`EAGER_SWEEP_S` while
        requests are in flight, conclude a poll and keep its events for the next
        :meth:`poll`; then wake the waiters, only when that brought events. Its
        wait has no deadline while nothing is in flight; the pump that brings the
        first request sets one, without waking it."""
        task_status.started()
        while True:
            with trio.CancelScope() as sweep:
                if self._eager:
                    self._sweep = sweep  # _pump sets its deadline once requests come
                    if self.core.has_in_flight():
                        sweep.deadline = trio.current_time() + self.eager_sweep
                await self._conclude_due.wait()
            self._sweep = None
            if sweep.cancelled_caught:
                self._due = True  # time passed: a timeout may have come
            self._conclude_due = trio.Event()
            self._conclude_if_due()

    def _conclude_if_due(self) -> None:
        """The eager conclusion, if input arrived since the last one (the pump runs
        it at once after a received batch, or any input while few requests are
        tracked; the conclusion task after the rest)."""
        if not self._due:
            return
        self._due = False
        if not self._eager:  # turned off meanwhile: the next poll concludes
            self._signal_activity()
            return
        try:
            events = self._conclude(list(self.core.poll_values(trio.current_time())))
        except Exception:
            self.observer.internal_error("an eager poll")
            self._signal_activity()
            return
        if events:
            self._ready.append(events)
            self._signal_activity()

    # -- scheduler-side API -------------------------------------------------------

    async def poll(self) -> list[Event]:
        """One poll (docs/protocol.md#proto-prefill-poll,
        docs/protocol.md#proto-decode-poll): this rank's values, the replica
        agreement's MIN, then the events in registration order —
        :class:`~tspd.core.commands.Bootstrapped`, then
        :class:`~tspd.core.commands.Succeeded` (Prefill) or
        :class:`~tspd.core.commands.RemotePrefillDone` (Decode), or
        :class:`~tspd.core.commands.Failed` (and, on Decode,
        :class:`~tspd.core.commands.PagesReleased`). Every rank of the group polls
        once per scheduler iteration.

        A group of one has nothing to agree on: its poll is a cancel point first
        (a cancelled poll takes nothing) and returns the events it has at once,
        without yielding to other tasks; only a poll that finds none yields, so a
        loop that polls without waiting still lets the peer's tasks run. Yielding
        with events in hand cost the scheduler a loop iteration of Trio for every
        event it was given (~10 µs of a completion's way to a Trio scheduler at one
        room in flight, docs/architecture.md#tasks)."""
        if self.agreement.group_size == 1:
            await trio.lowlevel.checkpoint_if_cancelled()
            events = self.poll_now()
            if not events:
                await trio.lowlevel.cancel_shielded_checkpoint()
            return events
        values = self.core.poll_values(trio.current_time())
        agreed = await self.agreement.agree(values)
        return self._take_ready() + self._conclude(agreed)

    def poll_now(self) -> list[Event]:
        """:meth:`poll` for a rank that agrees with itself alone (a group of one,
        :class:`~tspd.shell.agreement.SingleRank`), without awaiting: one plain
        call from the Trio thread. Raises ``RuntimeError`` for a TP group,
        whose ranks must agree with each other (use :meth:`poll`)."""
        if self.agreement.group_size != 1:
            raise RuntimeError(
                f"poll_now() needs a group of one rank; this one has "
                f"{self.agreement.group_size}: await poll() instead"
            )
        return self._take_ready() + self._conclude(list(self.core.poll_values(trio.current_time())))

    def conclude_eagerly(self, eager: bool = True) -> None:
        """Conclude a poll in the Trio thread as soon as input arrives or a
        scheduler call left events for a poll, instead of waiting for the
        scheduler's next :meth:`poll` (a group of one rank only), and at least every
        :data:`EAGER_SWEEP_S` while requests are in flight, for what only time
        brings. The events wait, in order, for the next poll (:meth:`take_ready`
        takes them from any thread without a crossing), and
        :meth:`wait_for_activity` and :attr:`on_activity` wake only when such a
        conclusion brought events. A thread host turns this on, so a scheduler
        thread's wake-up carries its events with it and its polls never cross
        (docs/architecture.md#threads). Turning it off hands the events still kept
        to the next poll."""
        if eager and self.agreement.group_size != 1:
            raise RuntimeError(
                f"eager conclusion needs a group of one rank; this one has "
                f"{self.agreement.group_size}, whose ranks must poll together"
            )
        self._eager = eager
        self._conclude_due.set()  # the conclusion task re-reads whether to sweep

    @property
    def eager(self) -> bool:
        """Whether polls are concluded eagerly (:meth:`conclude_eagerly`)."""
        return self._eager

    def take_ready(self) -> list[Event]:
        """The events of eager conclusions not yet taken, oldest first, and forget
        them; safe from any thread (the Trio thread only appends)."""
        return self._take_ready()

    def _take_ready(self) -> list[Event]:
        ready = self._ready
        if not ready:
            return []
        signalled = self._signalled  # read first: every wake up to it appended already
        events: list[Event] = []
        while True:
            try:
                events += ready.popleft()
            except IndexError:
                self._taken = signalled
                return events

    def _conclude(self, agreed: list[int]) -> list[Event]:
        events = self.core.conclude(agreed, trio.current_time())
        self._concluded(events)
        self.observer.events(events)
        self._pump()
        return events

    def _concluded(self, events: list[Event]) -> None:
        """A poll's events, before anything else sees them: the side forgets what it
        keeps for requests that ended. Default: nothing."""

    async def wait_for_activity(self) -> None:
        """Return once something arrived from outside the scheduler since the last
        call — a peer's message, a transfer outcome, a lookup, a timer — so a
        scheduler loop can sleep between polls instead of spinning. Bound the wait
        (``trio.move_on_after``): polls also see time passing. With eager
        conclusion (:meth:`conclude_eagerly`) it returns once a conclusion brought
        events, which the next poll returns; a wake whose events a poll took
        already is not waited for."""
        if self._eager and self._taken == self._signalled and self._activity.is_set():
            self._activity = trio.Event()
        await self._activity.wait()
        self._activity = trio.Event()

    def has_in_flight(self) -> bool:
        """Whether any request is tracked (Prefill: one that may still send KV;
        Decode: also a failed room whose pages are held), so the scheduler polls."""
        return self.core.has_in_flight() or bool(self._ready)

    def room_state(self, room: int) -> RoomState:
        """``room``'s state on this rank (``ABSENT`` when it has no entry)."""
        return self.core.room_state(room)

    def trace(self, room: int) -> RoomTrace | None:
        """``room``'s milestones on this rank: live, or kept after it failed or ran
        slow (:mod:`tspd.core.trace`); ``None`` when neither."""
        return self.core.trace(room)

    def recent_traces(self) -> list[RoomTrace]:
        """Kept traces of recent rooms that failed, ran slow or (Prefill) were
        dropped."""
        return self.core.recent_traces()

    # -- tasks -------------------------------------------------------------------

    #: What the receive task's messages are, for the log line of a fault handling one.
    _received = "a message"

    @abstractmethod
    def _receiver(self) -> Receiver:
        """The core's handler of one received message (read once per batch)."""

    async def _receive(
        self,
        sock: TrioSocket,
        batch: int,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """The receive task, the only owner of the PULL ``sock``: each drained batch
        (at most ``batch`` messages) goes to the core (:meth:`_receiver`), then the
        peer pumps. The loop never dies (docs/protocol.md#proto-control-dispatch):
        a fault of tspd's own handling a message is logged."""
        task_status.started()
        if self.curve is not None:
            await self._receive_secure(sock, batch)
        while True:
            messages = await sock.recv_batch(batch)
            now = trio.current_time()
            handle = self._receiver()
            for frames in messages:
                try:
                    handle(frames, now)
                except Exception:
                    self.observer.internal_error(self._received)
            self._pump(activity=True, conclude=True)

    async def _receive_secure(self, sock: TrioSocket, batch: int) -> None:
        """The receive loop of secure mode: each message with its CURVE identity."""
        while True:
            messages = await sock.recv_batch_from(batch)
            now = trio.current_time()
            handle = self._receiver()
            for frames, sender in messages:
                try:
                    handle(frames, now, sender)
                except Exception:
                    self.observer.internal_error(self._received)
            self._pump(activity=True, conclude=True)


# ---------------------------------------------------------------------------- setup


def open_rank_sockets(
    context: zmq.Context[zmq.Socket[bytes]],
    settings: PeerSettings,
    name: str,
    *,
    server_key: Callable[[str, int], str | None],
    socket_name: str,
    max_frame_bytes: int,
) -> tuple[CurveGuard | None, PushPool, TrioSocket, int]:
    """A rank's CURVE guard (secure mode, else ``None``), push pool and PULL socket
    bound on ``settings.host``, with the port it got. ``name`` names the rank
    (``"Prefill rank 0"``) to the guard and the pool; ``server_key`` gives the
    pool each route's CURVE server key (secure mode only); ``socket_name`` and
    ``max_frame_bytes`` are the PULL socket's (it takes at most
    :data:`~tspd.shell.zmq.MAX_MESSAGE_FRAMES` frames a message). A bind that fails
    closes what it opened and raises."""
    security = settings.security
    curve = (
        CurveGuard(context, security.curve, name)
        if security is not None and security.curve is not None
        else None
    )
    pushes = PushPool(
        context,
        name=name,
        max_sockets=settings.push_sockets,
        idle_ttl=settings.push_idle_ttl,
        curve=curve,
        server_key=server_key if curve is not None else None,
    )
    try:
        sock, port = _bind_pull(
            context, settings.host, curve, max_frame_bytes=max_frame_bytes, name=socket_name
        )
    except BaseException:
        if curve is not None:
            curve.close()
        raise
    return curve, pushes, sock, port


def _bind_pull(
    context: zmq.Context[zmq.Socket[bytes]],
    host: str,
    curve: CurveGuard | None,
    *,
    max_frame_bytes: int,
    name: str,
) -> tuple[TrioSocket, int]:
    sock = open_socket(
        context,
        zmq.PULL,
        max_frame_bytes=max_frame_bytes,
        max_frames=MAX_MESSAGE_FRAMES,
        name=name,
        owner_only=True,  # the receive task makes every call on it
    )
    try:
        if curve is not None:
            curve.server(sock, f"the {name}")
        port = bind_free_port(sock, host)
    except BaseException:
        sock.close()
        raise
    return sock, port


@asynccontextmanager
async def open_peer_nursery(
    security: SecurityConfig | None,
) -> AsyncIterator[tuple[BootstrapClient, trio.Nursery]]:
    """A peer's bootstrap client and the nursery its tasks run in, for the duration
    of the block; leaving it cancels every task. A group of one error from the
    tasks or the block is raised as that error (:func:`~tspd.shell.nursery.single_error`)."""
    with single_error():
        async with (
            BootstrapClient(security=security) as client,
            trio.open_nursery() as nursery,
        ):
            try:
                yield client, nursery
            finally:
                nursery.cancel_scope.cancel()
