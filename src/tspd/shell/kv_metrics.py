"""Prometheus metrics for the KV-event path: drops and gaps made visible.

TokenSpeed's publisher records no metrics (spec §10), so a lost batch is invisible
on both ends. :class:`KVEventMetrics` is a Prometheus collector that reads the
counters publishers and subscribers already keep (``statistics()``) at scrape
time -- nothing on the event path pays for it. Names follow the engine's other
metrics (prefix ``tokenspeed:``, labels ``model_name``, ``app_key``, and
``dp_rank`` or ``source``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import final

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tspd.shell.kv_publisher import EventPublisher
from tspd.shell.kv_subscriber import KVEventSubscriber

__all__ = ["KVEventMetrics"]

_PUBLISHER_COUNTERS = (
    ("batches_published", "KV event batches sent on the PUB socket"),
    ("events_published", "KV events sent on the PUB socket"),
    ("batches_dropped", "KV event batches dropped (queue full, or publisher closed)"),
    ("send_failures", "KV event batches whose PUB send failed (still replayable)"),
    ("replay_requests_served", "KV event replay requests answered with an end marker"),
    ("replay_requests_invalid", "malformed KV event replay requests ignored"),
    ("replay_batches_sent", "KV event batches resent by replays"),
    ("replays_cut_short", "KV event replays cut short by a client that stopped reading"),
)
_PUBLISHER_GAUGES = (
    ("queue_depth", "KV event batches waiting for the publisher's socket task"),
    ("buffered", "KV event batches held for replay"),
)
_SUBSCRIBER_COUNTERS = (
    ("delivered", "KV event batches delivered in order"),
    ("replayed", "KV event batches delivered from a replay"),
    ("duplicates", "duplicate KV event batches dropped"),
    ("gaps", "KV event sequence gaps detected"),
    ("replays_requested", "KV event replays requested"),
    ("lost_batches", "KV event batches lost for good (not replayable)"),
    ("restarts", "KV event publisher restarts detected"),
)


@final
class KVEventMetrics(Collector):
    """Collects the counters of registered publishers and subscribers at scrape time.

    Register once (``REGISTRY.register(metrics)``), then :meth:`add_publisher` and
    :meth:`add_subscriber` as they start, and the matching ``remove_*`` when they end.
    """

    def __init__(self, *, model_name: str = "", app_key: str = "") -> None:
        self._base = (model_name, app_key)
        self._publishers: dict[int, EventPublisher] = {}
        self._subscribers: list[KVEventSubscriber] = []

    def add_publisher(self, publisher: EventPublisher, dp_rank: int) -> None:
        """Report ``publisher`` under ``dp_rank`` (replacing an earlier one of that rank)."""
        self._publishers[dp_rank] = publisher

    def remove_publisher(self, dp_rank: int) -> None:
        """Stop reporting the publisher of ``dp_rank``."""
        self._publishers.pop(dp_rank, None)

    def add_subscriber(self, subscriber: KVEventSubscriber) -> None:
        """Report every source of ``subscriber``."""
        self._subscribers.append(subscriber)

    def remove_subscriber(self, subscriber: KVEventSubscriber) -> None:
        """Stop reporting ``subscriber``."""
        self._subscribers = [s for s in self._subscribers if s is not subscriber]

    def describe(self) -> Iterator[Metric]:
        """No fixed description: the metric set depends on what is registered."""
        return iter(())

    def collect(self) -> Iterator[Metric]:
        """Prometheus scrape: one family per counter, one sample per rank or source."""
        labels = ["model_name", "app_key", "dp_rank"]
        stats = {rank: p.statistics() for rank, p in sorted(self._publishers.items())}
        for name, doc in _PUBLISHER_COUNTERS:
            family = CounterMetricFamily(f"tokenspeed:kv_events_{name}", doc, labels=labels)
            for rank, s in stats.items():
                family.add_metric([*self._base, str(rank)], getattr(s, name))
            yield family
        for name, doc in _PUBLISHER_GAUGES:
            gauge = GaugeMetricFamily(f"tokenspeed:kv_events_{name}", doc, labels=labels)
            for rank, s in stats.items():
                gauge.add_metric([*self._base, str(rank)], getattr(s, name))
            yield gauge
        sources = {
            label: tracker
            for subscriber in self._subscribers
            for label, tracker in subscriber.statistics().items()
        }
        sub_labels = ["model_name", "app_key", "source"]
        for name, doc in _SUBSCRIBER_COUNTERS:
            family = CounterMetricFamily(
                f"tokenspeed:kv_events_subscriber_{name}", doc, labels=sub_labels
            )
            for label, tracker in sources.items():
                family.add_metric([*self._base, label], getattr(tracker, name))
            yield family
