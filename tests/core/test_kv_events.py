"""KV event structs: golden bytes, consumer compatibility, map form, malformed input."""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable, Sequence
from enum import IntEnum

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tspd.core.errors import WireError
from tspd.core.kv_events import (
    AllBlocksCleared,
    BatchEncoder,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    _batch_from_obj,
    block_hash,
    chain_block_hashes,
    decode_batch,
    decode_pub_frames,
    encode_batch,
    encode_event,
    encode_events,
    encode_pub_frames,
    encode_seq,
    from_scheduler_event,
    from_scheduler_events,
    split_pub_frames,
)

U64 = (1 << 64) - 1

# The reference encodings of docs/protocol.md#proto-kv-wire, produced by msgspec 0.23.0.
GOLDEN_BATCH = bytes.fromhex(
    "93" "cb3ff8000000000000" "92"
    "95" "ab" + b"BlockStored".hex() + "91" "7b" "c0" "92" "01" "02" "02"
    "92" "ac" + b"BlockRemoved".hex() + "91" "7b"
    "02"
)  # fmt: skip
GOLDEN_EVENT = bytes.fromhex(
    "95" "ab" + b"BlockStored".hex() + "91" "cfffffffffffffffff" "cf8000000000000000"
    "92" "ff" "ce00011170" "10"
)  # fmt: skip


def test_reference_batch_encoding_is_byte_identical() -> None:
    batch = KVEventBatch(
        1.5, (BlockStored((123,), None, (1, 2), 2), BlockRemoved((123,))), dp_rank=2
    )
    assert encode_batch(batch) == GOLDEN_BATCH


def test_reference_event_with_extreme_integers_is_byte_identical() -> None:
    event = BlockStored((U64,), 1 << 63, (-1, 70000), 16)
    assert encode_event(event) == GOLDEN_EVENT
    batch = encode_batch(KVEventBatch(1.5, (event,), 0))
    assert batch.endswith(GOLDEN_EVENT + b"\x00")


def test_all_blocks_cleared_is_a_one_element_tagged_array() -> None:
    assert encode_event(AllBlocksCleared()) == b"\x91\xb0AllBlocksCleared"


def test_timestamp_is_always_float64_even_for_integral_values() -> None:
    payload = encode_batch(KVEventBatch(2.0, (), 0))
    assert payload[1] == 0xCB
    assert struct.unpack(">d", payload[2:10]) == (2.0,)


def test_a_plain_msgpack_consumer_reads_the_dynamo_shape() -> None:
    """Decoded the vLLM/Dynamo way: plain msgpack into lists."""
    decoded = msgpack.unpackb(GOLDEN_BATCH, raw=False)
    assert decoded == [1.5, [["BlockStored", [123], None, [1, 2], 2], ["BlockRemoved", [123]]], 2]


def _event_strategy() -> st.SearchStrategy[BlockStored | BlockRemoved | AllBlocksCleared]:
    hashes = st.lists(st.integers(0, U64), max_size=4).map(tuple)
    tokens = st.lists(st.integers(-(1 << 31), (1 << 31) - 1), max_size=8).map(tuple)
    stored = st.builds(
        BlockStored, hashes, st.none() | st.integers(0, U64), tokens, st.integers(1, 1 << 20)
    )
    removed = st.builds(BlockRemoved, hashes)
    return stored | removed | st.just(AllBlocksCleared())


batches = st.builds(
    KVEventBatch,
    st.floats(allow_nan=False, allow_infinity=False),
    st.lists(_event_strategy(), max_size=6).map(tuple),
    st.none() | st.integers(0, 1 << 16),
)


@given(batches)
def test_round_trip_and_plain_msgpack_view(batch: KVEventBatch) -> None:
    payload = encode_batch(batch)
    assert decode_batch(payload) == batch
    assert encode_events(batch.ts, iter(batch.events), batch.dp_rank) == payload
    plain = msgpack.unpackb(payload, raw=False)
    assert plain[0] == batch.ts
    assert [event[0] for event in plain[1]] == [type(e).__name__ for e in batch.events]
    assert plain[2] == batch.dp_rank


def test_map_form_from_vllm_is_decoded_with_its_extra_fields() -> None:
    payload = msgpack.packb(
        [
            3.25,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [b"\x01" * 32, 7],
                    "parent_block_hash": None,
                    "token_ids": [5, 6, 7],
                    "block_size": 16,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                    "extra_keys": None,
                    "group_idx": 1,
                },
                {"type": "BlockRemoved", "block_hashes": [7], "medium": "CPU"},
                {"type": "AllBlocksCleared"},
            ],
            None,
        ]
    )
    batch = decode_batch(payload)
    assert batch.ts == 3.25
    assert batch.dp_rank is None
    assert batch.events == (
        BlockStored((b"\x01" * 32, 7), None, (5, 6, 7), 16, medium="GPU", group_idx=1),
        BlockRemoved((7,), medium="CPU"),
        AllBlocksCleared(),
    )


def test_legacy_array_form_with_trailing_fields_is_accepted() -> None:
    """SGLang and older vLLM append lora_id, medium ... to the positional array."""
    payload = msgpack.packb(
        [1.0, [["BlockStored", [1], 9, [1], 1, None, "GPU"], ["BlockRemoved", [1], "GPU"]], 3]
    )
    batch = decode_batch(payload)
    assert batch.events == (BlockStored((1,), 9, (1,), 1), BlockRemoved((1,)))
    assert batch.dp_rank == 3


def test_map_shaped_batch_is_accepted() -> None:
    payload = msgpack.packb({"ts": 1, "events": [], "data_parallel_rank": 4})
    assert decode_batch(payload) == KVEventBatch(1.0, (), 4)


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ([1.0], "got 1 items"),
        ([1.0, [], 0, 0], "got 4 items"),
        ("x", "must be a msgpack array"),
        ([True, [], 0], "timestamp must be a number"),
        ([1.0, {}, 0], "events must be an array"),
        ([1.0, [], "0"], "dp_rank must be an integer"),
        ([1.0, [["Nope"]], 0], "unknown KV event type 'Nope'"),
        ([1.0, [[]], 0], "must start with its type name"),
        ([1.0, [["BlockStored", [1], None, [1]]], 0], "at least 4 fields"),
        ([1.0, [["BlockStored", [-1], None, [1], 1]], 0], "outside the unsigned 64-bit"),
        ([1.0, [["BlockStored", ["h"], None, [1], 1]], 0], "must be an unsigned integer"),
        ([1.0, [["BlockStored", [1], None, [1.5], 1]], 0], "token id must be an integer"),
        ([1.0, [["BlockStored", [1], None, [1], None]], 0], "block_size must be an integer"),
        ([1.0, [["BlockRemoved"]], 0], "block_hashes"),
        ([1.0, [{"type": "BlockStored", "block_hashes": []}], 0], "missing the field"),
        ([1.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": 3}], 0], "medium"),
        ([1.0, [7], 0], "tagged array or map"),
        ({"events": []}, "'ts' and 'events'"),
    ],
)
def test_malformed_batches_raise_wire_error(obj: object, message: str) -> None:
    with pytest.raises(WireError, match=message):
        decode_batch(msgpack.packb(obj))


@pytest.mark.parametrize(
    "payload",
    [b"", b"\xc1", b"\x93\xcb", GOLDEN_BATCH + b"\x00", b"\xd6\xff\x00\x00\x00\x01"],
)
def test_bytes_that_are_not_one_msgpack_value_raise_wire_error(payload: bytes) -> None:
    with pytest.raises(WireError):
        decode_batch(payload)


@given(st.binary(max_size=64))
def test_any_bytes_decode_or_raise_wire_error(payload: bytes) -> None:
    outcome: object
    try:
        outcome = decode_batch(payload)
    except WireError as exc:
        outcome = exc
    assert isinstance(outcome, KVEventBatch | WireError)


def test_encoding_rejects_integers_outside_64_bits() -> None:
    with pytest.raises(ValueError, match="64-bit"):
        encode_batch(KVEventBatch(0.0, (BlockRemoved((1 << 64,)),), 0))


def test_the_batch_encoder_writes_the_reference_bytes() -> None:
    encoder = BatchEncoder(2)
    events = [BlockStored((123,), None, (1, 2), 2), BlockRemoved((123,))]
    assert encoder.encode(1.5, events) == GOLDEN_BATCH
    assert encoder.encode(1.5, iter(events)) == GOLDEN_BATCH  # reused, from an iterator
    extreme = BatchEncoder(0).encode(1.5, [BlockStored((U64,), 1 << 63, (-1, 70000), 16)])
    assert extreme.endswith(GOLDEN_EVENT + b"\x00")


@given(batches)
def test_the_batch_encoder_agrees_with_encode_batch(batch: KVEventBatch) -> None:
    encoder = BatchEncoder(batch.dp_rank)
    for _ in range(2):
        assert encoder.encode(batch.ts, batch.events) == encode_batch(batch)


def test_the_batch_encoder_writes_subclassed_events_as_their_base() -> None:
    class Stored(BlockStored):
        __slots__ = ()

    plain = BlockStored((5,), 4, (1, 2, 3), 3)
    sub = Stored((5,), 4, (1, 2, 3), 3)
    assert BatchEncoder(0).encode(2, [sub]) == encode_batch(KVEventBatch(2.0, (plain,), 0))


def test_what_msgspec_refuses_the_batch_encoder_writes_as_the_reference_does() -> None:
    class Token(int):
        pass

    class Rank(IntEnum):
        TWO = 2

    events = [BlockStored((Token(1 << 40),), Token(3), (Token(70000), -1), Token(16))]
    plain = [BlockStored((1 << 40,), 3, (70000, -1), 16)]
    reference = encode_batch(KVEventBatch(1.0, tuple(plain), 2))
    assert encode_events(1.0, events, 2) == reference
    assert BatchEncoder(2).encode(1.0, events) == reference
    assert BatchEncoder(Rank.TWO).encode(1, plain) == reference


def test_the_batch_encoder_raises_for_bad_fields_and_stays_usable() -> None:
    encoder = BatchEncoder(0)
    good = [BlockRemoved((7,))]
    with pytest.raises(ValueError, match="64-bit"):
        encoder.encode(0.0, [BlockRemoved((1, 1 << 64))])
    assert encoder.encode(0.0, good) == encode_batch(KVEventBatch(0.0, tuple(good), 0))
    with pytest.raises(TypeError):
        encoder.encode(0.0, [BlockRemoved((object(),))])  # type: ignore[arg-type]
    assert encoder.encode(0.0, good) == encode_batch(KVEventBatch(0.0, tuple(good), 0))


# The decoder's fast path (TokenSpeed's shape) must agree with its careful path on
# every input: same batch, or the same error message.

_FIELD = st.one_of(
    st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Other"]),
    st.none(),
    st.booleans(),
    st.integers(-(1 << 63), U64),
    st.sampled_from([-1, 0, 1, U64, 1.5, b"\x01" * 4, "GPU"]),
    st.lists(st.integers(-2, 3) | st.sampled_from([U64, True, 2.5, b"h", None]), max_size=3),
)
_STORED = st.tuples(
    st.just("BlockStored"),
    st.lists(st.integers(0, U64), max_size=3),
    st.none() | st.integers(0, U64),
    st.lists(st.integers(-(1 << 63), U64), max_size=3),
    st.integers(-4, 1 << 20),
).map(list)
_REMOVED = st.tuples(st.just("BlockRemoved"), st.lists(st.integers(0, U64), max_size=3)).map(list)
_VALID_EVENT = _STORED | _REMOVED | st.just(["AllBlocksCleared"])


def _mutated(event_index_field: tuple[Sequence[object], int, object]) -> list[object]:
    """A valid event with one field replaced, or one trailing field added."""
    event, index, field = event_index_field
    if index == len(event):
        return [*event, field]
    return [*event[:index], field, *event[index + 1 :]]


_RAW_EVENT = st.one_of(
    _VALID_EVENT,
    st.tuples(_VALID_EVENT, st.integers(0, 5), _FIELD)
    .filter(lambda t: t[1] <= len(t[0]))
    .map(_mutated),
    st.lists(_FIELD, max_size=6),
    _FIELD,
)
_RAW_BATCH = st.one_of(
    st.tuples(st.just(1.0), st.lists(_VALID_EVENT, max_size=4), st.none() | st.integers(0, 9)),
    st.tuples(st.just(1.0), st.lists(_RAW_EVENT, max_size=4), st.none()),
    st.tuples(_FIELD, st.lists(_RAW_EVENT, max_size=3), _FIELD),
    st.lists(_FIELD, max_size=4),
).map(list)


def _outcome(decode: Callable[[], KVEventBatch]) -> object:
    try:
        return decode()
    except WireError as exc:
        return f"WireError: {exc}"


@given(_RAW_BATCH)
def test_fast_and_careful_decoding_agree(obj: object) -> None:
    payload = msgpack.packb(obj)
    careful = _outcome(lambda: _batch_from_obj(msgpack.unpackb(payload, use_list=False)))
    assert _outcome(lambda: decode_batch(payload)) == careful


@given(batches)
def test_decoded_events_are_ordinary_frozen_structs(batch: KVEventBatch) -> None:
    decoded = decode_batch(encode_batch(batch))
    assert [type(e) for e in decoded.events] == [type(e) for e in batch.events]
    assert hash(decoded) == hash(batch)
    for event in decoded.events:
        assert repr(event) == repr(dataclasses.replace(event))
        if not isinstance(event, AllBlocksCleared):
            with pytest.raises(dataclasses.FrozenInstanceError):
                event.medium = "GPU"  # type: ignore[misc]


def test_a_tokenspeed_batch_decodes_fast_with_every_field() -> None:
    batch = decode_batch(GOLDEN_BATCH)
    assert batch == KVEventBatch(
        1.5, (BlockStored((123,), None, (1, 2), 2), BlockRemoved((123,))), dp_rank=2
    )
    stored = batch.events[0]
    assert isinstance(stored, BlockStored)
    assert (stored.medium, stored.group_idx, stored.lora_name) == (None, None, None)


def _fnv1a_reference(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for byte in data:
        h ^= byte
        h = (h * 0x100000001B3) % (1 << 64)
    return h


def test_fnv1a_reference_matches_the_published_vector() -> None:
    assert _fnv1a_reference(b"a") == 0xAF63DC4C8601EC8C


def test_block_hash_follows_the_spec_byte_layout() -> None:
    tokens = [1, -2, 70000]
    first = block_hash(None, tokens)
    expected_first = _fnv1a_reference(b"\x00" + struct.pack("<Q", 3) + struct.pack("<3i", *tokens))
    assert first == expected_first
    second = block_hash(first, [4])
    assert second == _fnv1a_reference(
        b"\x01" + struct.pack("<Q", first) + struct.pack("<Q", 1) + struct.pack("<i", 4)
    )


def test_chain_hashes_only_full_blocks_each_chained_to_its_parent() -> None:
    tokens = list(range(10))
    hashes = chain_block_hashes(tokens, 4)
    assert hashes == [block_hash(None, tokens[0:4]), block_hash(hashes[0], tokens[4:8])]
    with pytest.raises(ValueError, match="block_size"):
        chain_block_hashes(tokens, 0)


def test_pub_frames_round_trip_and_reject_bad_shapes() -> None:
    frames = encode_pub_frames(b"kv", 258, b"payload")
    assert frames == [b"kv", b"\x00\x00\x00\x00\x00\x00\x01\x02", b"payload"]
    message = decode_pub_frames(frames)
    assert split_pub_frames(frames) == (258, b"payload")
    with pytest.raises(WireError, match="8 bytes"):
        split_pub_frames([b"kv", b"\x00" * 9, b""])
    assert (message.topic, message.seq, message.payload) == (b"kv", 258, b"payload")
    with pytest.raises(WireError, match="3 frames"):
        decode_pub_frames([b"kv", b"\x00" * 8])
    with pytest.raises(WireError, match="8 bytes"):
        decode_pub_frames([b"kv", b"\x00" * 7, b""])
    with pytest.raises(ValueError, match="64-bit"):
        encode_pub_frames(b"", -1, b"")


def test_encode_seq_writes_the_end_marker_as_twos_complement() -> None:
    assert encode_seq(-1) == b"\xff" * 8
    assert encode_seq(1) == b"\x00" * 7 + b"\x01"


class _Native:
    """A scheduler-native event as the binding hands it out (numpy-like integers)."""

    def __init__(self, kind: str, **fields: object) -> None:
        self.kind = kind
        for name, value in fields.items():
            setattr(self, name, value)


class _NumpyLikeInt:
    def __init__(self, value: int) -> None:
        self.value = value

    def __int__(self) -> int:
        return self.value


def test_scheduler_events_translate_by_kind_and_coerce_integers() -> None:
    stored = _Native(
        "BlockStored",
        block_hashes=[_NumpyLikeInt(5)],
        parent_block_hash=_NumpyLikeInt(4),
        token_ids=[_NumpyLikeInt(1), 2],
        block_size=_NumpyLikeInt(2),
    )
    first = _Native("stored", block_hashes=[4], parent_block_hash=None, token_ids=[9], block_size=1)
    removed = _Native("BlockRemoved", block_hashes=[5])
    events = from_scheduler_events([stored, first, removed])
    assert events == [
        BlockStored((5,), 4, (1, 2), 2),
        BlockStored((4,), None, (9,), 1),
        BlockRemoved((5,)),
    ]
    assert all(type(h) is int for e in events for h in e.block_hashes)  # type: ignore[union-attr]


def test_unknown_scheduler_kind_is_tokenspeeds_type_error() -> None:
    # Shape does not matter: a removal-shaped event of an unknown kind is refused.
    with pytest.raises(TypeError, match=r"^Unsupported scheduler KV event kind: Evicted$"):
        from_scheduler_event(_Native("Evicted", block_hashes=[1]))
