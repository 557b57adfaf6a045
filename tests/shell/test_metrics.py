"""Metrics: a CorePair driven through success, failure and timeout paths, observed as a
shell would, then scraped over real HTTP on 127.0.0.1."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from tspd.core.commands import StartTransfer
from tspd.core.errors import ConfigError
from tspd.core.seqtrack import TrackerStats
from tspd.core.trace import Side
from tspd.shell.kv_publisher import PublisherStats
from tspd.shell.kv_subscriber import BatchesLost, ReceivedBatch
from tspd.shell.metrics import PeerMetrics, TokenSpeedLabels, TspdMetrics, open_metrics_server
from tspd.testing.core_pair import CorePair
from tspd.testing.layouts import simple_contract

CONTRACT = simple_contract(num_pages=16, page_bytes=64)
PROMPT = 40

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _samples(text: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


async def _scrape(url: str, accept: str | None = None) -> httpx.Response:
    headers = {"Accept": accept} if accept else {}
    async with httpx.AsyncClient() as client:
        return await client.get(url, headers=headers)


@pytest.fixture
def pair() -> Iterator[CorePair]:
    p = CorePair([CONTRACT], [CONTRACT])
    yield p
    p.close()


def _observe(pair: CorePair, prefill: PeerMetrics, decode: PeerMetrics) -> None:
    """What the shells do after each drain: commands, then finished rooms. CorePair
    already executed the commands, so its records stand in for the drained ones."""
    for side, _, command in pair.failures:
        (prefill if side == "prefill" else decode).observe_command(command)
    for _, chunk in pair.transfers:
        prefill.observe_command(chunk)
    pair.failures.clear()
    pair.transfers.clear()
    prefill.observe_finished_all(pair.prefill[0].drain_finished())
    decode.observe_finished_all(pair.decode[0].drain_finished())


def _drive(pair: CorePair, prefill: PeerMetrics, decode: PeerMetrics) -> None:
    """Two successes, a failed write, a bootstrap timeout and a waiting timeout."""
    for room in (1, 2):
        pair.register_decode(f"ok{room}", room)
        pair.register_prefill(f"ok{room}", room)
        for event in pair.poll_decode():
            decode.observe_event(event)
        pair.now += 0.5
        pair.preallocate(room, PROMPT)
        for event in pair.poll_prefill():
            prefill.observe_event(event)
        pair.now += 0.25
        pair.hand_over(room, PROMPT)
        for event in pair.poll_prefill():
            prefill.observe_event(event)
        for event in pair.poll_decode():
            decode.observe_event(event)
    _observe(pair, prefill, decode)

    pair.write_errors[CorePair.decode_session(0)] = "connection reset"
    pair.register_decode("bad", 3)
    pair.register_prefill("bad", 3)
    pair.poll_decode()
    pair.preallocate(3, PROMPT)
    pair.poll_prefill()
    pair.hand_over(3, PROMPT)
    pair.poll_prefill()
    pair.poll_decode()
    del pair.write_errors[CorePair.decode_session(0)]
    pair.advance(30.0)  # the failed session's TTL passes
    _observe(pair, prefill, decode)

    pair.register_prefill("slow", 4)  # Decode never pre-allocates: bootstrap timeout
    pair.now += 120.0
    pair.poll_prefill()
    pair.register_decode("late", 5)  # pre-allocated, but Prefill never sends: waiting timeout
    pair.poll_decode()
    pair.preallocate(5, PROMPT)
    pair.advance(300.0)
    pair.poll_decode()
    pair.advance(120.0)  # room 5 was never claimed on Prefill: dropped
    _observe(pair, prefill, decode)


async def test_scraped_metrics_after_success_failure_and_timeouts(pair: CorePair) -> None:
    metrics = TspdMetrics()
    prefill = metrics.peer("prefill", 0)
    decode = metrics.peer(Side.DECODE, 0)
    prefill.watch(
        rooms_by_state=pair.prefill[0].rooms_by_state,
        statistics=lambda: {
            **pair.prefill[0].statistics(),
            "bytes_written": pair.bytes_written,
            "descriptors": 2,
            "engine_calls": 2,
            "messages_sent": 9,
            "messages_dropped": 1,
            "chunks_in_flight": 0,
        },
    )
    decode.watch(rooms_by_state=pair.decode[0].rooms_by_state, statistics=pair.decode[0].statistics)
    _drive(pair, prefill, decode)
    # One live room at scrape time, so the state gauge has something to show.
    pair.register_decode("live", 6)

    async with open_metrics_server(metrics) as server:
        assert server.host == "127.0.0.1"
        assert server.port > 0
        response = await _scrape(server.url)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    s = _samples(response.text)
    p = {"side": "prefill", "rank": "0"}
    d = {"side": "decode", "rank": "0"}

    assert _value(s, "tspd_rooms_finished_total", **p, outcome="success") == 2
    assert _value(s, "tspd_rooms_finished_total", **p, outcome="failed") == 2
    assert _value(s, "tspd_rooms_finished_total", **p, outcome="dropped") == 1
    assert _value(s, "tspd_rooms_finished_total", **d, outcome="success") == 2
    assert _value(s, "tspd_rooms_finished_total", **d, outcome="failed") == 2
    assert _value(s, "tspd_room_failures_total", **p, reason_class="transfer") == 1
    assert _value(s, "tspd_room_failures_total", **p, reason_class="timeout-bootstrapping") == 1
    assert _value(s, "tspd_room_failures_total", **d, reason_class="peer-failed") == 1
    assert _value(s, "tspd_room_failures_total", **d, reason_class="timeout-waiting") == 1
    assert _value(s, "tspd_room_timeouts_total", **p, phase="bootstrapping") == 1
    assert _value(s, "tspd_room_timeouts_total", **d, phase="waiting_for_input") == 1
    # Phase histograms: both successful Prefill rooms waited 0.5 s for Decode.
    assert _value(s, "tspd_room_phase_seconds_count", **p, phase="bootstrapping") >= 2
    assert _value(s, "tspd_room_phase_seconds_bucket", **p, phase="waiting_for_input", le="0.25")
    assert _value(s, "tspd_room_phase_seconds_count", **d, phase="waiting_for_preallocation") >= 2
    assert _value(s, "tspd_room_phase_seconds_count", **d, phase="transfer") == 2
    assert _value(s, "tspd_room_phase_seconds_sum", **d, phase="transfer") == pytest.approx(0.5)
    assert _value(s, "tspd_room_duration_seconds_count", **p, outcome="success") == 2
    assert _value(s, "tspd_kv_transfer_latency_seconds_count", **p) == 2
    assert _value(s, "tspd_transfer_chunks_total", **p) == 3
    assert _value(s, "tspd_scheduler_events_total", **p, event="succeeded") == 2
    assert _value(s, "tspd_scheduler_events_total", **d, event="remote_prefill_done") == 2
    # Scrape-time reads: room states, table sizes, transfer and message counters.
    assert _value(s, "tspd_rooms", **d, state="Bootstrapped") == 1
    assert _value(s, "tspd_rooms", **p, state="Failed") == 0
    assert _value(s, "tspd_room_table_entries", **d, table="traces") == 1
    assert _value(s, "tspd_room_table_entries", **p, table="traces") == 0
    assert _value(s, "tspd_transfer_bytes_total", **p) == pair.bytes_written == 2 * 3 * 64
    assert _value(s, "tspd_transfer_descriptors_total", **p) == 2
    assert _value(s, "tspd_control_messages_total", **p, result="dropped") == 1
    assert _value(s, "tspd_transfer_chunks_in_flight", **p) == 0
    assert all(name.startswith("tspd_") for name, _ in s)


async def test_traces_are_served_as_json(pair: CorePair) -> None:
    metrics = TspdMetrics()
    for side, cores in (("prefill", pair.prefill), ("decode", pair.decode)):
        view = metrics.peer(side, 0)
        view.watch(trace=cores[0].trace, recent_traces=cores[0].recent_traces)
    pair.write_errors[CorePair.decode_session(0)] = "connection reset"
    pair.register_decode("bad", 7)
    pair.register_prefill("bad", 7)
    pair.poll_decode()
    pair.preallocate(7, PROMPT)
    pair.poll_prefill()
    pair.hand_over(7, PROMPT)
    pair.poll_prefill()
    pair.poll_decode()
    async with open_metrics_server(metrics) as server:
        base = f"http://{server.address}"
        one = await _scrape(f"{base}/traces/7")
        every = await _scrape(f"{base}/traces")
        missing = await _scrape(f"{base}/traces/8")
        bad = await _scrape(f"{base}/traces/x")
    assert one.status_code == 200
    by_side = {t["side"]: t for t in one.json()}
    assert by_side["prefill"]["reason_class"] == "transfer"
    assert by_side["prefill"]["outcome"] == "failed"
    assert by_side["decode"]["reason_class"] == "peer-failed"
    assert ["registered", 0.0] in by_side["decode"]["marks"]
    assert [t["room"] for t in every.json()] == [7, 7]
    assert missing.status_code == 404
    assert "only failed or slow rooms are kept" in missing.text
    assert bad.status_code == 400


async def test_kv_publisher_and_subscriber_counters() -> None:
    metrics = TspdMetrics()
    stats = PublisherStats(
        batches_published=10,
        events_published=40,
        batches_dropped=2,
        send_failures=1,
        replay_requests_served=3,
        replay_requests_invalid=1,
        replay_batches_sent=7,
        replays_cut_short=0,
        queue_depth=4,
        buffered=5,
        next_seq=10,
    )
    tracker = TrackerStats(
        delivered=8,
        replayed=3,
        duplicates=1,
        gaps=2,
        replays_requested=2,
        lost_batches=4,
        restarts=1,
        pending=0,
        next_seq=12,
    )
    metrics.watch_publisher(lambda: stats, dp_rank=1)
    metrics.watch_subscriber(lambda: {"dp1": tracker})
    metrics.observe_subscriber_item(BatchesLost("dp1", 3, 7, "evicted"))
    metrics.observe_subscriber_item(ReceivedBatch("dp1", 7, None, False))  # type: ignore[arg-type]
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    s = _samples(body.decode())
    assert _value(s, "tspd_kv_events_published_total", dp_rank="1") == 40
    assert _value(s, "tspd_kv_batches_dropped_total", dp_rank="1") == 2
    assert _value(s, "tspd_kv_replay_requests_total", dp_rank="1", result="served") == 3
    assert _value(s, "tspd_kv_replayed_batches_total", dp_rank="1") == 7
    assert _value(s, "tspd_kv_publisher_queue_depth", dp_rank="1") == 4
    assert _value(s, "tspd_kv_subscriber_gaps_total", source="dp1") == 2
    assert _value(s, "tspd_kv_subscriber_lost_batches_total", source="dp1") == 4
    assert _value(s, "tspd_kv_subscriber_restarts_total", source="dp1") == 1
    assert _value(s, "tspd_kv_subscriber_replayed_total", source="dp1") == 3
    assert _value(s, "tspd_kv_subscriber_gaps_unhealed_total", source="dp1", reason="evicted") == 1


async def test_openmetrics_is_negotiated() -> None:
    metrics = TspdMetrics()
    metrics.peer("prefill", 3).observe_finished_all([])
    async with open_metrics_server(metrics) as server:
        response = await _scrape(server.url, "application/openmetrics-text; version=1.0.0")
        index = await _scrape(f"http://{server.address}/")
    assert response.headers["content-type"].startswith("application/openmetrics-text")
    assert response.text.rstrip().endswith("# EOF")
    assert "/metrics" in index.text


def test_registries_are_separate_unless_asked(caplog: pytest.LogCaptureFixture) -> None:
    first, second = TspdMetrics(), TspdMetrics()
    assert first.registry is not second.registry
    first.peer("prefill", 0).observe_event(object())  # type: ignore[arg-type]
    shared = CollectorRegistry()
    TspdMetrics(shared)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        TspdMetrics(shared)
    with pytest.raises(ConfigError):
        TspdMetrics(shared, use_default=True)
    default = TspdMetrics(use_default=True)
    try:
        assert default.registry is REGISTRY
        default.peer("prefill", 0).observe_command(
            StartTransfer(room=1, shard=0, intervals=(), final=True, sessions=())
        )
        labels = {"side": "prefill", "rank": "0"}
        assert REGISTRY.get_sample_value("tspd_transfer_chunks_total", labels) == 1
    finally:
        default.unregister()
    TspdMetrics(use_default=True).unregister()  # a successor can register again

    # A source that fails to read is left out; the scrape still answers.
    broken = TspdMetrics()

    def boom() -> dict[str, int]:
        raise RuntimeError("dictionary changed size during iteration")

    broken.peer("decode", 1).watch(rooms_by_state=boom, statistics=boom)
    with caplog.at_level(logging.WARNING, logger="tspd.metrics"):
        body, _ = broken.render()
        broken.render()
    assert b"tspd_rooms{" not in body
    assert b"# TYPE tspd_rooms gauge" in body
    warned = [r.getMessage() for r in caplog.records]
    assert (
        warned.count("metrics: reading decode rank 1 rooms failed; its samples are left out") == 1
    )


async def test_a_port_in_use_is_a_config_error() -> None:
    metrics = TspdMetrics()
    async with open_metrics_server(metrics) as server:
        with pytest.raises(ConfigError, match=f"cannot bind 127.0.0.1:{server.port}"):
            async with open_metrics_server(metrics, port=server.port):
                pass  # pragma: no cover


def test_only_room_commands_count() -> None:
    metrics = TspdMetrics()
    view = metrics.peer("prefill", 0)
    view.observe_command(StartTransfer(room=1, shard=0, intervals=(), final=True, sessions=()))
    body = metrics.render()[0].decode()
    assert 'tspd_transfer_chunks_total{rank="0",side="prefill"} 1.0' in body
    assert "tspd_room_failures_total{" not in body


def test_tokenspeed_named_metrics_are_opt_in_and_prefill_only(pair: CorePair) -> None:
    plain = TspdMetrics()
    assert b"tokenspeed:" not in plain.render()[0]
    metrics = TspdMetrics(tokenspeed=TokenSpeedLabels("llama", app_key="k"))
    prefill = metrics.peer("prefill", 0, dp_rank=2)
    decode = metrics.peer("decode", 0)
    _drive(pair, prefill, decode)
    for _ in range(3):  # what the transfer workers report per destination write
        prefill.observe_write(0.001)
    decode.observe_write(0.001)  # a Decode rank never writes; nothing TokenSpeed-named
    ts = {"model_name": "llama", "app_key": "k", "dp_rank": "2"}
    get = metrics.registry.get_sample_value
    # Two Prefill failures (a write, a bootstrap timeout); Decode's are not counted.
    assert get("tokenspeed:kv_transfer_failures_total", ts) == 2
    assert get("tokenspeed:kv_transfer_timeouts_total", {**ts, "stage": "bootstrapping"}) == 1
    assert get("tokenspeed:kv_transfer_latency_seconds_count", ts) == 3
    assert get("tspd_transfer_write_seconds_count", {"side": "prefill", "rank": "0"}) == 3
    assert get("tokenspeed:kv_transfer_failures_total", {**ts, "dp_rank": "0"}) is None
    metrics.unregister()
    assert list(metrics.registry.collect()) == []


async def test_scrapes_read_peers_in_the_trio_thread_and_encode_elsewhere() -> None:
    metrics = TspdMetrics()
    readers: list[int] = []

    def rooms() -> dict[str, int]:
        readers.append(threading.get_ident())
        return {"Bootstrapping": 2}

    metrics.peer("decode", 0).watch(rooms_by_state=rooms)
    async with open_metrics_server(metrics) as server:
        first = await _scrape(server.url)
        second = await _scrape(server.url)
    assert readers == [threading.get_ident()] * 2
    for response in (first, second):
        s = _samples(response.text)
        assert _value(s, "tspd_rooms", side="decode", rank="0", state="Bootstrapping") == 2
    # Outside a scrape, render() reads the sources itself, as before.
    assert b'state="Bootstrapping"} 2.0' in metrics.render()[0]
    assert len(readers) == 3


def test_a_closed_peer_is_no_longer_read() -> None:
    metrics = TspdMetrics()
    reads: list[str] = []

    def rooms(name: str) -> dict[str, int]:
        reads.append(name)
        return {"Bootstrapping": 1}

    first = metrics.peer("prefill", 0)
    first.watch(rooms_by_state=lambda: rooms("first"))
    second = metrics.peer("prefill", 1)
    second.watch(rooms_by_state=lambda: rooms("second"))
    first.watch(rooms_by_state=lambda: rooms("again"))  # replaces the first watch
    first.observe_command(StartTransfer(room=1, shard=0, intervals=(), final=True, sessions=()))
    metrics.render()
    assert sorted(reads) == ["again", "second"]
    assert metrics.peers == (first, second)
    first.close()
    reads.clear()
    s = _samples(metrics.render()[0].decode())
    assert reads == ["second"]
    assert metrics.peers == (second,)
    assert first.trace(1) is None
    assert (
        "tspd_rooms",
        frozenset({("side", "prefill"), ("rank", "0"), ("state", "Bootstrapping")}),
    ) not in s
    assert _value(s, "tspd_transfer_chunks_total", side="prefill", rank="0") == 1
