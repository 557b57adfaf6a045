"""KV-event counters reach Prometheus at scrape time."""

from __future__ import annotations

import shutil
import tempfile

import trio
from prometheus_client import CollectorRegistry, generate_latest

from tspd.core.kv_config import KVEventsConfig
from tspd.core.kv_events import BlockRemoved
from tspd.shell.kv_metrics import KVEventMetrics
from tspd.shell.kv_publisher import open_kv_publisher
from tspd.shell.kv_subscriber import EventSource, ReceivedBatch, open_kv_subscriber


async def test_publisher_and_subscriber_counters_are_scraped() -> None:
    path = tempfile.mkdtemp(prefix="tspd-met-")
    registry = CollectorRegistry()
    metrics = KVEventMetrics(model_name="m", app_key="a")
    registry.register(metrics)
    config = KVEventsConfig(
        enable_kv_cache_events=True, endpoint=f"ipc://{path}/p", max_queue_size=1
    )
    try:
        async with (
            open_kv_publisher(config, dp_rank=0) as pub,
            open_kv_subscriber([EventSource(pub.endpoint, name="r0")]) as sub,
        ):
            metrics.add_publisher(pub, 0)
            metrics.add_subscriber(sub)
            delivered = 0
            with trio.fail_after(10):
                while delivered == 0:
                    await pub.apublish([BlockRemoved((1,))])
                    with trio.move_on_after(0.05):
                        items = await sub.receive_batch()
                        delivered += sum(isinstance(i, ReceivedBatch) for i in items)
            assert pub.publish_nowait([BlockRemoved((2,))])
            assert not pub.publish_nowait([BlockRemoved((3,))])  # queue of one: dropped
            text = generate_latest(registry).decode()
            published = pub.statistics().batches_published
    finally:
        shutil.rmtree(path, ignore_errors=True)
    labels = 'app_key="a",dp_rank="0",model_name="m"'
    assert f"tokenspeed:kv_events_batches_published_total{{{labels}}} {published:.1f}" in text
    assert f"tokenspeed:kv_events_batches_dropped_total{{{labels}}} 1.0" in text
    assert f"tokenspeed:kv_events_queue_depth{{{labels}}} 1.0" in text
    assert (
        'tokenspeed:kv_events_subscriber_delivered_total{app_key="a",model_name="m",source="r0"}'
        in text
    )
    metrics.remove_publisher(0)
    metrics.remove_subscriber(sub)
    assert "dp_rank=" not in generate_latest(registry).decode()
