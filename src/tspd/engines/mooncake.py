"""The Mooncake transfer engine behind :class:`tspd.engines.base.TransferEngine`.

It makes the calls docs/protocol.md#proto-transfer-engine lists.

Mooncake is imported only when a :class:`MooncakeEngine` is built, so the rest of
tspd works on hosts without it; a missing package or system library becomes an
:class:`EngineUnavailable` that says what to install.

Every method here blocks the calling thread, and the write calls busy-spin a core
until the transfer completes or fails (bounded by ``MC_TRANSFER_TIMEOUT``, default
30 s, at least 5 s). Never call them on a Trio thread: writes go through
:class:`tspd.shell.offload.EngineRunner`, and the setup calls —
building the engine (``initialize`` opens its listener and, on RDMA, its devices),
:meth:`~MooncakeEngine.register_memory` and :meth:`~MooncakeEngine.unregister_memory`
(registering pins the memory: seconds for gigabytes on RDMA) and
:meth:`~MooncakeEngine.close` — through :mod:`tspd.shell.engine_setup`
(:func:`~tspd.shell.engine_setup.open_mooncake_engine` builds and closes one in a
worker thread), as ``blocking_setup = True`` asks.

Batching: Mooncake's TCP transport queues at most 1,024 transfers per peer
(``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``) and holds up to 1,024 more waiting for
room (``MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER``, each for at most
``MC_TCP_ADMISSION_TIMEOUT_MS``, 1 s); beyond those 2,048 a transfer fails at once.
TokenSpeed's 4,096-descriptor calls therefore fail every room over 2,048 pages.
tspd keeps at most :attr:`MooncakeEngine.max_in_flight_descriptors` (the queue,
1,024 by default) in flight to a peer from one write, so nothing waits for
admission.

Pipelined batches (:class:`tspd.engines.base.PipelinedEngine`):
:meth:`MooncakeEngine.submit_batch` starts a batch with one
``batch_transfer_async_write`` for all descriptors but the last, and the last with
``transfer_submit_write`` — the batch's *sentinel*. Mooncake serves a peer's
transfers from one queue in order, so once the sentinel is done the rest are done
or finishing on the other connection lanes. :meth:`MooncakeEngine.wait_batch`
polls the sentinel with short sleeps, then collects the batch with
``get_batch_transfer_status`` (which busy-spins, but by then only for the last
lanes' transfers). The sync calls busy-spin a core for the whole write instead:
on a 2-core host that core is taken from Mooncake's own I/O threads and the peer
(measured there, medians of interleaved runs: a 64 MiB write 50 ms through
``batch_transfer_sync_write`` against 28 ms waited this way; 16,384 × 4 KiB
descriptors 1.33 s in sync calls of 1,024 against 0.69 s with two batches of 512
in flight). :meth:`MooncakeEngine.batch_write` is built
on the same pair: batches of at most ``max_descriptors`` (default
:data:`DEFAULT_MAX_DESCRIPTORS`) and half the in-flight bound, two in flight, so a
batch of any size succeeds on Mooncake's default settings. Neither path retries a
failed batch (the sync calls retry once per RDMA device); the write fails and tspd
reports it.

Non-blocking writes (:class:`tspd.engines.base.PollingEngine`):
:meth:`MooncakeEngine.submit_write` is Mooncake's ``transfer_submit_write`` (one
descriptor per call: ``transfer_check_status`` looks at the first task of a batch
only) and :meth:`MooncakeEngine.check_write` its ``transfer_check_status``. The
sync calls time a write out themselves after ``MC_TRANSFER_TIMEOUT`` plus 1 ns per
byte; the status check does not, so :meth:`check_write` applies the same bound,
and so does the sentinel poll of :meth:`~MooncakeEngine.wait_batch`
(``get_batch_transfer_status`` has that bound built in).
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, cast, final

from tspd.engines.base import (
    AddressList,
    BatchTicket,
    EngineUnavailable,
    TransferError,
    WriteTicket,
    as_address_list,
)

__all__ = [
    "DEFAULT_MAX_DESCRIPTORS",
    "DEFAULT_QUEUED_TRANSFERS_PER_PEER",
    "INIT_FAILED",
    "MooncakeEngine",
    "load_mooncake",
    "queued_transfers_per_peer",
    "transfer_timeout",
]

logger = logging.getLogger("tspd.engines.mooncake")

DEFAULT_MAX_DESCRIPTORS: Final = 1024
"""Descriptors per Mooncake call: half of the 2,048 transfers TCP takes per peer
(queued and waiting for admission together)."""

DEFAULT_QUEUED_TRANSFERS_PER_PEER: Final = 1024
"""Mooncake's default ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``."""

INIT_FAILED: Final = "Mooncake Transfer Engine initialization failed."
"""The message for a non-zero ``initialize`` (docs/protocol.md#proto-transfer-engine)."""

_BATCH_MISSING: Final = (
    "Mooncake's batch transfer requires mooncake-transfer-engine >= 0.3.4.post2. "
    "Upgrade the installed Mooncake wheel (pip install -U 'tspd[mooncake-cpu]' or "
    "'tspd[mooncake-gpu]')."
)

_INSTALL_HINT: Final = (
    "Install one Mooncake wheel, never both: CPU/TCP hosts "
    "`pip install 'tspd[mooncake-cpu]'` (mooncake-transfer-engine-non-cuda) plus "
    "`apt-get install -y --no-install-recommends libibverbs1`; GPU/RDMA hosts "
    "`pip install 'tspd[mooncake-gpu]'` (mooncake-transfer-engine)."
)


_NO_BATCH: Final = frozenset({0, -1, (1 << 64) - 1})
"""What ``transfer_submit_write`` returns when it could not start a write (the
binding's ``-1`` is an unsigned batch id; some builds return 0)."""

_CHECK_DONE: Final = 1
_CHECK_PENDING: Final = 0

#: The sentinel poll of :meth:`MooncakeEngine.wait_batch`: the first check after
#: this, then twice the interval each time up to the cap (a thread's sleep is
#: precise to ~0.1 ms; a check is ~1 µs of work).
_SENTINEL_FIRST_POLL_S: Final = 0.00005
_SENTINEL_MAX_POLL_S: Final = 0.0005

_DOWN_HINT: Final = (
    "the peer may be down, unreachable or hung (MC_TRANSFER_TIMEOUT), or a destination "
    "lies outside its registered memory"
)


@dataclass(frozen=True, slots=True)
class _Batch:
    """What :meth:`MooncakeEngine.submit_batch` started: the batch id of all but the
    last descriptor (0: none), the sentinel's batch id (0: none) and the error that
    refused the sentinel after the rest started, if any."""

    main: int
    sentinel: int
    refused: TransferError | None


def queued_transfers_per_peer(environ: Mapping[str, str] | None = None) -> int:
    """``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` as a positive integer, else Mooncake's
    default :data:`DEFAULT_QUEUED_TRANSFERS_PER_PEER`."""
    env = os.environ if environ is None else environ
    raw = env.get("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "").strip()
    if raw.isdigit() and int(raw) > 0:
        return int(raw)
    return DEFAULT_QUEUED_TRANSFERS_PER_PEER


def transfer_timeout(environ: Mapping[str, str] | None = None) -> float:
    """Mooncake's transfer timeout in seconds: ``MC_TRANSFER_TIMEOUT`` read the way
    the engine reads it (leading digits, at least 5 s), 30 s when unset."""
    env = os.environ if environ is None else environ
    raw = env.get("MC_TRANSFER_TIMEOUT")
    if raw is None:
        return 30.0
    digits = raw.strip()
    sign = -1 if digits.startswith("-") else 1
    digits = digits.lstrip("+-")
    end = 0
    while end < len(digits) and digits[end].isdigit():
        end += 1
    value = sign * int(digits[:end]) if end else 0
    return float(max(5, value))


def load_mooncake() -> type[Any]:
    """Import Mooncake's ``TransferEngine`` class, or raise :class:`EngineUnavailable`
    explaining which package or system library is missing."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as err:
        text = str(err)
        if "libibverbs" in text:
            hint = (
                "Mooncake needs the system library libibverbs.so.1 even for TCP: "
                "`apt-get install -y --no-install-recommends libibverbs1` "
                "(Debian/Ubuntu)."
            )
        elif "libcudart" in text or "libcuda" in text or "libmlx5" in text:
            hint = (
                "this is Mooncake's CUDA wheel on a host without CUDA/RDMA libraries; on a "
                "CPU host uninstall mooncake-transfer-engine and install "
                "mooncake-transfer-engine-non-cuda (`pip install 'tspd[mooncake-cpu]'`)."
            )
        else:
            hint = _INSTALL_HINT
        raise EngineUnavailable(
            f"the Mooncake transfer engine cannot be imported ({text}): {hint}"
        ) from err
    return cast(type[Any], TransferEngine)


@final
class MooncakeEngine:
    """One Mooncake ``TransferEngine``, initialised in P2P-handshake mode.

    ``host`` is the address peers reach this engine at (``127.0.0.1`` for loopback
    tests); the session id is ``"{host}:{rpc_port}"``. ``protocol`` defaults to
    ``"tcp"`` (TokenSpeed hard-codes ``"rdma"``, which falls back to TCP on hosts
    without an HCA); ``device`` names the RDMA devices (``""`` = auto-detect).
    """

    #: Building, registering, unregistering and closing block (see the module
    #: docstring): the shell makes those calls in a worker thread.
    blocking_setup: Final = True

    def __init__(
        self,
        host: str,
        *,
        metadata_server: str = "P2PHANDSHAKE",
        protocol: str = "tcp",
        device: str = "",
        max_descriptors: int = DEFAULT_MAX_DESCRIPTORS,
    ) -> None:
        if max_descriptors < 1:
            raise ValueError(f"max_descriptors must be at least 1, got {max_descriptors}")
        engine_class = load_mooncake()
        engine = engine_class()
        rc = engine.initialize(host, metadata_server, protocol, device)
        if rc != 0:
            err = EngineUnavailable(INIT_FAILED)
            err.add_note(
                f"initialize(host={host!r}, metadata_server={metadata_server!r}, "
                f"protocol={protocol!r}, device={device!r}) returned {rc}; check that the "
                "host is an address of this machine and the metadata server is reachable"
            )
            raise err
        self._engine: Any = engine
        self._max_descriptors = max_descriptors
        self._session_id = f"{host}:{engine.get_rpc_port()}"
        self._regions: set[int] = set()
        self._timeout = transfer_timeout()
        self._queue = queued_transfers_per_peer()
        if not hasattr(engine, "batch_transfer_async_write") or not hasattr(
            engine, "get_batch_transfer_status"
        ):
            raise EngineUnavailable(_BATCH_MISSING)

    @property
    def session_id(self) -> str:
        """``"{host}:{rpc_port}"``, what peers pass to their writes."""
        return self._session_id

    @property
    def max_descriptors(self) -> int:
        """Most descriptors handed to Mooncake in one call."""
        return self._max_descriptors

    @property
    def max_in_flight_descriptors(self) -> int:
        """Descriptors one write keeps in flight to a peer at most: the TCP
        transport's per-peer queue (``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``, read
        when the engine is built)."""
        return self._queue

    def _live(self, peer: str) -> Any:
        if self._engine is None:
            raise TransferError(peer, -1, f"Mooncake engine {self._session_id} is closed")
        return self._engine

    def register_memory(self, addr: int, length: int) -> None:
        """Register ``[addr, addr+length)`` with Mooncake; a non-zero code (``-7``:
        overlaps a registered region) raises :class:`TransferError`."""
        rc = self._live(self._session_id).register_memory(addr, length)
        if rc != 0:
            raise TransferError(
                self._session_id,
                rc,
                f"Mooncake refused to register {length} bytes at {addr:#x}",
            )
        self._regions.add(addr)

    def unregister_memory(self, addr: int) -> None:
        """Withdraw the region at ``addr`` (``-3``: no region there)."""
        rc = self._live(self._session_id).unregister_memory(addr)
        if rc != 0:
            raise TransferError(
                self._session_id, rc, f"Mooncake has no region registered at {addr:#x}"
            )
        self._regions.discard(addr)

    def batch_write(
        self,
        peer_session: str,
        src: AddressList,
        dst: AddressList,
        lengths: AddressList,
    ) -> None:
        """Write every descriptor to ``peer_session`` in batches of at most
        :attr:`max_descriptors` and half of :attr:`max_in_flight_descriptors`, two
        in flight (see the module docstring); returns once all are done. The first
        failing batch stops submission and raises :class:`TransferError` once every
        submitted batch is done (an exception inside Mooncake counts as ``-1``)."""
        self._live(peer_session)
        srcs, dsts, lens = _columns(peer_session, src, dst, lengths)
        total = len(srcs)
        step = max(1, min(self._max_descriptors, self._queue // 2))
        pending: deque[tuple[BatchTicket, int, int]] = deque()
        in_flight = 0
        error: TransferError | None = None
        try:
            for start in range(0, total, step):
                end = min(start + step, total)
                while pending and in_flight + (end - start) > self._queue:
                    ticket, first, last = pending.popleft()
                    in_flight -= last - first
                    error = self._collect(ticket, first, last, total)
                    if error is not None:
                        break
                if error is not None:
                    break
                try:
                    ticket = self._submit(
                        self._live(peer_session),
                        peer_session,
                        srcs[start:end],
                        dsts[start:end],
                        lens[start:end],
                    )
                except TransferError as err:
                    error = _range_error(err, start, end, total)
                    break
                pending.append((ticket, start, end))
                in_flight += end - start
        finally:
            while pending:
                ticket, first, last = pending.popleft()
                late = self._collect(ticket, first, last, total)
                error = error or late
        if error is not None:
            raise error

    def _collect(
        self, ticket: BatchTicket, first: int, last: int, total: int
    ) -> TransferError | None:
        """Wait for one batch of :meth:`batch_write`; its error, named by range."""
        try:
            self.wait_batch(ticket)
        except TransferError as err:
            return _range_error(err, first, last, total)
        return None

    def submit_batch(
        self,
        peer_session: str,
        src: AddressList,
        dst: AddressList,
        lengths: AddressList,
    ) -> BatchTicket:
        """Start the batch without waiting: all descriptors but the last in one
        ``batch_transfer_async_write``, the last (the sentinel) with
        ``transfer_submit_write`` (see the module docstring). A refusal of the first
        call raises :class:`TransferError` with nothing in flight; a refused sentinel
        is raised by :meth:`wait_batch`, once the rest is done. Zero-length
        descriptors are skipped. The first write to a peer blocks while Mooncake
        opens its segment (a handshake)."""
        engine = self._live(peer_session)
        srcs, dsts, lens = _columns(peer_session, src, dst, lengths)
        return self._submit(engine, peer_session, srcs, dsts, lens)

    def _submit(
        self, engine: Any, peer_session: str, srcs: list[int], dsts: list[int], lens: list[int]
    ) -> BatchTicket:
        """:meth:`submit_batch` of validated columns."""
        if 0 in lens:
            kept = [i for i, n in enumerate(lens) if n]
            srcs = [srcs[i] for i in kept]
            dsts = [dsts[i] for i in kept]
            lens = [lens[i] for i in kept]
        count, nbytes = len(lens), sum(lens)
        main = sentinel = 0
        refused: TransferError | None = None
        if count > 1:
            try:
                main = int(
                    engine.batch_transfer_async_write(peer_session, srcs[:-1], dsts[:-1], lens[:-1])
                )
            except Exception as err:  # the binding raises on bad arguments
                raise TransferError(
                    peer_session, -1, f"Mooncake raised {type(err).__name__}: {err}"
                ) from err
            if main in _NO_BATCH:
                raise TransferError(
                    peer_session,
                    -1,
                    f"Mooncake could not start a batch of {count - 1} descriptors; the "
                    "peer may be down or unreachable",
                )
        if count:
            try:
                sentinel = int(
                    engine.transfer_submit_write(peer_session, srcs[-1], dsts[-1], lens[-1])
                )
            except Exception as err:
                refused = TransferError(
                    peer_session, -1, f"Mooncake raised {type(err).__name__}: {err}"
                )
            else:
                if sentinel in _NO_BATCH:
                    sentinel = 0
                    refused = TransferError(
                        peer_session,
                        -1,
                        f"Mooncake could not start a write of {lens[-1]} bytes to "
                        f"{dsts[-1]:#x}; the peer may be down or unreachable",
                    )
            if refused is not None and not main:
                raise refused
        return BatchTicket(
            peer_session, count, nbytes, time.monotonic(), _Batch(main, sentinel, refused)
        )

    def wait_batch(self, ticket: BatchTicket) -> None:
        """Block until the batch is done: poll its sentinel with short sleeps, then
        collect the rest with ``get_batch_transfer_status``. A failure, or a batch in
        flight longer than ``MC_TRANSFER_TIMEOUT`` plus 1 ns per byte, raises
        :class:`TransferError` once nothing of the batch is left to wait for."""
        peer = ticket.peer_session
        batch = ticket.handle
        assert isinstance(batch, _Batch)
        engine = self._live(peer)
        error = batch.refused
        if batch.sentinel:
            error = self._await_sentinel(engine, ticket, batch.sentinel)
        if batch.main:
            try:
                rc = engine.get_batch_transfer_status([batch.main])
            except Exception as err:
                rc = -1
                error = error or TransferError(
                    peer, -1, f"Mooncake raised {type(err).__name__}: {err}"
                )
            if rc != 0:
                error = error or TransferError(
                    peer,
                    int(rc),
                    f"Mooncake batch write of {ticket.descriptors} descriptors failed; "
                    + _DOWN_HINT,
                )
        if error is not None:
            raise error

    def _await_sentinel(
        self, engine: Any, ticket: BatchTicket, sentinel: int
    ) -> TransferError | None:
        """Poll the sentinel with growing sleeps until it is not in flight; its error."""
        peer = ticket.peer_session
        limit = self._timeout + ticket.length * 1e-9
        delay = _SENTINEL_FIRST_POLL_S
        while True:
            try:
                rc = engine.transfer_check_status(sentinel)
            except Exception as err:
                return TransferError(peer, -1, f"Mooncake raised {type(err).__name__}: {err}")
            if rc == _CHECK_DONE:
                return None
            if rc != _CHECK_PENDING:
                what = "timed out" if rc == -2 else "failed"
                return TransferError(
                    peer,
                    int(rc),
                    f"Mooncake batch write of {ticket.descriptors} descriptors {what}; "
                    + _DOWN_HINT,
                )
            elapsed = time.monotonic() - ticket.submitted_at
            if elapsed > limit:
                return TransferError(
                    peer,
                    -2,
                    f"Mooncake batch write of {ticket.descriptors} descriptors still "
                    f"unfinished after {elapsed:.1f}s (MC_TRANSFER_TIMEOUT "
                    f"{self._timeout:g}s); the peer may be hung",
                )
            time.sleep(delay)
            delay = min(delay * 2, _SENTINEL_MAX_POLL_S)

    def submit_write(self, peer_session: str, src: int, dst: int, length: int) -> WriteTicket:
        """Start one write without waiting (``transfer_submit_write``); a refusal
        raises :class:`TransferError` and leaves nothing in flight. The first write
        to a peer blocks while Mooncake opens its segment (a handshake)."""
        engine = self._live(peer_session)
        try:
            batch = engine.transfer_submit_write(peer_session, src, dst, length)
        except Exception as err:  # the binding raises on bad arguments
            raise TransferError(
                peer_session, -1, f"Mooncake raised {type(err).__name__}: {err}"
            ) from err
        if batch in _NO_BATCH:
            raise TransferError(
                peer_session,
                -1,
                f"Mooncake could not start a write of {length} bytes to {dst:#x}; the peer "
                "may be down or unreachable",
            )
        return WriteTicket(peer_session, int(batch), length, time.monotonic())

    def check_write(self, ticket: WriteTicket) -> bool:
        """``transfer_check_status`` of a submitted write: ``True`` done, ``False`` in
        flight; a failure, Mooncake's timeout status, or a write in flight longer than
        ``MC_TRANSFER_TIMEOUT`` plus 1 ns per byte raises :class:`TransferError`."""
        peer = ticket.peer_session
        engine = self._live(peer)
        try:
            rc = engine.transfer_check_status(ticket.token)
        except Exception as err:
            raise TransferError(peer, -1, f"Mooncake raised {type(err).__name__}: {err}") from err
        if rc == _CHECK_DONE:
            return True
        if rc == _CHECK_PENDING:
            elapsed = time.monotonic() - ticket.submitted_at
            if elapsed <= self._timeout + ticket.length * 1e-9:
                return False
            raise TransferError(
                peer,
                -2,
                f"Mooncake write of {ticket.length} bytes still unfinished after "
                f"{elapsed:.1f}s (MC_TRANSFER_TIMEOUT {self._timeout:g}s); the peer may be "
                "hung",
            )
        what = "timed out" if rc == -2 else "failed"
        raise TransferError(
            peer,
            int(rc),
            f"Mooncake write of {ticket.length} bytes {what}; the peer may be down, "
            "unreachable or hung (MC_TRANSFER_TIMEOUT), or the destination lies outside "
            "its registered memory",
        )

    def close(self) -> None:
        """Unregister what this engine registered and drop the Mooncake engine;
        later calls raise :class:`TransferError`. Idempotent."""
        engine, self._engine = self._engine, None
        if engine is None:
            return
        for addr in sorted(self._regions):
            rc = engine.unregister_memory(addr)
            if rc != 0:
                logger.warning(
                    "Mooncake engine %s: unregistering %#x on close returned %d",
                    self._session_id,
                    addr,
                    rc,
                )
        self._regions.clear()


def _columns(
    peer: str, src: AddressList, dst: AddressList, lengths: AddressList
) -> tuple[list[int], list[int], list[int]]:
    """The batch's columns as lists of ints (what the binding takes), or a
    :class:`TransferError` naming what is wrong with them."""
    try:
        srcs = as_address_list(src, what="src")
        dsts = as_address_list(dst, what="dst")
        lens = as_address_list(lengths, what="lengths")
    except TypeError as err:
        raise TransferError(peer, -1, str(err)) from None
    if not len(srcs) == len(dsts) == len(lens):
        raise TransferError(
            peer,
            -1,
            f"batch columns differ in length: {len(srcs)} src, {len(dsts)} dst, "
            f"{len(lens)} lengths",
        )
    return srcs, dsts, lens


def _range_error(err: TransferError, start: int, end: int, total: int) -> TransferError:
    """``err`` restated for descriptors ``[start, end)`` of a ``total``-descriptor write."""
    return TransferError(
        err.peer, err.code, f"descriptors [{start}, {end}) of {total}: {err.detail}"
    )
