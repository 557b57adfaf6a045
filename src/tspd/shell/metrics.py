"""Prometheus metrics for tspd peers and KV-event streams, and an HTTP endpoint on Trio.

Every metric is named ``tspd_…``. A :class:`TspdMetrics` owns one
``CollectorRegistry`` — a fresh one by default, so tests and several peers in
one process never collide; ``use_default=True`` registers into
``prometheus_client``'s global registry instead (once per process). Several peers
may share one :class:`TspdMetrics` (one endpoint for the process): each gets a
:class:`PeerMetrics` view labelled with its ``side`` and ``rank``.

Two ways in:

* **Observed as they happen** — the peer's shell passes what it drains from its
  core: ``observe_command(command)`` for every command (room failures by reason
  class, timeouts by phase, transfer chunks), ``observe_event(event)`` for every
  scheduler event, ``observe_finished(trace)`` for every room trace from the
  core's ``drain_finished()`` (rooms by outcome, room and phase durations,
  transfer latency).
* **Read at scrape time** — :meth:`PeerMetrics.watch` registers callables (the
  core's ``rooms_by_state`` and the peer's ``statistics``) that a collector reads
  when Prometheus scrapes: rooms by state, table sizes, bytes, descriptors and
  engine calls written, control messages; :meth:`TspdMetrics.watch_publisher` and
  :meth:`TspdMetrics.watch_subscriber` do the same for KV-event publishers' and
  subscribers' counters, :meth:`TspdMetrics.watch_bootstrap` for the requests a
  bootstrap server refused. Nothing is counted twice and nothing costs a hot-path
  call. Scrapes run in the peer's Trio thread when served by :func:`serve_metrics`.

============================================ ========= ==================================
metric                                       kind      labels
============================================ ========= ==================================
``tspd_rooms``                               gauge     side, rank, state
``tspd_room_table_entries``                  gauge     side, rank, table
``tspd_rooms_finished_total``                counter   side, rank, outcome
``tspd_room_failures_total``                 counter   side, rank, reason_class
``tspd_room_timeouts_total``                 counter   side, rank, phase
``tspd_rejected_messages_total``             counter   side, rank, reason
``tspd_room_duration_seconds``               histogram side, rank, outcome
``tspd_room_phase_seconds``                  histogram side, rank, phase
``tspd_kv_transfer_latency_seconds``         histogram side, rank
``tspd_transfer_write_seconds``              histogram side, rank
``tspd_transfer_chunks_total``               counter   side, rank
``tspd_transfer_chunks_in_flight``           gauge     side, rank
``tspd_transfer_bytes_total``                counter   side, rank
``tspd_transfer_descriptors_total``          counter   side, rank
``tspd_transfer_engine_calls_total``         counter   side, rank
``tspd_control_messages_total``              counter   side, rank, result (sent, dropped)
``tspd_heartbeats_total``                    counter   side, rank
``tspd_scheduler_events_total``              counter   side, rank, event
``tspd_kv_batches_published_total``          counter   dp_rank
``tspd_kv_events_published_total``           counter   dp_rank
``tspd_kv_batches_dropped_total``            counter   dp_rank
``tspd_kv_send_failures_total``              counter   dp_rank
``tspd_kv_replay_requests_total``            counter   dp_rank, result (served, invalid)
``tspd_kv_replayed_batches_total``           counter   dp_rank
``tspd_kv_replays_cut_short_total``          counter   dp_rank
``tspd_kv_publisher_queue_depth``            gauge     dp_rank
``tspd_kv_publisher_buffered_batches``       gauge     dp_rank
``tspd_kv_subscriber_batches_total``         counter   source
``tspd_kv_subscriber_replayed_total``        counter   source
``tspd_kv_subscriber_duplicates_total``      counter   source
``tspd_kv_subscriber_gaps_total``            counter   source
``tspd_kv_subscriber_gaps_unhealed_total``   counter   source, reason
``tspd_kv_subscriber_lost_batches_total``    counter   source
``tspd_kv_subscriber_replay_requests_total`` counter   source
``tspd_kv_subscriber_restarts_total``        counter   source
``tspd_kv_subscriber_pending_batches``       gauge     source
``tspd_bootstrap_rejected_requests_total``   counter   reason
============================================ ========= ==================================

``tspd_rejected_messages_total`` counts the control and status messages a peer
refused, by :class:`tspd.core.commands.RejectReason` (``malformed-header``,
``registration-refused``, ``preallocation-refused``, ``malformed-status``, and in
secure mode ``wrong-identity``: docs/security.md...);
the log lines about them are rate-limited per peer and reason
(:class:`tspd.log.LogLimits`).

``tspd_bootstrap_rejected_requests_total`` counts the requests and connections a
bootstrap server refused, by reason (``tspd.core.bootstrap.REFUSAL_REASONS``:
``bad_field``, ``conflict``, ``connection_limit``, ``request_timeout``, and for a
secure server ``unauthorized``, ``identity_conflict``, ``tls_required``...).

``tspd_kv_transfer_latency_seconds`` is a successful Prefill room's transfer
phase: from its first chunk going to the workers to its final write (the latency of
docs/protocol.md#proto-metrics, per room, queueing on the workers included).
``tspd_transfer_write_seconds`` is one write to one destination session, every
engine call of it (the transport's share; R-pd observes each ``write_copies``).
Its ``_sum`` divided into ``tspd_transfer_bytes_total`` is the achieved rate.

TokenSpeed's own three KV-transfer metrics have no fixed names in any source
(docs/protocol.md#proto-metrics); with ``tokenspeed=TokenSpeedLabels(model_name,
app_key)`` the Prefill peers also export them under these ``tokenspeed:`` names,
labelled ``model_name``, ``app_key``, ``dp_rank``, for dashboards built on them:
``tokenspeed:kv_transfer_failures_total`` (once per failed room),
``tokenspeed:kv_transfer_timeouts_total{stage}`` (``bootstrapping``) and
``tokenspeed:kv_transfer_latency_seconds`` (per successful destination write, as
R-pd observes it).

Gaps healed by replay are ``tspd_kv_subscriber_gaps_total`` less
``tspd_kv_subscriber_gaps_unhealed_total`` (each loss report counts as one
unhealed gap; a gap cut into several losses counts more than once).
"""

from __future__ import annotations

import contextvars
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Final, NoReturn, final

import trio
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from tspd.core.commands import (
    Bootstrapped,
    Command,
    Event,
    Failed,
    Rejected,
    RemotePrefillDone,
    RoomFailed,
    StartTransfer,
    Succeeded,
)
from tspd.core.errors import ConfigError
from tspd.core.machines import RoomState
from tspd.core.seqtrack import TrackerStats
from tspd.core.trace import Outcome, RoomTrace, Side
from tspd.shell.http import bind_tcp, serve_asgi
from tspd.shell.kv_publisher import PublisherStats
from tspd.shell.kv_subscriber import BatchesLost, SubscriberItem
from tspd.shell.nursery import single_error

__all__ = [
    "LATENCY_BUCKETS",
    "PHASE_BUCKETS",
    "MetricsServer",
    "PeerMetrics",
    "TokenSpeedLabels",
    "TspdMetrics",
    "metrics_app",
    "open_metrics_server",
    "serve_metrics",
]

log = logging.getLogger("tspd.metrics")

#: Room and phase durations: from sub-millisecond notifications to the 300 s
#: waiting timeout.
PHASE_BUCKETS: Final = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)
#: Transfer latency: a small loopback write is ~50 µs, a 64 MiB one ~35 ms, a hung
#: peer fails after ``MC_TRANSFER_TIMEOUT`` (30 s).
LATENCY_BUCKETS: Final = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)

_PEER: Final = ("side", "rank")
_ROOM_STATES: Final = tuple(s.value for s in RoomState if s is not RoomState.ABSENT)
_EVENT_NAMES: Final[Mapping[type, str]] = {
    Bootstrapped: "bootstrapped",
    Succeeded: "succeeded",
    Failed: "failed",
    RemotePrefillDone: "remote_prefill_done",
}

# Peer statistics keys read as counters or gauges; every other key is a table size.
_COUNTER_KEYS: Final[Mapping[str, str]] = {
    "bytes_written": "tspd_transfer_bytes",
    "descriptors": "tspd_transfer_descriptors",
    "engine_calls": "tspd_transfer_engine_calls",
    "heartbeats": "tspd_heartbeats",
}
_MESSAGE_KEYS: Final[Mapping[str, str]] = {
    "messages_sent": "sent",
    "messages_dropped": "dropped",
}
_GAUGE_KEYS: Final[Mapping[str, str]] = {"chunks_in_flight": "tspd_transfer_chunks_in_flight"}


#: Set (in a copied context) while a worker thread encodes a scrape: the scrape-time
#: samples, already read in the Trio thread, for :class:`_ScrapeCollector` to yield.
_FROZEN: contextvars.ContextVar[list[Metric] | None] = contextvars.ContextVar(
    "tspd_metrics_frozen", default=None
)


@dataclass(frozen=True, slots=True)
class TokenSpeedLabels:
    """The labels TokenSpeed's engine metrics carry besides ``dp_rank``."""

    model_name: str
    app_key: str = ""


@dataclass(frozen=True, slots=True)
class _PeerSource:
    side: str
    rank: str
    rooms_by_state: Callable[[], Mapping[str, int]] | None
    statistics: Callable[[], Mapping[str, int]] | None


@dataclass(frozen=True, slots=True)
class _PublisherSource:
    dp_rank: str
    statistics: Callable[[], PublisherStats]


@final
class _ScrapeCollector:
    """Reads every watched source when the registry is collected."""

    def __init__(self) -> None:
        self.peers: list[_PeerSource] = []
        self.publishers: list[_PublisherSource] = []
        self.subscribers: list[Callable[[], Mapping[str, TrackerStats]]] = []
        self.bootstraps: list[Callable[[], Mapping[str, int]]] = []
        #: Sources whose last read failed (warned once until a read succeeds).
        self._failing: set[str] = set()

    def describe(self) -> Iterable[Metric]:
        """Nothing up front: the names are checked when the first scrape builds them."""
        return []

    def collect(self) -> Iterator[Metric]:
        frozen = _FROZEN.get()
        if frozen is not None:
            yield from frozen
            return
        yield from self._peer_metrics()
        yield from self._publisher_metrics()
        yield from self._subscriber_metrics()
        yield from self._bootstrap_metrics()

    def _read(self, what: str, read: Callable[[], Any]) -> Any:
        """One source's values, or ``None`` when reading fails: a scrape never fails
        because one source did. The first failure in a row is a warning, the rest
        debug lines, so a broken source does not log on every scrape."""
        try:
            values = read()
        except Exception:
            level = logging.DEBUG if what in self._failing else logging.WARNING
            self._failing.add(what)
            log.log(
                level, "metrics: reading %s failed; its samples are left out", what, exc_info=True
            )
            return None
        self._failing.discard(what)
        return values

    def _peer_metrics(self) -> Iterator[Metric]:
        rooms = GaugeMetricFamily(
            "tspd_rooms", "Rooms in each state on this rank.", labels=[*_PEER, "state"]
        )
        tables = GaugeMetricFamily(
            "tspd_room_table_entries",
            "Entries in each of the core's tables (every per-room table empties when "
            "its rooms end).",
            labels=[*_PEER, "table"],
        )
        counters = {
            name: CounterMetricFamily(name, help_text, labels=list(_PEER))
            for name, help_text in (
                ("tspd_transfer_bytes", "Bytes the transfer workers wrote to Decode ranks."),
                ("tspd_transfer_descriptors", "Copy descriptors the transfer workers wrote."),
                ("tspd_transfer_engine_calls", "Transfer-engine write calls made."),
                ("tspd_heartbeats", "Heartbeat rounds against Prefill bootstrap servers."),
            )
        }
        messages = CounterMetricFamily(
            "tspd_control_messages",
            "Control messages handed to PUSH sockets (sent) or dropped (peer queue full).",
            labels=[*_PEER, "result"],
        )
        in_flight = GaugeMetricFamily(
            "tspd_transfer_chunks_in_flight",
            "Transfer chunks queued or running.",
            labels=list(_PEER),
        )
        for peer in list(self.peers):
            who = [peer.side, peer.rank]
            if peer.rooms_by_state is not None:
                counts = self._read(f"{peer.side} rank {peer.rank} rooms", peer.rooms_by_state)
                if counts is not None:
                    for state in _ROOM_STATES:
                        rooms.add_metric([*who, state], counts.get(state, 0))
            if peer.statistics is None:
                continue
            stats = self._read(f"{peer.side} rank {peer.rank} statistics", peer.statistics)
            for key, value in (stats or {}).items():
                if key in _COUNTER_KEYS:
                    counters[_COUNTER_KEYS[key]].add_metric(who, value)
                elif key in _MESSAGE_KEYS:
                    messages.add_metric([*who, _MESSAGE_KEYS[key]], value)
                elif key in _GAUGE_KEYS:
                    in_flight.add_metric(who, value)
                else:
                    tables.add_metric([*who, key], value)
        yield rooms
        yield tables
        yield from counters.values()
        yield messages
        yield in_flight

    def _publisher_metrics(self) -> Iterator[Metric]:
        label = ["dp_rank"]
        families = {
            field: CounterMetricFamily(name, help_text, labels=label)
            for field, name, help_text in (
                ("batches_published", "tspd_kv_batches_published", "KV event batches published."),
                ("events_published", "tspd_kv_events_published", "KV events published."),
                (
                    "batches_dropped",
                    "tspd_kv_batches_dropped",
                    "KV event batches dropped (queue full, published after close, or not "
                    "encodable).",
                ),
                ("send_failures", "tspd_kv_send_failures", "KV event batches the PUB failed."),
                (
                    "replay_batches_sent",
                    "tspd_kv_replayed_batches",
                    "KV event batches sent to replay requests.",
                ),
                (
                    "replays_cut_short",
                    "tspd_kv_replays_cut_short",
                    "Replays that could not send every batch they promised.",
                ),
            )
        }
        replays = CounterMetricFamily(
            "tspd_kv_replay_requests",
            "Replay requests answered (served) or refused as malformed (invalid).",
            labels=[*label, "result"],
        )
        depth = GaugeMetricFamily(
            "tspd_kv_publisher_queue_depth", "KV event batches waiting to be sent.", labels=label
        )
        buffered = GaugeMetricFamily(
            "tspd_kv_publisher_buffered_batches",
            "KV event batches held for replay.",
            labels=label,
        )
        for source in list(self.publishers):
            stats = self._read(f"KV publisher {source.dp_rank}", source.statistics)
            if stats is None:
                continue
            who = [source.dp_rank]
            for field, family in families.items():
                family.add_metric(who, getattr(stats, field))
            replays.add_metric([*who, "served"], stats.replay_requests_served)
            replays.add_metric([*who, "invalid"], stats.replay_requests_invalid)
            depth.add_metric(who, stats.queue_depth)
            buffered.add_metric(who, stats.buffered)
        yield from families.values()
        yield replays
        yield depth
        yield buffered

    def _subscriber_metrics(self) -> Iterator[Metric]:
        label = ["source"]
        families = {
            field: CounterMetricFamily(name, help_text, labels=label)
            for field, name, help_text in (
                ("delivered", "tspd_kv_subscriber_batches", "KV event batches delivered in order."),
                ("replayed", "tspd_kv_subscriber_replayed", "Batches delivered from a replay."),
                ("duplicates", "tspd_kv_subscriber_duplicates", "Duplicate batches dropped."),
                ("gaps", "tspd_kv_subscriber_gaps", "Sequence gaps detected."),
                (
                    "lost_batches",
                    "tspd_kv_subscriber_lost_batches",
                    "Batches given up as lost (evicted, no replay, replay failed).",
                ),
                (
                    "replays_requested",
                    "tspd_kv_subscriber_replay_requests",
                    "Replay requests sent.",
                ),
                ("restarts", "tspd_kv_subscriber_restarts", "Publisher restarts seen."),
            )
        }
        pending = GaugeMetricFamily(
            "tspd_kv_subscriber_pending_batches",
            "Live batches held behind an open gap.",
            labels=label,
        )
        for statistics in list(self.subscribers):
            per_source = self._read("KV subscriber", statistics)
            for source, stats in (per_source or {}).items():
                for field, family in families.items():
                    family.add_metric([source], getattr(stats, field))
                pending.add_metric([source], stats.pending)
        yield from families.values()
        yield pending

    def _bootstrap_metrics(self) -> Iterator[Metric]:
        rejected = CounterMetricFamily(
            "tspd_bootstrap_rejected_requests",
            "Requests and connections a bootstrap server refused, by reason.",
            labels=["reason"],
        )
        totals: dict[str, int] = {}
        for statistics in list(self.bootstraps):
            for reason, count in (self._read("bootstrap server", statistics) or {}).items():
                totals[reason] = totals.get(reason, 0) + count
        for reason, count in sorted(totals.items()):
            rejected.add_metric([reason], count)
        yield rejected


@final
class TspdMetrics:
    """Every tspd metric, in one registry. See the module docstring."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        use_default: bool = False,
        tokenspeed: TokenSpeedLabels | None = None,
    ) -> None:
        if registry is not None and use_default:
            raise ConfigError("pass a registry or use_default=True, not both")
        self.registry: CollectorRegistry = (
            registry if registry is not None else REGISTRY if use_default else CollectorRegistry()
        )
        reg = self.registry
        self.rooms_finished = Counter(
            "tspd_rooms_finished",
            "Rooms that ended, by outcome (success, failed, dropped unclaimed).",
            [*_PEER, "outcome"],
            registry=reg,
        )
        self.room_failures = Counter(
            "tspd_room_failures",
            "Rooms that failed, by the class of their first failure reason.",
            [*_PEER, "reason_class"],
            registry=reg,
        )
        self.rejected_messages = Counter(
            "tspd_rejected_messages",
            "Messages from peers that were refused (malformed, unregistered, conflicting), "
            "by reason.",
            [*_PEER, "reason"],
            registry=reg,
        )
        self.room_timeouts = Counter(
            "tspd_room_timeouts",
            "Rooms that failed by timing out, by the phase that timed out.",
            [*_PEER, "phase"],
            registry=reg,
        )
        self.room_duration = Histogram(
            "tspd_room_duration_seconds",
            "A room's life on this rank, from its first milestone to its end.",
            [*_PEER, "outcome"],
            buckets=PHASE_BUCKETS,
            registry=reg,
        )
        self.room_phase = Histogram(
            "tspd_room_phase_seconds",
            "Time rooms spent in each phase (see tspd.core.trace).",
            [*_PEER, "phase"],
            buckets=PHASE_BUCKETS,
            registry=reg,
        )
        self.transfer_latency = Histogram(
            "tspd_kv_transfer_latency_seconds",
            "A successful room's transfer: first chunk queued to final write done.",
            list(_PEER),
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.transfer_write = Histogram(
            "tspd_transfer_write_seconds",
            "One write to one destination session: every engine call of it.",
            list(_PEER),
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.transfer_chunks = Counter(
            "tspd_transfer_chunks",
            "Transfer chunks handed to the transfer workers.",
            list(_PEER),
            registry=reg,
        )
        self.scheduler_events = Counter(
            "tspd_scheduler_events",
            "Events the scheduler received from polls, by kind.",
            [*_PEER, "event"],
            registry=reg,
        )
        self.subscriber_unhealed = Counter(
            "tspd_kv_subscriber_gaps_unhealed",
            "KV event gaps (or parts of one) given up as lost, by reason.",
            ["source", "reason"],
            registry=reg,
        )
        self.tokenspeed = tokenspeed
        ts_labels = ("model_name", "app_key", "dp_rank")
        self.ts_failures = Counter(
            "tokenspeed:kv_transfer_failures",
            "KV transfers that failed (once per room, Prefill side).",
            ts_labels,
            registry=None,
        )
        self.ts_timeouts = Counter(
            "tokenspeed:kv_transfer_timeouts",
            "KV transfers that timed out, by stage (Prefill side).",
            [*ts_labels, "stage"],
            registry=None,
        )
        self.ts_latency = Histogram(
            "tokenspeed:kv_transfer_latency_seconds",
            "Successful KV transfer writes, one destination each (Prefill side).",
            ts_labels,
            buckets=LATENCY_BUCKETS,
            registry=None,
        )
        ts_collectors = (self.ts_failures, self.ts_timeouts, self.ts_latency)
        if tokenspeed is not None:
            for collector in ts_collectors:
                reg.register(collector)
        self._scrape = _ScrapeCollector()
        reg.register(self._scrape)
        self._collectors = (
            *(ts_collectors if tokenspeed is not None else ()),
            self.rooms_finished,
            self.room_failures,
            self.room_timeouts,
            self.rejected_messages,
            self.room_duration,
            self.room_phase,
            self.transfer_latency,
            self.transfer_write,
            self.transfer_chunks,
            self.scheduler_events,
            self.subscriber_unhealed,
            self._scrape,
        )
        self._peers: list[PeerMetrics] = []

    def unregister(self) -> None:
        """Remove every tspd metric from the registry (a peer that shares the global
        registry, shutting down, so a successor can register again)."""
        for collector in self._collectors:
            self.registry.unregister(collector)

    def peer(self, side: Side | str, rank: int, *, dp_rank: int = 0) -> PeerMetrics:
        """The metrics view of one rank (``side`` is ``"prefill"`` or ``"decode"``);
        ``dp_rank`` labels its TokenSpeed-named metrics."""
        view = PeerMetrics(self, Side(side), rank, dp_rank=dp_rank)
        self._peers.append(view)
        return view

    @property
    def peers(self) -> tuple[PeerMetrics, ...]:
        """Every view handed out, in order (for trace endpoints)."""
        return tuple(self._peers)

    def _watch_peer(self, source: _PeerSource) -> None:
        self._scrape.peers.append(source)

    def _unwatch_peer(self, source: _PeerSource) -> None:
        if source in self._scrape.peers:
            self._scrape.peers.remove(source)

    def _forget_view(self, view: PeerMetrics) -> None:
        if view in self._peers:
            self._peers.remove(view)

    def watch_publisher(self, statistics: Callable[[], PublisherStats], dp_rank: int = 0) -> None:
        """Read a KV event publisher's counters (``publisher.statistics``) at scrape
        time, labelled ``dp_rank``."""
        self._scrape.publishers.append(_PublisherSource(str(dp_rank), statistics))

    def watch_subscriber(self, statistics: Callable[[], Mapping[str, TrackerStats]]) -> None:
        """Read a KV event subscriber's per-source counters (``subscriber.statistics``)
        at scrape time, labelled ``source``."""
        self._scrape.subscribers.append(statistics)

    def watch_bootstrap(self, statistics: Callable[[], Mapping[str, int]]) -> None:
        """Read a bootstrap server's refusals by reason
        (:meth:`tspd.shell.bootstrap.BootstrapServer.statistics`) at scrape time, as
        ``tspd_bootstrap_rejected_requests_total{reason}`` (summed over the watched
        servers)."""
        self._scrape.bootstraps.append(statistics)

    def observe_subscriber_item(self, item: SubscriberItem) -> None:
        """Count what only the subscriber's stream says: each :class:`BatchesLost` is
        an unhealed gap, by reason. Call it for every item the consumer receives."""
        if isinstance(item, BatchesLost):
            self.subscriber_unhealed.labels(item.source, item.reason).inc()

    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        """The registry in the exposition format ``accept`` asks for (Prometheus
        text by default): ``(body, content type)``."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type

    async def render_off_loop(self, accept: str | None = None) -> tuple[bytes, str]:
        """:meth:`render` for a Trio endpoint: the watched peers are read here, in
        their own thread (their tables are not thread-safe), and the text is encoded
        in a worker thread, so a scrape never stalls the peers' loop for the
        milliseconds encoding takes."""
        frozen = list(self._scrape.collect())
        context = contextvars.copy_context()
        context.run(_FROZEN.set, frozen)
        return await trio.to_thread.run_sync(context.run, self.render, accept)


@final
class PeerMetrics:
    """One rank's metrics: ``observe_*`` what its shell drains, ``watch`` its tables.

    Get it from :meth:`TspdMetrics.peer`. Every method runs in the peer's thread.
    """

    def __init__(self, metrics: TspdMetrics, side: Side, rank: int, *, dp_rank: int = 0) -> None:
        self.metrics = metrics
        self.side = side
        self.rank = rank
        labels = (str(side), str(rank))
        self._labels = labels
        self._chunks = metrics.transfer_chunks.labels(*labels)
        self._latency = metrics.transfer_latency.labels(*labels)
        self._write = metrics.transfer_write.labels(*labels)
        ts = metrics.tokenspeed if side is Side.PREFILL else None
        self._ts_labels = (ts.model_name, ts.app_key, str(dp_rank)) if ts is not None else None
        self._children: dict[tuple[str, str], Any] = {}
        self._trace: Callable[[int], RoomTrace | None] | None = None
        self._recent: Callable[[], list[RoomTrace]] | None = None
        self._source: _PeerSource | None = None

    def _child(self, family: Counter | Histogram, name: str, value: str) -> Any:
        key = (name, value)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = family.labels(*self._labels, value)
        return child

    def observe_command(self, command: Command) -> None:
        """Count a drained core command: a :class:`Rejected` (its reason), a
        :class:`RoomFailed` (its class, and its
        phase for a timeout) or a :class:`StartTransfer`; others are ignored."""
        if isinstance(command, StartTransfer):
            self._chunks.inc()
        elif isinstance(command, Rejected):
            self._child(self.metrics.rejected_messages, "rejected", str(command.reason)).inc()
        elif isinstance(command, RoomFailed):
            metrics = self.metrics
            self._child(metrics.room_failures, "failure", str(command.reason_class)).inc()
            if command.timeout_stage is not None:
                self._child(metrics.room_timeouts, "timeout", command.timeout_stage).inc()
            if self._ts_labels is not None:
                metrics.ts_failures.labels(*self._ts_labels).inc()
                if command.timeout_stage is not None:
                    metrics.ts_timeouts.labels(*self._ts_labels, command.timeout_stage).inc()

    def observe_commands(self, commands: Iterable[Command]) -> None:
        """:meth:`observe_command` for each of ``commands``."""
        for command in commands:
            self.observe_command(command)

    def observe_event(self, event: Event) -> None:
        """Count a scheduler event by kind."""
        name = _EVENT_NAMES.get(type(event))
        if name is not None:
            self._child(self.metrics.scheduler_events, "event", name).inc()

    def observe_finished(self, trace: RoomTrace) -> None:
        """Record a finished room from the core's ``drain_finished()``: its outcome,
        its duration, each phase's duration and (a successful transfer) its latency."""
        metrics = self.metrics
        outcome = str(trace.outcome or Outcome.DROPPED)
        self._child(metrics.rooms_finished, "finished", outcome).inc()
        self._child(metrics.room_duration, "duration", outcome).observe(trace.duration)
        phases = trace.phases
        for phase, seconds in phases.items():
            self._child(metrics.room_phase, "phase", phase).observe(seconds)
        if trace.outcome is Outcome.SUCCESS and trace.chunks and "transfer" in phases:
            self._latency.observe(phases["transfer"])

    def observe_write(self, seconds: float) -> None:
        """A transfer worker finished one write to one destination in ``seconds``
        (every engine call of it; its bytes are counted from the peer's statistics)."""
        self._write.observe(seconds)
        if self._ts_labels is not None:
            self.metrics.ts_latency.labels(*self._ts_labels).observe(seconds)

    def observe_finished_all(self, traces: Iterable[RoomTrace]) -> None:
        """:meth:`observe_finished` for each of ``traces``."""
        for trace in traces:
            self.observe_finished(trace)

    def watch(
        self,
        *,
        rooms_by_state: Callable[[], Mapping[str, int]] | None = None,
        statistics: Callable[[], Mapping[str, int]] | None = None,
        trace: Callable[[int], RoomTrace | None] | None = None,
        recent_traces: Callable[[], list[RoomTrace]] | None = None,
    ) -> None:
        """Read this rank's state when scraped: ``rooms_by_state`` (the core's) gives
        ``tspd_rooms``; ``statistics`` (the peer's) gives the table sizes and the
        transfer, message and heartbeat counters. ``trace``/``recent_traces`` (the
        core's) serve the metrics endpoint's ``/traces`` routes. Watching again
        replaces what was watched."""
        if self._source is not None:
            self.metrics._unwatch_peer(self._source)
        self._source = _PeerSource(str(self.side), str(self.rank), rooms_by_state, statistics)
        self.metrics._watch_peer(self._source)
        self._trace = trace
        self._recent = recent_traces

    def close(self) -> None:
        """The peer stopped: stop reading it at scrape time and drop its traces from
        the endpoint. What it counted stays in the registry's counters."""
        if self._source is not None:
            self.metrics._unwatch_peer(self._source)
        self.metrics._forget_view(self)
        self._source = None
        self._trace = None
        self._recent = None

    def trace(self, room: int) -> RoomTrace | None:
        """The watched core's trace of ``room`` (``None`` without one, or unwatched)."""
        return self._trace(room) if self._trace is not None else None

    def recent_traces(self) -> list[RoomTrace]:
        """The watched core's kept traces (empty when unwatched)."""
        return self._recent() if self._recent is not None else []


# --------------------------------------------------------------------------- HTTP


def _trace_entry(trace: RoomTrace, offset: float) -> dict[str, object]:
    """A trace as JSON, plus its marks on the Unix clock (``offset`` is Unix time
    minus the peers' clock), so traces from several processes line up."""
    entry = trace.as_dict()
    entry["started_unix"] = trace.started + offset
    entry["marks_unix"] = [[str(mark), when + offset] for mark, when in trace.marks]
    return entry


def metrics_app(metrics: TspdMetrics) -> Starlette:
    """The ASGI app: ``GET /metrics`` (Prometheus or OpenMetrics text, by the
    ``Accept`` header), ``GET /traces`` (every watched rank's kept traces, JSON) and
    ``GET /traces/{room}`` (that room's trace on every watched rank, 404 if none).

    Trace times are the peers' Trio clock (what their cores were given); each trace
    also carries ``started_unix`` and ``marks_unix``, the same instants on the Unix
    clock, to compare traces taken in different processes (``tspd trace``).
    """

    def offset() -> float:
        return time.time() - trio.current_time()

    async def scrape(request: Request) -> Response:
        body, content_type = await metrics.render_off_loop(request.headers.get("accept"))
        return Response(body, headers={"Content-Type": content_type})

    async def recent(request: Request) -> Response:
        shift = offset()
        traces = [_trace_entry(t, shift) for peer in metrics.peers for t in peer.recent_traces()]
        return JSONResponse(traces)

    async def one_room(request: Request) -> Response:
        text = request.path_params["room"]
        if not text.isdigit():
            return PlainTextResponse(f"room must be a non-negative integer, got {text!r}", 400)
        room = int(text)
        shift = offset()
        traces = [
            _trace_entry(t, shift) for p in metrics.peers for t in [p.trace(room)] if t is not None
        ]
        if not traces:
            return PlainTextResponse(
                f"no trace of room {room}: it never reached this process, or it succeeded "
                "quickly and was not kept (only failed or slow rooms are kept)",
                404,
            )
        return JSONResponse(traces)

    async def index(request: Request) -> Response:
        return PlainTextResponse("tspd metrics: /metrics, /traces, /traces/{room}\n")

    return Starlette(
        routes=[
            Route("/", index, methods=["GET"]),
            Route("/metrics", scrape, methods=["GET"]),
            Route("/traces", recent, methods=["GET"]),
            Route("/traces/{room}", one_room, methods=["GET"]),
        ]
    )


@dataclass(frozen=True, slots=True)
class MetricsServer:
    """A running metrics endpoint: where it listens."""

    host: str
    port: int

    @property
    def address(self) -> str:
        """``host:port`` (IPv6 hosts in brackets)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def url(self) -> str:
        """The scrape URL, ``http://host:port/metrics``."""
        return f"http://{self.address}/metrics"


def _bind(host: str, port: int) -> socket.socket:
    try:
        return bind_tcp(host, port)
    except OSError as err:
        raise ConfigError(
            f"the metrics endpoint cannot bind {host}:{port}: {err.strerror or err}; "
            "pick another port (0 picks a free one)"
        ) from err


async def _serve_socket(
    sock: socket.socket,
    host: str,
    metrics: TspdMetrics,
    *,
    task_status: trio.TaskStatus[MetricsServer] = trio.TASK_STATUS_IGNORED,
) -> NoReturn:
    server = MetricsServer(host, sock.getsockname()[1])
    await serve_asgi(
        metrics_app(metrics),
        sock,
        logger=log,
        what="metrics endpoint",
        started=server,
        url=server.url,
        task_status=task_status,
    )


async def serve_metrics(
    metrics: TspdMetrics,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    task_status: trio.TaskStatus[MetricsServer] = trio.TASK_STATUS_IGNORED,
) -> NoReturn:
    """Serve ``metrics`` over HTTP on ``host:port`` until cancelled; ``task_status``
    reports the bound :class:`MetricsServer` (``port=0`` picks a free port). Run it
    in the peers' Trio loop so scrapes read their tables from the owning thread. A
    port that cannot be bound raises :class:`~tspd.core.errors.ConfigError`."""
    await _serve_socket(_bind(host, port), host, metrics, task_status=task_status)


@asynccontextmanager
async def open_metrics_server(
    metrics: TspdMetrics, host: str = "127.0.0.1", port: int = 0
) -> AsyncIterator[MetricsServer]:
    """Serve ``metrics`` for the duration of the block; yields the bound server."""
    sock = _bind(host, port)
    with single_error():
        async with trio.open_nursery() as nursery:
            server: MetricsServer = await nursery.start(_serve_socket, sock, host, metrics)
            try:
                yield server
            finally:
                nursery.cancel_scope.cancel()
