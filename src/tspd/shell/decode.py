"""The Decode rank's peer on Trio: status socket, bootstrap lookups, heartbeats, polls.

:func:`open_decode_peer` runs one Decode rank's PD transfer peer for the
duration of an ``async with`` block. The sans-IO
:class:`tspd.core.decode.DecodeCore` makes every protocol decision; the peer's
nursery owns:

* the **status task** — the only owner of the PULL status socket (bound on the
  configured host before the core exists, so its port goes into every
  registration; frames and frame counts bounded by the largest status message); it
  drains status messages in batches into ``core.receive_status``;
* the **push pool** — a bounded pool of PUSH sockets, one per Prefill rank, for
  registrations and pre-allocations (docs/protocol.md#proto-zmq);
* **bootstrap lookups** — one short task per ``FetchParallelInfo`` /
  ``FetchRankInfo`` command over HTTP (:class:`~tspd.shell.bootstrap.BootstrapClient`),
  answered with ``core.parallel_info`` / ``core.rank_info`` (an error becomes the
  error text: the waiting rooms fail with the spec's reason,
  docs/protocol.md#proto-decode-room-table);
* the **heartbeat task** — every interval, ``GET /health`` on each Prefill
  bootstrap address the core names, concurrently, reported to ``core.heartbeat``
  (docs/protocol.md#proto-failure-prefill-death);
* the **timer task** — the waiting timeout.

In secure mode (``DecodeSettings.security`` with CURVE keys, docs/security.md) the
status socket is a CURVE server behind the ZAP handler's allow-list (its server key is
this process's public key, which every Prefill rank learns as the identity of the
registration it receives), each status reaches the core with its sender's identity,
and registrations and pre-allocations go out as CURVE clients of the key each
Prefill rank's bootstrap route carries. A rank whose route has no key (a plain
Prefill), or a key not on the allow-list, fails its rooms with an explicit reason; a
plain Decode refuses a rank whose route carries a key the same way.

What the Decode peer shares with the Prefill peer — the pump after every core call,
the poll, the receive task, the queries — is :class:`~tspd.shell.peer.RankPeer`'s;
:meth:`DecodePeer._execute` matches every :data:`~tspd.core.commands.DecodeCommand`
exhaustively.

Nothing a peer sends and no route that cannot be planned raises into the caller:
the room fails with a reason, and the scheduler sees a ``Failed`` event. The
arena is registered with the engine so Prefill ranks can write into it, and
deregistered on exit, through :mod:`tspd.shell.engine_setup` (in a worker thread for
an engine whose setup blocks, inline for the in-process engines).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, assert_never, final

import trio
import zmq

from tspd.core.bootstrap import RankInfo
from tspd.core.commands import (
    DecodeCommand,
    FetchParallelInfo,
    FetchRankInfo,
    Log,
    Rejected,
    RoomFailed,
    ScatterStaged,
    SendFrames,
)
from tspd.core.config import parse_pd_env
from tspd.core.decode import DecodeConfig, DecodeCore
from tspd.core.errors import TspdError, WireError
from tspd.core.manifest import BlockManifest
from tspd.core.staging import check_within, read_blob_table, scatter_blob
from tspd.core.trace import Side
from tspd.core.wire import MAX_STATUS_FRAME_BYTES
from tspd.engines.base import AsyncTransferEngine, TransferEngine
from tspd.log import component_logger
from tspd.shell.agreement import ReplicaAgreement, SingleRank
from tspd.shell.arena import HostArena
from tspd.shell.bootstrap import BootstrapClient
from tspd.shell.engine_setup import register_memory, unregister_on_exit
from tspd.shell.metrics import TspdMetrics
from tspd.shell.observe import PeerObserver
from tspd.shell.peer import RankPeer, Receiver, open_peer_nursery, open_rank_sockets
from tspd.shell.pushes import DEFAULT_IDLE_TTL, DEFAULT_MAX_SOCKETS, PushPool
from tspd.shell.security import CurveGuard, SecurityConfig

__all__ = ["DecodePeer", "DecodeSettings", "open_decode_peer"]

log = component_logger("decode")


@dataclass(frozen=True, slots=True)
class DecodeSettings:
    """What a Decode rank's peer needs besides its core's configuration.

    ``host``: where the status socket binds and what registrations advertise.
    ``heartbeat_interval``: seconds between heartbeat rounds
    (``TOKENSPEED_DISAGGREGATION_HEARTBEAT_INTERVAL``, 5.0 by default).
    ``status_batch`` caps how many status messages one drain takes.
    ``push_sockets``/``push_idle_ttl``: the push pool's bound and idle TTL
    (:class:`~tspd.shell.pushes.PushPool`). ``security``: secure mode (CURVE keys
    for the sockets, TLS and token for the bootstrap client; docs/security.md);
    ``None`` is plain mode.
    """

    host: str = "127.0.0.1"
    heartbeat_interval: float = 5.0
    status_batch: int = 256
    push_sockets: int = DEFAULT_MAX_SOCKETS
    push_idle_ttl: float = DEFAULT_IDLE_TTL
    security: SecurityConfig | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str], **fields: Any) -> DecodeSettings:
        """Settings whose heartbeat interval defaults to
        ``TOKENSPEED_DISAGGREGATION_HEARTBEAT_INTERVAL`` in ``environ`` (pass
        ``os.environ``); explicit ``fields`` win. Raises ``ConfigError`` naming the
        variable for an invalid value."""
        values: dict[str, Any] = {
            "heartbeat_interval": parse_pd_env(environ, prefill=False).heartbeat_interval
        }
        values.update(fields)
        return cls(**values)


@final
class DecodePeer(RankPeer[DecodeCommand]):
    """One Decode rank's running peer; get one from :func:`open_decode_peer`.

    Every method runs in the peer's Trio thread.
    """

    core: DecodeCore
    _side = Side.DECODE

    def __init__(
        self,
        core: DecodeCore,
        *,
        engine: AsyncTransferEngine | TransferEngine,
        arena: HostArena,
        agreement: ReplicaAgreement,
        pushes: PushPool,
        client: BootstrapClient,
        status_port: int,
        observer: PeerObserver | None = None,
        curve: CurveGuard | None = None,
        server_keys: dict[tuple[str, int], str] | None = None,
        staging: HostArena | None = None,
    ) -> None:
        super().__init__(core, observer, agreement=agreement, pushes=pushes, curve=curve)
        #: Secure mode: the CURVE server key of each Prefill control endpoint (the
        #: push pool reads it when it opens a socket).
        self._server_keys = server_keys if server_keys is not None else {}
        self.engine = engine
        self.arena = arena
        #: The staging region staged blobs land in (docs/wire.md#staged-transfers).
        self.staging = staging
        self.status_port = status_port
        self._client = client
        self._nursery: trio.Nursery | None = None
        self.heartbeats = 0

    @property
    def session_id(self) -> str:
        """This rank's transfer-engine session id."""
        return self.core.config.session_id

    # -- command execution -------------------------------------------------------

    def _execute(self, command: DecodeCommand) -> None:
        match command:
            case SendFrames():
                self._pushes.send_nowait(
                    command.endpoint, command.port, command.frames, command.room
                )
            case FetchParallelInfo():
                self._spawn(self._fetch_parallel_info, command)
            case FetchRankInfo():
                self._spawn(self._fetch_rank_info, command)
            case ScatterStaged():
                self._spawn(self._scatter, command)
            case RoomFailed() | Log() | Rejected():
                self._observed(command)
            case _:
                assert_never(command)

    def _spawn(
        self, fn: object, command: FetchParallelInfo | FetchRankInfo | ScatterStaged
    ) -> None:
        if self._nursery is None:
            log.error("Decode peer is not running; dropped %r", command)
            return
        self._nursery.start_soon(fn, command)  # type: ignore[arg-type]

    async def _fetch_parallel_info(self, command: FetchParallelInfo) -> None:
        addr = command.bootstrap_addr
        try:
            info = await self._client.get_parallel_info(addr)
        except TspdError as err:
            self.core.parallel_info(addr, str(err), trio.current_time())
        else:
            self.core.parallel_info(addr, info, trio.current_time())
        self._pump(activity=True)

    async def _fetch_rank_info(self, command: FetchRankInfo) -> None:
        addr, rank, dp = command.bootstrap_addr, command.engine_rank, command.dp_group
        try:
            info = await self._client.get_rank_info(addr, rank, dp)
        except TspdError as err:
            self.core.rank_info(addr, dp, rank, str(err), trio.current_time())
        else:
            refused = self._check_mode(addr, rank, dp, info)
            self.core.rank_info(addr, dp, rank, refused or info, trio.current_time())
        self._pump(activity=True)

    async def _scatter(self, command: ScatterStaged) -> None:
        """Check a staged blob and copy it into the room's pages in a worker thread
        (a large room's blob is tens of MiB), then tell the core."""
        error: str | None = None
        try:
            await trio.to_thread.run_sync(self._scatter_blob, command)
        except (WireError, ValueError) as err:
            error = str(err)
        self.core.staged_done(command.room, command.prefill_rank, error, trio.current_time())
        self._pump(activity=True)

    def _scatter_blob(self, command: ScatterStaged) -> None:
        if self.staging is None:
            raise ValueError("this Decode rank has no staging region (a bug: please report it)")
        blob = self.staging.view(command.slot_offset, command.slot_length)
        dst, lengths = read_blob_table(blob, command.staged_bytes, command.slot_length)
        check_within(dst, lengths, command.starts, command.ends)
        scatter_blob(blob, dst, lengths, self.arena.array)

    def server_key(self, endpoint: str, port: int) -> str | None:
        """Secure mode: the CURVE server key of the Prefill control socket at
        ``endpoint:port`` (from its bootstrap route), or ``None``."""
        return self._server_keys.get((endpoint, port))

    def _check_mode(self, addr: str, rank: int, dp: int, info: RankInfo) -> str | None:
        """Why this rank must not use ``info`` (a plain rank in secure mode, a secure
        one in plain mode, a key off the allow-list), or ``None``; a usable key is
        kept for the push pool."""
        where = f"Prefill rank {rank} (DP group {dp}) of {addr} at {info.rank_ip}:{info.rank_port}"
        if self.curve is None:
            if info.curve_key is None:
                return None
            return (
                f"{where} runs tspd secure mode (its bootstrap route carries a CURVE key) and "
                "this Decode runs plain mode: a plain peer cannot reach it; configure "
                "TSPD_CURVE_SECRET_KEY_FILE and TSPD_CURVE_ALLOW_DIR (docs/security.md)"
            )
        if info.curve_key is None:
            return (
                f"{where} runs plain mode (its bootstrap route has no CURVE key) and this "
                "Decode runs tspd secure mode, which refuses plain peers (docs/security.md)"
            )
        if info.curve_key not in self.curve.keys.allowed:
            return (
                f"{where} presents CURVE key {info.curve_key}, which is not in this Decode's "
                f"allow-list {self.curve.keys.allow_dir}: refused (docs/security.md)"
            )
        route = (info.rank_ip, info.rank_port)
        if self._server_keys.get(route, info.curve_key) != info.curve_key:
            self._pushes.release(*route)  # the rank's key changed: reconnect with the new one
        self._server_keys[route] = info.curve_key
        return None

    # -- scheduler-side API -------------------------------------------------------

    def register_request(self, rid: str, room: int, bootstrap_addr: str) -> None:
        """Track request ``rid`` for ``room`` at the Prefill instance whose bootstrap
        server is ``bootstrap_addr`` (``host:port``); routing starts at once."""
        self.core.register_request(rid, room, bootstrap_addr, trio.current_time())
        self._pump(due=self.core.event_pending(rid))

    def send_preallocation(
        self,
        room: int,
        manifest: BlockManifest | Mapping[str, Sequence[int]],
        *,
        prefix_len: int = 0,
        prompt_len: int | None = None,
    ) -> None:
        """Pre-allocate ``room`` with its Prefill ranks once its pages are allocated
        and zeroed: a manifest, or block tables with the window (``prompt_len``). An
        invalid manifest fails the room with the reason."""
        try:
            self.core.send_preallocation(
                room, manifest, trio.current_time(), prefix_len=prefix_len, prompt_len=prompt_len
            )
        finally:
            self._pump(due=self.core.event_pending(self.core.rid_of(room)))

    def statistics(self) -> dict[str, int]:
        """The core's table sizes plus message counters."""
        stats = dict(self.core.statistics())
        stats["messages_sent"] = self._pushes.stats.sent
        stats["messages_dropped"] = self._pushes.stats.dropped
        stats["heartbeats"] = self.heartbeats
        return stats

    # -- tasks -------------------------------------------------------------------

    _received = "a Prefill status message"

    def _receiver(self) -> Receiver:
        return self.core.receive_status

    async def _heartbeat(
        self, interval: float, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        task_status.started()
        while True:
            await trio.sleep(interval)
            addrs = self.core.bootstrap_addrs()
            if not addrs:
                continue
            results: dict[str, bool] = {}
            async with trio.open_nursery() as nursery:
                for addr in addrs:
                    nursery.start_soon(self._beat, addr, results)
            now = trio.current_time()
            for addr in addrs:
                self.core.heartbeat(addr, results.get(addr, False), now)
            self.heartbeats += 1
            self._pump(activity=True)

    async def _beat(self, addr: str, results: dict[str, bool]) -> None:
        results[addr] = await self._client.health(addr)


@asynccontextmanager
async def open_decode_peer(
    config: DecodeConfig,
    engine: AsyncTransferEngine | TransferEngine,
    arena: HostArena,
    *,
    settings: DecodeSettings | None = None,
    agreement: ReplicaAgreement | None = None,
    context: zmq.Context[zmq.Socket[bytes]] | None = None,
    metrics: TspdMetrics | None = None,
) -> AsyncIterator[DecodePeer]:
    """Run one Decode rank's peer for the duration of the block (see the module doc).

    ``config`` is the core's configuration; its ``arena_base``, ``session_id``,
    ``endpoint`` and ``port`` are taken from ``arena``, ``engine`` and the status
    socket this function binds on ``settings.host``. Decode never writes, so a
    synchronous engine is fine here: only its registration calls are used.
    ``metrics``: where this rank's metrics go (serve them with
    :func:`tspd.shell.metrics.serve_metrics`); logs and traces are kept either way.
    """
    settings = settings or DecodeSettings()
    ctx = context or zmq.Context.instance()
    server_keys: dict[tuple[str, int], str] = {}
    curve, pushes, status, port = open_rank_sockets(
        ctx,
        settings,
        f"Decode rank {config.tp_rank}",
        server_key=lambda e, p: server_keys.get((e, p)),
        socket_name="Decode status socket",
        max_frame_bytes=MAX_STATUS_FRAME_BYTES,
    )
    # Staged transfers (docs/wire.md#staged-transfers): a staging region of its own,
    # registered with the engine beside the arena.
    region = HostArena(config.staging_bytes) if config.staging_bytes > 0 else None
    arena_registered = False
    try:
        core = DecodeCore(
            dataclasses.replace(
                config,
                arena_base=arena.base,
                session_id=engine.session_id,
                endpoint=settings.host,
                port=port,
                staging_base=region.base if region is not None else 0,
            )
        )
        await register_memory(engine, arena.base, arena.size)
        arena_registered = True
        if region is not None:
            # Its pages are backed before the first blob lands (no faults then).
            await trio.to_thread.run_sync(region.prefault)
            await register_memory(engine, region.base, region.size)
    except BaseException:
        status.close()
        if curve is not None:
            curve.close()
        if arena_registered:
            await unregister_on_exit(engine, arena.base, what="the Decode arena", logger=log)
        if region is not None:
            region.close()
        raise
    try:
        async with open_peer_nursery(settings.security) as (client, nursery):
            peer = DecodePeer(
                core,
                engine=engine,
                arena=arena,
                agreement=agreement or SingleRank(),
                pushes=pushes,
                client=client,
                status_port=port,
                observer=PeerObserver(
                    "decode", config.tp_rank, metrics=metrics, slow_after=config.trace.slow_after
                ),
                curve=curve,
                server_keys=server_keys,
                staging=region,
            )
            peer.observer.watch(core, peer.statistics)
            peer._nursery = nursery
            await peer._start_tasks(nursery)
            await nursery.start(peer._receive, status, settings.status_batch)
            await nursery.start(peer._heartbeat, settings.heartbeat_interval)
            try:
                yield peer
            finally:
                peer._nursery = None
                peer.observer.close()
    finally:
        status.close()
        if curve is not None:
            curve.close()
        await unregister_on_exit(engine, arena.base, what="the Decode arena", logger=log)
        if region is not None:
            await unregister_on_exit(
                engine, region.base, what="the Decode staging region", logger=log
            )
            region.close()
