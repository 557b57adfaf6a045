"""PeerObserver: the one object a peer's shell feeds its drained commands, events and
finished traces to; checked against a CorePair and a scrape of its registry."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from tspd.core.commands import Log, LogLevel, SendFrames
from tspd.shell.metrics import TspdMetrics
from tspd.shell.observe import PeerObserver
from tspd.testing.core_pair import CorePair
from tspd.testing.layouts import simple_contract

CONTRACT = simple_contract(num_pages=16, page_bytes=64)
PROMPT = 40


@pytest.fixture
def pair() -> Iterator[CorePair]:
    p = CorePair([CONTRACT], [CONTRACT])
    yield p
    p.close()


def _sample(metrics: TspdMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_observer_logs_counts_and_reports_slow_rooms(
    pair: CorePair, caplog: pytest.LogCaptureFixture
) -> None:
    metrics = TspdMetrics()
    prefill = PeerObserver("prefill", 0, metrics=metrics, slow_after=2.0)
    decode = PeerObserver("decode", 0, metrics=metrics, slow_after=None)
    prefill.watch(pair.prefill[0], pair.prefill[0].statistics)
    decode.watch(pair.decode[0])
    # A slow success (3 s waiting for Decode's pages) and a failed write.
    pair.register_decode("slow", 1)
    pair.register_prefill("slow", 1)
    decode.events(pair.poll_decode())
    pair.now = 3.0
    pair.preallocate(1, PROMPT)
    prefill.events(pair.poll_prefill())
    pair.hand_over(1, PROMPT)
    prefill.events(pair.poll_prefill())
    decode.events(pair.poll_decode())
    pair.write_errors[CorePair.decode_session(0)] = "connection reset"
    pair.register_decode("bad", 2)
    pair.register_prefill("bad", 2)
    pair.poll_decode()
    pair.preallocate(2, PROMPT)
    pair.poll_prefill()
    pair.hand_over(2, PROMPT)
    pair.poll_prefill()
    pair.poll_decode()

    with caplog.at_level(logging.INFO, logger="tspd"):
        for side, _, command in [*pair.logs, *pair.failures]:
            observer = prefill if side == "prefill" else decode
            assert observer.command(command)
        assert not prefill.command(SendFrames("h", 1, (b"x",), 1))
        prefill.finished(pair.prefill[0].drain_finished())
        decode.finished(pair.decode[0].drain_finished())

    failures = [r for r in caplog.records if r.getMessage().startswith("room 2 failed: ")]
    assert [(r.name, r.side, r.reason_class) for r in failures] == [  # type: ignore[attr-defined]
        ("tspd.prefill", "prefill", "transfer"),
        ("tspd.decode", "decode", "peer-failed"),
    ]
    slow = [r for r in caplog.records if "succeeded slowly" in r.getMessage()]
    assert len(slow) == 1
    assert (
        slow[0].getMessage().startswith("room 1 succeeded slowly in 3.000s: bootstrapping=3.000s")
    )
    assert slow[0].rid == "slow"  # type: ignore[attr-defined]

    p = {"side": "prefill", "rank": "0"}
    assert _sample(metrics, "tspd_room_failures_total", **p, reason_class="transfer") == 1
    assert _sample(metrics, "tspd_rooms_finished_total", **p, outcome="success") == 1
    assert _sample(metrics, "tspd_scheduler_events_total", **p, event="succeeded") == 1
    assert _sample(metrics, "tspd_rooms", side="decode", rank="0", state="Success") == 0
    assert _sample(metrics, "tspd_room_table_entries", **p, table="traces") == 0
    prefill_view, decode_view = metrics.peers
    assert prefill_view.trace(2).reason_class == "transfer"  # type: ignore[union-attr]
    assert decode_view.trace(2).reason_class == "peer-failed"  # type: ignore[union-attr]
    prefill.close()
    assert metrics.peers == (decode_view,)
    assert _sample(metrics, "tspd_room_table_entries", **p, table="traces") is None
    assert _sample(metrics, "tspd_room_failures_total", **p, reason_class="transfer") == 1


def test_without_metrics_the_observer_only_logs(caplog: pytest.LogCaptureFixture) -> None:
    observer = PeerObserver("decode", 1)
    observer.watch(object())  # type: ignore[arg-type]  # nothing is read without metrics
    observer.events([])
    with caplog.at_level(logging.DEBUG, logger="tspd.decode"):
        assert observer.command(Log(LogLevel.INFO, "registered", 4))
    (record,) = caplog.records
    assert (record.room, record.side, record.rank) == (4, "decode", 1)  # type: ignore[attr-defined]
