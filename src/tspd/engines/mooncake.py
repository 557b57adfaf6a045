"""The Mooncake transfer engine behind :class:`tspd.engines.base.TransferEngine` (spec §8).

Mooncake is imported only when a :class:`MooncakeEngine` is built, so the rest of
tspd works on hosts without it; a missing package or system library becomes an
:class:`EngineUnavailable` that says what to install.

Every method here blocks the calling thread, and the write calls busy-spin a core
until the transfer completes or fails (bounded by ``MC_TRANSFER_TIMEOUT``, default
30 s, at least 5 s). Never call them on a Trio thread: go through
:class:`tspd.shell.offload.EngineRunner`.

Batching: Mooncake's TCP transport queues at most 2,048 transfers per peer
(``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``); a call with more descriptors fails at
once, and for a moment afterwards so do the next calls to that peer while the
refused batch drains. TokenSpeed's 4,096-descriptor calls therefore fail every room
over 2,048 pages. :meth:`MooncakeEngine.batch_write` splits a batch into calls of at
most ``max_descriptors`` (default :data:`DEFAULT_MAX_DESCRIPTORS`, half the limit),
made one after another, so a batch of any size succeeds on Mooncake's default
settings.
"""

from __future__ import annotations

import logging
from typing import Any, Final, cast, final

from tspd.engines.base import (
    AddressList,
    EngineUnavailable,
    TransferError,
    as_address_list,
)

__all__ = [
    "DEFAULT_MAX_DESCRIPTORS",
    "INIT_FAILED",
    "MooncakeEngine",
    "load_mooncake",
]

logger = logging.getLogger("tspd.engines.mooncake")

DEFAULT_MAX_DESCRIPTORS: Final = 1024
"""Descriptors per Mooncake call: half of TCP's 2,048 queued transfers per peer."""

INIT_FAILED: Final = "Mooncake Transfer Engine initialization failed."
"""The specification's message for a non-zero ``initialize`` (§8)."""

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
