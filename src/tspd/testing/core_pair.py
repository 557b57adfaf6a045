"""``CorePair``: Prefill and Decode cores wired together in-process, in virtual time.

The quinn ``Pair`` / h11 ``ConnectionPair`` idea for tspd: every Prefill TP rank's
:class:`~tspd.core.prefill.PrefillCore` and every Decode TP rank's
:class:`~tspd.core.decode.DecodeCore` of one Prefill instance and one Decode
instance, with no sockets, threads or clocks:

* :class:`~tspd.core.commands.SendFrames` go straight to the core listening on that
  port (Prefill control ports ``7000 + rank``, Decode status ports ``8000 + rank``);
* bootstrap lookups are answered from the Prefill ranks' contracts;
* :class:`~tspd.core.commands.StartTransfer` is run by per-(rank, shard) FIFO
  workers that apply each :class:`~tspd.core.copies.CopyPlan` to host arenas
  (:class:`~tspd.shell.arena.HostArena`), checking every copy stays inside both;
  layerwise intervals wait for :meth:`CorePair.produce`'s step counter;
* the replica agreement is the element-wise MIN over the ranks of a side.

Faults are injected by setting :attr:`CorePair.parallel_info_error`,
:attr:`CorePair.rank_info_errors`, :attr:`CorePair.write_errors` and
:attr:`CorePair.dropped_ports`. Bytes are the interop pattern
(docs/protocol.md#proto-interop), so :meth:`CorePair.verify` checks every Decode block
byte for byte.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import final

from tspd.core.bootstrap import ParallelInfo, RankInfo
from tspd.core.commands import (
    Command,
    Event,
    FetchParallelInfo,
    FetchRankInfo,
    Log,
    Rejected,
    RoomFailed,
    SendFrames,
    StartTransfer,
)
from tspd.core.contract import CacheContract
from tspd.core.copies import CopyPlan
from tspd.core.decode import DecodeConfig, DecodeCore
from tspd.core.manifest import BlockManifest, build_manifest
from tspd.core.poll import TransferPoll
from tspd.core.prefill import PrefillConfig, PrefillCore
from tspd.core.schedule import STEP_MODULUS, ProducerSchedule, step_ready
from tspd.shell.arena import BlockMismatch, HostArena, fill_room, verify_room
from tspd.testing.layouts import PageAllocator

__all__ = ["CorePair"]

HOST = "127.0.0.1"
PREFILL_PORT = 7000
DECODE_PORT = 8000
SESSION_PORT = 9000


@dataclass(slots=True)
class _Job:
    rank: int
    command: StartTransfer
    next_interval: int = 0


@dataclass(slots=True)
class _Room:
    decode_manifests: dict[int, BlockManifest] = field(default_factory=dict)
    decode_tables: dict[int, dict[str, list[int]]] = field(default_factory=dict)
    prefill_tables: dict[int, dict[str, list[int]]] = field(default_factory=dict)


def _given(**fields: float | None) -> dict[str, float]:
    return {name: value for name, value in fields.items() if value is not None}


@final
class CorePair:
    """One Prefill instance (``len(prefill_contracts)`` TP ranks) and one Decode
    instance (``len(decode_contracts)`` TP ranks) around shared virtual time ``now``.

    Call :meth:`pump` after driving a core directly; the high-level helpers pump
    for you.
    """

    def __init__(
        self,
        prefill_contracts: Sequence[CacheContract],
        decode_contracts: Sequence[CacheContract],
        *,
        bootstrap_addr: str = f"{HOST}:8998",
        bootstrap_timeout: float | None = None,
        waiting_timeout: float | None = None,
        failed_session_ttl: float | None = None,
        transfer_workers: int = 2,
        heartbeat_max_failures: int | None = None,
        layerwise: ProducerSchedule | None = None,
        layerwise_interval: int = 1,
        seed: int = 0,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        """Timeouts, TTL and heartbeat failures left ``None`` come from TokenSpeed's
        variables in ``environ`` (the configs' ``from_env``; their defaults when
        ``environ`` is ``None``)."""
        env: Mapping[str, str] = environ or {}
        prefill_fields = _given(
            bootstrap_timeout=bootstrap_timeout, failed_session_ttl=failed_session_ttl
        )
        decode_fields = _given(
            waiting_timeout=waiting_timeout, heartbeat_max_failures=heartbeat_max_failures
        )
        self.now = 0.0
        self.seed = seed
        self.bootstrap_addr = bootstrap_addr
        self.prefill_contracts = list(prefill_contracts)
        self.decode_contracts = list(decode_contracts)
        self.prefill_arenas = [HostArena.for_contract(c) for c in self.prefill_contracts]
        self.decode_arenas = [HostArena.for_contract(c) for c in self.decode_contracts]
        p_tp, d_tp = len(self.prefill_contracts), len(self.decode_contracts)
        self.prefill = [
            PrefillCore(
                PrefillConfig.from_env(
                    env,
                    tp_size=p_tp,
                    tp_rank=rank,
                    contract=contract,
                    arena_base=self.prefill_arenas[rank].base,
                    arena_len=self.prefill_arenas[rank].size,
                    session_id=f"{HOST}:{SESSION_PORT + 100 + rank}",
                    transfer_workers=transfer_workers,
                    layerwise=layerwise,
                    layerwise_interval=layerwise_interval,
                    test_failure_seed=seed + rank,
                    **prefill_fields,
                )
            )
            for rank, contract in enumerate(self.prefill_contracts)
        ]
        self.decode = [
            DecodeCore(
                DecodeConfig.from_env(
                    env,
                    tp_size=d_tp,
                    tp_rank=rank,
                    contract=contract,
                    arena_base=self.decode_arenas[rank].base,
                    session_id=self.decode_session(rank),
                    endpoint=HOST,
                    port=DECODE_PORT + rank,
                    test_failure_seed=seed + 1000 + rank,
                    **decode_fields,
                )
            )
            for rank, contract in enumerate(self.decode_contracts)
        ]
        #: Each Prefill rank's control port (a restart moves it).
        self.prefill_ports = [PREFILL_PORT + rank for rank in range(p_tp)]
        self._prefill_pages = [PageAllocator(c) for c in self.prefill_contracts]
        self._decode_pages = [PageAllocator(c) for c in self.decode_contracts]
        self._rooms: dict[int, _Room] = {}
        self._queues: dict[tuple[int, int], deque[_Job]] = {}
        #: Per Prefill rank: producer steps landed so far (modulo the step modulus).
        self.steps = [0] * p_tp
        #: Faults: answer parallel-info fetches with this error.
        self.parallel_info_error: str | None = None
        #: Faults: answer rank-info fetches for these Prefill ranks with an error.
        self.rank_info_errors: dict[int, str] = {}
        #: Faults: writes to these Decode sessions fail with the given error.
        self.write_errors: dict[str, str] = {}
        #: Faults: messages to these ports are lost.
        self.dropped_ports: set[int] = set()
        #: When False, transfers queue until :meth:`run_transfers`.
        self.auto_transfer = True
        #: Every Log and Rejected command (both have a ``message``).
        self.logs: list[tuple[str, int, Log | Rejected]] = []
        self.failures: list[tuple[str, int, RoomFailed]] = []
        self.sent: list[tuple[str, int, SendFrames]] = []
        self.transfers: list[tuple[int, StartTransfer]] = []
        #: Per Decode rank: arena byte offset -> the room whose pages hold it.
        self._owners: list[dict[int, int]] = [{} for _ in self.decode_contracts]
        #: Writes that landed on bytes their room does not own (now, or any more):
        #: (room, Decode rank, offset, owner or None). Write fencing keeps it empty.
        self.fencing_violations: list[tuple[int, int, int, int | None]] = []
        self.bytes_written = 0

    def restart_prefill(self, rank: int) -> None:
        """Prefill rank ``rank`` dies and starts again: a fresh core (its tables lost)
        on a new control port, which the bootstrap lookups now answer; messages to
        the old port are lost, as a PUSH to a dead process queues forever."""
        old = self.prefill[rank]
        self.dropped_ports.add(self.prefill_ports[rank])
        self.prefill_ports[rank] += 100
        self.prefill[rank] = PrefillCore(old.config)

    # ------------------------------------------------------------------ addressing

    @staticmethod
    def decode_session(rank: int) -> str:
        """The transfer session id of Decode rank ``rank``."""
        return f"{HOST}:{SESSION_PORT + rank}"

    def _decode_rank_of_session(self, session_id: str) -> int:
        return int(session_id.rsplit(":", 1)[1]) - SESSION_PORT

    # ------------------------------------------------------------------ plumbing

    def close(self) -> None:
        """Unmap every arena."""
        for arena in (*self.prefill_arenas, *self.decode_arenas):
            arena.close()

    def advance(self, seconds: float) -> None:
        """Move virtual time forward, then run every timer that came due."""
        self.now += seconds
        self.run_timers()

    def run_timers(self) -> None:
        """Call ``handle_timeout`` on every core whose deadline has passed."""
        for prefill in self.prefill:
            deadline = prefill.next_deadline()
            if deadline is not None and deadline <= self.now:
                prefill.handle_timeout(self.now)
        for decode in self.decode:
            deadline = decode.next_deadline()
            if deadline is not None and deadline <= self.now:
                decode.handle_timeout(self.now)
        self.pump()

    def pump(self) -> None:
        """Execute every queued command of every core until all are quiet."""
        command: Command  # either side's
        busy = True
        while busy:
            busy = False
            for rank, prefill in enumerate(self.prefill):
                for command in prefill.drain_commands():
                    busy = True
                    self._execute("prefill", rank, command)
            for rank, decode in enumerate(self.decode):
                for command in decode.drain_commands():
                    busy = True
                    self._execute("decode", rank, command)
            if self.auto_transfer and self._run_workers():
                busy = True

    def _execute(self, side: str, rank: int, command: Command) -> None:
        match command:
            case SendFrames():
                self.sent.append((side, rank, command))
                self._deliver(command)
            case StartTransfer():
                self.transfers.append((rank, command))
                key = (rank, command.shard)
                self._queues.setdefault(key, deque()).append(_Job(rank, command))
            case FetchParallelInfo(bootstrap_addr=addr):
                info: ParallelInfo | str = self.parallel_info_error or ParallelInfo(
                    tp_size=len(self.prefill),
                    dp_size=1,
                    cache_layout=self.prefill_contracts[0].to_json().decode("ascii"),
                )
                self.decode[rank].parallel_info(addr, info, self.now)
            case FetchRankInfo(bootstrap_addr=addr, engine_rank=target, dp_group=dp):
                answer: RankInfo | str = self.rank_info_errors.get(target) or RankInfo(
                    HOST, self.prefill_ports[target]
                )
                self.decode[rank].rank_info(addr, dp, target, answer, self.now)
            case RoomFailed():
                self.failures.append((side, rank, command))
            case Log() | Rejected():
                self.logs.append((side, rank, command))

    def _deliver(self, command: SendFrames) -> None:
        port = command.port
        if port in self.dropped_ports:
            return
        if port in self.prefill_ports:
            self.prefill[self.prefill_ports.index(port)].receive_control(command.frames, self.now)
        elif DECODE_PORT <= port < DECODE_PORT + len(self.decode):
            self.decode[port - DECODE_PORT].receive_status(command.frames, self.now)
        else:
            raise AssertionError(f"a core sent to an unknown port {port}: {command}")

    def run_transfers(self) -> bool:
        """Run every runnable transfer (also when :attr:`auto_transfer` is off)."""
        ran = self._run_workers()
        self.pump()
        return ran

    def _run_workers(self) -> bool:
        progressed = False
        for queue in self._queues.values():
            while queue:
                job = queue[0]
                if not self._advance_job(job):
                    break
                self.prefill[job.rank].transfer_done(job.command.room, self.now)
                queue.popleft()
                progressed = True
        return progressed

    def _advance_job(self, job: _Job) -> bool:
        """Run ``job`` as far as it can go; ``True`` once it is finished."""
        core = self.prefill[job.rank]
        command = job.command
        room = command.room
        while job.next_interval < len(command.intervals):
            interval = command.intervals[job.next_interval]
            if not core.room_active(room):
                return True
            if interval.target_step is not None:
                dead = [s for s in command.sessions if not core.session_alive(s, self.now)]
                if dead:
                    core.transfer_failed(
                        room,
                        None,
                        f"Cache-transfer layerwise peer failed for room {room}",
                        self.now,
                    )
                    return True
                if not step_ready(self.steps[job.rank], interval.target_step):
                    return False
            for write in interval.writes:
                if not core.room_active(room):
                    return True
                error = self.write_errors.get(write.session_id)
                if error is not None:
                    core.transfer_failed(room, write.session_id, error, self.now)
                    return True
                self._apply(
                    job.rank, self._decode_rank_of_session(write.session_id), write.plan, room
                )
            job.next_interval += 1
        if command.final:
            core.transfer_succeeded(room, self.now)
        return True

    def _own(self, rank: int, tables: Mapping[str, Sequence[int]], room: int | None) -> None:
        """Record ``room`` (``None``: free) as the owner of every byte of the pages in
        ``tables`` on Decode rank ``rank``, for the write-fencing check."""
        contract = self.decode_contracts[rank]
        owners = self._owners[rank]
        for spec in contract.plan.fields:
            for page in tables.get(spec.group_id, ()):
                if page <= 0:
                    continue
                start = contract.page_offset(spec, page)
                for offset in range(start, start + spec.payload_bytes):
                    if room is None:
                        owners.pop(offset, None)
                    else:
                        owners[offset] = room

    def _apply(
        self, prefill_rank: int, decode_rank: int, plan: CopyPlan, room: int | None = None
    ) -> None:
        source = self.prefill_arenas[prefill_rank]
        target = self.decode_arenas[decode_rank]
        if room is not None:
            owners = self._owners[decode_rank]
            for _, dst, length in plan:
                start = dst - target.base
                for offset in (start, start + length - 1):
                    owner = owners.get(offset)
                    if owner != room:
                        self.fencing_violations.append((room, decode_rank, offset, owner))
        for src, dst, length in plan:
            s, d = src - source.base, dst - target.base
            if not (s >= 0 and s + length <= source.size and d >= 0 and d + length <= target.size):
                raise AssertionError(f"copy ({src:#x}, {dst:#x}, {length}) leaves an arena")
            target.array[d : d + length] = source.array[s : s + length]
            self.bytes_written += length

    def produce(self, steps: int, rank: int | None = None) -> None:
        """Land ``steps`` producer steps on one Prefill rank (all when ``None``), then
        let waiting layerwise intervals go."""
        ranks = range(len(self.prefill)) if rank is None else [rank]
        for r in ranks:
            self.steps[r] = (self.steps[r] + steps) % STEP_MODULUS
        self.pump()

    # ------------------------------------------------------------------ agreement

    @staticmethod
    def _agree(values: Sequence[Sequence[int]]) -> list[int]:
        lengths = {len(v) for v in values}
        if len(lengths) != 1:
            raise AssertionError(f"ranks track different request counts: {lengths}")
        return [min(column) for column in zip(*values, strict=True)]

    def poll_prefill(self) -> list[Event]:
        """One scheduler iteration on every Prefill rank: poll, MIN, conclude. Returns
        rank 0's events (every rank gets the same ones)."""
        if not self.prefill[0].has_in_flight():
            return []
        agreed = self._agree([core.poll_values(self.now) for core in self.prefill])
        events = [core.conclude(agreed, self.now) for core in self.prefill]
        self.pump()
        if any(e != events[0] for e in events[1:]):
            raise AssertionError(f"Prefill ranks disagree on events: {events}")
        return events[0]

    def poll_decode(self) -> list[Event]:
        """One scheduler iteration on every Decode rank; returns rank 0's events."""
        if not self.decode[0].has_in_flight():
            return []
        agreed = self._agree([core.poll_values(self.now) for core in self.decode])
        events = [core.conclude(agreed, self.now) for core in self.decode]
        self.pump()
        return events[0]

    # ------------------------------------------------------------------ request journey

    def register_decode(self, rid: str, room: int) -> None:
        """Every Decode rank registers the request (route planning, registrations)."""
        for core in self.decode:
            core.register_request(rid, room, self.bootstrap_addr, self.now)
        self.pump()

    def register_prefill(self, rid: str, room: int) -> None:
        """Every Prefill rank registers the request."""
        for core in self.prefill:
            core.register_request(rid, room, self.now)
        self.pump()

    def preallocate(self, room: int, prompt_len: int, prefix_len: int = 0) -> None:
        """Every Decode rank allocates the request's pages and pre-allocates."""
        entry = self._rooms.setdefault(room, _Room())
        for rank, core in enumerate(self.decode):
            tables = self._decode_pages[rank].allocate(prompt_len, prefix_len)
            entry.decode_tables[rank] = tables
            self._own(rank, tables, room)
            manifest = build_manifest(self.decode_contracts[rank], tables, prefix_len, prompt_len)
            entry.decode_manifests[rank] = manifest
            core.send_preallocation(room, manifest, self.now)
        self.pump()

    def prefill_tables(self, room: int, prompt_len: int, prefix_len: int = 0) -> None:
        """Every Prefill rank allocates the request's pages and writes its KV (the
        interop pattern) into them, as a forward would."""
        entry = self._rooms.setdefault(room, _Room())
        for rank in range(len(self.prefill)):
            if rank in entry.prefill_tables:
                continue
            contract = self.prefill_contracts[rank]
            tables = self._prefill_pages[rank].allocate(prompt_len, prefix_len)
            entry.prefill_tables[rank] = tables
            source = build_manifest(contract, tables, prefix_len, prompt_len)
            fill_room(
                self.prefill_arenas[rank],
                contract,
                source,
                seed=self.seed,
                room=room,
                tp_size=len(self.prefill),
                tp_rank=rank,
            )

    def tables_of(self, room: int, rank: int) -> Mapping[str, Sequence[int]]:
        """Prefill rank ``rank``'s block-table row of ``room`` (see :meth:`prefill_tables`)."""
        return self._rooms[room].prefill_tables[rank]

    def hand_over(
        self,
        room: int,
        prompt_len: int,
        prefix_len: int = 0,
        *,
        token: int = 7,
        candidates: Sequence[int] = (),
    ) -> None:
        """Every Prefill rank hands the written prompt over (remote decode)."""
        self.prefill_tables(room, prompt_len, prefix_len)
        for rank, core in enumerate(self.prefill):
            core.hand_over(room, self.tables_of(room, rank), token, candidates, self.now)
        self.pump()

    def verify(self, room: int) -> list[BlockMismatch]:
        """Every Decode block of ``room`` checked against the interop pattern."""
        mismatches: list[BlockMismatch] = []
        for rank, manifest in self._rooms[room].decode_manifests.items():
            mismatches += verify_room(
                self.decode_arenas[rank],
                self.decode_contracts[rank],
                manifest,
                seed=self.seed,
                room=room,
                tp_size=len(self.decode),
                tp_rank=rank,
            )
        return mismatches

    def release_room(self, room: int) -> None:
        """Return the room's pages on both sides (the engines' block managers)."""
        entry = self._rooms.pop(room, None)
        if entry is None:
            return
        for rank, tables in entry.prefill_tables.items():
            self._prefill_pages[rank].release(tables)
        for rank, tables in entry.decode_tables.items():
            self._own(rank, tables, None)
            self._decode_pages[rank].release(tables)

    def status(self, room: int) -> tuple[list[TransferPoll | None], list[TransferPoll | None]]:
        """The room's status on every Prefill rank and every Decode rank."""
        return (
            [core.room_state(room).poll for core in self.prefill],
            [core.room_state(room).poll for core in self.decode],
        )

    def statistics(self) -> dict[str, dict[str, int]]:
        """Every core's table sizes, keyed ``prefill.<rank>`` / ``decode.<rank>``."""
        stats = {f"prefill.{r}": c.statistics() for r, c in enumerate(self.prefill)}
        stats.update({f"decode.{r}": c.statistics() for r, c in enumerate(self.decode)})
        return stats

    _PER_PEER = frozenset(
        {
            "registrations",
            "rejected",
            "failed_sessions",
            "addresses",
            "rank_infos",
            "registered_ranks",
            # Bounded and time-limited memory of failed rooms, kept on purpose.
            "failed_room_memory",
        }
    )

    def room_tables_empty(self) -> bool:
        """Whether every per-room table of every core is empty (per-peer tables such
        as registrations may stay)."""
        return all(
            size == 0
            for stats in self.statistics().values()
            for name, size in stats.items()
            if name not in self._PER_PEER
        )

    def full_journey(
        self, rid: str, room: int, prompt_len: int, prefix_len: int = 0, *, token: int = 7
    ) -> tuple[list[Event], list[Event]]:
        """Run one request end to end: register on both sides, pre-allocate, hand
        over, and poll both sides until they conclude. Returns every Prefill event
        and every Decode event."""
        prefill_events: list[Event] = []
        decode_events: list[Event] = []
        self.register_decode(rid, room)
        self.register_prefill(rid, room)
        decode_events += self.poll_decode()
        self.preallocate(room, prompt_len, prefix_len)
        prefill_events += self.poll_prefill()
        if self.prefill[0].room_state(room).poll is TransferPoll.BOOTSTRAPPED:
            self.hand_over(room, prompt_len, prefix_len, token=token)
        prefill_events += self.poll_prefill()
        decode_events += self.poll_decode()
        return prefill_events, decode_events
