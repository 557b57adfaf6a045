"""Live peers for ``tspd bench hostile`` and ``tspd bench churn``, and the test that
runs the same attack in CI (``tests/integration/test_hostile_input.py``).

A *victim* is one real component, on 127.0.0.1, driven the way an engine drives it:

* ``bootstrap`` — the bootstrap HTTP server (:func:`~tspd.shell.bootstrap.open_bootstrap_server`);
* ``prefill`` — one Prefill rank (TP 1) on the real Mooncake engine, registered with
  the bootstrap server, with a small scheduler that serves the rooms it is told to
  (:class:`PrefillRooms`: on ``Bootstrapped`` it writes the interop pattern
  (docs/protocol.md#proto-interop) into
  the room's pages and hands the remote decode over);
* ``decode`` — one Decode rank (TP 1) on Mooncake, whose scheduler registers rooms
  with the bootstrap server, pre-allocates them and checks every byte and the
  bootstrap token that arrives (:func:`decode_rooms`);
* ``events`` — a KV-event publisher with a replay ROUTER and a subscriber bound for
  it (TokenSpeed's non-wildcard set-up), the publisher publishing synthetic batches.

The benchmarks run each victim in a child process (:class:`Victim`, started with this
interpreter): its RSS, descriptors and log lines are its own, and a crash is a dead
process. A victim prints one JSON line ``{"event": "ready", ...}`` with its
addresses, then answers JSON commands on standard input, one line each:
``{"op": "stats"}``, ``{"op": "rooms", "start": a, "stop": b}`` (serve those rooms
and report), ``{"op": "expect", "rooms": [...]}`` (Prefill: serve them, report
nothing), ``{"op": "exit"}``. A Prefill victim started with ``engine="fake"`` runs
on tspd's fake transfer engine instead and plays the Decode side's data plane for
``tspd bench churn``: ``{"op": "session", "room": r}`` opens a new Decode session
(a new fake engine with the Decode arena registered, pages for room ``r``) and
``{"op": "drop", "room": r}`` checks the room's bytes and closes it.

Every log record under ``tspd`` is formatted as the ``tspd`` commands would write it
and tallied (:class:`LogTally`): lines, bytes, by level, by message template.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Final, final

import trio

from tspd.core.commands import Bootstrapped, Failed, RemotePrefillDone, Succeeded
from tspd.core.contract import CacheContract
from tspd.core.decode import DecodeConfig
from tspd.core.interop import bootstrap_token_and_candidates
from tspd.core.manifest import BlockManifest, build_manifest
from tspd.core.prefill import PrefillConfig
from tspd.demo.workload import Workload
from tspd.layouts import PageAllocator
from tspd.log import KeyValueFormatter
from tspd.shell.arena import HostArena, clear_room, fill_room, verify_room
from tspd.shell.decode import DecodePeer, DecodeSettings, open_decode_peer
from tspd.shell.prefill import PrefillPeer, PrefillSettings, RemoteDecodeRow, open_prefill_peer

__all__ = [
    "GOOD_ROOMS",
    "SEED",
    "LogTally",
    "PrefillRooms",
    "RoomOutcome",
    "Victim",
    "close_all",
    "decode_config",
    "decode_rooms",
    "fds_of",
    "mooncake_decode",
    "mooncake_prefill",
    "prefill_config",
    "process_figures",
    "rss_of",
    "victim",
    "wait_idle",
    "workload",
]

#: The interop pattern's seed for every room the victims serve.
SEED: Final = 11
#: Rooms of the good traffic start here; hostile traffic never names a room in
#: ``[GOOD_ROOMS, GOOD_ROOMS + 10**9)``.
GOOD_ROOMS: Final = 10**12
#: Seconds a room may take before the driver gives up on it.
ROOM_LIMIT: Final = 60.0
#: How often an idle scheduler loop polls (an engine polls every iteration).
_IDLE: Final = 0.002


def workload() -> Workload:
    """The victims' cache geometry: one layer, small pages, prompts of 1-2 pages."""
    return Workload(
        rooms=range(GOOD_ROOMS, GOOD_ROOMS + 1),
        seed=SEED,
        layers=1,
        global_heads=2,
        head_dim=16,
        page_tokens=4,
        num_pages=512,
        max_prompt_pages=2,
    )


# ----------------------------------------------------------------------- process figures


def rss_of(pid: int | str = "self") -> int:
    """Resident set size of a process in bytes (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def fds_of(pid: int | str = "self") -> int:
    """Open descriptors of a process (0 once it is gone)."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def _threads_of(pid: int | str) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


def _cpu_of(pid: int | str) -> float:
    """User + system CPU seconds of a process."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _tcp_sockets_of(pid: int | str) -> int:
    """Descriptors of a process that are sockets."""
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return 0
    count = 0
    for name in names:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{name}").startswith("socket:"):
                count += 1
    return count


def process_figures(pid: int | str = "self") -> dict[str, float]:
    """RSS (bytes), descriptors, of them sockets, threads and CPU seconds of a process."""
    return {
        "rss": rss_of(pid),
        "fds": fds_of(pid),
        "sockets": _tcp_sockets_of(pid),
        "threads": _threads_of(pid),
        "cpu": _cpu_of(pid),
    }


# ---------------------------------------------------------------------------- log tally


@final
class LogTally(logging.Handler):
    """Counts what the ``tspd`` loggers write: each record is formatted as the
    ``tspd`` commands format it (``key=value`` lines) and counted — records, lines
    (a traceback adds its lines), bytes, per level and per message template (at most
    ``templates`` distinct ones; the rest under ``"(other)"``). Keeps the first
    ``samples`` lines of WARNING and above. Nothing is written anywhere."""

    def __init__(self, *, templates: int = 64, samples: int = 5) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(KeyValueFormatter())
        self.records = 0
        self.lines = 0
        self.bytes = 0
        self.by_level: Counter[str] = Counter()
        #: WARNING+ lines and bytes (what ``tspd`` commands show by default).
        self.warning_lines = 0
        self.warning_bytes = 0
        self.by_template: Counter[str] = Counter()
        #: The largest record written, in bytes.
        self.longest = 0
        self._templates = templates
        self.samples: list[str] = []
        self._max_samples = samples

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
        except Exception:  # a record that cannot be formatted is still a record
            text = str(record.msg)
        lines = text.count("\n") + 1
        size = len(text.encode("utf-8", "replace")) + 1
        self.records += 1
        self.lines += lines
        self.bytes += size
        self.longest = max(self.longest, size)
        self.by_level[record.levelname] += 1
        if record.levelno >= logging.WARNING:
            self.warning_lines += lines
            self.warning_bytes += size
            if len(self.samples) < self._max_samples:
                self.samples.append(text[:300])
        template = f"{record.levelname} {record.name}: {str(record.msg)[:80]}"
        if template in self.by_template or len(self.by_template) < self._templates:
            self.by_template[template] += 1
        else:
            self.by_template["(other)"] += 1

    def snapshot(self) -> dict[str, Any]:
        """The tallies as JSON-friendly data (the five most frequent templates)."""
        return {
            "records": self.records,
            "lines": self.lines,
            "bytes": self.bytes,
            "warning_lines": self.warning_lines,
            "warning_bytes": self.warning_bytes,
            "longest": self.longest,
            "by_level": dict(self.by_level),
            "top": self.by_template.most_common(5),
            "samples": list(self.samples),
        }

    @contextlib.contextmanager
    def attached(self, level: int = logging.INFO) -> Any:
        """Tally ``tspd`` records at ``level`` and above for the block (the ``tspd``
        logger's level is set for it and restored)."""
        root = logging.getLogger("tspd")
        old = root.level
        root.addHandler(self)
        root.setLevel(level)
        try:
            yield self
        finally:
            root.removeHandler(self)
            root.setLevel(old)


# ------------------------------------------------------------------------------ rooms


@dataclass(slots=True)
class RoomOutcome:
    """How a batch of rooms ended on one side."""

    ok: int = 0
    failed: int = 0
    bytes_verified: int = 0
    reasons: list[str] = field(default_factory=list)

    def fail(self, room: int, reason: str) -> None:
        """Count a failed room (the first few reasons are kept)."""
        self.failed += 1
        if len(self.reasons) < 5:
            self.reasons.append(f"room {room}: {reason}"[:400])

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return {
            "ok": self.ok,
            "failed": self.failed,
            "bytes_verified": self.bytes_verified,
            "reasons": self.reasons,
        }


@final
class PrefillRooms:
    """A stand-in Prefill scheduler: serves every room it is given, as the demo's
    Prefill rank does (register, poll, write the pattern on ``Bootstrapped``, hand
    over), and remembers each room's outcome until it is collected."""

    def __init__(self, peer: PrefillPeer, workload: Workload) -> None:
        self.peer = peer
        self.workload = workload
        self.contract = peer.core.config.contract
        self._pages = PageAllocator(self.contract)
        self._live: dict[str, int] = {}
        self._tables: dict[str, dict[str, list[int]]] = {}
        self.outcomes: dict[int, str | None] = {}
        self._changed = trio.Event()
        self.served = 0
        self.failed = 0

    def expect(self, rooms: Iterable[int]) -> None:
        """Start serving ``rooms`` (the outcome of each lands in :attr:`outcomes`)."""
        for room in rooms:
            rid = self.workload.rid(room)
            self._live[rid] = room
            self.peer.register_request(rid, room)

    async def run(self) -> None:
        """The scheduler loop (runs until cancelled)."""
        while True:
            if not self.peer.has_in_flight():
                with trio.move_on_after(0.05):
                    await self.peer.wait_for_activity()
                continue
            events = await self.peer.poll()
            ready: list[RemoteDecodeRow] = []
            for event in events:
                room = self._live.get(event.rid)
                if room is None:
                    continue
                if isinstance(event, Bootstrapped):
                    ready.append(self._forward(event.rid, room))
                elif isinstance(event, Succeeded | Failed):
                    del self._live[event.rid]
                    tables = self._tables.pop(event.rid, None)
                    if tables is not None:
                        self._pages.release(tables)
                    ok = isinstance(event, Succeeded)
                    self.served += ok
                    self.failed += not ok
                    self.outcomes[room] = None if ok else event.reason  # type: ignore[union-attr]
                    self._changed.set()
            if ready:
                self.peer.hand_over(ready)
            if not events:
                with trio.move_on_after(_IDLE):
                    await self.peer.wait_for_activity()

    def _forward(self, rid: str, room: int) -> RemoteDecodeRow:
        prompt = self.workload.prompt_len(room, self.contract)
        tables = self._pages.allocate(prompt)
        self._tables[rid] = tables
        manifest = build_manifest(self.contract, tables, 0, prompt)
        fill_room(
            self.peer.arena,
            self.contract,
            manifest,
            seed=self.workload.seed,
            room=room,
        )
        token, candidates = bootstrap_token_and_candidates(
            self.workload.seed, room, self.workload.candidates
        )
        return RemoteDecodeRow(rid, tables, token, candidates)

    async def collect(self, rooms: Sequence[int], limit: float = ROOM_LIMIT) -> RoomOutcome:
        """Wait for the outcome of every one of ``rooms`` (at most ``limit`` seconds;
        a room still open then counts as failed) and forget them."""
        outcome = RoomOutcome()
        with trio.move_on_after(limit):
            while not all(room in self.outcomes for room in rooms):
                self._changed = trio.Event()
                await self._changed.wait()
        for room in rooms:
            if room not in self.outcomes:
                outcome.fail(room, f"no outcome within {limit:g} s")
                continue
            reason = self.outcomes.pop(room)
            if reason is None:
                outcome.ok += 1
            else:
                outcome.fail(room, reason)
        return outcome


async def decode_rooms(
    peer: DecodePeer, workload: Workload, rooms: Sequence[int], bootstrap: str
) -> RoomOutcome:
    """Serve ``rooms`` as the demo's Decode rank does — register each with
    ``bootstrap``, pre-allocate zeroed pages on ``Bootstrapped``, check every byte,
    the bootstrap token and the candidates on ``RemotePrefillDone`` — and report."""
    contract = peer.core.config.contract
    pages = PageAllocator(contract)
    outcome = RoomOutcome()
    live = {workload.rid(room): room for room in rooms}
    held: dict[str, tuple[dict[str, list[int]], BlockManifest]] = {}
    for rid, room in live.items():
        peer.register_request(rid, room, bootstrap)
    with trio.move_on_after(ROOM_LIMIT):
        while live:
            events = await peer.poll()
            for event in events:
                room_or_none = live.get(event.rid)
                if room_or_none is None:
                    continue
                room = room_or_none
                if isinstance(event, Bootstrapped):
                    prompt = workload.prompt_len(room, contract)
                    tables = pages.allocate(prompt)
                    manifest = build_manifest(contract, tables, 0, prompt)
                    clear_room(peer.arena, contract, manifest)
                    held[event.rid] = (tables, manifest)
                    peer.send_preallocation(room, manifest)
                elif isinstance(event, RemotePrefillDone | Failed):
                    del live[event.rid]
                    kept = held.pop(event.rid, None)
                    if kept is not None:
                        pages.release(kept[0])
                    if isinstance(event, Failed):
                        outcome.fail(room, event.reason)
                    elif kept is None:
                        outcome.fail(room, "done without a pre-allocation")
                    else:
                        _check_room(peer.arena, contract, workload, room, event, kept[1], outcome)
            if not events:
                with trio.move_on_after(_IDLE):
                    await peer.wait_for_activity()
    for room in live.values():
        outcome.fail(room, f"no outcome within {ROOM_LIMIT:g} s")
    return outcome


def _check_room(
    arena: HostArena,
    contract: CacheContract,
    workload: Workload,
    room: int,
    event: RemotePrefillDone,
    manifest: BlockManifest,
    outcome: RoomOutcome,
) -> None:
    token, candidates = bootstrap_token_and_candidates(workload.seed, room, workload.candidates)
    if (event.bootstrap_token, event.spec_candidate_ids) != (token, candidates):
        outcome.fail(room, f"token {event.bootstrap_token} differs from the pattern's {token}")
        return
    mismatches = verify_room(arena, contract, manifest, seed=workload.seed, room=room)
    if mismatches:
        outcome.fail(room, f"{len(mismatches)} blocks differ, first {mismatches[0]}")
        return
    outcome.ok += 1
    outcome.bytes_verified += manifest.payload_bytes(contract)


# --------------------------------------------------------------------------- peers


def prefill_config(contract: CacheContract, **changes: Any) -> PrefillConfig:
    """A Prefill rank's configuration for the victims (TP 1 unless changed)."""
    values: dict[str, Any] = {
        "tp_size": 1,
        "tp_rank": 0,
        "contract": contract,
        "arena_base": 1,
        "transfer_workers": 2,
        "bootstrap_timeout": 10.0,
        "failed_session_ttl": 10.0,
    }
    values.update(changes)
    return PrefillConfig(**values)


def decode_config(contract: CacheContract, **changes: Any) -> DecodeConfig:
    """A Decode rank's configuration for the victims (TP 1)."""
    values: dict[str, Any] = {
        "tp_size": 1,
        "tp_rank": 0,
        "contract": contract,
        "arena_base": 1,
        "session_id": "",
        "endpoint": "127.0.0.1",
        "port": 1,
        "waiting_timeout": 30.0,
    }
    values.update(changes)
    return DecodeConfig(**values)


@asynccontextmanager
async def _mooncake() -> AsyncIterator[Any]:
    """A Mooncake engine behind an EngineRunner, built and closed in worker threads."""
    from tspd.shell.engine_setup import open_mooncake_engine
    from tspd.shell.offload import EngineRunner

    async with open_mooncake_engine("127.0.0.1") as engine:
        yield EngineRunner(engine)


@asynccontextmanager
async def mooncake_prefill(
    contract: CacheContract,
    *,
    bootstrap: str | None,
    settings: Mapping[str, Any] | None = None,
    **config: Any,
) -> AsyncIterator[PrefillPeer]:
    """One Prefill rank on Mooncake, registered with ``bootstrap`` (when given)."""
    async with _mooncake() as engine:
        with HostArena.for_contract(contract) as arena:
            async with open_prefill_peer(
                prefill_config(contract, **config),
                engine,
                arena,
                settings=PrefillSettings(bootstrap_addr=bootstrap, **(settings or {})),
            ) as peer:
                yield peer


@asynccontextmanager
async def mooncake_decode(
    contract: CacheContract, *, settings: Mapping[str, Any] | None = None, **config: Any
) -> AsyncIterator[DecodePeer]:
    """One Decode rank on Mooncake."""
    async with _mooncake() as engine:
        with HostArena.for_contract(contract) as arena:
            async with open_decode_peer(
                decode_config(contract, **config),
                engine,
                arena,
                settings=DecodeSettings(**(settings or {})),
            ) as peer:
                yield peer


# ------------------------------------------------------------------- child processes


def _emit(obj: Mapping[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def _commands() -> AsyncIterator[dict[str, Any]]:
    """JSON commands from standard input, one a line, until it closes."""
    stream = trio.lowlevel.FdStream(os.dup(0))
    buffer = b""
    async with stream:
        while True:
            chunk = await stream.receive_some(65536)
            if not chunk:
                return
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                if line.strip():
                    yield json.loads(line)


#: A victim's command handler: the command in, the answer's fields out (``None``:
#: no answer).
Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any] | None]]


async def _serve_commands(
    tally: LogTally, stats: Callable[[], dict[str, Any]], handlers: Mapping[str, Handler]
) -> None:
    async for command in _commands():
        op = str(command.get("op"))
        if op == "exit":
            return
        if op == "stats":
            _emit(
                {
                    "event": "stats",
                    "stats": stats(),
                    "log": tally.snapshot(),
                    "process": process_figures(),
                }
            )
            continue
        handler = handlers.get(op)
        if handler is None:
            _emit({"event": "error", "error": f"unknown command {command!r}"})
            continue
        answer = await handler(command)
        if answer is not None:
            _emit({"event": op, **answer})


async def _run_victim(role: str, options: dict[str, Any]) -> None:
    tally = LogTally()
    with tally.attached(logging.INFO):
        if role == "bootstrap":
            await _bootstrap_victim(tally, options)
        elif role == "prefill":
            await _prefill_victim(tally, options)
        elif role == "decode":
            await _decode_victim(tally, options)
        elif role == "events":
            await _events_victim(tally, options)
        else:
            raise SystemExit(f"unknown victim role {role!r}")


async def _bootstrap_victim(tally: LogTally, options: dict[str, Any]) -> None:
    from tspd.shell.bootstrap import open_bootstrap_server
    from tspd.shell.http import HttpLimits

    limits = HttpLimits(**options.get("limits", {}))
    async with open_bootstrap_server("127.0.0.1", 0, limits=limits) as server:
        _emit({"event": "ready", "address": server.address, "pid": os.getpid()})

        def stats() -> dict[str, Any]:
            return {"refused": server.statistics()}

        await _serve_commands(tally, stats, {})


def _prefill_stats(peer: PrefillPeer) -> dict[str, Any]:
    stats: dict[str, Any] = dict(peer.statistics())
    pool = peer._pushes.stats  # the push pool's own counters (sockets open now, opened...)
    stats.update(
        push_sockets=pool.sockets,
        push_opened=pool.opened,
        push_closed=pool.closed,
        push_failed=pool.failed,
        push_evicted_busy=pool.evicted_busy,
    )
    return stats


@final
class _DecodeSessions:
    """Decode sessions that come and go inside the Prefill victim, on its fake fabric
    (``tspd bench churn``): each a new :class:`FakeEngine` (a new session id) with
    the one Decode arena registered; pages are handed out per room and checked when
    the session is dropped."""

    def __init__(self, fabric: Any, work: Workload, contract: CacheContract) -> None:
        self._fabric = fabric
        self._work = work
        self._contract = contract
        self.arena = HostArena.for_contract(contract)
        self._pages = PageAllocator(contract)
        self._open: dict[int, tuple[Any, dict[str, list[int]], BlockManifest]] = {}

    def open(self, room: int) -> dict[str, Any]:
        from tspd.engines.memory import FakeEngine

        engine = FakeEngine("127.0.0.1", fabric=self._fabric)
        engine.register_memory(self.arena.base, self.arena.size)
        prompt = self._work.prompt_len(room, self._contract)
        tables = self._pages.allocate(prompt)
        manifest = build_manifest(self._contract, tables, 0, prompt)
        clear_room(self.arena, self._contract, manifest)
        self._open[room] = (engine, tables, manifest)
        return {
            "session": engine.session_id,
            "arena": self.arena.base,
            "manifest": manifest.to_json().decode("ascii"),
        }

    def drop(self, room: int) -> dict[str, Any]:
        engine, tables, manifest = self._open.pop(room)
        mismatches = verify_room(
            self.arena, self._contract, manifest, seed=self._work.seed, room=room
        )
        self._pages.release(tables)
        engine.close()
        return {"verified": not mismatches, "mismatches": len(mismatches)}

    def close(self) -> None:
        for engine, _, _ in self._open.values():
            engine.close()
        self._open.clear()
        self.arena.close()


@asynccontextmanager
async def _fake_prefill(
    contract: CacheContract, fabric: Any, *, settings: Mapping[str, Any] | None, **config: Any
) -> AsyncIterator[PrefillPeer]:
    from tspd.engines.memory import AsyncFakeEngine

    engine = AsyncFakeEngine("127.0.0.1", fabric=fabric)
    try:
        with HostArena.for_contract(contract) as arena:
            async with open_prefill_peer(
                prefill_config(contract, **config),
                engine,
                arena,
                settings=PrefillSettings(**(settings or {})),
            ) as peer:
                yield peer
    finally:
        engine.close()


async def _prefill_victim(tally: LogTally, options: dict[str, Any]) -> None:
    work = workload()
    contract = work.contract(1)
    config: dict[str, Any] = dict(options.get("config", {}))
    fabric = None
    if options.get("engine") == "fake":
        from tspd.engines.memory import FakeFabric

        fabric = FakeFabric()
        opened = _fake_prefill(contract, fabric, settings=options.get("settings"), **config)
    else:
        opened = mooncake_prefill(
            contract, bootstrap=options.get("bootstrap"), settings=options.get("settings"), **config
        )
    sessions = _DecodeSessions(fabric, work, contract) if fabric is not None else None
    try:
        async with opened as peer, trio.open_nursery() as nursery:
            rooms = PrefillRooms(peer, work)
            nursery.start_soon(rooms.run)
            _emit(
                {
                    "event": "ready",
                    "control_port": peer.control_port,
                    "session": peer.session_id,
                    "registered": peer.registered_with_bootstrap,
                    "contract": contract.to_json().decode("ascii"),
                    "pid": os.getpid(),
                }
            )

            async def serve(command: dict[str, Any]) -> dict[str, Any]:
                batch = list(range(int(command["start"]), int(command["stop"])))
                rooms.expect(batch)
                return (await rooms.collect(batch)).as_dict()

            async def expect(command: dict[str, Any]) -> None:
                rooms.expect(int(r) for r in command["rooms"])

            async def session(command: dict[str, Any]) -> dict[str, Any]:
                assert sessions is not None
                room = int(command["room"])
                rooms.expect([room])
                return sessions.open(room)

            async def drop(command: dict[str, Any]) -> dict[str, Any]:
                assert sessions is not None
                room = int(command["room"])
                answer = sessions.drop(room)
                # The Prefill side's own outcome of the room (it may still be
                # settling when the Decode has its status).
                outcome = await rooms.collect([room], limit=5.0)
                answer["prefill_ok"] = outcome.ok == 1
                answer["reasons"] = outcome.reasons
                return answer

            def stats() -> dict[str, Any]:
                out = _prefill_stats(peer)
                out.update(served=rooms.served, failed=rooms.failed)
                return out

            handlers: dict[str, Handler] = {"rooms": serve, "expect": expect}
            if sessions is not None:
                handlers.update(session=session, drop=drop)
            await _serve_commands(tally, stats, handlers)
            nursery.cancel_scope.cancel()
    finally:
        if sessions is not None:
            sessions.close()


async def _decode_victim(tally: LogTally, options: dict[str, Any]) -> None:
    work = workload()
    contract = work.contract(1)
    bootstrap = str(options["bootstrap"])
    async with mooncake_decode(contract, settings=options.get("settings")) as peer:
        _emit(
            {
                "event": "ready",
                "status_port": peer.status_port,
                "session": peer.session_id,
                "pid": os.getpid(),
            }
        )

        async def serve(command: dict[str, Any]) -> dict[str, Any]:
            batch = list(range(int(command["start"]), int(command["stop"])))
            return (await decode_rooms(peer, work, batch, bootstrap)).as_dict()

        def stats() -> dict[str, Any]:
            return dict(peer.statistics())

        await _serve_commands(tally, stats, {"rooms": serve})


async def _events_victim(tally: LogTally, options: dict[str, Any]) -> None:
    from tspd.core.kv_config import KVEventsConfig
    from tspd.core.kv_synth import SyntheticCache
    from tspd.shell.kv_publisher import open_kv_publisher
    from tspd.shell.kv_subscriber import EventSource, ReceivedBatch, open_kv_subscriber
    from tspd.shell.ports import free_port

    live = f"tcp://127.0.0.1:{free_port()}"
    replay = f"tcp://127.0.0.1:{free_port()}"
    prefill_batches = int(options.get("batches", 256))
    every = float(options.get("every", 0.5))
    seen: Counter[str] = Counter()
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=live,
        replay_endpoint=replay,
        buffer_steps=int(options.get("buffer_steps", 10_000)),
    )
    source = EventSource(live, replay, name="engine", bind=True)
    async with (
        open_kv_subscriber([source], catch_up=True) as subscriber,
        open_kv_publisher(config) as publisher,
        trio.open_nursery() as nursery,
    ):
        cache = SyntheticCache(seed=SEED)

        async def publish() -> None:
            for _ in range(prefill_batches):
                await publisher.apublish(cache.batch(4))
            while True:
                await trio.sleep(every)
                await publisher.apublish(cache.batch(4))

        async def consume() -> None:
            async for item in subscriber:
                seen[type(item).__name__] += 1
                if isinstance(item, ReceivedBatch):
                    seen["events"] += len(item.batch.events)

        nursery.start_soon(publish)
        nursery.start_soon(consume)
        _emit(
            {
                "event": "ready",
                "live": live,
                "replay": replay,
                "pid": os.getpid(),
            }
        )

        def stats() -> dict[str, Any]:
            tracker = subscriber.statistics()["engine"]
            return {
                "publisher": _asdict(publisher.statistics()),
                "subscriber": _asdict(tracker),
                "items": dict(seen),
            }

        await _serve_commands(tally, stats, {})
        nursery.cancel_scope.cancel()


def _asdict(obj: Any) -> dict[str, Any]:
    names: Iterable[str] = getattr(obj, "__dataclass_fields__", ())
    return {name: getattr(obj, name) for name in names}


def victim(role: str, options: str = "{}") -> None:
    """Child-process entry point: run one victim until told to exit (see the module
    doc). ``options`` is JSON."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    trio.run(_run_victim, role, json.loads(options))


# --------------------------------------------------------------------- parent handles


_CHILD = "import sys; from tspd.bench.victims import victim; victim(sys.argv[1], sys.argv[2])"


@final
class Victim:
    """A victim in a child process: start it, talk to it, watch it (see the module
    doc). Not thread-safe; :meth:`close` kills it if it does not exit."""

    def __init__(self, role: str, log_path: str, **options: Any) -> None:
        self.role = role
        self._log = open(log_path, "wb")  # noqa: SIM115 - the child's stderr for its life
        env = dict(os.environ)
        env.setdefault("MC_LOG_LEVEL", "ERROR")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, role, json.dumps(options)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            text=True,
        )
        self.log_path = log_path
        self.ready = self._read("ready")
        self.pid = self.proc.pid

    def _read(self, event: str) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(
                    f"the {self.role} victim exited (code {self.proc.poll()}) before "
                    f"reporting {event!r}:\n{self.log_tail()}"
                )
            record: dict[str, Any] = json.loads(line)
            if record.get("event") == event:
                return record
            if record.get("event") == "error":
                raise RuntimeError(f"the {self.role} victim: {record['error']}")

    def send(self, **command: Any) -> None:
        """Send one command without waiting for an answer."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def call(self, event: str, **command: Any) -> dict[str, Any]:
        """Send a command and wait for its answer (an ``event`` line)."""
        self.send(**command)
        return self._read(event)

    def stats(self) -> dict[str, Any]:
        """The victim's own statistics, log tally and process figures."""
        return self.call("stats", op="stats")

    @property
    def alive(self) -> bool:
        """Whether the process is still running."""
        return self.proc.poll() is None

    def figures(self) -> dict[str, float]:
        """RSS, descriptors, sockets, threads and CPU seconds, read from ``/proc``."""
        return process_figures(self.pid)

    def log_tail(self, lines: int = 20) -> str:
        """The end of the child's standard error."""
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def request_exit(self) -> None:
        """Ask it to exit (without waiting): ``exit``, then end of input."""
        with contextlib.suppress(OSError, ValueError):
            if self.alive:
                self.send(op="exit")
            assert self.proc.stdin is not None
            self.proc.stdin.close()

    def close(self, timeout: float = 10.0) -> int | None:
        """Ask it to exit; kill it after ``timeout`` seconds. Returns the exit code."""
        self.request_exit()
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()
        return code


def close_all(victims: Iterable[Victim]) -> None:
    """Close several victims, asking them all to exit first (they stop in parallel)."""
    victims = list(victims)
    for v in victims:
        v.request_exit()
    for v in victims:
        v.close()


def wait_idle(pids: Sequence[int], *, quiet: float = 0.2, limit: float = 120.0) -> float:
    """Wait until every process in ``pids`` used less than 2 % of a core for ``quiet``
    seconds (at most ``limit``); returns when that quiet spell began
    (``time.monotonic``)."""
    deadline = time.monotonic() + limit
    while True:
        start = time.monotonic()
        before = [_cpu_of(pid) for pid in pids]
        time.sleep(quiet)
        used = [_cpu_of(pid) - b for pid, b in zip(pids, before, strict=True)]
        if all(u < 0.02 * quiet + 1 / os.sysconf("SC_CLK_TCK") for u in used):
            return start
        if time.monotonic() > deadline:
            return time.monotonic()
