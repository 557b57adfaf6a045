"""Engine setup calls from Trio: blocking engines register, unregister, open and close
in worker threads (the loop keeps running), in-process engines stay inline, and
teardown happens even when cancelled, bounded by a time limit."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

import numpy as np
import pytest
import trio
import trio.testing
from pd_helpers import wait_until

from tspd.core.contract import CacheContract
from tspd.core.decode import DecodeConfig
from tspd.core.prefill import PrefillConfig
from tspd.engines.base import AddressList, TransferEngine, setup_blocks
from tspd.engines.mooncake import MooncakeEngine
from tspd.shell.arena import HostArena
from tspd.shell.decode import open_decode_peer
from tspd.shell.engine_setup import (
    close_engine,
    open_engine,
    register_memory,
    unregister_memory,
    unregister_on_exit,
)
from tspd.shell.offload import EngineRunner
from tspd.shell.prefill import open_prefill_peer
from tspd.testing.fake_engine import AsyncFakeEngine, FakeEngine, FakeFabric
from tspd.testing.layouts import multi_layer_contract

SETUP_DELAY = 0.3
TICK = 0.01


class SlowSetupEngine:
    """A fake engine whose setup calls block like Mooncake's on RDMA: each sleeps
    ``delay`` seconds in the calling thread and records when and where it ran."""

    blocking_setup = True

    def __init__(self, fabric: FakeFabric, delay: float = SETUP_DELAY) -> None:
        self.inner = FakeEngine(fabric=fabric)
        self.delay = delay
        #: (call, start, end, thread id) per setup call.
        self.calls: list[tuple[str, float, float, int]] = []
        #: When set, unregister_memory waits for it (a hung engine) instead of sleeping.
        self.hang: threading.Event | None = None

    @property
    def session_id(self) -> str:
        return self.inner.session_id

    def _block(self, call: str) -> None:
        start = time.monotonic()
        if call == "unregister" and self.hang is not None:
            self.hang.wait(10)
        else:
            time.sleep(self.delay)
        self.calls.append((call, start, time.monotonic(), threading.get_ident()))

    def register_memory(self, addr: int, length: int) -> None:
        self._block("register")
        self.inner.register_memory(addr, length)

    def unregister_memory(self, addr: int) -> None:
        self._block("unregister")
        self.inner.unregister_memory(addr)

    def batch_write(
        self, peer_session: str, src: AddressList, dst: AddressList, lengths: AddressList
    ) -> None:
        self.inner.batch_write(peer_session, src, dst, lengths)

    def close(self) -> None:
        self._block("close")
        self.inner.close()

    def window(self, call: str) -> tuple[float, float, int]:
        """Start, end and thread of the first ``call`` recorded."""
        return next((s, e, ident) for name, s, e, ident in self.calls if name == call)


def _contract() -> CacheContract:
    return multi_layer_contract(layers=1, num_pages=8, heads=1, head_dim=8)


def _decode(
    engine: SlowSetupEngine, arena: HostArena, contract: CacheContract
) -> AbstractAsyncContextManager[object]:
    return open_decode_peer(DecodeConfig(1, 0, contract, 1, "", "", 1), engine, arena)


def _prefill(
    engine: SlowSetupEngine, arena: HostArena, contract: CacheContract
) -> AbstractAsyncContextManager[object]:
    config = PrefillConfig(tp_size=1, tp_rank=0, contract=contract, arena_base=1)
    return open_prefill_peer(config, EngineRunner(engine), arena)


OPENERS: dict[
    str,
    Callable[[SlowSetupEngine, HostArena, CacheContract], AbstractAsyncContextManager[object]],
] = {"decode": _decode, "prefill": _prefill}


async def _ticker(ticks: list[float]) -> None:
    while True:
        ticks.append(time.monotonic())
        await trio.sleep(TICK)


def _ticks_within(ticks: list[float], start: float, end: float) -> int:
    return sum(start < t < end for t in ticks)


@pytest.mark.parametrize("side", sorted(OPENERS))
async def test_the_loop_keeps_running_while_a_blocking_engine_registers(side: str) -> None:
    """The arena's registration and its deregistration on exit sleep in a worker
    thread; a task of the same loop keeps ticking meanwhile."""
    contract = _contract()
    engine = SlowSetupEngine(FakeFabric())
    ticks: list[float] = []
    trio_thread = threading.get_ident()
    with HostArena.for_contract(contract) as arena:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_ticker, ticks)
            async with OPENERS[side](engine, arena, contract):
                assert engine.inner.regions() == {arena.base: arena.size}
            assert engine.inner.regions() == {}
            nursery.cancel_scope.cancel()
    for call in ("register", "unregister"):
        start, end, thread = engine.window(call)
        assert thread != trio_thread, f"{call} ran on the Trio thread"
        assert _ticks_within(ticks, start, end) >= 1, f"the loop stalled during {call}"


async def test_sleep_and_wake_run_off_the_trio_thread() -> None:
    contract = _contract()
    engine = SlowSetupEngine(FakeFabric())
    ticks: list[float] = []
    with HostArena.for_contract(contract) as arena:
        config = PrefillConfig(tp_size=1, tp_rank=0, contract=contract, arena_base=1)
        async with open_prefill_peer(config, EngineRunner(engine), arena) as peer:
            engine.calls.clear()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_ticker, ticks)
                await peer.release_registration()
                assert engine.inner.regions() == {}
                await peer.restore_registration()
                assert engine.inner.regions() == {arena.base: arena.size}
                nursery.cancel_scope.cancel()
    for call in ("unregister", "register"):
        start, end, _ = engine.window(call)
        assert _ticks_within(ticks, start, end) >= 1, f"the loop stalled during {call}"


@pytest.mark.parametrize("side", sorted(OPENERS))
async def test_cancelled_while_registering_the_arena_is_still_unregistered(side: str) -> None:
    """A cancel that lands while the engine registers waits for it (never abandoned),
    and the peer's teardown then unregisters what was registered."""
    contract = _contract()
    engine = SlowSetupEngine(FakeFabric())
    with HostArena.for_contract(contract) as arena:
        with trio.move_on_after(SETUP_DELAY / 3) as scope:
            async with OPENERS[side](engine, arena, contract):
                await trio.sleep(10)
        assert scope.cancelled_caught
        assert [call for call, *_ in engine.calls] == ["register", "unregister"]
        assert engine.inner.regions() == {}
    assert trio.testing.active_thread_count() == 0


async def test_teardown_runs_when_cancelled() -> None:
    engine = SlowSetupEngine(FakeFabric(), delay=0.05)
    buf = np.zeros(64, dtype=np.uint8)
    addr = int(buf.ctypes.data)
    engine.inner.register_memory(addr, 64)
    with trio.CancelScope() as scope:
        scope.cancel()
        assert await unregister_on_exit(engine, addr, what="the test arena")
        assert await close_engine(engine)
    assert engine.inner.regions() == {}
    assert engine.inner.closed


async def test_a_hung_unregistration_is_given_up_with_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = SlowSetupEngine(FakeFabric())
    engine.hang = threading.Event()
    buf = np.zeros(64, dtype=np.uint8)
    addr = int(buf.ctypes.data)
    engine.inner.register_memory(addr, 64)
    try:
        with caplog.at_level(logging.ERROR, logger="tspd.engine"):
            started = time.monotonic()
            assert not await unregister_on_exit(engine, addr, what="the test arena", limit=0.2)
            assert time.monotonic() - started < 5
        (record,) = [r for r in caplog.records if r.name == "tspd.engine"]
        assert record.levelno == logging.ERROR
        message = record.getMessage()
        assert message.startswith(f"could not deregister the test arena ({addr:#x})")
        assert "did not return within 0.2s" in message
    finally:
        engine.hang.set()
    # The abandoned call finishes once the engine comes back.
    await wait_until(lambda: not engine.inner.regions(), limit=5)


async def test_a_refused_unregistration_on_exit_is_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = AsyncFakeEngine(fabric=FakeFabric())
    with caplog.at_level(logging.WARNING, logger="tspd.engine"):
        assert not await unregister_on_exit(engine, 0x1000, what="the test arena")
    assert "could not deregister the test arena on shutdown" in caplog.text


async def test_in_process_engines_stay_inline() -> None:
    """No thread and no checkpoint: a cancelled caller still registers and
    unregisters at once (what keeps MockClock tests deterministic)."""
    engines = [AsyncFakeEngine(fabric=FakeFabric()), FakeEngine(fabric=FakeFabric())]
    buf = np.zeros(64, dtype=np.uint8)
    addr = int(buf.ctypes.data)
    with trio.CancelScope() as scope:
        scope.cancel()
        for engine in engines:
            await register_memory(engine, addr, 64)
            assert engine.session_id
            await unregister_memory(engine, addr)
            await register_memory(engine, addr, 64)
            assert await unregister_on_exit(engine, addr, what="the test arena")
            assert await close_engine(engine)
    assert not scope.cancelled_caught, "an inline setup call reached a checkpoint"


async def test_a_blocking_engine_is_built_and_closed_in_a_thread_even_when_cancelled() -> None:
    fabric = FakeFabric()
    built: list[int] = []
    trio_thread = threading.get_ident()

    def build() -> SlowSetupEngine:
        built.append(threading.get_ident())
        time.sleep(SETUP_DELAY)
        return SlowSetupEngine(fabric, delay=0.01)

    engines: list[SlowSetupEngine] = []
    with trio.move_on_after(SETUP_DELAY / 3) as scope:
        async with open_engine(build) as engine:
            engines.append(engine)
            await trio.sleep(10)
    assert scope.cancelled_caught
    (builder,) = built
    assert builder != trio_thread
    (engine,) = engines
    assert engine.inner.closed
    assert engine.window("close")[2] != trio_thread


def test_which_engines_block_on_setup() -> None:
    fabric = FakeFabric()
    assert MooncakeEngine.blocking_setup is True
    assert setup_blocks(FakeEngine(fabric=fabric)) is False
    assert setup_blocks(AsyncFakeEngine(fabric=fabric)) is False
    assert EngineRunner(FakeEngine(fabric=fabric)).blocking_setup is False
    slow = SlowSetupEngine(fabric)
    assert isinstance(slow, TransferEngine)
    assert EngineRunner(slow).blocking_setup is True

    class Undeclared:
        """An engine written before the flag: taken to block."""

    assert setup_blocks(Undeclared()) is True  # type: ignore[arg-type]
