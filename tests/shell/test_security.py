"""Secure mode (docs/security.md): CURVE on the PD sockets, identities checked by the
cores, the bootstrap server behind TLS and a token, and plain and secure peers
refusing each other. Real peers, a real bootstrap server, fake engines."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import trio
import zmq
from pd_helpers import poll_for, wait_until

from tspd.core import wire
from tspd.core.bootstrap import CURVE_KEY_FIELD, build_route_payload, encode_route_payload
from tspd.core.commands import Bootstrapped, Failed, RemotePrefillDone, Succeeded
from tspd.core.contract import CacheContract
from tspd.core.decode import DecodeConfig
from tspd.core.interop import bootstrap_token_and_candidates
from tspd.core.machines import RoomState
from tspd.core.manifest import build_manifest
from tspd.core.poll import TransferPoll
from tspd.core.prefill import PrefillConfig
from tspd.keys import KeyFiles, generate_keys
from tspd.shell.arena import HostArena, fill_room, verify_room
from tspd.shell.bootstrap import BootstrapClient, holder_alive, open_bootstrap_server
from tspd.shell.decode import DecodePeer, DecodeSettings, open_decode_peer
from tspd.shell.prefill import PrefillPeer, PrefillSettings, RemoteDecodeRow, open_prefill_peer
from tspd.shell.security import CurveKeys, SecurityConfig
from tspd.testing.fake_engine import AsyncFakeEngine, FakeFabric
from tspd.testing.layouts import PageAllocator, multi_layer_contract

SEED = 5
PROMPT = 10


def _contract() -> CacheContract:
    return multi_layer_contract(layers=2, num_pages=24, heads=4, head_dim=4, tp_size=1)


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> KeyFiles:
    """Key pairs for a Prefill, a Decode and an allow-listed rogue; TLS; a token."""
    return generate_keys(tmp_path_factory.mktemp("keys"), ["prefill", "decode", "rogue"])


@pytest.fixture(scope="module")
def stranger(tmp_path_factory: pytest.TempPathFactory) -> KeyFiles:
    """A key pair nobody allow-lists (its own allow-list holds only itself)."""
    return generate_keys(tmp_path_factory.mktemp("stranger"), ["stranger"], tls=False)


def security(keys: KeyFiles, name: str | None, **fields: object) -> SecurityConfig:
    return SecurityConfig.from_env(keys.env(name), **fields)


def curve(keys: KeyFiles, name: str) -> CurveKeys:
    keyset = security(keys, name).curve
    assert keyset is not None
    return keyset


def server_security(keys: KeyFiles, **fields: object) -> SecurityConfig:
    return SecurityConfig.from_env(keys.env(server=True), **fields)


@asynccontextmanager
async def _prefill(
    fabric: FakeFabric, bootstrap: str, sec: SecurityConfig | None
) -> AsyncIterator[PrefillPeer]:
    contract = _contract()
    with HostArena.for_contract(contract) as arena:
        cfg = PrefillConfig(tp_size=1, tp_rank=0, contract=contract, arena_base=1)
        settings = PrefillSettings(bootstrap_addr=bootstrap, security=sec)
        async with open_prefill_peer(
            cfg, AsyncFakeEngine(fabric=fabric), arena, settings=settings
        ) as peer:
            yield peer


@asynccontextmanager
async def _decode(fabric: FakeFabric, sec: SecurityConfig | None) -> AsyncIterator[DecodePeer]:
    contract = _contract()
    with HostArena.for_contract(contract) as arena:
        cfg = DecodeConfig(1, 0, contract, 1, "", "", 1, waiting_timeout=5)
        settings = DecodeSettings(security=sec)
        async with open_decode_peer(
            cfg, AsyncFakeEngine(fabric=fabric), arena, settings=settings
        ) as peer:
            yield peer


async def _bootstrapped(prefill: PrefillPeer, decode: DecodePeer, rid: str, room: int, addr: str):  # type: ignore[no-untyped-def]
    """Both sides past the bootstrap: the Decode pre-allocated, the Prefill's room is
    ready for its hand-over. Returns the Decode's manifest and the Prefill's tables."""
    prefill.register_request(rid, room)
    decode.register_request(rid, room, addr)
    event = await poll_for(decode, rid)
    assert isinstance(event, Bootstrapped), event
    contract = decode.core.config.contract
    manifest = build_manifest(contract, PageAllocator(contract).allocate(PROMPT), 0, PROMPT)
    decode.send_preallocation(room, manifest)
    event = await poll_for(prefill, rid)
    assert isinstance(event, Bootstrapped), event
    pcontract = prefill.core.config.contract
    tables = PageAllocator(pcontract).allocate(PROMPT)
    fill_room(
        prefill.arena,
        pcontract,
        build_manifest(pcontract, tables, 0, PROMPT),
        seed=SEED,
        room=room,
        tp_size=1,
        tp_rank=0,
    )
    return manifest, tables


async def _hand_over_and_finish(
    prefill: PrefillPeer,
    decode: DecodePeer,
    rid: str,
    room: int,
    manifest,
    tables,  # type: ignore[no-untyped-def]
) -> None:
    token, candidates = bootstrap_token_and_candidates(SEED, room, 2)
    prefill.hand_over([RemoteDecodeRow(rid, tables, token, candidates)])
    done = await poll_for(decode, rid)
    assert isinstance(done, RemotePrefillDone), done
    assert (done.bootstrap_token, done.spec_candidate_ids) == (token, candidates)
    contract = decode.core.config.contract
    assert (
        verify_room(decode.arena, contract, manifest, seed=SEED, room=room, tp_size=1, tp_rank=0)
        == []
    )
    assert isinstance(await poll_for(prefill, rid), Succeeded)


async def test_a_secure_room_completes_over_curve_tls_and_a_token(keys: KeyFiles) -> None:
    fabric = FakeFabric()
    async with (
        open_bootstrap_server(security=server_security(keys)) as server,
        _prefill(fabric, server.address, security(keys, "prefill")) as prefill,
        _decode(fabric, security(keys, "decode")) as decode,
    ):
        assert server.url.startswith("https://")
        assert prefill.registered_with_bootstrap
        manifest, tables = await _bootstrapped(prefill, decode, "r", 77, server.address)
        await _hand_over_and_finish(prefill, decode, "r", 77, manifest, tables)


def _forger(
    keys: KeyFiles | None, name: str | None, server_key: str, port: int
) -> zmq.Socket[bytes]:
    """A PUSH to the Decode status socket: a CURVE client with ``name``'s keys, or
    plain (no keys)."""
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None and name is not None:
        public, secret = zmq.auth.load_certificate(keys.curve[name][1])
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
        sock.setsockopt(zmq.CURVE_SERVERKEY, server_key.encode())
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


async def test_forged_success_from_strangers_and_wrong_identities_never_touches_the_room(
    keys: KeyFiles, stranger: KeyFiles, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="tspd")
    fabric = FakeFabric()
    room = 4242
    async with (
        open_bootstrap_server(security=server_security(keys)) as server,
        _prefill(fabric, server.address, security(keys, "prefill")) as prefill,
        _decode(fabric, security(keys, "decode")) as decode,
    ):
        status_key = keys.public_key("decode")
        manifest, tables = await _bootstrapped(prefill, decode, "r", room, server.address)
        # The Decode registered over CURVE: its identity is its status socket's key.
        assert prefill.core.route_identity("127.0.0.1", decode.status_port) == status_key
        forged = wire.encode_status(
            wire.StatusMessage(room, TransferPoll.SUCCESS, 0, bootstrap_token=99, cached_tokens=1)
        )
        forgers = [
            _forger(stranger, "stranger", status_key, decode.status_port),  # not allow-listed
            _forger(keys, "rogue", status_key, decode.status_port),  # allow-listed, not the rank
            _forger(None, None, status_key, decode.status_port),  # plain
        ]
        try:
            for sock in forgers:
                sock.send_multipart(forged)
            assert decode.curve is not None
            await wait_until(lambda: decode.curve.refused >= 1)  # type: ignore[union-attr]
            await wait_until(lambda: "is not the key the bootstrap route gave" in caplog.text)
            await wait_until(lambda: "does not speak CURVE" in caplog.text)
            await trio.sleep(0.1)
            assert decode.room_state(room) is RoomState.WAITING_FOR_INPUT
            assert not [e for e in await decode.poll() if e.rid == "r"]
            assert keys.public_key("rogue") in caplog.text
            assert stranger.public_key("stranger") in caplog.text  # the ZAP refusal names it
        finally:
            for sock in forgers:
                sock.close(linger=0)
        # The real Prefill still completes the room, with its own token.
        await _hand_over_and_finish(prefill, decode, "r", room, manifest, tables)


def _client(keys: KeyFiles) -> httpx.AsyncClient:
    import ssl

    assert keys.ca_file is not None
    return httpx.AsyncClient(verify=ssl.create_default_context(cafile=str(keys.ca_file)))


def _token(keys: KeyFiles) -> str:
    assert keys.token_file is not None
    return Path(keys.token_file).read_text().strip()


async def test_route_hijack_needs_the_token_and_the_same_identity_while_the_rank_lives(
    keys: KeyFiles,
) -> None:
    fabric = FakeFabric()
    contract = _contract()
    async with open_bootstrap_server(security=server_security(keys)) as server:
        url = f"https://{server.address}/route"
        mine = keys.public_key("prefill")

        def body(port: int, key: str | None) -> bytes:
            payload = build_route_payload(
                rank_ip="127.0.0.1",
                rank_port=port,
                engine_rank=0,
                world_size=1,
                dp_size=1,
                cache_layout=contract.to_json(),
            )
            if key is not None:
                payload[CURVE_KEY_FIELD] = key
            return encode_route_payload(payload)

        def bearer(token: str) -> dict[str, str]:
            return {"Authorization": f"Bearer {token}"}

        async with _client(keys) as http:
            async with _prefill(fabric, server.address, security(keys, "prefill")) as prefill:
                route = await http.get(url, params={"engine_rank": 0, "target_dp_group": 0})
                assert route.json() == {
                    "rank_ip": "127.0.0.1",
                    "rank_port": prefill.control_port,
                    CURVE_KEY_FIELD: mine,
                }
                hijack = body(1, keys.public_key("rogue"))
                assert (await http.put(url, content=hijack)).status_code == 401
                wrong = await http.put(url, content=hijack, headers=bearer("not-the-token"))
                assert wrong.status_code == 403
                held = await http.put(url, content=hijack, headers=bearer(_token(keys)))
                assert held.status_code == 409
                assert "held by a live rank of another identity" in held.text
                plain = await http.put(url, content=body(1, None), headers=bearer(_token(keys)))
                assert plain.status_code == 409
                again = await http.get(url, params={"engine_rank": 0, "target_dp_group": 0})
                assert again.json() == route.json()
                stats = server.statistics()
                assert stats["unauthorized"] == 2
                assert stats["identity_conflict"] == 2
                # The same identity may re-register (a restart), with the token.
                same = await http.put(
                    url, content=body(prefill.control_port, mine), headers=bearer(_token(keys))
                )
                assert same.status_code == 200
            # The holder is gone (its control endpoint refuses connections): another
            # identity may take the route over. libzmq closes a listener in its I/O
            # thread after the socket is closed, so wait until the port refuses.
            with trio.fail_after(10):
                while await holder_alive("127.0.0.1", route.json()["rank_port"]):  # noqa: ASYNC110
                    await trio.sleep(0.02)  # nothing to wait on: the port is libzmq's
            taken = await http.put(url, content=body(2, None), headers=bearer(_token(keys)))
            assert taken.status_code == 200, taken.text


async def test_get_routes_need_the_token_when_protected(keys: KeyFiles) -> None:
    async with (
        open_bootstrap_server(security=server_security(keys, protect_get=True)) as server,
        _client(keys) as http,
    ):
        url = f"https://{server.address}/route"
        params = {"engine_rank": -1, "target_dp_group": -1}
        assert (await http.get(url, params=params)).status_code == 401
        answer = await http.get(
            url, params=params, headers={"Authorization": f"Bearer {_token(keys)}"}
        )
        assert answer.status_code == 503  # authorised; no rank registered yet
        assert (await http.get(f"https://{server.address}/health")).status_code == 200


async def _fails(decode: DecodePeer, addr: str, room: int) -> Failed:
    decode.register_request("x", room, addr)
    event = await poll_for(decode, "x")
    assert isinstance(event, Failed), event
    return event


async def test_a_plain_decode_refuses_a_secure_prefill_with_a_clear_error(
    keys: KeyFiles, caplog: pytest.LogCaptureFixture
) -> None:
    fabric = FakeFabric()
    async with (
        open_bootstrap_server() as server,  # plain HTTP: the ranks' modes differ
        _prefill(fabric, server.address, security(keys, "prefill", tls_ca_file=None)),
        _decode(fabric, None) as decode,
    ):
        event = await _fails(decode, server.address, 11)
        assert event.reason.startswith("Could not fetch bootstrap info for engine rank: 0")
        assert "runs tspd secure mode" in caplog.text
        assert "this Decode runs plain mode" in caplog.text


async def test_a_secure_decode_refuses_a_plain_prefill_with_a_clear_error(
    keys: KeyFiles, caplog: pytest.LogCaptureFixture
) -> None:
    fabric = FakeFabric()
    async with (
        open_bootstrap_server() as server,
        _prefill(fabric, server.address, None),
        _decode(fabric, security(keys, "decode", tls_ca_file=None)) as decode,
    ):
        await _fails(decode, server.address, 12)
        assert "runs plain mode (its bootstrap route has no CURVE key)" in caplog.text


async def test_a_plain_decode_is_told_the_bootstrap_server_speaks_https_only(
    keys: KeyFiles, caplog: pytest.LogCaptureFixture
) -> None:
    fabric = FakeFabric()
    async with (
        open_bootstrap_server(security=server_security(keys)) as server,
        _prefill(fabric, server.address, security(keys, "prefill")),
        _decode(fabric, None) as decode,
    ):
        event = await _fails(decode, server.address, 13)
        assert "parallel info" in event.reason
        assert "speaks HTTPS only" in caplog.text
        assert server.statistics()["tls_required"] >= 1


async def test_a_secure_client_refuses_a_plain_bootstrap_server(keys: KeyFiles) -> None:
    from tspd.shell.bootstrap import BootstrapUnavailable

    async with (
        open_bootstrap_server() as server,
        BootstrapClient(security=security(keys, "decode")) as client,
    ):
        with pytest.raises(BootstrapUnavailable, match="this client speaks HTTPS"):
            await client.get_parallel_info(server.address)


async def test_a_secure_kv_event_subscriber_ignores_a_rogue_publisher(keys: KeyFiles) -> None:
    from tspd.core.kv_config import KVEventsConfig
    from tspd.core.kv_events import BlockRemoved
    from tspd.shell.kv_publisher import open_kv_publisher
    from tspd.shell.kv_subscriber import EventSource, ReceivedBatch, open_kv_subscriber
    from tspd.shell.ports import free_port

    real, taken = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    mine, rogue = curve(keys, "prefill"), curve(keys, "rogue")  # rogue: allow-listed
    sub_keys = curve(keys, "decode")

    def config(endpoint: str) -> KVEventsConfig:
        return KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint)

    sources = [
        EventSource(real, name="real", server_key=mine.public_key),
        # The rogue took the port the subscriber expects the real publisher on.
        EventSource(taken, name="taken", server_key=mine.public_key),
    ]
    async with (
        open_kv_publisher(config(real.replace("127.0.0.1", "*")), curve=mine) as pub,
        open_kv_publisher(config(taken.replace("127.0.0.1", "*")), curve=rogue) as fake,
        open_kv_subscriber(sources, curve=sub_keys) as sub,
    ):
        seen: dict[str, int] = {}
        with trio.fail_after(10):
            while "real" not in seen:
                await pub.apublish([BlockRemoved((1,))])
                await fake.apublish([BlockRemoved((666,))])
                with trio.move_on_after(0.05):
                    while True:
                        item = await sub.receive()
                        if isinstance(item, ReceivedBatch):
                            seen[item.source] = seen.get(item.source, 0) + 1
        for _ in range(20):
            await fake.apublish([BlockRemoved((666,))])
        await trio.sleep(0.2)
        with trio.move_on_after(0.1):
            while True:
                item = await sub.receive()
                if isinstance(item, ReceivedBatch):
                    seen[item.source] = seen.get(item.source, 0) + 1
        assert "taken" not in seen, seen


async def test_a_binding_secure_subscriber_reads_only_its_publisher(keys: KeyFiles) -> None:
    from tspd.core.kv_config import KVEventsConfig
    from tspd.core.kv_events import BlockRemoved
    from tspd.shell.kv_publisher import open_kv_publisher
    from tspd.shell.kv_subscriber import EventSource, ReceivedBatch, open_kv_subscriber
    from tspd.shell.ports import free_port

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    mine, rogue = curve(keys, "prefill"), curve(keys, "rogue")  # rogue: allow-listed
    sub_keys = curve(keys, "decode")
    source = EventSource(endpoint, name="bound", bind=True, server_key=mine.public_key)
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint)
    async with (
        open_kv_subscriber([source], curve=sub_keys) as sub,
        open_kv_publisher(config, curve=rogue, server_key=sub_keys.public_key) as fake,
        open_kv_publisher(config, curve=mine, server_key=sub_keys.public_key) as pub,
    ):
        got: list[ReceivedBatch] = []
        with trio.fail_after(10):
            while len(got) < 3:
                await fake.apublish([BlockRemoved((666,))])
                await pub.apublish([BlockRemoved((1,))])
                with trio.move_on_after(0.05):
                    while True:
                        item = await sub.receive()
                        if isinstance(item, ReceivedBatch):
                            got.append(item)
        assert all(b.batch.events == (BlockRemoved((1,)),) for b in got), got


async def test_a_secure_replica_agreement_counts_only_each_rank_s_identity(
    keys: KeyFiles,
) -> None:
    from tspd.shell.agreement import ZmqAgreement, _encode
    from tspd.shell.ports import free_port

    endpoints = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    names = ("prefill", "decode")
    peer_keys = [keys.public_key(n) for n in names]
    rogue = _forger(keys, "rogue", peer_keys[0], int(endpoints[0].rsplit(":", 1)[1]))
    try:
        async with (
            ZmqAgreement(0, endpoints, curve=curve(keys, names[0]), peer_keys=peer_keys) as a,
            ZmqAgreement(1, endpoints, curve=curve(keys, names[1]), peer_keys=peer_keys) as b,
        ):
            # The rogue (allow-listed, not rank 1) votes Failed for rank 1 in round 0.
            rogue.send_multipart(_encode(0, 1, [0, 0]))
            await trio.sleep(0.05)
            results: dict[int, list[int]] = {}

            async def run(agreement: ZmqAgreement, values: list[int]) -> None:
                results[agreement.rank] = await agreement.agree(values)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(run, a, [3, 4])
                nursery.start_soon(run, b, [4, 2])
            assert results == {0: [3, 2], 1: [3, 2]}
    finally:
        rogue.close(linger=0)


async def test_plain_mode_is_unchanged_on_the_wire() -> None:
    """A plain rank's PUT carries no key and its route reply is TokenSpeed's two
    fields, byte for byte."""
    fabric = FakeFabric()
    async with (
        open_bootstrap_server() as server,
        _prefill(fabric, server.address, None) as prefill,
        httpx.AsyncClient() as http,
    ):
        assert prefill.curve is None
        reply = await http.get(
            f"http://{server.address}/route", params={"engine_rank": 0, "target_dp_group": 0}
        )
        assert reply.content == (
            b'{"rank_ip": "127.0.0.1", "rank_port": %d}' % prefill.control_port
        )
