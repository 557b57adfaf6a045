"""Observability of real Prefill and Decode peers (fake engines, a real bootstrap
server): metrics scraped over HTTP, traces from the peers, one line per failure."""

from __future__ import annotations

import logging

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from tspd.core.commands import Bootstrapped, Event, Failed, RemotePrefillDone, Succeeded
from tspd.core.decode import DecodeConfig
from tspd.core.manifest import build_manifest
from tspd.core.prefill import PrefillConfig
from tspd.core.trace import Mark, Outcome, ReasonClass
from tspd.shell.arena import HostArena
from tspd.shell.bootstrap import open_bootstrap_server
from tspd.shell.decode import DecodePeer, open_decode_peer
from tspd.shell.metrics import TspdMetrics, open_metrics_server
from tspd.shell.prefill import PrefillPeer, PrefillSettings, RemoteDecodeRow, open_prefill_peer
from tspd.testing.fake_engine import AsyncFakeEngine, FakeFabric
from tspd.testing.layouts import PageAllocator, simple_contract

CONTRACT = simple_contract(num_pages=16, page_bytes=64)
PROMPT = 40  # three 16-token pages


async def _poll_for(peer: PrefillPeer | DecodePeer, rid: str) -> Event:
    with trio.fail_after(10):
        while True:
            for event in await peer.poll():
                if event.rid == rid:
                    return event
            await trio.sleep(0.002)


async def _room(
    prefill: PrefillPeer, decode: DecodePeer, addr: str, rid: str, room: int
) -> tuple[Event, Event]:
    """One request through both peers; their final events."""
    decode.register_request(rid, room, addr)
    prefill.register_request(rid, room)
    assert isinstance(await _poll_for(decode, rid), Bootstrapped)
    tables = PageAllocator(CONTRACT).allocate(PROMPT)
    decode.send_preallocation(room, build_manifest(CONTRACT, tables, 0, PROMPT))
    assert isinstance(await _poll_for(prefill, rid), Bootstrapped)
    prefill.hand_over([RemoteDecodeRow(rid, PageAllocator(CONTRACT).allocate(PROMPT), 7)])
    return await _poll_for(prefill, rid), await _poll_for(decode, rid)


async def test_peers_report_metrics_traces_and_one_line_per_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fabric = FakeFabric()
    metrics = TspdMetrics()
    decode_engine = AsyncFakeEngine(fabric=fabric)
    prefill_engine = AsyncFakeEngine(fabric=fabric)
    with (
        HostArena.for_contract(CONTRACT) as prefill_arena,
        HostArena.for_contract(CONTRACT) as decode_arena,
        caplog.at_level(logging.WARNING, logger="tspd"),
    ):
        async with open_bootstrap_server() as server:
            settings = PrefillSettings(bootstrap_addr=server.address)
            async with (
                open_prefill_peer(
                    PrefillConfig(1, 0, CONTRACT, 1),
                    prefill_engine,
                    prefill_arena,
                    settings=settings,
                    metrics=metrics,
                ) as prefill,
                open_decode_peer(
                    DecodeConfig(1, 0, CONTRACT, 1, "", "", 1),
                    decode_engine,
                    decode_arena,
                    metrics=metrics,
                ) as decode,
                open_metrics_server(metrics) as endpoint,
            ):
                ok = await _room(prefill, decode, server.address, "ok", 1)
                prefill_engine.fail_next(decode_engine.session_id)
                bad = await _room(prefill, decode, server.address, "bad", 2)
                async with httpx.AsyncClient() as client:
                    text = (await client.get(endpoint.url)).text
                    traces = (await client.get(f"http://{endpoint.address}/traces/2")).json()
                prefill_trace = prefill.trace(2)
                decode_trace = decode.trace(2)
            assert metrics.peers == ()  # both peers closed their views on exit

    s = {
        (x.name, frozenset(x.labels.items())): x.value
        for family in text_string_to_metric_families(text)
        for x in family.samples
    }

    def value(name: str, **labels: str) -> float:
        return s[(name, frozenset(labels.items()))]

    p, d = {"side": "prefill", "rank": "0"}, {"side": "decode", "rank": "0"}
    assert value("tspd_rooms_finished_total", **p, outcome="success") == 1
    assert value("tspd_rooms_finished_total", **d, outcome="success") == 1
    assert value("tspd_room_failures_total", **p, reason_class="transfer") == 1
    assert value("tspd_room_failures_total", **d, reason_class="peer-failed") == 1
    assert value("tspd_scheduler_events_total", **d, event="remote_prefill_done") == 1
    assert value("tspd_kv_transfer_latency_seconds_count", **p) == 1
    assert value("tspd_transfer_write_seconds_count", **p) == 1  # room 2's write failed
    assert value("tspd_transfer_bytes_total", **p) == 3 * 64
    assert value("tspd_transfer_descriptors_total", **p) == 1
    assert value("tspd_transfer_chunks_total", **p) == 2
    assert value("tspd_room_table_entries", **d, table="traces") == 0
    assert value("tspd_control_messages_total", **d, result="sent") >= 3

    assert prefill_trace is not None
    assert decode_trace is not None
    assert prefill_trace.outcome is Outcome.FAILED
    assert prefill_trace.reason_class is ReasonClass.TRANSFER
    assert decode_trace.reason_class is ReasonClass.PEER_FAILED
    assert decode_trace.at(Mark.PREALLOCATED) is not None
    assert sorted(t["side"] for t in traces) == ["decode", "prefill"]

    failures = [r for r in caplog.records if r.getMessage().startswith("room 2 failed: ")]
    assert sorted((r.name, r.reason_class) for r in failures) == [  # type: ignore[attr-defined]
        ("tspd.decode", "peer-failed"),
        ("tspd.prefill", "transfer"),
    ]
    assert not any(r.getMessage().startswith("room 1") for r in caplog.records)
    assert [type(e) for e in ok] == [Succeeded, RemotePrefillDone]
    assert [type(e) for e in bad] == [Failed, Failed]
