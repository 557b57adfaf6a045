"""The bootstrap server's state and the payloads its clients send and read.

The bootstrap server (docs/protocol.md#proto-bootstrap) is the HTTP rendezvous of one
Prefill instance: each Prefill rank ``PUT``\\ s its control endpoint and cache contract
to ``/route``; Decode ranks ``GET`` the instance's parallel info and each target rank's
endpoint. This module is the sans-IO part: :class:`BootstrapState` turns a request
(method, query, body) into an :class:`HttpReply`; the HTTP stack in
:mod:`tspd.shell.bootstrap` only carries bytes. The client half builds the ``PUT`` body
of a Prefill rank and parses the two ``GET`` replies, raising :class:`WireError` for a
reply that cannot be used.

Readiness (a tspd decision, beyond S1): until every one of the instance's
``world_size`` Prefill ranks has registered, both ``GET /route`` forms answer
``503`` with ``Bootstrap server is waiting for {missing} of {world_size} Prefill
ranks`` (before the first ``PUT``: ``Bootstrap server is waiting for its first
Prefill rank``). TokenSpeed would hand out a partial table or null sizes; a Decode
treats any non-200 as a failed request either way, and answering "not yet" keeps a
Decode from planning against an instance whose contract or endpoints are still
arriving. ``GET /health`` stays ``200`` throughout: it reports liveness, and Decode
heartbeats must not declare a starting instance dead.

Refusals (a tspd decision: TokenSpeed answers every bad ``PUT`` with a generic
``500``, and its clients only tell ``200`` from anything else, so this costs no
compatibility): a request that is wrong is answered ``4xx`` with a plain-text body
that says what was wrong and, where it helps, what to do — ``400`` for a body or
query that cannot be used (not JSON, a missing or ill-typed field, an address, port
or size out of range, an invalid contract), ``409`` for a registration that
contradicts what the instance registered before (another contract, stage placement
or world/DP size), ``404`` for an unknown route or rank, ``405`` for another method.
The message is the specification's, verbatim, where it fixes one. ``500`` is left
for a fault of the server itself. Every refusal carries a short ``reason`` (one of
:data:`REFUSAL_REASONS`) for logs and metrics.

Everything a ``PUT`` says is checked before anything is stored, and what is stored
is bounded by the checked sizes: ``world_size`` at most :data:`MAX_WORLD_SIZE`, the
Prefill TP per DP group (and stage) at most ``MAX_CACHE_TP_SIZE``, ``rank_ip`` a host
name or IP literal (:func:`is_valid_host`), ``rank_port`` in ``1..65535``,
``engine_rank`` below the world size. Re-registration follows the specification
(a rank's later ``PUT`` replaces its endpoint, as a restarted rank's does) except
that a ``PUT`` whose ``world_size``/``dp_size`` differ from the ones registered first
is refused with ``409`` instead of being filed under sizes the instance does not
have. The client half applies the same checks to what a server returns, so a reply
from a server that checks nothing fails the request, never the caller.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeGuard

from tspd.core.contract import MAX_CONTRACT_BYTES, parse_contract
from tspd.core.errors import TspdError, WireError
from tspd.core.topology import MAX_CACHE_TP_SIZE

__all__ = [
    "BAD_LAYOUT",
    "CURVE_KEY_FIELD",
    "INCOMPATIBLE_LAYOUTS",
    "LAYOUT_NOT_STRING",
    "MAX_HOST_CHARS",
    "MAX_ROLE_CHARS",
    "MAX_WORLD_SIZE",
    "METHOD_NOT_ALLOWED",
    "MISSING_INPUTS",
    "REFUSAL_REASONS",
    "STAGING_FIELD",
    "BootstrapState",
    "HttpReply",
    "ParallelInfo",
    "RankInfo",
    "build_route_payload",
    "encode_route_payload",
    "is_curve_key",
    "is_valid_host",
    "parse_parallel_info",
    "parse_rank_info",
    "parse_route_payload",
]

LAYOUT_NOT_STRING: Final = "CachePD bootstrap layout must be a string"
BAD_LAYOUT: Final = "CachePD bootstrap layout is invalid"
INCOMPATIBLE_LAYOUTS: Final = "CachePD prefill ranks registered incompatible layouts"
PLACEMENT_REQUIRED: Final = "CachePD requires explicit stage field placement"
PLACEMENT_COVERAGE: Final = "cache stage placement must cover every logical field exactly once"
PLACEMENT_STAGES: Final = "CachePD placement does not match pipeline stage count"
INCOMPATIBLE_PLACEMENT: Final = "CachePD prefill ranks registered incompatible field placement"
MISSING_INPUTS: Final = "Missing inputs for bootstrap server."
METHOD_NOT_ALLOWED: Final = "Method not allowed"

MAX_WORLD_SIZE: Final = 4096
"""Largest Prefill world size (TP x DP, x PP in S3) a ``PUT`` may declare or a
parallel-info reply may report; each DP group's (and stage's) TP is further bounded
by ``MAX_CACHE_TP_SIZE`` (1024)."""
MAX_HOST_CHARS: Final = 253
"""Longest ``rank_ip`` (the longest DNS name)."""
MAX_ROLE_CHARS: Final = 64
"""Longest ``role`` string."""
_MAX_QUERY_CHARS: Final = 20

CURVE_KEY_FIELD: Final = "curve_public_key"
"""The ``PUT /route`` field, and the rank-info reply field, that carries a secure-mode
Prefill rank's CURVE public key (Z85, 40 characters; docs/security.md). A plain rank
sends none, and its reply is then exactly TokenSpeed's."""

STAGING_FIELD: Final = "tspd_staging"
"""The ``PUT /route`` field, and the rank-info reply field, by which a tspd Prefill
rank offers staged transfers (``true``; docs/wire.md#staged-transfers). Absent or
``false``: the plain protocol, and the reply is exactly TokenSpeed's. TokenSpeed's
Decode ignores the field; a tspd Decode then adds the staging frames for that rank
only."""

#: Z85's alphabet (ZeroMQ RFC 32).
_Z85: Final = frozenset(
    "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
)

#: Why a request was refused: the ``reason`` of a refusing :class:`HttpReply` (the
#: first eight), of the HTTP layer (the next four), of a secure server (the next
#: three: no or a wrong token, a route held by a live rank of another identity, plain
#: HTTP to a TLS server) or ``"other"`` (a refusal without a known reason, e.g. from
#: a subclass): a bounded label set for logs and metrics.
REFUSAL_REASONS: Final = (
    "bad_body",
    "bad_field",
    "bad_layout",
    "conflict",
    "bad_query",
    "unknown_rank",
    "not_found",
    "method_not_allowed",
    "body_too_large",
    "request_timeout",
    "connection_limit",
    "server_error",
    "unauthorized",
    "identity_conflict",
    "tls_required",
    "other",
)

_TEXT: Final = "text/plain; charset=utf-8"
_JSON: Final = "application/json"


@dataclass(frozen=True, slots=True)
class HttpReply:
    """One HTTP answer: status, body text and content type; a refusal (``4xx``) also
    has its ``reason``, one of :data:`REFUSAL_REASONS`."""

    status: int
    body: str
    content_type: str = _TEXT
    reason: str = ""

    @classmethod
    def ok(cls) -> HttpReply:
        """``200 OK`` with body ``OK`` (``PUT /route`` and ``/health``)."""
        return cls(200, "OK")

    @classmethod
    def json(cls, value: Mapping[str, Any]) -> HttpReply:
        """``200`` with a JSON body."""
        return cls(200, json.dumps(value), _JSON)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


class _Refused(WireError):
    """A request the server refuses: its status, its reason and the message."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason

    def reply(self) -> HttpReply:
        return HttpReply(self.status, str(self), _TEXT, self.reason)


def _bad(reason: str, message: str) -> _Refused:
    return _Refused(400, reason, message)


def _shown(value: object, limit: int = 64) -> str:
    """``repr(value)``, cut to ``limit`` characters: what a message may echo of
    something a client sent."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


_LABEL: Final = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9])?\Z")


def is_valid_host(host: str) -> bool:
    """Whether ``host`` is a host name (RFC 1123 labels, underscores allowed inside
    a label; the last label not all digits), an IPv4 address or an IPv6 address
    without zone: what a control endpoint may name. ``"*"``, ``""``, text with
    spaces or control characters, ``"1.2.3"`` and names over
    :data:`MAX_HOST_CHARS` are not."""
    if not isinstance(host, str) or not 0 < len(host) <= MAX_HOST_CHARS or not host.isascii():
        return False
    if ":" in host:
        if "%" in host:
            return False
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return False
        return True
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        pass
    else:
        return True
    labels = host.removesuffix(".").split(".")
    return all(_LABEL.match(label) for label in labels) and not labels[-1].isdigit()


def is_curve_key(value: object) -> TypeGuard[str]:
    """Whether ``value`` is a CURVE public key in Z85 text (40 characters)."""
    return isinstance(value, str) and len(value) == 40 and _Z85.issuperset(value)


@dataclass(frozen=True, slots=True)
class _Registration:
    """One Prefill rank's endpoint in the port table, with its CURVE public key when
    the rank runs in secure mode."""

    rank_ip: str
    rank_port: int
    curve_key: str | None = None
    staging: bool = False


class BootstrapState:
    """What one bootstrap server knows, fed request by request
    (docs/protocol.md#proto-bootstrap-put, docs/protocol.md#proto-parallel-info).

    ``compat=True`` parses contracts with the S3 group-spec extras accepted
    (``replayable``, ``shard_count``). S3 peers' ``cache_fields_by_stage`` and
    ``pp_size`` are validated and stored whenever a ``PUT`` carries them, and the
    parallel-info reply then includes ``prefill_pp_size`` and
    ``cache_fields_by_stage``; S1 ``PUT``\\ s without them work unchanged.
    """

    def __init__(self, *, compat: bool = False) -> None:
        self._compat = compat
        self.world_size: int | None = None
        self.dp_size: int | None = None
        self.pp_size: int | None = None
        self.cache_layout: str | None = None
        self.fields_by_stage: tuple[tuple[str, ...], ...] | None = None
        self._table: dict[int, dict[int, _Registration]] = {}

    # -- dispatch --------------------------------------------------------------

    def handle(self, method: str, path: str, query: Mapping[str, str], body: bytes) -> HttpReply:
        """Answer one request (docs/protocol.md#proto-bootstrap-routes)."""
        if path == "/health":
            if method in ("GET", "HEAD"):
                return HttpReply.ok()
            return HttpReply(405, METHOD_NOT_ALLOWED, _JSON, "method_not_allowed")
        if path != "/route":
            return HttpReply(
                404,
                f"no route {_shown(path)} on this bootstrap server: it serves /route and /health",
                _TEXT,
                "not_found",
            )
        if method == "PUT":
            return self.put_route(body)
        if method in ("GET", "HEAD"):  # the HTTP layer drops a HEAD reply's body
            return self.get_route(query)
        return HttpReply(405, METHOD_NOT_ALLOWED, _JSON, "method_not_allowed")

    # -- PUT -------------------------------------------------------------------

    def put_route(self, body: bytes) -> HttpReply:
        """Register one rank (docs/protocol.md#proto-bootstrap-put, in the reference's
        order). A refused ``PUT`` (``400`` or ``409``, see the module docstring) leaves
        the state unchanged."""
        try:
            payload = json.loads(body)
        except (ValueError, UnicodeDecodeError, RecursionError):
            return _bad("bad_body", "bootstrap PUT body is not JSON").reply()
        if not isinstance(payload, dict):
            return _bad("bad_body", "bootstrap PUT body must be a JSON object").reply()
        try:
            self._register(payload)
        except _Refused as err:
            return err.reply()
        return HttpReply.ok()

    def _register(self, payload: dict[str, Any]) -> None:
        layout = self._checked_layout(payload)
        placement, pp_size = self._checked_placement(payload, layout)
        role = _field(payload, "role", str)
        if len(role) > MAX_ROLE_CHARS:
            raise _bad(
                "bad_field", f"bootstrap PUT role is longer than {MAX_ROLE_CHARS} characters"
            )
        world_size = _field(payload, "world_size", int)
        dp_size = _field(payload, "dp_size", int)
        _check_sizes(world_size, dp_size, pp_size if placement is not None else None)
        if self.world_size is not None and (world_size, dp_size) != (self.world_size, self.dp_size):
            raise _Refused(
                409,
                "conflict",
                f"bootstrap PUT has world_size={world_size} and dp_size={dp_size}, but this "
                f"Prefill instance registered world_size={self.world_size} and "
                f"dp_size={self.dp_size}: every rank of an instance must send the same sizes "
                "(restart the bootstrap server to serve a resized instance)",
            )
        registration: tuple[int, int, _Registration] | None = None
        if role == "Prefill":
            rank_ip = _field(payload, "rank_ip", str)
            rank_port = _field(payload, "rank_port", int)
            engine_rank = _field(payload, "engine_rank", int)
            if not 0 <= engine_rank < world_size:
                raise _bad(
                    "bad_field",
                    f"bootstrap PUT has engine_rank={_shown(engine_rank)} outside "
                    f"[0, {world_size})",
                )
            if not is_valid_host(rank_ip) or not 0 < rank_port < 65536:
                raise _bad(
                    "bad_field",
                    f"bootstrap PUT from engine_rank={engine_rank} has an unusable control "
                    f"endpoint {_shown(rank_ip)}:{_shown(rank_port)}: rank_ip must be a host "
                    "name or an IPv4/IPv6 address Decode ranks can reach and rank_port in "
                    "1..65535",
                )
            curve_key = payload.get(CURVE_KEY_FIELD)
            if curve_key is not None and not is_curve_key(curve_key):
                raise _bad(
                    "bad_field",
                    f"bootstrap PUT field {CURVE_KEY_FIELD!r} must be a CURVE public key in "
                    f"Z85 (40 characters), got {_shown(curve_key)}",
                )
            staging = payload.get(STAGING_FIELD, False)
            if not isinstance(staging, bool):
                raise _bad(
                    "bad_field",
                    f"bootstrap PUT field {STAGING_FIELD!r} must be true or false, got "
                    f"{_shown(staging)}",
                )
            tp_per_dp = world_size // dp_size
            registration = (
                engine_rank // tp_per_dp,
                engine_rank % tp_per_dp,
                _Registration(rank_ip, rank_port, curve_key, staging),
            )
        # Every check passed: commit.
        self.cache_layout = layout
        if placement is not None:
            self.fields_by_stage = placement
            self.pp_size = pp_size
        if self.world_size is None:
            self.world_size, self.dp_size = world_size, dp_size
        if registration is not None:
            dp_group, tp_in_dp, entry = registration
            self._table.setdefault(dp_group, {})[tp_in_dp] = entry

    def _checked_layout(self, payload: Mapping[str, Any]) -> str:
        layout = payload.get("cache_layout")
        if not isinstance(layout, str):
            raise _bad("bad_layout", LAYOUT_NOT_STRING)
        try:
            canonical = parse_contract(layout, compat=self._compat).to_json().decode("ascii")
        except (TspdError, ValueError) as err:
            raise _bad("bad_layout", BAD_LAYOUT) from err
        if self.cache_layout is not None and canonical != self.cache_layout:
            raise _Refused(409, "conflict", INCOMPATIBLE_LAYOUTS)
        return canonical

    def _checked_placement(
        self, payload: Mapping[str, Any], layout: str
    ) -> tuple[tuple[tuple[str, ...], ...] | None, int | None]:
        if "cache_fields_by_stage" not in payload:
            return None, None
        raw = payload["cache_fields_by_stage"]
        if not isinstance(raw, list) or not all(
            isinstance(stage, list) and all(isinstance(f, str) for f in stage) for stage in raw
        ):
            raise _bad("bad_layout", PLACEMENT_REQUIRED)
        placement = tuple(tuple(stage) for stage in raw)
        placed = [f for stage in placement for f in stage]
        logical = [f["field_id"] for f in json.loads(layout)["plan"]["fields"]]
        if len(placed) != len(set(placed)) or set(placed) != set(logical):
            raise _bad("bad_layout", PLACEMENT_COVERAGE)
        pp_size = payload.get("pp_size", self.pp_size if self.pp_size is not None else 1)
        if not _is_int(pp_size) or pp_size <= 0 or len(placement) != pp_size:
            raise _bad("bad_layout", PLACEMENT_STAGES)
        if self.fields_by_stage is not None and placement != self.fields_by_stage:
            raise _Refused(409, "conflict", INCOMPATIBLE_PLACEMENT)
        return placement, int(pp_size)

    # -- GET -------------------------------------------------------------------

    @property
    def registered_ranks(self) -> int:
        """How many distinct Prefill ranks have registered."""
        return sum(len(ranks) for ranks in self._table.values())

    def waiting_reason(self) -> str | None:
        """Why the ``GET`` routes answer ``503`` now, or ``None`` once every rank
        of the instance has registered."""
        if self.world_size is None:
            return "Bootstrap server is waiting for its first Prefill rank"
        missing = self.world_size - self.registered_ranks
        if missing > 0:
            return f"Bootstrap server is waiting for {missing} of {self.world_size} Prefill ranks"
        return None

    def parallel_info(self) -> dict[str, Any]:
        """The parallel-info object (docs/protocol.md#proto-parallel-info) as stored now."""
        info: dict[str, Any] = {
            "prefill_tp_size": self.world_size,
            "prefill_dp_size": self.dp_size,
            "cache_layout": self.cache_layout,
        }
        if self.fields_by_stage is not None:
            info["prefill_pp_size"] = self.pp_size
            info["cache_fields_by_stage"] = [list(stage) for stage in self.fields_by_stage]
        return info

    def get_route(self, query: Mapping[str, str]) -> HttpReply:
        """Answer ``GET /route`` (docs/protocol.md#proto-bootstrap-routes, plus the
        readiness rule of this module)."""
        engine_rank_text = query.get("engine_rank", "")
        dp_group_text = query.get("target_dp_group", "")
        if not engine_rank_text or not dp_group_text:
            return HttpReply(400, MISSING_INPUTS, _TEXT, "bad_query")
        engine_rank, dp_group = _query_int(engine_rank_text), _query_int(dp_group_text)
        if engine_rank is None or dp_group is None:
            return _bad(
                "bad_query",
                f"bootstrap GET /route needs integer engine_rank and target_dp_group, got "
                f"{_shown(engine_rank_text)} and {_shown(dp_group_text)}",
            ).reply()
        waiting = self.waiting_reason()
        if waiting is not None:
            return HttpReply(503, waiting)
        if engine_rank == -1 and dp_group == -1:
            return HttpReply.json(self.parallel_info())
        entry = self._table.get(dp_group, {}).get(engine_rank)
        if entry is None:
            return HttpReply(
                404,
                f"Bootstrap info not found for engine_rank={engine_rank} "
                f"target_dp_group={dp_group}: this Prefill instance has "
                f"dp_size={self.dp_size} and {self.world_size} ranks",
                _TEXT,
                "unknown_rank",
            )
        reply: dict[str, Any] = {"rank_ip": entry.rank_ip, "rank_port": entry.rank_port}
        if entry.curve_key is not None:
            reply[CURVE_KEY_FIELD] = entry.curve_key
        if entry.staging:
            reply[STAGING_FIELD] = True
        return HttpReply.json(reply)

    def identity_conflict(self, body: bytes) -> tuple[str, int, str | None] | None:
        """The registration a Prefill rank's ``PUT`` would replace when it is held by
        another identity (another CURVE public key, or a key where the ``PUT`` has
        none, or none where it has one): ``(rank_ip, rank_port, curve_key)`` of the
        holder, else ``None`` (also for a body :meth:`put_route` would refuse
        anyway). A secure server replaces such a route only once its holder is no
        longer live (docs/security.md)."""
        try:
            payload = json.loads(body)
        except (ValueError, UnicodeDecodeError, RecursionError):
            return None
        if not isinstance(payload, dict) or payload.get("role") != "Prefill":
            return None
        world_size, dp_size = payload.get("world_size"), payload.get("dp_size")
        engine_rank = payload.get("engine_rank")
        if not (_is_int(world_size) and _is_int(dp_size) and _is_int(engine_rank)):
            return None
        if not (0 < dp_size <= world_size and world_size % dp_size == 0):
            return None
        tp_per_dp = world_size // dp_size
        held = self._table.get(engine_rank // tp_per_dp, {}).get(engine_rank % tp_per_dp)
        if held is None or held.curve_key == payload.get(CURVE_KEY_FIELD):
            return None
        return held.rank_ip, held.rank_port, held.curve_key


def _query_int(text: str) -> int | None:
    """A query parameter as an int (TokenSpeed's ``int()``), or ``None``; at most
    a few digits are read."""
    if len(text) > _MAX_QUERY_CHARS:
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _field(payload: Mapping[str, Any], key: str, kind: type) -> Any:
    """``payload[key]`` checked against ``kind`` (bool is not an int)."""
    if key not in payload:
        raise _bad("bad_field", f"bootstrap PUT body lacks {key!r}")
    value = payload[key]
    if (kind is int and not _is_int(value)) or not isinstance(value, kind):
        raise _bad(
            "bad_field",
            f"bootstrap PUT field {key!r} must be {kind.__name__}, got {type(value).__name__}",
        )
    return value


def _size_problem(world_size: int, dp_size: int, pp_size: int | None, world: str) -> str | None:
    """What is wrong with a Prefill instance's sizes, or ``None``: ``world`` names
    the world size in the message (``world_size`` or ``prefill_tp_size``)."""
    dp = "dp_size" if world == "world_size" else "prefill_dp_size"
    pp = "pp_size" if world == "world_size" else "prefill_pp_size"
    if not 0 < world_size <= MAX_WORLD_SIZE:
        return f"{world}={_shown(world_size)} is outside [1, {MAX_WORLD_SIZE}]"
    if not 0 < dp_size <= world_size:
        return f"{dp}={_shown(dp_size)} is outside [1, {world}={world_size}]"
    groups = dp_size * (pp_size or 1)
    if pp_size is not None and not 0 < pp_size <= world_size:
        return f"{pp}={_shown(pp_size)} is outside [1, {world}={world_size}]"
    if world_size % groups:
        return f"{world}={world_size} is not a multiple of {dp}={dp_size}" + (
            f" * {pp}={pp_size}" if pp_size is not None else ""
        )
    if world_size // groups > MAX_CACHE_TP_SIZE:
        return (
            f"{world}={world_size} gives {world_size // groups} TP ranks per DP group"
            + (" and stage" if pp_size is not None else "")
            + f", more than {MAX_CACHE_TP_SIZE}"
        )
    return None


def _check_sizes(world_size: int, dp_size: int, pp_size: int | None) -> None:
    problem = _size_problem(world_size, dp_size, pp_size, "world_size")
    if problem is not None:
        raise _bad(
            "bad_field",
            f"bootstrap PUT has unusable sizes: {problem}; world_size is the Prefill "
            "instance's TP x DP (x PP) size, a multiple of dp_size (x pp_size)",
        )


# --------------------------------------------------------------------------- clients


def build_route_payload(
    *,
    rank_ip: str,
    rank_port: int,
    engine_rank: int,
    world_size: int,
    dp_size: int,
    cache_layout: str | bytes,
    role: str = "Prefill",
    pp_size: int | None = None,
    cache_fields_by_stage: Sequence[Sequence[str]] | None = None,
) -> dict[str, Any]:
    """The ``PUT /route`` body of one Prefill rank (docs/protocol.md#proto-bootstrap-put).
    The S3 keys are added only when ``cache_fields_by_stage`` is given."""
    layout = cache_layout.decode("ascii") if isinstance(cache_layout, bytes) else cache_layout
    payload: dict[str, Any] = {
        "role": role,
        "world_size": world_size,
        "dp_size": dp_size,
        "rank_ip": rank_ip,
        "rank_port": rank_port,
        "engine_rank": engine_rank,
        "cache_layout": layout,
    }
    if cache_fields_by_stage is not None:
        payload["pp_size"] = len(cache_fields_by_stage) if pp_size is None else pp_size
        payload["cache_fields_by_stage"] = [list(stage) for stage in cache_fields_by_stage]
    return payload


def encode_route_payload(payload: Mapping[str, Any]) -> bytes:
    """A ``PUT /route`` body as JSON bytes."""
    return json.dumps(dict(payload), separators=(",", ":")).encode("utf-8")


def parse_route_payload(body: bytes) -> dict[str, Any]:
    """Decode a ``PUT /route`` body to its object, or raise :class:`WireError`."""
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError) as err:
        raise WireError("bootstrap PUT body is not JSON") from err
    if not isinstance(payload, dict):
        raise WireError("bootstrap PUT body must be a JSON object")
    return payload


@dataclass(frozen=True, slots=True)
class ParallelInfo:
    """A Prefill instance's parallel info as Decode uses it
    (docs/protocol.md#proto-parallel-info)."""

    tp_size: int
    dp_size: int
    cache_layout: str
    pp_size: int | None = None
    fields_by_stage: tuple[tuple[str, ...], ...] | None = None

    @property
    def tp_size_per_dp(self) -> int:
        """Prefill TP ranks per DP group: ``tp // dp`` (S3: ``tp // (dp * pp)``)."""
        return self.tp_size // (self.dp_size * (self.pp_size or 1))


@dataclass(frozen=True, slots=True)
class RankInfo:
    """One Prefill rank's control endpoint, and its CURVE public key (Z85) when it
    runs in secure mode (``None``: a plain rank)."""

    rank_ip: str
    rank_port: int
    curve_key: str | None = None
    #: The rank offers staged transfers (:data:`STAGING_FIELD`).
    staging: bool = False

    @property
    def endpoint(self) -> str:
        """``tcp://{rank_ip}:{rank_port}``: where Decode's PUSH connects."""
        return f"tcp://{self.rank_ip}:{self.rank_port}"


def _reply_object(body: bytes | str, what: str) -> dict[str, Any]:
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError) as err:
        raise WireError(f"bootstrap {what} reply is not JSON") from err
    if not isinstance(value, dict):
        raise WireError(f"bootstrap {what} reply must be a JSON object")
    return value


def parse_parallel_info(body: bytes | str) -> ParallelInfo:
    """Decode a parallel-info reply; null or ill-typed sizes or layout (a server
    with no registered rank) raise :class:`WireError`."""
    obj = _reply_object(body, "parallel-info")
    tp: object = obj.get("prefill_tp_size")
    dp: object = obj.get("prefill_dp_size")
    layout: object = obj.get("cache_layout")
    if not _is_int(tp) or not _is_int(dp) or not isinstance(layout, str) or not layout:
        raise WireError(
            "Prefill bootstrap server returned incomplete parallel info "
            f"(prefill_tp_size={tp!r}, prefill_dp_size={dp!r}, "
            f"cache_layout {'present' if isinstance(layout, str) else 'missing'}): "
            "has every Prefill rank registered?"
        )
    if len(layout) > MAX_CONTRACT_BYTES:
        raise WireError(
            f"bootstrap parallel-info cache_layout is {len(layout)} characters, more than a "
            f"contract's {MAX_CONTRACT_BYTES} bytes"
        )
    pp: object = obj.get("prefill_pp_size")
    placement_raw = obj.get("cache_fields_by_stage")
    placement: tuple[tuple[str, ...], ...] | None = None
    if placement_raw is not None:
        if not isinstance(placement_raw, list) or not all(
            isinstance(s, list) and all(isinstance(f, str) for f in s) for s in placement_raw
        ):
            raise WireError("bootstrap parallel-info cache_fields_by_stage must be lists of str")
        placement = tuple(tuple(s) for s in placement_raw)
    if pp is not None and (not _is_int(pp) or pp <= 0):
        raise WireError(f"bootstrap parallel-info prefill_pp_size must be positive, got {pp!r}")
    pp_size = pp if _is_int(pp) else None
    problem = _size_problem(tp, dp, pp_size, "prefill_tp_size")
    if problem is not None:
        raise WireError(f"bootstrap parallel info is inconsistent: {problem}")
    if placement is not None and len(placement) > tp:
        raise WireError(
            f"bootstrap parallel-info cache_fields_by_stage has {len(placement)} stages, "
            f"more than prefill_tp_size={tp}"
        )
    return ParallelInfo(tp, dp, layout, pp_size, placement)


def parse_rank_info(body: bytes | str) -> RankInfo:
    """Decode a rank-info reply ``{"rank_ip": str, "rank_port": int}``: ``rank_ip``
    must pass :func:`is_valid_host` and ``rank_port`` be in ``1..65535`` (a server
    that checks nothing may hand out ``"*"``, which a socket library refuses). A
    secure-mode rank's reply also has :data:`CURVE_KEY_FIELD`, which must then be a
    CURVE public key; :data:`STAGING_FIELD` ``true`` offers staged transfers (any
    other value reads as no offer)."""
    obj = _reply_object(body, "rank-info")
    ip: object = obj.get("rank_ip")
    port: object = obj.get("rank_port")
    if (
        not isinstance(ip, str)
        or not is_valid_host(ip)
        or not _is_int(port)
        or not 0 < port < 65536
    ):
        raise WireError(
            f"bootstrap rank-info reply has no usable endpoint (rank_ip={_shown(ip)}, "
            f"rank_port={_shown(port)}): the Prefill rank registered an address that is not a "
            "host name or IP address, or the server is not a bootstrap server"
        )
    key: object = obj.get(CURVE_KEY_FIELD)
    if key is not None and not is_curve_key(key):
        raise WireError(
            f"bootstrap rank-info reply has an unusable {CURVE_KEY_FIELD} {_shown(key)}: a "
            "CURVE public key is 40 characters of Z85"
        )
    return RankInfo(ip, port, key, obj.get(STAGING_FIELD) is True)
