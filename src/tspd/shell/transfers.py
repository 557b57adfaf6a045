"""Transfer workers: run a Prefill core's planned chunks through the transfer engine.

The core shards chunks by destination set (spec §6.8) and plans every copy of a
chunk before its first write; a worker runs the chunks queued on its shard one
after another, so one room's chunks — and its final report — stay in order.

A chunk is a list of intervals: wait until the producer step counter is past the
interval's target (layerwise; a full transfer has no target), then write each
destination's copies in order, cut into engine calls of at most
``max_descriptors`` (:func:`tspd.core.copies.batches`). What a worker reports back
to the core:

* a failed write → ``transfer_failed(room, session_id, reason, now)`` and the rest
  of the chunk is dropped (later intervals are not attempted, spec §7.9.2);
* a layerwise wait that must stop → the reason the core gives (room ended) or
  the spec's layerwise peer failure;
* every interval written and the chunk final → ``transfer_succeeded(room, now)``.

A worker never dies of a chunk's error: it logs it, fails that room through the
core ("first failure wins" is the core's rule), and takes the next chunk.
Engine calls go through an :class:`~tspd.engines.base.AsyncTransferEngine`
(:class:`~tspd.shell.offload.EngineRunner` around a blocking engine), and a write
that started is finished before cancellation is delivered.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, final

import trio

from tspd.core.commands import StartTransfer
from tspd.core.copies import DEFAULT_MAX_DESCRIPTORS, batches
from tspd.engines.base import AsyncTransferEngine, TransferError
from tspd.log import component_logger
from tspd.shell.offload import wait_step

__all__ = ["TransferFeedback", "TransferWorkers", "WorkerStats"]

log = component_logger("transfer")

_NO_COUNTER = "Cache-transfer layerwise transfer has no producer step counter"

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
    ) -> None:
        self._engine = engine
        self._feedback = feedback
        self._read_step = read_step
        self._max_descriptors = max_descriptors
        channels = [trio.open_memory_channel[StartTransfer](math.inf) for _ in range(max(count, 1))]
        self._senders = [send for send, _ in channels]
        self._receivers = [receive for _, receive in channels]
        self.stats = WorkerStats()
        self._busy = 0

    @property
    def count(self) -> int:
        """How many workers there are."""
        return len(self._senders)

    def in_flight(self) -> int:
        """Chunks queued or running."""
        return self._busy

    def submit(self, chunk: StartTransfer) -> None:
        """Queue ``chunk`` on its shard's worker (never blocks)."""
        self._busy += 1
        self._senders[chunk.shard % len(self._senders)].send_nowait(chunk)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run every worker until cancelled."""
        async with trio.open_nursery() as nursery:
            for index, receiver in enumerate(self._receivers):
                nursery.start_soon(self._work, receiver, name=f"tspd-transfer-{index}")
            task_status.started()

    async def _work(self, receiver: trio.MemoryReceiveChannel[StartTransfer]) -> None:
        async for chunk in receiver:
            try:
                await self._run_chunk(chunk)
            except Exception as exc:  # a worker outlives any one chunk
                log.exception("transfer worker: chunk for room %s failed unexpectedly", chunk.room)
                self.stats.failed_chunks += 1
                self._feedback.chunk_failed(chunk, None, f"{type(exc).__name__}: {exc}")
            finally:
                self._busy -= 1

    async def _wait_step(
        self, chunk: StartTransfer, target: int, read: Callable[[], int]
    ) -> str | None:
        """Wait for producer step ``target``, re-checking every ~100 ms whether the
        room ended or a destination failed (spec §7.9.2); the reason to stop, else
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
                if not self._feedback.room_active(chunk):
                    # The room ended meanwhile: no page is written after its end.
                    self._feedback.chunk_failed(
                        chunk, None, f"room {chunk.room} ended before its transfer finished"
                    )
                    return
                for batch in batches(write.plan, self._max_descriptors):
                    try:
                        await self._engine.batch_write(
                            write.session_id, batch.src, batch.dst, batch.length
                        )
                    except TransferError as exc:
                        self.stats.failed_chunks += 1
                        self._feedback.chunk_failed(
                            chunk,
                            write.session_id,
                            str(exc),
                        )
                        return
                    self.stats.engine_calls += 1
                    self.stats.descriptors += len(batch)
                    self.stats.bytes_written += batch.total_bytes
        self._feedback.chunk_succeeded(chunk)
