"""Calling a blocking transfer engine from Trio, and waiting for producer steps.

:class:`EngineRunner` turns any synchronous :class:`~tspd.engines.base.TransferEngine`
into an :class:`~tspd.engines.base.AsyncTransferEngine`, under a per-engine
``trio.CapacityLimiter`` that bounds concurrent writes (Mooncake's sync calls
busy-spin a core each; on a small host one or two concurrent writes is the useful
limit). A write takes one of three ways:

* **pipelined** — when the engine is a :class:`~tspd.engines.base.PipelinedEngine`,
  the write has at least ``pipeline_min_descriptors`` copies and a write to that
  peer already succeeded: the copies go out in batches of at most
  ``max_descriptors`` and half the engine's per-peer in-flight bound
  (:attr:`~tspd.engines.base.PipelinedEngine.max_in_flight_descriptors`), each
  submitted in one engine call on the Trio thread and waited for in a worker
  thread, with up to that bound in flight to the peer (two batches by default,
  whatever other writes to it hold) — so the engine always has the next batch
  queued when one finishes, and no Python runs per copy. :meth:`EngineRunner.write_plan`
  checks the caller's ``active()`` before every submission (write fencing). The
  limiter is held only while a batch is submitted: a long pipelined write never
  holds up another write for more than that. Measured on the 2-core host with
  Mooncake over loopback TCP (other load present, medians of 4-7 interleaved
  writes), 16,384 scattered 4 KiB copies: 0.69 s pipelined against 1.02 s polled
  one copy at a time in 16 calls of 1,024 and 1.33 s through Mooncake's
  busy-spinning sync calls; under heavier load 0.72 s against 0.77 and 1.16 s
  (what is left is Mooncake's own cost of ~30-45 µs a 4 KiB copy there);
* **polled on the Trio thread** — when the engine is a
  :class:`~tspd.engines.base.PollingEngine`, the batch has at most
  ``poll_max_descriptors`` copies and a write to that peer already succeeded: one
  ``submit_write`` per copy (a copy longer than ``split_bytes`` as several, see
  :data:`DEFAULT_SPLIT_BYTES`), then ``check_write`` on each until all are done. The
  first checks are zero-length sleeps (a 4 KiB write takes ~50 µs), then one every
  millisecond; a write expected to take milliseconds sleeps most of that first and
  is then checked once a millisecond, never spun on (a 64 MiB room in
  ``tspd bench pd``, 4 interleaved pairs of 5 rooms: median room 45.6-59.5 ms
  spinning, 42.2-45.8 ms not).
  Measured on the 2-core host with Mooncake over loopback TCP: a 4 KiB write 52 µs
  polled against 148 µs through a thread, four 4 KiB copies 137 against 272 µs;
  at eight copies one write alone is faster through a thread (each submit is a
  separate transfer), but under load polling wins, hence the default of polling
  every write to a reached peer (:data:`DEFAULT_POLL_MAX_DESCRIPTORS`);
* **in a worker thread** — everything else, via ``trio.to_thread.run_sync``: big
  batches (one engine call for all their descriptors), engines without the
  polling pair, and the first write to a peer (opening a peer's connection can
  block for a handshake, or much longer for a peer that does not answer, and that
  must not stall the Trio loop; a pipelined write sends its first batch this way,
  then pipelines the rest). A failed write sends its peer back to this way.

Cancellation: a write is **never abandoned**. The engine is reading this rank's
registered memory and writing the peer's; if the caller moved on, the memory could
be released or reused (sleep/wake, a room that ended) while the transfer still
references it. A thread is never abandoned (``abandon_on_cancel=False``), and a
polled write is checked under a shielded cancel scope until the engine reports it
done or failed — which it does within ``MC_TRANSFER_TIMEOUT`` for Mooncake. A
cancelled caller therefore waits for the write to finish and gets its outcome: a
``TransferError`` if it failed, otherwise the cancellation is delivered at the
caller's next checkpoint. A cancel that arrives while waiting for the limiter
cancels the write before it starts. A pipelined write submits nothing more once
cancelled, waits (shielded) for every batch it submitted, and then raises the
first batch's ``TransferError`` if one failed, else the cancellation. A failed
batch likewise stops submission: the batches in flight are waited for, then the
error is raised.

The runner's setup calls (``register_memory``, ``unregister_memory``, ``close``)
call the engine's in the calling thread and report its ``blocking_setup``; from
Trio, make them through :mod:`tspd.shell.engine_setup`, which takes a worker thread
for an engine whose setup blocks (Mooncake) and stays inline otherwise.

:func:`wait_step` waits until a producer step counter has passed a target step
(docs/protocol.md#proto-step-counter). The default polls the counter on the Trio thread:
a read is one aligned 8-byte load, far cheaper than a thread hop, so the loop stays
responsive and the wait is cancellable at once. ``in_thread=True`` instead blocks a
worker thread with the same polling (for counters whose read may block); that thread is
abandoned on cancel, and a stop flag makes it exit within one poll interval so it never
outlives the wait by more than that.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final, final

import trio

from tspd.core.config import parse_pd_env
from tspd.core.copies import DEFAULT_MAX_DESCRIPTORS, CopyPlan, batches
from tspd.core.schedule import step_ready
from tspd.engines.base import (
    AddressList,
    BatchTicket,
    PipelinedEngine,
    PollingEngine,
    TransferEngine,
    TransferError,
    WriteTicket,
    as_address_list,
    setup_blocks,
)

__all__ = [
    "DEFAULT_PIPELINE_MIN_DESCRIPTORS",
    "DEFAULT_POLL_MAX_DESCRIPTORS",
    "DEFAULT_SPLIT_BYTES",
    "DEFAULT_WRITE_CONCURRENCY",
    "EngineRunner",
    "StartedWrite",
    "wait_step",
]

DEFAULT_WRITE_CONCURRENCY: Final = 1
"""Concurrent writes per engine when no limiter is given. Mooncake's synchronous
calls busy-spin a core each: on a small host one write at a time is the fastest
setting (the demo and ``tspd bench pd`` measure with it)."""

DEFAULT_POLL_MAX_DESCRIPTORS: Final = 1 << 16
"""Largest batch written by polling on the Trio thread (see the module docstring):
every write to a reached peer, however many copies. Alone, a batch of more than
four 4 KiB copies writes faster through a thread; under load the thread's busy-spin
takes a core from the other ranks, and polling wins. Measured on the 2-core host
(``tspd demo``, 300 rooms, 16 in flight, 2 runs each): through threads for more
than four copies 270-282 rooms/s, hand-over -> done p50 33-34 ms, Prefill CPU
5.2-5.3 ms a room; every write polled 339-341 rooms/s, 20-21 ms, 3.8-3.9 ms. Pass
``poll_max_descriptors=4`` for the single-write optimum."""

DEFAULT_PIPELINE_MIN_DESCRIPTORS: Final = 512
"""Smallest write that is pipelined on an engine that can (see the module docstring).
Below it a write is polled one copy at a time as before (no thread hop to wait for
it), so small rooms — the rooms/s workload groups at most 256 one-page rooms into a
write — keep exactly their former path."""

DEFAULT_SPLIT_BYTES: Final = 16 << 20
"""Longest piece a polled write submits as one descriptor: a longer copy goes as
``ceil(length / DEFAULT_SPLIT_BYTES)`` equal pieces, submitted together, which
Mooncake's TCP transport carries over several connections at once (one copy is one
connection, whose rate after an idle pause starts low: docs/configuration.md,
"Host settings"). Measured on the 2-core host over loopback TCP (BBR), 64 MiB
contiguous rooms through ``tspd demo``'s roles, 8 rooms a run, 11 alternated pairs:
median room 29.1-39.9 ms in 16 MiB pieces against 32.5-53.1 ms as one copy (10
pairs faster, one 0.5 ms slower); a bare 64 MiB write after a 0.4 s pause 33-34 ms
in four pieces against 38-42 ms whole, back to back the same (26 ms). 8 MiB pieces
did no better."""

_SPLIT_SUBMISSIONS: Final = 64
"""Submissions a polled write grows to at most by splitting its long copies (later
long copies go whole): the pieces stay well inside Mooncake's per-peer queue
(``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``, 1,024 by default)."""

_MAX_BATCHES_IN_FLIGHT: Final = 8
"""Batches one pipelined write keeps in flight at most (with the default sizes the
engine's in-flight bound allows two)."""

_WARM_PEERS: Final = 4096
"""Peers remembered as reached; the oldest is forgotten beyond this."""

#: The polling schedule's model of a write: a fixed cost per copy plus bytes at
#: loopback-TCP speed. Only the sleep pattern depends on it, never an outcome.
_COPY_COST_S: Final = 30e-6
_BYTES_PER_S: Final = 2.5e9
#: Fast (zero-length sleep) checks run until twice the expected time plus this.
_FAST_SLACK_S: Final = 0.0005
#: A write expected to take longer than this first sleeps all but _WAKE_EARLY_S of it.
_SLEEP_FIRST_S: Final = 0.003
_WAKE_EARLY_S: Final = 0.002
#: Check interval once the fast checks are over (a timed Trio sleep rounds up to
#: about a millisecond anyway).
_SLOW_POLL_S: Final = 0.001

_FAST_POLLS: Final = 8
"""Zero-length sleeps before a step wait backs off to timed polls."""


@dataclass(slots=True)
class StartedWrite:
    """A polled write that :meth:`EngineRunner.start_write` started: its submitted
    copies, the error that stopped submission (if any) and the limiter token it
    holds. Hand it to :meth:`EngineRunner.finish_write`."""

    peer_session: str
    tickets: list[WriteTicket]
    error: TransferError | None
    started: float
    expected: float
    borrower: object


@final
class EngineRunner:
    """An async front for a synchronous engine (see the module docstring).

    ``limiter`` bounds concurrent writes (threads and polled writes alike; a
    pipelined write holds it only to submit each batch) for this engine; the
    default allows :data:`DEFAULT_WRITE_CONCURRENCY`. ``poll_max_descriptors`` is
    the largest batch written by polling (0: always a thread);
    ``pipeline_min_descriptors`` the smallest write pipelined (0: never);
    ``split_bytes`` the longest copy a polled write submits whole (0: never split,
    see :data:`DEFAULT_SPLIT_BYTES`). The setup
    calls run in the calling thread; :attr:`blocking_setup` is the engine's, for
    :mod:`tspd.shell.engine_setup` to decide where to make them.
    """

    def __init__(
        self,
        engine: TransferEngine,
        *,
        limiter: trio.CapacityLimiter | None = None,
        poll_max_descriptors: int = DEFAULT_POLL_MAX_DESCRIPTORS,
        pipeline_min_descriptors: int = DEFAULT_PIPELINE_MIN_DESCRIPTORS,
        split_bytes: int = DEFAULT_SPLIT_BYTES,
    ) -> None:
        if split_bytes < 0:
            raise ValueError(f"split_bytes must not be negative, got {split_bytes}")
        if poll_max_descriptors < 0:
            raise ValueError(
                f"poll_max_descriptors must not be negative, got {poll_max_descriptors}"
            )
        if pipeline_min_descriptors < 0:
            raise ValueError(
                f"pipeline_min_descriptors must not be negative, got {pipeline_min_descriptors}"
            )
        self.engine = engine
        self.limiter = (
            trio.CapacityLimiter(DEFAULT_WRITE_CONCURRENCY) if limiter is None else limiter
        )
        self._polling: PollingEngine | None = (
            engine if poll_max_descriptors and isinstance(engine, PollingEngine) else None
        )
        self._poll_max = poll_max_descriptors
        self._pipelined: PipelinedEngine | None = (
            engine if pipeline_min_descriptors and isinstance(engine, PipelinedEngine) else None
        )
        self._pipeline_min = pipeline_min_descriptors
        self._split = split_bytes
        #: Peers a write reached since their last failure (insertion-ordered, bounded).
        self._reached: dict[str, None] = {}
        self._in_flight = 0
        #: Descriptors of pipelined batches in flight, per peer.
        self._batch_load: dict[str, int] = {}
        #: Writes that took each way (for tests and benchmarks).
        self.polled_writes = 0
        self.thread_writes = 0
        self.pipelined_writes = 0
        #: Most batches one pipelined write had in flight at once.
        self.peak_batches_in_flight = 0

    @classmethod
    def from_env(
        cls,
        engine: TransferEngine,
        environ: Mapping[str, str],
        *,
        default_concurrency: int = DEFAULT_WRITE_CONCURRENCY,
        poll_max_descriptors: int = DEFAULT_POLL_MAX_DESCRIPTORS,
        pipeline_min_descriptors: int = DEFAULT_PIPELINE_MIN_DESCRIPTORS,
        split_bytes: int = DEFAULT_SPLIT_BYTES,
    ) -> EngineRunner:
        """A runner whose write concurrency is ``TOKENSPEED_DISAGGREGATION_THREAD_POOL_SIZE``
        from ``environ`` (pass ``os.environ``) when set, else ``default_concurrency``.
        TokenSpeed's pool runs its blocking writes; here it bounds the writes in
        flight at once, polled or threaded. Raises ``ConfigError`` naming the
        variable for an invalid value."""
        size = parse_pd_env(environ, prefill=False).thread_pool_size
        return cls(
            engine,
            limiter=trio.CapacityLimiter(size or default_concurrency),
            poll_max_descriptors=poll_max_descriptors,
            pipeline_min_descriptors=pipeline_min_descriptors,
            split_bytes=split_bytes,
        )

    @property
    def session_id(self) -> str:
        """The engine's session id."""
        return self.engine.session_id

    @property
    def in_flight(self) -> int:
        """Writes started and not yet finished (including those waiting for the limiter)."""
        return self._in_flight

    @property
    def blocking_setup(self) -> bool:
        """Whether the engine's setup calls may block
        (:attr:`~tspd.engines.base.TransferEngine.blocking_setup`)."""
        return setup_blocks(self.engine)

    async def _take_turn(self) -> object:
        """A turn of the write limiter, on behalf of a fresh borrower (returned, for
        the release). A free limiter is taken without yielding: a scheduler pass costs
        tens of µs next to a ~50 µs write."""
        borrower = object()
        try:
            self.limiter.acquire_on_behalf_of_nowait(borrower)
        except trio.WouldBlock:
            await self.limiter.acquire_on_behalf_of(borrower)
        return borrower

    def register_memory(self, addr: int, length: int) -> None:
        """As :meth:`~tspd.engines.base.TransferEngine.register_memory`, in the calling
        thread (from Trio: :func:`tspd.shell.engine_setup.register_memory`)."""
        self.engine.register_memory(addr, length)

    def unregister_memory(self, addr: int) -> None:
        """As :meth:`~tspd.engines.base.TransferEngine.unregister_memory`, in the calling
        thread (from Trio: :func:`tspd.shell.engine_setup.unregister_memory`)."""
        self.engine.unregister_memory(addr)

    async def batch_write(
        self,
        peer_session: str,
        src: AddressList,
        dst: AddressList,
        lengths: AddressList,
    ) -> None:
        """Write the batch, pipelined, polled or in a worker thread (see the module
        docstring); never abandoned once started (a cancel that arrives while waiting
        for the limiter does cancel the write before it starts)."""
        self._in_flight += 1
        try:
            pipelined = self._pipelined
            if (
                pipelined is not None
                and len(src) >= self._pipeline_min
                and peer_session in self._reached
            ):
                if not len(src) == len(dst) == len(lengths):
                    raise TransferError(
                        peer_session,
                        -1,
                        f"batch columns differ in length: {len(src)} src, {len(dst)} dst, "
                        f"{len(lengths)} lengths",
                    )
                step = max(1, pipelined.max_in_flight_descriptors // 2)
                await self._pipeline(
                    pipelined, peer_session, src, dst, lengths, 0, step, _always, None
                )
            elif (
                self._polling is not None
                and len(src) <= self._poll_max
                and peer_session in self._reached
            ):
                self.polled_writes += 1
                # A cancel up to here lands before anything started. A free limiter
                # is taken without yielding: a scheduler pass costs tens of µs next
                # to a ~50 µs write.
                await trio.lowlevel.checkpoint_if_cancelled()
                borrower = await self._take_turn()
                await self._finish(
                    self._submit(self._polling, borrower, peer_session, src, dst, lengths)
                )
            else:
                self.thread_writes += 1
                await trio.to_thread.run_sync(
                    self.engine.batch_write,
                    peer_session,
                    src,
                    dst,
                    lengths,
                    limiter=self.limiter,
                    abandon_on_cancel=False,
                )
        except TransferError:
            self._reached.pop(peer_session, None)
            raise
        finally:
            self._in_flight -= 1
        if peer_session not in self._reached:
            if len(self._reached) >= _WARM_PEERS:
                del self._reached[next(iter(self._reached))]
            self._reached[peer_session] = None

    def start_write(
        self,
        peer_session: str,
        src: AddressList,
        dst: AddressList,
        lengths: AddressList,
    ) -> StartedWrite | None:
        """Start a write that :meth:`batch_write` would poll, now, without yielding —
        or return ``None`` when it would not be polled (not a polling engine, too
        many copies, a write that would be pipelined, a peer not reached yet) or the
        limiter is taken. A started
        write must be passed to :meth:`finish_write`: it references registered
        memory until that returns. Lets a caller start a transfer before its task
        next yields (the Prefill hand-over: ~30 µs sooner than a worker wake-up)."""
        engine = self._polling
        if (
            engine is None
            or len(src) > self._poll_max
            or peer_session not in self._reached
            or (self._pipelined is not None and len(src) >= self._pipeline_min)
        ):
            return None
        borrower = object()
        try:
            self.limiter.acquire_on_behalf_of_nowait(borrower)
        except trio.WouldBlock:
            return None
        self._in_flight += 1
        self.polled_writes += 1
        return self._submit(engine, borrower, peer_session, src, dst, lengths)

    async def finish_write(self, write: StartedWrite) -> None:
        """Wait until a write from :meth:`start_write` is done — shielded, like every
        polled write — and raise its :class:`TransferError` if it failed."""
        try:
            await self._finish(write)
        except TransferError:
            self._reached.pop(write.peer_session, None)
            raise
        finally:
            self._in_flight -= 1

    async def write_plan(
        self,
        peer_session: str,
        plan: CopyPlan,
        *,
        max_descriptors: int = DEFAULT_MAX_DESCRIPTORS,
        active: Callable[[], bool] | None = None,
        on_batch: Callable[[int, int], None] | None = None,
    ) -> bool:
        """Write ``plan`` to ``peer_session`` in engine calls of at most
        ``max_descriptors`` copies, checking ``active()`` before every call (write
        fencing); ``False`` once it said no — nothing more is started then, and
        whatever was started is finished first. ``on_batch(descriptors, nbytes)``
        follows every call that succeeded. Pipelined when the engine can and the
        plan has at least ``pipeline_min_descriptors`` copies (the first call to a
        peer not reached yet goes alone, through a thread), else one
        :meth:`batch_write` after another. Raises the first failed call's
        :class:`TransferError` once nothing of the plan is in flight."""
        if max_descriptors < 1:
            raise ValueError(f"max_descriptors must be at least 1, got {max_descriptors}")
        check = _always if active is None else active
        engine = self._pipelined
        if engine is None or len(plan) < self._pipeline_min:
            for batch in batches(plan, max_descriptors):
                if not check():
                    return False
                await self.batch_write(peer_session, batch.src, batch.dst, batch.length)
                if on_batch is not None:
                    on_batch(len(batch), batch.total_bytes)
            return True
        step = max(1, min(max_descriptors, engine.max_in_flight_descriptors // 2))
        start = 0
        if peer_session not in self._reached:
            if not check():
                return False
            first = CopyPlan(plan.src[:step], plan.dst[:step], plan.length[:step])
            await self.batch_write(peer_session, first.src, first.dst, first.length)
            if on_batch is not None:
                on_batch(len(first), first.total_bytes)
            start = len(first)
            if start == len(plan):
                return True
        self._in_flight += 1
        try:
            return await self._pipeline(
                engine, peer_session, plan.src, plan.dst, plan.length, start, step, check, on_batch
            )
        finally:
            self._in_flight -= 1

    async def _pipeline(
        self,
        engine: PipelinedEngine,
        peer_session: str,
        src: AddressList,
        dst: AddressList,
        lengths: AddressList,
        start: int,
        step: int,
        active: Callable[[], bool],
        on_batch: Callable[[int, int], None] | None,
    ) -> bool:
        """Submit ``[start, len)`` of the columns in batches of ``step``, keeping the
        peer's pipelined descriptors within the engine's bound (at least one batch of
        this write in flight); ``False`` if ``active()`` stopped it (see
        :meth:`write_plan` and the module docstring's cancellation rule)."""
        self.pipelined_writes += 1
        budget = max(1, engine.max_in_flight_descriptors)
        pending: deque[tuple[BatchTicket, int]] = deque()
        error: TransferError | None = None
        total = len(lengths)
        try:
            for first in range(start, total, step):
                last = min(first + step, total)
                count = last - first
                while pending and (
                    len(pending) >= _MAX_BATCHES_IN_FLIGHT
                    or self._batch_load.get(peer_session, 0) + count > budget
                ):
                    error = await self._reap(engine, peer_session, pending, on_batch)
                    if error is not None:
                        return False
                # A cancel stops submission here; what is in flight is waited for below.
                await trio.lowlevel.checkpoint_if_cancelled()
                borrower = await self._take_turn()
                try:
                    if not active():
                        return False
                    ticket = engine.submit_batch(
                        peer_session, src[first:last], dst[first:last], lengths[first:last]
                    )
                except TransferError as err:
                    error = err
                    return False
                finally:
                    self.limiter.release_on_behalf_of(borrower)
                pending.append((ticket, count))
                self._batch_load[peer_session] = self._batch_load.get(peer_session, 0) + count
                self.peak_batches_in_flight = max(self.peak_batches_in_flight, len(pending))
            return True
        finally:
            while pending:
                late = await self._reap(engine, peer_session, pending, on_batch)
                error = error or late
            if error is not None:
                self._reached.pop(peer_session, None)
                # A failure outranks a cancellation (the module docstring's rule).
                raise error

    async def _reap(
        self,
        engine: PipelinedEngine,
        peer_session: str,
        pending: deque[tuple[BatchTicket, int]],
        on_batch: Callable[[int, int], None] | None,
    ) -> TransferError | None:
        """Wait (shielded, in a worker thread) for the oldest pipelined batch; its error."""
        ticket, count = pending.popleft()
        error: TransferError | None = None
        try:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(engine.wait_batch, ticket, abandon_on_cancel=False)
        except TransferError as err:
            error = err
        except Exception as err:  # the batch is spent either way; never leave the rest
            error = TransferError(peer_session, -1, f"{type(err).__name__}: {err}")
        finally:
            load = self._batch_load.get(peer_session, 0) - count
            if load > 0:
                self._batch_load[peer_session] = load
            else:
                self._batch_load.pop(peer_session, None)
        if error is None and on_batch is not None:
            on_batch(count, ticket.length)
        return error

    def _submit(
        self,
        engine: PollingEngine,
        borrower: object,
        peer_session: str,
        src: AddressList,
        dst: AddressList,
        lengths: AddressList,
    ) -> StartedWrite:
        """Submit one write per copy (the limiter is held for ``borrower``); never
        raises: an error is kept in the result, raised by :meth:`_finish` once
        whatever was submitted is done."""
        started = time.perf_counter()
        tickets: list[WriteTicket] = []
        try:
            srcs = as_address_list(src, what="src")
            dsts = as_address_list(dst, what="dst")
            lens = as_address_list(lengths, what="lengths")
        except TypeError as err:
            return StartedWrite(
                peer_session,
                tickets,
                TransferError(peer_session, -1, str(err)),
                started,
                0.0,
                borrower,
            )
        if not len(srcs) == len(dsts) == len(lens):
            detail = (
                f"batch columns differ in length: {len(srcs)} src, {len(dsts)} dst, "
                f"{len(lens)} lengths"
            )
            return StartedWrite(
                peer_session,
                tickets,
                TransferError(peer_session, -1, detail),
                started,
                0.0,
                borrower,
            )
        error: TransferError | None = None
        split = self._split
        spare = _SPLIT_SUBMISSIONS - len(srcs)  # pieces beyond one a copy, at most
        for s, d, n in zip(srcs, dsts, lens, strict=True):
            if n == 0:
                continue
            try:
                extra = -(-n // split) - 1 if split and n > split else 0  # pieces - 1
                if not extra or extra > spare:
                    tickets.append(engine.submit_write(peer_session, s, d, n))
                    continue
                spare -= extra
                for offset, size in _pieces(n, extra + 1):
                    tickets.append(engine.submit_write(peer_session, s + offset, d + offset, size))
            except TransferError as err:
                error = err
                break  # what was submitted is still waited for
        expected = len(tickets) * _COPY_COST_S + sum(lens) / _BYTES_PER_S
        return StartedWrite(peer_session, tickets, error, started, expected, borrower)

    async def _finish(self, write: StartedWrite) -> None:
        """Check a submitted write until nothing is in flight (whatever cancels
        arrive), release its limiter token, raise its first error."""
        try:
            late: TransferError | None = None
            if write.tickets:
                assert self._polling is not None
                late = await _await_tickets(
                    self._polling, write.tickets, write.started, write.expected
                )
            else:
                await trio.lowlevel.cancel_shielded_checkpoint()  # still a schedule point
        finally:
            self.limiter.release_on_behalf_of(write.borrower)
        error = write.error or late
        if error is not None:
            raise error

    def close(self) -> None:
        """Close the engine, in the calling thread (from Trio:
        :func:`tspd.shell.engine_setup.close_engine`). Call it only when no write is
        in flight."""
        self.engine.close()


def _always() -> bool:
    return True


def _pieces(length: int, count: int) -> list[tuple[int, int]]:
    """``(offset, size)`` of the ``count`` pieces a copy of ``length`` bytes is
    submitted as, ``count`` being ``ceil(length / split_bytes)``: equal sizes, the
    last one shorter by what does not divide (see :data:`DEFAULT_SPLIT_BYTES`)."""
    size = -(-length // count)
    return [(offset, min(size, length - offset)) for offset in range(0, length, size)]


async def _await_tickets(
    engine: PollingEngine, tickets: list[WriteTicket], started: float, expected: float
) -> TransferError | None:
    """Check ``tickets`` until none is in flight, whatever cancels arrive; the first
    error an engine reported, if any. ``expected`` seconds shape the sleeps only: a
    write expected to take over ``_SLEEP_FIRST_S`` sleeps until
    ``_WAKE_EARLY_S`` before that, then is checked every ``_SLOW_POLL_S``;
    a shorter one is checked fast until twice its expected time plus
    ``_FAST_SLACK_S``, then every ``_SLOW_POLL_S``. The fast checks yield
    through a cancel-shielded checkpoint (a shielded cancel scope costs more than
    a 4 KiB write's worth of checks); only timed sleeps enter a shield."""
    if expected > _SLEEP_FIRST_S:
        with trio.CancelScope(shield=True):
            await trio.sleep(expected - _WAKE_EARLY_S)
        # Then a check a millisecond: spinning here would take a core from the
        # engine's own threads for the rest of a write that is milliseconds long.
        fast_until = 0.0
    else:
        fast_until = started + 2 * expected + _FAST_SLACK_S
    error: TransferError | None = None
    pending = tickets
    while True:
        still: list[WriteTicket] = []
        for ticket in pending:
            try:
                if not engine.check_write(ticket):
                    still.append(ticket)
            except TransferError as err:
                error = error or err
        if not still:
            return error
        pending = still
        if time.perf_counter() < fast_until:
            # Give the CPU to the engine's own threads if they wait for it: this
            # loop never blocks, and on a small host a spinning Trio thread kept
            # Mooncake's I/O thread waiting (measured p90 of a polled 4 KiB write
            # ~1.6 ms without, ~0.1 ms with).
            os.sched_yield()
            await trio.lowlevel.cancel_shielded_checkpoint()
        else:
            with trio.CancelScope(shield=True):
                await trio.sleep(_SLOW_POLL_S)


async def wait_step(
    counter_read: Callable[[], int],
    target: int,
    *,
    poll: float = 0.001,
    in_thread: bool = False,
) -> int:
    """Return once ``step_ready(counter_read(), target)`` holds; returns the counter
    value that satisfied it.

    On the Trio thread (default) the first few polls are zero-length sleeps (a
    step is often just about to land), then one every ``poll`` seconds; under a
    ``MockClock`` the timed polls autojump. With ``in_thread=True`` a worker thread
    polls every ``poll`` seconds instead (see the module docstring). Bound the wait
    with ``trio.fail_after`` or a cancel scope: a step that never comes is waited
    for forever.
    """
    if poll <= 0:
        raise ValueError(f"step wait poll interval must be positive, got {poll}")
    if in_thread:
        return await _wait_step_in_thread(counter_read, target, poll)
    polls = 0
    while True:
        value = counter_read()
        if step_ready(value, target):
            await trio.lowlevel.checkpoint()
            return value
        await trio.sleep(0 if polls < _FAST_POLLS else poll)
        polls += 1


async def _wait_step_in_thread(counter_read: Callable[[], int], target: int, poll: float) -> int:
    stop = threading.Event()

    def spin() -> int:
        while not stop.is_set():
            value = counter_read()
            if step_ready(value, target):
                return value
            time.sleep(poll)
        return -1

    try:
        return await trio.to_thread.run_sync(spin, abandon_on_cancel=True)
    finally:
        stop.set()
