"""``tspd bench events``: the KV-event path end to end, beside its raw limit.

Measured in one run, publisher in this process and consumer in a helper process
(started with this interpreter) on 127.0.0.1, as a router would consume them:

* **end to end**: batches/s and events/s from ``publish`` in an engine thread to
  the tspd subscriber's delivered batches, for batches of 1 and 16 events
  (synthetic, realistic events, pre-generated so the figure is the path's);
* **raw limit**: a plain pyzmq PUB sending pre-encoded payloads of the same sizes
  to a plain SUB (high-water marks off, no loss);
* **publish cost**: p50/p99 of ``publish`` called from a non-Trio thread, for
  batches of 1 and 16 events -- what the engine's scheduler round pays (the
  sender task encodes, not the caller);
* **hand-off**: the two ways into Trio from a thread, timed per call -- tspd's
  bounded queue woken with ``TrioToken.run_sync_soon``, and
  ``trio.from_thread.run`` of a memory channel's ``send``;
* **replay**: a helper's DEALER asks for all 10,000 buffered batches several times;
  the time to the end marker and how many replays arrived complete.

Figures only; nothing here asserts a speed.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import click
import trio
import zmq
from rich.console import Console
from rich.table import Table

from tspd.core.kv_config import KVEventsConfig
from tspd.core.kv_events import KVEvent, KVEventBatch, encode_batch
from tspd.core.kv_synth import SyntheticCache
from tspd.shell.kv_publisher import BatchQueue, open_kv_publisher
from tspd.shell.kv_subscriber import EventSource, ReceivedBatch, open_kv_subscriber
from tspd.shell.ports import free_port

__all__ = [
    "EventSizes",
    "Row",
    "events",
    "raw_sub_helper",
    "replay_client_helper",
    "run_event_benchmarks",
    "tspd_sub_helper",
]

_HELPER = "from tspd.bench.events import {fn}; {fn}({args})"


@dataclass(frozen=True, slots=True)
class EventSizes:
    """How much: batches per end-to-end run, publish calls timed, replay size and count."""

    batches: int
    latency_calls: int
    replay_batches: int
    replays: int


FULL = EventSizes(batches=50_000, latency_calls=20_000, replay_batches=10_000, replays=15)
QUICK = EventSizes(batches=2_000, latency_calls=2_000, replay_batches=1_000, replays=2)


@dataclass(frozen=True, slots=True)
class Row:
    """One line of the table."""

    what: str
    figure: str
    detail: str = ""


# -- helper processes ----------------------------------------------------------


@contextlib.contextmanager
def _helper(fn: str, args: str) -> Iterator[tuple[subprocess.Popen[str], dict[str, Any]]]:
    """Start a helper; yield it with the JSON line it prints first (its endpoint)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _HELPER.format(fn=fn, args=args)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"benchmark helper {fn} exited before reporting its endpoint")
        yield proc, json.loads(line)
    finally:
        if proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _result(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError("benchmark helper exited without a result")
    result = json.loads(line)
    assert isinstance(result, dict)
    return result


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def raw_sub_helper(expected: int, idle: float = 2.0) -> None:
    """Helper: a plain SUB bound on 127.0.0.1; counts messages until ``expected``
    arrived or nothing came for ``idle`` seconds after the first."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind("tcp://127.0.0.1:0")
    _emit({"endpoint": sub.getsockopt_string(zmq.LAST_ENDPOINT)})
    count, first, last = 0, 0.0, 0.0
    while count < expected:
        if not sub.poll(int(idle * 1000) if count else 30_000):
            break
        sub.recv_multipart()
        last = time.perf_counter()
        if count == 0:
            first = last
        count += 1
    _emit({"received": count, "seconds": last - first})
    sub.close(linger=0)


def tspd_sub_helper(expected: int, idle: float = 2.0) -> None:
    """Helper: the tspd subscriber (bound SUB); counts delivered batches and events."""
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    result: dict[str, Any] = {}

    async def consume() -> None:
        delivered = events = 0
        first = last = 0.0
        source = EventSource(endpoint, bind=True, name="bench")
        async with open_kv_subscriber([source]) as sub:
            _emit({"endpoint": endpoint})  # bound and subscribed: the publisher may start
            while delivered < expected:
                with trio.move_on_after(idle if delivered else 30.0) as scope:
                    items = await sub.receive_batch()
                if scope.cancelled_caught:
                    break
                for item in items:
                    if isinstance(item, ReceivedBatch):
                        last = time.perf_counter()
                        if delivered == 0:
                            first = last
                        delivered += 1
                        events += len(item.batch.events)
            stats = sub.statistics()["bench"]
        result.update(
            delivered=delivered,
            events=events,
            seconds=last - first,
            lost=stats.lost_batches,
        )

    trio.run(consume)
    _emit(result)


def replay_client_helper(endpoint: str, replays: int) -> None:
    """Helper: a plain DEALER asks for everything ``replays`` times; reports each run."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    _emit({"ready": True})
    runs: list[dict[str, Any]] = []
    for _ in range(replays):
        start = time.perf_counter()
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        count, ended = 0, False
        while dealer.poll(5000):
            _, seq, _payload = dealer.recv_multipart()
            if seq == b"\xff" * 8:
                ended = True
                break
            count += 1
        runs.append({"batches": count, "ended": ended, "seconds": time.perf_counter() - start})
    _emit({"runs": runs})
    dealer.close(linger=0)


# -- measurements ----------------------------------------------------------------


def _batches(events_per_batch: int, count: int) -> list[list[KVEvent]]:
    """Realistic batches, generated up front (hashing is not what is measured)."""
    synth = SyntheticCache(seed=events_per_batch, capacity=2048)
    distinct = [synth.batch(events_per_batch) for _ in range(min(count, 512))]
    return [distinct[i % len(distinct)] for i in range(count)]


def _percentiles(samples: Sequence[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return ordered[len(ordered) // 2], ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def _end_to_end(events_per_batch: int, count: int) -> tuple[Row, int]:
    batches = _batches(events_per_batch, count)
    payload_size = len(encode_batch(KVEventBatch(time.time(), tuple(batches[0]), 0)))
    with _helper("tspd_sub_helper", str(count)) as (proc, hello):
        config = KVEventsConfig(enable_kv_cache_events=True, endpoint=hello["endpoint"])

        async def produce() -> None:
            async with open_kv_publisher(config) as pub:
                await trio.sleep(0.5)  # the connection and subscription settle

                def engine_thread() -> None:
                    for batch in batches:
                        pub.publish(batch)

                await trio.to_thread.run_sync(engine_thread)
                # Stay open until the consumer has seen everything: closing would
                # cut what the PUB still holds.
                result.update(await trio.to_thread.run_sync(_result, proc))

        result: dict[str, Any] = {}
        trio.run(produce)
    seconds = result["seconds"] or float("nan")
    rate = result["delivered"] / seconds
    row = Row(
        f"end to end, {events_per_batch}-event batches ({payload_size} B)",
        f"{rate:,.0f} batches/s",
        f"{result['events'] / seconds:,.0f} events/s; delivered {result['delivered']:,} "
        f"of {count:,}, lost {result['lost']:,}",
    )
    return row, payload_size


def _raw_limit(events_per_batch: int, count: int) -> Row:
    batches = _batches(events_per_batch, count)
    payloads = [encode_batch(KVEventBatch(1.0, tuple(b), 0)) for b in batches[:512]]
    with _helper("raw_sub_helper", str(count)) as (proc, hello):
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, 0)
        pub.connect(hello["endpoint"])
        time.sleep(0.5)
        for i in range(count):
            pub.send_multipart([b"", i.to_bytes(8, "big"), payloads[i % len(payloads)]])
        result = _result(proc)
        pub.close(linger=0)
    seconds = result["seconds"] or float("nan")
    return Row(
        f"raw limit: plain PUB→SUB, {len(payloads[0])} B payloads",
        f"{result['received'] / seconds:,.0f} msg/s",
        f"received {result['received']:,} of {count:,}",
    )


def _publish_latency(calls: int, events_per_batch: int = 1) -> Row:
    batches = _batches(events_per_batch, calls)
    port = free_port()
    samples: list[float] = []

    async def run() -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        sink = ctx.socket(zmq.SUB)
        sink.setsockopt(zmq.LINGER, 0)
        sink.bind(f"tcp://127.0.0.1:{port}")
        config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{port}")
        try:
            async with open_kv_publisher(config) as pub:

                def engine_thread() -> None:
                    for batch in batches:
                        start = time.perf_counter()
                        pub.publish(batch)
                        samples.append(time.perf_counter() - start)
                        # A scheduler round is not back to back with the next.
                        time.sleep(0.00005)

                await trio.to_thread.run_sync(engine_thread)
        finally:
            sink.close(linger=0)

    trio.run(run)
    p50, p99 = _percentiles(samples)
    what = "publish() from an engine thread"
    if events_per_batch != 1:
        # Not containing the 1-event label, which scripts look for.
        what = f"publish() of {events_per_batch}-event batches, engine thread"
    return Row(
        what,
        f"p50 {p50 * 1e6:,.1f} µs",
        f"p99 {p99 * 1e6:,.1f} µs over {calls:,} calls (the caller's cost: encoding "
        "is the sender task's)",
    )


def _handoff(calls: int) -> list[Row]:
    """tspd's queue + run_sync_soon against trio.from_thread.run(channel.send)."""
    queue_samples: list[float] = []
    portal_samples: list[float] = []
    item = (b"x" * 100, 1)

    async def run() -> None:
        queue = BatchQueue[tuple[bytes, int]](100_000, trio.lowlevel.current_trio_token())
        send, receive = trio.open_memory_channel[tuple[bytes, int]](100_000)

        async def drain_queue() -> None:
            while await queue.get_batch(256):
                pass

        async def drain_channel() -> None:
            async for _ in receive:
                pass

        def via_queue() -> None:
            for _ in range(calls):
                start = time.perf_counter()
                queue.put(item, block=True)
                queue_samples.append(time.perf_counter() - start)

        def via_portal() -> None:
            for _ in range(calls):
                start = time.perf_counter()
                trio.from_thread.run(send.send, item)
                portal_samples.append(time.perf_counter() - start)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain_queue)
            nursery.start_soon(drain_channel)
            await trio.to_thread.run_sync(via_queue)
            await trio.to_thread.run_sync(via_portal)
            queue.close()
            await send.aclose()
        queue.stop()

    trio.run(run)
    rows = []
    for label, samples in (
        ("hand-off: bounded queue + run_sync_soon (tspd)", queue_samples),
        ("hand-off: trio.from_thread.run(channel.send)", portal_samples),
    ):
        p50, p99 = _percentiles(samples)
        rows.append(
            Row(
                label,
                f"p50 {p50 * 1e6:,.2f} µs",
                f"p99 {p99 * 1e6:,.2f} µs; {len(samples) / sum(samples):,.0f} calls/s",
            )
        )
    return rows


def _replay(batches_count: int, replays: int) -> Row:
    batches = _batches(1, batches_count)
    port = free_port()
    outcome: dict[str, Any] = {}

    async def run() -> None:
        config = KVEventsConfig(
            enable_kv_cache_events=True,
            endpoint=f"tcp://127.0.0.1:{port}",
            replay_endpoint="tcp://127.0.0.1:0",
            buffer_steps=batches_count,
        )
        async with open_kv_publisher(config) as pub:
            for batch in batches:
                await pub.apublish(batch)
            await pub.wait_published(batches_count)
            assert pub.replay_endpoint is not None
            args = f"{pub.replay_endpoint!r}, {replays}"

            def client() -> None:
                with _helper("replay_client_helper", args) as (proc, _hello):
                    outcome.update(_result(proc))

            await trio.to_thread.run_sync(client)

    trio.run(run)
    runs = outcome["runs"]
    complete = sum(1 for r in runs if r["ended"] and r["batches"] == batches_count)
    median_ms = statistics.median(r["seconds"] for r in runs) * 1000
    return Row(
        f"replay of {batches_count:,} batches to a DEALER",
        f"{median_ms:,.0f} ms median",
        f"{complete} of {len(runs)} replays complete with the end marker",
    )


def run_event_benchmarks(sizes: EventSizes) -> list[Row]:
    """Every row of the table, measured now."""
    rows: list[Row] = []
    for events_per_batch in (1, 16):
        row, _size = _end_to_end(events_per_batch, sizes.batches)
        rows.append(row)
        rows.append(_raw_limit(events_per_batch, sizes.batches))
    rows.append(_publish_latency(sizes.latency_calls))
    rows.append(_publish_latency(sizes.latency_calls, 16))
    rows.extend(_handoff(sizes.latency_calls))
    rows.append(_replay(sizes.replay_batches, sizes.replays))
    return rows


def render(rows: list[Row]) -> Table:
    """The rich table of ``rows``."""
    table = Table(title="tspd bench events")
    table.add_column("measurement", no_wrap=True)
    table.add_column("figure", justify="right", no_wrap=True)
    table.add_column("detail")
    for row in rows:
        table.add_row(row.what, row.figure, row.detail)
    return table


@click.command()
@click.option("--quick", is_flag=True, help="Small runs (a smoke run).")
def events(quick: bool) -> None:
    """KV events: end to end and raw limit, publish cost, hand-off, replay."""
    rows = run_event_benchmarks(QUICK if quick else FULL)
    Console().print(render(rows))
