"""The Trio KV-event publisher on real sockets over 127.0.0.1 and IPC."""

from __future__ import annotations

import itertools
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

import msgpack
import pytest
import trio
import zmq

from tspd.core.errors import ConfigError
from tspd.core.kv_config import KVEventsConfig
from tspd.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    decode_batch,
    decode_pub_frames,
    encode_batch,
)
from tspd.core.replay import END_SEQ_FRAME, decode_replay_reply, encode_replay_request
from tspd.shell.kv_publisher import (
    PUBLISHERS,
    KVEventPublisher,
    NullKVEventPublisher,
    open_event_publisher,
    open_kv_publisher,
)
from tspd.shell.ports import free_port
from tspd.shell.zmq import TrioSocket, open_socket

EVENTS: list[KVEvent] = [BlockStored((11,), None, (1, 2, 3, 4), 4), BlockRemoved((7,))]

# docs/protocol.md#proto-kv-wire's reference batch (tests/core/test_kv_events.py), DP rank 0.
GOLDEN_BATCH_RANK_0 = bytes.fromhex(
    "93" "cb3ff8000000000000" "92"
    "95" "ab" + b"BlockStored".hex() + "91" "7b" "c0" "92" "01" "02" "02"
    "92" "ac" + b"BlockRemoved".hex() + "91" "7b"
    "00"
)  # fmt: skip


async def _until(predicate: Callable[[], bool], limit: float = 10.0) -> None:
    """Poll ``predicate`` until it holds (state that has no event to wait on)."""
    with trio.fail_after(limit):
        for _ in itertools.count():
            if predicate():
                return
            await trio.sleep(0.002)


@pytest.fixture
def ipc_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="tspd-kv-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def ctx() -> zmq.Context[zmq.Socket[bytes]]:
    return zmq.Context.instance()


def _config(endpoint: str, **fields: object) -> KVEventsConfig:
    return KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint, **fields)  # type: ignore[arg-type]


async def _subscribed(pub: KVEventPublisher, sub: TrioSocket) -> int:
    """Publish until the SUB sees a batch (the slow-joiner window); return the next seq."""
    seq: int | None = None
    with trio.fail_after(10):
        while seq is None:
            await pub.apublish(EVENTS)
            with trio.move_on_after(0.05):
                seq = decode_pub_frames(await sub.recv_multipart()).seq
        # Drain what else arrived during the probe.
        while True:
            with trio.move_on_after(0.05) as scope:
                seq = decode_pub_frames(await sub.recv_multipart()).seq
            if scope.cancelled_caught:
                return seq + 1


def _sub(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, topic: bytes = b"") -> TrioSocket:
    sub = open_socket(ctx, zmq.SUB)
    sub.sock.setsockopt(zmq.SUBSCRIBE, topic)
    sub.sock.connect(endpoint)
    return sub


async def test_batches_arrive_in_order_with_three_frames_and_tokenspeed_payload(
    ctx: zmq.Context[zmq.Socket[bytes]], ipc_dir: str
) -> None:
    config = _config(f"ipc://{ipc_dir}/pub", topic="kv@pod")
    async with open_kv_publisher(config, ctx=ctx) as pub:
        assert pub.endpoint == f"ipc://{ipc_dir}/pub"
        async with _sub(ctx, pub.endpoint, b"kv@") as sub:
            first = await _subscribed(pub, sub)
            for i in range(50):
                await pub.apublish(EVENTS, ts=float(i))
            got: list[list[bytes]] = []
            with trio.fail_after(10):
                while len(got) < 50:
                    got.append(await sub.recv_multipart())
    messages = [decode_pub_frames(frames) for frames in got]
    assert [m.seq for m in messages] == list(range(first, first + 50))
    assert {m.topic for m in messages} == {b"kv@pod"}
    plain = msgpack.unpackb(messages[3].payload)
    assert plain == [3.0, [["BlockStored", [11], None, [1, 2, 3, 4], 4], ["BlockRemoved", [7]]], 0]
    stats = pub.statistics()
    assert stats.batches_published == first + 50
    assert stats.events_published == 2 * (first + 50)
    assert stats.batches_dropped == 0


async def test_sequence_starts_at_zero_and_empty_rounds_send_nothing(
    ctx: zmq.Context[zmq.Socket[bytes]], ipc_dir: str
) -> None:
    port = free_port()
    sub = open_socket(ctx, zmq.SUB)
    sub.sock.setsockopt(zmq.SUBSCRIBE, b"")
    sub.sock.bind(f"tcp://127.0.0.1:{port}")
    async with sub, open_kv_publisher(_config(f"tcp://127.0.0.1:{port}"), ctx=ctx) as pub:
        await pub.apublish([])
        assert pub.publish_nowait([]) is True
        first = await _subscribed(pub, sub)
        assert pub.statistics().next_seq == first
    assert first >= 1
    assert pub.statistics().batches_published == first


async def test_publish_from_an_engine_thread_and_refusal_in_the_trio_thread(
    ctx: zmq.Context[zmq.Socket[bytes]], ipc_dir: str
) -> None:
    async with open_kv_publisher(_config(f"ipc://{ipc_dir}/p", max_queue_size=4), ctx=ctx) as pub:

        def engine_thread() -> None:
            for _ in range(500):
                pub.publish(EVENTS)

        await trio.to_thread.run_sync(engine_thread)
        with pytest.raises(RuntimeError, match="apublish"):
            pub.publish(EVENTS)
    stats = pub.statistics()
    assert stats.batches_published == 500
    assert stats.batches_dropped == 0


async def test_full_queue_blocks_publish_and_drops_publish_nowait(
    ctx: zmq.Context[zmq.Socket[bytes]], ipc_dir: str
) -> None:
    async with open_kv_publisher(_config(f"ipc://{ipc_dir}/p", max_queue_size=2), ctx=ctx) as pub:
        # No checkpoint in between: the sender task cannot drain yet.
        assert pub.publish_nowait(EVENTS)
        assert pub.publish_nowait(EVENTS)
        assert not pub.publish_nowait(EVENTS)
        assert pub.statistics().batches_dropped == 1
        assert pub.statistics().queue_depth == 2

        done = threading.Event()

        def blocked_publisher() -> None:
            pub.publish(EVENTS)
            done.set()

        thread = threading.Thread(target=blocked_publisher)
        thread.start()
        # Still no checkpoint: the queue stays full and the thread must wait.
        time.sleep(0.2)  # noqa: ASYNC251
        assert not done.is_set()
        await _until(done.is_set)
        await trio.to_thread.run_sync(thread.join)
    assert pub.statistics().batches_published == 3


async def test_close_flushes_the_queue_within_its_bound(
    ctx: zmq.Context[zmq.Socket[bytes]], ipc_dir: str
) -> None:
    config = _config(f"ipc://{ipc_dir}/p", max_queue_size=10_000)
    async with open_kv_publisher(config, ctx=ctx) as pub:
        for _ in range(3000):
            assert pub.publish_nowait(EVENTS)
        start = trio.current_time()
    elapsed = trio.current_time() - start
    stats = pub.statistics()
    assert stats.batches_published == 3000
    assert stats.batches_dropped == 0
    assert elapsed < 3.0  # bounded by close_timeout (1 s) plus scheduling slack


class _SlowSend:
    """Wraps the PUB socket: every send blocks for ``delay`` (a saturated link)."""

    def __init__(self, inner: TrioSocket, delay: float) -> None:
        self._inner = inner
        self._delay = delay

    def send_multipart_nowait(self, frames: list[bytes]) -> bool:
        time.sleep(self._delay)
        return self._inner.send_multipart_nowait(frames)

    def close(self, linger: int = 0) -> None:
        self._inner.close(linger)


async def test_close_reports_what_it_could_not_send(
    ctx: zmq.Context[zmq.Socket[bytes]], ipc_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    n = 600
    config = _config(f"ipc://{ipc_dir}/p", max_queue_size=n)
    async with open_kv_publisher(config, ctx=ctx, close_timeout=0.05) as pub:
        pub._pub = _SlowSend(pub._pub, 0.001)  # type: ignore[assignment]
        for _ in range(n):
            assert pub.publish_nowait(EVENTS)
    stats = pub.statistics()
    # The sender takes at most two chunks of 256 before the bound is noticed.
    assert stats.batches_published <= 512
    assert stats.batches_dropped == n - stats.batches_published
    assert f"closed with {stats.batches_dropped} batches still queued" in caplog.text
    # After close, publishing drops and counts instead of raising.
    assert not pub.publish_nowait(EVENTS)
    await trio.to_thread.run_sync(pub.publish, EVENTS)
    assert pub.statistics().batches_dropped == stats.batches_dropped + 2
    assert "is closed; dropping a batch" in caplog.text


async def _request(dealer: TrioSocket, start: bytes | int) -> list[tuple[int, bytes]]:
    frame = start if isinstance(start, bytes) else encode_replay_request(start)[1]
    await dealer.send_multipart([b"", frame])
    out: list[tuple[int, bytes]] = []
    with trio.fail_after(20):
        while True:
            reply = decode_replay_reply(await dealer.recv_multipart())
            if reply.is_end:
                assert reply.payload == b""
                return out
            out.append((reply.seq, reply.payload))


def _dealer(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> TrioSocket:
    dealer = open_socket(ctx, zmq.DEALER)
    dealer.sock.connect(endpoint)
    return dealer


async def test_replay_answers_from_start_seq_and_always_ends_with_the_marker(
    ctx: zmq.Context[zmq.Socket[bytes]], ipc_dir: str
) -> None:
    config = _config(f"ipc://{ipc_dir}/p", replay_endpoint="tcp://127.0.0.1:0", buffer_steps=5)
    async with open_kv_publisher(config, ctx=ctx) as pub:
        assert pub.replay_endpoint is not None
        assert pub.replay_endpoint.startswith("tcp://127.0.0.1:")
        for i in range(8):
            await pub.apublish(EVENTS, ts=float(i))
        await _until(lambda: pub.statistics().next_seq >= 8)
        async with _dealer(ctx, pub.replay_endpoint) as dealer:
            all_kept = await _request(dealer, 0)
            tail = await _request(dealer, 6)
            none = await _request(dealer, 100)
    assert [s for s, _ in all_kept] == [3, 4, 5, 6, 7]
    assert decode_batch(all_kept[0][1]).ts == 3.0
    assert [s for s, _ in tail] == [6, 7]
    assert none == []
    assert pub.statistics().replay_requests_served == 3
    assert pub.statistics().replay_batches_sent == 7


async def test_bad_replay_requests_are_answered_or_ignored_without_harm(
    ctx: zmq.Context[zmq.Socket[bytes]], ipc_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    config = _config(f"ipc://{ipc_dir}/p", replay_endpoint="tcp://127.0.0.1:0")
    async with open_kv_publisher(config, ctx=ctx) as pub:
        assert pub.replay_endpoint is not None
        for _ in range(4):
            await pub.apublish(EVENTS)
        await _until(lambda: pub.statistics().next_seq >= 4)
        async with _dealer(ctx, pub.replay_endpoint) as dealer:
            # Wrong frame counts: logged and ignored, no reply.
            await dealer.send_multipart([b"", b"\x00", b"extra"])
            await dealer.send_multipart([b"\x00" * 8])
            # Short start_seq: left-padded; long: its last 8 bytes.
            short = await _request(dealer, b"\x02")
            long = await _request(dealer, b"\xff\xff" + (3).to_bytes(8, "big"))
            empty = await _request(dealer, b"")
        assert pub.statistics().replay_requests_invalid == 2
        # Live publishing carries on.
        await pub.apublish(EVENTS)
    assert [s for s, _ in short] == [2, 3]
    assert [s for s, _ in long] == [3]
    assert [s for s, _ in empty] == [0, 1, 2, 3]
    assert "Invalid replay request: expected 3 frames" in caplog.text
    assert pub.statistics().batches_published == 5


def _big_events(i: int) -> list[BlockStored]:
    return [BlockStored((i,), None, tuple(range(2048)), 2048)]


async def test_replay_longer_than_the_high_water_mark_delivers_every_batch(
    ctx: zmq.Context[zmq.Socket[bytes]], ipc_dir: str
) -> None:
    """TokenSpeed loses batches past the ROUTER's HWM; backpressure must not."""
    n = 3000
    config = _config(f"ipc://{ipc_dir}/p", replay_endpoint="tcp://127.0.0.1:0", buffer_steps=n)
    async with open_kv_publisher(config, ctx=ctx, replay_sndhwm=50) as pub:
        assert pub.replay_endpoint is not None
        for i in range(n):
            await pub.apublish(_big_events(i))
        await _until(lambda: pub.statistics().next_seq >= n)
        async with _dealer(ctx, pub.replay_endpoint) as dealer:
            dealer.sock.setsockopt(zmq.RCVHWM, 50)
            replayed = await _request(dealer, 0)
    assert [s for s, _ in replayed] == list(range(n))
    assert pub.statistics().replays_cut_short == 0


async def test_replay_to_a_client_that_stops_reading_is_cut_short_visibly(
    ctx: zmq.Context[zmq.Socket[bytes]], ipc_dir: str
) -> None:
    n = 3000
    config = _config(f"ipc://{ipc_dir}/p", replay_endpoint="tcp://127.0.0.1:0", buffer_steps=n)
    async with open_kv_publisher(
        config, ctx=ctx, replay_sndhwm=20, replay_stall_timeout=0.3
    ) as pub:
        assert pub.replay_endpoint is not None
        for i in range(n):
            await pub.apublish(_big_events(i))
        await _until(lambda: pub.statistics().next_seq >= n)
        async with _dealer(ctx, pub.replay_endpoint) as dealer:
            dealer.sock.setsockopt(zmq.RCVHWM, 20)
            await dealer.send_multipart(encode_replay_request(0))
            await _until(lambda: pub.statistics().replays_cut_short > 0, 20)
            # Live publishing was not held up by the stalled replay.
            await pub.apublish(EVENTS)
            replayed = await _request_tail(dealer)
    seqs = [s for s, _ in replayed]
    assert 0 < len(seqs) < n
    assert seqs == list(range(len(seqs)))  # a contiguous run, then the end marker
    assert pub.statistics().batches_published == n + 1


async def _request_tail(dealer: TrioSocket) -> list[tuple[int, bytes]]:
    out: list[tuple[int, bytes]] = []
    with trio.fail_after(20):
        while True:
            frames = await dealer.recv_multipart()
            if frames[1] == END_SEQ_FRAME:
                return out
            reply = decode_replay_reply(frames)
            out.append((reply.seq, reply.payload))


async def test_dp_rank_moves_both_ports_and_is_written_into_batches(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    sub_port, replay_port = free_port(), free_port()
    sub = open_socket(ctx, zmq.SUB)
    sub.sock.setsockopt(zmq.SUBSCRIBE, b"")
    sub.sock.bind(f"tcp://127.0.0.1:{sub_port}")
    config = _config(
        f"tcp://127.0.0.1:{sub_port - 3}", replay_endpoint=f"tcp://127.0.0.1:{replay_port - 3}"
    )
    async with sub, open_kv_publisher(config, dp_rank=3, ctx=ctx) as pub:
        assert pub.endpoint == f"tcp://127.0.0.1:{sub_port}"
        assert pub.replay_endpoint == f"tcp://127.0.0.1:{replay_port}"
        await _subscribed(pub, sub)
        await pub.apublish(EVENTS)
        with trio.fail_after(5):
            message = decode_pub_frames(await sub.recv_multipart())
    assert decode_batch(message.payload).dp_rank == 3


@pytest.mark.parametrize(
    ("endpoint", "rank", "message"),
    [
        ("inproc://kv", 0, "inproc:// is private"),
        ("ipc:///tmp/kv", 1, "only tcp:// endpoints can be offset"),
        ("udp://127.0.0.1:1", 0, "unsupported endpoint udp://"),
        ("tcp://127.0.0.1:notaport", 0, "cannot connect the PUB socket"),
    ],
)
async def test_unsupported_endpoints_fail_at_start(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, rank: int, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        async with open_kv_publisher(_config(endpoint), dp_rank=rank, ctx=ctx):
            pytest.fail("the publisher must not start")


async def test_factory_follows_tokenspeed(ipc_dir: str) -> None:
    async with open_event_publisher(None) as null:
        assert isinstance(null, NullKVEventPublisher)
        null.publish(EVENTS)
        assert null.publish_nowait(EVENTS)
        await null.apublish(EVENTS)
        assert null.statistics().batches_published == 0
    async with open_event_publisher('{"enable_kv_cache_events": false}') as off:
        assert isinstance(off, NullKVEventPublisher)
    enabled = f'{{"enable_kv_cache_events": true, "endpoint": "ipc://{ipc_dir}/f"}}'
    async with open_event_publisher(enabled, attn_tp_rank=1) as other_rank:
        assert isinstance(other_rank, NullKVEventPublisher)
    async with open_event_publisher(enabled) as real:
        assert isinstance(real, KVEventPublisher)
    with pytest.raises(ConfigError, match="Unknown event publisher 'kafka'"):
        open_event_publisher('{"enable_kv_cache_events": true, "publisher": "kafka"}')
    assert PUBLISHERS.names() == ("null", "zmq")


class _FailingOnce:
    """Wraps the PUB socket: the send of one chosen message fails like libzmq would."""

    def __init__(self, inner: TrioSocket, fail_at: int) -> None:
        self._inner = inner
        self._calls = 0
        self._fail_at = fail_at

    def send_multipart_nowait(self, frames: list[bytes]) -> bool:
        self._calls += 1
        if self._calls == self._fail_at:
            raise zmq.ZMQError(zmq.ENOTSUP)
        return self._inner.send_multipart_nowait(frames)

    def close(self, linger: int = 0) -> None:
        self._inner.close(linger)


async def test_a_batch_whose_send_failed_is_still_replayable(
    ctx: zmq.Context[zmq.Socket[bytes]], ipc_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    config = _config(f"ipc://{ipc_dir}/p", replay_endpoint="tcp://127.0.0.1:0")
    async with open_kv_publisher(config, ctx=ctx) as pub:
        assert pub.replay_endpoint is not None
        pub._pub = _FailingOnce(pub._pub, fail_at=2)  # type: ignore[assignment]
        for i in range(3):
            await pub.apublish(EVENTS, ts=float(i))
        await pub.wait_published(3)
        async with _dealer(ctx, pub.replay_endpoint) as dealer:
            replayed = await _request(dealer, 0)
    assert [s for s, _ in replayed] == [0, 1, 2]
    assert decode_batch(replayed[1][1]).ts == 1.0
    assert pub.statistics().send_failures == 1
    assert "publishing KV event batch 1" in caplog.text
    assert "stays in the replay buffer" in caplog.text


async def test_a_client_that_stops_reading_does_not_hold_up_another(
    ctx: zmq.Context[zmq.Socket[bytes]], ipc_dir: str
) -> None:
    n = 2000
    config = _config(f"ipc://{ipc_dir}/p", replay_endpoint="tcp://127.0.0.1:0", buffer_steps=n)
    async with open_kv_publisher(config, ctx=ctx, replay_sndhwm=20, replay_stall_timeout=60) as pub:
        assert pub.replay_endpoint is not None
        for i in range(n):
            await pub.apublish(_big_events(i))
        await pub.wait_published(n)
        async with (
            _dealer(ctx, pub.replay_endpoint) as stuck,
            _dealer(ctx, pub.replay_endpoint) as reader,
        ):
            stuck.sock.setsockopt(zmq.RCVHWM, 20)
            await stuck.send_multipart(encode_replay_request(0))  # and never reads
            await trio.sleep(0.2)
            with trio.fail_after(20):  # far below the stuck client's 60 s stall bound
                replayed = await _request(reader, 0)
    assert [s for s, _ in replayed] == list(range(n))


async def test_the_callers_error_leaves_the_block_unwrapped(ipc_dir: str) -> None:
    with pytest.raises(KeyError, match="mine"):
        async with open_kv_publisher(_config(f"ipc://{ipc_dir}/p")):
            raise KeyError("mine")


class _WatchedEvents(list[KVEvent]):
    """A round's events that note every thread iterating over them: the encoder does,
    ``publish`` (which only hands the sequence over) must not."""

    def __init__(self, events: list[KVEvent], readers: list[int]) -> None:
        super().__init__(events)
        self.readers = readers

    def __iter__(self) -> Iterator[KVEvent]:
        self.readers.append(threading.get_ident())
        return super().__iter__()


async def test_publish_leaves_the_encoding_to_the_sender_task(
    ctx: zmq.Context[zmq.Socket[bytes]], ipc_dir: str
) -> None:
    readers: list[int] = []
    engine: list[int] = []
    async with open_kv_publisher(_config(f"ipc://{ipc_dir}/p"), ctx=ctx) as pub:
        trio_thread = threading.get_ident()

        def engine_thread() -> None:
            engine.append(threading.get_ident())
            for i in range(20):
                pub.publish(_WatchedEvents(EVENTS, readers), ts=float(i))
            assert pub.publish_nowait(_WatchedEvents(EVENTS, readers))

        await trio.to_thread.run_sync(engine_thread)
        await pub.apublish(_WatchedEvents(EVENTS, readers))
        await pub.wait_published(22)
    # Every batch was read, each by the publisher's own (Trio) thread only.
    assert len(readers) == 22
    assert set(readers) == {trio_thread}
    assert engine[0] not in readers
    assert pub.statistics().events_published == 22 * len(EVENTS)


async def test_published_payloads_are_the_reference_encoding(
    ctx: zmq.Context[zmq.Socket[bytes]], ipc_dir: str
) -> None:
    rounds: list[list[KVEvent]] = [
        [BlockStored((123,), None, (1, 2), 2), BlockRemoved((123,))],
        [BlockStored(((1 << 64) - 1,), 1 << 63, (-1, 70000), 16)],
        [BlockStored((b"\x01" * 32, 5), b"\x02" * 32, (7,), 1), AllBlocksCleared()],
        [BlockRemoved(())] * 40,
    ]
    config = _config(f"ipc://{ipc_dir}/p", replay_endpoint="tcp://127.0.0.1:0")
    async with open_kv_publisher(config, dp_rank=0, ctx=ctx) as pub:
        assert pub.replay_endpoint is not None
        for i, events in enumerate(rounds):
            await pub.apublish(events, ts=1.5 + i)
        await pub.wait_published(len(rounds))
        async with _dealer(ctx, pub.replay_endpoint) as dealer:
            replayed = await _request(dealer, 0)
    assert replayed == [
        (i, encode_batch(KVEventBatch(1.5 + i, tuple(events), 0)))
        for i, events in enumerate(rounds)
    ]
    assert replayed[0][1] == GOLDEN_BATCH_RANK_0


async def test_a_batch_that_cannot_be_encoded_is_dropped_without_a_sequence_number(
    ctx: zmq.Context[zmq.Socket[bytes]], ipc_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    too_big: list[KVEvent] = [BlockStored((1 << 64,), None, (1,), 1)]
    not_msgpack: list[KVEvent] = [BlockStored((1,), None, (object(),), 1)]  # type: ignore[arg-type]
    config = _config(f"ipc://{ipc_dir}/p", replay_endpoint="tcp://127.0.0.1:0")
    async with open_kv_publisher(config, ctx=ctx) as pub:
        assert pub.replay_endpoint is not None

        def engine_thread() -> None:
            pub.publish(EVENTS, ts=0.0)
            pub.publish(too_big)  # returns: the sender finds out, not the caller
            assert pub.publish_nowait(not_msgpack)
            pub.publish(iter(EVENTS))  # type: ignore[arg-type]  # not a Sequence: no len()
            pub.publish(EVENTS, ts=1.0)

        await trio.to_thread.run_sync(engine_thread)
        await pub.wait_published(2)
        stats = pub.statistics()
        async with _dealer(ctx, pub.replay_endpoint) as dealer:
            replayed = await _request(dealer, 0)
    assert [(seq, decode_batch(payload).ts) for seq, payload in replayed] == [(0, 0.0), (1, 1.0)]
    assert stats.batches_published == 2
    assert stats.events_published == 2 * len(EVENTS)
    assert stats.batches_dropped == 3
    assert stats.next_seq == 2
    assert "dropping a batch that cannot be encoded (ValueError" in caplog.text


async def test_batches_still_queued_at_close_reach_the_subscriber(
    ctx: zmq.Context[zmq.Socket[bytes]], ipc_dir: str
) -> None:
    n, queued = 2000, 1000
    config = _config(f"ipc://{ipc_dir}/pub", max_queue_size=n, hwm=10 * n)
    sub = open_socket(ctx, zmq.SUB)
    sub.sock.setsockopt(zmq.RCVHWM, 10 * n)  # the test reads only after the close
    sub.sock.setsockopt(zmq.SUBSCRIBE, b"")
    sub.sock.connect(f"ipc://{ipc_dir}/pub")
    async with sub:
        async with open_kv_publisher(config, ctx=ctx) as pub:
            first = await _subscribed(pub, sub)

            def engine_thread() -> None:
                for i in range(n - queued):
                    pub.publish(EVENTS, ts=float(i))

            await trio.to_thread.run_sync(engine_thread)
            # No checkpoint from here to the end of the block: these are all still
            # queued, none encoded, when the publisher closes.
            for i in range(n - queued, n):
                assert pub.publish_nowait(EVENTS, ts=float(i))
            assert pub.statistics().queue_depth >= queued
        stats = pub.statistics()
        got: list[tuple[int, float]] = []
        with trio.fail_after(10):
            while len(got) < n:
                message = decode_pub_frames(await sub.recv_multipart())
                got.append((message.seq, decode_batch(message.payload).ts))
    assert got == [(first + i, float(i)) for i in range(n)]
    assert stats.batches_published == first + n
    assert stats.batches_dropped == 0
