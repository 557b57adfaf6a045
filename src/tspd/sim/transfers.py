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
checks fencing.

A staged write (``DestinationWrite.staged``, docs/wire.md#staged-transfers) is
gathered into its blob in the rank's staging region when it is issued
(:func:`tspd.sim.staging.gather`), and is then one engine call like any other
(same latency, failures, hangs and late landings) whose copies are the blob's
parts; an ``xfail`` lands a prefix of the parts, and
:meth:`tspd.sim.decode.DecodeInstance.land_staged` copies them into the Decode's
staging region, reading the Prefill's region at that moment. The ``garble``
fault damages the blob's magic as it lands. The blobs a chunk holds in the rank's
staging region are its *holdings* from the chunk's queueing to its
``transfer_done`` (when the core frees them): a new one that overlaps a held one is
a ``staging`` violation.

Layerwise chunks (:mod:`tspd.sim.layerwise`): before an interval with a target
step, the worker waits as the shell's workers do (:mod:`tspd.shell.transfers`): it
asks whether to stop (the room ended: ``Cache-transfer layerwise wait aborted
for room …``; a destination session failed: ``Cache-transfer layerwise peer failed
for room …``, both reported as ``transfer_failed(room, None, reason)``), then waits
until the rank's producer step counter is past the target
(:func:`tspd.core.schedule.step_ready`), asking again every 100 ms while it waits.
Each step the forward completes wakes the waiting workers of that rank.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tspd.core.commands import DestinationWrite, StartTransfer
from tspd.core.copies import CopyPlan
from tspd.core.schedule import step_ready
from tspd.sim.invariants import Check
from tspd.sim.staging import gather

if TYPE_CHECKING:
    from tspd.sim.cluster import Cluster
    from tspd.sim.decode import DecodeRank
    from tspd.sim.prefill import PrefillRank

__all__ = ["WAIT_CHECK", "SimEngine", "TransferStats"]

#: A layerwise step wait asks whether to stop this often (the shell's ~100 ms).
WAIT_CHECK = 0.1


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
    #: Layerwise intervals that waited for their producer step, and waits stopped.
    step_waits: int = 0
    waits_stopped: int = 0


class _Worker:
    __slots__ = ("bound", "busy", "jobs")

    def __init__(self) -> None:
        self.jobs: deque[StartTransfer] = deque()
        self.busy = False
        #: The latest time the work queued here can end, timeouts included.
        self.bound = 0.0


@dataclass(slots=True, eq=False)
class _Run:
    worker: _Worker
    job: StartTransfer
    interval: int = 0
    write: int = 0
    #: The interval whose producer step was seen ready (-1: none yet).
    ready: int = -1
    #: Bumped at each wait, so a stale 100 ms check finds nothing to do.
    wait: int = 0


@dataclass(slots=True, eq=False)
class _Write:
    run: _Run
    write: DestinationWrite
    target: DecodeRank | None
    ok: bool
    error: str
    #: Copies that land when it completes (all on success, a prefix on failure).
    landing: int
    #: Issue order, for reports.
    seq: int = 0
    #: A staged write's copies: its blob's parts, staging region to slot.
    parts: CopyPlan | None = None
    #: The ``garble`` fault damages the blob's magic when its first part lands.
    garbled: bool = False
    #: Stopped by its rank's death (``rank-crash``): nothing more of it lands.
    stopped: bool = False

    @property
    def copies(self) -> CopyPlan:
        """What the engine call copies: the plan, or a staged write's parts."""
        return self.write.plan if self.parts is None else self.parts


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
        #: Runs waiting for a producer step, in the order they began to wait.
        self.waiting: list[_Run] = []
        #: Writes issued and not yet reported (a late landing is not counted).
        self._in_flight: set[_Write] = set()

    def writes_in_flight(self) -> list[int]:
        """The room of every write issued and not yet reported, in issue order."""
        return [w.run.job.room for w in sorted(self._in_flight, key=lambda w: w.seq)]

    def write_bound(self) -> float:
        """The longest one engine call may take before it is reported."""
        timings = self.cluster.config.timings
        return timings.transfer_timeout + 20 * timings.write_latency

    def wait_bound(self, job: StartTransfer) -> float:
        """The longest a chunk may wait for its producer steps: its forward, which
        was armed with it, and one more check of the wait."""
        forwards = self.rank.group.forwards
        if forwards is None or all(i.target_step is None for i in job.intervals):
            return 0.0
        return forwards.forward_bound() + WAIT_CHECK

    def enqueue(self, job: StartTransfer) -> float:
        """Queue a chunk on its worker; returns the latest time it can end."""
        worker = self.workers[job.shard]
        calls = sum(1 for i in job.intervals for w in i.writes if len(w.plan))
        worker.bound = (
            max(worker.bound, self.cluster.queue.now)
            + calls * self.write_bound()
            + self.wait_bound(job)
        )
        worker.jobs.append(job)
        self.pending += 1
        self.cluster.stats.chunks += 1
        if self.rank.staging is not None:
            self._hold(job)
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

    def step_ready(self, target: int) -> bool:
        """Whether the rank's producer step counter is past ``target``."""
        return step_ready(self.rank.steps, target)

    def wait_should_stop(self, job: StartTransfer) -> str | None:
        """The shell's check during a step wait: a reason to stop, else ``None``."""
        core, room = self.rank.core, job.room
        if not core.room_active(room):
            return f"Cache-transfer layerwise wait aborted for room {room}"
        now = self.cluster.now
        if any(not core.session_alive(session, now) for session in job.sessions):
            return f"Cache-transfer layerwise peer failed for room {room}"
        return None

    def _waited(self, run: _Run) -> bool:
        """The wait before the run's current interval: ``True`` to go on writing;
        ``False`` when the run stopped or waits (it resumes on its own)."""
        target = run.job.intervals[run.interval].target_step
        if target is None or run.ready == run.interval:
            return True
        reason = self.wait_should_stop(run.job)
        if reason is not None:
            self._stop_wait(run, reason)
            return False
        if self.step_ready(target):
            run.ready = run.interval
            return True
        self.cluster.stats.step_waits += 1
        run.wait += 1
        self.waiting.append(run)
        self.cluster.queue.after(WAIT_CHECK, self._check_wait, (run, run.wait))
        return False

    def _stop_wait(self, run: _Run, reason: str) -> None:
        cluster = self.cluster
        cluster.stats.waits_stopped += 1
        room = run.job.room
        cluster.timeline.note(room, cluster.now, self.rank.name, f"step wait stops: {reason}")
        self.rank.core.transfer_failed(room, None, reason, cluster.now)
        self._finish(run)

    def _check_wait(self, argument: tuple[_Run, int]) -> None:
        """The wait's 100 ms check: stop, or wait on."""
        run, wait = argument
        if not self.alive or run.wait != wait or run not in self.waiting:
            return
        reason = self.wait_should_stop(run.job)
        if reason is not None:
            self.waiting.remove(run)
            self._stop_wait(run, reason)
            return
        self.cluster.queue.after(WAIT_CHECK, self._check_wait, argument)

    def step_advanced(self) -> None:
        """The rank's step counter moved: resume the runs whose step is done."""
        if not self.waiting or not self.alive:
            return
        runs = self.waiting
        resumed = [r for r in runs if self.step_ready(r.job.intervals[r.interval].target_step or 0)]
        if not resumed:
            return
        self.waiting = [r for r in runs if r not in resumed]
        for run in resumed:
            run.ready = run.interval
            run.wait += 1
            self._advance(run)

    def _advance(self, run: _Run) -> None:
        cluster, rank, job = self.cluster, self.rank, run.job
        room = job.room
        intervals = job.intervals
        while run.interval < len(intervals):
            if run.write == 0 and not self._waited(run):
                return
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

    def _hold(self, job: StartTransfer) -> None:
        """The chunk's staged blobs are held in the rank's staging region until its
        ``transfer_done``: none may overlap a blob another chunk holds."""
        region = self.rank.staging
        assert region is not None
        for interval in job.intervals:
            for write in interval.writes:
                staged = write.staged
                if staged is None:
                    continue
                start, end = staged.source_offset, staged.source_offset + staged.length
                for offset, length, room, _ in region.held:
                    if start < offset + length and offset < end:
                        self.cluster.checker.violate(
                            Check.STAGING,
                            self.rank.name,
                            f"the blob for {write.session_id} was given staging bytes "
                            f"{start}..{end} of the Prefill rank, which room {room}'s blob "
                            f"still holds ({offset}..{offset + length})",
                            job.room,
                        )
                region.held.append((start, staged.length, job.room, job))

    def _finish(self, run: _Run) -> None:
        """The chunk is over (written, failed or stopped): tell the core, then run
        the worker's next chunk."""
        rank = self.rank
        self.pending -= 1
        region = rank.staging
        if region is not None and region.held:
            region.held = [h for h in region.held if h[3] is not run.job]
        rank.core.transfer_done(run.job.room, self.cluster.now)
        rank.group.pump(rank, (run.job.room,))
        if rank.group.sleep == "closing":
            # A release refused while this chunk was with the workers may go now.
            rank.group.ask_release()
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
        if not rank.registered:
            cluster.checker.violate(
                Check.RELEASED,
                rank.name,
                f"a write to {write.session_id} was issued while the arena's registration "
                "was released (asleep)",
                room,
            )
        stats = cluster.stats
        stats.writes += 1
        timings, faults, rng = cluster.config.timings, cluster.config.faults, cluster.engine_rng
        target = cluster.sessions.get(write.session_id)
        parts: CopyPlan | None = None
        garbled = False
        if write.staged is None:
            if rank.staging is not None:
                cluster.staging.in_place += 1
        else:
            gathered = gather(rank, write, cluster.config.staging_part_bytes)
            if isinstance(gathered, str):
                # The shell reports it as the chunk's failure; the core planned it.
                cluster.checker.violate(
                    Check.STAGING,
                    rank.name,
                    f"gathering the staged blob for {write.session_id} failed: {gathered}",
                    room,
                )
                return
            parts = gathered
            cluster.staging.staged_writes += 1
            garbled = bool(faults.garble) and cluster.staging_rng.random() < faults.garble
            cluster.timeline.note(
                room,
                now,
                rank.name,
                f"staged write to {write.session_id}: a {write.staged.length}-byte blob of "
                f"{len(write.plan)} copies in {len(parts)} parts",
            )
        copies = len(write.plan) if parts is None else len(parts)
        latency = timings.write_latency * (0.5 + min(rng.expovariate(1.0), 10.0))
        if target is None or not target.alive:
            stats.gone += 1
            pending = _Write(
                run, write, None, False, "transfer failed: remote session gone", 0, 0, parts
            )
            cluster.timeline.note(room, now, rank.name, f"write to {write.session_id}: peer gone")
            cluster.queue.after(latency, self._done, self._track(pending))
            return
        if cluster.network.cut(rank.ip, target.ip) or (faults.hang and rng.random() < faults.hang):
            stats.hung += 1
            pending = _Write(run, write, target, False, "transfer timed out", 0, 0, parts, garbled)
            cluster.timeline.note(room, now, rank.name, f"write to {target.name} hangs")
            cluster.queue.after(timings.transfer_timeout, self._done, self._track(pending))
            if faults.late and rng.random() < faults.late:
                stats.late += 1
                delay = timings.transfer_timeout * rng.uniform(1.0, 2.0)
                cluster.queue.after(delay, self._land_late, pending)
            return
        if faults.xfail and rng.random() < faults.xfail:
            landing = rng.randrange(copies + 1) if rng.random() < 0.5 else 0
            pending = _Write(
                run, write, target, False, "injected write failure", landing, 0, parts, garbled
            )
            cluster.queue.after(latency, self._done, self._track(pending))
            return
        pending = _Write(run, write, target, True, "", copies, 0, parts, garbled)
        cluster.queue.after(latency, self._done, self._track(pending))

    def _track(self, pending: _Write) -> _Write:
        pending.seq = self.cluster.stats.writes
        self._in_flight.add(pending)
        target = pending.target
        if self.rank.trap:
            self.cluster.spring_rank_trap(self.rank)
        elif target is not None and target.trap:
            self.cluster.spring_rank_trap(target)
        return pending

    def _land(self, pending: _Write, count: int, late: bool) -> None:
        if pending.target is None or count <= 0:
            return
        self.cluster.stats.landed += 1
        room = pending.run.job.room
        if pending.parts is not None:
            pending.target.instance.land_staged(
                pending.target, self.rank, room, pending.parts, count, late, pending.garbled
            )
            if count == len(pending.parts) and not late:
                self.cluster.staging.blobs_landed += 1
            return
        pending.target.instance.land(
            pending.target, self.rank, room, pending.write.plan, count, late
        )

    def _land_late(self, pending: _Write) -> None:
        if not pending.stopped:
            self._land(pending, len(pending.copies), True)

    def kill(self) -> None:
        """The rank's process died alone (the ``rank-crash`` fault): its workers
        stop, each of its writes in flight stops where it is (a prefix of what it
        was to land lands now, nothing later, not even a late landing), and nothing
        is reported."""
        self.alive = False
        self.waiting.clear()
        rng = self.cluster.fault_rng
        for pending in sorted(self._in_flight, key=lambda w: w.seq):
            pending.stopped = True
            count, pending.landing = pending.landing, 0
            self._land(pending, rng.randrange(count + 1), False)
        self._in_flight.clear()

    def _done(self, pending: _Write) -> None:
        self._in_flight.discard(pending)
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
