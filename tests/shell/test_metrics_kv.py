"""KV-event metrics from a real publisher and subscriber: a gap healed by replay, then
one that cannot be (no replay socket), scraped over HTTP on 127.0.0.1."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from tspd.core.kv_config import KVEventsConfig
from tspd.core.kv_events import BlockRemoved, BlockStored, KVEvent
from tspd.shell.kv_publisher import KVEventPublisher, open_kv_publisher
from tspd.shell.kv_subscriber import (
    BatchesLost,
    EventSource,
    KVEventSubscriber,
    ReceivedBatch,
    SubscriberItem,
    open_kv_subscriber,
)
from tspd.shell.metrics import TspdMetrics, open_metrics_server

EVENTS: list[KVEvent] = [BlockStored((5,), None, (1, 2), 2), BlockRemoved((5,))]


@pytest.fixture
def ipc_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="tspd-metrics-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _config(endpoint: str, replay: str | None = None) -> KVEventsConfig:
    return KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint, replay_endpoint=replay)


async def _until(
    pub: KVEventPublisher,
    sub: KVEventSubscriber,
    metrics: TspdMetrics,
    done: type[SubscriberItem],
    *,
    replayed: bool = False,
) -> None:
    """Publish until an item of type ``done`` (a replayed batch when ``replayed``)
    arrives, counting every item in ``metrics`` as a consumer would."""
    with trio.fail_after(10):
        while True:
            await pub.apublish(EVENTS)
            with trio.move_on_after(0.05):
                while True:
                    item = await sub.receive()
                    metrics.observe_subscriber_item(item)
                    if isinstance(item, done) and (
                        not replayed or (isinstance(item, ReceivedBatch) and item.replayed)
                    ):
                        return


async def _gap(pub: KVEventPublisher, sub: KVEventSubscriber, source: str) -> None:
    sub.disconnect(source)
    await trio.sleep(0.1)
    for _ in range(10):  # published while nobody listens
        await pub.apublish(EVENTS)
    sub.connect(source)


async def test_kv_counters_reach_the_endpoint(ipc_dir: str) -> None:
    metrics = TspdMetrics()
    healing = _config(f"ipc://{ipc_dir}/a", "tcp://127.0.0.1:0")
    async with (
        open_kv_publisher(healing, dp_rank=0) as pub,
        open_kv_publisher(_config(f"ipc://{ipc_dir}/b")) as bare,
    ):
        assert pub.replay_endpoint is not None
        sources = [
            EventSource(pub.endpoint, pub.replay_endpoint, name="dp0"),
            EventSource(bare.endpoint, name="dp1"),
        ]
        async with open_kv_subscriber(sources) as sub:
            metrics.watch_publisher(pub.statistics, dp_rank=0)
            metrics.watch_publisher(bare.statistics, dp_rank=1)
            metrics.watch_subscriber(sub.statistics)
            await _until(pub, sub, metrics, ReceivedBatch)
            await _until(bare, sub, metrics, ReceivedBatch)
            await _gap(pub, sub, "dp0")
            await _until(pub, sub, metrics, ReceivedBatch, replayed=True)
            await _gap(bare, sub, "dp1")
            await _until(bare, sub, metrics, BatchesLost)
            published = pub.statistics().events_published
            stats = sub.statistics()
            async with open_metrics_server(metrics) as server, httpx.AsyncClient() as client:
                text = (await client.get(server.url)).text

    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    assert value("tspd_kv_events_published_total", dp_rank="0") == published
    assert value("tspd_kv_replay_requests_total", dp_rank="0", result="served") >= 1
    assert value("tspd_kv_replayed_batches_total", dp_rank="0") >= 10
    assert value("tspd_kv_batches_dropped_total", dp_rank="1") == 0
    assert value("tspd_kv_subscriber_gaps_total", source="dp0") == stats["dp0"].gaps >= 1
    assert value("tspd_kv_subscriber_replayed_total", source="dp0") >= 10
    assert value("tspd_kv_subscriber_lost_batches_total", source="dp0") == 0
    assert value("tspd_kv_subscriber_gaps_total", source="dp1") >= 1
    assert value("tspd_kv_subscriber_lost_batches_total", source="dp1") >= 10
    assert (
        value("tspd_kv_subscriber_gaps_unhealed_total", source="dp1", reason="no_replay_endpoint")
        >= 1
    )
    assert (
        "tspd_kv_subscriber_gaps_unhealed_total",
        (("reason", "evicted"), ("source", "dp0")),
    ) not in samples
    assert value("tspd_kv_subscriber_restarts_total", source="dp1") == 0
