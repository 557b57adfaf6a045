"""The real Mooncake engine: two processes on 127.0.0.1 over TCP with P2PHANDSHAKE.

The peer process is ``mooncake_peer.py`` (JSON lines on stdin/stdout); the test
process owns the other engine. Every write is verified byte for byte.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

pytest.importorskip("mooncake.engine")

from tspd.core.copies import CopyPlan
from tspd.engines.base import (
    EngineUnavailable,
    PipelinedEngine,
    PollingEngine,
    TransferEngine,
    TransferError,
    WriteTicket,
)
from tspd.engines.mooncake import (
    DEFAULT_MAX_DESCRIPTORS,
    DEFAULT_QUEUED_TRANSFERS_PER_PEER,
    INIT_FAILED,
    MooncakeEngine,
    queued_transfers_per_peer,
    transfer_timeout,
)
from tspd.shell.offload import EngineRunner
from tspd.testing.procs import stop_process

pytestmark = pytest.mark.mooncake

PEER_SCRIPT = Path(__file__).with_name("mooncake_peer.py")
ARENA = 32 << 20
PAGE = 4096


class Peer:
    """The Mooncake engine in the other process."""

    def __init__(self, size: int, log: Path) -> None:
        self._log = log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER_SCRIPT), str(size)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        hello = self._read()
        self.session: str = hello["session"]
        self.addr: int = hello["addr"]
        self.size: int = hello["size"]

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"mooncake peer exited early; see {self._log.name}"
        reply: dict[str, Any] = json.loads(line)
        return reply

    def call(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def digest(self, offset: int, length: int) -> str:
        return str(self.call(op="digest", offset=offset, length=length)["sha256"])

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@pytest.fixture(scope="module")
def peer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Peer]:
    """One peer process for the module (each test checks only what it wrote)."""
    p = Peer(ARENA, tmp_path_factory.mktemp("mooncake") / "peer.log")
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture
def dying_peer(tmp_path: Path) -> Iterator[Peer]:
    """A peer of its own, for tests that stop it."""
    p = Peer(1 << 20, tmp_path / "peer.log")
    try:
        yield p
    finally:
        p.stop()


class Local:
    """The engine in this process, with a registered, patterned arena."""

    def __init__(self, size: int) -> None:
        self.engine = MooncakeEngine("127.0.0.1")
        self._buf = mmap.mmap(-1, size)
        self.arena = np.frombuffer(self._buf, dtype=np.uint8)
        self.arena[:] = np.random.default_rng(7).integers(0, 256, size, dtype=np.uint8)
        self.addr = int(self.arena.ctypes.data)
        self.engine.register_memory(self.addr, size)


@pytest.fixture
def local() -> Iterator[Local]:
    loc = Local(ARENA)
    try:
        yield loc
    finally:
        loc.engine.close()


def sha(data: np.ndarray) -> str:
    return hashlib.sha256(data.tobytes()).hexdigest()


def test_engine_satisfies_the_protocol(local: Local) -> None:
    assert isinstance(local.engine, TransferEngine)
    host, port = local.engine.session_id.rsplit(":", 1)
    assert host == "127.0.0.1"
    assert int(port) > 0


def test_two_processes_write_into_each_other(local: Local, peer: Peer) -> None:
    # This process -> peer: scattered pages in reverse order, plus one large run.
    pages = 64
    src = [local.addr + i * PAGE for i in range(pages)]
    dst = [peer.addr + (pages - 1 - i) * PAGE for i in range(pages)]
    src.append(local.addr + (1 << 20))
    dst.append(peer.addr + (8 << 20))
    lengths = [PAGE] * pages + [4 << 20]
    local.engine.batch_write(peer.session, src, dst, lengths)
    expected = np.concatenate(
        [local.arena[(pages - 1 - i) * PAGE : (pages - i) * PAGE] for i in range(pages)]
    )
    assert peer.digest(0, pages * PAGE) == sha(expected)
    assert peer.digest(8 << 20, 4 << 20) == sha(local.arena[1 << 20 : 5 << 20])

    # Peer -> this process.
    peer.call(op="fill", seed=11)
    peer_bytes = np.random.default_rng(11).integers(0, 256, ARENA, dtype=np.uint8)
    reply = peer.call(
        op="write",
        peer=local.engine.session_id,
        src=[0, 3 * PAGE],
        dst=[local.addr + (16 << 20), local.addr + 100],
        lengths=[2 * PAGE, 10],
    )
    assert reply == {"ok": True}
    assert bytes(local.arena[16 << 20 : (16 << 20) + 2 * PAGE]) == bytes(peer_bytes[: 2 * PAGE])
    assert bytes(local.arena[100:110]) == bytes(peer_bytes[3 * PAGE : 3 * PAGE + 10])


def test_more_than_4096_descriptors_succeed_in_one_batch_write(local: Local, peer: Peer) -> None:
    count = 5000  # > 4096 (TokenSpeed's call size) and > 2 * 2048 (Mooncake TCP's queue)
    assert count > 4 * DEFAULT_MAX_DESCRIPTORS
    offsets = np.arange(count, dtype=np.int64) * PAGE
    local.engine.batch_write(
        peer.session,
        local.addr + offsets,
        peer.addr + offsets,
        np.full(count, PAGE, dtype=np.int64),
    )
    assert peer.digest(0, count * PAGE) == sha(local.arena[: count * PAGE])


def test_out_of_range_destination_fails_and_engine_stays_usable(local: Local, peer: Peer) -> None:
    with pytest.raises(TransferError) as err:
        local.engine.batch_write(peer.session, [local.addr], [peer.addr + ARENA - 100], [PAGE])
    assert err.value.peer == peer.session
    assert err.value.code < 0
    local.engine.batch_write(peer.session, [local.addr], [peer.addr], [PAGE])
    assert peer.digest(0, PAGE) == sha(local.arena[:PAGE])


def test_dead_and_unreachable_peers_fail_without_hanging(local: Local, dying_peer: Peer) -> None:
    peer = dying_peer
    local.engine.batch_write(peer.session, [local.addr], [peer.addr], [PAGE])
    peer.stop()
    started = time.monotonic()
    with pytest.raises(TransferError) as dead:
        local.engine.batch_write(peer.session, [local.addr], [peer.addr], [PAGE])
    with pytest.raises(TransferError):
        local.engine.batch_write("127.0.0.1:1", [local.addr], [0x10000], [PAGE])
    # Well under MC_TRANSFER_TIMEOUT: a dead peer is refused, not timed out.
    assert time.monotonic() - started < 5
    assert dead.value.code < 0


def test_register_errors_are_transfer_errors(local: Local) -> None:
    with pytest.raises(TransferError) as overlap:
        local.engine.register_memory(local.addr + PAGE, PAGE)
    assert overlap.value.code != 0
    with pytest.raises(TransferError) as unknown:
        local.engine.unregister_memory(local.addr + PAGE)
    assert unknown.value.code != 0


def test_mismatched_columns_are_refused_before_mooncake(local: Local, peer: Peer) -> None:
    with pytest.raises(TransferError, match="differ in length"):
        local.engine.batch_write(peer.session, [local.addr, local.addr], [peer.addr], [1])
    local.engine.batch_write(peer.session, [], [], [])  # empty: no call, success


def test_closed_engine_refuses_writes(peer: Peer) -> None:
    loc = Local(1 << 20)
    loc.engine.close()
    loc.engine.close()
    with pytest.raises(TransferError, match="closed"):
        loc.engine.batch_write(peer.session, [loc.addr], [peer.addr], [PAGE])


def test_initialize_failure_has_the_spec_message() -> None:
    with pytest.raises(EngineUnavailable) as err:
        MooncakeEngine("127.0.0.1", metadata_server="http://127.0.0.1:1/metadata")
    assert str(err.value) == INIT_FAILED
    assert any("metadata_server" in note for note in err.value.__notes__)


async def test_runner_writes_through_a_thread(local: Local, peer: Peer) -> None:
    runner = EngineRunner(local.engine, limiter=trio.CapacityLimiter(1))
    offsets = np.arange(8, dtype=np.int64) * PAGE
    await runner.batch_write(
        peer.session, local.addr + offsets, peer.addr + offsets, np.full(8, PAGE)
    )
    assert peer.digest(0, 8 * PAGE) == sha(local.arena[: 8 * PAGE])


@pytest.mark.slow
def test_hung_peer_fails_after_the_transfer_timeout(local: Local, dying_peer: Peer) -> None:
    """A stopped (SIGSTOP) peer fails the write after MC_TRANSFER_TIMEOUT (5 s in the
    test configuration) instead of hanging, and works again once resumed."""
    peer = dying_peer
    local.engine.batch_write(peer.session, [local.addr], [peer.addr], [PAGE])
    stop_process(peer.proc.pid)
    try:
        with pytest.raises(TransferError):
            local.engine.batch_write(peer.session, [local.addr], [peer.addr], [PAGE])
    finally:
        os.kill(peer.proc.pid, signal.SIGCONT)
    # The timed-out write may still land once the peer resumes: check another page.
    local.engine.batch_write(peer.session, [local.addr + PAGE], [peer.addr + PAGE], [PAGE])
    assert peer.digest(PAGE, PAGE) == sha(local.arena[PAGE : 2 * PAGE])


# -- the non-blocking pair: transfer_submit_write + transfer_check_status --------


def _finish(engine: MooncakeEngine, ticket: WriteTicket, limit: float = 10.0) -> None:
    """Check ``ticket`` until done (raises what ``check_write`` raises)."""
    deadline = time.monotonic() + limit
    while not engine.check_write(ticket):
        assert time.monotonic() < deadline, "a submitted write never finished"


def test_engine_is_a_polling_engine(local: Local) -> None:
    assert isinstance(local.engine, PollingEngine)


def test_submitted_writes_land_byte_for_byte(local: Local, peer: Peer) -> None:
    tickets = [
        local.engine.submit_write(
            peer.session, local.addr + i * PAGE, peer.addr + (20 << 20) + (3 - i) * PAGE, PAGE
        )
        for i in range(4)
    ]
    big = local.engine.submit_write(peer.session, local.addr + (2 << 20), peer.addr, 4 << 20)
    for ticket in [*tickets, big]:
        _finish(local.engine, ticket)
    expected = np.concatenate([local.arena[(3 - i) * PAGE : (4 - i) * PAGE] for i in range(4)])
    assert peer.digest(20 << 20, 4 * PAGE) == sha(expected)
    assert peer.digest(0, 4 << 20) == sha(local.arena[2 << 20 : 6 << 20])
    assert big.length == 4 << 20
    assert big.peer_session == peer.session


def test_a_submitted_write_outside_the_peer_fails_at_the_check(local: Local, peer: Peer) -> None:
    ticket = local.engine.submit_write(peer.session, local.addr, peer.addr + ARENA - 100, PAGE)
    with pytest.raises(TransferError) as err:
        _finish(local.engine, ticket)
    assert err.value.peer == peer.session
    assert err.value.code < 0


def test_submitted_writes_to_a_dead_peer_fail_fast(local: Local, dying_peer: Peer) -> None:
    peer = dying_peer
    _finish(local.engine, local.engine.submit_write(peer.session, local.addr, peer.addr, PAGE))
    peer.stop()
    started = time.monotonic()
    with pytest.raises(TransferError) as dead:
        _finish(local.engine, local.engine.submit_write(peer.session, local.addr, peer.addr, PAGE))
    with pytest.raises(TransferError) as unknown:
        _finish(local.engine, local.engine.submit_write("127.0.0.1:1", local.addr, 0x10000, PAGE))
    assert time.monotonic() - started < 5  # refused, not timed out
    assert dead.value.peer == peer.session
    assert dead.value.code < 0
    assert unknown.value.peer == "127.0.0.1:1"


async def test_runner_polls_small_writes_to_a_reached_peer(local: Local, peer: Peer) -> None:
    runner = EngineRunner(local.engine, limiter=trio.CapacityLimiter(1))
    offsets = np.arange(4, dtype=np.int64) * PAGE
    dst = peer.addr + (24 << 20)
    await runner.batch_write(peer.session, local.addr + offsets, dst + offsets, np.full(4, PAGE))
    await runner.batch_write(
        peer.session, local.addr + PAGE * 8 + offsets, dst + offsets[::-1], np.full(4, PAGE)
    )
    assert (runner.thread_writes, runner.polled_writes) == (1, 1)
    expected = np.concatenate([local.arena[(11 - i) * PAGE : (12 - i) * PAGE] for i in range(4)])
    assert peer.digest(24 << 20, 4 * PAGE) == sha(expected)


async def test_runner_polled_write_to_a_dead_peer_is_a_transfer_error(
    local: Local, dying_peer: Peer
) -> None:
    peer = dying_peer
    runner = EngineRunner(local.engine)
    await runner.batch_write(peer.session, [local.addr], [peer.addr], [PAGE])
    peer.stop()
    with pytest.raises(TransferError) as err:
        await runner.batch_write(peer.session, [local.addr], [peer.addr], [PAGE])
    assert runner.polled_writes == 1
    assert err.value.peer == peer.session
    assert err.value.code < 0


async def test_runner_finishes_a_polled_write_it_was_cancelled_during(
    local: Local, peer: Peer
) -> None:
    """A cancel that lands while a 16 MiB write is being polled waits for the write:
    the bytes are all there when the cancellation is delivered."""
    runner = EngineRunner(local.engine)
    await runner.batch_write(peer.session, [local.addr], [peer.addr], [PAGE])
    size = 16 << 20
    src = local.addr + (8 << 20)
    with trio.CancelScope() as scope:
        scope.deadline = trio.current_time() + 0.001
        await runner.batch_write(peer.session, [src], [peer.addr], [size])
        await trio.sleep(10)  # the cancellation lands here, after the write
    assert scope.cancelled_caught
    assert runner.polled_writes == 1
    assert runner.in_flight == 0
    assert peer.digest(0, size) == sha(local.arena[8 << 20 : (8 << 20) + size])


@pytest.mark.slow
async def test_runner_polled_write_to_a_hung_peer_fails_after_the_timeout(
    local: Local, dying_peer: Peer
) -> None:
    """A stopped peer: the polled write is checked, through a cancel, until
    MC_TRANSFER_TIMEOUT (5 s in the test configuration) fails it."""
    peer = dying_peer
    assert transfer_timeout() == 5.0
    runner = EngineRunner(local.engine)
    await runner.batch_write(peer.session, [local.addr], [peer.addr], [PAGE])
    stop_process(peer.proc.pid)
    try:
        started = trio.current_time()
        with trio.move_on_after(0.1) as scope, pytest.raises(TransferError) as err:
            await runner.batch_write(peer.session, [local.addr], [peer.addr], [PAGE])
        elapsed = trio.current_time() - started
    finally:
        os.kill(peer.proc.pid, signal.SIGCONT)
    assert runner.polled_writes == 1
    assert not scope.cancelled_caught, "the outcome of the write is what the caller gets"
    assert err.value.peer == peer.session
    assert elapsed >= 5.0
    # Resumed: the peer went back to the thread way and is reached again (into
    # another page: the timed-out write may still land once the peer runs).
    await runner.batch_write(peer.session, [local.addr + PAGE], [peer.addr + PAGE], [PAGE])
    assert runner.thread_writes == 2
    assert peer.digest(PAGE, PAGE) == sha(local.arena[PAGE : 2 * PAGE])


# -- pipelined batches ---------------------------------------------------------------


def test_engine_is_a_pipelined_engine_bounded_by_the_tcp_queue(local: Local) -> None:
    assert isinstance(local.engine, PipelinedEngine)
    assert local.engine.max_in_flight_descriptors == queued_transfers_per_peer()
    assert queued_transfers_per_peer({}) == DEFAULT_QUEUED_TRANSFERS_PER_PEER == 1024
    assert queued_transfers_per_peer({"MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": " 4096 "}) == 4096
    for bad in ("0", "-5", "lots", ""):
        assert queued_transfers_per_peer({"MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": bad}) == 1024


def test_submitted_batches_land_byte_for_byte(local: Local, peer: Peer) -> None:
    count = 1000
    offsets = np.arange(count, dtype=np.int64) * PAGE
    scattered = local.engine.submit_batch(
        peer.session,
        local.addr + offsets,
        peer.addr + (4 << 20) + offsets[::-1],
        np.full(count, PAGE, dtype=np.int64),
    )
    one = local.engine.submit_batch(peer.session, [local.addr + (9 << 20)], [peer.addr], [PAGE])
    # A zero-length copy is skipped, as the polled writes skip it.
    with_empty = local.engine.submit_batch(
        peer.session,
        [local.addr + (10 << 20), local.addr, local.addr + (11 << 20)],
        [peer.addr + (1 << 20), peer.addr + (2 << 20), peer.addr + (3 << 20)],
        [PAGE, 0, PAGE],
    )
    assert (scattered.descriptors, scattered.length) == (count, count * PAGE)
    assert (with_empty.descriptors, with_empty.length) == (2, 2 * PAGE)
    for ticket in (scattered, one, with_empty):
        local.engine.wait_batch(ticket)
    expected = local.arena[: count * PAGE].reshape(count, PAGE)[::-1].reshape(-1)
    assert peer.digest(4 << 20, count * PAGE) == sha(expected)
    assert peer.digest(0, PAGE) == sha(local.arena[9 << 20 : (9 << 20) + PAGE])
    assert peer.digest(1 << 20, PAGE) == sha(local.arena[10 << 20 : (10 << 20) + PAGE])
    assert peer.digest(3 << 20, PAGE) == sha(local.arena[11 << 20 : (11 << 20) + PAGE])


@pytest.mark.parametrize("bad", [1, 2], ids=["inside-the-batch", "the-last-copy"])
def test_a_batch_outside_the_peer_fails_at_the_wait(local: Local, peer: Peer, bad: int) -> None:
    dsts = [peer.addr, peer.addr + PAGE, peer.addr + 2 * PAGE]
    dsts[bad] = peer.addr + ARENA - 100
    ticket = local.engine.submit_batch(peer.session, [local.addr] * 3, dsts, [PAGE] * 3)
    with pytest.raises(TransferError) as err:
        local.engine.wait_batch(ticket)
    assert err.value.peer == peer.session
    assert err.value.code < 0
    local.engine.wait_batch(local.engine.submit_batch(peer.session, [local.addr], [peer.addr], [1]))


def test_batches_to_a_dead_peer_fail_fast(local: Local, dying_peer: Peer) -> None:
    peer = dying_peer
    local.engine.wait_batch(local.engine.submit_batch(peer.session, [local.addr], [peer.addr], [1]))
    peer.stop()
    started = time.monotonic()
    with pytest.raises(TransferError) as err:
        local.engine.wait_batch(
            local.engine.submit_batch(
                peer.session, [local.addr, local.addr], [peer.addr, peer.addr + PAGE], [PAGE] * 2
            )
        )
    assert time.monotonic() - started < 5  # refused or failed, not timed out
    assert err.value.peer == peer.session
    assert err.value.code < 0
    closed = MooncakeEngine("127.0.0.1")
    closed.close()
    with pytest.raises(TransferError, match="closed"):
        closed.submit_batch(peer.session, [local.addr], [peer.addr], [1])


async def test_runner_pipelines_a_large_scattered_write(local: Local, peer: Peer) -> None:
    """5,000 scattered 4 KiB copies — more than Mooncake TCP takes to a peer at once —
    in batches of 512, two in flight; the first batch opens the peer through a thread."""
    count = 5000
    offsets = np.arange(count, dtype=np.int64) * PAGE
    order = np.random.default_rng(11).permutation(count).astype(np.int64)
    plan = CopyPlan(local.addr + offsets, peer.addr + order * PAGE, np.full(count, PAGE))
    runner = EngineRunner(local.engine)
    calls: list[int] = []
    assert await runner.write_plan(peer.session, plan, on_batch=lambda n, _: calls.append(n))
    assert (runner.thread_writes, runner.pipelined_writes) == (1, 1)
    assert runner.peak_batches_in_flight == 2
    assert sum(calls) == count
    assert max(calls) == local.engine.max_in_flight_descriptors // 2
    expected = np.empty((count, PAGE), dtype=np.uint8)
    expected[order] = local.arena[: count * PAGE].reshape(count, PAGE)
    assert peer.digest(0, count * PAGE) == sha(expected.reshape(-1))
    assert runner.in_flight == 0


@pytest.mark.slow
async def test_runner_pipelined_write_to_a_hung_peer_fails_after_the_timeout(
    local: Local, dying_peer: Peer
) -> None:
    """A stopped peer: the pipelined write's batches are waited for, through a cancel,
    until MC_TRANSFER_TIMEOUT (5 s in the test configuration) fails them."""
    peer = dying_peer
    assert transfer_timeout() == 5.0
    runner = EngineRunner(local.engine)
    await runner.batch_write(peer.session, [local.addr], [peer.addr], [PAGE])
    count = 2048
    offsets = np.arange(count, dtype=np.int64) * 256
    plan = CopyPlan(local.addr + offsets, peer.addr + offsets, np.full(count, 256))
    stop_process(peer.proc.pid)
    try:
        started = trio.current_time()
        with trio.move_on_after(0.1) as scope, pytest.raises(TransferError) as err:
            await runner.write_plan(peer.session, plan)
        elapsed = trio.current_time() - started
    finally:
        os.kill(peer.proc.pid, signal.SIGCONT)
    assert runner.pipelined_writes == 1
    assert not scope.cancelled_caught, "the outcome of the write is what the caller gets"
    assert err.value.peer == peer.session
    assert elapsed >= 5.0
    assert runner.in_flight == 0
