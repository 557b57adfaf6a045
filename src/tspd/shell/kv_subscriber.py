"""A KV-event subscriber on Trio that heals gaps by replay and reports what it cannot heal.

It listens to one or many publishers (one per attention-DP rank, or several
engines) and yields, as one async iterator, what a router needs to keep its index
honest:

* :class:`ReceivedBatch` -- a decoded batch, per publisher strictly in sequence
  order, each sequence number once (live or replayed);
* :class:`ReplayRequested` -- a gap was seen and a replay asked for;
* :class:`BatchesLost` -- batches the publisher can no longer resend (evicted from
  its buffer, no replay socket, replay timed out): the router's view of that
  publisher is incomplete from here on;
* :class:`PublisherRestarted` -- the sequence went back: drop that publisher's state;
* :class:`UndecodableBatch` -- a batch arrived but its payload is malformed.

Each publisher gets a SUB socket (subscribed to the topic prefix) and, when it has
a replay endpoint, a DEALER for the replay protocol (a REQ socket would only see
the first reply). Both bound what a publisher can make them hold: frames of at most
``max_batch_bytes`` (:data:`MAX_BATCH_BYTES` by default) and at most
:data:`~tspd.shell.zmq.MAX_MESSAGE_FRAMES` frames a message. The ordering,
deduplication and gap logic is
:class:`tspd.core.seqtrack.SeqTracker`; this module only moves bytes and time.
Payloads in TokenSpeed's array form and vLLM's map form are both decoded, so the
same subscriber follows TokenSpeed, vLLM and SGLang engines.

Secure mode (``curve=``, docs/security.md): a SUB or DEALER that connects is a CURVE
client of the publisher's key (:attr:`EventSource.server_key`), so a publisher
without that key's secret never completes a handshake and nothing it sends is read;
a SUB that binds is a CURVE server behind the ZAP handler's allow-list, and with a
``server_key`` keeps only the messages whose CURVE identity is that key.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, TypeAlias, final

import trio
import zmq

from tspd.core.errors import ConfigError, WireError
from tspd.core.kv_config import offset_endpoint_port
from tspd.core.kv_events import KVEventBatch, decode_batch, split_pub_frames
from tspd.core.replay import decode_replay_reply, encode_replay_request
from tspd.core.seqtrack import (
    Deliver,
    GapReason,
    GapUnhealable,
    RequestReplay,
    SeqTracker,
    TrackerCommand,
    TrackerStats,
)
from tspd.core.seqtrack import PublisherRestarted as _Restarted
from tspd.log import RateLimitedLog
from tspd.shell.nursery import single_error
from tspd.shell.zmq import MAX_MESSAGE_FRAMES, TrioSocket, open_socket

if TYPE_CHECKING:
    from tspd.shell.security import CurveGuard, CurveKeys

__all__ = [
    "MAX_BATCH_BYTES",
    "BatchesLost",
    "EventSource",
    "KVEventSubscriber",
    "PublisherRestarted",
    "ReceivedBatch",
    "ReplayRequested",
    "SubscriberItem",
    "UndecodableBatch",
    "open_kv_subscriber",
]

log = logging.getLogger(__name__)

# One read of a socket takes at most this many messages, and stops after this many
# bytes. A read's batches are decoded together and stay alive until the consumer
# takes the group; kept below the collector's youngest generation (700 objects by
# default; a 16-event batch decodes to about 20), they die before a collection
# traces them. Measured end to end with 16-event batches (~1 KB), per 50,000: 128
# a read, ~1,090 young and 9 full collections, 38-44 us of subscriber CPU a batch;
# 16 KiB a read (~17 batches), 17 young and no full ones, 29-35 us.
_RECV_BATCH: Final = 128
_RECV_BYTES: Final = 16 * 1024

#: The largest payload frame a subscriber accepts by default (``ZMQ_MAXMSGSIZE`` on
#: its SUB and DEALER; libzmq checks each frame, and disconnects a publisher that
#: announces a larger one before storing it: that batch becomes a gap, healed by
#: replay or reported lost). The protocol fixes no bound (docs/protocol.md#proto-kv-events): a
#: batch is one
#: scheduler round's cache mutations on one DP rank, about 24 bytes a removed block
#: and 40-100 bytes a stored one (1-16 tokens), so 64 MiB is over 2.5 million
#: removals or 650,000 16-token blocks in a single round.
MAX_BATCH_BYTES: Final = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class EventSource:
    """One publisher to follow.

    ``endpoint`` is the publisher's PUB address to connect to (or, with
    ``bind=True``, the address to bind when the publisher connects, TokenSpeed's
    non-wildcard case); ``replay_endpoint`` its ROUTER, if any. ``name`` labels
    everything this source yields (default: the endpoint). ``server_key``: the
    publisher's CURVE public key (Z85), for a secure subscriber (docs/security.md).
    """

    endpoint: str
    replay_endpoint: str | None = None
    name: str = ""
    bind: bool = False
    server_key: str | None = None

    @property
    def label(self) -> str:
        """The name items from this source carry."""
        return self.name or self.endpoint

    @classmethod
    def for_dp_ranks(
        cls,
        endpoint: str,
        replay_endpoint: str | None,
        dp_ranks: Sequence[int],
        *,
        host: str,
    ) -> list[EventSource]:
        """One source per DP rank of a publisher configured with ``endpoint``.

        The rank moves the TCP port as on the publisher; a wildcard host (``*``) is
        replaced by ``host``, the address the publishers are reached at.
        """

        def resolve(address: str, rank: int) -> str:
            return offset_endpoint_port(address, rank).replace("://*:", f"://{host}:")

        return [
            cls(
                resolve(endpoint, rank),
                resolve(replay_endpoint, rank) if replay_endpoint is not None else None,
                name=f"dp{rank}",
            )
            for rank in dp_ranks
        ]


@dataclass(frozen=True, slots=True)
class ReceivedBatch:
    """A batch, delivered in sequence order for its source."""

    source: str
    seq: int
    batch: KVEventBatch
    replayed: bool


@dataclass(frozen=True, slots=True)
class ReplayRequested:
    """A gap was detected; a replay from ``start_seq`` was requested."""

    source: str
    start_seq: int
    attempt: int


@dataclass(frozen=True, slots=True)
class BatchesLost:
    """Batches ``first_missing`` .. ``resumed_at - 1`` of ``source`` will never arrive."""

    source: str
    first_missing: int
    resumed_at: int
    reason: GapReason

    @property
    def count(self) -> int:
        """How many batches were lost."""
        return self.resumed_at - self.first_missing


@dataclass(frozen=True, slots=True)
class PublisherRestarted:
    """``source``'s sequence went back from ``last_seq`` to ``new_seq``: a new stream."""

    source: str
    last_seq: int
    new_seq: int


@dataclass(frozen=True, slots=True)
class UndecodableBatch:
    """Batch ``seq`` of ``source`` arrived but its payload is malformed (``error``)."""

    source: str
    seq: int
    error: str


SubscriberItem: TypeAlias = (
    ReceivedBatch | ReplayRequested | BatchesLost | PublisherRestarted | UndecodableBatch
)


class _SourceFeed:
    """One publisher's sockets and tracker, driven by three tasks in one Trio run."""

    def __init__(
        self,
        source: EventSource,
        ctx: zmq.Context[zmq.Socket[bytes]],
        topic: bytes,
        tracker: SeqTracker,
        out: trio.MemorySendChannel[list[SubscriberItem]],
        max_batch_bytes: int = MAX_BATCH_BYTES,
        curve: CurveGuard | None = None,
    ) -> None:
        if (
            curve is not None
            and source.server_key is None
            and (not source.bind or source.replay_endpoint is not None)
        ):
            raise ConfigError(
                f"a secure KV event subscriber needs the publisher's CURVE key for "
                f"{source.label} (EventSource.server_key)"
            )
        #: Secure bind mode: the only identity whose messages are read.
        self._expect = source.server_key if curve is not None and source.bind else None
        #: Messages dropped for coming from another identity.
        self.foreign = 0
        self._foreign_log = RateLimitedLog(log)
        self.source = source
        self.label = source.label
        self.tracker = tracker
        self._out = out
        self._topic = topic
        self._deadline_changed = trio.Event()
        self._lock = trio.Lock()
        self.sub = open_socket(
            ctx,
            zmq.SUB,
            max_frame_bytes=max_batch_bytes,
            max_frames=MAX_MESSAGE_FRAMES,
            name=f"KV event SUB for {source.label}",
        )
        self.dealer: TrioSocket | None = None
        try:
            self.sub.sock.setsockopt(zmq.SUBSCRIBE, topic)
            if curve is not None:
                if source.bind:
                    curve.server(self.sub, f"the KV event SUB for {source.label}")
                else:
                    assert source.server_key is not None
                    curve.client(self.sub, source.server_key)
            if source.bind:
                self.sub.sock.bind(source.endpoint)
            else:
                self.sub.sock.connect(source.endpoint)
            if source.replay_endpoint is not None:
                self.dealer = open_socket(
                    ctx,
                    zmq.DEALER,
                    max_frame_bytes=max_batch_bytes,
                    max_frames=MAX_MESSAGE_FRAMES,
                    name=f"KV event replay DEALER for {source.label}",
                )
                self.dealer.sock.setsockopt(zmq.RCVHWM, 0)
                if curve is not None:
                    assert source.server_key is not None
                    curve.client(self.dealer, source.server_key)
                self.dealer.sock.connect(source.replay_endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise ConfigError(
                f"KV event subscriber: cannot follow {source.label} (endpoint "
                f"{source.endpoint}, replay {source.replay_endpoint or 'none'}): {exc}"
            ) from None

    def close(self) -> None:
        self.sub.close()
        if self.dealer is not None:
            self.dealer.close()

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._live_loop)
            if self.dealer is not None:
                nursery.start_soon(self._replay_loop, self.dealer)
            nursery.start_soon(self._timer_loop)

    async def _receive_live(self) -> list[list[bytes]]:
        if self._expect is None:
            return await self.sub.recv_batch(_RECV_BATCH, _RECV_BYTES)
        messages = await self.sub.recv_batch_from(_RECV_BATCH, _RECV_BYTES)
        kept = [frames for frames, sender in messages if sender == self._expect]
        if len(kept) < len(messages):
            self.foreign += len(messages) - len(kept)
            self._foreign_log.warning(
                self.label,
                "foreign",
                "%s: ignored %d KV event messages from CURVE identities other than the "
                "publisher's %s (%d so far)",
                self.label,
                len(messages) - len(kept),
                self._expect,
                self.foreign,
            )
        return kept

    async def _live_loop(self) -> None:
        while True:
            messages = await self._receive_live()
            now = trio.current_time()
            live = self.tracker.live
            for frames in messages:
                try:
                    seq, payload = split_pub_frames(frames)
                except WireError as exc:
                    self._foreign_log.warning(
                        self.label,
                        "malformed",
                        "malformed KV event message from %s ignored: %s",
                        self.label,
                        exc,
                    )
                    continue
                live(seq, payload, now)
            await self._apply()

    async def _replay_loop(self, dealer: TrioSocket) -> None:
        while True:
            messages = await dealer.recv_batch(_RECV_BATCH, _RECV_BYTES)
            now = trio.current_time()
            for frames in messages:
                try:
                    reply = decode_replay_reply(frames)
                except WireError as exc:
                    self._foreign_log.warning(
                        self.label,
                        "malformed-replay",
                        "malformed KV event replay from %s ignored: %s",
                        self.label,
                        exc,
                    )
                    continue
                if reply.is_end:
                    self.tracker.replay_end(now)
                else:
                    self.tracker.replayed(reply.seq, reply.payload, now)
            await self._apply()

    async def _timer_loop(self) -> None:
        while True:
            deadline = self.tracker.next_deadline()
            self._deadline_changed = trio.Event()
            with trio.move_on_at(deadline if deadline is not None else math.inf):
                await self._deadline_changed.wait()
            self.tracker.handle_timeout(trio.current_time())
            await self._apply()

    async def _apply(self) -> None:
        """Carry out the tracker's commands; hand their items over as one group.

        Three tasks feed the tracker; the lock keeps "drain, then send everything
        drained" atomic, so items leave in the tracker's order even while a send
        waits for the consumer. One channel send per group, not per item: a Trio
        channel operation costs a scheduler pass.
        """
        async with self._lock:
            before = self.tracker.next_deadline()
            items: list[SubscriberItem] = []
            for command in self.tracker.drain_commands():
                if isinstance(command, RequestReplay):
                    assert self.dealer is not None
                    await self.dealer.send_multipart(encode_replay_request(command.start_seq))
                items.append(self._item(command))
            if self.tracker.next_deadline() != before:
                self._deadline_changed.set()
            if items:
                await self._out.send(items)

    def _item(self, command: TrackerCommand) -> SubscriberItem:
        label = self.label
        match command:
            case Deliver(seq=seq, payload=payload, replayed=replayed):
                try:
                    batch = decode_batch(payload)
                except WireError as exc:
                    self._foreign_log.warning(
                        label,
                        "undecodable",
                        "KV event batch %d from %s is malformed: %s",
                        seq,
                        label,
                        exc,
                    )
                    return UndecodableBatch(label, seq, str(exc))
                return ReceivedBatch(label, seq, batch, replayed)
            case RequestReplay(start_seq=start, attempt=attempt):
                return ReplayRequested(label, start, attempt)
            case GapUnhealable(first_missing=first, resumed_at=resumed, reason=reason):
                self._foreign_log.warning(
                    label,
                    "lost",
                    "KV events %d..%d from %s are lost (%s); the view of this publisher is "
                    "incomplete",
                    first,
                    resumed - 1,
                    label,
                    reason,
                )
                return BatchesLost(label, first, resumed, reason)
            case _Restarted(last_seq=last, new_seq=new):
                self._foreign_log.warning(
                    label,
                    "restarted",
                    "KV event publisher %s restarted (sequence %d after %d); drop its state",
                    label,
                    new,
                    last,
                )
                return PublisherRestarted(label, last, new)

    def disconnect(self) -> None:
        self.sub.sock.disconnect(self.source.endpoint)

    def connect(self) -> None:
        self.sub.sock.connect(self.source.endpoint)


@final
class KVEventSubscriber:
    """Batches and stream events from every source, as an async iterator.

    Create it with :func:`open_kv_subscriber`. Items arrive in groups (what one
    read of the sockets produced): :meth:`receive_batch` returns a whole group
    with one checkpoint, the fastest way to consume; :meth:`receive` returns one
    item and checkpoints every time; ``async for`` checkpoints once per group.
    Iteration ends when the subscriber closes.
    """

    def __init__(
        self,
        feeds: dict[str, _SourceFeed],
        receive: trio.MemoryReceiveChannel[list[SubscriberItem]],
    ) -> None:
        self._feeds = feeds
        self._receive = receive
        self._ready: deque[SubscriberItem] = deque()

    def __aiter__(self) -> AsyncIterator[SubscriberItem]:
        return self

    async def __anext__(self) -> SubscriberItem:
        if self._ready:
            return self._ready.popleft()
        try:
            self._ready.extend(await self._receive.receive())
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise StopAsyncIteration from None
        return self._ready.popleft()

    async def receive(self) -> SubscriberItem:
        """The next item; raises :class:`trio.EndOfChannel` once closed."""
        if self._ready:
            await trio.lowlevel.checkpoint()
            return self._ready.popleft()
        self._ready.extend(await self._receive.receive())
        return self._ready.popleft()

    async def receive_batch(self) -> list[SubscriberItem]:
        """Every item ready now (at least one), in order; one checkpoint."""
        if self._ready:
            items = list(self._ready)
            self._ready.clear()
            await trio.lowlevel.checkpoint()
            return items
        items = await self._receive.receive()
        while True:
            try:
                items.extend(self._receive.receive_nowait())
            except trio.WouldBlock:
                return items

    @property
    def sources(self) -> tuple[str, ...]:
        """The labels of the followed publishers."""
        return tuple(self._feeds)

    def statistics(self) -> dict[str, TrackerStats]:
        """Per-source counters: delivered, replayed, duplicates, gaps, lost, restarts."""
        return {label: feed.tracker.statistics() for label, feed in self._feeds.items()}

    def disconnect(self, source: str) -> None:
        """Drop the live connection to ``source`` (a connected source only).

        For operators' tools and tests: batches published meanwhile are missed, and
        after :meth:`connect` the gap is healed by replay like any other.
        """
        feed = self._feed(source)
        if feed.source.bind:
            raise ValueError(f"source {source!r} is bound, not connected; it cannot disconnect")
        feed.disconnect()

    def connect(self, source: str) -> None:
        """Re-establish the live connection dropped by :meth:`disconnect`."""
        self._feed(source).connect()

    def _feed(self, source: str) -> _SourceFeed:
        try:
            return self._feeds[source]
        except KeyError:
            raise ValueError(
                f"unknown KV event source {source!r}; known: {', '.join(self._feeds)}"
            ) from None


@asynccontextmanager
async def open_kv_subscriber(
    sources: Sequence[EventSource],
    *,
    topic: str = "",
    catch_up: bool = False,
    replay_timeout: float = 5.0,
    max_buffered: int = 64,
    ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
    max_batch_bytes: int = MAX_BATCH_BYTES,
    curve: CurveKeys | None = None,
) -> AsyncIterator[KVEventSubscriber]:
    """Follow ``sources`` until the block exits.

    ``topic`` is the subscription prefix. ``catch_up`` replays each publisher's
    buffer from 0 when the first batch seen is not 0 (a late joiner rebuilding its
    view); without it, delivery starts at the first live batch. ``max_buffered``
    groups of items (one group per read of a socket) wait for the consumer before
    the sockets stop being read (then libzmq's high-water marks drop live batches,
    and the gaps are healed by replay). ``max_batch_bytes``: the largest payload
    accepted (:data:`MAX_BATCH_BYTES`); a larger batch is never received.
    ``curve``: this process's CURVE keys and allow-list (secure mode, see the module
    doc); each source then needs its publisher's ``server_key``.
    """
    if not sources:
        raise ValueError("open_kv_subscriber needs at least one EventSource")
    labels = [s.label for s in sources]
    if len(set(labels)) != len(labels):
        raise ValueError(f"KV event sources need distinct names, got {labels}")
    context = ctx if ctx is not None else zmq.Context.instance()
    send, receive = trio.open_memory_channel[list[SubscriberItem]](max_buffered)
    feeds: dict[str, _SourceFeed] = {}
    guard: CurveGuard | None = None
    if curve is not None:
        from tspd.shell.security import CurveGuard

        guard = CurveGuard(context, curve, "the KV event subscriber")
    try:
        for source in sources:
            tracker = SeqTracker(
                replay=source.replay_endpoint is not None,
                catch_up=catch_up,
                replay_timeout=replay_timeout,
            )
            feeds[source.label] = _SourceFeed(
                source, context, topic.encode(), tracker, send, max_batch_bytes, guard
            )
        subscriber = KVEventSubscriber(feeds, receive)
        with single_error():  # the caller sees its own error, not our task group
            async with trio.open_nursery() as nursery:
                for feed in feeds.values():
                    nursery.start_soon(feed.run)
                try:
                    yield subscriber
                finally:
                    nursery.cancel_scope.cancel()
    finally:
        for feed in feeds.values():
            feed.close()
        if guard is not None:
            guard.close()
        send.close()
        receive.close()
