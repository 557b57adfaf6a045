"""Codecs of the control messages exchanged over ZMQ (docs/protocol.md#proto-messages).

Every message is a list of raw byte frames. Decoders take such a list and either
return a frozen value or raise :class:`~tspd.core.errors.WireError` (or its
subclass :class:`~tspd.core.errors.ContractError` for the contract and manifest
frames) whose text is the protocol reference's message, verbatim where the
reference fixes one. Encoders produce exactly the frames the decoders accept
and refuse, with a ``WireError``, values that have no encoding.

Messages and their direction:

* registration (Decode → Prefill, 8 frames, docs/protocol.md#proto-registration) —
  :func:`decode_registration`; its route header (endpoint, session, port) alone
  with :func:`decode_registration_route`, so a registration whose later frames are
  bad can still be rejected by route (docs/protocol.md#proto-registration-handling);
* pre-allocation (Decode → Prefill, 3 frames, docs/protocol.md#proto-preallocation)
  — :func:`decode_preallocation` parses the room and the session only; the manifest
  frame is parsed later by :meth:`Preallocation.manifest`, after the registration
  lookup and the already-failed short-circuit
  (docs/protocol.md#proto-preallocation-checks);
* status (Prefill → Decode, 3..7 frames, docs/protocol.md#proto-status) —
  :func:`encode_status` always sends the 7-frame form
  (docs/protocol.md#proto-compat-choices), :func:`decode_status` accepts 3..7;
* EPD embedding status (Encode → Prefill, 3 frames, docs/protocol.md#proto-epd-status).

Bounds for the sockets: :data:`MAX_CONTROL_FRAME_BYTES` and
:data:`MAX_STATUS_FRAME_BYTES` are the largest frame a legal message of each socket
has (the shell sets them as ``ZMQ_MAXMSGSIZE``, which libzmq applies per frame),
:data:`MAX_CONTROL_FRAMES` and :data:`MAX_STATUS_FRAMES` the most frames. A
registration's reply endpoint is checked to be usable as a ZMQ address
(docs/protocol.md#proto-zmq) before anything connects to it.

The two hot paths, pre-allocation decoding and status encoding, avoid regexes and
per-call setup: integer frames are checked with ``bytes`` predicates and the
constant frames are precomputed.
"""

from __future__ import annotations

import functools
import ipaddress
import struct
from dataclasses import dataclass, field
from typing import Final

from tspd.core.contract import MAX_CONTRACT_BYTES, CacheContract, parse_contract
from tspd.core.copies import MAX_ADDRESS
from tspd.core.errors import ContractError, WireError
from tspd.core.manifest import MAX_MANIFEST_BYTES, BlockManifest, parse_manifest
from tspd.core.poll import TransferPoll

__all__ = [
    "MAX_CONTRACT_BYTES",
    "MAX_CONTROL_FRAMES",
    "MAX_CONTROL_FRAME_BYTES",
    "MAX_DECODE_TP_SIZE",
    "MAX_ENDPOINT_CHARS",
    "MAX_HOST_CHARS",
    "MAX_MANIFEST_BYTES",
    "MAX_RANK",
    "MAX_ROOM",
    "MAX_SESSION_CHARS",
    "MAX_SPEC_CANDIDATES",
    "MAX_STATUS_FRAMES",
    "MAX_STATUS_FRAME_BYTES",
    "REGISTRATION_MARKER",
    "EmbeddingStatus",
    "Preallocation",
    "Registration",
    "RouteHeader",
    "StatusMessage",
    "decode_embedding_status",
    "decode_preallocation",
    "decode_registration",
    "decode_registration_route",
    "decode_status",
    "decode_uint",
    "encode_embedding_status",
    "encode_preallocation",
    "encode_registration",
    "encode_staging_region",
    "encode_staging_slot",
    "encode_status",
    "encode_uint",
    "endpoint_problem",
    "failure_notice",
    "is_registration",
    "session_port",
]

# Bounds fixed by the protocol (docs/protocol.md#proto-registration,
# docs/protocol.md#proto-preallocation, docs/protocol.md#proto-contract-schema,
# docs/protocol.md#proto-manifest-schema).
REGISTRATION_MARKER: Final = b"None"
MAX_ROOM: Final = 2**63 - 1
MAX_ENDPOINT_CHARS: Final = 255
MAX_SESSION_CHARS: Final = 512
MAX_PORT: Final = 65535
MAX_DECODE_TP_SIZE: Final = 1024
# Bounds the protocol leaves open; chosen wide enough for any real topology.
# A status rank is pp_rank * tp_size + tp_rank (docs/protocol.md#proto-status), kept
# inside int32.
MAX_RANK: Final = 2**31 - 1
#: The longest host name in a registration's endpoint (DNS: 253 characters).
MAX_HOST_CHARS: Final = 253
#: Speculative candidates one status may carry. Drafters propose a handful of
#: tokens (EAGLE/MTP: up to a few dozen); 4096 is far above any of them and keeps a
#: status's candidate frame within 16 KiB. Checked on the frame's length, before
#: a single candidate is converted.
MAX_SPEC_CANDIDATES: Final = 4096
_MIN_TOKEN: Final = -(2**63)
_MAX_TOKEN: Final = 2**63 - 1

_REGISTRATION_FRAMES: Final = 8
_PREALLOCATION_FRAMES: Final = 3
# tspd's staged-transfer extension (docs/wire.md#staged-transfers): one more frame on
# each message, sent only between tspd peers that both enabled it.
_STAGED_REGISTRATION_FRAMES: Final = 9
_STAGED_PREALLOCATION_FRAMES: Final = 4
_ZERO: Final = 48  # ord("0")

# What the receiving sockets accept (libzmq's ZMQ_MAXMSGSIZE bounds each frame, not
# the sum of a message's frames, so these are largest *frames*).
#: Prefill control socket: a pre-allocation's manifest (2 MiB,
#: docs/protocol.md#proto-preallocation) is the largest frame; a registration's is its
#: contract (256 KiB, docs/protocol.md#proto-registration), its other frames are at
#: most 512 bytes (the session id).
MAX_CONTROL_FRAME_BYTES: Final = max(MAX_MANIFEST_BYTES, MAX_CONTRACT_BYTES, MAX_SESSION_CHARS)
#: Prefill control socket: a registration's 8 frames (a pre-allocation has 3).
MAX_CONTROL_FRAMES: Final = _STAGED_REGISTRATION_FRAMES
#: Decode status socket: the candidate frame, 4 bytes a candidate (16 KiB); the
#: integer frames are at most 20 bytes and the logprob 8 (docs/protocol.md#proto-status).
MAX_STATUS_FRAME_BYTES: Final = 4 * MAX_SPEC_CANDIDATES
#: Decode status socket: the 7-frame form (docs/protocol.md#proto-status,
#: docs/protocol.md#proto-compat-choices).
MAX_STATUS_FRAMES: Final = 8

_MSG_HEADER: Final = "Rejecting malformed Mooncake bootstrap message header"
_MSG_REGISTRATION_FRAMES: Final = "CachePD slab registration requires exactly 8 frames"
_MSG_ENDPOINT: Final = "CachePD registration endpoint is invalid"
_MSG_SESSION: Final = "CachePD registration session is invalid"
_MSG_POINTER_LENGTH: Final = "CachePD slab pointer frame must be exactly 8 bytes"
_MSG_POINTER_ZERO: Final = "CachePD slab pointer must be nonzero"
_MSG_PREALLOCATION_FRAMES: Final = "CachePD pre-allocation requires exactly 3 frames"
_MSG_REQUEST_SESSION: Final = "CachePD request requires a Decode session"
_MSG_MANIFEST_SIZE: Final = f"Cache block manifest payload must be 1..{MAX_MANIFEST_BYTES} bytes"
_STATUS_PREFIX: Final = "Rejecting malformed Prefill status message: "
_EMBEDDING_PREFIX: Final = "Rejecting malformed EPD embedding status message: "

_U64: Final = struct.Struct("<Q")
_U64_PAIR: Final = struct.Struct("<QQ")
_F64: Final = struct.Struct("<d")
# Frames of the status values, so encoding a status allocates nothing for it.
_POLL_FRAMES: Final[dict[int, bytes]] = {poll: b"%d" % poll for poll in TransferPoll}
# Status by wire value: TransferPoll's values are 0..5 without gaps
# (docs/protocol.md#proto-transfer-poll).
_POLLS: Final[tuple[TransferPoll, ...]] = tuple(sorted(TransferPoll))
_MAX_POLL: Final = len(_POLLS) - 1


# --------------------------------------------------------------------------- integers


def _digits(maximum: int) -> int:
    return len(str(maximum))


def _is_canonical_uint(frame: bytes, max_digits: int) -> bool:
    # bytes.isdigit() is ASCII-only and False for b"", so it also rejects signs,
    # whitespace and '_' that int() would accept.
    return (
        0 < len(frame) <= max_digits and frame.isdigit() and (frame[0] != _ZERO or len(frame) == 1)
    )


def _uint(frame: bytes, name: str, minimum: int, maximum: int, max_digits: int) -> int:
    if not _is_canonical_uint(frame, max_digits):
        raise WireError(f"{name} must be canonical unsigned ASCII")
    value = int(frame)
    if value < minimum or value > maximum:
        raise WireError(f"{name} is out of range")
    return value


def decode_uint(frame: bytes, *, name: str, minimum: int, maximum: int) -> int:
    """Decode a canonical unsigned ASCII integer (docs/protocol.md#proto-canonical-uint).

    Valid iff the frame has 1 to ``digits(maximum)`` bytes, all ASCII digits, no
    leading ``0`` unless it is exactly ``b"0"``, and the value is in
    ``[minimum, maximum]``. Errors: ``"{name} must be canonical unsigned ASCII"``,
    ``"{name} is out of range"``.
    """
    return _uint(frame, name, minimum, maximum, _digits(maximum))


def encode_uint(value: int) -> bytes:
    """The canonical unsigned ASCII frame of ``value`` (what ``str(int)`` writes)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise WireError(f"{value!r} has no canonical unsigned ASCII encoding")
    return b"%d" % value


def _ascii(frame: bytes, max_chars: int, message: str) -> str:
    if not 0 < len(frame) <= max_chars or not frame.isascii():
        raise WireError(message)
    return frame.decode("ascii")


def _check_ascii(text: str, max_chars: int, message: str) -> bytes:
    if not 0 < len(text) <= max_chars or not text.isascii():
        raise WireError(message)
    return text.encode("ascii")


# ---------------------------------------------------------------------------- endpoint

_LABEL_CHARS: Final = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_")


def _shown(text: str) -> str:
    return repr(text) if len(text) <= 64 else repr(text[:64]) + "..."


def endpoint_problem(endpoint: str) -> str | None:
    """Why a registration's ``endpoint`` cannot be the host of a reply address, or
    ``None`` when it can; ``endpoint`` is ASCII of 1..255 characters.

    The reply goes to ``tcp://<host>:<port>`` where ``host`` is the part of
    ``endpoint`` before its first ``:`` (docs/protocol.md#proto-zmq). ``host`` must
    be a host name (labels of 1..63 letters, digits, ``-`` and ``_``, not starting or
    ending with ``-``, at most 253 characters, one trailing ``.`` allowed) or a
    dotted-quad IPv4 address. The whole endpoint must be printable without spaces: it appears in
    logs. IPv6 literals are refused: the first-``:`` rule cannot carry them.
    """
    if not endpoint.isprintable() or " " in endpoint:
        return f"{_shown(endpoint)} contains spaces or control characters"
    host = endpoint.partition(":")[0]
    if endpoint.startswith("[") or endpoint.count(":") > 1:
        return (
            f"{_shown(endpoint)} looks like an IPv6 literal, which cannot be used: the "
            "reply host is the part before the first ':'"
        )
    if not host:
        return f"{_shown(endpoint)} has no host before its ':'"
    if len(host) > MAX_HOST_CHARS:
        return f"its host has {len(host)} characters, more than {MAX_HOST_CHARS}"
    labels = host.split(".")
    if all(label.isdigit() for label in labels):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return f"{_shown(host)} is not a dotted-quad IPv4 address"
        return None
    if len(labels) > 1 and not labels[-1]:
        labels.pop()  # a fully qualified name's trailing dot
    for label in labels:
        if (
            not 0 < len(label) <= 63
            or not _LABEL_CHARS.issuperset(label)
            or label[0] == "-"
            or label[-1] == "-"
        ):
            return f"{_shown(host)} is not a host name or IPv4 address"
    return None


# ---------------------------------------------------------------------- discrimination


def is_registration(frames: list[bytes]) -> bool:
    """Whether a message on the Prefill control socket is a registration
    (docs/protocol.md#proto-control-dispatch).

    Frame 0 equal to ``b"None"`` is a registration; any other ASCII frame 0 is a
    pre-allocation. A message without frames, or whose frame 0 is not ASCII, cannot
    be routed at all: ``WireError("Rejecting malformed Mooncake bootstrap message
    header")`` — the text TokenSpeed logs when it drops such a message, so the
    shell can log ``str(err)`` as is.
    """
    if not frames or not frames[0].isascii():
        raise WireError(_MSG_HEADER)
    return frames[0] == REGISTRATION_MARKER


# ------------------------------------------------------------------------ registration


@dataclass(frozen=True, slots=True)
class RouteHeader:
    """Where a Decode rank wants its status messages, and who it is (frames 1-3 of
    docs/protocol.md#proto-registration)."""

    endpoint: str
    port: int
    session_id: str

    @property
    def status_address(self) -> str:
        """The ZMQ address of the Decode rank's status PULL socket
        (docs/protocol.md#proto-zmq): only the part of ``endpoint`` before its first
        ``:`` is used."""
        host = self.endpoint.split(":", 1)[0]
        return f"tcp://{host}:{self.port}"


@dataclass(frozen=True, slots=True)
class Registration:
    """A Decode rank's registration with one Prefill TP rank (docs/protocol.md#proto-registration).

    Equality compares every field that matters for conflicts
    (docs/protocol.md#proto-registration-handling), the contract as a parsed object;
    ``contract_bytes`` (the frame as received, re-sent verbatim by
    :func:`encode_registration`) is excluded so that two serialisations of one
    contract do not conflict.
    """

    endpoint: str
    port: int
    session_id: str
    arena_base: int
    contract: CacheContract
    contract_bytes: bytes = field(compare=False, repr=False)
    decode_tp_size: int
    decode_tp_rank: int
    #: The Decode rank's staging region ``(base address, size in bytes)`` for staged
    #: transfers (frame 8, tspd's extension, docs/wire.md#staged-transfers); ``None``:
    #: the plain 8-frame registration.
    staging: tuple[int, int] | None = None

    @property
    def route(self) -> RouteHeader:
        """The route header of this registration."""
        return RouteHeader(self.endpoint, self.port, self.session_id)


def decode_registration_route(frames: list[bytes], *, staging: bool = False) -> RouteHeader:
    """Decode a registration's route header, checking frames 0, 1, 3, 2 in that order
    (docs/protocol.md#proto-registration) and nothing else. The endpoint must also
    pass :func:`endpoint_problem`: an endpoint no socket can connect to is no route
    (the registration is dropped, docs/protocol.md#proto-registration-handling), and
    the error says why. ``staging``: this rank offers staged transfers, so the
    9-frame form (docs/wire.md#staged-transfers) is accepted too."""
    count = len(frames)
    if (
        count != _REGISTRATION_FRAMES and not (staging and count == _STAGED_REGISTRATION_FRAMES)
    ) or frames[0] != REGISTRATION_MARKER:
        raise WireError(_MSG_REGISTRATION_FRAMES)
    endpoint = _ascii(frames[1], MAX_ENDPOINT_CHARS, _MSG_ENDPOINT)
    problem = endpoint_problem(endpoint)
    if problem is not None:
        raise WireError(f"{_MSG_ENDPOINT}: {problem}")
    session_id = _ascii(frames[3], MAX_SESSION_CHARS, _MSG_SESSION)
    port = _uint(frames[2], "CachePD registration port", 1, MAX_PORT, 5)
    return RouteHeader(endpoint, port, session_id)


def decode_registration(
    frames: list[bytes], *, compat: bool = False, staging: bool = False
) -> Registration:
    """Decode and validate a registration (docs/protocol.md#proto-registration).

    Check order: route header (frames 0, 1, 3, 2), pointer length (4), contract (5),
    ``decode_tp_size`` (6), ``decode_tp_rank`` (7), pointer non-zero (4), then the
    staging region (8) when present. Contract
    errors are :class:`ContractError` with the messages of
    docs/protocol.md#proto-contract-errors; ``compat`` is passed to
    :func:`~tspd.core.contract.parse_contract` (accept the S3 group-spec keys).
    ``staging``: accept the 9-frame form whose frame 8 is the Decode's staging
    region (docs/wire.md#staged-transfers).
    """
    route = decode_registration_route(frames, staging=staging)
    pointer = frames[4]
    if len(pointer) != 8:
        raise WireError(_MSG_POINTER_LENGTH)
    contract_bytes = bytes(frames[5])
    contract = parse_contract(contract_bytes, compat=compat)
    tp_size = _uint(frames[6], "CachePD decode_tp_size", 1, MAX_DECODE_TP_SIZE, 4)
    tp_rank = decode_uint(frames[7], name="CachePD decode_tp_rank", minimum=0, maximum=tp_size - 1)
    (arena_base,) = _U64.unpack(pointer)
    if arena_base == 0:
        raise WireError(_MSG_POINTER_ZERO)
    region = _staging_region(frames[8]) if len(frames) == _STAGED_REGISTRATION_FRAMES else None
    return Registration(
        endpoint=route.endpoint,
        port=route.port,
        session_id=route.session_id,
        arena_base=arena_base,
        contract=contract,
        contract_bytes=contract_bytes,
        decode_tp_size=tp_size,
        decode_tp_rank=tp_rank,
        staging=region,
    )


def _staging_region(frame: bytes) -> tuple[int, int]:
    if len(frame) != _U64_PAIR.size:
        raise WireError(
            f"tspd staging region frame must be 16 bytes (base, size), got {len(frame)}"
        )
    base, size = _U64_PAIR.unpack(frame)
    if base == 0 or size == 0 or base + size > MAX_ADDRESS:
        raise WireError(
            f"tspd staging region (base {base:#x}, {size} bytes) must have a non-zero base "
            f"and size and end below {MAX_ADDRESS:#x}"
        )
    return base, size


def encode_staging_region(base: int, size: int) -> bytes:
    """Frame 8 of a staged registration: the Decode rank's staging region
    (docs/wire.md#staged-transfers), base and size as two unsigned 64-bit
    little-endian integers."""
    if not (0 <= base < 2**64 and 0 <= size < 2**64):
        raise WireError(f"tspd staging region (base {base:#x}, {size} bytes) does not fit 64 bits")
    frame = _U64_PAIR.pack(base, size)
    _staging_region(frame)
    return frame


def encode_staging_slot(offset: int, length: int) -> bytes:
    """Frame 3 of a staged pre-allocation: the slot offered, offset into the staging
    region and length, as two unsigned 64-bit little-endian integers
    (docs/wire.md#staged-transfers)."""
    if not (0 <= offset < 2**64 and 0 <= length < 2**64):
        raise WireError(f"tspd staging slot (offset {offset}, {length} bytes) does not fit 64 bits")
    frame = _U64_PAIR.pack(offset, length)
    _staging_slot(frame)
    return frame


def encode_registration(registration: Registration) -> list[bytes]:
    """The 8 frames of ``registration``; the pointer is unsigned 64-bit little-endian
    (docs/protocol.md#proto-registration) and the contract frame is
    ``registration.contract_bytes``."""
    reg = registration
    endpoint = _check_ascii(reg.endpoint, MAX_ENDPOINT_CHARS, _MSG_ENDPOINT)
    problem = endpoint_problem(reg.endpoint)
    if problem is not None:
        raise WireError(f"{_MSG_ENDPOINT}: {problem}")
    session = _check_ascii(reg.session_id, MAX_SESSION_CHARS, _MSG_SESSION)
    if not 1 <= reg.port <= MAX_PORT:
        raise WireError("CachePD registration port is out of range")
    if reg.arena_base == 0:
        raise WireError(_MSG_POINTER_ZERO)
    if not 0 < reg.arena_base < 2**64:
        raise WireError(f"CachePD slab pointer {reg.arena_base:#x} does not fit 64 bits")
    if not 0 < len(reg.contract_bytes) <= MAX_CONTRACT_BYTES:
        raise ContractError(
            f"cache transfer contract payload must be 1..{MAX_CONTRACT_BYTES} bytes"
        )
    if not 1 <= reg.decode_tp_size <= MAX_DECODE_TP_SIZE:
        raise WireError("CachePD decode_tp_size is out of range")
    if not 0 <= reg.decode_tp_rank < reg.decode_tp_size:
        raise WireError("CachePD decode_tp_rank is out of range")
    frames = [
        REGISTRATION_MARKER,
        endpoint,
        encode_uint(reg.port),
        session,
        _U64.pack(reg.arena_base),
        reg.contract_bytes,
        encode_uint(reg.decode_tp_size),
        encode_uint(reg.decode_tp_rank),
    ]
    if reg.staging is not None:
        frames.append(encode_staging_region(*reg.staging))
    return frames


# ---------------------------------------------------------------------- pre-allocation


@dataclass(frozen=True, slots=True)
class Preallocation:
    """A pre-allocation (docs/protocol.md#proto-preallocation) with its manifest
    frame still unparsed.

    The Prefill rank looks the session's registration up and short-circuits an
    already-failed room before it parses the manifest
    (docs/protocol.md#proto-preallocation-checks), so parsing is a separate step:
    :meth:`manifest`.
    """

    room: int
    session_id: str
    manifest_bytes: bytes = field(repr=False)
    #: The Decode staging slot ``(offset into its staging region, length)`` offered
    #: for this room (frame 3, tspd's extension, docs/wire.md#staged-transfers).
    slot: tuple[int, int] | None = None

    @property
    def is_dummy(self) -> bool:
        """An empty manifest frame: a rendezvous-only pre-allocation for a dummy
        Prefill rank (docs/protocol.md#proto-dummies)."""
        return not self.manifest_bytes

    def manifest(self) -> BlockManifest | None:
        """Parse the manifest frame: ``None`` for a dummy pre-allocation, else the
        block manifest (1..2097152 bytes; :class:`ContractError` with the messages of
        docs/protocol.md#proto-manifest-errors). It is not validated against a contract
        here: that needs the sender's registration
        (``tspd.core.manifest.validate_manifest``)."""
        if not self.manifest_bytes:
            return None
        return parse_manifest(self.manifest_bytes)


def decode_preallocation(frames: list[bytes], *, staging: bool = False) -> Preallocation:
    """Decode a pre-allocation's frame count, room and session
    (docs/protocol.md#proto-preallocation); the manifest frame is kept as bytes for
    :meth:`Preallocation.manifest`. ``staging``: accept the 4-frame form whose frame 3
    offers a staging slot (docs/wire.md#staged-transfers)."""
    slot = None
    if len(frames) != _PREALLOCATION_FRAMES:
        if not (staging and len(frames) == _STAGED_PREALLOCATION_FRAMES):
            raise WireError(_MSG_PREALLOCATION_FRAMES)
        slot = _staging_slot(frames[3])
    room_frame, session_frame, manifest_bytes = frames[:3]
    # _uint inlined: this decode runs once per request and Prefill rank.
    if not (
        0 < len(room_frame) <= 19
        and room_frame.isdigit()
        and (room_frame[0] != _ZERO or len(room_frame) == 1)
    ):
        raise WireError("CachePD room must be canonical unsigned ASCII")
    room = int(room_frame)
    if room > MAX_ROOM:
        raise WireError("CachePD room is out of range")
    if not 0 < len(session_frame) <= MAX_SESSION_CHARS or not session_frame.isascii():
        raise WireError(_MSG_REQUEST_SESSION)
    return Preallocation(room, session_frame.decode("ascii"), manifest_bytes, slot)


def _staging_slot(frame: bytes) -> tuple[int, int]:
    if len(frame) != _U64_PAIR.size:
        raise WireError(
            f"tspd staging slot frame must be 16 bytes (offset, length), got {len(frame)}"
        )
    offset, length = _U64_PAIR.unpack(frame)
    if length == 0 or offset + length > MAX_ADDRESS:
        raise WireError(
            f"tspd staging slot (offset {offset}, {length} bytes) must be non-empty and end "
            f"below {MAX_ADDRESS:#x}"
        )
    return offset, length


def encode_preallocation(
    room: int,
    session_id: str,
    manifest: BlockManifest | None,
    slot: tuple[int, int] | None = None,
) -> list[bytes]:
    """The 3 frames of a pre-allocation; ``manifest=None`` sends the empty frame of a
    dummy pre-allocation. ``slot``: the 4-frame form offering a staging slot
    ``(offset, length)`` (docs/wire.md#staged-transfers)."""
    if not 0 <= room <= MAX_ROOM:
        raise WireError("CachePD room is out of range")
    session = _check_ascii(session_id, MAX_SESSION_CHARS, _MSG_REQUEST_SESSION)
    payload = b"" if manifest is None else manifest.to_json()
    if len(payload) > MAX_MANIFEST_BYTES:
        raise ContractError(_MSG_MANIFEST_SIZE)
    frames = [encode_uint(room), session, payload]
    if slot is not None:
        frames.append(encode_staging_slot(*slot))
    return frames


# ------------------------------------------------------------------------------ status


@dataclass(frozen=True, slots=True)
class StatusMessage:
    """A status message, Prefill → Decode (docs/protocol.md#proto-status), with
    S3/R-pd's seven fields.

    ``bootstrap_token`` ``-1`` means none; ``bootstrap_logprob`` ``None`` means none.
    """

    room: int
    status: TransferPoll
    prefill_rank: int
    bootstrap_token: int = -1
    spec_candidate_ids: tuple[int, ...] = ()
    cached_tokens: int = 0
    bootstrap_logprob: float | None = None
    #: A ``Success`` whose bytes went to the Decode's staging slot as a blob of this
    #: many bytes (frame 7, tspd's extension, docs/wire.md#staged-transfers); ``0``:
    #: the bytes were written in place.
    staged_bytes: int = 0


def _status_error(detail: str) -> WireError:
    return WireError(_STATUS_PREFIX + detail)


def encode_status(message: StatusMessage) -> list[bytes]:
    """The 7-frame form of ``message`` (docs/protocol.md#proto-status): ASCII
    decimals, candidates as packed little-endian int32, the logprob as little-endian
    float64 or an empty frame; a staged ``Success`` has an 8th frame, the blob's
    length (docs/wire.md#staged-transfers)."""
    m = message
    status = _POLL_FRAMES.get(m.status)
    if (
        status is None
        or not 0 <= m.room <= MAX_ROOM
        or not 0 <= m.prefill_rank <= MAX_RANK
        or not _MIN_TOKEN <= m.bootstrap_token <= _MAX_TOKEN
        or not 0 <= m.cached_tokens <= MAX_ROOM
        or not 0 <= m.staged_bytes <= MAX_ROOM
    ):
        raise WireError(f"status message for room {m.room} has a value out of range: {m!r}")
    candidates = m.spec_candidate_ids
    if len(candidates) > MAX_SPEC_CANDIDATES:
        raise WireError(
            f"status message for room {m.room} has {len(candidates)} speculative "
            f"candidates, more than {MAX_SPEC_CANDIDATES}"
        )
    if candidates:
        try:
            packed = struct.pack(f"<{len(candidates)}i", *candidates)
        except struct.error:
            raise WireError(
                f"status message for room {m.room} has a speculative candidate id "
                f"outside int32: {candidates!r}"
            ) from None
    else:
        packed = b""
    logprob = m.bootstrap_logprob
    frames = [
        b"%d" % m.room,
        status,
        b"%d" % m.prefill_rank,
        b"%d" % m.bootstrap_token,
        packed,
        b"%d" % m.cached_tokens,
        b"" if logprob is None else _F64.pack(logprob),
    ]
    if m.staged_bytes:
        frames.append(b"%d" % m.staged_bytes)
    return frames


def failure_notice(room: int, prefill_rank: int, cached_tokens: int = 0) -> list[bytes]:
    """The bare Failed status of ``room`` (docs/protocol.md#proto-status,
    docs/protocol.md#proto-failure-notice): no token, no candidates, no logprob, and
    the room's recorded cached-token count."""
    return encode_status(
        StatusMessage(room, TransferPoll.FAILED, prefill_rank, -1, (), cached_tokens)
    )


def _status_uint(frame: bytes, name: str, maximum: int, max_digits: int) -> int:
    if not _is_canonical_uint(frame, max_digits):
        raise _status_error(f"{name} must be canonical unsigned ASCII, got {bytes(frame[:32])!r}")
    value = int(frame)
    if value > maximum:
        raise _status_error(f"{name} {value} is out of range 0..{maximum}")
    return value


def _status_token(frame: bytes) -> int:
    # What str(int) writes: "-" then a canonical non-zero magnitude, or a canonical
    # unsigned value. "-0", "+1", " 1" and "1_0" are refused.
    if frame[:1] == b"-":
        magnitude = frame[1:]
        if _is_canonical_uint(magnitude, 19) and magnitude != b"0":
            value = -int(magnitude)
            if value >= _MIN_TOKEN:
                return value
            raise _status_error(f"bootstrap token {value} is out of range")
    elif _is_canonical_uint(frame, 19):
        value = int(frame)
        if value <= _MAX_TOKEN:
            return value
        raise _status_error(f"bootstrap token {value} is out of range")
    raise _status_error(
        f"bootstrap token must be a canonical ASCII integer, got {bytes(frame[:32])!r}"
    )


def _status_candidates(frame: bytes) -> tuple[int, ...]:
    size = len(frame)
    if not size:
        return ()
    if size > MAX_STATUS_FRAME_BYTES:
        raise _status_error(
            f"speculative candidate frame has {size} bytes, more than "
            f"{MAX_STATUS_FRAME_BYTES} ({MAX_SPEC_CANDIDATES} candidates)"
        )
    if size % 4:
        raise _status_error(f"speculative candidate frame has {size} bytes, not a multiple of 4")
    return struct.unpack(f"<{size // 4}i", frame)


def _status_logprob(frame: bytes) -> float | None:
    if not frame:
        return None
    if len(frame) != 8:
        raise _status_error(f"bootstrap logprob frame has {len(frame)} bytes, not 0 or 8")
    value: float = _F64.unpack(frame)[0]
    return value


def decode_status(frames: list[bytes]) -> StatusMessage:
    """Decode a status message of 3..8 frames (docs/protocol.md#proto-status; the
    8th is tspd's staged-blob length, docs/wire.md#staged-transfers); absent trailing
    frames read as token ``-1``, no candidates, ``0`` cached tokens, no logprob and
    nothing staged.

    Integers must be exactly what ``str(int)`` writes (a ``-`` only on the token);
    at most :data:`MAX_SPEC_CANDIDATES` candidates, checked on the frame's length
    before any is converted. Errors read ``"Rejecting malformed Prefill status
    message: <detail>"``.
    """
    count = len(frames)
    if not 3 <= count <= MAX_STATUS_FRAMES:
        raise _status_error(f"expected 3..{MAX_STATUS_FRAMES} frames, got {count}")
    room = _status_uint(frames[0], "room", MAX_ROOM, 19)
    status = _POLLS[_status_uint(frames[1], "status", _MAX_POLL, 1)]
    rank = _status_uint(frames[2], "prefill rank", MAX_RANK, 10)
    return StatusMessage(
        room,
        status,
        rank,
        _status_token(frames[3]) if count > 3 else -1,
        _status_candidates(frames[4]) if count > 4 else (),
        _status_uint(frames[5], "cached tokens", MAX_ROOM, 19) if count > 5 else 0,
        _status_logprob(frames[6]) if count > 6 else None,
        _status_uint(frames[7], "staged bytes", MAX_ROOM, 19) if count > 7 else 0,
    )


# ------------------------------------------------------------------ EPD embedding status


@dataclass(frozen=True, slots=True)
class EmbeddingStatus:
    """An EPD embedding status, Encode → Prefill (docs/protocol.md#proto-epd-status):
    ``[room, status, rank]``."""

    room: int
    status: TransferPoll
    rank: int


def encode_embedding_status(message: EmbeddingStatus) -> list[bytes]:
    """The 3 ASCII-decimal frames of an embedding status."""
    status = _POLL_FRAMES.get(message.status)
    if status is None or not 0 <= message.room <= MAX_ROOM or not 0 <= message.rank <= MAX_RANK:
        raise WireError(f"EPD embedding status has a value out of range: {message!r}")
    return [b"%d" % message.room, status, b"%d" % message.rank]


def decode_embedding_status(frames: list[bytes]) -> EmbeddingStatus:
    """Decode an embedding status of exactly 3 frames. Errors read
    ``"Rejecting malformed EPD embedding status message: <detail>"``."""
    if len(frames) != 3:
        raise WireError(f"{_EMBEDDING_PREFIX}expected 3 frames, got {len(frames)}")
    try:
        room = _uint(frames[0], "room", 0, MAX_ROOM, 19)
        status = _uint(frames[1], "status", 0, _MAX_POLL, 1)
        rank = _uint(frames[2], "rank", 0, MAX_RANK, 10)
    except WireError as err:
        raise WireError(_EMBEDDING_PREFIX + str(err)) from None
    return EmbeddingStatus(room, _POLLS[status], rank)


# ----------------------------------------------------------------------------- helpers


@functools.lru_cache(maxsize=1024)
def session_port(session_id: str) -> int | None:
    """The RPC port of a Mooncake session id ``"<ip>:<port>"``, or ``None`` when it
    has none (R-pd shards transfer work by it and lets such sessions count as 0).
    Kept for the last 1,024 ids: a Prefill rank asks once per room and destination,
    for the few sessions of its Decode ranks."""
    _, sep, tail = session_id.rpartition(":")
    raw = tail.encode("ascii", "replace")
    if not sep or not _is_canonical_uint(raw, 5):
        return None
    port = int(raw)
    return port if 1 <= port <= MAX_PORT else None
