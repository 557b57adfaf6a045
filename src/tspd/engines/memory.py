"""In-process transfer engines (tests, benchmarks, simulations): real byte copies,
injectable faults.

:class:`FakeEngine` implements :class:`tspd.engines.base.TransferEngine` by copying
with ``ctypes.memmove`` between regions registered in one process. Engines meet in
a :class:`FakeFabric` keyed by session id (a process-wide default, or one per
test). Every write is validated the way a careful Mooncake would: the peer must be
alive on the fabric, every destination must lie inside one of the peer's
registered regions and every source inside one of this engine's (Mooncake's TCP
transport does not check the source; the fake is stricter on purpose so planner
bugs surface in tests). Failures raise :class:`TransferError` with Mooncake's
codes (``-1`` for a failed write, ``-3`` unknown region, ``-7`` overlap).

It also offers the non-blocking pair of :class:`tspd.engines.base.PollingEngine`:
:meth:`FakeEngine.submit_write` starts a write and :meth:`FakeEngine.check_write`
completes it — copying, or raising the write's error — at the first check once
its latency (or injected stall) has passed on the engine's ``clock``; with no
latency the first check completes it. And it offers the batch pair of
:class:`tspd.engines.base.PipelinedEngine`: :meth:`FakeEngine.submit_batch` records a
batch (one fault per batch, like one write) and :meth:`FakeEngine.wait_batch`
sleeps what is left of its latency, then copies it or raises its error. The
counters record how many batches, and descriptors per peer, were in flight at once
(:class:`FakeEngineStats`), so tests can see a writer keep several batches in
flight without timing anything.

:class:`AsyncFakeEngine` wraps a :class:`FakeEngine` with an ``async batch_write``
whose latency and hangs are ``trio.sleep`` calls, so tests under
``trio.testing.MockClock(autojump_threshold=0)`` run in virtual time without
threads.

Setup never blocks here (``blocking_setup = False``): registering or
unregistering memory is a dict update under a lock — measured with ``timeit``
(best of 5 × 200,000 calls, the 2-core development host) at ~0.3 µs a
``register_memory`` and ~0.25 µs an ``unregister_memory``, against ~90 µs for one
``trio.to_thread.run_sync`` hop — and building or closing an engine only joins or
leaves the fabric. So the shell makes those calls inline
(:mod:`tspd.shell.engine_setup`), which also keeps ``MockClock`` tests
deterministic: a thread hop would let autojump move virtual time and fire timeouts.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, final

import trio

from tspd.engines.base import (
    AddressList,
    BatchTicket,
    TransferError,
    WriteTicket,
    as_address_list,
)

__all__ = [
    "DEFAULT_FABRIC",
    "AsyncFakeEngine",
    "FakeEngine",
    "FakeEngineStats",
    "FakeFabric",
]

_FAILED = -1
_UNKNOWN_REGION = -3
_OVERLAP = -7

#: :attr:`FakeEngine.max_in_flight_descriptors` unless given (Mooncake's TCP default).
DEFAULT_IN_FLIGHT_DESCRIPTORS = 1024


@dataclass(slots=True)
class FakeEngineStats:
    """Counters of one fake engine (all writes it initiated)."""

    batches: int = 0
    descriptors: int = 0
    bytes_written: int = 0
    failures: int = 0
    writes_by_peer: dict[str, int] = field(default_factory=dict)
    #: Batches started with :meth:`FakeEngine.submit_batch`.
    batch_submits: int = 0
    #: Most submitted batches not yet waited for, at any moment.
    peak_batches_in_flight: int = 0
    #: Most descriptors of submitted batches to one peer not yet waited for.
    peak_descriptors_in_flight: int = 0


@dataclass(slots=True)
class _Fault:
    """Pending faults for writes to one peer."""

    fail_writes: int = 0
    fail_code: int = _FAILED
    hang_writes: int = 0
    hang_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class _Submitted:
    """A write started with :meth:`FakeEngine.submit_write`."""

    ready_at: float
    src: int
    dst: int
    fault: tuple[float, int] | None


@dataclass(frozen=True, slots=True)
class _SubmittedBatch:
    """A batch started with :meth:`FakeEngine.submit_batch`."""

    ready_at: float
    src: list[int]
    dst: list[int]
    lengths: list[int]
    fault: tuple[float, int] | None


@final
class FakeFabric:
    """The meeting place of fake engines: session id → live engine."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._engines: dict[str, FakeEngine] = {}
        self._ports = itertools.count(20000)

    def _attach(self, host: str, engine: FakeEngine) -> str:
        with self._lock:
            session = f"{host}:{next(self._ports)}"
            self._engines[session] = engine
            return session

    def _detach(self, session: str) -> None:
        with self._lock:
            self._engines.pop(session, None)

    def lookup(self, session: str) -> FakeEngine | None:
        """The live engine with that session id, if any."""
        with self._lock:
            return self._engines.get(session)

    def sessions(self) -> list[str]:
        """Session ids of every live engine, sorted."""
        with self._lock:
            return sorted(self._engines)


#: The fabric engines join when none is given.
DEFAULT_FABRIC = FakeFabric()


def _find_region(regions: dict[int, int], addr: int, length: int) -> bool:
    """Whether ``[addr, addr+length)`` lies inside one registered region."""
    return any(base <= addr and addr + length <= base + size for base, size in regions.items())


@final
class FakeEngine:
    """A synchronous in-process engine (see the module docstring).

    ``sleep`` is what a hang or latency calls (``time.sleep`` by default); a write
    with latency runs the sleep before copying, so tests can observe a transfer in
    flight. ``clock`` times the non-blocking writes (``time.monotonic`` by default).
    """

    #: Registration, unregistration and close are bookkeeping (see the module docstring).
    blocking_setup: Final = False

    def __init__(
        self,
        host: str = "127.0.0.1",
        *,
        fabric: FakeFabric | None = None,
        latency: float = 0.0,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        max_in_flight_descriptors: int = DEFAULT_IN_FLIGHT_DESCRIPTORS,
    ) -> None:
        if max_in_flight_descriptors < 1:
            raise ValueError(
                f"max_in_flight_descriptors must be at least 1, got {max_in_flight_descriptors}"
            )
        self._fabric = DEFAULT_FABRIC if fabric is None else fabric
        self._lock = threading.Lock()
        self._regions: dict[int, int] = {}
        self._faults: dict[str, _Fault] = {}
        self._sleep = sleep
        self._clock = clock
        self._submitted: dict[int, _Submitted] = {}
        self._batches: dict[int, _SubmittedBatch] = {}
        self._batch_load: dict[str, int] = {}
        self._max_in_flight = max_in_flight_descriptors
        self._tokens = itertools.count(1)
        self.latency = latency
        self.stats = FakeEngineStats()
        self._closed = False
        self._session_id = self._fabric._attach(host, self)

    @property
    def session_id(self) -> str:
        """``"{host}:{port}"`` with a port unique on the fabric."""
        return self._session_id

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (the engine is then a dead peer)."""
        return self._closed

    # -- registration ---------------------------------------------------------

    def register_memory(self, addr: int, length: int) -> None:
        """Register ``[addr, addr+length)``; an overlap fails with code -7."""
        if addr <= 0 or length <= 0:
            raise TransferError(
                self._session_id, _FAILED, f"cannot register {length} bytes at {addr:#x}"
            )
        with self._lock:
            for base, size in self._regions.items():
                if addr < base + size and base < addr + length:
                    raise TransferError(
                        self._session_id,
                        _OVERLAP,
                        f"region {addr:#x}+{length} overlaps registered {base:#x}+{size}",
                    )
            self._regions[addr] = length

    def unregister_memory(self, addr: int) -> None:
        """Withdraw the region at ``addr``; an unknown address fails with code -3."""
        with self._lock:
            if self._regions.pop(addr, None) is None:
                raise TransferError(
                    self._session_id, _UNKNOWN_REGION, f"no region registered at {addr:#x}"
                )

    def regions(self) -> dict[int, int]:
        """A copy of the registered regions, base → length."""
        with self._lock:
            return dict(self._regions)

    # -- faults ---------------------------------------------------------------

    def fail_next(self, peer_session: str, count: int = 1, *, code: int = _FAILED) -> None:
        """Make the next ``count`` writes to ``peer_session`` fail with ``code``
        without copying anything."""
        with self._lock:
            fault = self._faults.setdefault(peer_session, _Fault())
            fault.fail_writes += count
            fault.fail_code = code

    def hang_next(self, peer_session: str, seconds: float, count: int = 1) -> None:
        """Make the next ``count`` writes to ``peer_session`` stall ``seconds`` and
        then fail, like a write to a hung peer hitting ``MC_TRANSFER_TIMEOUT``."""
        with self._lock:
            fault = self._faults.setdefault(peer_session, _Fault())
            fault.hang_writes += count
            fault.hang_seconds = seconds

    def clear_faults(self) -> None:
        """Forget every pending fault."""
        with self._lock:
            self._faults.clear()

    def _take_fault(self, peer_session: str) -> tuple[float, int] | None:
        """Consume one pending fault for ``peer_session``: (stall seconds, code)."""
        with self._lock:
            fault = self._faults.get(peer_session)
            if fault is None:
                return None
            if fault.hang_writes > 0:
                fault.hang_writes -= 1
                return (fault.hang_seconds, _FAILED)
            if fault.fail_writes > 0:
                fault.fail_writes -= 1
                return (0.0, fault.fail_code)
            return None

    # -- writes ---------------------------------------------------------------

    def batch_write(
        self,
        peer_session: str,
        src: AddressList,
        dst: AddressList,
        lengths: AddressList,
    ) -> None:
        """Validate and copy the batch (see the module docstring)."""
        fault = self._take_fault(peer_session)
        stall = self.latency if fault is None else max(fault[0], self.latency)
        if stall > 0:
            self._sleep(stall)
        self._write_now(peer_session, src, dst, lengths, fault)

    def submit_write(self, peer_session: str, src: int, dst: int, length: int) -> WriteTicket:
        """Start one write (see the module docstring); a closed engine refuses."""
        if self._closed:
            raise TransferError(peer_session, _FAILED, f"engine {self._session_id} is closed")
        fault = self._take_fault(peer_session)
        stall = self.latency if fault is None else max(fault[0], self.latency)
        now = self._clock()
        with self._lock:
            token = next(self._tokens)
            self._submitted[token] = _Submitted(now + stall, src, dst, fault)
        return WriteTicket(peer_session, token, length, now)

    def check_write(self, ticket: WriteTicket) -> bool:
        """``False`` until the write's latency passed; then copy (``True``) or raise
        its :class:`TransferError`. A ticket this engine does not hold raises."""
        with self._lock:
            pending = self._submitted.get(ticket.token)
            if pending is None:
                raise TransferError(
                    ticket.peer_session, _FAILED, f"no write in flight with token {ticket.token}"
                )
            if self._clock() < pending.ready_at:
                return False
            del self._submitted[ticket.token]
        self._write_now(
            ticket.peer_session, [pending.src], [pending.dst], [ticket.length], pending.fault
        )
        return True

    @property
    def pending_writes(self) -> int:
        """Writes submitted and not yet completed by a check."""
        with self._lock:
            return len(self._submitted)

    @property
    def max_in_flight_descriptors(self) -> int:
        """The per-peer in-flight bound a writer should keep to (the constructor's)."""
        return self._max_in_flight

    def submit_batch(
        self, peer_session: str, src: AddressList, dst: AddressList, lengths: AddressList
    ) -> BatchTicket:
        """Record a batch (one pending fault applies to the whole batch); columns that
        are not integers or differ in length are refused at once, everything else is
        checked when :meth:`wait_batch` copies."""
        srcs, dsts, lens = self._columns(peer_session, src, dst, lengths)
        fault = self._take_fault(peer_session)
        stall = self.latency if fault is None else max(fault[0], self.latency)
        now = self._clock()
        with self._lock:
            token = next(self._tokens)
            self._batches[token] = _SubmittedBatch(now + stall, srcs, dsts, lens, fault)
            load = self._batch_load.get(peer_session, 0) + len(lens)
            self._batch_load[peer_session] = load
            stats = self.stats
            stats.batch_submits += 1
            stats.peak_batches_in_flight = max(stats.peak_batches_in_flight, len(self._batches))
            stats.peak_descriptors_in_flight = max(stats.peak_descriptors_in_flight, load)
        return BatchTicket(peer_session, len(lens), sum(lens), now, token)

    def wait_batch(self, ticket: BatchTicket) -> None:
        """Sleep what is left of the batch's latency (or stall), then copy it or raise
        its :class:`TransferError`. A ticket this engine does not hold raises."""
        token = ticket.handle
        with self._lock:
            pending = self._batches.get(token) if isinstance(token, int) else None
        if pending is None or not isinstance(token, int):
            raise TransferError(
                ticket.peer_session, _FAILED, f"no batch in flight with token {ticket.handle}"
            )
        try:
            left = pending.ready_at - self._clock()
            if left > 0:
                self._sleep(left)
            self._write_now(
                ticket.peer_session, pending.src, pending.dst, pending.lengths, pending.fault
            )
        finally:
            with self._lock:
                del self._batches[token]
                load = self._batch_load[ticket.peer_session] - len(pending.lengths)
                if load:
                    self._batch_load[ticket.peer_session] = load
                else:
                    del self._batch_load[ticket.peer_session]

    @property
    def batches_in_flight(self) -> int:
        """Batches submitted and not yet waited for."""
        with self._lock:
            return len(self._batches)

    def _write_now(
        self,
        peer_session: str,
        src: AddressList,
        dst: AddressList,
        lengths: AddressList,
        fault: tuple[float, int] | None,
    ) -> None:
        """The synchronous part of a write, after any latency."""
        try:
            if fault is not None:
                stalled = f" after stalling {fault[0]:g}s" if fault[0] > 0 else ""
                raise TransferError(peer_session, fault[1], f"injected fault{stalled}")
            copies = self._validate(peer_session, src, dst, lengths)
        except TransferError:
            with self._lock:
                self.stats.failures += 1
            raise
        total = 0
        for s, d, n in copies:
            ctypes.memmove(d, s, n)
            total += n
        with self._lock:
            self.stats.batches += 1
            self.stats.descriptors += len(copies)
            self.stats.bytes_written += total
            by_peer = self.stats.writes_by_peer
            by_peer[peer_session] = by_peer.get(peer_session, 0) + 1

    def _columns(
        self, peer_session: str, src: AddressList, dst: AddressList, lengths: AddressList
    ) -> tuple[list[int], list[int], list[int]]:
        """A batch's three columns as address lists; a closed engine, a column that is
        not integers or columns of different lengths are a ``TransferError``."""
        if self._closed:
            raise TransferError(peer_session, _FAILED, f"engine {self._session_id} is closed")
        try:
            srcs = as_address_list(src, what="src")
            dsts = as_address_list(dst, what="dst")
            lens = as_address_list(lengths, what="lengths")
        except TypeError as exc:
            raise TransferError(peer_session, _FAILED, str(exc)) from None
        if not len(srcs) == len(dsts) == len(lens):
            raise TransferError(
                peer_session,
                _FAILED,
                f"batch columns differ in length: {len(srcs)} src, {len(dsts)} dst, "
                f"{len(lens)} lengths",
            )
        return srcs, dsts, lens

    def _validate(
        self,
        peer_session: str,
        src: AddressList,
        dst: AddressList,
        lengths: AddressList,
    ) -> list[tuple[int, int, int]]:
        srcs, dsts, lens = self._columns(peer_session, src, dst, lengths)
        peer = self._fabric.lookup(peer_session)
        if peer is None or peer.closed:
            raise TransferError(peer_session, _FAILED, "peer session is not reachable")
        local, remote = self.regions(), peer.regions()
        copies: list[tuple[int, int, int]] = []
        for s, d, n in zip(srcs, dsts, lens, strict=True):
            if n < 0:
                raise TransferError(peer_session, _FAILED, f"negative length {n}")
            if n == 0:
                continue
            if not _find_region(local, s, n):
                raise TransferError(
                    peer_session,
                    _FAILED,
                    f"source {s:#x}+{n} is not within a region registered by {self._session_id}",
                )
            if not _find_region(remote, d, n):
                raise TransferError(
                    peer_session,
                    _FAILED,
                    f"remote-supplied address {d:#x}+{n} is not within any registered buffer",
                )
            copies.append((s, d, n))
        return copies

    def close(self) -> None:
        """Leave the fabric; writes to this engine now fail as to a dead peer."""
        if self._closed:
            return
        self._closed = True
        self._fabric._detach(self._session_id)


@final
class AsyncFakeEngine:
    """An :class:`tspd.engines.base.AsyncTransferEngine` over a :class:`FakeEngine`
    whose latency and hangs are ``trio.sleep`` (virtual time under ``MockClock``).

    A write that started is not abandoned when cancelled: the sleep is shielded,
    as a real transfer referencing registered memory would run to its end.
    """

    #: As :attr:`FakeEngine.blocking_setup`: setup is bookkeeping, made inline.
    blocking_setup: Final = False

    def __init__(
        self,
        host: str = "127.0.0.1",
        *,
        fabric: FakeFabric | None = None,
        latency: float = 0.0,
    ) -> None:
        self.engine = FakeEngine(host, fabric=fabric)
        self.latency = latency
        self.in_flight = 0

    @property
    def session_id(self) -> str:
        """The wrapped engine's session id."""
        return self.engine.session_id

    @property
    def stats(self) -> FakeEngineStats:
        """The wrapped engine's counters."""
        return self.engine.stats

    def register_memory(self, addr: int, length: int) -> None:
        """As :meth:`FakeEngine.register_memory`."""
        self.engine.register_memory(addr, length)

    def unregister_memory(self, addr: int) -> None:
        """As :meth:`FakeEngine.unregister_memory`."""
        self.engine.unregister_memory(addr)

    def fail_next(self, peer_session: str, count: int = 1, *, code: int = _FAILED) -> None:
        """As :meth:`FakeEngine.fail_next`."""
        self.engine.fail_next(peer_session, count, code=code)

    def hang_next(self, peer_session: str, seconds: float, count: int = 1) -> None:
        """As :meth:`FakeEngine.hang_next`, in ``trio`` time."""
        self.engine.hang_next(peer_session, seconds, count)

    async def batch_write(
        self,
        peer_session: str,
        src: AddressList,
        dst: AddressList,
        lengths: AddressList,
    ) -> None:
        """Sleep the latency (or the injected hang) in Trio time, then copy."""
        await trio.lowlevel.checkpoint_if_cancelled()
        fault = self.engine._take_fault(peer_session)
        stall = self.latency if fault is None else max(fault[0], self.latency)
        self.in_flight += 1
        try:
            with trio.CancelScope(shield=True):
                if stall > 0:
                    await trio.sleep(stall)
                self.engine._write_now(peer_session, src, dst, lengths, fault)
        finally:
            self.in_flight -= 1
        # Yield without raising Cancelled: the write happened and its outcome must
        # reach the caller, as with a thread that is never abandoned.
        await trio.lowlevel.cancel_shielded_checkpoint()

    def close(self) -> None:
        """As :meth:`FakeEngine.close`."""
        self.engine.close()
