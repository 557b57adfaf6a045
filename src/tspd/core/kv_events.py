"""KV-cache events: the wire structs, their byte-exact msgpack encoding, and decoders.

One *batch* is the prefix-cache mutations of one scheduler round on one attention-DP
rank (docs/protocol.md#proto-kv-source). tspd encodes batches exactly as TokenSpeed does
(msgspec's "array-like" tagged structs, docs/protocol.md#proto-kv-wire), so its bytes
are identical to TokenSpeed's and readable by every consumer written against vLLM's
legacy format (Dynamo, llm-d, SGLang's router): plain msgpack arrays, the event's class
name first.

Decoding is lenient where peers differ and strict where the bytes are wrong:

* the **array form** (TokenSpeed, SGLang, vLLM before May 2026) may carry extra
  trailing fields (``lora_id``, ``medium`` ...): they are ignored;
* the **map form** vLLM moved to (each event a map tagged by ``"type"``) is read by
  field name, unknown keys ignored; ``medium``, ``group_idx`` and ``lora_name`` are
  kept because routers of hybrid and multi-tier models need them;
* block hashes may be unsigned 64-bit integers (TokenSpeed, SGLang) or byte strings
  (vLLM's hashes of other widths);
* anything else -- wrong types, out-of-range integers, unknown tags, trailing bytes,
  msgpack extension types -- raises :class:`~tspd.core.errors.WireError`, never
  anything else.

The live PUB frames ``[topic, seq, payload]`` (docs/protocol.md#proto-kv-pub) are also
here; the replay frames are in :mod:`tspd.core.replay`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Final, TypeAlias, final

import msgpack
import msgspec

from tspd.core.errors import WireError

__all__ = [
    "FNV_OFFSET_BASIS",
    "FNV_PRIME",
    "AllBlocksCleared",
    "BatchEncoder",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "KVEvent",
    "KVEventBatch",
    "PubMessage",
    "block_hash",
    "chain_block_hashes",
    "decode_batch",
    "decode_pub_frames",
    "encode_batch",
    "encode_event",
    "encode_events",
    "encode_pub_frames",
    "encode_seq",
    "from_scheduler_event",
    "from_scheduler_events",
    "split_pub_frames",
]

_U64_MAX: Final = (1 << 64) - 1

FNV_OFFSET_BASIS: Final = 14695981039346656037
FNV_PRIME: Final = 1099511628211

#: A block hash: an unsigned 64-bit integer (TokenSpeed, SGLang) or the raw bytes
#: vLLM uses for hashes of other widths.
BlockHash: TypeAlias = int | bytes


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Prefix blocks were written into the cache.

    TokenSpeed emits one hash per event; ``parent_block_hash`` is the block before
    the first of ``block_hashes`` in the request's prefix, ``None`` for a first block.
    ``medium``, ``group_idx`` and ``lora_name`` come only from vLLM's map form and are
    not part of TokenSpeed's encoding (tspd never writes them).
    """

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None = field(default=None, kw_only=True)
    group_idx: int | None = field(default=None, kw_only=True)
    lora_name: str | None = field(default=None, kw_only=True)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Prefix blocks were evicted from the cache."""

    block_hashes: tuple[BlockHash, ...]
    medium: str | None = field(default=None, kw_only=True)
    group_idx: int | None = field(default=None, kw_only=True)


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache was reset (in the union; TokenSpeed never emits it)."""


KVEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    """One round's events on one attention-DP rank (TokenSpeed's ``KVEventBatch``).

    ``ts`` is wall-clock seconds since the Unix epoch at publish time; ``dp_rank``
    is ``None`` only in batches from vLLM publishers that leave it unset.
    """

    ts: float
    events: tuple[KVEvent, ...]
    dp_rank: int | None


# -- block hashes ---------------------------------------------------------------


def block_hash(parent: int | None, token_ids: Sequence[int]) -> int:
    """The 64-bit FNV-1a block hash of docs/protocol.md#proto-kv-wire (for consumers
    that recompute hashes).

    Input bytes: ``1`` and the parent's 8 little-endian bytes if there is a parent,
    else ``0``; the token count as 8 little-endian bytes; each token id as 4
    little-endian two's-complement bytes.
    """
    parts = bytearray()
    if parent is None:
        parts.append(0)
    else:
        parts.append(1)
        parts += (parent & _U64_MAX).to_bytes(8, "little")
    parts += len(token_ids).to_bytes(8, "little")
    for token in token_ids:
        parts += (token & 0xFFFFFFFF).to_bytes(4, "little")
    h = FNV_OFFSET_BASIS
    for byte in parts:
        h = ((h ^ byte) * FNV_PRIME) & _U64_MAX
    return h


def chain_block_hashes(
    token_ids: Sequence[int], block_size: int, parent: int | None = None
) -> list[int]:
    """Hashes of the full blocks of a token sequence, each chained to the one before.

    A trailing partial block is not hashed (only full blocks enter a prefix cache).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    hashes: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


# -- from the scheduler -----------------------------------------------------------

_STORED_KINDS: Final = frozenset({"blockstored", "stored"})
_REMOVED_KINDS: Final = frozenset({"blockremoved", "removed"})


def from_scheduler_event(native: Any) -> KVEvent:
    """One scheduler-native event as its wire struct (docs/protocol.md#proto-kv-source).

    Dispatches on the event's ``kind`` attribute, not on its shape; integers are
    coerced to plain ``int`` (the binding may hand out numpy or C++ integers).
    The scheduler's kind names are matched case-insensitively as ``BlockStored`` /
    ``stored`` and ``BlockRemoved`` / ``removed`` [inferred: the binding is not
    part of the spec's sources]. Anything else raises TokenSpeed's
    ``TypeError("Unsupported scheduler KV event kind: {kind}")``.
    """
    kind = getattr(native, "kind", None)
    name = str(kind).lower()
    if name in _STORED_KINDS:
        parent = native.parent_block_hash
        return BlockStored(
            tuple(int(h) for h in native.block_hashes),
            None if parent is None else int(parent),
            tuple(int(t) for t in native.token_ids),
            int(native.block_size),
        )
    if name in _REMOVED_KINDS:
        return BlockRemoved(tuple(int(h) for h in native.block_hashes))
    raise TypeError(f"Unsupported scheduler KV event kind: {kind}")


def from_scheduler_events(natives: Iterable[Any]) -> list[KVEvent]:
    """A drained list of scheduler events as wire structs, in order."""
    return [from_scheduler_event(n) for n in natives]


# -- encoding -------------------------------------------------------------------

_PACKER_OPTIONS: Final[dict[str, Any]] = {"use_bin_type": True, "use_single_float": False}


def _event_array(event: KVEvent) -> tuple[Any, ...]:
    """The event as the tagged array msgpack writes (tuples pack as arrays)."""
    if isinstance(event, BlockStored):
        return (
            "BlockStored",
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
        )
    if isinstance(event, BlockRemoved):
        return ("BlockRemoved", event.block_hashes)
    return ("AllBlocksCleared",)


def encode_event(event: KVEvent) -> bytes:
    """One event's bytes in TokenSpeed's array form (what appears inside a batch)."""
    return _pack(_event_array(event))


def encode_batch(batch: KVEventBatch) -> bytes:
    """The batch payload, byte-identical to TokenSpeed's (``[ts, events, dp_rank]``).

    ``ts`` is always a float64 (``0xcb``), integers take their smallest msgpack form.
    Raises :class:`ValueError` for an integer outside the 64-bit ranges.
    """
    return encode_events(batch.ts, batch.events, batch.dp_rank)


def encode_events(ts: float, events: Iterable[KVEvent], dp_rank: int | None) -> bytes:
    """The payload of a batch of ``events`` without building the :class:`KVEventBatch`
    first; the same bytes as :func:`encode_batch`. (The publisher encodes with a
    :class:`BatchEncoder`, which is faster and writes the same bytes.)"""
    return _pack((float(ts), _event_arrays(events), dp_rank))


def _event_arrays(events: Iterable[KVEvent]) -> list[tuple[Any, ...]]:
    """Every event as its tagged array; :class:`BlockStored` (nearly every event) is
    built inline, without a call per event."""
    stored = BlockStored
    return [
        ("BlockStored", e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size)
        if type(e) is stored
        else _event_array(e)
        for e in events
    ]


def _pack(obj: object) -> bytes:
    try:
        packed = msgpack.packb(obj, **_PACKER_OPTIONS)
    except OverflowError as exc:
        raise ValueError(f"a KV event field does not fit a 64-bit integer: {exc}") from None
    assert isinstance(packed, bytes)
    return packed


@final
class BatchEncoder:
    """Encodes one publisher's batch payloads, byte for byte as :func:`encode_events`.

    The publisher's hot path: the event arrays go to msgspec's msgpack encoder (the
    one TokenSpeed encodes with; it writes the same bytes as the reference
    :func:`encode_events`, which uses msgpack, at twice its speed on events with
    token ids), kept for the encoder's lifetime. A batch msgspec refuses (an
    ``int`` subclass, say) is written by the reference encoder instead, so
    whatever :func:`encode_events` writes, this writes too (msgspec also writes a
    few things the reference refuses, a set as an array for one); what neither can
    write raises :class:`ValueError` (an integer outside the 64-bit ranges) or
    :class:`TypeError`. ``dp_rank`` is the attention-DP rank written into every
    batch. Instances are independent (one per publisher's sender).
    """

    __slots__ = ("_encode", "dp_rank")

    def __init__(self, dp_rank: int | None) -> None:
        self.dp_rank = dp_rank
        self._encode = msgspec.msgpack.Encoder().encode

    def encode(self, ts: float, events: Iterable[KVEvent]) -> bytes:
        """The payload ``[ts, events, dp_rank]`` of one batch."""
        batch = (float(ts), _event_arrays(events), self.dp_rank)
        try:
            return self._encode(batch)
        except (TypeError, ValueError, OverflowError, msgspec.EncodeError):
            return _pack(batch)


# -- decoding -------------------------------------------------------------------
#
# Two paths give the same result. The fast path covers what TokenSpeed and SGLang
# send (the array form, integer hashes): it checks each event's shape inline,
# checks every hash and token id of the batch at once at C speed, and builds the
# structs through builders (below) instead of their generated ``__init__``. It never
# raises: anything unusual -- the map form, byte-string hashes, trailing fields, an
# integer timestamp, any malformed field -- sends the whole batch down the careful
# path, which accepts it or names what is wrong.

_INT_ONLY: Final = frozenset({int})


class _StoredBuilder:
    """Builds a :class:`BlockStored` at a quarter of the cost of its ``__init__``.

    A frozen dataclass's ``__init__`` must go through ``object.__setattr__`` for each
    field; this class has the very same slots, fills them with plain stores, then
    becomes a ``BlockStored`` (``__class__`` assignment between identical slot
    layouts). The result is an ordinary ``BlockStored`` in every respect.
    """

    __slots__ = BlockStored.__slots__

    def __init__(
        self, hashes: tuple[int, ...], parent: int | None, tokens: tuple[int, ...], size: int
    ) -> None:
        self.block_hashes = hashes
        self.parent_block_hash = parent
        self.token_ids = tokens
        self.block_size = size
        self.medium = None
        self.group_idx = None
        self.lora_name = None
        self.__class__ = BlockStored  # type: ignore[assignment]


class _RemovedBuilder:
    """Builds a :class:`BlockRemoved` the same way (see :class:`_StoredBuilder`)."""

    __slots__ = BlockRemoved.__slots__

    def __init__(self, hashes: tuple[int, ...]) -> None:
        self.block_hashes = hashes
        self.medium = None
        self.group_idx = None
        self.__class__ = BlockRemoved  # type: ignore[assignment]


def decode_batch(payload: bytes | bytearray | memoryview) -> KVEventBatch:
    """Decode a batch payload in TokenSpeed's array form or vLLM's map form.

    Raises :class:`WireError` (and nothing else) for anything malformed.
    """
    try:
        # Arrays come back as tuples: the structs keep them as they are.
        obj = msgpack.unpackb(payload, raw=False, use_list=False, strict_map_key=True, timestamp=0)
    except Exception as exc:  # msgpack raises a zoo of types for bad bytes
        raise WireError(f"KV event batch is not valid msgpack: {exc}") from None
    if type(obj) is tuple and len(obj) == 3:
        ts, events_obj, rank = obj
        if type(ts) is float and (rank is None or type(rank) is int):
            events = _events_fast(events_obj)
            if events is not None:
                return KVEventBatch(ts, events, rank)
    return _batch_from_obj(obj)


def _events_fast(events: object) -> tuple[KVEvent, ...] | None:
    """TokenSpeed-shaped events (array form, integer hashes), or ``None`` otherwise."""
    if type(events) is not tuple:
        return None
    out: list[Any] = []
    append = out.append
    hash_runs: list[tuple[Any, ...]] = []
    parents: list[object] = []
    token_runs: list[tuple[Any, ...]] = []
    for event in events:
        if type(event) is not tuple:
            return None
        size = len(event)
        if size == 5:
            tag, hashes, parent, tokens, block_size = event
            if (
                tag != "BlockStored"
                or type(hashes) is not tuple
                or type(tokens) is not tuple
                or type(block_size) is not int
            ):
                return None
            hash_runs.append(hashes)
            token_runs.append(tokens)
            if parent is not None:
                parents.append(parent)
            append(_StoredBuilder(hashes, parent, tokens, block_size))
        elif size == 2:
            tag, hashes = event
            if tag != "BlockRemoved" or type(hashes) is not tuple:
                return None
            hash_runs.append(hashes)
            append(_RemovedBuilder(hashes))
        elif size == 1 and event[0] == "AllBlocksCleared":
            append(AllBlocksCleared())
        else:
            return None
    # Every hash an unsigned integer (msgpack never yields one above 2**64 - 1, and
    # ``type() is int`` excludes bool), every token id an integer.
    hashes_flat = list(chain.from_iterable(hash_runs))
    hashes_flat += parents
    if hashes_flat and not (set(map(type, hashes_flat)) <= _INT_ONLY and min(hashes_flat) >= 0):
        return None
    if not set(map(type, chain.from_iterable(token_runs))) <= _INT_ONLY:
        return None
    return tuple(out)


def _batch_from_obj(obj: object) -> KVEventBatch:
    """The careful path: every shape both forms allow, and a precise error otherwise."""
    if isinstance(obj, tuple):
        if not 2 <= len(obj) <= 3:
            raise WireError(
                f"KV event batch must be an array of [ts, events, dp_rank], got {len(obj)} items"
            )
        ts_obj, events_obj = obj[0], obj[1]
        rank_obj = obj[2] if len(obj) == 3 else None
    elif isinstance(obj, dict):
        if "ts" not in obj or "events" not in obj:
            raise WireError("KV event batch map must have the keys 'ts' and 'events'")
        ts_obj, events_obj = obj["ts"], obj["events"]
        rank_obj = obj.get("data_parallel_rank", obj.get("attn_dp_rank"))
    else:
        raise WireError(f"KV event batch must be a msgpack array, got {_kind(obj)}")
    if isinstance(ts_obj, bool) or not isinstance(ts_obj, float | int):
        raise WireError(f"KV event batch timestamp must be a number, got {_kind(ts_obj)}")
    if not isinstance(events_obj, tuple):
        raise WireError(f"KV event batch events must be an array, got {_kind(events_obj)}")
    dp_rank = _opt_int(rank_obj, "KV event batch dp_rank")
    return KVEventBatch(float(ts_obj), tuple(_event_from_obj(e) for e in events_obj), dp_rank)


def _event_from_obj(obj: object) -> KVEvent:
    if isinstance(obj, tuple):
        return _event_from_array(obj)
    if isinstance(obj, dict):
        return _event_from_map(obj)
    raise WireError(f"KV event must be a tagged array or map, got {_kind(obj)}")


def _event_from_array(items: tuple[Any, ...]) -> KVEvent:
    if not items or not isinstance(items[0], str):
        raise WireError("KV event array must start with its type name")
    tag = items[0]
    if tag == "BlockStored":
        if len(items) < 5:
            raise WireError(
                f"BlockStored must have at least 4 fields "
                f"[block_hashes, parent_block_hash, token_ids, block_size], got {len(items) - 1}"
            )
        return BlockStored(
            _hashes(items[1]),
            _opt_hash(items[2]),
            _token_ids(items[3]),
            _int(items[4], "BlockStored block_size"),
        )
    if tag == "BlockRemoved":
        if len(items) < 2:
            raise WireError("BlockRemoved must have the field block_hashes")
        return BlockRemoved(_hashes(items[1]))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise WireError(f"unknown KV event type {tag!r}")


def _event_from_map(fields: Mapping[str, Any]) -> KVEvent:
    tag = fields.get("type")
    if tag == "BlockStored":
        for key in ("block_hashes", "token_ids", "block_size"):
            if key not in fields:
                raise WireError(f"BlockStored map is missing the field {key!r}")
        return BlockStored(
            _hashes(fields["block_hashes"]),
            _opt_hash(fields.get("parent_block_hash")),
            _token_ids(fields["token_ids"]),
            _int(fields["block_size"], "BlockStored block_size"),
            medium=_opt_str(fields.get("medium"), "BlockStored medium"),
            group_idx=_opt_int(fields.get("group_idx"), "BlockStored group_idx"),
            lora_name=_opt_str(fields.get("lora_name"), "BlockStored lora_name"),
        )
    if tag == "BlockRemoved":
        if "block_hashes" not in fields:
            raise WireError("BlockRemoved map is missing the field 'block_hashes'")
        return BlockRemoved(
            _hashes(fields["block_hashes"]),
            medium=_opt_str(fields.get("medium"), "BlockRemoved medium"),
            group_idx=_opt_int(fields.get("group_idx"), "BlockRemoved group_idx"),
        )
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise WireError(f"unknown KV event type {tag!r}")


def _kind(obj: object) -> str:
    return "nil" if obj is None else type(obj).__name__


def _hash(obj: object) -> BlockHash:
    if isinstance(obj, bytes):
        return obj
    if isinstance(obj, int) and not isinstance(obj, bool):
        if 0 <= obj <= _U64_MAX:
            return obj
        raise WireError(f"block hash {obj} is outside the unsigned 64-bit range")
    raise WireError(f"block hash must be an unsigned integer or bytes, got {_kind(obj)}")


def _opt_hash(obj: object) -> BlockHash | None:
    return None if obj is None else _hash(obj)


def _hashes(obj: object) -> tuple[BlockHash, ...]:
    if not isinstance(obj, tuple):
        raise WireError(f"block_hashes must be an array, got {_kind(obj)}")
    # Plain non-negative integers are the common case, checked at C speed.
    if set(map(type, obj)) <= _INT_ONLY and (not obj or min(obj) >= 0):
        return obj
    return tuple(_hash(h) for h in obj)


def _token_ids(obj: object) -> tuple[int, ...]:
    if not isinstance(obj, tuple):
        raise WireError(f"token_ids must be an array, got {_kind(obj)}")
    # msgpack integers always fit 64 bits; only the type needs checking.
    if set(map(type, obj)) <= _INT_ONLY:
        return obj
    for token in obj:
        if isinstance(token, bool) or not isinstance(token, int):
            raise WireError(f"token id must be an integer, got {_kind(token)}")
    raise AssertionError("unreachable: a non-int token id was found above")


def _int(obj: object, what: str) -> int:
    if isinstance(obj, bool) or not isinstance(obj, int):
        raise WireError(f"{what} must be an integer, got {_kind(obj)}")
    return obj


def _opt_int(obj: object, what: str) -> int | None:
    return None if obj is None else _int(obj, what)


def _opt_str(obj: object, what: str) -> str | None:
    if obj is None or isinstance(obj, str):
        return obj
    raise WireError(f"{what} must be a string, got {_kind(obj)}")


# -- live PUB frames ------------------------------------------------------------


def encode_seq(seq: int) -> bytes:
    """A sequence number as its 8-byte big-endian frame (``-1`` is the end marker)."""
    return seq.to_bytes(8, "big", signed=seq < 0)


@dataclass(frozen=True, slots=True)
class PubMessage:
    """One live message as it arrives on a SUB socket."""

    topic: bytes
    seq: int
    payload: bytes


def encode_pub_frames(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    """The three live frames ``[topic, seq (8 B big-endian), payload]``
    (docs/protocol.md#proto-kv-pub)."""
    if not 0 <= seq <= _U64_MAX:
        raise ValueError(f"sequence number {seq} is outside the unsigned 64-bit range")
    return [topic, seq.to_bytes(8, "big"), payload]


def decode_pub_frames(frames: Sequence[bytes]) -> PubMessage:
    """Split a live message; raises :class:`WireError` unless it has exactly 3 frames
    and an 8-byte sequence number (the payload is decoded separately)."""
    seq, payload = split_pub_frames(frames)
    return PubMessage(bytes(frames[0]), seq, payload)


def split_pub_frames(frames: Sequence[bytes]) -> tuple[int, bytes]:
    """``(seq, payload)`` of a live message, checked as :func:`decode_pub_frames`
    checks it, without building a :class:`PubMessage` (the subscriber's hot path)."""
    if len(frames) != 3:
        raise WireError(
            f"KV event message must have 3 frames [topic, seq, payload], got {len(frames)}"
        )
    _topic, seq, payload = frames
    if len(seq) != 8:
        raise WireError(f"KV event sequence number must be 8 bytes, got {len(seq)}")
    return int.from_bytes(seq, "big"), bytes(payload)
