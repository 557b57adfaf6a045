"""The bootstrap HTTP server and client on Trio (docs/protocol.md#proto-bootstrap).

Server: hypercorn (under :func:`tspd.shell.http.serve_asgi`) serving a Starlette app
whose only job is to hand each request to :class:`tspd.core.bootstrap.BootstrapState`
and write its :class:`~tspd.core.bootstrap.HttpReply` back. Use :func:`open_bootstrap_server`
(an async context manager yielding a :class:`BootstrapServer` with the bound
address) or :func:`serve_bootstrap` under a caller's nursery (``task_status``
reports the same handle). Leaving the block cancels the server: open keep-alive
connections are closed and the listening port is released at once, so a new
server can bind it immediately (docs/protocol.md#proto-bootstrap-lifecycle).

Unlike TokenSpeed's server (all interfaces), the host is explicit and defaults to
``127.0.0.1``; pass ``"0.0.0.0"`` to serve other machines.

No client can crash, bloat or hold it: a request is refused with ``4xx`` and a
reason (see :mod:`tspd.core.bootstrap`; a body over :data:`MAX_BODY_BYTES` is
``413``), an exception inside the app answers ``500`` for that request alone, and
:class:`~tspd.shell.http.HttpLimits` (``limits=``) bounds how long a request may
take, how long an idle connection stays and how many are open. Each refusal is
counted by reason (:meth:`BootstrapServer.statistics`, exported as
``tspd_bootstrap_rejected_requests_total`` by
:meth:`tspd.shell.metrics.TspdMetrics.watch_bootstrap`) and logged through a
:class:`~tspd.log.RateLimitedLog`: at most one line per client and reason every
10 s, the next one saying how many were held back.

Client: :class:`BootstrapClient` over ``httpx.AsyncClient`` (which runs on Trio),
one keep-alive client per bootstrap address, with the timeouts of
docs/protocol.md#proto-bootstrap-clients. Every call
is bounded (the parallel-info fetch, unbounded in S1, uses 5 s too), reads at most
:data:`MAX_REPLY_BYTES` of a reply, and fails only with
:class:`BootstrapUnavailable` or :class:`~tspd.core.errors.WireError` — whatever the
address (it comes from a request) or the server (it may not be tspd's) is. The calls take
``timeout=`` (seconds, httpx's per-phase timeout as TokenSpeed's clients use it)
rather than relying on ``trio.fail_after`` around them, because the health check
needs distinct connect and read limits.

Secure mode (``security=``, a :class:`~tspd.shell.security.SecurityConfig`;
docs/security.md): the server speaks HTTPS only with the configured certificate, and
``PUT /route`` (with ``protect_get`` the ``GET`` routes too) needs the bearer token:
``401`` without one, ``403`` with another. A rank's route held by one identity (its
CURVE public key, or none) is replaced by a ``PUT`` of another identity only once the
holder is no longer live — its control endpoint refuses a TCP connection, or does not
answer within :data:`LIVENESS_PROBE_S` — else ``409`` (``identity_conflict``). The
client verifies the server with the CA, sends the token and speaks ``https://``.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, NoReturn, final

import httpx
import trio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from tspd.core.bootstrap import (
    REFUSAL_REASONS,
    BootstrapState,
    HttpReply,
    ParallelInfo,
    RankInfo,
    encode_route_payload,
    is_valid_host,
    parse_parallel_info,
    parse_rank_info,
)
from tspd.core.errors import TspdError
from tspd.log import RateLimitedLog
from tspd.shell.http import HttpLimits, OnRefused, bind_tcp, serve_asgi
from tspd.shell.nursery import single_error

if TYPE_CHECKING:
    from tspd.shell.security import SecurityConfig

__all__ = [
    "DEFAULT_BOOTSTRAP_PORT",
    "MAX_BODY_BYTES",
    "MAX_REPLY_BYTES",
    "MAX_SESSIONS",
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

MAX_REPLY_BYTES: Final = 1 << 20
"""Largest reply body a :class:`BootstrapClient` reads (a parallel-info reply holds
one contract); a longer reply fails the call."""

MAX_SESSIONS: Final = 256
"""Bootstrap addresses a :class:`BootstrapClient` keeps a session open to; opening
one more closes the least recently used."""

LIVENESS_PROBE_S: Final = 2.0
"""Secure server: how long a route's holder has to accept a TCP connection on its
control endpoint to count as live when another identity wants its route."""

_METHODS: Final = ["GET", "HEAD", "PUT", "POST", "DELETE", "PATCH", "OPTIONS", "TRACE"]
#: Refusals logged at INFO rather than WARNING: probes and scanners, not peers.
_QUIET: Final = frozenset({"not_found", "method_not_allowed"})
_BY_STATUS: Final = {
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "body_too_large",
    500: "server_error",
}


class BootstrapServerError(TspdError, RuntimeError):
    """The bootstrap server could not start (docs/protocol.md#proto-bootstrap-lifecycle
    messages)."""


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


@final
class _Refusals:
    """Counts refused requests by reason and logs them, rate-limited per client."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self._log = RateLimitedLog(logger)

    def __call__(self, peer: str, reason: str, message: str) -> None:
        reason = reason if reason in REFUSAL_REASONS else "other"
        self.counts[reason] = self.counts.get(reason, 0) + 1
        level = logging.INFO if reason in _QUIET else logging.WARNING
        self._log.log(level, peer, reason, "bootstrap server: %s", message)


def _reason(reply: HttpReply) -> str:
    return reply.reason or _BY_STATUS.get(reply.status, "other")


async def holder_alive(host: str, port: int) -> bool:
    """Whether ``host:port`` accepts a TCP connection within :data:`LIVENESS_PROBE_S`."""
    with trio.move_on_after(LIVENESS_PROBE_S):
        try:
            stream = await trio.open_tcp_stream(host, port)
        except OSError:
            return False
        await trio.aclose_forcefully(stream)
        return True
    return False


def _unauthorized(status: int, what: str) -> HttpReply:
    detail = (
        "needs a bearer token (Authorization: Bearer ..., TSPD_BOOTSTRAP_TOKEN_FILE)"
        if status == 401
        else "was sent with a token this server does not accept"
    )
    return HttpReply(status, f"bootstrap {what} {detail}", reason="unauthorized")


def bootstrap_app(
    state: BootstrapState,
    *,
    on_refused: OnRefused | None = None,
    security: SecurityConfig | None = None,
    alive: Callable[[str, int], Awaitable[bool]] = holder_alive,
) -> Starlette:
    """A Starlette app answering every path and method from ``state``.

    Each refused request (``4xx`` but the ``503`` of a starting instance, or a
    ``500``) is reported to ``on_refused(peer, reason, message)`` (default: a
    rate-limited log line). An exception raised by ``state`` is answered ``500``
    and logged with its traceback (rate-limited); the server goes on. With
    ``security`` carrying a token, the token and identity rules of the module doc
    apply (``alive`` probes a route's holder)."""
    refused = _Refusals() if on_refused is None else on_refused
    faults = RateLimitedLog(logger)
    token = security.bootstrap_token if security is not None else None
    protect_get = security is not None and security.protect_get

    async def guarded(request: Request, body: bytes) -> HttpReply | None:
        """A refusal from the token or identity rules, or ``None`` to go on."""
        if token is None or request.url.path != "/route":
            return None
        method = request.method
        if method == "PUT" or (protect_get and method in ("GET", "HEAD")):
            from tspd.shell.security import check_token

            status = check_token(token, request.headers.get("authorization"))
            if status is not None:
                return _unauthorized(status, f"{method[:8]} /route")
        if method != "PUT":
            return None
        conflict = state.identity_conflict(body)
        if conflict is None:
            return None
        host, port, key = conflict
        if not await alive(host, port):
            logger.warning(
                "bootstrap server: a rank's route %s:%d (identity %s) is replaced by another "
                "identity: its holder no longer answers",
                host,
                port,
                key or "plain",
            )
            return None
        return HttpReply(
            409,
            f"bootstrap PUT /route refused: this rank's route is held by a live rank of "
            f"another identity ({host}:{port}, CURVE key {key or 'none: plain mode'}); only "
            "the same identity may replace it while its holder is live",
            reason="identity_conflict",
        )

    def answer(request: Request, reply: HttpReply) -> Response:
        if reply.status >= 400 and reply.status != 503:
            peer = request.client.host if request.client else "?"
            first_line = reply.body.partition("\n")[0][:300]
            refused(
                peer,
                _reason(reply),
                f"{request.method[:16]} {request.url.path[:100]!r} from {peer} refused "
                f"({reply.status}): {first_line}",
            )
        return Response(reply.body, status_code=reply.status, media_type=reply.content_type)

    def too_large() -> HttpReply:
        return HttpReply(
            413,
            f"bootstrap request body exceeds {MAX_BODY_BYTES} bytes",
            reason="body_too_large",
        )

    async def endpoint(request: Request) -> Response:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            return answer(request, too_large())
        body = bytearray()
        try:
            async for chunk in request.stream():
                body += chunk
                if len(body) > MAX_BODY_BYTES:
                    return answer(request, too_large())
        except ClientDisconnect:  # gone, or closed by the limits (reported there)
            return Response(status_code=400)
        refusal = await guarded(request, bytes(body))
        if refusal is not None:
            response = answer(request, refusal)
            if refusal.status == 401:
                response.headers["WWW-Authenticate"] = "Bearer"
            return response
        try:
            reply: HttpReply = state.handle(
                request.method,
                request.url.path,
                dict(request.query_params),
                bytes(body),
            )
        except Exception:
            peer = request.client.host if request.client else "?"
            faults.log(
                logging.ERROR,
                peer,
                "server_error",
                "bootstrap server failed on %s %s from %s (a bug in the bootstrap server; "
                "the request was answered 500 and the server goes on)",
                request.method,
                repr(request.url.path[:100]),
                peer,
                exc_info=True,
            )
            reply = HttpReply(
                500,
                "the bootstrap server failed on this request; its log has the details",
                reason="server_error",
            )
        return answer(request, reply)

    async def http_error(request: Request, exc: Exception) -> Response:
        # Starlette's own refusals (a method outside _METHODS).
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        detail = exc.detail if isinstance(exc, HTTPException) else "internal error"
        return answer(request, HttpReply(status, str(detail)))

    return Starlette(
        routes=[Route("/{path:path}", endpoint, methods=_METHODS)],
        exception_handlers={HTTPException: http_error},
    )


@final
@dataclass(frozen=True, slots=True)
class BootstrapServer:
    """A running bootstrap server: where it listens, the state it serves and the
    limits it enforces."""

    host: str
    port: int
    state: BootstrapState
    limits: HttpLimits = field(default_factory=HttpLimits)
    _refusals: _Refusals = field(default_factory=_Refusals, repr=False, compare=False)
    #: ``https`` when the server speaks TLS (secure mode).
    scheme: str = "http"

    def statistics(self) -> dict[str, int]:
        """Refused requests and connections so far, by reason (the reasons of
        :data:`tspd.core.bootstrap.REFUSAL_REASONS`; only those seen are present)."""
        return dict(self._refusals.counts)

    @property
    def address(self) -> str:
        """``"host:port"``: what Decode ranks are given as the bootstrap address."""
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """``http://host:port`` (``https://`` with TLS)."""
        return f"{self.scheme}://{self.address}"


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
    limits: HttpLimits | None = None,
    security: SecurityConfig | None = None,
    task_status: trio.TaskStatus[BootstrapServer] = trio.TASK_STATUS_IGNORED,
) -> NoReturn:
    """Serve the bootstrap routes on ``host:port`` until cancelled.

    ``port=0`` picks a free port; ``task_status`` reports the :class:`BootstrapServer`
    once the socket is bound and listening. ``limits`` (default
    :class:`~tspd.shell.http.HttpLimits`) bound what clients may hold. ``security``:
    TLS and the token rules (see the module doc). A port that cannot be bound raises
    :class:`BootstrapServerError` ``"Bootstrap server failed to bind on port
    {port}"`` chained to the OS error.
    """
    await _serve_socket(_bind(host, port), host, state, limits, security, task_status=task_status)


async def _serve_socket(
    sock: socket.socket,
    host: str,
    state: BootstrapState | None,
    limits: HttpLimits | None,
    security: SecurityConfig | None = None,
    *,
    task_status: trio.TaskStatus[BootstrapServer] = trio.TASK_STATUS_IGNORED,
) -> NoReturn:
    """Serve on an already bound socket (adopted: closed when serving stops)."""
    state = BootstrapState() if state is None else state
    limits = HttpLimits() if limits is None else limits
    try:
        ssl_context = security.server_ssl_context() if security is not None else None
    except BaseException:
        sock.close()
        raise
    scheme = "https" if ssl_context is not None else "http"
    server = BootstrapServer(host, sock.getsockname()[1], state, limits, scheme=scheme)
    if security is not None and security.bootstrap_token and ssl_context is None:
        logger.warning(
            "bootstrap server %s: a bearer token is required but TLS is off, so the token "
            "travels in clear text; set TSPD_TLS_CERT_FILE and TSPD_TLS_KEY_FILE",
            server.address,
        )
    await serve_asgi(
        bootstrap_app(state, on_refused=server._refusals, security=security),
        sock,
        logger=logger,
        what="bootstrap server",
        started=server,
        url=server.url,
        limits=limits,
        on_refused=server._refusals,
        ssl_context=ssl_context,
        task_status=task_status,
    )


@asynccontextmanager
async def open_bootstrap_server(
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    state: BootstrapState | None = None,
    limits: HttpLimits | None = None,
    security: SecurityConfig | None = None,
) -> AsyncIterator[BootstrapServer]:
    """Run a bootstrap server for the duration of the block; yields its handle
    (``server.address`` is the bound ``"host:port"``). ``limits`` and ``security``
    as for :func:`serve_bootstrap`. A bind failure raises
    :class:`BootstrapServerError` before the block runs."""
    sock = _bind(host, port)
    with single_error():
        async with trio.open_nursery() as nursery:
            server: BootstrapServer = await nursery.start(
                _serve_socket, sock, host, state, limits, security
            )
            try:
                yield server
            finally:
                nursery.cancel_scope.cancel()


# --------------------------------------------------------------------------- client


class _ReplyTooLarge(Exception):
    pass


async def _read_capped(response: httpx.Response) -> bytes:
    """The reply's body, refused past :data:`MAX_REPLY_BYTES` or when compressed."""
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise _ReplyTooLarge(
            f"the reply is compressed ({encoding[:32]!r}); a bootstrap server sends plain replies"
        )
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_REPLY_BYTES:
        raise _ReplyTooLarge(f"the reply announces {int(declared)} bytes, over {MAX_REPLY_BYTES}")
    body = bytearray()
    async for chunk in response.aiter_raw():
        body += chunk
        if len(body) > MAX_REPLY_BYTES:
            raise _ReplyTooLarge(f"the reply is longer than {MAX_REPLY_BYTES} bytes")
    return bytes(body)


def _base_url(address: str, scheme: str = "http") -> str:
    return address if "://" in address else f"{scheme}://{address}"


def _address_problem(address: str) -> str | None:
    """Why ``address`` (``host``, ``host:port`` or ``[v6]:port``; a URL is left to
    httpx) cannot name a bootstrap server, or ``None``."""
    if "://" in address:
        return None
    if address.startswith("["):
        host, bracket, rest = address[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            return "an IPv6 address is written [address]:port"
        if ":" not in host or not is_valid_host(host):
            return f"{host[:64]!r} is not an IPv6 address"
        colon, port = rest[:1], rest[1:]
    else:
        host, colon, port = address.partition(":")
        if not is_valid_host(host):
            return f"{host[:64]!r} is not a host name or IP address"
    if colon and not (
        len(port) <= 5 and port.isascii() and port.isdigit() and 0 < int(port) < 65536
    ):
        return f"port {port[:16]!r} is not in 1..65535"
    return None


@final
class BootstrapClient:
    """Talks to bootstrap servers; one keep-alive ``httpx.AsyncClient`` per address.

    Use as an async context manager (or call :meth:`aclose`) so pooled connections
    are closed. Failures raise :class:`BootstrapUnavailable` (transport error or
    non-200) or :class:`tspd.core.errors.WireError` (a 200 reply that cannot be
    used); :meth:`health` never raises. ``security``: verify the server with its CA
    over ``https://`` and send the bearer token (secure mode, docs/security.md).
    """

    def __init__(
        self,
        *,
        put_timeout: float = 5.0,
        get_timeout: float = 5.0,
        health_connect_timeout: float = 2.0,
        health_read_timeout: float = 3.0,
        security: SecurityConfig | None = None,
    ) -> None:
        self._scheme = security.scheme if security is not None else "http"
        self._verify = security.client_ssl_context() if security is not None else None
        self._headers = {"Connection": "keep-alive", "Accept-Encoding": "identity"}
        if security is not None and security.bootstrap_token:
            self._headers["Authorization"] = f"Bearer {security.bootstrap_token}"
        self._put_timeout = put_timeout
        self._get_timeout = get_timeout
        self._health_timeout = httpx.Timeout(
            health_read_timeout, connect=health_connect_timeout, pool=health_connect_timeout
        )
        #: Sessions, least recently used first (at most MAX_SESSIONS).
        self._clients: dict[str, httpx.AsyncClient] = {}

    async def __aenter__(self) -> BootstrapClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def _client(self, address: str) -> httpx.AsyncClient:
        client = self._clients.pop(address, None)
        if client is None:
            while len(self._clients) >= MAX_SESSIONS:
                await self.drop(next(iter(self._clients)))
            client = httpx.AsyncClient(
                base_url=_base_url(address, self._scheme),
                trust_env=False,  # never route a bootstrap address through a proxy
                # Plain replies only: a compressed one could inflate past MAX_REPLY_BYTES.
                headers=self._headers,
                verify=self._verify if self._verify is not None else True,
            )
        self._clients[address] = client  # now the most recently used
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
    ) -> bytes:
        """The body of a ``200`` reply; anything else raises
        :class:`BootstrapUnavailable` (whatever the address or the server is)."""
        problem = _address_problem(address)
        if problem is not None:
            raise BootstrapUnavailable(
                address[:100], what, None, f"not a bootstrap address (host:port): {problem}"
            )
        try:
            client = await self._client(address)
            async with client.stream(
                method,
                path,
                params=params,
                content=content,
                timeout=timeout,
                headers={"Content-Type": "application/json"} if content is not None else None,
            ) as response:
                status = response.status_code
                body = await _read_capped(response)
        except _ReplyTooLarge as err:
            raise BootstrapUnavailable(address, what, None, str(err)) from err
        except (httpx.HTTPError, httpx.InvalidURL, httpx.StreamError, ValueError) as err:
            cause = err.__cause__ or err.__context__
            detail = f"{type(err).__name__}: {err or cause!r}"
            if self._verify is not None and isinstance(err, httpx.ConnectError):
                detail += (
                    " (this client speaks HTTPS, secure mode: a plain-HTTP bootstrap server "
                    "is refused, as is a certificate the CA did not sign)"
                )
            raise BootstrapUnavailable(address, what, None, detail) from err
        if status != 200:
            detail = body[:1000].decode("utf-8", "replace")
            raise BootstrapUnavailable(address, what, status, detail)
        return body

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
        body = await self._request(
            address,
            "GET parallel info",
            "GET",
            "/route",
            timeout=self._get_timeout if timeout is None else timeout,
            params={"engine_rank": "-1", "target_dp_group": "-1"},
        )
        return parse_parallel_info(body)

    async def get_rank_info(
        self,
        address: str,
        engine_rank: int,
        dp_group: int,
        *,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> RankInfo:
        """Fetch one Prefill rank's control endpoint (5 s by default)."""
        body = await self._request(
            address,
            f"GET rank info for engine_rank={engine_rank} target_dp_group={dp_group}",
            "GET",
            "/route",
            timeout=self._get_timeout if timeout is None else timeout,
            params={"engine_rank": str(engine_rank), "target_dp_group": str(dp_group)},
        )
        return parse_rank_info(body)

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
