"""The demo's observability on real processes and Mooncake: every rank serves its
metrics over HTTP (the demo reports each address as the rank starts), and the
summary carries both sides' traces of failed rooms."""

from __future__ import annotations

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from tspd.demo.orchestrate import DemoOptions, DemoSummary, run_demo
from tspd.demo.workload import Workload

pytest.importorskip("mooncake.engine")

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(180)]


async def test_demo_serves_metrics_and_reports_failed_rooms_with_traces() -> None:
    # Prefill gives up bootstrapping at once; Decode hears Failed or times out
    # waiting (2 s), so its rank stays up long enough to be scraped.
    options = DemoOptions(
        workload=Workload(rooms=range(7300, 7304), seed=3, num_pages=256, max_prompt_pages=2),
        prefill_tp=1,
        decode_tp=1,
        in_flight=4,
        timeout=60,
        bootstrap_timeout=0.001,
        waiting_timeout=2.0,
        metrics_port=0,
    )
    urls: dict[str, str] = {}
    decode_up = trio.Event()
    scraped: list[str] = []
    result: list[DemoSummary] = []

    def on_metrics(name: str, url: str) -> None:
        urls[name] = url
        if name.startswith("decode"):
            decode_up.set()

    async def demo() -> None:
        result.append(await run_demo(options, on_metrics=on_metrics))

    async def scrape() -> None:
        await decode_up.wait()
        async with httpx.AsyncClient() as client:
            scraped.append((await client.get(urls["decode-0"], timeout=10)).text)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(demo)
        nursery.start_soon(scrape)

    (summary,) = result
    assert summary.errors == []
    assert summary.failed == 4
    assert set(urls) == {"prefill-0", "decode-0"}
    assert summary.metrics == urls
    assert all(
        url.startswith("http://127.0.0.1:") and url.endswith("/metrics") for url in urls.values()
    )
    families = {f.name for f in text_string_to_metric_families(scraped[0])}
    assert {"tspd_rooms", "tspd_room_table_entries", "tspd_room_failures"} <= families
    # Both sides' traces of the first failed rooms travel with the summary.
    assert summary.traces
    for room, traces in summary.traces.items():
        by_side = {t["side"]: t for t in traces}
        assert by_side["prefill"]["room"] == room
        assert by_side["prefill"]["reason_class"] == "timeout-bootstrapping"
        assert by_side["prefill"]["outcome"] == "failed"
        assert by_side["decode"]["reason_class"] in ("peer-failed", "timeout-waiting")
    assert summary.as_dict()["failure_traces"]
