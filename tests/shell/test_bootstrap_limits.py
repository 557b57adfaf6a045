"""Nothing a client sends can crash, bloat or hold the bootstrap server, and nothing a
server returns can crash its clients (all traffic on 127.0.0.1, bounded)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import AsyncIterator, Mapping
from typing import Any

import httpx
import pytest
import trio
from pd_helpers import wait_until
from prometheus_client import CollectorRegistry

from tspd.core.bootstrap import REFUSAL_REASONS, BootstrapState, HttpReply
from tspd.core.commands import Failed
from tspd.core.contract import CacheContract
from tspd.core.decode import DecodeConfig
from tspd.core.errors import ConfigError, WireError
from tspd.log import RateLimitedLog
from tspd.shell.arena import HostArena
from tspd.shell.bootstrap import (
    MAX_REPLY_BYTES,
    BootstrapClient,
    BootstrapServer,
    BootstrapUnavailable,
    open_bootstrap_server,
)
from tspd.shell.decode import DecodePeer, open_decode_peer
from tspd.shell.http import HttpLimits
from tspd.shell.metrics import TspdMetrics
from tspd.testing.fake_engine import AsyncFakeEngine, FakeFabric
from tspd.testing.layouts import simple_contract

CONTRACT = simple_contract(num_pages=8, page_bytes=64)
LAYOUT = CONTRACT.to_json().decode("ascii")


def route(engine_rank: int = 0, **change: Any) -> dict[str, Any]:
    body = {
        "role": "Prefill",
        "world_size": 2,
        "dp_size": 1,
        "rank_ip": "127.0.0.1",
        "rank_port": 7000 + engine_rank,
        "engine_rank": engine_rank,
        "cache_layout": LAYOUT,
    }
    body.update(change)
    return body


@pytest.fixture
async def server() -> AsyncIterator[BootstrapServer]:
    async with open_bootstrap_server() as srv:
        yield srv


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(trust_env=False, timeout=5) as client:
        yield client


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# -- refusals are 4xx with a reason, counted, and never end the server ---------------


async def test_the_reported_puts_are_refused_400_and_leave_the_routes_alone(
    server: BootstrapServer, http: httpx.AsyncClient
) -> None:
    for rank in (0, 1):
        assert (await http.put(server.url + "/route", json=route(rank))).status_code == 200
    params = {"engine_rank": 0, "target_dp_group": 0}
    before = (await http.get(server.url + "/route", params=params)).json()
    for bad in (
        route(rank_ip="*"),
        route(rank_ip="foo bar"),
        route(world_size=2**70, dp_size=1),
        route(world_size=2**62, dp_size=2**62),
    ):
        r = await http.put(server.url + "/route", json=bad)
        assert r.status_code == 400, r.text
        assert "bootstrap PUT" in r.text
    r = await http.put(server.url + "/route", json=route(world_size=4, dp_size=2))
    assert r.status_code == 409
    assert "registered world_size=2 and dp_size=1" in r.text
    assert (await http.get(server.url + "/route", params=params)).json() == before
    assert server.state.registered_ranks == 2
    assert server.statistics() == {"bad_field": 4, "conflict": 1}


async def test_odd_requests_are_4xx_never_500(
    server: BootstrapServer, http: httpx.AsyncClient
) -> None:
    url = server.url
    cases: list[tuple[str, str, dict[str, Any], int]] = [
        ("GET", "/nothing", {}, 404),
        ("GET", "/" + "x" * 2000, {}, 404),
        ("POST", "/route", {}, 405),
        ("DELETE", "/health", {}, 405),
        ("TRACE", "/route", {}, 405),
        ("FOO", "/route", {}, 405),
        ("PUT", "/route", {"content": b"\xff\xfe"}, 400),
        ("PUT", "/route", {"content": b"[" * 100_000}, 400),
        ("PUT", "/route", {"content": b"null"}, 400),
        ("PUT", "/route", {"content": b" " * ((1 << 20) + 1)}, 413),
        ("GET", "/route", {"params": {"engine_rank": "1" * 5000, "target_dp_group": "0"}}, 400),
        ("GET", "/route", {"params": {"engine_rank": "x", "target_dp_group": "0"}}, 400),
        ("GET", "/route", {"params": {"engine_rank": "0"}}, 400),
    ]
    for method, path, kwargs, status in cases:
        r = await http.request(method, url + path, **kwargs)
        assert r.status_code == status, (method, path[:20], r.status_code, r.text[:200])
        assert r.text
    assert (await http.get(url + "/health")).status_code == 200
    counted = server.statistics()
    assert set(counted) <= set(REFUSAL_REASONS)
    assert sum(counted.values()) == len(cases)


async def test_an_answer_given_before_the_body_is_read_closes_the_connection(
    server: BootstrapServer, http: httpx.AsyncClient
) -> None:
    # The unread rest of such a body would be parsed as the next request, so the
    # server closes after answering; it must say so, or a client that reuses the
    # connection for its next request finds it closed under that request.
    url = server.url
    r = await http.put(url + "/route", content=b" " * ((1 << 20) + 1))
    assert r.status_code == 413
    assert r.headers.get("connection") == "close", r.headers
    assert (await http.get(url + "/health")).status_code == 200
    # Answers given after the whole body was read keep the connection.
    for r in (
        await http.put(url + "/route", json=route()),
        await http.put(url + "/nothing", content=b"{}"),
    ):
        assert r.status_code in (200, 404)
        assert r.headers.get("connection") != "close", r.headers


async def test_a_declared_oversized_body_is_refused_before_it_is_read(
    server: BootstrapServer,
) -> None:
    stream = await trio.open_tcp_stream("127.0.0.1", server.port)
    async with stream:
        await stream.send_all(
            b"PUT /route HTTP/1.1\r\nHost: t\r\nContent-Length: 999999999\r\n\r\n{"
        )
        with trio.fail_after(10):
            head = await stream.receive_some(4096)
    assert head.startswith(b"HTTP/1.1 413")
    assert server.statistics() == {"body_too_large": 1}


async def test_a_request_head_larger_than_the_bound_is_431_even_in_one_read(
    server: BootstrapServer,
) -> None:
    stream = await trio.open_tcp_stream("127.0.0.1", server.port)
    async with stream:
        padding = b"x" * (HttpLimits().max_header_bytes + 1024)
        await stream.send_all(b"GET /health HTTP/1.1\r\nHost: t\r\nX-Pad: " + padding + b"\r\n\r\n")
        with trio.fail_after(10):
            head = await stream.receive_some(4096)
    assert head.startswith(b"HTTP/1.1 431")


async def test_full_oversized_bodies_never_break_the_server(
    server: BootstrapServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A 2 MiB PUT sent whole, many times: each is refused 413 and no send races
    another (a trio stream refuses two senders at once)."""
    body = b"{" + b" " * (2 * 1024 * 1024 - 1)
    caplog.set_level(logging.ERROR)

    async def one() -> bytes:
        stream = await trio.open_tcp_stream("127.0.0.1", server.port)
        async with stream:
            head = b"PUT /route HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % len(body)
            # The server may answer and close before reading it all.
            with trio.move_on_after(10), contextlib.suppress(trio.BrokenResourceError):
                await stream.send_all(head + body)
            with trio.fail_after(10):
                return bytes(await stream.receive_some(4096))

    replies: list[bytes] = []

    async def run() -> None:
        replies.append(await one())

    async with trio.open_nursery() as nursery:
        for _ in range(20):
            nursery.start_soon(run)
    assert all(r.startswith(b"HTTP/1.1 413") or r == b"" for r in replies)
    assert not [r for r in caplog.records if "BusyResourceError" in (r.exc_text or "")]
    async with httpx.AsyncClient() as client:
        assert (await client.get(f"http://127.0.0.1:{server.port}/health")).status_code == 200


class Exploding(BootstrapState):
    """A state with a bug: every PUT raises."""

    def handle(self, method: str, path: str, query: Mapping[str, str], body: bytes) -> HttpReply:
        if method == "PUT":
            raise RuntimeError("a bug")
        return super().handle(method, path, query, body)


async def test_an_exception_answers_500_for_that_request_and_the_server_goes_on(
    http: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "tspd.bootstrap")
    async with open_bootstrap_server(state=Exploding()) as srv:
        for _ in range(3):
            r = await http.put(srv.url + "/route", json=route())
            assert r.status_code == 500
            assert "its log has the details" in r.text
        assert (await http.get(srv.url + "/health")).status_code == 200
        assert srv.statistics() == {"server_error": 3}
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1  # rate-limited, with the traceback
    assert errors[0].exc_info is not None


async def test_refusals_are_logged_once_per_client_and_reason(
    server: BootstrapServer, http: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "tspd.bootstrap")
    started = trio.current_time()
    for _ in range(30):
        await http.put(server.url + "/route", json=route(rank_ip="*"))
        await http.get(server.url + "/nothing")
    windows = 1 + int((trio.current_time() - started) // 10) + 1
    lines = [r for r in caplog.records if r.name == "tspd.bootstrap"]
    bad = [r for r in lines if getattr(r, "reason", None) == "bad_field"]
    assert 1 <= len(bad) <= windows
    assert bad[0].levelno == logging.WARNING
    assert "'*'" in bad[0].getMessage()
    assert "from 127.0.0.1" in bad[0].getMessage()
    probes = [r for r in lines if getattr(r, "reason", None) == "not_found"]
    assert 1 <= len(probes) <= windows
    assert probes[0].levelno == logging.INFO
    assert server.statistics() == {"bad_field": 30, "not_found": 30}


async def test_refusals_are_exported_as_a_metric(
    server: BootstrapServer, http: httpx.AsyncClient
) -> None:
    metrics = TspdMetrics(CollectorRegistry())
    metrics.watch_bootstrap(server.statistics)
    await http.put(server.url + "/route", json=route(rank_port=0))
    await http.put(server.url + "/route", json=route(rank_port=70000))
    await http.delete(server.url + "/route")
    text = metrics.render()[0].decode()
    assert 'tspd_bootstrap_rejected_requests_total{reason="bad_field"} 2.0' in text
    assert 'tspd_bootstrap_rejected_requests_total{reason="method_not_allowed"} 1.0' in text


# -- slow and many clients -----------------------------------------------------------

STALLED = (
    b"PUT /route HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
    b"Content-Length: 1000\r\n\r\n"
)


async def _closed_by_server(stream: trio.SocketStream) -> None:
    """Read until the server closes the connection."""
    while True:
        try:
            data = await stream.receive_some(4096)
        except trio.BrokenResourceError:
            return
        if not data:
            return


async def test_stalled_requests_are_closed_and_their_descriptors_released() -> None:
    limits = HttpLimits(request_timeout=1.0, keep_alive_timeout=1.0, read_timeout=2.0)
    async with open_bootstrap_server(limits=limits) as srv:
        baseline = open_fds()
        streams = [await trio.open_tcp_stream("127.0.0.1", srv.port) for _ in range(200)]
        for stream in streams:
            await stream.send_all(STALLED)
        # The server still answers while 200 requests hang.
        async with httpx.AsyncClient(trust_env=False, timeout=5) as http:
            assert (await http.get(srv.url + "/health")).status_code == 200
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for stream in streams:
                    nursery.start_soon(_closed_by_server, stream)
        for stream in streams:
            await stream.aclose()
        await wait_until(lambda: open_fds() <= baseline, step=0.05)
        assert srv.statistics() == {"request_timeout": 200}


async def test_a_request_trickling_in_is_closed_at_its_deadline() -> None:
    limits = HttpLimits(request_timeout=1.0, keep_alive_timeout=5.0, read_timeout=5.0)
    async with open_bootstrap_server(limits=limits) as srv:
        stream = await trio.open_tcp_stream("127.0.0.1", srv.port)
        async with stream:

            async def trickle() -> None:
                # One header byte every 0.1 s: each read is quick, the request never ends.
                for byte in b"GET /health HTTP/1.1\r\nX-Slow: " + b"a" * 1000:
                    try:
                        await stream.send_all(bytes([byte]))
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        return
                    await trio.sleep(0.1)

            with trio.fail_after(20):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(trickle)
                    await _closed_by_server(stream)
                    nursery.cancel_scope.cancel()
        assert srv.statistics() == {"request_timeout": 1}


async def test_connections_beyond_the_cap_are_closed_at_once() -> None:
    limits = HttpLimits(max_connections=5, keep_alive_timeout=30.0, read_timeout=30.0)
    async with open_bootstrap_server(limits=limits) as srv:
        held = [await trio.open_tcp_stream("127.0.0.1", srv.port) for _ in range(5)]
        extra = await trio.open_tcp_stream("127.0.0.1", srv.port)
        with trio.fail_after(10):
            await _closed_by_server(extra)
        await extra.aclose()
        assert srv.statistics() == {"connection_limit": 1}
        for stream in held:
            await stream.aclose()
        # Once they are gone, new clients are served again.
        async with httpx.AsyncClient(trust_env=False, timeout=5) as http:
            with trio.fail_after(10):
                for _ in iter(int, 1):  # until the server has noticed they are gone
                    try:
                        if (await http.get(srv.url + "/health")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    await trio.sleep(0.05)


def test_limits_are_checked() -> None:
    for bad in ({"request_timeout": 0}, {"read_timeout": float("inf")}, {"max_connections": 0}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            HttpLimits(**bad)


# -- clients: a bad address or a bad server fails the call, never the caller ----------


@pytest.mark.parametrize(
    "address", ["h:p", "[::1", "::1:5", "*:5", "foo bar:1", "x" * 300 + ":1", "h:0", "h:99999"]
)
async def test_an_unusable_bootstrap_address_is_bootstrap_unavailable(address: str) -> None:
    async with BootstrapClient() as client:
        with pytest.raises(BootstrapUnavailable, match="not a bootstrap address"):
            await client.get_parallel_info(address)
        assert not await client.health(address)
        assert client.addresses == []


class Replies(BootstrapState):
    """A server that checks nothing: answers every GET /route with ``body``."""

    def __init__(self, body: str) -> None:
        super().__init__()
        self.body = body

    def handle(self, method: str, path: str, query: Mapping[str, str], body: bytes) -> HttpReply:
        if path == "/route":
            return HttpReply(200, self.body, "application/json")
        return super().handle(method, path, query, body)


async def test_an_oversized_reply_fails_the_call() -> None:
    huge = json.dumps({"rank_ip": "h", "rank_port": 1, "pad": "x" * MAX_REPLY_BYTES})
    async with open_bootstrap_server(state=Replies(huge)) as srv, BootstrapClient() as client:
        with pytest.raises(BootstrapUnavailable, match="over 1048576"):
            await client.get_rank_info(srv.address, 0, 0)


async def test_a_route_with_an_unusable_address_is_a_wire_error() -> None:
    reply = json.dumps({"rank_ip": "*", "rank_port": 5000})
    async with open_bootstrap_server(state=Replies(reply)) as srv, BootstrapClient() as client:
        with pytest.raises(WireError, match="no usable endpoint"):
            await client.get_rank_info(srv.address, 0, 0)


async def _failure_reason(decode: DecodePeer, rid: str) -> str:
    with trio.fail_after(10):
        while True:
            for event in await decode.poll():
                if event.rid == rid:
                    assert isinstance(event, Failed), event
                    return event.reason
            await trio.sleep(0.005)


def _decode(contract: CacheContract) -> DecodeConfig:
    return DecodeConfig(1, 0, contract, 1, "", "", 1)


async def test_a_decode_fails_the_room_on_a_garbage_route_and_keeps_running() -> None:
    """A server that is not tspd's hands out ``rank_ip: "*"``; the room fails with
    the reason, the peer lives on (libzmq would refuse ``tcp://*:5000``)."""
    info = {"prefill_tp_size": 1, "prefill_dp_size": 1, "cache_layout": LAYOUT}

    class Garbage(BootstrapState):
        def handle(
            self, method: str, path: str, query: Mapping[str, str], body: bytes
        ) -> HttpReply:
            if query.get("engine_rank") == "-1":
                return HttpReply.json(info)
            return HttpReply.json({"rank_ip": "*", "rank_port": 5000})

    with HostArena.for_contract(CONTRACT) as arena:
        async with (
            open_bootstrap_server(state=Garbage()) as srv,
            open_decode_peer(_decode(CONTRACT), AsyncFakeEngine(fabric=FakeFabric()), arena) as d,
        ):
            d.register_request("r1", 11, srv.address)
            reason = await _failure_reason(d, "r1")
            assert (
                reason == "Could not fetch bootstrap info for engine rank: 0 and target_dp_group: 0"
            )
            for rid, room, address in (("r2", 12, "h:p"), ("r3", 13, "x" * 300 + ":1")):
                d.register_request(rid, room, address)
                reason = await _failure_reason(d, rid)
                assert reason.startswith("Could not fetch prefill parallel info")
            assert d.statistics()["rooms"] == 0


# -- the rate-limited log helper -----------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_rate_limited_log_writes_one_line_per_peer_and_reason_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    logger = logging.getLogger("tspd.test.ratelimit")
    caplog.set_level(logging.INFO, logger.name)
    clock = Clock()
    log = RateLimitedLog(logger, interval=10.0, clock=clock)
    assert log.warning("10.0.0.1", "bad_field", "refused %s", "a")
    for _ in range(5):
        assert not log.warning("10.0.0.1", "bad_field", "refused %s", "b")
    assert log.warning("10.0.0.2", "bad_field", "refused %s", "c")  # another peer
    assert log.warning("10.0.0.1", "conflict", "refused %s", "d")  # another reason
    clock.now = 10.0
    assert log.warning("10.0.0.1", "bad_field", "refused %s", "e")
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "refused a",
        "refused c",
        "refused d",
        "refused e (5 similar lines suppressed in the last 10 s)",
    ]
    last = caplog.records[-1]
    assert (last.peer, last.reason, last.suppressed) == ("10.0.0.1", "bad_field", 5)  # type: ignore[attr-defined]
    assert log.suppressed_total == 5


def test_rate_limited_log_keeps_a_bounded_table(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("tspd.test.ratelimit")
    caplog.set_level(logging.INFO, logger.name)
    clock = Clock()
    log = RateLimitedLog(logger, interval=10.0, max_keys=8, clock=clock)
    written = sum(log.warning(f"10.0.{i // 256}.{i % 256}", "bad_field", "x") for i in range(1000))
    assert len(log) == 8
    assert written == 9  # 8 peers, then one line for every other peer together
    assert caplog.records[-1].peer == RateLimitedLog.OTHER_PEERS  # type: ignore[attr-defined]
    clock.now = 20.0  # every entry expired: new peers get their own line again
    assert log.warning("10.9.9.9", "bad_field", "x")
    assert len(log) <= 8
