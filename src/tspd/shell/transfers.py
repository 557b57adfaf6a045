"""Transfer workers: run a Prefill core's planned chunks through the transfer engine.

The core shards chunks by destination set (docs/protocol.md#proto-batching) and plans every copy of
a
chunk before its first write; a worker runs the chunks queued on its shard one
after another, so one room's chunks — and its final report — stay in order.

A chunk is a list of intervals: wait until the producer step counter is past the
interval's target (layerwise; a full transfer has no target), then write each
destination's copies in order, cut into engine calls of at most
``max_descriptors`` (:func:`tspd.core.copies.batches`), the room checked before
every call (write fencing). Through an :class:`~tspd.shell.offload.EngineRunner`
a large write is pipelined (:meth:`~tspd.shell.offload.EngineRunner.write_plan`:
the next calls are submitted while earlier ones are in flight, within the engine's
per-peer queue); otherwise each call waits for the previous one. What a worker
reports back to the core:

* a failed write → ``transfer_failed(room, session_id, reason, now)`` and the rest
  of the chunk is dropped (later intervals are not attempted,
  docs/protocol.md#proto-failure-decode-death);
* a layerwise wait that must stop → the reason the core gives (room ended) or
  the spec's layerwise peer failure;
* every interval written and the chunk final → ``transfer_succeeded(room, now)``.

Full transfers already queued together on a worker are written together: per
destination session, their copies go out in shared engine calls (still at most
``max_descriptors`` each), and the rooms are then reported in queue order. Under
load this turns a thread hop and an engine call per room into one per batch of
rooms (Mooncake over TCP pays ~40 µs a call on top of its descriptors). A failed
shared call fails every room with copies in it, with that call's error (the
failure marks the session failed, so newer rooms to it fail fast anyway).
A layerwise chunk is never grouped, and keeps its place in the queue.

A full transfer with one small write, submitted to an idle worker, starts at once
— in the submitting task, through :meth:`EngineRunner.start_write`, when the
engine polls — rather than when the worker next runs (after the submitting task
yields: ~30 µs later on the 2-core host); the worker then waits for it and reports
it like any other. A write started that way is still waited for if the workers
stop before taking it.

A destination write the core planned *staged* (docs/wire.md#staged-transfers) is
gathered into its blob in the Prefill's staging region and written to the Decode's
slot part by part (:data:`STAGED_PART_BYTES`, the first one
:data:`STAGED_FIRST_PART_BYTES`): each part's write is in flight while
a worker thread gathers the next. Such a chunk is never grouped with others.

Each write to one destination session that succeeds — one chunk's copies in one
interval, or a group's shared copies — is reported to ``on_write(session_id,
nbytes, seconds)`` when given, for the transfer latency metrics (docs/protocol.md#proto-metrics:
R-pd
observes each ``write_copies``).

A worker never dies of a chunk's error: it logs it, fails that room through the
core ("first failure wins" is the core's rule), and takes the next chunk.
Engine calls go through an :class:`~tspd.engines.base.AsyncTransferEngine`
(:class:`~tspd.shell.offload.EngineRunner` around a blocking engine), and a write
that started is finished before cancellation is delivered.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol, final

import trio

from tspd.core.commands import DestinationWrite, StartTransfer
from tspd.core.copies import DEFAULT_MAX_DESCRIPTORS, CopyPlan, batches
from tspd.core.staging import gather_blob_parts
from tspd.engines.base import AsyncTransferEngine, TransferError
from tspd.log import component_logger
from tspd.shell.arena import HostArena
from tspd.shell.offload import EngineRunner, StartedWrite, wait_step

__all__ = [
    "STAGED_FIRST_PART_BYTES",
    "STAGED_PARTS_IN_FLIGHT",
    "STAGED_PART_BYTES",
    "Staging",
    "TransferFeedback",
    "TransferWorkers",
    "WorkerStats",
]

log = component_logger("transfer")

_NO_COUNTER = "Cache-transfer layerwise transfer has no producer step counter"

#: Caps on one group of full-transfer chunks written together.
_GROUP_CHUNKS = 256
_GROUP_DESCRIPTORS = 8192


def _is_full(chunk: StartTransfer) -> bool:
    """A full transfer that may share engine calls with others: one interval that
    waits for no producer step, and no write of it staged (a staged write is one
    blob of its own)."""
    return (
        len(chunk.intervals) == 1
        and chunk.intervals[0].target_step is None
        and all(w.staged is None for w in chunk.intervals[0].writes)
    )


#: A staged blob is gathered and written in parts of about this many bytes: each
#: part's write is in flight while the next part is gathered, and the engine runner
#: submits a part as 16 MiB pieces at once (offload.DEFAULT_SPLIT_BYTES). Staged
#: 64 MiB rooms through ``tspd demo``'s roles, 6 rooms a run, 6 alternated rounds:
#: median room 48.6-57.4 ms in 32 MiB parts (16 MiB: 51.5-57.9 ms) against
#: 52.2-68.5 ms in 8 MiB parts, each part waiting for the one before on the wire.
STAGED_PART_BYTES = 32 << 20
#: The first part is smaller, so the first write starts after a short gather rather
#: than a whole part's (nothing overlaps that one). ``tspd bench pd --large-only``,
#: 3 alternated runs of 3 staged 64 MiB rooms on the 2-core VM: 0.62-0.70 GB/s
#: (median 0.68) against 0.52-0.70 (0.63) with a 32 MiB first part; one room's first
#: write started 11-18 ms after the hand-over against 20-27 ms.
STAGED_FIRST_PART_BYTES = 4 << 20
#: Parts of one staged blob handed to the engine runner at once: the next part's
#: write is queued while the one before is in flight, so it starts as soon as the
#: runner's write limiter lets it (with the default limit of one write, the moment
#: the part before is done) rather than a task hand-off later.
STAGED_PARTS_IN_FLIGHT = 2


@final
@dataclass(frozen=True, slots=True)
class Staging:
    """What a Prefill rank's workers need to send staged writes
    (docs/wire.md#staged-transfers): its arena (``source``) and its staging region
    (``region``), both registered with the engine. Their bytes are viewed only
    while a blob is gathered, so either can be closed once the workers stop."""

    source: HostArena
    region: HostArena

    def parts(self, write: DestinationWrite) -> Iterator[CopyPlan]:
        """Gather ``write``'s copies into its blob part by part (each ``next()`` in
        the calling thread; the first one checks every range and writes the table);
        each part's descriptor, from the staging region to the Decode's slot."""
        staged = write.staged
        assert staged is not None
        plan = write.plan
        parts = gather_blob_parts(
            self.region.view(staged.source_offset, staged.length),
            self.source.array,
            plan.src - staged.src_base,
            plan.dst - staged.dst_base,
            plan.length,
            STAGED_PART_BYTES,
            first_part_bytes=min(STAGED_FIRST_PART_BYTES, STAGED_PART_BYTES),
        )
        end = 0
        for start, end in parts:
            yield CopyPlan.from_copies(
                [(staged.source_addr + start, staged.dest_addr + start, end - start)]
            )
        if end != staged.length:
            raise ValueError(
                f"the staged blob of {write.session_id} is {end} bytes where the core "
                f"planned {staged.length} (a bug: please report it)"
            )


#: A layerwise step wait re-checks its room and destinations this often.
_WAIT_CHECK_S = 0.1


class TransferFeedback(Protocol):
    """What a worker tells the Prefill peer about a chunk (the peer forwards it to
    its core and executes the commands that follow)."""

    def chunk_succeeded(self, chunk: StartTransfer) -> None:
        """Every interval of ``chunk`` was written."""

    def chunk_failed(self, chunk: StartTransfer, session_id: str | None, reason: str) -> None:
        """``chunk`` stopped: a write to ``session_id`` failed, or a wait gave up."""

    def wait_should_stop(self, chunk: StartTransfer) -> str | None:
        """Checked every ~100 ms during a step wait: a reason to stop, else ``None``."""

    def room_active(self, chunk: StartTransfer) -> bool:
        """Checked before every write: ``False`` once the chunk's room ended."""


@dataclass(slots=True)
class WorkerStats:
    """Counters over every worker of a peer."""

    chunks: int = 0
    failed_chunks: int = 0
    engine_calls: int = 0
    descriptors: int = 0
    bytes_written: int = 0
    #: Writes sent as one staged blob (docs/wire.md#staged-transfers).
    staged_writes: int = 0


@final
class TransferWorkers:
    """``count`` worker tasks, each with its own ordered queue of chunks."""

    def __init__(
        self,
        engine: AsyncTransferEngine,
        feedback: TransferFeedback,
        *,
        count: int,
        read_step: Callable[[], int] | None = None,
        max_descriptors: int = DEFAULT_MAX_DESCRIPTORS,
        on_write: Callable[[str, int, float], None] | None = None,
        staging: Staging | None = None,
    ) -> None:
        self._engine = engine
        self._staging = staging
        self._feedback = feedback
        self._on_write = on_write
        self._read_step = read_step
        self._max_descriptors = max_descriptors
        channels = [trio.open_memory_channel[StartTransfer](math.inf) for _ in range(max(count, 1))]
        self._senders = [send for send, _ in channels]
        self._receivers = [receive for _, receive in channels]
        self.stats = WorkerStats()
        self._busy = 0
        #: A layerwise chunk taken off the queue while grouping full ones; it runs
        #: right after the group.
        self._held: StartTransfer | None = None
        #: Writes started when their chunk was submitted (see submit), by chunk id,
        #: with the time they started.
        self._runner = engine if isinstance(engine, EngineRunner) else None
        self._started: dict[int, tuple[StartedWrite, float]] = {}
        #: Per worker: chunks submitted and not yet finished (0: the worker is idle).
        self._pending = [0] * len(self._senders)

    @property
    def count(self) -> int:
        """How many workers there are."""
        return len(self._senders)

    def in_flight(self) -> int:
        """Chunks queued or running."""
        return self._busy

    def submit(self, chunk: StartTransfer) -> None:
        """Queue ``chunk`` on its shard's worker (never blocks). A full transfer with
        one small write, for an idle worker, starts at once when the engine can
        poll it (:meth:`EngineRunner.start_write`): the worker would otherwise only
        start it after the calling task next yields."""
        index = chunk.shard % len(self._senders)
        if self._runner is not None and self._pending[index] == 0 and _is_full(chunk):
            self._start_now(self._runner, chunk)
        self._pending[index] += 1
        self._busy += 1
        self._senders[index].send_nowait(chunk)

    def _start_now(self, runner: EngineRunner, chunk: StartTransfer) -> None:
        writes = [w for w in chunk.intervals[0].writes if len(w.plan)]
        if len(writes) != 1 or len(writes[0].plan) > self._max_descriptors:
            return
        if not self._feedback.room_active(chunk):
            return
        plan = writes[0].plan
        src, dst, lengths = plan.columns()
        started = runner.start_write(writes[0].session_id, src, dst, lengths)
        if started is not None:
            self._started[id(chunk)] = (started, trio.current_time())

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run every worker until cancelled. A write started at submission and not
        yet taken by its worker is still waited for on the way out."""
        try:
            async with trio.open_nursery() as nursery:
                for index, receiver in enumerate(self._receivers):
                    nursery.start_soon(self._work, index, receiver, name=f"tspd-transfer-{index}")
                task_status.started()
        finally:
            leftover, self._started = list(self._started.values()), {}
            if leftover and self._runner is not None:
                with trio.CancelScope(shield=True):
                    for write, _ in leftover:
                        try:
                            await self._runner.finish_write(write)
                        except TransferError as exc:
                            log.warning("a transfer started before shutdown failed: %s", exc)

    async def _work(self, index: int, receiver: trio.MemoryReceiveChannel[StartTransfer]) -> None:
        async for chunk in receiver:
            try:
                await self._take(chunk, receiver)
            finally:
                # What is left is what the worker has not taken off its queue yet.
                self._pending[index] = receiver.statistics().current_buffer_used

    async def _take(
        self, chunk: StartTransfer, receiver: trio.MemoryReceiveChannel[StartTransfer]
    ) -> None:
        early = self._started.pop(id(chunk), None)
        if early is not None:
            try:
                await self._run_started(chunk, *early)
            finally:
                self._busy -= 1
            return
        group = [chunk]
        if _is_full(chunk):
            group.extend(self._more_full_chunks(receiver, chunk))
        try:
            if len(group) > 1:
                await self._run_full_group(group)
            else:
                await self._run_one(chunk)
        finally:
            self._busy -= len(group)
        held, self._held = self._held, None
        if held is not None:
            try:
                await self._run_one(held)
            finally:
                self._busy -= 1

    async def _run_started(self, chunk: StartTransfer, write: StartedWrite, since: float) -> None:
        """Finish a chunk whose one write started at submission, and report it."""
        assert self._runner is not None
        self.stats.chunks += 1
        plan = next(w.plan for w in chunk.intervals[0].writes if len(w.plan))
        try:
            await self._runner.finish_write(write)
        except TransferError as exc:
            self.stats.failed_chunks += 1
            self._feedback.chunk_failed(chunk, write.peer_session, str(exc))
            return
        except Exception as exc:  # a worker outlives any one chunk
            log.exception("transfer worker: chunk for room %s failed unexpectedly", chunk.room)
            self.stats.failed_chunks += 1
            self._feedback.chunk_failed(chunk, None, f"{type(exc).__name__}: {exc}")
            return
        nbytes = plan.total_bytes
        self.stats.engine_calls += 1
        self.stats.descriptors += len(plan)
        self.stats.bytes_written += nbytes
        if self._on_write is not None:
            self._on_write(write.peer_session, nbytes, trio.current_time() - since)
        self._feedback.chunk_succeeded(chunk)

    def _more_full_chunks(
        self, receiver: trio.MemoryReceiveChannel[StartTransfer], first: StartTransfer
    ) -> list[StartTransfer]:
        """Full-transfer chunks already queued behind ``first`` (up to the group caps),
        taken so that their copies to each session go out in shared engine calls."""
        more: list[StartTransfer] = []
        descriptors = first.descriptors
        while len(more) + 1 < _GROUP_CHUNKS and descriptors < _GROUP_DESCRIPTORS:
            try:
                chunk = receiver.receive_nowait()
            except trio.WouldBlock:
                break
            if not _is_full(chunk):
                # Keeps queue order: this one runs right after the group.
                self._held = chunk
                break
            more.append(chunk)
            descriptors += chunk.descriptors
        return more

    async def _run_one(self, chunk: StartTransfer) -> None:
        try:
            await self._run_chunk(chunk)
        except Exception as exc:  # a worker outlives any one chunk
            log.exception("transfer worker: chunk for room %s failed unexpectedly", chunk.room)
            self.stats.failed_chunks += 1
            self._feedback.chunk_failed(chunk, None, f"{type(exc).__name__}: {exc}")

    async def _run_full_group(self, group: list[StartTransfer]) -> None:
        """Write several rooms' full transfers with one engine call per session for all
        of them (each call at most ``max_descriptors``), then report each room in
        queue order. A failed call fails every room with copies in it — its session
        is marked failed then anyway — and the other rooms go on."""
        try:
            self.stats.chunks += len(group)
            live: list[StartTransfer] = []
            for chunk in group:
                if self._feedback.room_active(chunk):
                    live.append(chunk)
                else:
                    self._feedback.chunk_failed(
                        chunk, None, f"room {chunk.room} ended before its transfer finished"
                    )
            by_session: dict[str, list[tuple[int, CopyPlan]]] = {}
            for index, chunk in enumerate(live):
                for write in chunk.intervals[0].writes:
                    if len(write.plan):
                        by_session.setdefault(write.session_id, []).append((index, write.plan))
            failed: set[int] = set()
            for session, entries in by_session.items():
                items = [(index, plan) for index, plan in entries if index not in failed]
                if not items:
                    continue
                rooms = [live[index] for index, _ in items]
                try:
                    shared = await self._write(
                        session,
                        CopyPlan.concat([plan for _, plan in items]),
                        self._all_active(rooms),
                    )
                    if not shared:
                        # A room ended between two shared calls: the others write
                        # their own copies again (same bytes, same places), so no
                        # call carries the ended room's copies.
                        for index, plan in items:
                            chunk = live[index]
                            if not await self._write(session, plan, self._all_active([chunk])):
                                failed.add(index)
                                self._feedback.chunk_failed(
                                    chunk,
                                    None,
                                    f"room {chunk.room} ended before its transfer finished",
                                )
                except TransferError as exc:
                    for index, _ in items:
                        if index in failed:
                            continue
                        failed.add(index)
                        self.stats.failed_chunks += 1
                        self._feedback.chunk_failed(live[index], session, str(exc))
            for index, chunk in enumerate(live):
                if index not in failed:
                    self._feedback.chunk_succeeded(chunk)
        except Exception as exc:  # a worker outlives any group
            log.exception("transfer worker: a group of %d chunks failed unexpectedly", len(group))
            for chunk in group:
                self.stats.failed_chunks += 1
                self._feedback.chunk_failed(chunk, None, f"{type(exc).__name__}: {exc}")

    def _all_active(self, chunks: list[StartTransfer]) -> Callable[[], bool]:
        """A check that every one of ``chunks``' rooms may still be written."""
        active = self._feedback.room_active
        return lambda: all(active(chunk) for chunk in chunks)

    async def _write(self, session: str, plan: CopyPlan, active: Callable[[], bool]) -> bool:
        """Write ``plan`` to ``session`` in engine calls of at most ``max_descriptors``,
        checking ``active()`` before each call (write fencing: no call starts once the
        room ended); ``False`` if it stopped there. Through a runner the calls are
        pipelined when the plan is large (:meth:`EngineRunner.write_plan`). A write
        that moved bytes is reported to ``on_write``."""
        started, written = trio.current_time(), 0

        def count(descriptors: int, nbytes: int) -> None:
            nonlocal written
            self.stats.engine_calls += 1
            self.stats.descriptors += descriptors
            self.stats.bytes_written += nbytes
            written += nbytes

        if self._runner is not None:
            if not await self._runner.write_plan(
                session,
                plan,
                max_descriptors=self._max_descriptors,
                active=active,
                on_batch=count,
            ):
                return False
        else:
            for batch in batches(plan, self._max_descriptors):
                if not active():
                    return False
                await self._engine.batch_write(session, batch.src, batch.dst, batch.length)
                count(len(batch), batch.total_bytes)
        if written and self._on_write is not None:
            self._on_write(session, written, trio.current_time() - started)
        return True

    async def _write_staged(
        self, write: DestinationWrite, active: Callable[[], bool]
    ) -> bool | str:
        """Send a staged write: gather its blob part by part in a worker thread while
        the parts before it are written, at most :data:`STAGED_PARTS_IN_FLIGHT` of
        them at once. ``False`` if the room ended (nothing more is started), a text
        if the blob could not be gathered; a failed write raises its
        :class:`TransferError` once the writes in flight are done."""
        staging = self._staging
        if staging is None:
            return (
                f"a write to {write.session_id} was planned staged, but these transfer "
                "workers have no staging region (a bug: please report it)"
            )
        parts = staging.parts(write)
        session = write.session_id
        failure: list[TransferError] = []
        stopped = False

        async def send(plan: CopyPlan, done: trio.Event) -> None:
            nonlocal stopped
            try:
                if not await self._write(session, plan, active):
                    stopped = True
            except TransferError as exc:
                failure.append(exc)
            finally:
                done.set()

        gathered: str | None = None
        async with trio.open_nursery() as nursery:
            sending: deque[trio.Event] = deque()
            while True:
                try:
                    plan = await trio.to_thread.run_sync(next, parts, None)
                except ValueError as exc:
                    gathered = f"gathering the staged blob for {session} failed: {exc}"
                    break
                while len(sending) >= STAGED_PARTS_IN_FLIGHT:
                    await sending.popleft().wait()
                if plan is None or failure or stopped:
                    break
                sent = trio.Event()
                sending.append(sent)
                nursery.start_soon(send, plan, sent)
        if failure:
            raise failure[0]
        if gathered is not None:
            return gathered
        self.stats.staged_writes += 1
        return not stopped

    async def _wait_step(
        self, chunk: StartTransfer, target: int, read: Callable[[], int]
    ) -> str | None:
        """Wait for producer step ``target``, re-checking every ~100 ms whether the
        room ended or a destination failed (docs/protocol.md#proto-failure-decode-death); the
        reason to stop, else
        ``None`` once the step landed."""
        while True:
            reason = self._feedback.wait_should_stop(chunk)
            if reason is not None:
                return reason
            with trio.move_on_after(_WAIT_CHECK_S) as slice_:
                await wait_step(read, target)
            if not slice_.cancelled_caught:
                return None

    async def _run_chunk(self, chunk: StartTransfer) -> None:
        self.stats.chunks += 1
        for interval in chunk.intervals:
            if interval.target_step is not None:
                if self._read_step is None:
                    self.stats.failed_chunks += 1
                    self._feedback.chunk_failed(
                        chunk,
                        None,
                        "Cache-transfer layerwise transfer has no producer step counter",
                    )
                    return
                stop = await self._wait_step(chunk, interval.target_step, self._read_step)
                if stop is not None:
                    self.stats.failed_chunks += 1
                    self._feedback.chunk_failed(chunk, None, stop)
                    return
            for write in interval.writes:
                active = self._all_active([chunk])
                try:
                    if write.staged is None:
                        written = await self._write(write.session_id, write.plan, active)
                    else:
                        staged = await self._write_staged(write, active)
                        if isinstance(staged, str):  # this rank's fault, not the session's
                            self.stats.failed_chunks += 1
                            self._feedback.chunk_failed(chunk, None, staged)
                            return
                        written = staged
                except TransferError as exc:
                    self.stats.failed_chunks += 1
                    self._feedback.chunk_failed(chunk, write.session_id, str(exc))
                    return
                if not written:
                    # The room ended meanwhile: no page is written after its end.
                    self._feedback.chunk_failed(
                        chunk, None, f"room {chunk.room} ended before its transfer finished"
                    )
                    return
        self._feedback.chunk_succeeded(chunk)
