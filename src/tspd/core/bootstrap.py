"""The bootstrap server's state and the payloads its clients send and read (spec §2).

The bootstrap server is the HTTP rendezvous of one Prefill instance: each Prefill
rank ``PUT``\\ s its control endpoint and cache contract to ``/route``; Decode ranks
``GET`` the instance's parallel info and each target rank's endpoint. This module is
the sans-IO part: :class:`BootstrapState` turns a request (method, query, body) into
an :class:`HttpReply`; the HTTP stack in :mod:`tspd.shell.bootstrap` only carries
bytes. The client half builds the ``PUT`` body of a Prefill rank and parses the two
``GET`` replies, raising :class:`WireError` for a reply that cannot be used.

Readiness (a tspd decision, beyond S1): until every one of the instance's
``world_size`` Prefill ranks has registered, both ``GET /route`` forms answer
``503`` with ``Bootstrap server is waiting for {missing} of {world_size} Prefill
ranks`` (before the first ``PUT``: ``Bootstrap server is waiting for its first
Prefill rank``). TokenSpeed would hand out a partial table or null sizes; a Decode
treats any non-200 as a failed request either way, and answering "not yet" keeps a
Decode from planning against an instance whose contract or endpoints are still
arriving. ``GET /health`` stays ``200`` throughout: it reports liveness, and Decode
heartbeats must not declare a starting instance dead.

``PUT`` errors answer ``500`` like TokenSpeed's generic handler, with the error
message (verbatim from the specification where it fixes one) as a plain-text body
so an operator sees what was wrong.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeGuard

from tspd.core.contract import parse_contract
from tspd.core.errors import TspdError, WireError

__all__ = [
    "BAD_LAYOUT",
    "INCOMPATIBLE_LAYOUTS",
    "LAYOUT_NOT_STRING",
    "METHOD_NOT_ALLOWED",
    "MISSING_INPUTS",
    "BootstrapState",
    "HttpReply",
    "ParallelInfo",
    "RankInfo",
    "build_route_payload",
    "encode_route_payload",
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

_TEXT: Final = "text/plain; charset=utf-8"
_JSON: Final = "application/json"


@dataclass(frozen=True, slots=True)
class HttpReply:
    """One HTTP answer: status, body text and content type."""

    status: int
    body: str
    content_type: str = _TEXT

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


@dataclass(frozen=True, slots=True)
class _Registration:
    """One Prefill rank's endpoint in the port table."""

    rank_ip: str
    rank_port: int


class BootstrapState:
    """What one bootstrap server knows (spec §2.2–§2.3), fed request by request.

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
        """Answer one request (spec §2.1)."""
        if path == "/health":
            if method in ("GET", "HEAD"):
                return HttpReply.ok()
            return HttpReply(405, METHOD_NOT_ALLOWED, _JSON)
        if path != "/route":
            return HttpReply(404, "Not Found")
        if method == "PUT":
            return self.put_route(body)
        if method in ("GET", "HEAD"):  # the HTTP layer drops a HEAD reply's body
            return self.get_route(query)
        return HttpReply(405, METHOD_NOT_ALLOWED, _JSON)

    # -- PUT -------------------------------------------------------------------

    def put_route(self, body: bytes) -> HttpReply:
        """Register one rank (§2.2, in the specification's order); any error is a
        ``500`` whose body is the error message and leaves the state unchanged."""
        try:
            payload = json.loads(body)
        except (ValueError, UnicodeDecodeError, RecursionError):
            return HttpReply(500, "bootstrap PUT body is not JSON")
        if not isinstance(payload, dict):
            return HttpReply(500, "bootstrap PUT body must be a JSON object")
        try:
            self._register(payload)
        except (TspdError, ValueError) as err:
            return HttpReply(500, str(err))
        return HttpReply.ok()

    def _register(self, payload: dict[str, Any]) -> None:
        layout = self._checked_layout(payload)
        placement, pp_size = self._checked_placement(payload, layout)
        role = _field(payload, "role", str)
        world_size = _field(payload, "world_size", int)
        dp_size = _field(payload, "dp_size", int)
        if world_size <= 0 or dp_size <= 0 or world_size % dp_size:
            raise WireError(
                f"bootstrap PUT has world_size={world_size} and dp_size={dp_size}: both "
                "must be positive and dp_size must divide world_size"
            )
        registration: tuple[int, int, _Registration] | None = None
        if role == "Prefill":
            rank_ip = _field(payload, "rank_ip", str)
            rank_port = _field(payload, "rank_port", int)
            engine_rank = _field(payload, "engine_rank", int)
            if not rank_ip or not 0 < rank_port < 65536:
                raise WireError(
                    f"bootstrap PUT from engine_rank={engine_rank} has an unusable control "
                    f"endpoint {rank_ip!r}:{rank_port}"
                )
            if not 0 <= engine_rank < world_size:
                raise WireError(
                    f"bootstrap PUT has engine_rank={engine_rank} outside [0, {world_size})"
                )
            tp_per_dp = world_size // dp_size
            registration = (
                engine_rank // tp_per_dp,
                engine_rank % tp_per_dp,
                _Registration(rank_ip, rank_port),
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
            raise WireError(LAYOUT_NOT_STRING)
        try:
            canonical = parse_contract(layout, compat=self._compat).to_json().decode("ascii")
        except (TspdError, ValueError) as err:
            raise WireError(BAD_LAYOUT) from err
        if self.cache_layout is not None and canonical != self.cache_layout:
            raise WireError(INCOMPATIBLE_LAYOUTS)
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
            raise WireError(PLACEMENT_REQUIRED)
        placement = tuple(tuple(stage) for stage in raw)
        placed = [f for stage in placement for f in stage]
        logical = [f["field_id"] for f in json.loads(layout)["plan"]["fields"]]
        if len(placed) != len(set(placed)) or set(placed) != set(logical):
            raise WireError(PLACEMENT_COVERAGE)
        pp_size = payload.get("pp_size", self.pp_size if self.pp_size is not None else 1)
        if not _is_int(pp_size) or pp_size <= 0 or len(placement) != pp_size:
            raise WireError(PLACEMENT_STAGES)
        if self.fields_by_stage is not None and placement != self.fields_by_stage:
            raise WireError(INCOMPATIBLE_PLACEMENT)
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
        """The parallel-info object (§2.3) as stored now."""
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
        """Answer ``GET /route`` (§2.1, plus the readiness rule of this module)."""
        engine_rank_text = query.get("engine_rank", "")
        dp_group_text = query.get("target_dp_group", "")
        if not engine_rank_text or not dp_group_text:
            return HttpReply(400, MISSING_INPUTS)
        try:
            engine_rank, dp_group = int(engine_rank_text), int(dp_group_text)
        except ValueError:
            return HttpReply(
                500,
                f"bootstrap GET /route needs integer engine_rank and target_dp_group, got "
                f"{engine_rank_text!r} and {dp_group_text!r}",
            )
        waiting = self.waiting_reason()
        if waiting is not None:
            return HttpReply(503, waiting)
        if engine_rank == -1 and dp_group == -1:
            return HttpReply.json(self.parallel_info())
        entry = self._table.get(dp_group, {}).get(engine_rank)
        if entry is None:
            return HttpReply(
                500,
                f"Bootstrap info not found for engine_rank={engine_rank} "
                f"target_dp_group={dp_group}: this Prefill instance has "
                f"dp_size={self.dp_size} and {self.world_size} ranks",
            )
        return HttpReply.json({"rank_ip": entry.rank_ip, "rank_port": entry.rank_port})


def _field(payload: Mapping[str, Any], key: str, kind: type) -> Any:
    """``payload[key]`` checked against ``kind`` (bool is not an int)."""
    if key not in payload:
        raise WireError(f"bootstrap PUT body lacks {key!r}")
    value = payload[key]
    if (kind is int and not _is_int(value)) or not isinstance(value, kind):
        raise WireError(
            f"bootstrap PUT field {key!r} must be {kind.__name__}, got {type(value).__name__}"
        )
    return value


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
    """The ``PUT /route`` body of one Prefill rank (§2.2). The S3 keys are added
    only when ``cache_fields_by_stage`` is given."""
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
    """A Prefill instance's parallel info as Decode uses it (§2.3)."""

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
    """One Prefill rank's control endpoint."""

    rank_ip: str
    rank_port: int

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
    if not _is_int(tp) or not _is_int(dp) or not isinstance(layout, str):
        raise WireError(
            "Prefill bootstrap server returned incomplete parallel info "
            f"(prefill_tp_size={tp!r}, prefill_dp_size={dp!r}, "
            f"cache_layout {'present' if isinstance(layout, str) else 'missing'}): "
            "has every Prefill rank registered?"
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
    if tp <= 0 or dp <= 0 or tp % (dp * (pp_size or 1)):
        raise WireError(
            f"bootstrap parallel info is inconsistent: prefill_tp_size={tp} is not a positive "
            f"multiple of prefill_dp_size={dp}" + (f" * prefill_pp_size={pp}" if pp else "")
        )
    return ParallelInfo(tp, dp, layout, pp_size, placement)


def parse_rank_info(body: bytes | str) -> RankInfo:
    """Decode a rank-info reply ``{"rank_ip": str, "rank_port": int}``."""
    obj = _reply_object(body, "rank-info")
    ip: object = obj.get("rank_ip")
    port: object = obj.get("rank_port")
    if not isinstance(ip, str) or not ip or not _is_int(port) or not 0 < port < 65536:
        raise WireError(
            f"bootstrap rank-info reply has no usable endpoint (rank_ip={ip!r}, rank_port={port!r})"
        )
    return RankInfo(ip, port)
