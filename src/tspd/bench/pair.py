"""Prefill and Decode cores wired together in-process, for ``tspd bench rooms``.

Every Prefill TP rank's :class:`~tspd.core.prefill.PrefillCore` and every Decode TP
rank's :class:`~tspd.core.decode.DecodeCore` of one Prefill instance and one Decode
instance, on a clock that only moves when told, with nothing but the cores in the
measured path:

* :class:`~tspd.core.commands.SendFrames` go straight to the core listening on that
  port (Prefill control ports ``7000 + rank``, Decode status ports ``8000 + rank``);
* bootstrap lookups are answered from the Prefill ranks' contracts;
* :class:`~tspd.core.commands.StartTransfer` copies each plan between the ranks'
  host arenas (:class:`~tspd.shell.arena.HostArena`) once the cores are drained, then
  reports ``transfer_succeeded`` and ``transfer_done``, as a transfer worker would;
* the replica agreement is the element-wise MIN over the ranks of a side.

It is built from public modules only (:mod:`tspd.core`, :mod:`tspd.layouts`,
:mod:`tspd.shell.arena`). Tests drive cores with :mod:`tspd.testing.core_pair`,
which adds fault injection, layerwise steps, byte verification and write-fencing
bookkeeping; none of that is wanted in a timing loop, so this is not it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, final

from tspd.core.bootstrap import ParallelInfo, RankInfo
from tspd.core.commands import (
    Command,
    Event,
    FetchParallelInfo,
    FetchRankInfo,
    RemotePrefillDone,
    SendFrames,
    StartTransfer,
    Succeeded,
)
from tspd.core.contract import CacheContract
from tspd.core.decode import DecodeConfig, DecodeCore
from tspd.core.manifest import build_manifest
from tspd.core.poll import TransferPoll
from tspd.core.prefill import PrefillConfig, PrefillCore
from tspd.layouts import PageAllocator
from tspd.shell.arena import HostArena

__all__ = ["WiredCores"]

HOST: Final = "127.0.0.1"
BOOTSTRAP_ADDR: Final = f"{HOST}:8998"
PREFILL_PORT: Final = 7000
DECODE_PORT: Final = 8000
SESSION_PORT: Final = 9000

#: The bootstrap token a hand-over carries (any value does).
_TOKEN: Final = 7


def _min_columns(values: Sequence[Sequence[int]]) -> list[int]:
    """The replica agreement: element-wise MIN over the ranks of a side."""
    return [min(column) for column in zip(*values, strict=True)]


@final
class WiredCores:
    """One Prefill instance (``len(prefill_contracts)`` TP ranks) and one Decode
    instance (``len(decode_contracts)`` TP ranks) at time :attr:`now`.

    Timeouts are TokenSpeed's defaults (the configs' ``from_env`` of an empty
    environment). Call :meth:`close` to unmap the arenas.
    """

    def __init__(
        self,
        prefill_contracts: Sequence[CacheContract],
        decode_contracts: Sequence[CacheContract],
    ) -> None:
        self.now = 0.0
        self.prefill_contracts = list(prefill_contracts)
        self.decode_contracts = list(decode_contracts)
        self.prefill_arenas = [HostArena.for_contract(c) for c in self.prefill_contracts]
        self.decode_arenas = [HostArena.for_contract(c) for c in self.decode_contracts]
        p_tp, d_tp = len(self.prefill_contracts), len(self.decode_contracts)
        self.prefill = [
            PrefillCore(
                PrefillConfig.from_env(
                    {},
                    tp_size=p_tp,
                    tp_rank=rank,
                    contract=contract,
                    arena_base=self.prefill_arenas[rank].base,
                    arena_len=self.prefill_arenas[rank].size,
                    session_id=f"{HOST}:{SESSION_PORT + 100 + rank}",
                    transfer_workers=2,
                )
            )
            for rank, contract in enumerate(self.prefill_contracts)
        ]
        self.decode = [
            DecodeCore(
                DecodeConfig.from_env(
                    {},
                    tp_size=d_tp,
                    tp_rank=rank,
                    contract=contract,
                    arena_base=self.decode_arenas[rank].base,
                    session_id=f"{HOST}:{SESSION_PORT + rank}",
                    endpoint=HOST,
                    port=DECODE_PORT + rank,
                )
            )
            for rank, contract in enumerate(self.decode_contracts)
        ]
        self._parallel_info = ParallelInfo(
            tp_size=p_tp,
            dp_size=1,
            cache_layout=self.prefill_contracts[0].to_json().decode("ascii"),
        )
        self._prefill_pages = [PageAllocator(c) for c in self.prefill_contracts]
        self._decode_pages = [PageAllocator(c) for c in self.decode_contracts]
        #: Per room: each side's block-table rows per rank (returned by release_room).
        self._tables: dict[int, tuple[list[dict[str, list[int]]], list[dict[str, list[int]]]]] = {}
        self._transfers: list[tuple[int, StartTransfer]] = []

    def close(self) -> None:
        """Unmap every arena."""
        for arena in (*self.prefill_arenas, *self.decode_arenas):
            arena.close()

    # ------------------------------------------------------------------ time and commands

    def advance(self, seconds: float) -> None:
        """Move the clock forward, then run every timer that came due."""
        self.now += seconds
        cores: list[PrefillCore | DecodeCore] = [*self.prefill, *self.decode]
        for core in cores:
            deadline = core.next_deadline()
            if deadline is not None and deadline <= self.now:
                core.handle_timeout(self.now)
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
                    self._execute(rank, command)
            for rank, decode in enumerate(self.decode):
                for command in decode.drain_commands():
                    busy = True
                    self._execute(rank, command)
            if self._transfers:
                busy = True
                transfers, self._transfers = self._transfers, []
                for rank, transfer in transfers:
                    self._transfer(rank, transfer)

    def _execute(self, rank: int, command: Command) -> None:
        """One command of the core of ``rank`` on its side; logs, failures and route
        closes need nothing here."""
        if isinstance(command, SendFrames):
            port = command.port
            if DECODE_PORT <= port < DECODE_PORT + len(self.decode):
                self.decode[port - DECODE_PORT].receive_status(command.frames, self.now)
            else:
                self.prefill[port - PREFILL_PORT].receive_control(command.frames, self.now)
        elif isinstance(command, StartTransfer):
            self._transfers.append((rank, command))
        elif isinstance(command, FetchParallelInfo):
            self.decode[rank].parallel_info(command.bootstrap_addr, self._parallel_info, self.now)
        elif isinstance(command, FetchRankInfo):
            self.decode[rank].rank_info(
                command.bootstrap_addr,
                command.dp_group,
                command.engine_rank,
                RankInfo(HOST, PREFILL_PORT + command.engine_rank),
                self.now,
            )

    def _transfer(self, rank: int, transfer: StartTransfer) -> None:
        """Run one chunk as a transfer worker does: every write while the room is
        active, then the success report (when final) and the done report."""
        core = self.prefill[rank]
        room = transfer.room
        source = self.prefill_arenas[rank]
        for interval in transfer.intervals:
            for write in interval.writes:
                if not core.room_active(room):
                    break
                target = self.decode_arenas[int(write.session_id.rsplit(":", 1)[1]) - SESSION_PORT]
                for src, dst, length in write.plan:
                    s, d = src - source.base, dst - target.base
                    target.array[d : d + length] = source.array[s : s + length]
        if transfer.final and core.room_active(room):
            core.transfer_succeeded(room, self.now)
        core.transfer_done(room, self.now)

    # ------------------------------------------------------------------ scheduler iterations

    def poll_prefill(self) -> list[Event]:
        """One scheduler iteration on every Prefill rank: poll, MIN, conclude. Returns
        rank 0's events."""
        if not self.prefill[0].has_in_flight():
            return []
        agreed = _min_columns([core.poll_values(self.now) for core in self.prefill])
        events = [core.conclude(agreed, self.now) for core in self.prefill]
        self.pump()
        return events[0]

    def poll_decode(self) -> list[Event]:
        """One scheduler iteration on every Decode rank; returns rank 0's events."""
        if not self.decode[0].has_in_flight():
            return []
        agreed = _min_columns([core.poll_values(self.now) for core in self.decode])
        events = [core.conclude(agreed, self.now) for core in self.decode]
        self.pump()
        return events[0]

    # ------------------------------------------------------------------ a request's steps

    def register_decode(self, rid: str, room: int) -> None:
        """Every Decode rank registers the request (route planning, registrations)."""
        for core in self.decode:
            core.register_request(rid, room, BOOTSTRAP_ADDR, self.now)
        self.pump()

    def register_prefill(self, rid: str, room: int) -> None:
        """Every Prefill rank registers the request."""
        for core in self.prefill:
            core.register_request(rid, room, self.now)
        self.pump()

    def preallocate(self, room: int, prompt_len: int) -> None:
        """Every Decode rank allocates the request's pages and pre-allocates them."""
        decode_rows = self._tables.setdefault(room, ([], []))[1]
        for rank, core in enumerate(self.decode):
            tables = self._decode_pages[rank].allocate(prompt_len)
            decode_rows.append(tables)
            manifest = build_manifest(self.decode_contracts[rank], tables, 0, prompt_len)
            core.send_preallocation(room, manifest, self.now)
        self.pump()

    def hand_over(self, room: int, prompt_len: int) -> None:
        """Every Prefill rank allocates the request's pages and hands the prompt over
        (remote decode). The pages' bytes are whatever the arena holds: writing the
        KV is the forward's work, not the control plane's."""
        prefill_rows = self._tables.setdefault(room, ([], []))[0]
        for rank, core in enumerate(self.prefill):
            tables = self._prefill_pages[rank].allocate(prompt_len)
            prefill_rows.append(tables)
            core.hand_over(room, tables, _TOKEN, (), self.now)
        self.pump()

    def release_room(self, room: int) -> None:
        """Return the room's pages on both sides (the engines' block managers)."""
        prefill_rows, decode_rows = self._tables.pop(room, ([], []))
        for rank, tables in enumerate(prefill_rows):
            self._prefill_pages[rank].release(tables)
        for rank, tables in enumerate(decode_rows):
            self._decode_pages[rank].release(tables)

    def journey(self, rid: str, room: int, prompt_len: int) -> None:
        """One request end to end — register on both sides, pre-allocate, hand over,
        poll both sides until they conclude — then free its pages. Raises
        ``AssertionError`` unless Prefill reports ``Succeeded`` and Decode
        ``RemotePrefillDone``: a benchmark of a failing journey measures nothing."""
        self.register_decode(rid, room)
        self.register_prefill(rid, room)
        decode_events = self.poll_decode()
        self.preallocate(room, prompt_len)
        prefill_events = self.poll_prefill()
        if self.prefill[0].room_state(room).poll is TransferPoll.BOOTSTRAPPED:
            self.hand_over(room, prompt_len)
        prefill_events += self.poll_prefill()
        decode_events += self.poll_decode()
        self.release_room(room)
        if not (
            any(isinstance(e, Succeeded) for e in prefill_events)
            and any(isinstance(e, RemotePrefillDone) for e in decode_events)
        ):
            raise AssertionError(
                f"room {room} did not conclude: Prefill {prefill_events}, Decode "
                f"{decode_events}; the benchmark state is wrong"
            )
