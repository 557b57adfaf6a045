"""Raw limits measured beside tspd's figures: a bare Mooncake write, a bare ZMQ round
trip, a bare thread wake-up.

Each limit runs in the same benchmark run as the figure it bounds, between two
processes on 127.0.0.1 like the peers themselves: a helper process (started with
this interpreter) owns the target side and prints what the initiator needs as
one JSON line; the initiator measures. Nothing here goes through tspd's own code,
so the gap between a tspd figure and its limit is what the control plane costs.

A Mooncake write is timed two ways. ``sync``: ``batch_transfer_sync_write`` calls
of at most 1,024 descriptors, one after another — each busy-spins the calling
thread until its batch is done. ``pipelined``: what tspd's engine does
(:mod:`tspd.engines.mooncake`), in bare Mooncake calls — batches of at most 512
submitted with ``batch_transfer_async_write`` plus the last descriptor with
``transfer_submit_write``, two in flight, each waited for by polling that last
descriptor with short sleeps and then ``get_batch_transfer_status``. On a small
host the spinning thread takes a core from Mooncake's own threads, so the
pipelined figure is the higher, and the one a tspd figure can approach.

Both are timed back to back, on a connection that just carried the previous write.
A write after the connection idled for a tenth of a second or more can be much
slower when the host's TCP congestion control is BBR (docs/configuration.md,
"Host settings"): :func:`tcp_congestion_control` says which one the host runs, and
``tspd bench pd`` prints it beside its 64 MiB rows, whose rooms each start after such
a pause.

A thread wake-up (:func:`measure_thread_wake`) is the floor of any blocking
scheduler thread learning something from another thread: one thread sets a
``threading.Event`` that another blocks on, timed from just before ``set()`` to
the waiter's return, in this process.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import statistics
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

__all__ = [
    "TCP_CONGESTION_CONTROL_PATH",
    "MooncakeLimit",
    "ThreadWake",
    "ZmqLimit",
    "bare_mooncake_target",
    "bare_zmq_echo",
    "measure_mooncake",
    "measure_thread_wake",
    "measure_zmq_rtt",
    "tcp_congestion_control",
]

_HELPER = "from tspd.bench.raw import {fn}; {fn}({args})"


@contextlib.contextmanager
def _helper(fn: str, args: str = "") -> Iterator[tuple[subprocess.Popen[str], dict[str, Any]]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HELPER.format(fn=fn, args=args)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"benchmark helper {fn} exited before reporting its endpoint")
        yield proc, json.loads(line)
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def bare_mooncake_target(size: int) -> None:
    """Helper process: register ``size`` bytes with a Mooncake engine, print where, wait."""
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise SystemExit("Mooncake initialisation failed in the benchmark helper")
    buf = mmap.mmap(-1, size)
    addr = int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)
    if engine.register_memory(addr, size) != 0:
        raise SystemExit("Mooncake refused to register the benchmark helper's buffer")
    print(json.dumps({"session": f"127.0.0.1:{engine.get_rpc_port()}", "addr": addr}), flush=True)
    sys.stdin.read()


def bare_zmq_echo() -> None:
    """Helper process: echo every message from a PULL socket back on a PUSH socket."""
    import zmq

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    print(json.dumps({"port": port}), flush=True)
    reply_port = int(pull.recv())
    push.connect(f"tcp://127.0.0.1:{reply_port}")
    while True:
        frames = pull.recv_multipart()
        if frames == [b"stop"]:
            return
        push.send_multipart(frames)


@dataclass(frozen=True, slots=True)
class MooncakeLimit:
    """A bare Mooncake write: seconds per call (p50, p99) and GB/s at the median."""

    nbytes: int
    descriptors: int
    p50: float
    p99: float
    #: ``"sync"`` or ``"pipelined"`` (see the module docstring).
    mode: str = "sync"

    @property
    def gbps(self) -> float:
        """Gigabytes per second at the median call time."""
        return self.nbytes / self.p50 / 1e9


#: Where Linux says which TCP congestion control new connections use (this network
#: namespace's setting, ``sysctl net.ipv4.tcp_congestion_control``).
TCP_CONGESTION_CONTROL_PATH = "/proc/sys/net/ipv4/tcp_congestion_control"


def tcp_congestion_control(path: str = TCP_CONGESTION_CONTROL_PATH) -> str:
    """The TCP congestion control new connections get on this host (``"bbr"``,
    ``"cubic"``...), or ``"unknown"`` where the host does not say (not Linux, no
    ``/proc``)."""
    try:
        with open(path, encoding="ascii") as f:
            name = f.read().strip()
    except (OSError, UnicodeDecodeError):
        return "unknown"
    return name if name.isidentifier() else "unknown"


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


#: Pipelined mode: descriptors per batch, batches in flight, the sleep between polls.
_PIPELINE_BATCH = 512
_PIPELINE_DEPTH = 2
_PIPELINE_POLL_S = 0.0002


def _pipelined_write(
    engine: Any, session: str, srcs: list[int], dsts: list[int], lengths: list[int]
) -> None:
    """One write in the ``pipelined`` mode (see the module docstring), bare Mooncake."""
    pending: deque[tuple[int, int]] = deque()

    def collect() -> None:
        batch, last = pending.popleft()
        while (rc := engine.transfer_check_status(last)) == 0:
            time.sleep(_PIPELINE_POLL_S)
        if rc != 1 or (batch and engine.get_batch_transfer_status([batch]) != 0):
            raise RuntimeError(f"bare Mooncake pipelined write failed (status {rc})")

    for start in range(0, len(srcs), _PIPELINE_BATCH):
        stop = min(start + _PIPELINE_BATCH, len(srcs))
        if len(pending) >= _PIPELINE_DEPTH:
            collect()
        batch = 0
        if stop - start > 1:
            batch = engine.batch_transfer_async_write(
                session, srcs[start : stop - 1], dsts[start : stop - 1], lengths[start : stop - 1]
            )
        last = engine.transfer_submit_write(
            session, srcs[stop - 1], dsts[stop - 1], lengths[stop - 1]
        )
        if (stop - start > 1 and not batch) or not last:
            raise RuntimeError("bare Mooncake pipelined write could not start")
        pending.append((batch, last))
    while pending:
        collect()


def measure_mooncake(
    nbytes: int,
    *,
    descriptors: int = 1,
    repeats: int = 20,
    warmup: int = 3,
    mode: Literal["sync", "pipelined"] = "sync",
) -> MooncakeLimit:
    """Time a bare Mooncake write of ``nbytes`` in ``descriptors`` equal contiguous
    slices into a helper process, straight through Mooncake, in ``mode`` (see the
    module docstring)."""
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("Mooncake initialisation failed")
    buf = mmap.mmap(-1, nbytes)
    array = np.frombuffer(buf, dtype=np.uint8)
    array[:] = 7
    addr = int(array.ctypes.data)
    if engine.register_memory(addr, nbytes) != 0:
        raise RuntimeError("Mooncake refused to register the benchmark buffer")
    slice_bytes = nbytes // descriptors
    offsets = [i * slice_bytes for i in range(descriptors)]
    try:
        with _helper("bare_mooncake_target", str(nbytes)) as (_, target):
            srcs = [addr + o for o in offsets]
            dsts = [target["addr"] + o for o in offsets]
            lengths = [slice_bytes] * descriptors
            samples: list[float] = []
            for i in range(warmup + repeats):
                started = time.perf_counter()
                if mode == "pipelined" and i:  # the first write opens the connection
                    _pipelined_write(engine, target["session"], srcs, dsts, lengths)
                else:
                    for start in range(0, descriptors, 1024):
                        stop = start + 1024
                        rc = engine.batch_transfer_sync_write(
                            target["session"],
                            srcs[start:stop],
                            dsts[start:stop],
                            lengths[start:stop],
                        )
                        if rc != 0:
                            raise RuntimeError(f"bare Mooncake write failed with code {rc}")
                if i >= warmup:
                    samples.append(time.perf_counter() - started)
    finally:
        engine.unregister_memory(addr)
    return MooncakeLimit(
        nbytes=nbytes,
        descriptors=descriptors,
        p50=statistics.median(samples),
        p99=_percentile(samples, 0.99),
        mode=mode,
    )


@dataclass(frozen=True, slots=True)
class ZmqLimit:
    """A bare ZMQ PUSH/PULL round trip between two processes, seconds."""

    p50: float
    p99: float


def measure_zmq_rtt(*, repeats: int = 2000, warmup: int = 200) -> ZmqLimit:
    """Round trips of a small 3-frame message to an echoing helper process."""
    import zmq

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    reply_port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    pull.setsockopt(zmq.LINGER, 0)
    frames = [b"1000000", b"5", b"0"]
    samples: list[float] = []
    try:
        with _helper("bare_zmq_echo") as (_, echo):
            push.connect(f"tcp://127.0.0.1:{echo['port']}")
            push.send(str(reply_port).encode())
            for i in range(warmup + repeats):
                started = time.perf_counter()
                push.send_multipart(frames)
                pull.recv_multipart()
                if i >= warmup:
                    samples.append(time.perf_counter() - started)
            push.send_multipart([b"stop"])
    finally:
        push.close()
        pull.close()
        ctx.term()
    return ZmqLimit(p50=statistics.median(samples), p99=_percentile(samples, 0.99))


@dataclass(frozen=True, slots=True)
class ThreadWake:
    """A bare ``threading.Event`` wake-up from one thread to another, seconds."""

    p50: float
    p99: float


def measure_thread_wake(*, repeats: int = 2000, warmup: int = 200) -> ThreadWake:
    """One-way wake-ups of a thread blocked in ``Event.wait`` by another thread's
    ``Event.set``: from just before the set to the waiter's return."""
    wake, ready = threading.Event(), threading.Event()
    set_at: list[float] = []
    samples: list[float] = []
    total = warmup + repeats

    def waiter() -> None:
        for i in range(total):
            ready.set()
            wake.wait()
            woke = time.perf_counter()
            wake.clear()
            if i >= warmup:
                samples.append(woke - set_at[-1])

    thread = threading.Thread(target=waiter, name="tspd-bench-waiter", daemon=True)
    thread.start()
    for _ in range(total):
        ready.wait()
        ready.clear()
        time.sleep(0.0002)  # the waiter is asleep in wait() by now
        set_at.append(time.perf_counter())
        wake.set()
    thread.join(timeout=10)
    if thread.is_alive() or not samples:
        raise RuntimeError("the thread wake-up measurement's waiter did not finish")
    return ThreadWake(p50=statistics.median(samples), p99=_percentile(samples, 0.99))
