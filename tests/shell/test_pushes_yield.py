"""PushPool hands the CPU to libzmq's I/O thread after a lone send, not within bursts."""

from __future__ import annotations

import pytest
import trio
import zmq

from tspd.shell import pushes
from tspd.shell.pushes import PushPool
from tspd.shell.zmq import bind_free_port, open_socket


async def test_lone_sends_yield_the_cpu_and_bursts_do_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = [10.0]
    yields: list[float] = []
    monkeypatch.setattr(pushes, "_now", lambda: clock[0])
    monkeypatch.setattr(pushes, "_yield_cpu", lambda: yields.append(clock[0]))
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    pull = open_socket(ctx, zmq.PULL)
    port = bind_free_port(pull)
    pool = PushPool(ctx, name="test")
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        pool.send_nowait("127.0.0.1", port, [b"first"])  # lone: yields
        for _ in range(3):  # a burst: 0.1 ms apart, no yield
            clock[0] += 0.0001
            pool.send_nowait("127.0.0.1", port, [b"burst"])
        clock[0] += 0.002
        pool.send_nowait("127.0.0.1", port, [b"after a pause"])  # lone again: yields
        got: list[bytes] = []
        with trio.fail_after(10):
            while len(got) < 5:
                got.extend(m[0] for m in await pull.recv_batch())
        nursery.cancel_scope.cancel()
    pull.close()
    assert got == [b"first", b"burst", b"burst", b"burst", b"after a pause"]
    assert yields == [10.0, pytest.approx(10.0023)]
    assert pool.stats.sent == 5
