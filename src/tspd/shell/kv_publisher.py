"""The KV-event publisher on Trio: a PUB socket, a replaying ROUTER, a thread-safe queue.

Wire (docs/protocol.md#proto-kv-events, byte-for-byte TokenSpeed): every non-empty round goes out as
``[topic, seq (8 B big-endian), payload]`` on a PUB socket, sequence numbers from 0
without skips; an optional ROUTER answers ``[client, b"", start_seq]`` with every
buffered batch from ``start_seq`` and the end marker (sequence -1, empty payload).

Shape of the machinery:

* ``publish(events)`` costs the caller's thread (the engine's scheduler thread,
  typically) a time stamp and one append to a bounded queue -- the event objects
  are handed over as they are, nothing is encoded there -- **waiting while the
  queue is full**; ``publish_nowait`` drops and counts instead; from Trio code use
  ``await apublish(events)``. When the sender task sleeps, the queue's waker
  thread wakes it with ``TrioToken.run_sync_soon`` (the caller only hands the
  waker an event, see :class:`BatchQueue`), so a busy stream costs one lock
  round-trip a batch (``tspd bench events`` compares this with
  ``trio.from_thread.run``).
* One sender task takes up to 256 queued batches at a time, encodes them all
  (:class:`~tspd.core.kv_events.BatchEncoder`), then assigns sequence numbers and
  sends them back to back on the PUB socket (which never blocks: at its
  high-water mark libzmq drops, which subscribers see as a gap), appending every
  batch to the replay buffer -- also one whose send failed (R-ev), so a replay can
  still fill that gap. A batch that cannot be encoded (an integer outside the
  64-bit ranges, a field msgpack cannot write) is dropped, counted and logged
  there; it takes no sequence number.
* Replay requests are served from a snapshot of the buffer, one at a time per
  client (up to 8 clients at once), each in its own task. The
  ROUTER's send high-water mark covers the whole buffer, and sends use
  ``ROUTER_MANDATORY`` with backpressure (a full pipe waits instead of dropping, as
  TokenSpeed's replay silently does past 1,000 messages). If a client stops reading
  for ``replay_stall_timeout`` the replay is cut short: the end marker follows the
  last batch actually sent, so the client sees exactly where the run stopped and
  that its gap is still open (if even the end marker cannot go out, the client's
  own replay timeout ends its wait). Replay tasks yield to the sender regularly,
  so a long replay never holds up live publishing, and a stuck client holds up
  only its own replays.
* Closing stops accepting batches, sends what is queued for up to
  ``close_timeout`` (1 s, TokenSpeed's ``SHUTDOWN_TIMEOUT``), then logs and counts
  what it dropped. ``publish`` after close drops and counts (R-ev) rather than raise.

Open a publisher with :func:`open_kv_publisher` (or :func:`open_event_publisher`,
which follows TokenSpeed's factory: config string, ``enable_kv_cache_events``, and
the registry of publisher kinds in :data:`PUBLISHERS`).

Secure mode (``curve=``, docs/security.md): a PUB that binds and the replay ROUTER
are CURVE servers behind the ZAP handler's allow-list (only allow-listed subscribers
read the stream or ask for replays); a PUB that connects is a CURVE client of the
subscriber's ``server_key``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from queue import SimpleQueue
from typing import TYPE_CHECKING, Final, Generic, Protocol, TypeVar, final

import trio
import zmq

from tspd.core.errors import ConfigError, WireError
from tspd.core.kv_config import (
    KVEventsConfig,
    PublisherRegistry,
    bind_address,
    check_endpoint,
    offset_endpoint_port,
    parse_kv_events_config,
    pub_binds,
)
from tspd.core.kv_events import BatchEncoder, KVEvent
from tspd.core.replay import (
    ReplayBuffer,
    ReplayRequest,
    decode_replay_request,
    end_marker_frames,
    replay_reply_frames,
)
from tspd.log import RateLimitedLog
from tspd.shell.nursery import single_error
from tspd.shell.zmq import MAX_MESSAGE_FRAMES, TrioSocket, open_socket

if TYPE_CHECKING:
    from tspd.shell.security import CurveGuard, CurveKeys

__all__ = [
    "PUBLISHERS",
    "SHUTDOWN_TIMEOUT",
    "BatchQueue",
    "EventPublisher",
    "KVEventPublisher",
    "NullKVEventPublisher",
    "PublisherFactory",
    "PublisherStats",
    "open_event_publisher",
    "open_kv_publisher",
    "open_null_publisher",
]

log = logging.getLogger(__name__)

_get_ident: Final = threading.get_ident
_time: Final = time.time

#: How long closing waits for queued batches to go out (TokenSpeed's value).
SHUTDOWN_TIMEOUT: Final = 1.0
#: How long a replay waits for a client that stopped reading before cutting it short.
REPLAY_STALL_TIMEOUT: Final = 5.0
# Batches the sender takes off the queue before yielding to the replay task.
_SEND_BATCH: Final = 256
# Replayed messages sent between two yields to the sender task.
_REPLAY_YIELD_EVERY: Final = 64
# Replays served at the same time (to different clients).
_REPLAY_CONCURRENCY: Final = 8
# The largest frame the replay ROUTER takes from a client (ZMQ_MAXMSGSIZE, per
# frame): a request is [empty, start_seq] with an 8-byte start_seq
# (docs/protocol.md#proto-kv-replay; a
# longer one is read by its last 8 bytes). open_socket raises it to its handshake
# floor (1 KiB), which is what applies.
_MAX_REQUEST_FRAME_BYTES: Final = 64


@dataclass(frozen=True, slots=True, kw_only=True)
class PublisherStats:
    """A publisher's counters (for metrics; monotonic except the two depths)."""

    batches_published: int
    events_published: int
    batches_dropped: int
    send_failures: int
    replay_requests_served: int
    replay_requests_invalid: int
    replay_batches_sent: int
    replays_cut_short: int
    queue_depth: int
    buffered: int
    next_seq: int


_ZERO_STATS: Final = PublisherStats(
    batches_published=0,
    events_published=0,
    batches_dropped=0,
    send_failures=0,
    replay_requests_served=0,
    replay_requests_invalid=0,
    replay_batches_sent=0,
    replays_cut_short=0,
    queue_depth=0,
    buffered=0,
    next_seq=0,
)


class EventPublisher(Protocol):
    """What every publisher kind offers (the ZMQ publisher, the null publisher...)."""

    def publish(self, events: Sequence[KVEvent], *, ts: float | None = None) -> None:
        """Queue one round's events from a non-Trio thread; waits while the queue is full."""

    def publish_nowait(self, events: Sequence[KVEvent], *, ts: float | None = None) -> bool:
        """Queue one round's events from any thread; ``False`` if it was dropped."""

    async def apublish(self, events: Sequence[KVEvent], *, ts: float | None = None) -> None:
        """Queue one round's events from Trio; waits while the queue is full."""

    def statistics(self) -> PublisherStats:
        """The publisher's counters."""


#: One queued batch: the time stamp and the events as ``publish`` got them; the
#: sender encodes them.
Item = tuple[float, Sequence[KVEvent]]

T = TypeVar("T")


@final
class BatchQueue(Generic[T]):
    """A bounded FIFO from any thread into one Trio task (the publisher's hand-off).

    Producers in other threads wait on a condition variable while it is full; the
    Trio consumer sleeps on a :class:`trio.Event`, set only when the consumer is
    actually asleep. A producer that finds room pays one uncontended lock and one
    append; one that finds the consumer asleep also hands its event to the queue's
    waker thread, which sets it with ``TrioToken.run_sync_soon``. (Calling that
    itself would cost the producer a system call that releases the GIL, and the
    woken Trio thread could take the GIL and run the consumer's whole chunk before
    the producer got it back: the engine's round would pay for the encoding.)
    Call :meth:`stop` once the consumer is gone.
    """

    def __init__(self, maxsize: int, token: trio.lowlevel.TrioToken) -> None:
        self._maxsize = max(1, maxsize)
        self._items: deque[T] = deque()
        self._lock = threading.Lock()
        self._not_full = threading.Condition(self._lock)
        self._token = token
        self._trio_thread = threading.get_ident()
        self._consumer: trio.Event | None = None
        self._space: trio.Event | None = None
        self._closed = False
        self._blocked = 0  # producers waiting on _not_full
        self.dropped = 0
        self._wakes: SimpleQueue[trio.Event | None] = SimpleQueue()
        self._waker = threading.Thread(
            target=self._run_waker, name="tspd-kv-publisher-waker", daemon=True
        )
        self._waker.start()

    @property
    def trio_thread(self) -> int:
        return self._trio_thread

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: T, *, block: bool) -> bool:
        """Append ``item``; ``False`` (and counted as dropped) if closed, or full and
        not blocking. Must not block in the Trio thread."""
        with self._lock:
            if (self._closed or len(self._items) >= self._maxsize) and not (
                block and self._wait_for_space()
            ):
                self.dropped += 1
                return False
            self._items.append(item)
            wake = self._consumer
            if wake is None:
                return True
            self._consumer = None
        self._wake(wake)
        return True

    def _wait_for_space(self) -> bool:
        """With the lock held: wait until there is room (``True``) or the queue closed."""
        self._blocked += 1
        try:
            while len(self._items) >= self._maxsize and not self._closed:
                self._not_full.wait()
        finally:
            self._blocked -= 1
        return not self._closed

    def count_dropped(self, count: int = 1) -> None:
        """Count batches the consumer dropped after taking them (the publisher's
        unencodable batches) with the queue's own drops."""
        with self._lock:
            self.dropped += count

    async def put_async(self, item: T) -> bool:
        """Append ``item`` from the Trio thread, waiting for space; ``False`` if closed."""
        while True:
            with self._lock:
                if self._closed:
                    self.dropped += 1
                    return False
                if len(self._items) < self._maxsize:
                    self._items.append(item)
                    wake = self._consumer
                    self._consumer = None
                    break
                if self._space is None:
                    self._space = trio.Event()
                space = self._space
            await space.wait()
        if wake is not None:
            wake.set()
        await trio.lowlevel.checkpoint()
        return True

    def _wake(self, event: trio.Event) -> None:
        if _get_ident() == self._trio_thread:
            event.set()
        else:
            self._wakes.put(event)  # C, and no system call while the GIL is free

    def _run_waker(self) -> None:
        """The waker thread: sets events in Trio for producers in other threads."""
        get, run_sync_soon = self._wakes.get, self._token.run_sync_soon
        while (event := get()) is not None:
            # If the publisher's loop is gone, close() already accounted for the queue.
            with contextlib.suppress(trio.RunFinishedError):
                run_sync_soon(event.set)

    async def get_batch(self, max_items: int) -> list[T]:
        """Up to ``max_items`` items, waiting while empty; ``[]`` once closed and empty."""
        while True:
            with self._lock:
                items = self._items
                if items:
                    if len(items) <= max_items:
                        out = list(items)
                        items.clear()
                    else:
                        popleft = items.popleft
                        out = [popleft() for _ in range(max_items)]
                    if self._blocked:
                        self._not_full.notify_all()
                    space, self._space = self._space, None
                    break
                if self._closed:
                    return []
                event = self._consumer = trio.Event()
            await event.wait()
        if space is not None:
            space.set()
        return out

    def close(self) -> None:
        """Refuse new items; wake every waiter (the consumer drains what is left)."""
        with self._lock:
            self._closed = True
            self._not_full.notify_all()
            wake, self._consumer = self._consumer, None
            space, self._space = self._space, None
        if wake is not None:
            wake.set()
        if space is not None:
            space.set()

    def abandon(self) -> int:
        """Drop everything still queued; return how many items that was."""
        with self._lock:
            left = len(self._items)
            self._items.clear()
            self.dropped += left
            self._not_full.notify_all()
            return left

    def stop(self, timeout: float = 1.0) -> None:
        """End the waker thread, once the consumer is gone (after :meth:`close` and
        the drain or :meth:`abandon`: until then a producer that raced the close may
        still have a wake-up to deliver). Idempotent."""
        self._wakes.put(None)
        self._waker.join(timeout)


class _ReplaySend:
    SENT: Final = "sent"
    GONE: Final = "gone"
    STALLED: Final = "stalled"


@final
class KVEventPublisher:
    """One attention-DP rank's ZMQ publisher; create it with :func:`open_kv_publisher`."""

    def __init__(
        self,
        *,
        topic: bytes,
        dp_rank: int,
        queue: BatchQueue[Item],
        buffer: ReplayBuffer,
        pub: TrioSocket,
        router: TrioSocket | None,
        endpoint: str,
        replay_endpoint: str | None,
        replay_stall_timeout: float,
    ) -> None:
        self._topic = topic
        self._dp_rank = dp_rank
        self._queue = queue
        self._put = queue.put
        self._trio_thread = queue.trio_thread
        self._buffer = buffer
        self._pub = pub
        self._router = router
        self._endpoint = endpoint
        self._replay_endpoint = replay_endpoint
        self._replay_stall_timeout = replay_stall_timeout
        self._drained = trio.Event()
        self._progress = trio.Event()
        self._next_seq = 0
        self._batches = 0
        self._events = 0
        self._send_failures = 0
        self._replays_served = 0
        self._replays_invalid = 0
        self._replay_batches = 0
        self._replays_cut_short = 0
        self._warned_closed = False
        self._client_locks: dict[bytes, trio.StrictFIFOLock] = {}
        #: Lines about what replay clients send or do, rate-limited per reason (a
        #: client's ROUTER identity is new on every connection).
        self._client_log = RateLimitedLog(log)
        #: Lines about batches that could not be encoded (an engine bug, possibly
        #: repeated every round).
        self._batch_log = RateLimitedLog(log)

    # -- the public face ---------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """The PUB socket's address (the bound address when it binds)."""
        return self._endpoint

    @property
    def replay_endpoint(self) -> str | None:
        """The replay ROUTER's bound address, or ``None`` without replay."""
        return self._replay_endpoint

    @property
    def dp_rank(self) -> int:
        """The attention-DP rank written into every batch."""
        return self._dp_rank

    def publish(self, events: Sequence[KVEvent], *, ts: float | None = None) -> None:
        """Queue one round's events, waiting while the queue is full.

        For the engine's own threads; in the Trio thread this would deadlock and
        raises :class:`RuntimeError` (use :meth:`apublish` there). Empty rounds
        publish nothing. After close the batch is dropped and counted.

        The caller pays a time stamp (``ts``, wall-clock seconds, unless given) and
        one queue append: ``events`` is handed over as it is and encoded later by
        the sender task, so the caller must not change the sequence afterwards (the
        events themselves are frozen). A batch that then fails to encode is dropped,
        counted in :attr:`PublisherStats.batches_dropped` and logged.
        """
        if not events:
            return
        if _get_ident() == self._trio_thread:
            raise RuntimeError(
                "KVEventPublisher.publish() waits for queue space and would block the Trio "
                "loop; call `await publisher.apublish(events)` from Trio code"
            )
        if not self._put((_time() if ts is None else ts, events), block=True):
            self._warn_dropped()

    def publish_nowait(self, events: Sequence[KVEvent], *, ts: float | None = None) -> bool:
        """Queue one round's events without waiting; ``False`` when dropped (queue full
        or publisher closed), and counted in :attr:`PublisherStats.batches_dropped`.
        Hands ``events`` over as :meth:`publish` does."""
        if not events:
            return True
        return self._put((_time() if ts is None else ts, events), block=False)

    async def apublish(self, events: Sequence[KVEvent], *, ts: float | None = None) -> None:
        """Queue one round's events from Trio code, waiting while the queue is full.
        Hands ``events`` over as :meth:`publish` does."""
        if not events:
            await trio.lowlevel.checkpoint()
            return
        if not await self._queue.put_async((_time() if ts is None else ts, events)):
            self._warn_dropped()

    async def wait_published(self, count: int) -> None:
        """Wait until at least ``count`` batches went out (sent or failed, and buffered)."""
        while self._batches < count:
            await self._progress.wait()

    def statistics(self) -> PublisherStats:
        """The publisher's counters (safe to read from any thread)."""
        return PublisherStats(
            batches_published=self._batches,
            events_published=self._events,
            batches_dropped=self._queue.dropped,
            send_failures=self._send_failures,
            replay_requests_served=self._replays_served,
            replay_requests_invalid=self._replays_invalid,
            replay_batches_sent=self._replay_batches,
            replays_cut_short=self._replays_cut_short,
            queue_depth=len(self._queue),
            buffered=len(self._buffer),
            next_seq=self._next_seq,
        )

    # -- internals ---------------------------------------------------------------

    def _warn_dropped(self) -> None:
        if not self._warned_closed:
            self._warned_closed = True
            log.warning(
                "the KV event publisher for DP rank %d is closed; dropping a batch "
                "(later drops are only counted in statistics().batches_dropped)",
                self._dp_rank,
            )

    async def _run_sender(self) -> None:
        topic, pub, buffer, queue = self._topic, self._pub, self._buffer, self._queue
        encode = BatchEncoder(self._dp_rank).encode
        send = pub.send_multipart_nowait
        keep = buffer.append
        while True:
            items = await queue.get_batch(_SEND_BATCH)
            if not items:
                break
            # Encode the whole chunk first, then send it back to back: libzmq's I/O
            # thread then takes the messages in a few wake-ups and large writes
            # instead of one each.
            payloads: list[bytes] = []
            events = 0
            for ts, batch in items:
                try:
                    count = len(batch)
                    payloads.append(encode(ts, batch))
                except Exception as exc:  # whatever the caller's objects raise
                    self._unencodable(exc)
                else:
                    events += count
            seq = self._next_seq
            for payload in payloads:
                try:
                    sent = send([topic, seq.to_bytes(8, "big"), payload])
                except zmq.ZMQError as exc:
                    sent = False
                    error = str(exc)
                else:
                    error = "the PUB socket refused the message"
                if not sent:
                    self._send_failed(seq, error)
                keep(seq, payload)
                seq += 1
            # The counters move once a chunk (other threads read them a chunk late).
            self._next_seq = seq
            self._batches += len(payloads)
            self._events += events
            self._progress.set()
            self._progress = trio.Event()
            await trio.lowlevel.checkpoint()
        self._drained.set()

    def _send_failed(self, seq: int, error: str) -> None:
        self._send_failures += 1
        if self._send_failures == 1 or self._send_failures % 1000 == 0:
            log.warning(
                "publishing KV event batch %d on %s failed (%s); it stays in the "
                "replay buffer (%d failures so far)",
                seq,
                self._endpoint,
                error,
                self._send_failures,
            )

    def _unencodable(self, exc: Exception) -> None:
        """A batch the sender could not encode: dropped (no sequence number), counted."""
        self._queue.count_dropped()
        self._batch_log.error(
            "*",
            "unencodable-batch",
            "KV event publisher for DP rank %d: dropping a batch that cannot be encoded "
            "(%s: %s); counted in statistics().batches_dropped",
            self._dp_rank,
            type(exc).__name__,
            exc,
        )

    async def _run_replay(self, router: TrioSocket) -> None:
        """Receive requests; serve each in its own task, one at a time per client.

        A client that stops reading then holds up only its own replays (and one of
        :data:`_REPLAY_CONCURRENCY` slots, for a bounded time), never other
        clients' or live publishing.
        """
        limiter = trio.CapacityLimiter(_REPLAY_CONCURRENCY)
        async with trio.open_nursery() as nursery:
            while True:
                frames = await router.recv_multipart()
                try:
                    request = decode_replay_request(frames)
                except WireError as exc:
                    self._replays_invalid += 1
                    self._client_log.warning(
                        "*",
                        "invalid-replay-request",
                        "%s on %s; ignored",
                        exc,
                        self._replay_endpoint,
                    )
                    continue
                lock = self._client_locks.setdefault(request.client, trio.StrictFIFOLock())
                nursery.start_soon(self._serve_in_turn, router, request, lock, limiter)

    async def _serve_in_turn(
        self,
        router: TrioSocket,
        request: ReplayRequest,
        lock: trio.StrictFIFOLock,
        limiter: trio.CapacityLimiter,
    ) -> None:
        try:
            async with lock, limiter:
                await self._serve_replay(router, request)
        finally:
            if not lock.locked() and lock.statistics().tasks_waiting == 0:
                self._client_locks.pop(request.client, None)

    async def _serve_replay(self, router: TrioSocket, request: ReplayRequest) -> None:
        batches = self._buffer.since(request.start_seq)
        sent = 0
        outcome = _ReplaySend.SENT
        for seq, payload in batches:
            outcome = await self._send_replay(
                router, replay_reply_frames(request.client, seq, payload)
            )
            if outcome != _ReplaySend.SENT:
                break
            sent += 1
            if sent % _REPLAY_YIELD_EVERY == 0:
                await trio.lowlevel.checkpoint()
        self._replay_batches += sent
        if outcome == _ReplaySend.GONE:
            log.info(
                "KV event replay client %s disconnected after %d of %d batches",
                request.client.hex(),
                sent,
                len(batches),
            )
            return
        if outcome == _ReplaySend.STALLED:
            self._replays_cut_short += 1
            self._client_log.warning(
                "*",
                "replay-cut-short",
                "KV event replay to client %s cut short after %d of %d batches: the client "
                "read nothing for %.1f s; the end marker follows the last batch sent, so "
                "the client can ask again from there",
                request.client.hex(),
                sent,
                len(batches),
                self._replay_stall_timeout,
            )
        end = await self._send_replay(router, end_marker_frames(request.client))
        if end == _ReplaySend.SENT:
            self._replays_served += 1
        elif end == _ReplaySend.STALLED:
            self._client_log.warning(
                "*",
                "replay-end-marker-lost",
                "KV event replay to client %s: the end marker could not be sent either "
                "(nothing read for %.1f s); the client's own replay timeout ends its wait",
                request.client.hex(),
                self._replay_stall_timeout,
            )

    async def _send_replay(self, router: TrioSocket, frames: list[bytes]) -> str:
        """Send with backpressure: a full pipe waits (bounded) instead of dropping."""
        waited = 0.0
        delay = 0.0
        while True:
            try:
                if router.send_multipart_nowait(frames):
                    return _ReplaySend.SENT
            except zmq.ZMQError as exc:
                if exc.errno == zmq.EHOSTUNREACH:
                    return _ReplaySend.GONE
                raise
            if waited >= self._replay_stall_timeout:
                return _ReplaySend.STALLED
            await trio.sleep(delay)
            waited += max(delay, 0.0005)
            delay = min(max(delay * 2, 0.0005), 0.05)

    async def _shutdown(self, nursery: trio.Nursery, flush_for: float) -> None:
        """Stop accepting, flush for up to ``flush_for`` seconds, report drops, close."""
        deadline = trio.current_time() + flush_for
        self._queue.close()
        with trio.CancelScope(shield=True):
            with trio.move_on_at(deadline):
                await self._drained.wait()
            left = self._queue.abandon()
            if left:
                log.warning(
                    "KV event publisher for DP rank %d closed with %d batches still queued "
                    "after %.1f s; they were dropped",
                    self._dp_rank,
                    left,
                    flush_for,
                )
            nursery.cancel_scope.cancel()
            remaining_ms = max(0, int((deadline - trio.current_time()) * 1000))
            # The PUB keeps sending what it holds for the rest of the budget, in
            # libzmq's I/O thread, without holding up the caller. The ROUTER is
            # closed by open_kv_publisher once the cancelled replay tasks are gone:
            # closed now, a receive the cancel has not reached yet would end in
            # ClosedResourceError instead of the cancellation.
            self._pub.close(linger=remaining_ms)


def _attach(sock: TrioSocket, endpoint: str, *, bind: bool, what: str, dp_rank: int) -> str:
    """Bind or connect ``sock``; return the address peers use. ZMQ errors become
    :class:`ConfigError` naming the endpoint."""
    try:
        if bind:
            sock.sock.bind(bind_address(endpoint))
            last = sock.sock.getsockopt(zmq.LAST_ENDPOINT)
            assert isinstance(last, bytes)
            return last.decode()
        sock.sock.connect(endpoint)
        return endpoint
    except zmq.ZMQError as exc:
        sock.close()
        verb = "bind" if bind else "connect"
        raise ConfigError(
            f"KV event publisher for DP rank {dp_rank}: cannot {verb} the {what} socket to "
            f"{endpoint}: {exc}"
        ) from None


@asynccontextmanager
async def open_kv_publisher(
    config: KVEventsConfig,
    dp_rank: int = 0,
    *,
    ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
    close_timeout: float = SHUTDOWN_TIMEOUT,
    replay_stall_timeout: float = REPLAY_STALL_TIMEOUT,
    replay_sndhwm: int | None = None,
    curve: CurveKeys | None = None,
    server_key: str | None = None,
) -> AsyncIterator[KVEventPublisher]:
    """Publish KV events for ``dp_rank`` until the block exits.

    Endpoints follow docs/protocol.md#proto-kv-endpoints: the DP rank moves TCP ports, the PUB
    binds for
    wildcard and IPC addresses and connects otherwise, the replay ROUTER binds.
    Unsupported endpoints raise :class:`ConfigError` here, before anything starts.
    ``replay_sndhwm`` overrides the ROUTER's send high-water mark (default: the
    buffer size plus a margin, so a whole replay fits). ``curve``: this process's
    CURVE keys and allow-list (secure mode, see the module doc); ``server_key``: the
    subscriber's public key when the PUB connects.
    """
    endpoint = offset_endpoint_port(config.endpoint, dp_rank)
    check_endpoint(endpoint)
    replay_endpoint = None
    if config.replay_endpoint is not None:
        replay_endpoint = offset_endpoint_port(config.replay_endpoint, dp_rank)
        check_endpoint(replay_endpoint)
    if config.unknown_keys:
        log.warning("KV events config: ignoring unknown keys %s", ", ".join(config.unknown_keys))
    context = ctx if ctx is not None else zmq.Context.instance()
    binds = pub_binds(endpoint)
    if curve is not None and not binds and server_key is None:
        raise ConfigError(
            f"a secure KV event publisher that connects to {endpoint} needs the "
            "subscriber's CURVE key (server_key)"
        )
    guard: CurveGuard | None = None
    if curve is not None:
        from tspd.shell.security import CurveGuard

        guard = CurveGuard(context, curve, f"the KV event publisher of DP rank {dp_rank}")
    pub = open_socket(context, zmq.PUB)
    pub.sock.setsockopt(zmq.SNDHWM, config.hwm)
    pub.sock.setsockopt(zmq.RCVHWM, config.hwm)
    if guard is not None:
        if binds:
            guard.server(pub, f"the KV event PUB of DP rank {dp_rank}")
        else:
            assert server_key is not None
            guard.client(pub, server_key)
    try:
        bound = _attach(pub, endpoint, bind=binds, what="PUB", dp_rank=dp_rank)
    except ConfigError:
        if guard is not None:
            guard.close()
        raise
    router: TrioSocket | None = None
    replay_bound: str | None = None
    if replay_endpoint is not None:
        router = open_socket(
            context,
            zmq.ROUTER,
            max_frame_bytes=_MAX_REQUEST_FRAME_BYTES,
            max_frames=MAX_MESSAGE_FRAMES,
            name=f"KV event replay ROUTER of DP rank {dp_rank}",
        )
        router.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        hwm = replay_sndhwm if replay_sndhwm is not None else config.buffer_steps + 64
        router.sock.setsockopt(zmq.SNDHWM, hwm)
        if guard is not None:
            guard.server(router, f"the KV event replay ROUTER of DP rank {dp_rank}")
        try:
            replay_bound = _attach(
                router, replay_endpoint, bind=True, what="replay ROUTER", dp_rank=dp_rank
            )
        except ConfigError:
            pub.close()
            if guard is not None:
                guard.close()
            raise
    queue = BatchQueue[Item](config.max_queue_size, trio.lowlevel.current_trio_token())
    publisher = KVEventPublisher(
        topic=config.topic.encode(),
        dp_rank=dp_rank,
        queue=queue,
        buffer=ReplayBuffer(config.buffer_steps),
        pub=pub,
        router=router,
        endpoint=bound,
        replay_endpoint=replay_bound,
        replay_stall_timeout=replay_stall_timeout,
    )
    log.info(
        "publishing KV cache events for DP rank %d on %s (replay: %s)",
        dp_rank,
        bound,
        replay_bound or "off",
    )
    try:
        with single_error():  # the caller sees its own error, not our task group
            async with trio.open_nursery() as nursery:
                nursery.start_soon(publisher._run_sender)
                if router is not None:
                    nursery.start_soon(publisher._run_replay, router)
                try:
                    yield publisher
                finally:
                    await publisher._shutdown(nursery, close_timeout)
    finally:
        queue.stop()
        pub.close()
        if router is not None:
            router.close()
        if guard is not None:
            guard.close()


@final
class NullKVEventPublisher:
    """The publisher of a rank that does not publish: accepts and discards everything."""

    def publish(self, events: Sequence[KVEvent], *, ts: float | None = None) -> None:
        """Discard."""

    def publish_nowait(self, events: Sequence[KVEvent], *, ts: float | None = None) -> bool:
        """Discard; always accepted."""
        return True

    async def apublish(self, events: Sequence[KVEvent], *, ts: float | None = None) -> None:
        """Discard."""
        await trio.lowlevel.checkpoint()

    def statistics(self) -> PublisherStats:
        """All zero."""
        return _ZERO_STATS


@asynccontextmanager
async def open_null_publisher(
    config: KVEventsConfig | None = None, dp_rank: int = 0
) -> AsyncIterator[NullKVEventPublisher]:
    """A null publisher, for the factory's uniform shape."""
    await trio.lowlevel.checkpoint()
    yield NullKVEventPublisher()


#: A publisher kind: ``(config, dp_rank)`` to an async context manager.
PublisherFactory = Callable[[KVEventsConfig, int], AbstractAsyncContextManager[EventPublisher]]

#: The registered publisher kinds (``"zmq"`` and ``"null"``); embedders may add more.
PUBLISHERS: PublisherRegistry[PublisherFactory] = PublisherRegistry()
PUBLISHERS.register("zmq", open_kv_publisher)
PUBLISHERS.register("null", open_null_publisher)


def open_event_publisher(
    config: KVEventsConfig | str | None, dp_rank: int = 0, *, attn_tp_rank: int = 0
) -> AbstractAsyncContextManager[EventPublisher]:
    """TokenSpeed's factory: the publisher this rank should run.

    No config, events disabled, ``"publisher": "null"`` or an attention-TP rank
    other than 0 give the null publisher; an unknown kind raises
    ``ConfigError("Unknown event publisher '<kind>'")``.
    """
    parsed = parse_kv_events_config(config) if isinstance(config, str) else config
    if parsed is None or attn_tp_rank != 0:
        return open_null_publisher(parsed, dp_rank)
    return PUBLISHERS.get(parsed.kind)(parsed, dp_rank)
