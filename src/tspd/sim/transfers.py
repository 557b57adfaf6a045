"""The simulated transfer engine of one Prefill rank.

It runs :class:`~tspd.core.commands.StartTransfer` commands the way the shell's
transfer workers do (docs/protocol.md#proto-batching): one FIFO per worker shard,
a room's chunks in order, every interval's destinations written one after another,
the room checked with ``room_active`` before each write (a room that ended stops
its chunk: ``transfer_failed(room, None, ...)``, which the core ignores for an
ended room), a failed write reported with ``transfer_failed(room, session_id,
error)``, ``transfer_succeeded`` after the last write of a final chunk, and
``transfer_done`` once every chunk is over, whatever its end (the core holds a
room's ``Failed`` notices back until then: write fencing). An empty plan makes no
engine call.

Each write is one engine call whose outcome the run's generator draws:

* the destination session is gone (its Decode process died): it fails quickly;
* a partition separates the two hosts, or the ``hang`` fault: it hangs and is
  reported failed after the transfer timeout; with the ``late`` fault its bytes
  still land, later than that;
* the ``xfail`` fault: it fails after its latency, having written some of its
  copies or none;
* otherwise it lands and completes after its latency.

Bytes land through :meth:`tspd.sim.decode.DecodeInstance.land`, which reads the
source cells at that moment (an RDMA write reads its source while it runs) and
checks fencing. Layerwise intervals are not simulated (the simulator hands over
full transfers only).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tspd.core.commands import DestinationWrite, StartTransfer
from tspd.sim.invariants import Check

if TYPE_CHECKING:
    from tspd.sim.cluster import Cluster
    from tspd.sim.decode import DecodeRank
    from tspd.sim.prefill import PrefillRank

__all__ = ["SimEngine", "TransferStats"]


@dataclass(slots=True)
class TransferStats:
    """What the engines of a run did."""

    chunks: int = 0
    writes: int = 0
    landed: int = 0
    failed: int = 0
    hung: int = 0
    late: int = 0
    gone: int = 0
    stopped: int = 0


class _Worker:
    __slots__ = ("bound", "busy", "jobs")

    def __init__(self) -> None:
        self.jobs: deque[StartTransfer] = deque()
        self.busy = False
        #: The latest time the work queued here can end, timeouts included.
        self.bound = 0.0


@dataclass(slots=True)
class _Run:
    worker: _Worker
    job: StartTransfer
    interval: int = 0
    write: int = 0


@dataclass(slots=True)
class _Write:
    run: _Run
    write: DestinationWrite
    target: DecodeRank | None
    ok: bool
    error: str
    #: Copies that land when it completes (all on success, a prefix on failure).
    landing: int


class SimEngine:
    """The transfer workers of one Prefill rank incarnation."""

    def __init__(self, cluster: Cluster, rank: PrefillRank, workers: int) -> None:
        self.cluster = cluster
        self.rank = rank
        self.workers = [_Worker() for _ in range(workers)]
        #: False once the rank's process died: nothing is reported any more.
        self.alive = True
        #: Chunks queued or running.
        self.pending = 0

    def write_bound(self) -> float:
        """The longest one engine call may take before it is reported."""
        timings = self.cluster.config.timings
        return timings.transfer_timeout + 20 * timings.write_latency

    def enqueue(self, job: StartTransfer) -> float:
        """Queue a chunk on its worker; returns the latest time it can end."""
        worker = self.workers[job.shard]
        calls = sum(1 for i in job.intervals for w in i.writes if len(w.plan))
        worker.bound = max(worker.bound, self.cluster.queue.now) + calls * self.write_bound()
        worker.jobs.append(job)
        self.pending += 1
        self.cluster.stats.chunks += 1
        if not worker.busy:
            self._start_next(worker)
        return worker.bound

    def _start_next(self, worker: _Worker) -> None:
        if not worker.jobs or not self.alive:
            worker.busy = False
            return
        worker.busy = True
        self._advance(_Run(worker, worker.jobs.popleft()))

    def room_ended(self, room: int) -> bool:
        """The worker's check before each write (the shell's ``room_active``)."""
        return not self.rank.core.room_active(room)

    def _advance(self, run: _Run) -> None:
        cluster, rank, job = self.cluster, self.rank, run.job
        room = job.room
        intervals = job.intervals
        while run.interval < len(intervals):
            writes = intervals[run.interval].writes
            while run.write < len(writes):
                write = writes[run.write]
                if self.room_ended(room):
                    cluster.stats.stopped += 1
                    rank.core.transfer_failed(
                        room, None, f"room {room} ended before its transfer finished", cluster.now
                    )
                    self._finish(run)
                    return
                if not len(write.plan):
                    run.write += 1
                    continue
                self._issue(run, write)
                return
            run.write = 0
            run.interval += 1
        if job.final:
            rank.core.transfer_succeeded(room, cluster.now)
        self._finish(run)

    def _finish(self, run: _Run) -> None:
        """The chunk is over (written, failed or stopped): tell the core, then run
        the worker's next chunk."""
        rank = self.rank
        self.pending -= 1
        rank.core.transfer_done(run.job.room, self.cluster.now)
        rank.group.pump(rank, (run.job.room,))
        self._start_next(run.worker)

    def _issue(self, run: _Run, write: DestinationWrite) -> None:
        cluster, rank = self.cluster, self.rank
        room = run.job.room
        now = cluster.now
        if not rank.core.room_active(room):
            cluster.checker.violate(
                Check.WRITE_AFTER_END,
                rank.name,
                f"a write to {write.session_id} was issued after the room ended on this rank "
                f"({rank.core.room_state(room).value})",
                room,
            )
        stats = cluster.stats
        stats.writes += 1
        timings, faults, rng = cluster.config.timings, cluster.config.faults, cluster.engine_rng
        target = cluster.sessions.get(write.session_id)
        copies = len(write.plan)
        latency = timings.write_latency * (0.5 + min(rng.expovariate(1.0), 10.0))
        if target is None or not target.alive:
            stats.gone += 1
            pending = _Write(run, write, None, False, "transfer failed: remote session gone", 0)
            cluster.timeline.note(room, now, rank.name, f"write to {write.session_id}: peer gone")
            cluster.queue.after(latency, self._done, pending)
            return
        if cluster.network.cut(rank.ip, target.ip) or (faults.hang and rng.random() < faults.hang):
            stats.hung += 1
            pending = _Write(run, write, target, False, "transfer timed out", 0)
            cluster.timeline.note(room, now, rank.name, f"write to {target.name} hangs")
            cluster.queue.after(timings.transfer_timeout, self._done, pending)
            if faults.late and rng.random() < faults.late:
                stats.late += 1
                delay = timings.transfer_timeout * rng.uniform(1.0, 2.0)
                cluster.queue.after(delay, self._land_late, pending)
            return
        if faults.xfail and rng.random() < faults.xfail:
            landing = rng.randrange(copies + 1) if rng.random() < 0.5 else 0
            pending = _Write(run, write, target, False, "injected write failure", landing)
            cluster.queue.after(latency, self._done, pending)
            return
        cluster.queue.after(latency, self._done, _Write(run, write, target, True, "", copies))

    def _land(self, pending: _Write, count: int, late: bool) -> None:
        if pending.target is None or count <= 0:
            return
        self.cluster.stats.landed += 1
        pending.target.instance.land(
            pending.target, self.rank, pending.run.job.room, pending.write.plan, count, late
        )

    def _land_late(self, pending: _Write) -> None:
        self._land(pending, len(pending.write.plan), True)

    def _done(self, pending: _Write) -> None:
        self._land(pending, pending.landing, False)
        if not self.alive:
            return
        run, cluster = pending.run, self.cluster
        if pending.ok:
            run.write += 1
            self._advance(run)
            return
        cluster.stats.failed += 1
        room = run.job.room
        cluster.timeline.note(
            room, cluster.now, self.rank.name, f"write to {pending.write.session_id} failed"
        )
        self.rank.core.transfer_failed(room, pending.write.session_id, pending.error, cluster.now)
        self._finish(run)
