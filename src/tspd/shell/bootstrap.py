"""The bootstrap HTTP server and client on Trio (spec §2).

Server: hypercorn's Trio worker serving a Starlette app whose only job is to hand
each request to :class:`tspd.core.bootstrap.BootstrapState` and write its
:class:`~tspd.core.bootstrap.HttpReply` back. Use :func:`open_bootstrap_server`
(an async context manager yielding a :class:`BootstrapServer` with the bound
address) or :func:`serve_bootstrap` under a caller's nursery (``task_status``
reports the same handle). Leaving the block cancels the server: open keep-alive
connections are closed and the listening port is released at once, so a new
server can bind it immediately (§2.4).

Unlike TokenSpeed's server (all interfaces), the host is explicit and defaults to
``127.0.0.1``; pass ``"0.0.0.0"`` to serve other machines.

Client: :class:`BootstrapClient` over ``httpx.AsyncClient`` (which runs on Trio),
one keep-alive client per bootstrap address, with the timeouts of §2.5. Every call
is bounded (the parallel-info fetch, unbounded in S1, uses 5 s too). The calls take
``timeout=`` (seconds, httpx's per-phase timeout as TokenSpeed's clients use it)
rather than relying on ``trio.fail_after`` around them, because the health check
needs distinct connect and read limits.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Final, NoReturn, final

import httpx
import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from tspd.core.bootstrap import (
    BootstrapState,
    HttpReply,
    ParallelInfo,
    RankInfo,
    encode_route_payload,
    parse_parallel_info,
    parse_rank_info,
)
from tspd.core.errors import TspdError
from tspd.shell.http import bind_tcp, serve_asgi
from tspd.shell.nursery import single_error

__all__ = [
    "DEFAULT_BOOTSTRAP_PORT",
    "MAX_BODY_BYTES",
    "BootstrapClient",
    "BootstrapServer",
    "BootstrapServerError",
    "BootstrapUnavailable",
    "bootstrap_app",
    "open_bootstrap_server",
    "serve_bootstrap",
]

logger = logging.getLogger("tspd.bootstrap")

DEFAULT_BOOTSTRAP_PORT: Final = 8998
"""TokenSpeed's ``--disaggregation-bootstrap-port`` default."""

MAX_BODY_BYTES: Final = 1 << 20
"""Largest request body read (a contract is at most 256 KiB)."""

_METHODS: Final = ["GET", "HEAD", "PUT", "POST", "DELETE", "PATCH", "OPTIONS"]


class BootstrapServerError(TspdError, RuntimeError):
    """The bootstrap server could not start (spec §2.4 messages)."""


class BootstrapUnavailable(TspdError):
    """A bootstrap server did not answer, or answered with a non-200 status.

    ``address`` is the server, ``status`` the HTTP status (``None`` when no reply
    arrived) and ``detail`` the reply body or the transport error.
    """

    def __init__(self, address: str, what: str, status: int | None, detail: str) -> None:
        self.address = address
        self.status = status
        self.detail = detail
        got = f"status {status}" if status is not None else "no reply"
        super().__init__(f"bootstrap server {address}: {what} failed ({got}): {detail}")


# --------------------------------------------------------------------------- server


def bootstrap_app(state: BootstrapState) -> Starlette:
    """A Starlette app answering every path and method from ``state``."""

    async def endpoint(request: Request) -> Response:
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                return Response(
                    f"bootstrap request body exceeds {MAX_BODY_BYTES} bytes", status_code=413
                )
        reply: HttpReply = state.handle(
            request.method,
            request.url.path,
            dict(request.query_params),
            bytes(body),
        )
        if reply.status == 500:
            logger.warning(
                "bootstrap %s %s from %s refused: %s",
                request.method,
                request.url.path,
                request.client.host if request.client else "?",
                reply.body,
            )
        return Response(reply.body, status_code=reply.status, media_type=reply.content_type)

    return Starlette(routes=[Route("/{path:path}", endpoint, methods=_METHODS)])


@final
@dataclass(frozen=True, slots=True)
class BootstrapServer:
    """A running bootstrap server: where it listens and the state it serves."""

    host: str
    port: int
    state: BootstrapState

    @property
    def address(self) -> str:
        """``"host:port"``: what Decode ranks are given as the bootstrap address."""
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """``http://host:port``."""
        return f"http://{self.address}"


def _bind(host: str, port: int) -> socket.socket:
    try:
        return bind_tcp(host, port)
    except OSError as err:
        raise BootstrapServerError(f"Bootstrap server failed to bind on port {port}") from err


async def serve_bootstrap(
    host: str = "127.0.0.1",
    port: int = DEFAULT_BOOTSTRAP_PORT,
    *,
    state: BootstrapState | None = None,
    task_status: trio.TaskStatus[BootstrapServer] = trio.TASK_STATUS_IGNORED,
) -> NoReturn:
    """Serve the bootstrap routes on ``host:port`` until cancelled.

    ``port=0`` picks a free port; ``task_status`` reports the :class:`BootstrapServer`
    once the socket is bound and listening. A port that cannot be bound raises
    :class:`BootstrapServerError` ``"Bootstrap server failed to bind on port {port}"``
    chained to the OS error.
    """
    await _serve_socket(_bind(host, port), host, state, task_status=task_status)


async def _serve_socket(
    sock: socket.socket,
    host: str,
    state: BootstrapState | None,
    *,
    task_status: trio.TaskStatus[BootstrapServer] = trio.TASK_STATUS_IGNORED,
) -> NoReturn:
    """Serve on an already bound socket (adopted: hypercorn closes it)."""
    state = BootstrapState() if state is None else state
    server = BootstrapServer(host, sock.getsockname()[1], state)
    await serve_asgi(
        bootstrap_app(state),
        sock,
        logger=logger,
        what="bootstrap server",
        started=server,
        url=server.url,
        task_status=task_status,
    )


@asynccontextmanager
async def open_bootstrap_server(
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    state: BootstrapState | None = None,
) -> AsyncIterator[BootstrapServer]:
    """Run a bootstrap server for the duration of the block; yields its handle
    (``server.address`` is the bound ``"host:port"``). A bind failure raises
    :class:`BootstrapServerError` before the block runs."""
    sock = _bind(host, port)
    with single_error():
        async with trio.open_nursery() as nursery:
            server: BootstrapServer = await nursery.start(_serve_socket, sock, host, state)
            try:
                yield server
            finally:
                nursery.cancel_scope.cancel()


# --------------------------------------------------------------------------- client


def _base_url(address: str) -> str:
    return address if "://" in address else f"http://{address}"


@final
class BootstrapClient:
    """Talks to bootstrap servers; one keep-alive ``httpx.AsyncClient`` per address.

    Use as an async context manager (or call :meth:`aclose`) so pooled connections
    are closed. Failures raise :class:`BootstrapUnavailable` (transport error or
    non-200) or :class:`tspd.core.errors.WireError` (a 200 reply that cannot be
    used); :meth:`health` never raises.
    """

    def __init__(
        self,
        *,
        put_timeout: float = 5.0,
        get_timeout: float = 5.0,
        health_connect_timeout: float = 2.0,
        health_read_timeout: float = 3.0,
    ) -> None:
        self._put_timeout = put_timeout
        self._get_timeout = get_timeout
        self._health_timeout = httpx.Timeout(
            health_read_timeout, connect=health_connect_timeout, pool=health_connect_timeout
        )
        self._clients: dict[str, httpx.AsyncClient] = {}

    async def __aenter__(self) -> BootstrapClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def _client(self, address: str) -> httpx.AsyncClient:
        client = self._clients.get(address)
        if client is None:
            client = httpx.AsyncClient(
                base_url=_base_url(address),
                trust_env=False,  # never route a bootstrap address through a proxy
                headers={"Connection": "keep-alive"},
            )
            self._clients[address] = client
        return client

    @property
    def addresses(self) -> list[str]:
        """Addresses with an open session, sorted."""
        return sorted(self._clients)

    async def drop(self, address: str) -> None:
        """Close the session to ``address`` (the next call opens a new one)."""
        client = self._clients.pop(address, None)
        if client is not None:
            with trio.CancelScope(shield=True):
                await client.aclose()

    async def aclose(self) -> None:
        """Close every session."""
        for address in list(self._clients):
            await self.drop(address)

    async def _request(
        self,
        address: str,
        what: str,
        method: str,
        path: str,
        *,
        timeout: httpx.Timeout | float,  # noqa: ASYNC109 - httpx's per-phase timeout
        params: Mapping[str, str] | None = None,
        content: bytes | None = None,
    ) -> httpx.Response:
        try:
            response = await self._client(address).request(
                method,
                path,
                params=params,
                content=content,
                timeout=timeout,
                headers={"Content-Type": "application/json"} if content is not None else None,
            )
        except httpx.HTTPError as err:
            raise BootstrapUnavailable(address, what, None, f"{type(err).__name__}: {err}") from err
        if response.status_code != 200:
            raise BootstrapUnavailable(address, what, response.status_code, response.text)
        return response

    async def put_route(
        self,
        address: str,
        payload: Mapping[str, Any],
        *,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> None:
        """``PUT /route`` a Prefill rank's registration (5 s by default)."""
        await self._request(
            address,
            "PUT /route",
            "PUT",
            "/route",
            timeout=self._put_timeout if timeout is None else timeout,
            content=encode_route_payload(payload),
        )

    async def get_parallel_info(
        self,
        address: str,
        *,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> ParallelInfo:
        """Fetch the instance's parallel info (``engine_rank=-1&target_dp_group=-1``)."""
        response = await self._request(
            address,
            "GET parallel info",
            "GET",
            "/route",
            timeout=self._get_timeout if timeout is None else timeout,
            params={"engine_rank": "-1", "target_dp_group": "-1"},
        )
        return parse_parallel_info(response.content)

    async def get_rank_info(
        self,
        address: str,
        engine_rank: int,
        dp_group: int,
        *,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> RankInfo:
        """Fetch one Prefill rank's control endpoint (5 s by default)."""
        response = await self._request(
            address,
            f"GET rank info for engine_rank={engine_rank} target_dp_group={dp_group}",
            "GET",
            "/route",
            timeout=self._get_timeout if timeout is None else timeout,
            params={"engine_rank": str(engine_rank), "target_dp_group": str(dp_group)},
        )
        return parse_rank_info(response.content)

    async def health(self, address: str) -> bool:
        """``GET /health`` (connect 2 s, read 3 s): ``True`` on ``200``. A non-200
        reply also drops the session, as TokenSpeed's heartbeat does."""
        try:
            await self._request(
                address, "GET /health", "GET", "/health", timeout=self._health_timeout
            )
        except BootstrapUnavailable as err:
            logger.debug("%s", err)
            if err.status is not None:
                await self.drop(address)
            return False
        return True
