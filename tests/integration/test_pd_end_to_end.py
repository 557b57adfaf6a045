"""PD end to end: real processes, real ZMQ on 127.0.0.1, real Mooncake over TCP, bytes verified.

The first tests run ``tspd demo``'s orchestrator (bootstrap server, Prefill group
and Decode group, each rank its own process). The failure-path tests run one side
in this process — where its tables can be inspected — and the other as a
``tspd demo`` role process that the test kills, stops or confuses, then check that
the room ended ``Failed`` with a reason naming what happened on both sides, that
the in-process peer keeps serving, and that its tables are empty afterwards.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing
import zmq

from tspd.core import wire
from tspd.core.commands import Bootstrapped, Event, Failed, RemotePrefillDone, Succeeded
from tspd.core.decode import DecodeConfig
from tspd.core.interop import bootstrap_token_and_candidates
from tspd.core.manifest import build_manifest
from tspd.core.prefill import PrefillConfig
from tspd.demo.orchestrate import DemoOptions, RoleProcess, run_demo, spawn, tspd_argv
from tspd.demo.workload import Workload
from tspd.shell.arena import HostArena, fill_room, verify_room
from tspd.shell.bootstrap import open_bootstrap_server
from tspd.shell.decode import DecodePeer, DecodeSettings, open_decode_peer
from tspd.shell.engine_setup import open_mooncake_engine
from tspd.shell.offload import EngineRunner
from tspd.shell.ports import free_port
from tspd.shell.prefill import (
    PrefillPeer,
    PrefillSettings,
    ReleaseRefused,
    RemoteDecodeRow,
    open_prefill_peer,
)
from tspd.testing.layouts import PageAllocator
from tspd.testing.procs import stop_process

pytest.importorskip("mooncake.engine")

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(180)]

SEED = 7
PREFILL_EMPTY = ("rooms", "tracked_requests", "unclaimed", "destinations", "metadata", "usage")
DECODE_EMPTY = ("rooms", "tracked_requests", "routes", "completions", "waiting", "tracker_rooms")


def _workload(rooms: range, **changes: Any) -> Workload:
    values: dict[str, Any] = {"rooms": rooms, "seed": SEED, "num_pages": 512, "max_prompt_pages": 4}
    values.update(changes)
    return Workload(**values)


# ----------------------------------------------------------------------------- demo runs


_THREAD = ("--driver", "thread")


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "layerwise", "heads", "driver_args"),
    [
        pytest.param(2, 1, False, 4, (), id="full-tp2-to-tp1"),
        pytest.param(1, 2, True, 4, (), id="layerwise-tp1-to-tp2"),
        pytest.param(4, 1, False, 2, (), id="full-tp4-to-tp1-dummy-ranks"),
        pytest.param(2, 2, True, 4, (), id="layerwise-tp2-equal"),
        # Every scheduler a plain thread (tspd.hosts.threads): a group of one
        # concludes eagerly, a TP group polls together through the facade; the
        # layerwise forward arms and hands over through the Prefill's outbox.
        pytest.param(2, 1, False, 4, _THREAD, id="full-tp2-to-tp1-thread-schedulers"),
        pytest.param(1, 2, True, 4, _THREAD, id="layerwise-tp1-to-tp2-thread-schedulers"),
    ],
)
async def test_demo_moves_verified_bytes(
    prefill_tp: int, decode_tp: int, layerwise: bool, heads: int, driver_args: tuple[str, ...]
) -> None:
    options = DemoOptions(
        workload=_workload(range(5000, 5024), global_heads=heads, candidates=2),
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        in_flight=8,
        layerwise=layerwise,
        scatter=layerwise,
        timeout=120,
        prefill_args=driver_args,
        decode_args=driver_args,
    )
    summary = await run_demo(options)
    assert summary.errors == []
    assert summary.reasons == {}
    assert (summary.succeeded, summary.failed) == (24, 0)
    assert summary.bytes_verified > 0
    # Every Decode rank reported when each room ended on its peer and when its
    # scheduler saw it.
    assert len(summary.scheduler_lags) == 24 * decode_tp
    assert all(0 <= lag < 10 for lag in summary.scheduler_lags)
    for name, stats in summary.stats.items():
        keys = DECODE_EMPTY if name.startswith("decode") else PREFILL_EMPTY
        assert all(stats[k] == 0 for k in keys), (name, stats)


@pytest.mark.parametrize("scatter", [True, False], ids=["scattered", "contiguous"])
async def test_large_rooms_of_thousands_of_pages_move_verified_bytes(scatter: bool) -> None:
    """Rooms of 2,600 pages: scattered, 10,400 copies each — five times what Mooncake's
    TCP transport takes to one peer at once — so the Prefill pipelines its batches
    (the first room's first batch opens the peer through a thread); contiguous, a
    few large copies. Every byte is verified on the Decode side."""
    pages, rooms = 2600, 3
    options = DemoOptions(
        workload=_workload(
            range(5200, 5200 + rooms), num_pages=pages + 64, fixed_prompt_pages=pages, head_dim=16
        ),
        prefill_tp=1,
        decode_tp=1,
        in_flight=1,
        scatter=scatter,
        timeout=120,
    )
    summary = await run_demo(options)
    assert summary.errors == []
    assert summary.reasons == {}
    assert (summary.succeeded, summary.failed) == (rooms, 0)
    # 2 layers of K and V, 4 heads × 16 tokens × 16 dims of bfloat16 a page.
    assert summary.bytes_verified == rooms * pages * 4 * (4 * 16 * 16 * 2)
    if scatter:
        prefill = summary.stats["prefill-0"]
        assert prefill["descriptors"] > rooms * 2048
        # Engine calls of at most 512 copies: half the TCP queue, two in flight.
        assert prefill["engine_calls"] >= prefill["descriptors"] / 512


@pytest.mark.parametrize("driver_args", [(), _THREAD], ids=["trio", "thread-schedulers"])
async def test_demo_reports_every_room_failed_when_the_bytes_differ(
    driver_args: tuple[str, ...],
) -> None:
    """A Decode that expects another seed's pattern sees wrong bytes and a wrong
    token in every room: the demo says both, room by room, counts the rooms under
    the Prefill session they came from, and is not ok (whichever kind of thread
    runs the schedulers)."""
    options = DemoOptions(
        workload=_workload(range(5100, 5106), fixed_prompt_pages=2),
        prefill_tp=1,
        decode_tp=1,
        in_flight=4,
        timeout=60,
        prefill_args=driver_args,
        decode_args=("--seed", str(SEED + 1), *driver_args),
    )
    summary = await run_demo(options)
    assert summary.errors == []
    assert not summary.ok
    assert (summary.succeeded, summary.failed) == (0, 6)
    for reason in summary.reasons.values():
        assert "differ from the pattern" in reason
        assert "byte mismatch" in reason
        assert "another seed's pattern" in reason
    [sessions] = summary.failed_sessions.values()
    [session] = sessions.values()
    assert session["rooms"] == 6
    assert session["first_room"] == 5100
    # The ranks' last log lines come with it (tspd bench pd prints them in the row).
    assert "failed 6 of 6 rooms" in summary.role_logs["decode-0"], summary.role_logs


async def test_demo_without_speculative_candidates() -> None:
    """``--spec-candidates 0`` on both roles: no candidates sent, none expected."""
    options = DemoOptions(
        workload=_workload(range(5200, 5204), candidates=0),
        prefill_tp=1,
        decode_tp=1,
        in_flight=4,
        timeout=60,
    )
    summary = await run_demo(options)
    assert summary.errors == []
    assert (summary.succeeded, summary.failed) == (4, 0)
    assert summary.failed_sessions == {}


# ------------------------------------------------------------- one side in this process


class RoleWatcher:
    """A role process's JSON records, with waits on them."""

    def __init__(self, role: RoleProcess) -> None:
        self.role = role

    def find(self, event: str, **match: Any) -> dict[str, Any] | None:
        for record in self.role.records:
            if record.get("event") == event and all(record.get(k) == v for k, v in match.items()):
                return record
        return None

    async def wait(self, event: str, limit: float = 30, **match: Any) -> dict[str, Any]:
        with trio.fail_after(limit):
            while (record := self.find(event, **match)) is None:
                if self.role.finished.is_set() and self.find(event, **match) is None:
                    raise AssertionError(
                        f"{self.role.name} exited before {event} {match}:\n{self.role.log_tail()}"
                    )
                await trio.sleep(0.01)
        return record


def _workload_args(workload: Workload) -> list[str]:
    args = ["--seed", str(workload.seed), "--pages", str(workload.num_pages)]
    args += ["--max-prompt-pages", str(workload.max_prompt_pages)]
    if workload.fixed_prompt_pages is not None:
        args += ["--fixed-prompt-pages", str(workload.fixed_prompt_pages)]
    return args


@asynccontextmanager
async def role_process(
    nursery: trio.Nursery, workload: Workload, role: str, *args: str
) -> AsyncIterator[RoleWatcher]:
    log_dir = tempfile.mkdtemp(prefix="tspd-e2e-")
    argv = tspd_argv("demo", role, *_workload_args(workload), *args)
    process = await spawn(nursery, role, argv, lambda role, record: None, log_dir)
    try:
        yield RoleWatcher(process)
    finally:
        with contextlib.suppress(ProcessLookupError):
            process.process.send_signal(signal.SIGCONT)
            process.process.kill()


def _prefill_config(workload: Workload, **changes: Any) -> PrefillConfig:
    values: dict[str, Any] = {
        "tp_size": 1,
        "tp_rank": 0,
        "contract": workload.contract(1),
        "arena_base": 1,
        "transfer_workers": 2,
        "bootstrap_timeout": 30.0,
        "failed_session_ttl": 30.0,
    }
    values.update(changes)
    return PrefillConfig(**values)


@asynccontextmanager
async def mooncake_runner() -> AsyncIterator[EngineRunner]:
    """A Mooncake engine on 127.0.0.1 behind an EngineRunner, built and closed in
    worker threads."""
    async with open_mooncake_engine("127.0.0.1") as engine:
        yield EngineRunner(engine)


@asynccontextmanager
async def in_process_prefill(
    workload: Workload, **changes: Any
) -> AsyncIterator[tuple[PrefillPeer, str]]:
    """A bootstrap server and one Prefill rank (TP 1) on Mooncake, in this process."""
    config = _prefill_config(workload, **changes)
    async with mooncake_runner() as engine:
        with HostArena.for_contract(config.contract) as arena:
            async with open_bootstrap_server() as server:
                settings = PrefillSettings(bootstrap_addr=server.address)
                async with open_prefill_peer(config, engine, arena, settings=settings) as peer:
                    assert peer.registered_with_bootstrap
                    yield peer, server.address


async def poll_for(peer: PrefillPeer | DecodePeer, rid: str, limit: float = 30) -> Event:
    with trio.fail_after(limit):
        while True:
            for event in await peer.poll():
                if event.rid == rid:
                    return event
            with trio.move_on_after(0.01):
                await peer.wait_for_activity()


async def prefill_room(
    peer: PrefillPeer,
    workload: Workload,
    room: int,
    *,
    before_hand_over: Callable[[], Any] | None = None,
) -> Event:
    """Serve one room on an in-process Prefill rank: wait for Bootstrapped, write the
    pattern, hand over, wait for the end."""
    rid = workload.rid(room)
    peer.register_request(rid, room)
    event = await poll_for(peer, rid)
    if not isinstance(event, Bootstrapped):
        return event
    contract = peer.core.config.contract
    prompt = workload.prompt_len(room, contract)
    tables = PageAllocator(contract).allocate(prompt)
    fill_room(
        peer.arena, contract, build_manifest(contract, tables, 0, prompt), seed=SEED, room=room
    )
    if before_hand_over is not None:
        await before_hand_over()
    token, candidates = bootstrap_token_and_candidates(SEED, room, workload.candidates)
    peer.hand_over([RemoteDecodeRow(rid, tables, token, candidates)])
    return await poll_for(peer, rid)


def _assert_prefill_empty(peer: PrefillPeer) -> None:
    stats = peer.statistics()
    assert all(stats[k] == 0 for k in PREFILL_EMPTY), stats


async def test_decode_killed_mid_transfer_fails_the_room_and_prefill_keeps_serving(
    nursery: trio.Nursery,
) -> None:
    workload = _workload(range(100, 102))
    async with in_process_prefill(workload) as (peer, bootstrap):
        async with role_process(
            nursery, workload, "decode", "--rooms", "100:101", "--bootstrap", bootstrap
        ) as decode:
            await decode.wait("preallocated", room=100)

            async def kill_decode() -> None:
                decode.role.process.kill()
                await decode.role.process.wait()

            event = await prefill_room(peer, workload, 100, before_hand_over=kill_decode)
            assert isinstance(event, Failed)
            assert event.reason.startswith(
                "CachePD transfer failed: Mooncake transfer failed for 127.0.0.1:"
            )
        # A new Decode process (a new session) is served as before.
        async with role_process(
            nursery, workload, "decode", "--rooms", "101:102", "--bootstrap", bootstrap
        ) as decode:
            event = await prefill_room(peer, workload, 101)
            assert isinstance(event, Succeeded)
            record = await decode.wait("room", room=101)
            assert record["ok"], record
        _assert_prefill_empty(peer)


async def test_decode_that_never_preallocates_hits_the_bootstrap_timeout(
    nursery: trio.Nursery,
) -> None:
    workload = _workload(range(200, 202))
    async with in_process_prefill(workload, bootstrap_timeout=1.5) as (peer, bootstrap):
        async with role_process(
            nursery,
            workload,
            "decode",
            "--rooms",
            "200:201",
            "--bootstrap",
            bootstrap,
            "--never-preallocate",
        ):
            event = await prefill_room(peer, workload, 200)
            assert isinstance(event, Failed)
            assert event.reason.startswith("Request 200 timed out after 1.")
            assert event.reason.endswith("s in TransferPoll.Bootstrapping")
        async with role_process(
            nursery, workload, "decode", "--rooms", "201:202", "--bootstrap", bootstrap
        ) as decode:
            # The 1.5 s timeout runs from register_request: let the new process start
            # (a loaded CI host took longer than that to import and register) and
            # pre-allocate first, so only the first room tests the timeout.
            await decode.wait("preallocated", room=201)
            assert isinstance(await prefill_room(peer, workload, 201), Succeeded)
        await trio.sleep(0.1)
        _assert_prefill_empty(peer)


async def test_conflicting_and_malformed_registrations(nursery: trio.Nursery) -> None:
    workload = _workload(range(300, 302))
    async with in_process_prefill(workload) as (peer, bootstrap):
        ctx = zmq.Context.instance()
        raw = ctx.socket(zmq.PUSH)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(f"tcp://127.0.0.1:{peer.control_port}")
        try:
            async with role_process(
                nursery, workload, "decode", "--rooms", "300:301", "--bootstrap", bootstrap
            ) as decode:
                ready = await decode.wait("ready")
                await decode.wait("preallocated", room=300)
                rid = workload.rid(300)
                peer.register_request(rid, 300)
                assert isinstance(await poll_for(peer, rid), Bootstrapped)
                # Malformed messages are dropped; nothing changes.
                raw.send_multipart([b"None", b"only two frames"])
                raw.send_multipart([b"\xff"])
                # The same session registers again with a different arena: a conflict.
                contract = workload.contract(1)
                conflicting = wire.Registration(
                    endpoint="127.0.0.1",
                    port=int(ready["status"].rsplit(":", 1)[1]),
                    session_id=ready["session"],
                    arena_base=int(ready["arena_base"]) + 4096,
                    contract=contract,
                    contract_bytes=contract.to_json(),
                    decode_tp_size=1,
                    decode_tp_rank=0,
                )
                raw.send_multipart(wire.encode_registration(conflicting))
                event = await poll_for(peer, rid)
                assert isinstance(event, Failed)
                assert event.reason == (
                    f"Decode session {ready['session']} registration rejected: "
                    "conflicting registration for an active CachePD session"
                )
                record = await decode.wait("room", room=300)
                assert not record["ok"]
                assert record["reason"] == (
                    "Failed to get kvcache from prefill instance, it might be dead"
                )
            async with role_process(
                nursery, workload, "decode", "--rooms", "301:302", "--bootstrap", bootstrap
            ) as decode:
                assert isinstance(await prefill_room(peer, workload, 301), Succeeded)
                assert (await decode.wait("room", room=301))["ok"]
        finally:
            raw.close()
        _assert_prefill_empty(peer)


async def test_write_to_a_hung_decode_is_bounded_by_the_transfer_timeout(
    nursery: trio.Nursery,
) -> None:
    """A Decode that stops (SIGSTOP) after its session is open: the write fails after
    MC_TRANSFER_TIMEOUT (5 s here), the room fails on both sides. (A first write to a
    peer that hangs before any write opened its segment waits for Mooncake's
    handshake instead, about 30 s.)"""
    assert os.environ.get("MC_TRANSFER_TIMEOUT") == "5"
    workload = _workload(range(400, 402))
    async with in_process_prefill(workload) as (peer, bootstrap):
        async with role_process(
            nursery,
            workload,
            "decode",
            "--rooms",
            "400:402",
            "--bootstrap",
            bootstrap,
            "--in-flight",
            "1",
        ) as decode:
            assert isinstance(await prefill_room(peer, workload, 400), Succeeded)
            assert (await decode.wait("room", room=400))["ok"]
            await decode.wait("preallocated", room=401)

            async def stop_decode() -> None:
                stop_process(decode.role.process.pid)

            started = trio.current_time()
            event = await prefill_room(peer, workload, 401, before_hand_over=stop_decode)
            elapsed = trio.current_time() - started
            decode.role.process.send_signal(signal.SIGCONT)
            assert isinstance(event, Failed)
            assert event.reason.startswith("CachePD transfer failed: Mooncake transfer failed for")
            assert elapsed < 20, elapsed  # bounded by MC_TRANSFER_TIMEOUT, not hung
            record = await decode.wait("room", room=401)
            assert not record["ok"]
            assert (
                record["reason"] == "Failed to get kvcache from prefill instance, it might be dead"
            )
        _assert_prefill_empty(peer)


async def test_sleep_releases_and_wake_restores_the_registered_arena(
    nursery: trio.Nursery,
) -> None:
    """Release is refused while a request is tracked (the error lists its room); after
    a release and restore on the real engine the same arena serves the next room."""
    workload = _workload(range(450, 452))
    async with in_process_prefill(workload) as (peer, bootstrap):
        async with role_process(
            nursery,
            workload,
            "decode",
            "--rooms",
            "450:452",
            "--bootstrap",
            bootstrap,
            "--in-flight",
            "1",
        ) as decode:
            peer.register_request("held", 450)
            with pytest.raises(ReleaseRefused, match=r"rooms \[450\]"):
                await peer.release_registration()
            assert isinstance(await poll_for(peer, "held"), Bootstrapped)
            peer.abort(450, "the engine went to sleep")
            assert isinstance(await poll_for(peer, "held"), Failed)
            assert (await decode.wait("room", room=450))["reason"] == (
                "Failed to get kvcache from prefill instance, it might be dead"
            )
            await peer.release_registration()
            await peer.restore_registration()
            assert isinstance(await prefill_room(peer, workload, 451), Succeeded)
            assert (await decode.wait("room", room=451))["ok"]
        _assert_prefill_empty(peer)


async def test_prefill_killed_fails_the_room_by_heartbeat(nursery: trio.Nursery) -> None:
    workload = _workload(range(500, 501))
    port = free_port()
    bootstrap = f"127.0.0.1:{port}"
    log_dir = tempfile.mkdtemp(prefix="tspd-e2e-")
    server = await spawn(
        nursery,
        "bootstrap",
        tspd_argv("bootstrap-server", "--port", str(port)),
        lambda role, record: None,
        log_dir,
    )
    await server.ready.wait()
    contract = workload.contract(1)
    try:
        async with (
            mooncake_runner() as engine,
            role_process(
                nursery, workload, "prefill", "--rooms", "500:501", "--bootstrap", bootstrap
            ) as prefill,
        ):
            await prefill.wait("ready")
            with HostArena.for_contract(contract) as arena:
                config = DecodeConfig(1, 0, contract, 1, "", "", 1, heartbeat_max_failures=2)
                settings = DecodeSettings(heartbeat_interval=0.2)
                async with open_decode_peer(config, engine, arena, settings=settings) as decode:
                    rid = workload.rid(500)
                    decode.register_request(rid, 500, bootstrap)
                    assert isinstance(await poll_for(decode, rid), Bootstrapped)
                    # The Prefill instance dies with its bootstrap server before sending.
                    prefill.role.process.kill()
                    server.process.kill()
                    tables = PageAllocator(contract).allocate(workload.prompt_len(500, contract))
                    decode.send_preallocation(
                        500, tables, prompt_len=workload.prompt_len(500, contract)
                    )
                    event = await poll_for(decode, rid)
                    assert isinstance(event, Failed)
                    assert event.reason == (
                        f"Losing connection with prefill instance (bootstrap_addr: {bootstrap})"
                    )
                    stats = decode.statistics()
                    assert all(stats[k] == 0 for k in DECODE_EMPTY), stats
    finally:
        with contextlib.suppress(ProcessLookupError):
            server.process.kill()


async def test_decode_in_process_verifies_a_prefill_process(nursery: trio.Nursery) -> None:
    workload = _workload(range(600, 604), candidates=2)
    port = free_port()
    bootstrap = f"127.0.0.1:{port}"
    log_dir = tempfile.mkdtemp(prefix="tspd-e2e-")
    server = await spawn(
        nursery,
        "bootstrap",
        tspd_argv("bootstrap-server", "--port", str(port)),
        lambda role, record: None,
        log_dir,
    )
    await server.ready.wait()
    contract = workload.contract(1)
    try:
        async with (
            mooncake_runner() as engine,
            role_process(
                nursery, workload, "prefill", "--rooms", "600:604", "--bootstrap", bootstrap
            ) as prefill,
        ):
            await prefill.wait("ready")
            with HostArena.for_contract(contract) as arena:
                config = DecodeConfig(1, 0, contract, 1, "", "", 1)
                async with open_decode_peer(config, engine, arena) as decode:
                    for room in workload.rooms:
                        rid = workload.rid(room)
                        decode.register_request(rid, room, bootstrap)
                        assert isinstance(await poll_for(decode, rid), Bootstrapped)
                        prompt = workload.prompt_len(room, contract)
                        manifest = build_manifest(
                            contract, PageAllocator(contract).allocate(prompt), 0, prompt
                        )
                        decode.send_preallocation(room, manifest)
                        event = await poll_for(decode, rid)
                        assert isinstance(event, RemotePrefillDone), event
                        token, candidates = bootstrap_token_and_candidates(SEED, room, 2)
                        assert (event.bootstrap_token, event.spec_candidate_ids) == (
                            token,
                            candidates,
                        )
                        assert verify_room(arena, contract, manifest, seed=SEED, room=room) == []
                    stats = decode.statistics()
                    assert all(stats[k] == 0 for k in DECODE_EMPTY), stats
            await prefill.wait("done")
    finally:
        with contextlib.suppress(ProcessLookupError):
            server.process.kill()


async def test_cancelling_a_peer_mid_transfer_leaves_no_thread_or_socket(
    nursery: trio.Nursery,
) -> None:
    workload = _workload(range(700, 701), fixed_prompt_pages=64)
    ports: list[int] = []
    with trio.CancelScope() as outer:
        async with in_process_prefill(workload) as (peer, bootstrap):
            ports.append(peer.control_port)
            async with role_process(
                nursery,
                workload,
                "decode",
                "--rooms",
                "700:701",
                "--bootstrap",
                bootstrap,
                "--in-flight",
                "1",
            ) as decode:
                await decode.wait("preallocated", room=700)
                rid = workload.rid(700)
                peer.register_request(rid, 700)
                assert isinstance(await poll_for(peer, rid), Bootstrapped)
                contract = peer.core.config.contract
                prompt = workload.prompt_len(700, contract)
                tables = PageAllocator(contract).allocate(prompt)
                peer.hand_over([RemoteDecodeRow(rid, tables, 1)])
                assert peer.statistics()["chunks_in_flight"] == 1
                outer.cancel()  # the whole peer, with its transfer in flight
                await trio.sleep(30)
    assert outer.cancelled_caught
    assert trio.testing.active_thread_count() == 0
    with trio.fail_after(5):
        for _ in iter(int, 1):
            if _port_is_free(ports[0]):
                break
            await trio.sleep(0.01)


def _port_is_free(port: int) -> bool:
    import socket

    with socket.socket() as probe:
        # SO_REUSEADDR: connections the closed socket had accepted may linger in
        # TIME_WAIT; only a socket still listening makes the bind fail.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_tspd_demo_command_exit_codes() -> None:
    """``tspd demo`` exits 0 with every room verified, and 1 when rooms fail (here:
    a bootstrap timeout far shorter than any pre-allocation takes; the Prefill ranks
    finish at once and the Decode's waiting timeout ends its side)."""
    from click.testing import CliRunner

    from tspd.cli import main

    common = ["demo", "--prefill-tp", "1", "--pages", "256", "--in-flight", "4", "--json"]
    ok = CliRunner().invoke(main, [*common, "--rooms", "7000:7008"])
    assert ok.exit_code == 0, ok.output
    summary = json.loads(ok.output[ok.output.index("{") :])
    assert (summary["ok"], summary["succeeded"]) == (True, 8)
    bad = CliRunner().invoke(
        main,
        [
            *common,
            "--rooms",
            "7100:7104",
            "--bootstrap-timeout",
            "0.001",
            "--waiting-timeout",
            "2",
            "--timeout",
            "60",
        ],
    )
    assert bad.exit_code == 1, bad.output
    summary = json.loads(bad.output[bad.output.index("{") :])
    assert summary["ok"] is False
    assert summary["failed"] == 4
    assert summary["errors"] == []
