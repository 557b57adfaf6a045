"""Secure mode in the shell: CURVE keys, the ZAP handler, TLS and the bootstrap token.

Plain mode, the default, is TokenSpeed's: every socket speaks ZMTP's NULL mechanism
and the bootstrap server plain HTTP, unchanged on the wire. Secure mode is tspd ↔
tspd only (docs/security.md):

* **CURVE on every ZMQ socket.** Each process has one key pair in ZeroMQ's
  certificate format (:func:`zmq.auth.create_certificates`; ``tspd keys
  generate``) and an allow-list directory of the public certificates of every
  process it talks to (:class:`CurveKeys`). A socket that binds is the CURVE
  server; one that connects is a client that must know the server's public key.
* **A ZAP handler in a Trio task** (:class:`CurveGuard`, ZeroMQ RFC 27): one REP
  socket on ``inproc://zeromq.zap.01`` per ZMQ context, served by a Trio system
  task through :class:`~tspd.shell.zmq.TrioSocket`, answers every CURVE handshake
  of that context's server sockets. Each secure component registers a ZAP domain
  with its own allow-list; a client whose key is on it is admitted with its Z85
  public key as ``User-Id`` (read by :meth:`TrioSocket.recv_batch_from
  <tspd.shell.zmq.TrioSocket.recv_batch_from>`), any other is refused and logged
  (rate-limited). Server sockets also set ``ZMQ_ZAP_ENFORCE_DOMAIN``, so without a
  handler libzmq refuses rather than admits. A socket monitor on every server
  socket logs, rate-limited, a peer that does not speak CURVE (a plain-mode tspd or
  a TokenSpeed peer), which libzmq drops before ZAP sees it.
* **The bootstrap server over TLS with a bearer token** (:class:`SecurityConfig`):
  hypercorn's certificate and key on the server, a CA file on the client, and a
  token ``PUT /route`` (and, with ``protect_get``, the ``GET`` routes) must carry.

:meth:`SecurityConfig.from_env` reads the ``TSPD_*`` variables through
:func:`tspd.core.config.parse_security_env`.
"""

from __future__ import annotations

import contextlib
import hmac
import itertools
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Self, final

import trio
import zmq
import zmq.auth
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from tspd.core.config import (
    ENV_BOOTSTRAP_TOKEN_FILE,
    ENV_CURVE_ALLOW_DIR,
    ENV_CURVE_SECRET_KEY_FILE,
    parse_security_env,
)
from tspd.core.errors import ConfigError
from tspd.log import RateLimitedLog, component_logger
from tspd.shell.zmq import TrioSocket

__all__ = [
    "ZAP_ENDPOINT",
    "CurveGuard",
    "CurveKeys",
    "SecurityConfig",
    "check_token",
]

log = component_logger("security")

#: Where libzmq sends ZAP requests (ZeroMQ RFC 27): one handler per context.
ZAP_ENDPOINT: Final = "inproc://zeromq.zap.01"
#: Longest bearer token read from a token file.
MAX_TOKEN_CHARS: Final = 4096

#: Monitor events the server sockets report.
_MONITORED: Final = (
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_domains = itertools.count(1)


@final
@dataclass(frozen=True, slots=True)
class CurveKeys:
    """One process's CURVE key pair and the public keys it admits, all in Z85 text.

    ``names`` maps an admitted key to the name of its certificate file (its stem),
    for log lines. Load with :meth:`load`.
    """

    public_key: str
    secret_key: str = field(repr=False)
    allowed: frozenset[str]
    names: Mapping[str, str] = field(default_factory=dict, compare=False)
    allow_dir: str = ""

    @classmethod
    def load(
        cls, secret_key_file: str | os.PathLike[str], allow_dir: str | os.PathLike[str]
    ) -> Self:
        """Read this process's secret certificate (``*.key_secret``) and every public
        certificate (``*.key``) in ``allow_dir``. A missing or unreadable file, a
        certificate without a secret key, or an allow-list with no key is a
        :class:`ConfigError` that names the path."""
        try:
            public, secret = zmq.auth.load_certificate(secret_key_file)
        except (OSError, ValueError) as err:
            raise ConfigError(
                f"cannot read the CURVE secret certificate {os.fspath(secret_key_file)!r} "
                f"({ENV_CURVE_SECRET_KEY_FILE}): {err}"
            ) from None
        if not secret:
            raise ConfigError(
                f"{os.fspath(secret_key_file)!r} is a public certificate: secure mode needs "
                f"this process's secret certificate (*.key_secret, {ENV_CURVE_SECRET_KEY_FILE})"
            )
        directory = Path(allow_dir)
        if not directory.is_dir():
            raise ConfigError(
                f"the CURVE allow-list directory {os.fspath(allow_dir)!r} "
                f"({ENV_CURVE_ALLOW_DIR}) does not exist"
            )
        names: dict[str, str] = {}
        for path in sorted(directory.glob("*.key")):
            try:
                key, _ = zmq.auth.load_certificate(path)
            except (OSError, ValueError) as err:
                raise ConfigError(
                    f"cannot read the public certificate {str(path)!r}: {err}"
                ) from None
            names[key.decode("ascii")] = path.stem
        if not names:
            raise ConfigError(
                f"the CURVE allow-list directory {os.fspath(allow_dir)!r} has no public "
                "certificate (*.key): nobody could connect"
            )
        return cls(
            public_key=public.decode("ascii"),
            secret_key=secret.decode("ascii"),
            allowed=frozenset(names),
            names=names,
            allow_dir=os.fspath(allow_dir),
        )

    def name_of(self, key: str) -> str:
        """``key``'s certificate name (``"?"`` for a key not on the allow-list)."""
        return self.names.get(key, "?")


def _read_token(path: str) -> str:
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(
            f"cannot read the bootstrap token file {path!r} ({ENV_BOOTSTRAP_TOKEN_FILE}): {err}"
        ) from None
    if not token or len(token) > MAX_TOKEN_CHARS or not token.isprintable() or " " in token:
        raise ConfigError(
            f"the bootstrap token file {path!r} must hold one token of 1..{MAX_TOKEN_CHARS} "
            "printable characters without spaces"
        )
    return token


@final
@dataclass(frozen=True, slots=True)
class SecurityConfig:
    """What secure mode needs in one process (every field optional; see the module doc).

    ``curve``: this process's CURVE keys and allow-list; with them every tspd ZMQ
    socket of the component runs CURVE. ``tls_ca_file``: the CA a bootstrap client
    verifies the server with (the client then speaks HTTPS). ``tls_cert_file`` /
    ``tls_key_file``: a bootstrap server's certificate chain and key (it then serves
    HTTPS only). ``bootstrap_token``: the bearer token a client sends and a server
    requires on ``PUT /route`` (and on the ``GET`` routes with ``protect_get``).
    """

    curve: CurveKeys | None = None
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    bootstrap_token: str | None = field(default=None, repr=False)
    protect_get: bool = False

    def __post_init__(self) -> None:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ConfigError("a TLS bootstrap server needs both a certificate and its key")
        if self.bootstrap_token is not None and not self.bootstrap_token.strip():
            raise ConfigError("the bootstrap token must not be empty")

    @classmethod
    def from_env(cls, environ: Mapping[str, str], **fields: Any) -> Self:
        """Secure-mode settings from tspd's variables in ``environ`` (pass
        ``os.environ``): ``TSPD_CURVE_SECRET_KEY_FILE`` with ``TSPD_CURVE_ALLOW_DIR``,
        ``TSPD_TLS_CA_FILE``, ``TSPD_TLS_CERT_FILE`` with ``TSPD_TLS_KEY_FILE``,
        ``TSPD_BOOTSTRAP_TOKEN_FILE``, ``TSPD_BOOTSTRAP_PROTECT_GET``. Explicit
        ``fields`` win. None of them set: plain mode (:attr:`enabled` is false)."""
        env = parse_security_env(environ)
        values: dict[str, Any] = {
            "tls_ca_file": env.tls_ca_file,
            "tls_cert_file": env.tls_cert_file,
            "tls_key_file": env.tls_key_file,
            "protect_get": env.protect_get,
        }
        if "curve" not in fields and env.curve_secret_key_file and env.curve_allow_dir:
            values["curve"] = CurveKeys.load(env.curve_secret_key_file, env.curve_allow_dir)
        if "bootstrap_token" not in fields and env.bootstrap_token_file:
            values["bootstrap_token"] = _read_token(env.bootstrap_token_file)
        values.update(fields)
        return cls(**values)

    @classmethod
    def from_files(
        cls,
        *,
        secret_key_file: str | os.PathLike[str] | None = None,
        allow_dir: str | os.PathLike[str] | None = None,
        tls_ca_file: str | None = None,
        tls_cert_file: str | None = None,
        tls_key_file: str | None = None,
        token_file: str | None = None,
        protect_get: bool = False,
    ) -> Self:
        """Secure-mode settings from files (the layout ``tspd keys generate`` writes)."""
        if (secret_key_file is None) != (allow_dir is None):
            raise ConfigError("CURVE needs both the secret key file and the allow-list directory")
        curve = (
            CurveKeys.load(secret_key_file, allow_dir)
            if secret_key_file is not None and allow_dir is not None
            else None
        )
        return cls(
            curve=curve,
            tls_ca_file=tls_ca_file,
            tls_cert_file=tls_cert_file,
            tls_key_file=tls_key_file,
            bootstrap_token=_read_token(token_file) if token_file else None,
            protect_get=protect_get,
        )

    @property
    def enabled(self) -> bool:
        """Whether anything of secure mode is configured."""
        return bool(self.curve or self.tls_ca_file or self.tls_cert_file or self.bootstrap_token)

    @property
    def scheme(self) -> str:
        """``https`` for a client that verifies the server with a CA, else ``http``."""
        return "https" if self.tls_ca_file else "http"

    def client_ssl_context(self) -> ssl.SSLContext | None:
        """The context a bootstrap client verifies the server with (``None``: plain
        HTTP). The certificate must name the host the client connects to."""
        if self.tls_ca_file is None:
            return None
        try:
            return ssl.create_default_context(cafile=self.tls_ca_file)
        except (OSError, ssl.SSLError) as err:
            raise ConfigError(f"cannot read the TLS CA file {self.tls_ca_file!r}: {err}") from None

    def server_ssl_context(self) -> ssl.SSLContext | None:
        """hypercorn's server context for ``tls_cert_file``/``tls_key_file`` (``None``:
        plain HTTP)."""
        if self.tls_cert_file is None or self.tls_key_file is None:
            return None
        from hypercorn.config import Config as HypercornConfig

        config = HypercornConfig()
        config.certfile = self.tls_cert_file
        config.keyfile = self.tls_key_file
        try:
            context = config.create_ssl_context()
        except (OSError, ssl.SSLError) as err:
            raise ConfigError(
                f"cannot load the TLS certificate {self.tls_cert_file!r} and key "
                f"{self.tls_key_file!r}: {err}"
            ) from None
        assert context is not None
        return context


def check_token(expected: str, authorization: str | None) -> int | None:
    """Check an ``Authorization`` header against the bearer token: ``None`` when it
    matches, ``401`` when there is none, ``403`` when it is wrong (compared in
    constant time)."""
    if not authorization:
        return 401
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token:
        return 401
    if not hmac.compare_digest(token.strip().encode(), expected.encode()):
        return 403
    return None


# ------------------------------------------------------------------------------- ZAP


@final
class _Domain:
    """One secure component's ZAP policy."""

    __slots__ = ("accepted", "keys", "name", "refused")

    def __init__(self, keys: CurveKeys, name: str) -> None:
        self.keys = keys
        self.name = name
        self.accepted = 0
        self.refused = 0


@final
class _ZapService:
    """The ZAP handler of one ZMQ context in one Trio run (a Trio system task)."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]]) -> None:
        raw = context.socket(zmq.REP)
        try:
            raw.setsockopt(zmq.LINGER, 0)
            raw.bind(ZAP_ENDPOINT)
        except zmq.ZMQError as err:
            raw.close(linger=0)
            raise ConfigError(
                f"cannot serve ZAP on this ZMQ context ({err}): another ZAP handler (pyzmq's "
                "authenticator?) is bound there; give tspd's secure sockets a context of "
                "their own"
            ) from None
        self.sock = TrioSocket(raw, max_frames=16, name="ZAP handler")
        self.domains: dict[bytes, _Domain] = {}
        self.refusals = RateLimitedLog(log)

    async def run(self) -> None:
        sock = self.sock
        try:
            while True:
                request = await sock.recv_multipart()
                await sock.send_multipart(self.answer(request))
        except trio.ClosedResourceError:
            pass
        except Exception:  # a system task must not raise; secure sockets then fail closed
            log.exception("the ZAP handler stopped; secure sockets now refuse every client")
        finally:
            self.close()  # also when the Trio run ends with guards still open

    def answer(self, request: list[bytes]) -> list[bytes]:
        """The reply to one ZAP request (RFC 27): 200 with the key as User-Id for an
        allow-listed CURVE client of a known domain, 400 otherwise."""
        if len(request) < 6 or request[0] != b"1.0":
            version, request_id = b"1.0", request[1] if len(request) > 1 else b""
            return [version, request_id, b"500", b"malformed ZAP request", b"", b""]
        request_id, domain_name, address, mechanism = request[1], request[2], request[3], request[5]
        domain = self.domains.get(domain_name)
        peer = address.decode("ascii", "replace")[:64]
        if domain is None:
            return [b"1.0", request_id, b"400", b"unknown ZAP domain", b"", b""]
        if mechanism != b"CURVE" or len(request) != 7 or len(request[6]) != 32:
            domain.refused += 1
            self.refusals.warning(
                peer,
                "not-curve",
                "%s refused a %s peer from %s: secure mode admits CURVE clients only",
                domain.name,
                mechanism.decode("ascii", "replace")[:16],
                peer,
            )
            return [b"1.0", request_id, b"400", b"CURVE required", b"", b""]
        key = z85.encode(request[6]).decode("ascii")
        if key not in domain.keys.allowed:
            domain.refused += 1
            self.refusals.warning(
                peer,
                "not-allowed",
                "%s refused a CURVE client from %s: its public key %s is not in the "
                "allow-list %s (docs/security.md)",
                domain.name,
                peer,
                key,
                domain.keys.allow_dir,
            )
            return [b"1.0", request_id, b"400", b"key not allowed", b"", b""]
        domain.accepted += 1
        return [b"1.0", request_id, b"200", b"OK", key.encode("ascii"), b""]

    def close(self) -> None:
        raw = self.sock.sock
        if not self.sock.closed:
            with contextlib.suppress(zmq.ZMQError):
                raw.unbind(ZAP_ENDPOINT)  # at once, so a new handler can bind
        self.sock.close()


_services: trio.lowlevel.RunVar[dict[int, _ZapService]] = trio.lowlevel.RunVar("tspd_zap")


def _services_here() -> dict[int, _ZapService]:
    try:
        return _services.get()
    except LookupError:
        services: dict[int, _ZapService] = {}
        _services.set(services)
        return services


_PLAIN_PEER: Final = (
    "%s (%s) dropped a peer that does not speak CURVE: a plain-mode tspd or a TokenSpeed "
    "peer. Secure mode refuses plain peers (docs/security.md)"
)


@final
class CurveGuard:
    """CURVE for one secure component (a peer, an agreement, a publisher...): its keys,
    its ZAP domain on ``context`` and the monitors of its server sockets.

    Open it inside a Trio run before binding any server socket, and close it after
    the component's sockets (use it as a context manager). The first guard of a
    context starts the context's ZAP handler as a Trio system task; the last one
    closes it.
    """

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], keys: CurveKeys, name: str) -> None:
        self.keys = keys
        self.name = name
        self._context = context
        self._domain = f"tspd-{next(_domains)}".encode()
        self._monitors: list[tuple[zmq.Socket[bytes], TrioSocket]] = []
        self._closed = False
        services = _services_here()
        service = services.get(id(context))
        if service is None:
            service = _ZapService(context)
            services[id(context)] = service
            trio.lowlevel.spawn_system_task(service.run, name="tspd ZAP handler")
        self._service = service
        service.domains[self._domain] = _Domain(keys, name)
        self._log = RateLimitedLog(log)

    @property
    def public_key(self) -> str:
        """This process's public key (Z85): what peers need as the server key."""
        return self.keys.public_key

    @property
    def refused(self) -> int:
        """CURVE clients the ZAP handler refused for this component."""
        return self._service.domains[self._domain].refused if not self._closed else 0

    def server(self, sock: TrioSocket, what: str) -> None:
        """Make ``sock`` a CURVE server of this component (before it binds) and watch
        its handshakes."""
        raw = sock.sock
        raw.setsockopt(zmq.CURVE_SERVER, 1)
        raw.setsockopt(zmq.CURVE_SECRETKEY, self.keys.secret_key.encode("ascii"))
        raw.setsockopt(zmq.CURVE_PUBLICKEY, self.keys.public_key.encode("ascii"))
        raw.setsockopt(zmq.ZAP_DOMAIN, self._domain)
        raw.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        monitor = raw.get_monitor_socket(_MONITORED)
        watcher = TrioSocket(monitor, name=f"monitor of {what}")
        self._monitors.append((raw, watcher))
        trio.lowlevel.spawn_system_task(self._watch, watcher, what, name=f"tspd monitor {what}")

    def client(self, sock: TrioSocket | zmq.Socket[bytes], server_key: str) -> None:
        """Make ``sock`` a CURVE client of the server whose public key is
        ``server_key`` (Z85; before it connects)."""
        raw = sock.sock if isinstance(sock, TrioSocket) else sock
        raw.setsockopt(zmq.CURVE_SERVERKEY, server_key.encode("ascii"))
        raw.setsockopt(zmq.CURVE_PUBLICKEY, self.keys.public_key.encode("ascii"))
        raw.setsockopt(zmq.CURVE_SECRETKEY, self.keys.secret_key.encode("ascii"))

    async def _watch(self, watcher: TrioSocket, what: str) -> None:
        try:
            while True:
                event = parse_monitor_message(await watcher.recv_multipart())
                self._report(event, what)
        except trio.ClosedResourceError:
            pass
        except Exception:  # a system task must not raise
            log.exception("the handshake monitor of %s stopped", what)
        finally:
            watcher.close()

    def _report(self, event: Mapping[str, object], what: str) -> None:
        kind, value = event["event"], int(event["value"])  # type: ignore[call-overload]
        raw_endpoint = event.get("endpoint")
        endpoint = (
            raw_endpoint.decode("ascii", "replace") if isinstance(raw_endpoint, bytes) else "?"
        )
        where = f"{what} on {endpoint}"
        if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
                self._log.warning(endpoint, "plain-peer", _PLAIN_PEER, self.name, where)
            else:
                self._log.warning(
                    endpoint,
                    "handshake",
                    "%s (%s) dropped a peer that failed the CURVE handshake (%s): a client "
                    "with another server key, or not a tspd peer",
                    self.name,
                    where,
                    _event_name(value),
                )
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            log.debug("%s (%s): a connection closed during its handshake", self.name, where)

    def close(self) -> None:
        """Stop the monitors and leave the ZAP handler (closed with its last guard)."""
        if self._closed:
            return
        self._closed = True
        for raw, watcher in self._monitors:
            if not raw.closed:
                with contextlib.suppress(zmq.ZMQError):
                    raw.disable_monitor()
            watcher.close()
        self._monitors.clear()
        service = self._service
        service.domains.pop(self._domain, None)
        if not service.domains:
            service.close()
            services = _services_here()
            if services.get(id(self._context)) is service:
                del services[id(self._context)]

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _event_name(value: int) -> str:
    try:
        return zmq.Event(value).name or str(value)
    except ValueError:
        return str(value)
