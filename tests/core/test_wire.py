"""Control-message codecs (docs/protocol.md#proto-messages): every message, bound, check
order and exact error text, round trips, and the "decode or WireError, nothing else"
property."""

from __future__ import annotations

import contextlib
import json
import math
import struct
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tspd.core.contract import parse_contract
from tspd.core.errors import ContractError, WireError
from tspd.core.poll import TransferPoll
from tspd.core.wire import (
    MAX_CONTROL_FRAME_BYTES,
    MAX_RANK,
    MAX_ROOM,
    MAX_SPEC_CANDIDATES,
    MAX_STATUS_FRAME_BYTES,
    EmbeddingStatus,
    Preallocation,
    Registration,
    RouteHeader,
    StatusMessage,
    decode_embedding_status,
    decode_preallocation,
    decode_registration,
    decode_registration_route,
    decode_status,
    decode_uint,
    encode_embedding_status,
    encode_preallocation,
    encode_registration,
    encode_status,
    encode_uint,
    endpoint_problem,
    failure_notice,
    is_registration,
    session_port,
)

# A small valid contract in the S1 schema (docs/protocol.md#proto-contract-schema): one
# full-history group.
CONTRACT_TREE: dict[str, Any] = {
    "plan": {
        "prefix_granularity": 16,
        "lcm_block_bytes": 1024,
        "num_lcm_blocks": 4,
        "groups": [{"group_id": "full", "cache_blocks_per_lcm_block": 1, "page_count": 5}],
        "planes": [{"plane_id": "kv", "bytes_per_lcm_block": 1024, "arena_offset_bytes": 0}],
        "fields": [
            {
                "group_id": "full",
                "field_id": "layer.0.kv",
                "plane_id": "kv",
                "shape": [16, 32],
                "dtype": "bfloat16",
                "field_offset_bytes": 0,
                "page_stride_bytes": 1024,
            }
        ],
    },
    "group_specs": [
        {
            "group_id": "full",
            "retention": "full_history",
            "rows_per_page": 16,
            "entry_stride_tokens": 1,
            "sliding_window_tokens": None,
            "family": "history",
            "transfer_policy": "full_suffix",
            "checkpoint_granularity": None,
        }
    ],
    "transfer_schema": {"fields": []},
}
CONTRACT_BYTES = json.dumps(CONTRACT_TREE, separators=(",", ":")).encode()
CONTRACT = parse_contract(CONTRACT_BYTES)
MANIFEST_BYTES = (
    b'{"groups":[{"group_id":"full","block_ids":[1,2]}],"prefix_len":0,"prompt_len":20}'
)

REGISTRATION_FRAMES: list[bytes] = [
    b"None",
    b"127.0.0.1",
    b"5555",
    b"127.0.0.1:16001",
    (0x7F00_0000_1000).to_bytes(8, "little"),
    CONTRACT_BYTES,
    b"2",
    b"1",
]
PREALLOCATION_FRAMES: list[bytes] = [b"1000000", b"127.0.0.1:16001", MANIFEST_BYTES]
STATUS = StatusMessage(
    room=1_000_000,
    status=TransferPoll.SUCCESS,
    prefill_rank=3,
    bootstrap_token=621224652,
    spec_candidate_ids=(1210209511, 701474692, 832778341),
    cached_tokens=64,
    bootstrap_logprob=-0.25,
)


def replace(frames: list[bytes], index: int, frame: bytes) -> list[bytes]:
    out = list(frames)
    out[index] = frame
    return out


def error_of(call: Callable[[], object]) -> str:
    with pytest.raises(WireError) as info:
        call()
    return str(info.value)


# ---------------------------------------------------------------- canonical integers


@pytest.mark.parametrize(
    ("frame", "value"),
    [(b"0", 0), (b"7", 7), (b"65535", 65535), (b"1", 1)],
)
def test_decode_uint_accepts_canonical_frames(frame: bytes, value: int) -> None:
    assert decode_uint(frame, name="port", minimum=0, maximum=65535) == value


@pytest.mark.parametrize(
    "frame",
    [b"", b"00", b"01", b"+1", b"-1", b" 1", b"1 ", b"1_0", b"123456", b"1a", b"\xd9\xa1", b"0x1"],
)
def test_decode_uint_refuses_non_canonical_frames(frame: bytes) -> None:
    assert error_of(lambda: decode_uint(frame, name="port", minimum=0, maximum=65535)) == (
        "port must be canonical unsigned ASCII"
    )


@pytest.mark.parametrize(("frame", "minimum"), [(b"65536", 0), (b"99999", 0), (b"0", 1)])
def test_decode_uint_refuses_out_of_range_values(frame: bytes, minimum: int) -> None:
    assert error_of(lambda: decode_uint(frame, name="port", minimum=minimum, maximum=65535)) == (
        "port is out of range"
    )


@given(maximum=st.integers(0, 2**64), data=st.data())
def test_uint_round_trip(maximum: int, data: st.DataObject) -> None:
    value = data.draw(st.integers(0, maximum))
    assert decode_uint(encode_uint(value), name="n", minimum=0, maximum=maximum) == value


@given(frame=st.binary(max_size=24))
def test_decode_uint_returns_only_canonical_values(frame: bytes) -> None:
    try:
        value = decode_uint(frame, name="n", minimum=0, maximum=2**63 - 1)
    except WireError:
        return
    assert encode_uint(value) == frame


@pytest.mark.parametrize("value", [-1, True, 1.0])
def test_encode_uint_refuses_values_without_an_encoding(value: Any) -> None:
    with pytest.raises(WireError):
        encode_uint(value)


# ------------------------------------------------------------------- discrimination


def test_is_registration_splits_on_the_none_marker() -> None:
    assert is_registration(REGISTRATION_FRAMES)
    assert is_registration([b"None"])
    assert not is_registration(PREALLOCATION_FRAMES)
    assert not is_registration([b"none"])
    assert not is_registration([b""])


@pytest.mark.parametrize("frames", [[], [b"\xff"], [b"N\xc3\xb6ne", b"x"]])
def test_unroutable_header_is_rejected(frames: list[bytes]) -> None:
    assert error_of(lambda: is_registration(frames)) == (
        "Rejecting malformed Mooncake bootstrap message header"
    )


# --------------------------------------------------------------------- registration


def test_registration_decodes_every_field() -> None:
    reg = decode_registration(REGISTRATION_FRAMES)
    assert reg.endpoint == "127.0.0.1"
    assert reg.port == 5555
    assert reg.session_id == "127.0.0.1:16001"
    assert reg.arena_base == 0x7F00_0000_1000
    assert reg.contract == CONTRACT
    assert reg.contract_bytes == CONTRACT_BYTES
    assert (reg.decode_tp_size, reg.decode_tp_rank) == (2, 1)
    assert reg.route == RouteHeader("127.0.0.1", 5555, "127.0.0.1:16001")
    assert encode_registration(reg) == REGISTRATION_FRAMES


def test_registration_pointer_is_little_endian() -> None:
    frames = replace(REGISTRATION_FRAMES, 4, b"\x01" + b"\x00" * 7)
    assert decode_registration(frames).arena_base == 1
    assert encode_registration(decode_registration(frames))[4] == struct.pack("<Q", 1)


def test_registration_equality_compares_the_parsed_contract() -> None:
    spaced = json.dumps(CONTRACT_TREE, indent=1).encode()
    a = decode_registration(REGISTRATION_FRAMES)
    b = decode_registration(replace(REGISTRATION_FRAMES, 5, spaced))
    assert a == b
    c = decode_registration(replace(REGISTRATION_FRAMES, 2, b"5556"))
    assert a != c


@pytest.mark.parametrize(
    ("index", "frame", "message"),
    [
        (0, b"none", "CachePD slab registration requires exactly 8 frames"),
        (1, b"", "CachePD registration endpoint is invalid"),
        (1, b"h" * 256, "CachePD registration endpoint is invalid"),
        (1, b"h\xc3\xa9", "CachePD registration endpoint is invalid"),
        (3, b"", "CachePD registration session is invalid"),
        (3, b"s" * 513, "CachePD registration session is invalid"),
        (2, b"0", "CachePD registration port is out of range"),
        (2, b"65536", "CachePD registration port is out of range"),
        (2, b"080", "CachePD registration port must be canonical unsigned ASCII"),
        (4, b"\x01" * 7, "CachePD slab pointer frame must be exactly 8 bytes"),
        (4, b"\x01" * 9, "CachePD slab pointer frame must be exactly 8 bytes"),
        (4, b"\x00" * 8, "CachePD slab pointer must be nonzero"),
        (5, b"", "cache transfer contract payload must be 1..262144 bytes"),
        (5, b"{", "invalid cache transfer contract JSON"),
        (5, b"[]", "cache transfer contract payload must be a JSON object"),
        (5, b"{}", "invalid cache transfer contract"),
        (6, b"0", "CachePD decode_tp_size is out of range"),
        (6, b"1025", "CachePD decode_tp_size is out of range"),
        (6, b"10000", "CachePD decode_tp_size must be canonical unsigned ASCII"),
        (7, b"2", "CachePD decode_tp_rank is out of range"),
        (7, b"-1", "CachePD decode_tp_rank must be canonical unsigned ASCII"),
    ],
)
def test_registration_errors(index: int, frame: bytes, message: str) -> None:
    assert error_of(lambda: decode_registration(replace(REGISTRATION_FRAMES, index, frame))) == (
        message
    )


def test_registration_contract_errors_are_contract_errors() -> None:
    with pytest.raises(ContractError):
        decode_registration(replace(REGISTRATION_FRAMES, 5, b"{}"))


@pytest.mark.parametrize("count", [0, 1, 7, 9])
def test_registration_needs_exactly_eight_frames(count: int) -> None:
    frames = (REGISTRATION_FRAMES * 2)[:count]
    assert error_of(lambda: decode_registration(frames)) == (
        "CachePD slab registration requires exactly 8 frames"
    )
    assert error_of(lambda: decode_registration_route(frames)) == (
        "CachePD slab registration requires exactly 8 frames"
    )


# Each step breaks one more frame, in reverse check order; the error must always
# name the earliest broken frame of the order of docs/protocol.md#proto-registration:
# 0, 1, 3, 2, 4 (length), 5, 6, 7, 4 (non-zero).
CHECK_ORDER: list[tuple[int, bytes, str]] = [
    (4, b"\x00" * 8, "CachePD slab pointer must be nonzero"),
    (7, b"9", "CachePD decode_tp_rank is out of range"),
    (6, b"0", "CachePD decode_tp_size is out of range"),
    (5, b"{", "invalid cache transfer contract JSON"),
    (4, b"\x00", "CachePD slab pointer frame must be exactly 8 bytes"),
    (2, b"0", "CachePD registration port is out of range"),
    (3, b"", "CachePD registration session is invalid"),
    (1, b"", "CachePD registration endpoint is invalid"),
    (0, b"Nope", "CachePD slab registration requires exactly 8 frames"),
]


def test_registration_check_order() -> None:
    frames = list(REGISTRATION_FRAMES)
    for index, frame, message in CHECK_ORDER:
        frames[index] = frame
        assert error_of(lambda: decode_registration(frames)) == message


def test_route_header_survives_bad_later_frames() -> None:
    frames = list(REGISTRATION_FRAMES)
    for index, frame, _ in CHECK_ORDER[:5]:
        frames[index] = frame
    assert decode_registration_route(frames) == RouteHeader("127.0.0.1", 5555, "127.0.0.1:16001")
    # The route header itself is checked 0, 1, 3, 2.
    for index, frame, message in CHECK_ORDER[5:]:
        frames[index] = frame
        assert error_of(lambda: decode_registration_route(frames)) == message


ENDPOINT_INVALID = "CachePD registration endpoint is invalid: "


@pytest.mark.parametrize(
    ("endpoint", "detail"),
    [
        (b"*", "'*' is not a host name or IPv4 address"),
        (b"foo bar", "'foo bar' contains spaces or control characters"),
        (b"host\nname", "'host\\nname' contains spaces or control characters"),
        (b"a..b", "'a..b' is not a host name or IPv4 address"),
        (b"-a", "'-a' is not a host name or IPv4 address"),
        (b"a-", "'a-' is not a host name or IPv4 address"),
        (b"x" * 64 + b".com", "is not a host name or IPv4 address"),
        (b"a." * 127 + b"a", "its host has 255 characters, more than 253"),
        (b"256.1.1.1", "'256.1.1.1' is not a dotted-quad IPv4 address"),
        (b"1.2.3.4.5", "'1.2.3.4.5' is not a dotted-quad IPv4 address"),
        (b"010.0.0.1", "'010.0.0.1' is not a dotted-quad IPv4 address"),
        (b"1234", "'1234' is not a dotted-quad IPv4 address"),
        (b":5555", "':5555' has no host before its ':'"),
        (b"::1", "'::1' looks like an IPv6 literal"),
        (b"fe80::1", "'fe80::1' looks like an IPv6 literal"),
        (b"[::1]", "'[::1]' looks like an IPv6 literal"),
    ],
)
def test_registration_endpoint_must_be_a_host_name_or_ipv4_address(
    endpoint: bytes, detail: str
) -> None:
    frames = replace(REGISTRATION_FRAMES, 1, endpoint)
    for decode in (decode_registration, decode_registration_route):
        message = error_of(lambda decode=decode: decode(frames))  # type: ignore[misc]
        assert message.startswith(ENDPOINT_INVALID), message
        assert detail in message
    # The encoder refuses what the decoder would.
    with pytest.raises(WireError, match=r"^CachePD registration endpoint is invalid: "):
        encode_registration(_registration(endpoint=endpoint.decode()))


@pytest.mark.parametrize(
    "endpoint",
    [
        "127.0.0.1",
        "0.0.0.0",
        "255.255.255.255",
        "localhost",
        "decode-0.decode.svc.cluster.local",
        "decode-0.decode.svc.cluster.local.",
        "compose_service_1",
        "x" * 63,
        ("a." * 126 + "a")[:253],
        "10.0.0.2:99",
        "10.0.0.2:anything-after-the-first-colon",
    ],
)
def test_registration_endpoint_accepts_host_names_and_ipv4_addresses(endpoint: str) -> None:
    frames = replace(REGISTRATION_FRAMES, 1, endpoint.encode())
    assert decode_registration(frames).endpoint == endpoint
    assert decode_registration_route(frames).endpoint == endpoint


def test_status_address_uses_the_host_before_the_first_colon() -> None:
    assert RouteHeader("10.0.0.2", 7000, "s").status_address == "tcp://10.0.0.2:7000"
    assert RouteHeader("10.0.0.2:99", 7000, "s").status_address == "tcp://10.0.0.2:7000"


def _registration(**changes: Any) -> Registration:
    fields: dict[str, Any] = {
        "endpoint": "127.0.0.1",
        "port": 5555,
        "session_id": "127.0.0.1:1",
        "arena_base": 4096,
        "contract": CONTRACT,
        "contract_bytes": CONTRACT_BYTES,
        "decode_tp_size": 1,
        "decode_tp_rank": 0,
    }
    fields.update(changes)
    return Registration(**fields)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"endpoint": ""}, "CachePD registration endpoint is invalid"),
        ({"endpoint": "hé"}, "CachePD registration endpoint is invalid"),
        ({"session_id": "x" * 513}, "CachePD registration session is invalid"),
        ({"port": 0}, "CachePD registration port is out of range"),
        ({"arena_base": 0}, "CachePD slab pointer must be nonzero"),
        ({"arena_base": 2**64}, "CachePD slab pointer 0x10000000000000000 does not fit 64 bits"),
        ({"contract_bytes": b""}, "cache transfer contract payload must be 1..262144 bytes"),
        ({"decode_tp_size": 1025}, "CachePD decode_tp_size is out of range"),
        ({"decode_tp_rank": 1}, "CachePD decode_tp_rank is out of range"),
    ],
)
def test_encode_registration_refuses_what_the_decoder_would(
    changes: dict[str, Any], message: str
) -> None:
    assert error_of(lambda: encode_registration(_registration(**changes))) == message


ascii_text = st.text(
    alphabet=st.characters(min_codepoint=0, max_codepoint=127), min_size=1, max_size=40
)
host_label = st.from_regex(r"\A[a-z0-9_]([a-z0-9_-]{0,10}[a-z0-9_])?\Z").filter(
    lambda label: not label.isdigit()
)
ipv4 = st.tuples(*[st.integers(0, 255)] * 4).map(lambda q: ".".join(map(str, q)))
endpoints = st.one_of(
    ipv4,
    st.lists(host_label, min_size=1, max_size=4).map(".".join),
    st.tuples(
        ipv4, ascii_text.filter(lambda t: t.isprintable() and ":" not in t and " " not in t)
    ).map(":".join),
)


@given(endpoint=ascii_text)
def test_any_ascii_endpoint_decodes_or_is_refused_with_the_spec_text(endpoint: str) -> None:
    frames = replace(REGISTRATION_FRAMES, 1, endpoint.encode())
    if endpoint_problem(endpoint) is None:
        route = decode_registration_route(frames)
        assert route.status_address == f"tcp://{endpoint.split(':', 1)[0]}:5555"
    else:
        with pytest.raises(WireError, match=r"^CachePD registration endpoint is invalid"):
            decode_registration_route(frames)


@given(
    endpoint=endpoints,
    session=ascii_text,
    port=st.integers(1, 65535),
    base=st.integers(1, 2**64 - 1),
    tp=st.integers(1, 1024).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n - 1))),
)
def test_registration_round_trip(
    endpoint: str, session: str, port: int, base: int, tp: tuple[int, int]
) -> None:
    reg = _registration(
        endpoint=endpoint,
        session_id=session,
        port=port,
        arena_base=base,
        decode_tp_size=tp[0],
        decode_tp_rank=tp[1],
    )
    frames = encode_registration(reg)
    assert len(frames) == 8
    assert is_registration(frames)
    assert decode_registration(frames) == reg
    assert decode_registration_route(frames) == reg.route


# ------------------------------------------------------------------- pre-allocation


def test_preallocation_decodes_room_and_session_and_keeps_the_manifest_raw() -> None:
    pre = decode_preallocation(PREALLOCATION_FRAMES)
    assert pre == Preallocation(1_000_000, "127.0.0.1:16001", MANIFEST_BYTES)
    assert not pre.is_dummy
    assert not is_registration(PREALLOCATION_FRAMES)


def test_dummy_preallocation() -> None:
    pre = decode_preallocation([b"0", b"s:1", b""])
    assert pre.is_dummy
    assert pre.manifest() is None
    assert encode_preallocation(0, "s:1", None) == [b"0", b"s:1", b""]


def test_preallocation_parses_no_manifest_until_asked() -> None:
    # A broken manifest frame does not stop the route (room, session) from decoding;
    # the Prefill rank answers an already-failed room before parsing it
    # (docs/protocol.md#proto-preallocation-checks).
    pre = decode_preallocation([b"5", b"s:1", b"{not json"])
    assert pre.room == 5
    with pytest.raises(ContractError, match="invalid Cache block manifest JSON"):
        pre.manifest()


def test_oversized_manifest_is_refused_when_parsed() -> None:
    pre = decode_preallocation([b"5", b"s:1", b" " * (2 * 1024 * 1024 + 1)])
    with pytest.raises(ContractError) as info:
        pre.manifest()
    assert str(info.value) == "Cache block manifest payload must be 1..2097152 bytes"


def test_preallocation_manifest_round_trip() -> None:
    manifest = decode_preallocation(PREALLOCATION_FRAMES).manifest()
    assert manifest is not None
    frames = encode_preallocation(1_000_000, "127.0.0.1:16001", manifest)
    assert decode_preallocation(frames).manifest() == manifest


@pytest.mark.parametrize(
    ("frames", "message"),
    [
        ([], "CachePD pre-allocation requires exactly 3 frames"),
        ([b"1", b"s"], "CachePD pre-allocation requires exactly 3 frames"),
        ([b"1", b"s", b"", b""], "CachePD pre-allocation requires exactly 3 frames"),
        ([b"", b"s", b""], "CachePD room must be canonical unsigned ASCII"),
        ([b"01", b"s", b""], "CachePD room must be canonical unsigned ASCII"),
        ([b"-1", b"s", b""], "CachePD room must be canonical unsigned ASCII"),
        ([b"1" * 20, b"s", b""], "CachePD room must be canonical unsigned ASCII"),
        ([b"9223372036854775808", b"s", b""], "CachePD room is out of range"),
        ([b"1", b"", b""], "CachePD request requires a Decode session"),
        ([b"1", b"s" * 513, b""], "CachePD request requires a Decode session"),
        ([b"1", b"s\xff", b""], "CachePD request requires a Decode session"),
        # Room before session.
        ([b"x", b"", b""], "CachePD room must be canonical unsigned ASCII"),
    ],
)
def test_preallocation_errors(frames: list[bytes], message: str) -> None:
    assert error_of(lambda: decode_preallocation(frames)) == message


def test_preallocation_room_bounds() -> None:
    assert decode_preallocation([b"9223372036854775807", b"s", b""]).room == MAX_ROOM
    assert error_of(lambda: encode_preallocation(-1, "s", None)) == "CachePD room is out of range"
    assert error_of(lambda: encode_preallocation(1, "", None)) == (
        "CachePD request requires a Decode session"
    )


@given(room=st.integers(0, MAX_ROOM), session=ascii_text)
def test_dummy_preallocation_round_trip(room: int, session: str) -> None:
    pre = decode_preallocation(encode_preallocation(room, session, None))
    assert (pre.room, pre.session_id, pre.is_dummy) == (room, session, True)


# --------------------------------------------------------------------------- status


def test_status_encodes_the_seven_frame_form() -> None:
    assert encode_status(STATUS) == [
        b"1000000",
        b"5",
        b"3",
        b"621224652",
        struct.pack("<3i", 1210209511, 701474692, 832778341),
        b"64",
        struct.pack("<d", -0.25),
    ]


def test_failure_notice_is_the_bare_failed_form() -> None:
    assert failure_notice(42, 1) == [b"42", b"0", b"1", b"-1", b"", b"0", b""]
    assert failure_notice(42, 1, cached_tokens=32)[5] == b"32"
    assert decode_status(failure_notice(42, 1)) == StatusMessage(42, TransferPoll.FAILED, 1)


@pytest.mark.parametrize("count", [3, 4, 5, 6, 7])
def test_status_trailing_frames_are_optional(count: int) -> None:
    decoded = decode_status(encode_status(STATUS)[:count])
    defaults = StatusMessage(STATUS.room, STATUS.status, STATUS.prefill_rank)
    expected = [
        getattr(STATUS if i < count else defaults, name)
        for i, name in enumerate(
            [
                "room",
                "status",
                "prefill_rank",
                "bootstrap_token",
                "spec_candidate_ids",
                "cached_tokens",
                "bootstrap_logprob",
            ]
        )
    ]
    assert [
        decoded.room,
        decoded.status,
        decoded.prefill_rank,
        decoded.bootstrap_token,
        decoded.spec_candidate_ids,
        decoded.cached_tokens,
        decoded.bootstrap_logprob,
    ] == expected


def test_s1_five_frame_status() -> None:
    frames = [b"7", b"5", b"0", b"-1", b""]
    assert decode_status(frames) == StatusMessage(7, TransferPoll.SUCCESS, 0)
    assert decode_status(frames).status is TransferPoll.SUCCESS


def test_every_poll_value_decodes_to_its_member() -> None:
    for poll in TransferPoll:
        assert decode_status([b"1", b"%d" % poll, b"0"]).status is poll


@pytest.mark.parametrize(
    ("index", "frame", "detail"),
    [
        (0, b"", "room must be canonical unsigned ASCII"),
        (0, b"+1", "room must be canonical unsigned ASCII"),
        (0, b" 1", "room must be canonical unsigned ASCII"),
        (0, b"1_0", "room must be canonical unsigned ASCII"),
        (0, b"01", "room must be canonical unsigned ASCII"),
        (0, b"-1", "room must be canonical unsigned ASCII"),
        (0, b"9223372036854775808", "room 9223372036854775808 is out of range"),
        (1, b"6", "status 6 is out of range 0..5"),
        (1, b"05", "status must be canonical unsigned ASCII"),
        (2, b"2147483648", "prefill rank 2147483648 is out of range"),
        (2, b"-1", "prefill rank must be canonical unsigned ASCII"),
        (3, b"-0", "bootstrap token must be a canonical ASCII integer"),
        (3, b"--1", "bootstrap token must be a canonical ASCII integer"),
        (3, b"-01", "bootstrap token must be a canonical ASCII integer"),
        (3, b"+1", "bootstrap token must be a canonical ASCII integer"),
        (3, b"", "bootstrap token must be a canonical ASCII integer"),
        (3, b"9223372036854775808", "bootstrap token 9223372036854775808 is out of range"),
        (3, b"-9223372036854775809", "bootstrap token -9223372036854775809 is out of range"),
        (4, b"\x00" * 5, "speculative candidate frame has 5 bytes, not a multiple of 4"),
        (4, b"\x00" * 16385, "speculative candidate frame has 16385 bytes, more than 16384"),
        (5, b"-1", "cached tokens must be canonical unsigned ASCII"),
        (5, b"", "cached tokens must be canonical unsigned ASCII"),
        (6, b"\x00" * 4, "bootstrap logprob frame has 4 bytes, not 0 or 8"),
    ],
)
def test_status_errors(index: int, frame: bytes, detail: str) -> None:
    message = error_of(lambda: decode_status(replace(encode_status(STATUS), index, frame)))
    assert message.startswith("Rejecting malformed Prefill status message: " + detail)


@pytest.mark.parametrize("count", [0, 1, 2, 9])
def test_status_frame_count(count: int) -> None:
    frames = (encode_status(STATUS) * 2)[:count]
    assert error_of(lambda: decode_status(frames)) == (
        f"Rejecting malformed Prefill status message: expected 3..8 frames, got {count}"
    )


def test_status_candidates_are_bounded_before_they_are_converted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert MAX_STATUS_FRAME_BYTES == 4 * MAX_SPEC_CANDIDATES == 16384
    most = tuple(range(MAX_SPEC_CANDIDATES))
    frames = encode_status(StatusMessage(1, TransferPoll.SUCCESS, 0, 5, most))
    assert decode_status(frames).spec_candidate_ids == most
    # One 64 MiB frame (the finding: ~640 MiB of ints) is refused on its length alone.
    unpacked: list[str] = []
    real_unpack = struct.unpack

    def spy(fmt: str, data: bytes) -> tuple[Any, ...]:
        unpacked.append(fmt)
        return real_unpack(fmt, data)

    monkeypatch.setattr("tspd.core.wire.struct.unpack", spy)
    huge = replace(frames, 4, bytes(64 * 1024 * 1024))
    assert "more than 16384 (4096 candidates)" in error_of(lambda: decode_status(huge))
    assert unpacked == []
    with pytest.raises(WireError, match="4097 speculative candidates, more than 4096"):
        encode_status(StatusMessage(1, TransferPoll.SUCCESS, 0, 5, (*most, 1)))


def test_control_frame_bound_is_the_manifest_bound() -> None:
    assert MAX_CONTROL_FRAME_BYTES == 2 * 1024 * 1024


def test_status_token_extremes() -> None:
    for token in (-(2**63), -1, 0, 2**63 - 1):
        frames = encode_status(StatusMessage(1, TransferPoll.SUCCESS, 0, token))
        assert decode_status(frames).bootstrap_token == token


@pytest.mark.parametrize(
    "message",
    [
        StatusMessage(-1, TransferPoll.FAILED, 0),
        StatusMessage(MAX_ROOM + 1, TransferPoll.FAILED, 0),
        StatusMessage(1, TransferPoll.FAILED, -1),
        StatusMessage(1, TransferPoll.FAILED, MAX_RANK + 1),
        StatusMessage(1, TransferPoll.FAILED, 0, 2**63),
        StatusMessage(1, TransferPoll.FAILED, 0, cached_tokens=-1),
        StatusMessage(1, 9, 0),  # type: ignore[arg-type]
    ],
)
def test_encode_status_refuses_values_out_of_range(message: StatusMessage) -> None:
    assert "has a value out of range" in error_of(lambda: encode_status(message))


def test_encode_status_refuses_candidates_outside_int32() -> None:
    message = StatusMessage(1, TransferPoll.SUCCESS, 0, 5, (2**31,))
    assert "outside int32" in error_of(lambda: encode_status(message))


statuses = st.builds(
    StatusMessage,
    room=st.integers(0, MAX_ROOM),
    status=st.sampled_from(TransferPoll),
    prefill_rank=st.integers(0, MAX_RANK),
    bootstrap_token=st.integers(-(2**63), 2**63 - 1),
    spec_candidate_ids=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=8).map(tuple),
    cached_tokens=st.integers(0, MAX_ROOM),
    bootstrap_logprob=st.none() | st.floats(allow_nan=False),
)


@given(message=statuses)
def test_status_round_trip(message: StatusMessage) -> None:
    frames = encode_status(message)
    assert len(frames) == 7
    assert decode_status(frames) == message


@given(logprob=st.floats(allow_nan=True))
def test_status_logprob_bits_survive(logprob: float) -> None:
    decoded = decode_status(
        encode_status(StatusMessage(1, TransferPoll.SUCCESS, 0, 1, (), 0, logprob))
    )
    assert decoded.bootstrap_logprob is not None
    assert struct.pack("<d", decoded.bootstrap_logprob) == struct.pack("<d", logprob)
    assert math.isnan(decoded.bootstrap_logprob) == math.isnan(logprob)


# --------------------------------------------------------------- EPD embedding status


@given(
    room=st.integers(0, MAX_ROOM),
    status=st.sampled_from(TransferPoll),
    rank=st.integers(0, MAX_RANK),
)
def test_embedding_status_round_trip(room: int, status: TransferPoll, rank: int) -> None:
    message = EmbeddingStatus(room, status, rank)
    frames = encode_embedding_status(message)
    assert frames == [str(room).encode(), str(int(status)).encode(), str(rank).encode()]
    assert decode_embedding_status(frames) == message


@pytest.mark.parametrize(
    ("frames", "detail"),
    [
        ([b"1", b"5"], "expected 3 frames, got 2"),
        ([b"1", b"5", b"0", b""], "expected 3 frames, got 4"),
        ([b"01", b"5", b"0"], "room must be canonical unsigned ASCII"),
        ([b"1", b"7", b"0"], "status is out of range"),
        ([b"1", b"5", b"-1"], "rank must be canonical unsigned ASCII"),
    ],
)
def test_embedding_status_errors(frames: list[bytes], detail: str) -> None:
    assert error_of(lambda: decode_embedding_status(frames)) == (
        "Rejecting malformed EPD embedding status message: " + detail
    )


def test_encode_embedding_status_refuses_values_out_of_range() -> None:
    with pytest.raises(WireError):
        encode_embedding_status(EmbeddingStatus(-1, TransferPoll.SUCCESS, 0))


# ---------------------------------------------------------------------------- helpers


@pytest.mark.parametrize(
    ("session", "port"),
    [
        ("127.0.0.1:16001", 16001),
        ("[::1]:80", 80),
        ("127.0.0.1", None),
        ("127.0.0.1:", None),
        ("127.0.0.1:0", None),
        ("127.0.0.1:65536", None),
        ("127.0.0.1:080", None),
        ("127.0.0.1:８０", None),
    ],
)
def test_session_port(session: str, port: int | None) -> None:
    assert session_port(session) == port
    assert session_port(session) == port  # the kept answer is the same


def test_session_ports_kept_are_bounded_whatever_peers_name() -> None:
    """A Prefill rank reads a port per room and destination, so answers are kept;
    session ids come from peers, so the kept ones are bounded (newest kept)."""
    for i in range(3000):
        assert session_port(f"10.0.{i // 256}.{i % 256}:{1 + i}") == 1 + i
    info = session_port.cache_info()
    assert info.maxsize == 1024
    assert info.currsize <= 1024
    assert session_port(f"10.0.{2998 // 256}.{2998 % 256}:2999") == 2999
    assert session_port.cache_info().hits == info.hits + 1  # the newest are kept


# ------------------------------------------- any frames decode or raise WireError only

DECODERS: dict[str, Callable[[list[bytes]], object]] = {
    "is_registration": is_registration,
    "registration": decode_registration,
    "registration_route": decode_registration_route,
    "preallocation": lambda frames: decode_preallocation(frames).manifest(),
    "status": decode_status,
    "embedding_status": decode_embedding_status,
}
VALID_FRAMES = [
    REGISTRATION_FRAMES,
    PREALLOCATION_FRAMES,
    [b"1", b"s:1", b""],
    encode_status(STATUS),
    failure_notice(9, 0),
    [b"1", b"5", b"0"],
]


def _flip(frame: bytes, bit: int) -> bytes:
    if not frame:
        return b"\x80"
    i = (bit // 8) % len(frame)
    return frame[:i] + bytes([frame[i] ^ (1 << (bit % 8))]) + frame[i + 1 :]


@st.composite
def mutated_frames(draw: st.DrawFn) -> list[bytes]:
    frames = list(draw(st.sampled_from(VALID_FRAMES)))
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["drop", "dup", "replace", "truncate", "flip", "insert"]))
        i = draw(st.integers(0, max(len(frames) - 1, 0)))
        if not frames:
            frames.append(draw(st.binary(max_size=16)))
        elif op == "drop":
            del frames[i]
        elif op == "dup":
            frames.insert(i, frames[i])
        elif op == "replace":
            frames[i] = draw(st.binary(max_size=24) | st.sampled_from([b"0", b"-1", b"None"]))
        elif op == "truncate":
            frames[i] = frames[i][: draw(st.integers(0, max(len(frames[i]) - 1, 0)))]
        elif op == "flip":
            frames[i] = _flip(frames[i], draw(st.integers(0, 1 << 20)))
        else:
            frames.insert(i, draw(st.binary(max_size=8)))
    return frames


def _decode_or_wire_error(frames: list[bytes]) -> None:
    for decoder in DECODERS.values():
        with contextlib.suppress(WireError):
            decoder(frames)


@given(frames=st.lists(st.binary(max_size=24), max_size=9))
def test_random_frames_decode_or_raise_wire_error(frames: list[bytes]) -> None:
    _decode_or_wire_error(frames)


@given(frames=mutated_frames())
def test_mutated_frames_decode_or_raise_wire_error(frames: list[bytes]) -> None:
    _decode_or_wire_error(frames)
