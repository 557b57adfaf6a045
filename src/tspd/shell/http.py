"""Serving a small ASGI app (Starlette) with hypercorn on Trio, the way tspd's HTTP
endpoints do: the bootstrap server and the metrics endpoint.

The listening socket is bound by the caller first (:func:`bind_tcp`), so a port that
cannot be bound fails before any task starts, with the caller's own message, and
``port=0`` yields the real port at once; :func:`serve_asgi` then listens on it and
closes it when it stops.

Nothing a client does can hold the server: :class:`HttpLimits` bounds how long a
request may take to arrive, how long an idle keep-alive connection stays open, how
large a request head may be and how many connections are open at once. hypercorn
enforces its own settings (``read_timeout``, ``keep_alive_timeout``,
``h11_max_incomplete_size``); it has no connection cap and its read timeout is per
read, so :func:`serve_asgi` runs hypercorn's connection handler under its own accept
loop, which closes a connection beyond the cap at once and gives each request a
deadline from its first byte to its answer (a client trickling a byte at a time is
closed too). A connection closed for either reason is reported to ``on_refused``.

With an ``ssl_context`` the server speaks HTTPS only (tspd's secure mode,
docs/security.md): each connection's TLS handshake runs under the same deadlines,
and a client whose first bytes are not a TLS handshake (plain HTTP) is answered a
plain ``400`` that says so, then closed, and reported as ``tls_required``.
"""

from __future__ import annotations

import logging
import math
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Final, NoReturn, TypeVar, cast, final

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState
from hypercorn.utils import wrap_app

from tspd.core.errors import ConfigError
from tspd.log import RateLimitedLog
from tspd.shell.nursery import single_error

__all__ = ["HttpLimits", "OnRefused", "bind_tcp", "serve_asgi"]

T = TypeVar("T")

OnRefused = Callable[[str, str, str], None]
"""``on_refused(peer, reason, message)``: a connection from host ``peer`` was closed
for ``reason`` (``"connection_limit"`` or ``"request_timeout"``); ``message`` says
so for an operator."""

_UNKNOWN_PEER: Final = "?"


@final
@dataclass(frozen=True, slots=True)
class HttpLimits:
    """What one client may take of a tspd HTTP endpoint (seconds, counts, bytes).

    ``request_timeout``: longest from a request's first byte to its answer, however
    the bytes trickle in; a connection that stalls mid-request (headers sent, body
    promised and never sent) is closed when it expires. ``keep_alive_timeout``: an
    idle connection (between requests, or one that never sent a byte) is closed
    after it (hypercorn's ``keep_alive_timeout``; longer than the 15 s an aiohttp
    client reuses an idle connection and the 5 s of httpx's, so a heartbeat never
    races the server's close). ``read_timeout``: longest wait for the next bytes,
    idle or not (hypercorn's ``read_timeout``, a backstop; keep it at least
    ``keep_alive_timeout``, which it would otherwise cut short).
    ``max_connections``: connections open at once; one more is closed as soon as it
    is accepted. ``backlog``: the listening socket's accept queue.
    ``max_header_bytes``: largest request line plus headers (hypercorn's
    ``h11_max_incomplete_size``).
    """

    request_timeout: float = 10.0
    keep_alive_timeout: float = 20.0
    read_timeout: float = 30.0
    max_connections: int = 512
    backlog: int = 128
    max_header_bytes: int = 16 * 1024

    def __post_init__(self) -> None:
        for name in ("read_timeout", "request_timeout", "keep_alive_timeout"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and 0 < value < math.inf):
                raise ConfigError(f"HttpLimits.{name} must be a positive number, got {value!r}")
        for name in ("max_connections", "backlog", "max_header_bytes"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
                raise ConfigError(f"HttpLimits.{name} must be a positive integer, got {value!r}")


def bind_tcp(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (IPv6 when ``host`` has a ``:``); raises
    the ``OSError`` for the caller to turn into its own message."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def _peer_host(sock: trio.socket.SocketType) -> str:
    try:
        name = sock.getpeername()
    except OSError:
        return _UNKNOWN_PEER
    return str(name[0]) if isinstance(name, tuple) else _UNKNOWN_PEER


@final
class _GuardedStream(trio.abc.HalfCloseableStream):
    """A connection whose request must arrive and be answered within a deadline.

    The deadline starts at the first bytes received while no request is under way
    and ends when the server sends (its answer); a receive past it raises
    ``trio.TooSlowError``, on which hypercorn closes the connection. ``peer_gone``
    is set when the client closes its side. It has the ``socket`` attribute
    hypercorn reads and no ``do_handshake`` (not TLS).
    """

    def __init__(
        self, stream: trio.SocketStream, limits: HttpLimits, on_timeout: Callable[[], None]
    ) -> None:
        self._stream = stream
        self.socket = stream.socket
        self._timeout = limits.request_timeout
        self._on_timeout = on_timeout
        self._deadline = math.inf
        self._pushback = b""
        # The cancel scope of a receive under way: an answer sent meanwhile lifts its
        # deadline (TLS reads records while a response goes out).
        self._receiving: trio.CancelScope | None = None
        # One sender at a time: hypercorn may answer (say, 413 from the headers) or
        # close while another of its tasks still sends, and a trio stream raises
        # BusyResourceError for two concurrent senders.
        self._send_lock = trio.Lock()
        self.peer_gone = trio.Event()

    async def peek(self) -> bytes:
        """The first bytes the client sends, kept for the next :meth:`receive_some`
        (``b""`` when it closed first)."""
        data = bytes(await self.receive_some())
        self._pushback = data
        return data

    @property
    def deadline(self) -> float:
        """When the request under way must be answered (``inf`` when idle)."""
        return self._deadline

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        if self._pushback:
            data, self._pushback = self._pushback, b""
            return data
        with trio.move_on_at(self._deadline) as scope:
            self._receiving = scope
            try:
                data = await self._stream.receive_some(max_bytes)
            finally:
                self._receiving = None
            if not data:
                self.peer_gone.set()
            elif self._deadline == math.inf:
                self._deadline = trio.current_time() + self._timeout
            return data
        self._on_timeout()
        raise trio.TooSlowError

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self._deadline = math.inf
        if self._receiving is not None:
            self._receiving.deadline = math.inf
        async with self._send_lock:
            await self._stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        async with self._send_lock:
            await self._stream.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        async with self._send_lock:
            await self._stream.send_eof()

    async def aclose(self) -> None:
        await self._stream.aclose()


def _has_body(headers: Any) -> bool:
    """Whether a request head announces a body (a non-zero ``Content-Length`` or any
    ``Transfer-Encoding``)."""
    for name, value in headers:
        lowered = name.lower()
        if lowered == b"transfer-encoding" or (lowered == b"content-length" and value != b"0"):
            return True
    return False


def _close_if_body_unread(app: Any) -> Any:
    """``app``, whose answers given before the request's body was read in full (a
    ``413`` from the declared length, a ``404``/``405`` to a request with a body)
    say ``Connection: close``: the unread rest of the body would otherwise be read
    as the next request, so the server closes the connection after the answer, and
    a client that reused it for its next request would find it closed under that
    request instead of opening a new one."""

    async def wrapped(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or not _has_body(scope.get("headers", ())):
            await app(scope, receive, send)
            return
        body_read = False

        async def receive_tracked() -> Any:
            nonlocal body_read
            message = await receive()
            if message.get("type") == "http.request" and not message.get("more_body", False):
                body_read = True
            return message

        async def send_closing(message: Any) -> None:
            if message.get("type") == "http.response.start" and not body_read:
                headers = [h for h in message.get("headers", ()) if h[0].lower() != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        await app(scope, receive_tracked, send_closing)

    return wrapped


def _header_guard(app: Any, limit: int) -> Any:
    """``app`` behind a check of the request's size: h11 bounds only a request head
    that arrives in pieces, so one that arrives whole, however large, reaches the
    app; this answers it 431 instead."""

    async def guarded(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope.get("type") == "http":
            size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
            size += sum(len(k) + len(v) + 4 for k, v in scope.get("headers", ()))
            if size > limit:
                body = f"request line and headers exceed {limit} bytes\n".encode()
                await send(
                    {
                        "type": "http.response.start",
                        "status": 431,
                        "headers": [
                            (b"content-type", b"text/plain; charset=utf-8"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": body})
                return
        await app(scope, receive, send)

    return guarded


@final
class _CappedListener(trio.abc.Listener[_GuardedStream]):
    """Accepts connections up to ``limits.max_connections`` open at once; one more
    is closed at once and reported. :meth:`release` is called when one ends."""

    def __init__(self, sock: trio.socket.SocketType, limits: HttpLimits, on_refused: OnRefused):
        self._listener = trio.SocketListener(sock)
        self._limits = limits
        self._on_refused = on_refused
        self.open = 0

    async def accept(self) -> _GuardedStream:
        while True:
            stream = await self._listener.accept()
            peer = _peer_host(stream.socket)
            if self.open >= self._limits.max_connections:
                await trio.aclose_forcefully(stream)
                self._on_refused(
                    peer,
                    "connection_limit",
                    f"closed a new connection from {peer}: {self.open} connections are open, "
                    f"the limit (max_connections={self._limits.max_connections}); raise it if "
                    "that many clients are expected, else find the client holding them",
                )
                continue
            self.open += 1
            return _GuardedStream(stream, self._limits, partial(self._timed_out, peer))

    def _timed_out(self, peer: str) -> None:
        self._on_refused(
            peer,
            "request_timeout",
            f"closed the connection from {peer}: its request did not arrive within "
            f"request_timeout={self._limits.request_timeout:g} s",
        )

    def release(self) -> None:
        self.open -= 1

    async def aclose(self) -> None:
        await self._listener.aclose()


def _log_refusals(logger: logging.Logger) -> OnRefused:
    refusals = RateLimitedLog(logger)

    def on_refused(peer: str, reason: str, message: str) -> None:
        refusals.warning(peer, reason, "%s", message)

    return on_refused


#: What a plain-HTTP client of a TLS server reads before the connection closes.
_TLS_REQUIRED: Final = (
    b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\n"
    b"Connection: close\r\nContent-Length: %d\r\n\r\n%s"
)
_TLS_REQUIRED_BODY: Final = (
    b"this server speaks HTTPS only (tspd secure mode, docs/security.md): a plain-mode "
    b"peer cannot use it; give the client the CA (TSPD_TLS_CA_FILE)"
)


async def _tls_first(
    stream: _GuardedStream, limits: HttpLimits, on_refused: OnRefused, what: str
) -> bool:
    """Whether the client's first bytes start a TLS handshake (a record of type 22);
    a plain-HTTP client is answered :data:`_TLS_REQUIRED` and reported. An idle
    client is given ``keep_alive_timeout`` to start."""
    first = b""
    with trio.move_on_after(limits.keep_alive_timeout):
        first = await stream.peek()
    if first[:1] == b"\x16":
        return True
    if first:
        peer = _peer_host(stream.socket)
        with trio.move_on_after(1.0):
            await stream.send_all(_TLS_REQUIRED % (len(_TLS_REQUIRED_BODY), _TLS_REQUIRED_BODY))
        on_refused(
            peer,
            "tls_required",
            f"{what}: answered 400 to a plain-HTTP client from {peer}: this server speaks "
            "HTTPS only (secure mode); a plain-mode peer cannot use it",
        )
    return False


async def serve_asgi(
    app: object,
    sock: socket.socket,
    *,
    logger: logging.Logger,
    what: str,
    started: T,
    url: str,
    limits: HttpLimits | None = None,
    on_refused: OnRefused | None = None,
    ssl_context: ssl.SSLContext | None = None,
    task_status: trio.TaskStatus[T] = trio.TASK_STATUS_IGNORED,
) -> NoReturn:
    """Serve ``app`` on the bound ``sock`` until cancelled; report ``started`` through
    ``task_status`` once it listens. ``limits`` (defaults: :class:`HttpLimits`) bound
    what clients may hold; connections closed by them go to ``on_refused`` (default:
    a rate-limited WARNING on ``logger``). ``ssl_context``: serve HTTPS only (see the
    module doc). hypercorn's own errors go to ``logger``'s ``.http`` child; access
    logs are off. Leaving closes every connection and the listening socket."""
    limits = HttpLimits() if limits is None else limits
    on_refused = _log_refusals(logger) if on_refused is None else on_refused
    config = HypercornConfig()
    config.accesslog = None
    config.errorlog = logger.getChild("http")
    config.read_timeout = limits.read_timeout  # type: ignore[assignment]  # to trio.fail_after
    config.keep_alive_timeout = limits.keep_alive_timeout
    config.h11_max_incomplete_size = limits.max_header_bytes
    config.backlog = limits.backlog
    asgi = wrap_app(
        _header_guard(_close_if_body_unread(app), limits.max_header_bytes),
        config.wsgi_max_body_size,
        "asgi",
    )
    context = WorkerContext(None)
    faults = RateLimitedLog(logger)
    try:
        sock.listen(limits.backlog)
        listener = _CappedListener(trio.socket.from_stdlib_socket(sock), limits, on_refused)
    except BaseException:
        sock.close()
        raise

    async def close_when_peer_gone(stream: _GuardedStream, scope: trio.CancelScope) -> None:
        # hypercorn keeps a connection whose client closed it while idle until its
        # keep-alive timeout ends; close it at once (or when a request under way is
        # due), so its descriptor and its place under the cap come back.
        await stream.peer_gone.wait()
        deadline = stream.deadline
        await trio.sleep_until(deadline if deadline < math.inf else trio.current_time())
        scope.cancel()

    async def handle(stream: _GuardedStream) -> None:
        try:
            conn: trio.abc.Stream = stream
            if ssl_context is not None:
                if not await _tls_first(stream, limits, on_refused, what):
                    return
                conn = trio.SSLStream(stream, ssl_context, server_side=True, https_compatible=True)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(close_when_peer_gone, stream, nursery.cancel_scope)
                server = TCPServer(asgi, config, context, ConnectionState({}), cast(Any, conn))
                await server.run()
                nursery.cancel_scope.cancel()
        except Exception:  # one connection's fault must not end the server
            peer = _peer_host(stream.socket)
            faults.error(
                peer,
                "server_error",
                "%s: the connection from %s failed unexpectedly and was closed (a bug)",
                what,
                peer,
                exc_info=True,
            )
        finally:
            listener.release()
            await trio.aclose_forcefully(stream)

    try:
        with single_error():
            async with trio.open_nursery() as nursery:
                await nursery.start(trio.serve_listeners, handle, [listener])
                logger.info("%s listening on %s", what, url)
                task_status.started(started)
                await trio.sleep_forever()
    finally:
        await trio.aclose_forcefully(listener)
    raise AssertionError(f"unreachable: the {what} returns only by cancellation")
