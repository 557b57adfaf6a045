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

Batching: Mooncake's TCP transport queues at most 2,048 transfers per peer
(``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``); a call with more descriptors fails at
once, and for a moment afterwards so do the next calls to that peer while the
refused batch drains. TokenSpeed's 4,096-descriptor calls therefore fail every room
over 2,048 pages. :meth:`MooncakeEngine.batch_write` splits a batch into calls of at
most ``max_descriptors`` (default :data:`DEFAULT_MAX_DESCRIPTORS`, half the limit),
made one after another, so a batch of any size succeeds on Mooncake's default
settings.

Non-blocking writes (:class:`tspd.engines.base.PollingEngine`):
:meth:`MooncakeEngine.submit_write` is Mooncake's ``transfer_submit_write`` (one
descriptor per call: ``transfer_check_status`` looks at the first task of a batch
only) and :meth:`MooncakeEngine.check_write` its ``transfer_check_status``. The
sync calls time a write out themselves after ``MC_TRANSFER_TIMEOUT`` plus 1 ns per
byte; the status check does not, so :meth:`check_write` applies the same bound.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any, Final, cast, final

from tspd.engines.base import (
    AddressList,
    EngineUnavailable,
    TransferError,
    WriteTicket,
    as_address_list,
)

__all__ = [
    "DEFAULT_MAX_DESCRIPTORS",
    "INIT_FAILED",
    "MooncakeEngine",
    "load_mooncake",
    "transfer_timeout",
]

logger = logging.getLogger("tspd.engines.mooncake")

DEFAULT_MAX_DESCRIPTORS: Final = 1024
"""Descriptors per Mooncake call: half of TCP's 2,048 queued transfers per peer."""

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
        if not hasattr(engine, "batch_transfer_sync_write"):
            raise EngineUnavailable(_BATCH_MISSING)

    @property
    def session_id(self) -> str:
        """``"{host}:{rpc_port}"``, what peers pass to their writes."""
        return self._session_id

    @property
    def max_descriptors(self) -> int:
        """Most descriptors handed to Mooncake in one call."""
        return self._max_descriptors

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
        """Write every descriptor to ``peer_session``, in calls of at most
        :attr:`max_descriptors`; the first failing call stops the batch and raises
        :class:`TransferError` (an exception inside Mooncake counts as ``-1``)."""
        engine = self._live(peer_session)
        try:
            srcs = as_address_list(src, what="src")
            dsts = as_address_list(dst, what="dst")
            lens = as_address_list(lengths, what="lengths")
        except TypeError as err:
            raise TransferError(peer_session, -1, str(err)) from None
        if not len(srcs) == len(dsts) == len(lens):
            raise TransferError(
                peer_session,
                -1,
                f"batch columns differ in length: {len(srcs)} src, {len(dsts)} dst, "
                f"{len(lens)} lengths",
            )
        step = self._max_descriptors
        for start in range(0, len(srcs), step):
            end = start + step
            try:
                rc = engine.batch_transfer_sync_write(
                    peer_session, srcs[start:end], dsts[start:end], lens[start:end]
                )
            except Exception as err:  # the binding raises on bad arguments
                raise TransferError(
                    peer_session, -1, f"Mooncake raised {type(err).__name__}: {err}"
                ) from err
            if rc != 0:
                raise TransferError(
                    peer_session,
                    int(rc),
                    f"Mooncake batch write of descriptors [{start}, "
                    f"{min(end, len(srcs))}) of {len(srcs)} failed; the peer may be down, "
                    "unreachable or hung (MC_TRANSFER_TIMEOUT), or a destination lies "
                    "outside its registered memory",
                )

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
