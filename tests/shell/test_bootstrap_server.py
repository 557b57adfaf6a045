"""The bootstrap HTTP server and client over real HTTP on 127.0.0.1
(docs/protocol.md#proto-bootstrap)."""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator, Mapping
from typing import Any

import httpx
import pytest
import trio

from tspd.core.bootstrap import (
    BAD_LAYOUT,
    INCOMPATIBLE_LAYOUTS,
    LAYOUT_NOT_STRING,
    MISSING_INPUTS,
    BootstrapState,
    HttpReply,
    ParallelInfo,
    RankInfo,
    build_route_payload,
)
from tspd.core.contract import parse_contract
from tspd.core.errors import WireError
from tspd.shell.bootstrap import (
    BootstrapClient,
    BootstrapServer,
    BootstrapServerError,
    BootstrapUnavailable,
    open_bootstrap_server,
    serve_bootstrap,
)

LAYOUT = json.dumps(
    {
        "plan": {
            "prefix_granularity": 16,
            "lcm_block_bytes": 4096,
            "num_lcm_blocks": 8,
            "groups": [{"group_id": "full", "cache_blocks_per_lcm_block": 1, "page_count": 9}],
            "planes": [{"plane_id": "p0", "bytes_per_lcm_block": 4096, "arena_offset_bytes": 0}],
            "fields": [
                {
                    "group_id": "full",
                    "field_id": "layer.0.kv",
                    "plane_id": "p0",
                    "shape": [1024],
                    "dtype": "float32",
                    "field_offset_bytes": 0,
                    "page_stride_bytes": 4096,
                }
            ],
        },
        "group_specs": [
            {
                "group_id": "full",
                "retention": "full_history",
                "rows_per_page": 16,
                "entry_stride_tokens": 1,
                "sliding_window_tokens": None,
                "family": "history",
                "transfer_policy": "full_suffix",
                "checkpoint_granularity": None,
            }
        ],
        "transfer_schema": {"fields": []},
    },
    indent=2,
)
CANONICAL = parse_contract(LAYOUT).to_json().decode("ascii")


def payload(
    engine_rank: int, *, world_size: int = 2, dp_size: int = 1, layout: Any = LAYOUT
) -> dict[str, Any]:
    body = build_route_payload(
        rank_ip="127.0.0.1",
        rank_port=6000 + engine_rank,
        engine_rank=engine_rank,
        world_size=world_size,
        dp_size=dp_size,
        cache_layout=CANONICAL,
    )
    body["cache_layout"] = layout
    return body


@pytest.fixture
async def server() -> AsyncIterator[BootstrapServer]:
    async with open_bootstrap_server("127.0.0.1", 0) as srv:
        yield srv


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(trust_env=False, timeout=5) as client:
        yield client


async def test_health_route(server: BootstrapServer, http: httpx.AsyncClient) -> None:
    r = await http.get(server.url + "/health")
    assert (r.status_code, r.text) == (200, "OK")


async def test_put_then_get_parallel_and_rank_info(
    server: BootstrapServer, http: httpx.AsyncClient
) -> None:
    for rank in (0, 1):
        r = await http.put(server.url + "/route", json=payload(rank))
        assert (r.status_code, r.text) == (200, "OK")
    r = await http.get(server.url + "/route", params={"engine_rank": -1, "target_dp_group": -1})
    assert r.status_code == 200
    assert r.json() == {"prefill_tp_size": 2, "prefill_dp_size": 1, "cache_layout": CANONICAL}
    r = await http.get(server.url + "/route", params={"engine_rank": 1, "target_dp_group": 0})
    assert r.json() == {"rank_ip": "127.0.0.1", "rank_port": 6001}


async def test_missing_inputs_is_400(server: BootstrapServer, http: httpx.AsyncClient) -> None:
    await http.put(server.url + "/route", json=payload(0, world_size=1))
    for params in ({}, {"engine_rank": "0"}, {"engine_rank": "", "target_dp_group": "0"}):
        r = await http.get(server.url + "/route", params=params)
        assert (r.status_code, r.text) == (400, MISSING_INPUTS)


async def test_unknown_ranks_are_404_and_non_integer_ranks_400(
    server: BootstrapServer, http: httpx.AsyncClient
) -> None:
    await http.put(server.url + "/route", json=payload(0, world_size=1))
    r = await http.get(server.url + "/route", params={"engine_rank": 5, "target_dp_group": 0})
    assert r.status_code == 404
    assert "engine_rank=5" in r.text
    r = await http.get(server.url + "/route", params={"engine_rank": "a", "target_dp_group": 0})
    assert r.status_code == 400
    assert "integer engine_rank" in r.text


async def test_other_methods_are_405_json(server: BootstrapServer, http: httpx.AsyncClient) -> None:
    for method in ("POST", "DELETE", "PATCH"):
        r = await http.request(method, server.url + "/route")
        assert (r.status_code, r.text) == (405, "Method not allowed")
        assert r.headers["content-type"].startswith("application/json")


async def test_bad_puts_are_400_with_the_spec_message(
    server: BootstrapServer, http: httpx.AsyncClient
) -> None:
    r = await http.put(server.url + "/route", json=payload(0, layout=17))
    assert (r.status_code, r.text) == (400, LAYOUT_NOT_STRING)
    r = await http.put(server.url + "/route", json=payload(0, layout="{}"))
    assert (r.status_code, r.text) == (400, BAD_LAYOUT)
    r = await http.put(server.url + "/route", content=b"{not json")
    assert (r.status_code, r.text) == (400, "bootstrap PUT body is not JSON")
    r = await http.put(server.url + "/route", json={"cache_layout": LAYOUT})
    assert (r.status_code, r.text) == (400, "bootstrap PUT body lacks 'role'")


async def test_incompatible_layouts_are_rejected(
    server: BootstrapServer, http: httpx.AsyncClient
) -> None:
    assert (await http.put(server.url + "/route", json=payload(0))).status_code == 200
    other = json.loads(LAYOUT)
    other["plan"]["prefix_granularity"] = 32
    r = await http.put(server.url + "/route", json=payload(1, layout=json.dumps(other)))
    assert (r.status_code, r.text) == (409, INCOMPATIBLE_LAYOUTS)
    assert server.state.registered_ranks == 1


async def test_gets_are_503_until_every_rank_registered(
    server: BootstrapServer, http: httpx.AsyncClient
) -> None:
    params = {"engine_rank": -1, "target_dp_group": -1}
    r = await http.get(server.url + "/route", params=params)
    assert (r.status_code, r.text) == (
        503,
        "Bootstrap server is waiting for its first Prefill rank",
    )
    await http.put(server.url + "/route", json=payload(1))
    r = await http.get(server.url + "/route", params=params)
    assert (r.status_code, r.text) == (503, "Bootstrap server is waiting for 1 of 2 Prefill ranks")
    r = await http.get(server.url + "/route", params={"engine_rank": 1, "target_dp_group": 0})
    assert r.status_code == 503
    assert (await http.get(server.url + "/health")).status_code == 200
    await http.put(server.url + "/route", json=payload(0))
    assert (await http.get(server.url + "/route", params=params)).status_code == 200


async def test_oversized_body_is_413(server: BootstrapServer, http: httpx.AsyncClient) -> None:
    r = await http.put(server.url + "/route", content=b" " * ((1 << 20) + 10))
    assert r.status_code == 413


async def test_client_round_trip(server: BootstrapServer) -> None:
    async with BootstrapClient() as client:
        assert await client.health(server.address)
        with pytest.raises(BootstrapUnavailable) as waiting:
            await client.get_parallel_info(server.address)
        assert waiting.value.status == 503
        for rank in range(4):
            await client.put_route(server.address, payload(rank, world_size=4, dp_size=2))
        info = await client.get_parallel_info(server.address)
        assert info == ParallelInfo(4, 2, CANONICAL)
        assert info.tp_size_per_dp == 2
        rank = await client.get_rank_info(server.address, 1, 1)
        assert rank == RankInfo("127.0.0.1", 6003)
        with pytest.raises(BootstrapUnavailable) as bad:
            await client.put_route(server.address, payload(0, layout="{}"))
        assert bad.value.status == 400
        assert BAD_LAYOUT in str(bad.value)
        assert client.addresses == [server.address]


async def test_client_accepts_url_form_addresses(server: BootstrapServer) -> None:
    async with BootstrapClient() as client:
        assert await client.health(server.url)


class GarbageState(BootstrapState):
    """A server that answers 200 with replies no client can use."""

    def handle(self, method: str, path: str, query: Mapping[str, str], body: bytes) -> HttpReply:
        return HttpReply(200, '{"prefill_tp_size": null, "rank_ip": ""}', "application/json")


async def test_client_reports_unusable_200_replies_as_wire_errors() -> None:
    async with open_bootstrap_server(state=GarbageState()) as srv, BootstrapClient() as client:
        with pytest.raises(WireError, match="incomplete parallel info"):
            await client.get_parallel_info(srv.address)
        with pytest.raises(WireError, match="no usable endpoint"):
            await client.get_rank_info(srv.address, 0, 0)


async def test_health_of_a_dead_server_is_false_quickly() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    async with BootstrapClient() as client:
        with trio.fail_after(5):
            assert not await client.health(f"127.0.0.1:{port}")
        with pytest.raises(BootstrapUnavailable) as err:
            await client.get_rank_info(f"127.0.0.1:{port}", 0, 0)
        assert err.value.status is None


async def test_health_non_200_drops_the_session(http: httpx.AsyncClient) -> None:
    async with open_bootstrap_server() as srv, BootstrapClient() as client:
        assert await client.health(srv.address)
        assert client.addresses == [srv.address]
        # A server that answers /health with 404 (another service on that port).
        assert not await client.health(srv.url + "/nothing-here")
        assert srv.url + "/nothing-here" not in client.addresses


async def test_shutdown_releases_the_port_for_a_new_server() -> None:
    async with open_bootstrap_server() as first, BootstrapClient() as client:
        port = first.port
        assert await client.health(first.address)  # keep-alive connection left open
    async with open_bootstrap_server("127.0.0.1", port) as second, BootstrapClient() as client:
        assert second.port == port
        assert await client.health(second.address)
    async with BootstrapClient() as client:
        assert not await client.health(f"127.0.0.1:{port}")


async def test_bind_failure_names_the_port() -> None:
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    port = blocker.getsockname()[1]
    try:
        with pytest.raises(BootstrapServerError, match=f"failed to bind on port {port}") as err:
            async with open_bootstrap_server("127.0.0.1", port):
                pass
        assert isinstance(err.value.__cause__, OSError)
    finally:
        blocker.close()


async def test_serve_bootstrap_under_a_caller_nursery(nursery: trio.Nursery) -> None:
    srv = await nursery.start(serve_bootstrap, "127.0.0.1", 0)
    assert isinstance(srv, BootstrapServer)
    async with BootstrapClient() as client:
        assert await client.health(srv.address)
    nursery.cancel_scope.cancel()


async def test_errors_in_the_block_reach_the_caller_unwrapped() -> None:
    with pytest.raises(KeyError, match="mine"):
        async with open_bootstrap_server():
            raise KeyError("mine")
