"""The cache transfer contract: canonical JSON, every parsing rule
(docs/protocol.md#proto-contract-errors), tspd's own checks of a local contract, derived
geometry, peer compatibility (docs/protocol.md#proto-peer-compat)."""

from __future__ import annotations

import contextlib
import copy
import json
import pickle
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tspd.core.contract import (
    DTYPE_WIDTHS,
    LOCAL_CONTRACT_PREFIX,
    MAX_ARENA_BYTES,
    MAX_CONTRACT_BYTES,
    S1_PEER_PREFIX,
    CacheContract,
    CacheMemoryPlan,
    FieldSpec,
    GroupSpec,
    PageIndexError,
    Partition,
    Plane,
    PlanGroup,
    TransferSchema,
    check_local_contract,
    dtype_width,
    page_index,
    parse_contract,
    validate_peer_layout,
)
from tspd.core.errors import ContractError, WireError
from tspd.testing.layouts import multi_layer_contract, simple_contract

INVALID = "invalid cache transfer contract"


def history_spec(gid: str = "history", **overrides: Any) -> GroupSpec:
    values: dict[str, Any] = {
        "group_id": gid,
        "retention": "full_history",
        "rows_per_page": 2,
        "entry_stride_tokens": 1,
        "sliding_window_tokens": None,
        "family": "history",
        "transfer_policy": "full_suffix",
        "checkpoint_granularity": None,
    }
    values.update(overrides)
    return GroupSpec(**values)


def state_spec(gid: str = "state", **overrides: Any) -> GroupSpec:
    values: dict[str, Any] = {
        "group_id": gid,
        "retention": "full_history",
        "rows_per_page": None,
        "entry_stride_tokens": None,
        "sliding_window_tokens": None,
        "family": "state",
        "transfer_policy": "latest_snapshot",
        "checkpoint_granularity": 4,
    }
    values.update(overrides)
    return GroupSpec(**values)


def two_group_contract(
    stride: int, history_offset: int, state_offset: int, *, num_lcm_blocks: int = 8
) -> CacheContract:
    """One plane shared by a history group and a state group (the last example of
    docs/protocol.md#proto-planning-examples): each page slot of ``stride`` bytes holds
    a 16-byte field of each."""
    parents = num_lcm_blocks + 1
    plan = CacheMemoryPlan(
        prefix_granularity=2,
        lcm_block_bytes=stride,
        num_lcm_blocks=num_lcm_blocks,
        groups=(PlanGroup("history", 1, parents), PlanGroup("state", 1, parents)),
        planes=(Plane("p0", stride, 0),),
        fields=(
            FieldSpec("history", "layer.0.kv", "p0", (8,), "bfloat16", history_offset, stride),
            FieldSpec("state", "layer.1.state", "p0", (16,), "uint8", state_offset, stride),
        ),
    )
    return CacheContract(plan, (history_spec(), state_spec()), TransferSchema())


def wire(contract: CacheContract) -> dict[str, Any]:
    return copy.deepcopy(contract.to_wire_object())


def dump(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def invalid_cause(obj: Any, *, compat: bool = False) -> BaseException:
    """Parse ``obj``, require the generic invalid-contract error, return its cause."""
    with pytest.raises(ContractError) as info:
        parse_contract(dump(obj), compat=compat)
    assert str(info.value) == INVALID
    assert info.value.__cause__ is not None
    return info.value.__cause__


# --------------------------------------------------------------------- canonical form

GOLDEN = (
    b'{"plan":{"prefix_granularity":16,"lcm_block_bytes":8,"num_lcm_blocks":2,'
    b'"groups":[{"group_id":"full","cache_blocks_per_lcm_block":1,"page_count":3}],'
    b'"planes":[{"plane_id":"kv","bytes_per_lcm_block":8,"arena_offset_bytes":0}],'
    b'"fields":[{"group_id":"full","field_id":"layer.0.kv","plane_id":"kv","shape":[8],'
    b'"dtype":"uint8","field_offset_bytes":0,"page_stride_bytes":8}]},'
    b'"group_specs":[{"group_id":"full","retention":"full_history","rows_per_page":16,'
    b'"entry_stride_tokens":1,"sliding_window_tokens":null,"family":"history",'
    b'"transfer_policy":"full_suffix","checkpoint_granularity":null}],'
    b'"transfer_schema":{"fields":[]}}'
)


def test_canonical_form_is_compact_s1_key_order() -> None:
    contract = simple_contract(num_pages=2, page_bytes=8)
    assert contract.to_json() == GOLDEN
    assert parse_contract(GOLDEN) == contract
    assert parse_contract(GOLDEN.decode()) == contract


def test_reordered_and_spaced_input_canonicalises() -> None:
    obj = json.loads(GOLDEN)
    obj = {k: obj[k] for k in ("transfer_schema", "group_specs", "plan")}
    obj["plan"] = dict(reversed(list(obj["plan"].items())))
    text = json.dumps(obj, indent=2).encode()
    assert parse_contract(text).to_json() == GOLDEN


def test_non_ascii_ids_are_escaped_and_round_trip() -> None:
    contract = simple_contract(num_pages=2, page_bytes=8, group_id="grüppe", field_id="layer.0.é")
    data = contract.to_json()
    assert data.isascii()
    assert b"gr\\u00fcppe" in data
    assert parse_contract(data) == contract


def test_partitions_and_resident_bytes_serialise_in_place() -> None:
    contract = multi_layer_contract(layers=1, num_pages=2, heads=2, head_dim=2, tp_size=2)
    data = contract.to_json()
    assert (
        b'"transfer_schema":{"fields":[{"field_id":"layer.0.k","partition":{"axis":1,'
        b'"global_extent":4,"global_parts":[]}}' in data
    )
    obj = wire(contract)
    obj["plan"]["resident_block_bytes"] = 8
    resident = parse_contract(dump(obj))
    assert resident.plan.resident_block_bytes == 8
    out = json.loads(resident.to_json())
    assert list(out["plan"])[-1] == "resident_block_bytes"
    assert resident.arena_bytes == 3 * 8
    assert contract.arena_bytes == 3 * contract.plan.lcm_block_bytes
    obj["plan"]["resident_block_bytes"] = None
    assert parse_contract(dump(obj)) == contract
    assert b"resident_block_bytes" not in parse_contract(dump(obj)).to_json()


def test_unknown_top_level_plan_and_transfer_schema_keys_are_ignored_and_dropped() -> None:
    contract = simple_contract(num_pages=2, page_bytes=8)
    obj = wire(contract)
    obj["field_addresses"] = None
    obj["version"] = 7
    obj["plan"]["future"] = {"anything": [1, 2]}
    obj["transfer_schema"]["replicated"] = ["layer.0.kv"]
    obj["transfer_schema"]["version"] = None
    for compat in (False, True):
        parsed = parse_contract(dump(obj), compat=compat)
        assert parsed == contract
        assert parsed.to_json() == GOLDEN


def test_transfer_schema_still_needs_its_fields() -> None:
    obj = wire(BASE)
    del obj["transfer_schema"]["fields"]
    obj["transfer_schema"]["other"] = []
    assert "'fields'" in str(invalid_cause(obj))


@pytest.mark.parametrize("value", ["8", 8.0, True, [8], {"bytes": 8}])
def test_a_resident_block_bytes_that_is_no_integer_is_ignored_like_s1(value: Any) -> None:
    # S1 does not read the key at all (docs/protocol.md#proto-contract-errors); only S3/R
    # give it a meaning.
    obj = wire(BASE)
    obj["plan"]["resident_block_bytes"] = value
    parsed = parse_contract(dump(obj))
    assert parsed == BASE
    assert parsed.to_json() == BASE.to_json()


def test_encode_bound() -> None:
    long_id = "layer.0." + "x" * MAX_CONTRACT_BYTES
    plan = CacheMemoryPlan(
        prefix_granularity=1,
        lcm_block_bytes=1,
        num_lcm_blocks=1,
        groups=(PlanGroup("g", 1, 2),),
        planes=(Plane("p", 1, 0),),
        fields=(FieldSpec("g", long_id, "p", (1,), "uint8", 0, 1),),
    )
    contract = CacheContract(plan, (history_spec("g", rows_per_page=1),), TransferSchema())
    with pytest.raises(ContractError, match=r"^cache transfer contract exceeds 262144 wire bytes$"):
        contract.to_json()


# -------------------------------------- decoding (docs/protocol.md#proto-contract-errors)


@pytest.mark.parametrize("payload", [b"", b" " * (MAX_CONTRACT_BYTES + 1)])
def test_payload_size_bounds(payload: bytes) -> None:
    with pytest.raises(
        ContractError, match=r"^cache transfer contract payload must be 1\.\.262144 bytes$"
    ):
        parse_contract(payload)


def test_payload_at_the_bound_is_accepted() -> None:
    padded = GOLDEN + b" " * (MAX_CONTRACT_BYTES - len(GOLDEN))
    assert len(padded) == MAX_CONTRACT_BYTES
    assert parse_contract(padded).to_json() == GOLDEN


@pytest.mark.parametrize(
    "payload",
    [b"{", b"\xff\xfe{}", b"not json", b'{"plan": NaN}', b"[" * 100_000, b'{"a":Infinity}'],
)
def test_not_json(payload: bytes) -> None:
    with pytest.raises(ContractError, match=r"^invalid cache transfer contract JSON$"):
        parse_contract(payload)


@pytest.mark.parametrize("payload", [b"[]", b"1", b'"plan"', b"null", b"true"])
def test_not_an_object(payload: bytes) -> None:
    with pytest.raises(
        ContractError, match=r"^cache transfer contract payload must be a JSON object$"
    ):
        parse_contract(payload)


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path into a dict entry of the wire tree (list indices included)."""
    out: list[tuple[Any, ...]] = []
    if isinstance(obj, dict):
        for key, value in obj.items():
            out.append((*prefix, key))
            out.extend(_paths(value, (*prefix, key)))
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            out.extend(_paths(value, (*prefix, i)))
    return out


def _parent(obj: Any, path: tuple[Any, ...]) -> Any:
    for step in path[:-1]:
        obj = obj[step]
    return obj


BASE = multi_layer_contract(
    layers=1, num_pages=2, heads=2, head_dim=2, tp_size=2, with_state_group=True
)
KEY_PATHS = _paths(BASE.to_wire_object())


@pytest.mark.parametrize("path", KEY_PATHS, ids=lambda p: ".".join(map(str, p)))
def test_every_missing_key_is_invalid(path: tuple[Any, ...]) -> None:
    obj = wire(BASE)
    del _parent(obj, path)[path[-1]]
    cause = invalid_cause(obj)
    assert repr(path[-1]) in str(cause) or str(path[-1]) in str(cause)


@pytest.mark.parametrize("path", KEY_PATHS, ids=lambda p: ".".join(map(str, p)))
def test_every_wrong_type_is_invalid(path: tuple[Any, ...]) -> None:
    obj = wire(BASE)
    parent = _parent(obj, path)
    value = parent[path[-1]]
    parent[path[-1]] = {"wrong": True} if not isinstance(value, dict) else [value]
    invalid_cause(obj)


@pytest.mark.parametrize(
    "entry",
    [
        ("plan", "groups", 0),
        ("plan", "planes", 0),
        ("plan", "fields", 0),
        ("group_specs", 0),
        ("group_specs", 1),
        ("transfer_schema", "fields", 0),
        ("transfer_schema", "fields", 0, "partition"),
    ],
    ids=lambda p: ".".join(map(str, p)),
)
def test_unknown_key_inside_an_entry_is_invalid(entry: tuple[Any, ...]) -> None:
    obj = wire(BASE)
    target = obj
    for step in entry:
        target = target[step]
    target["surprise"] = 1
    assert "surprise" in str(invalid_cause(obj))


@pytest.mark.parametrize("value", [True, 1.0, 2.5, "3", None])
def test_integers_are_strict(value: Any) -> None:
    obj = wire(BASE)
    obj["plan"]["num_lcm_blocks"] = value
    invalid_cause(obj)


@pytest.mark.parametrize(
    ("key", "value"),
    [("retention", "forever"), ("family", "other"), ("transfer_policy", "everything")],
)
def test_spec_enumerations(key: str, value: str) -> None:
    obj = wire(BASE)
    obj["group_specs"][0][key] = value
    invalid_cause(obj)


def test_unsupported_dtype() -> None:
    obj = wire(BASE)
    obj["plan"]["fields"][0]["dtype"] = "float128"
    assert str(invalid_cause(obj)) == "unsupported cache dtype 'float128'"
    with pytest.raises(ContractError, match=r"^unsupported cache dtype 'complex'$"):
        dtype_width("complex")


def test_str_payload_with_a_lone_surrogate_is_not_json() -> None:
    with pytest.raises(ContractError, match=r"^invalid cache transfer contract JSON$"):
        parse_contract('{"plan": "\ud800"}')


def test_errors_are_wire_errors_and_value_errors() -> None:
    with pytest.raises(WireError):
        parse_contract(b"")
    with pytest.raises(ValueError, match="payload"):
        parse_contract(b"")


# --------------------------------------------------------------------- constructor rules


def _schema_cause(fields: list[dict[str, Any]]) -> str:
    obj = wire(BASE)
    obj["transfer_schema"]["fields"] = fields
    return str(invalid_cause(obj))


def _part(fid: str, axis: int, extent: int, parts: list[int] | None = None) -> dict[str, Any]:
    return {
        "field_id": fid,
        "partition": {"axis": axis, "global_extent": extent, "global_parts": parts or []},
    }


def test_transfer_schema_duplicate_and_unknown_fields() -> None:
    k = "layer.0.k"
    assert _schema_cause([_part(k, 1, 4), _part(k, 1, 4)]) == (
        "cache transfer schema contains a duplicate field"
    )
    assert _schema_cause([_part("layer.9.x", 0, 1), _part("layer.8.y", 0, 1)]) == (
        "cache transfer schema references unknown fields ['layer.8.y', 'layer.9.x']"
    )


@pytest.mark.parametrize(
    ("axis", "extent", "parts", "message"),
    [
        (3, 4, None, "cache field 'layer.0.k' has invalid partition geometry"),
        (-1, 4, None, "cache field 'layer.0.k' has invalid partition geometry"),
        (1, 1, None, "cache field 'layer.0.k' has invalid partition geometry"),
        (
            1,
            5,
            None,
            "cache field 'layer.0.k' global partition extent is not divisible by its local extent",
        ),
        (1, 4, [4], "cache field 'layer.0.k' has invalid global partition parts"),
        (1, 4, [2, 1, 1], "cache field 'layer.0.k' has invalid global partition parts"),
        (1, 4, [2, 4], "cache field 'layer.0.k' has invalid global partition parts"),
        (1, 4, [4, 0], "cache field 'layer.0.k' has invalid global partition parts"),
    ],
)
def test_partition_geometry(axis: int, extent: int, parts: list[int] | None, message: str) -> None:
    # layer.0.k has local shape (4, 2, 2): local extent 2 on axis 1.
    assert _schema_cause([_part("layer.0.k", axis, extent, parts)]) == message


def test_global_parts_bounds() -> None:
    # Local extent 32 on axis 0; global extent 64 gives 2 shards, so each part must be
    # even; 2..16 parts summing to 64.
    base = simple_contract(num_pages=1, page_bytes=32)

    def with_parts(parts: tuple[int, ...]) -> CacheContract:
        schema = TransferSchema((("layer.0.kv", Partition(0, 64, parts)),))
        return CacheContract(base.plan, base.group_specs, schema)

    for ok in ((32, 32), (4,) * 16, (2, 62), (8, 8, 48)):
        contract = with_parts(ok)
        assert parse_contract(contract.to_json()).partition_of("layer.0.kv") == Partition(0, 64, ok)
    for bad in ((64,), (4,) * 15 + (2, 2), (3, 61), (0, 64), (-2, 66), (32, 30)):
        with pytest.raises(ContractError) as info:
            with_parts(bad)
        assert str(info.value) == "cache field 'layer.0.kv' has invalid global partition parts"
        obj = wire(base)
        obj["transfer_schema"]["fields"] = [_part("layer.0.kv", 0, 64, list(bad))]
        assert str(invalid_cause(obj)) == str(info.value)


@pytest.mark.parametrize(
    "overrides",
    [
        {"rows_per_page": None},
        {"entry_stride_tokens": None},
        {"checkpoint_granularity": 4},
        {"rows_per_page": 0},
        {"entry_stride_tokens": -1},
        {"retention": "sliding_window", "sliding_window_tokens": 0},
    ],
)
def test_history_spec_shape_rules(overrides: dict[str, Any]) -> None:
    with pytest.raises(ContractError):
        history_spec(**overrides)
    obj = wire(BASE)
    obj["group_specs"][0].update(overrides)
    invalid_cause(obj)


@pytest.mark.parametrize(
    "overrides",
    [
        {"checkpoint_granularity": 0},
        {"checkpoint_granularity": None},
        {"rows_per_page": 2, "entry_stride_tokens": 1},
        {"family": "history"},
        {"replayable": True},
        {"shard_count": 0},
    ],
)
def test_state_spec_shape_rules(overrides: dict[str, Any]) -> None:
    with pytest.raises(ContractError):
        state_spec(**overrides)


def test_valid_spec_variants() -> None:
    assert history_spec(rows_per_page=4, entry_stride_tokens=2).block_granularity == 8
    assert state_spec(checkpoint_granularity=64).block_granularity == 64
    # A state group may use row geometry instead of checkpoints.
    assert state_spec(rows_per_page=2, entry_stride_tokens=3, checkpoint_granularity=None)
    sliding = history_spec(retention="sliding_window", sliding_window_tokens=5, replayable=True)
    assert sliding.is_sliding
    assert sliding.replayable is True
    assert history_spec(transfer_policy=None).transfer_policy is None


def _unpartitioned(obj: dict[str, Any], fid: str) -> bool:
    fields = obj["transfer_schema"]["fields"]
    obj["transfer_schema"]["fields"] = [f for f in fields if f["field_id"] != fid]
    return True


def _k(obj: dict[str, Any]) -> dict[str, Any]:
    field: dict[str, Any] = obj["plan"]["fields"][0]
    assert field["field_id"] == "layer.0.k"
    return field


# Every check tspd makes beyond S1 (docs/protocol.md#proto-contract-local): a peer's
# contract that breaks one is parsed as S1 parses it, and only this rank's own contract
# is refused (check_local_contract).
LOCAL_ONLY_RULES: list[tuple[Any, str]] = [
    (lambda o: o["plan"].update(prefix_granularity=0), "prefix_granularity must be positive"),
    (lambda o: o["plan"].update(lcm_block_bytes=0), "lcm_block_bytes must be positive"),
    (lambda o: o["plan"].update(num_lcm_blocks=-1), "num_lcm_blocks must not be negative"),
    (lambda o: o["plan"].update(resident_block_bytes=0), "resident_block_bytes"),
    (lambda o: o["plan"].update(resident_block_bytes=73), "resident_block_bytes"),
    (lambda o: o["plan"].update(lcm_block_bytes=MAX_ARENA_BYTES), "tspd can address"),
    (lambda o: o["plan"].update(groups=[]), "at least one page group"),
    (lambda o: o["plan"]["groups"][0].update(group_id=""), "IDs must be non-empty"),
    (lambda o: o["plan"]["planes"][0].update(plane_id=""), "IDs must be non-empty"),
    (lambda o: o["group_specs"][0].update(group_id=""), "IDs must be non-empty"),
    (lambda o: o["plan"]["fields"].append(o["plan"]["fields"][0]), "duplicated"),
    (lambda o: o["plan"]["groups"].append(o["plan"]["groups"][0]), "duplicated"),
    (lambda o: o["plan"]["planes"].append(o["plan"]["planes"][0]), "duplicated"),
    (lambda o: o["group_specs"].append(o["group_specs"][0]), "duplicated"),
    (lambda o: o["group_specs"].pop(), "disagree"),
    (lambda o: o["group_specs"][0].update(retention="sliding_window"), "needs sliding_window"),
    (lambda o: o["group_specs"][0].update(sliding_window_tokens=8), "cannot have sliding"),
    (lambda o: o["plan"]["groups"][0].update(cache_blocks_per_lcm_block=0), "positive"),
    (lambda o: o["plan"]["groups"][0].update(page_count=4), "page_count 4"),
    (lambda o: o["plan"]["groups"][1].update(page_count=2), "page_count 2"),
    (lambda o: o["plan"]["planes"][0].update(bytes_per_lcm_block=0), "positive"),
    (lambda o: o["plan"]["planes"][0].update(bytes_per_lcm_block=-32), "positive"),
    (lambda o: o["plan"]["planes"][0].update(arena_offset_bytes=-8), "negative arena offset"),
    (lambda o: _k(o).update(plane_id="nowhere"), "unknown plane"),
    (lambda o: _k(o).update(group_id="nowhere"), "unknown group"),
    (lambda o: (_k(o).update(field_id=""), _unpartitioned(o, "layer.0.k")), "non-empty"),
    (lambda o: (_k(o).update(shape=[]), _unpartitioned(o, "layer.0.k")), "shape"),
    (lambda o: _k(o).update(shape=[0, 2, 2]), "shape"),
    (lambda o: _k(o).update(field_offset_bytes=-1), "negative field offset"),
    (lambda o: _k(o).update(page_stride_bytes=0), "positive page stride"),
    (lambda o: _k(o).update(page_stride_bytes=-32), "positive page stride"),
    (lambda o: _k(o).update(page_stride_bytes=16), "its pages overlap one another"),
    (lambda o: _k(o).update(page_stride_bytes=64), "do not fit inside the layout"),
    (lambda o: o["plan"].update(lcm_block_bytes=8), "do not fit inside the layout"),
    (lambda o: o["plan"]["planes"][2].update(arena_offset_bytes=200), "do not fit"),
    # Plane v moved 8 bytes into plane k: their fields' pages now share bytes.
    (lambda o: o["plan"]["planes"][1].update(arena_offset_bytes=8), "share bytes"),
    (lambda o: o["plan"]["fields"][2].update(plane_id="layer.0.k"), "share bytes"),
]


@pytest.mark.parametrize(("mutate", "fragment"), LOCAL_ONLY_RULES)
def test_checks_beyond_s1_bind_only_the_local_contract(mutate: Any, fragment: str) -> None:
    obj = wire(BASE)
    mutate(obj)
    for compat in (False, True):
        parsed = parse_contract(dump(obj), compat=compat)
        assert parse_contract(parsed.to_json(), compat=compat) == parsed
    with pytest.raises(ContractError) as info:
        check_local_contract(parsed)
    message = str(info.value)
    assert message.startswith(LOCAL_CONTRACT_PREFIX)
    assert message.endswith("; fix the cache layout")
    assert fragment in message


def test_rules_that_stay_s1_refusals_on_every_contract() -> None:
    obj = wire(BASE)
    _k(obj).update(shape=[4, 0, 2])  # the partition axis: no local extent to divide by
    assert str(invalid_cause(obj)) == "cache field 'layer.0.k' has invalid partition geometry"
    obj = wire(BASE)
    _k(obj).update(shape=[])
    assert "partition geometry" in str(invalid_cause(obj))


def test_the_local_contracts_tspd_builds_pass_its_checks() -> None:
    check_local_contract(BASE)
    check_local_contract(two_group_contract(32, 0, 16))
    check_local_contract(multi_layer_contract(layers=3, num_pages=5, heads=1, head_dim=8))
    check_local_contract(simple_contract(num_pages=0, page_bytes=1))


def _interleaved(*, k_offset: int = 0, v_offset: int = 32, v_field: int = 0) -> dict[str, Any]:
    """TokenSpeed's interleaved planes: K and V planes both span every parent (64
    bytes a parent), V's plane starting ``v_offset`` bytes into K's; each page slot
    holds K's page then V's."""
    obj = wire(simple_contract(num_pages=3, page_bytes=32))
    plan = obj["plan"]
    plan["lcm_block_bytes"] = 64
    plan["planes"] = [
        {"plane_id": "k", "bytes_per_lcm_block": 64, "arena_offset_bytes": k_offset},
        {"plane_id": "v", "bytes_per_lcm_block": 64, "arena_offset_bytes": v_offset},
    ]
    kv = plan["fields"][0]
    plan["fields"] = [
        dict(kv, field_id="layer.0.k", plane_id="k", page_stride_bytes=64),
        dict(
            kv, field_id="layer.0.v", plane_id="v", page_stride_bytes=64, field_offset_bytes=v_field
        ),
    ]
    return obj


def test_interleaved_and_overlapping_planes_are_accepted_locally_and_from_peers() -> None:
    # Planes overlap (v starts inside k; then both at offset 0) and v's plane ends
    # past the layout, yet no two pages share a byte: S1 and tspd both accept.
    packed_obj = _interleaved(v_offset=128)
    for plane in packed_obj["plan"]["planes"]:
        plane["bytes_per_lcm_block"] = 32
    for field in packed_obj["plan"]["fields"]:
        field["page_stride_bytes"] = 32
    packed = parse_contract(dump(packed_obj))
    check_local_contract(packed)
    for obj in (_interleaved(), _interleaved(v_offset=0, v_field=32)):
        contract = parse_contract(dump(obj))
        check_local_contract(contract)
        assert [contract.page_offset("layer.0.k", p) for p in (1, 2, 3)] == [64, 128, 192]
        assert [contract.page_offset("layer.0.v", p) for p in (1, 2, 3)] == [96, 160, 224]
        assert contract.arena_bytes == 256
        validate_peer_layout(packed, contract)
        validate_peer_layout(contract, packed)
    # Fields of one plane at the same offset: a peer may say so, this rank may not.
    clash = parse_contract(dump(_interleaved(v_offset=0)))
    with pytest.raises(ContractError, match=r"'layer\.0\.k' and 'layer\.0\.v' share bytes"):
        check_local_contract(clash)


def test_only_pages_that_transfers_write_must_be_disjoint() -> None:
    # V's plane starts at K's page 3, so V's null page (page 0) is K's page 3:
    # transfers never write page 0, so nothing is shared.
    obj = _interleaved(v_offset=192)
    obj["plan"].update(lcm_block_bytes=128)
    for plane in obj["plan"]["planes"]:
        plane["bytes_per_lcm_block"] = 64
    contract = parse_contract(dump(obj))
    assert contract.page_offset("layer.0.v", 0) == contract.page_offset("layer.0.k", 3)
    check_local_contract(contract)


@st.composite
def page_runs(draw: st.DrawFn) -> tuple[int, int, int, int]:
    """(field offset, page stride, pages after the null page, payload bytes)."""
    stride = draw(st.integers(1, 12))
    return (draw(st.integers(0, 40)), stride, draw(st.integers(1, 6)), draw(st.integers(1, stride)))


@given(page_runs(), page_runs())
def test_shared_bytes_are_found_exactly(a: tuple[int, ...], b: tuple[int, ...]) -> None:
    """Two fields of one plane, any strides and offsets: refused exactly when a page
    (1 and up) of one shares a byte with a page of the other, counted byte by byte."""

    def pages(start: int, stride: int, count: int, length: int) -> set[int]:
        return {start + i * stride + n for i in range(count) for n in range(length)}

    plan = CacheMemoryPlan(
        prefix_granularity=1,
        lcm_block_bytes=200,
        num_lcm_blocks=1,
        groups=(PlanGroup("a", a[2], a[2] + 1), PlanGroup("b", b[2], b[2] + 1)),
        planes=(Plane("p", 200, 0),),
        fields=tuple(
            FieldSpec(gid, f"layer.0.{gid}", "p", (length,), "uint8", start, stride)
            for gid, (start, stride, _, length) in (("a", a), ("b", b))
        ),
    )
    contract = CacheContract(plan, (history_spec("a"), history_spec("b")))
    # Page 1 of a field starts bytes_per_lcm_block + field offset into its plane.
    shared = pages(200 + a[0], *a[1:]) & pages(200 + b[0], *b[1:])
    if shared:
        with pytest.raises(
            ContractError,
            match=r"^local cache transfer contract: cache fields 'layer\.0\.[ab]' and "
            r"'layer\.0\.[ab]' share bytes",
        ):
            check_local_contract(contract)
    else:
        check_local_contract(contract)


@pytest.mark.parametrize("page", [True, False, 1.0, "1", None, np.True_])
def test_a_page_id_must_be_an_integer_not_a_bool(page: Any) -> None:
    contract = two_group_contract(32, 0, 16)
    with pytest.raises(PageIndexError) as info:
        contract.page_offset("layer.0.kv", page)
    assert str(info.value) == f"page_id {page} outside [0, 9) for group 'history'"
    assert page_index(page) is None
    numpy_page: Any = np.int64(1)
    assert contract.page_offset("layer.0.kv", numpy_page) == contract.page_offset("layer.0.kv", 1)
    assert page_index(np.int32(3)) == 3


# --------------------------------------------------------------------- S3 / R extras


def test_compat_keys_need_compat_mode() -> None:
    obj = wire(BASE)
    obj["group_specs"][0]["shard_count"] = 2
    assert "shard_count" in str(invalid_cause(obj))
    contract = parse_contract(dump(obj), compat=True)
    assert contract.group("kv").shard_count == 2
    assert contract.virtual_block_count("kv") == 1 + 2 * 2
    assert contract.virtual_block_count("state") == 3
    out = json.loads(contract.to_json())
    assert list(out["group_specs"][0])[-1] == "shard_count"
    assert "shard_count" not in out["group_specs"][1]
    assert parse_contract(contract.to_json(), compat=True) == contract

    obj = wire(BASE)
    obj["group_specs"][0]["replayable"] = False
    assert "replayable" in str(invalid_cause(obj))
    contract = parse_contract(dump(obj), compat=True)
    keys = list(json.loads(contract.to_json())["group_specs"][0])
    assert keys.index("replayable") == keys.index("sliding_window_tokens") + 1
    assert keys.index("family") == keys.index("replayable") + 1


@pytest.mark.parametrize(
    ("key", "value"), [("replayable", 1), ("shard_count", 0), ("shard_count", True)]
)
def test_compat_key_values(key: str, value: Any) -> None:
    obj = wire(BASE)
    obj["group_specs"][0][key] = value
    invalid_cause(obj, compat=True)


def test_replayable_needs_a_sliding_group() -> None:
    obj = wire(BASE)
    obj["group_specs"][0]["replayable"] = True
    assert "sliding" in str(invalid_cause(obj, compat=True))
    obj["group_specs"][0].update(retention="sliding_window", sliding_window_tokens=8)
    assert parse_contract(dump(obj), compat=True).group("kv").replayable is True


def test_r_pd_fixture_schema_is_refused() -> None:
    # R-pd's `grouped_layout()` keys (attn_kind) are not the S1 schema
    # (docs/protocol.md#proto-contract-schema, docs/protocol.md#proto-open-questions).
    obj = wire(two_group_contract(32, 0, 16))
    obj["group_specs"] = [
        {
            "group_id": "history",
            "attn_kind": "full_history",
            "rows_per_page": 2,
            "entry_stride_tokens": 1,
            "replayable": False,
            "transfer_policy": "full_suffix",
            "shard_count": 1,
        },
        {
            "group_id": "state",
            "attn_kind": "state",
            "replayable": False,
            "transfer_policy": "latest_snapshot",
            "shard_count": 1,
        },
    ]
    obj["field_addresses"] = None
    assert "attn_kind" in str(invalid_cause(obj))
    assert "attn_kind" in str(invalid_cause(obj, compat=True))


# --------------------------------------------------------------------- derived geometry


def test_dtype_widths_and_payload() -> None:
    assert {n: w for n, w in DTYPE_WIDTHS.items() if w == 1} == {
        "uint8": 1,
        "int8": 1,
        "float8_e4m3fn": 1,
        "float8_e5m2": 1,
        "float8_e8m0fnu": 1,
    }
    assert [DTYPE_WIDTHS[n] for n in ("bfloat16", "float16", "int32", "float32")] == [2, 2, 4, 4]
    assert [DTYPE_WIDTHS[n] for n in ("int64", "float64")] == [8, 8]
    f = FieldSpec("g", "layer.3.k", "p", (2, 4, 2), "bfloat16", 0, 32)
    assert f.dtype_width == 2
    assert f.payload_bytes == 32
    assert f.layer == 3


@pytest.mark.parametrize(
    ("fid", "message"),
    [
        ("kv", "cache field 'kv' is not owned by a model layer"),
        ("layer.0", "cache field 'layer.0' is not owned by a model layer"),
        ("layers.0.k", "cache field 'layers.0.k' is not owned by a model layer"),
        ("layer.0.", "cache field 'layer.0.' is not owned by a model layer"),
        ("layer.x.k", "cache field 'layer.x.k' has an invalid layer id"),
        ("layer.-1.k", "cache field 'layer.-1.k' has an invalid layer id"),
        ("layer..k", "cache field 'layer..k' has an invalid layer id"),
        ("layer. 1.k", "cache field 'layer. 1.k' has an invalid layer id"),
    ],
)
def test_layer_ids(fid: str, message: str) -> None:
    f = FieldSpec("g", fid, "p", (1,), "uint8", 0, 1)
    with pytest.raises(ContractError) as info:
        _ = f.layer
    assert str(info.value) == message


def test_layer_suffix_may_hold_dots() -> None:
    assert FieldSpec("g", "layer.12.attn.k", "p", (1,), "uint8", 0, 1).layer == 12


def test_page_offsets_golden_whole_copy_vector() -> None:
    """docs/protocol.md#proto-planning-examples, last bullet: whole copy with different
    page-zero offsets."""
    source = two_group_contract(32, 0, 16)
    dest = two_group_contract(64, 8, 40)
    src = [0x10000 + source.page_offset("layer.0.kv", p) for p in (1, 2)]
    src.append(0x10000 + source.page_offset(source.field("layer.1.state"), 4))
    dst = [0x20000 + dest.page_offset("layer.0.kv", p) for p in (5, 6)]
    dst.append(0x20000 + dest.page_offset("layer.1.state", 3))
    assert src == [0x10020, 0x10040, 0x10090]
    assert dst == [0x20148, 0x20188, 0x200E8]
    assert {source.field(f).payload_bytes for f in ("layer.0.kv", "layer.1.state")} == {16}
    validate_peer_layout(source, dest)
    # A peer's field spec resolves by id to this contract's geometry.
    assert dest.page_offset(source.field("layer.0.kv"), 5) == 0x148
    with pytest.raises(ContractError, match=r"has no field 'layer\.9\.x'"):
        dest.page_offset("layer.9.x", 1)


def test_page_offset_formula_with_plane_offsets() -> None:
    contract = multi_layer_contract(layers=2, num_pages=3, heads=1, head_dim=2, page_tokens=2)
    # Four planes of 4 parents x 8 bytes, back to back.
    for n, fid in enumerate(("layer.0.k", "layer.0.v", "layer.1.k", "layer.1.v")):
        assert contract.page_offset(fid, 0) == n * 32
        assert contract.page_offset(fid, 1) == n * 32 + 8
        assert contract.page_offset(fid, 3) == n * 32 + 24
    assert contract.arena_bytes == 128


@pytest.mark.parametrize("page", [-1, 9, 100])
def test_page_offset_range(page: int) -> None:
    contract = two_group_contract(32, 0, 16)
    with pytest.raises(PageIndexError) as info:
        contract.page_offset("layer.0.kv", page)
    assert str(info.value) == f"page_id {page} outside [0, 9) for group 'history'"
    assert isinstance(info.value, IndexError)
    assert isinstance(info.value, ContractError)


def test_lookups() -> None:
    contract = multi_layer_contract(
        layers=2, num_pages=2, heads=2, head_dim=2, tp_size=2, with_state_group=True
    )
    assert contract.group_ids == ("kv", "state")
    assert [f.field_id for f in contract.fields_for_group("kv")] == [
        "layer.0.k",
        "layer.0.v",
        "layer.1.k",
        "layer.1.v",
    ]
    assert contract.plan_group("state").page_count == 3
    assert contract.page_count("kv") == 3
    assert contract.partition_of("layer.1.v") == Partition(1, 4)
    assert contract.global_shape("layer.1.v") == (4, 4, 2)
    assert contract.global_shape(contract.field("layer.0.state")) == (4, 2)
    assert contract.plane("state").bytes_per_lcm_block == 2 * 2 * 2 * 2
    for lookup in (contract.group, contract.plan_group, contract.field, contract.plane):
        with pytest.raises(ContractError, match="has no"):
            lookup("missing")
    replicated = simple_contract(num_pages=1, page_bytes=4)
    assert replicated.partition_of("layer.0.kv") is None
    assert replicated.global_shape("layer.0.kv") == (4,)


def test_fields_for_group_sorts_by_id_not_plan_order() -> None:
    plan = CacheMemoryPlan(
        prefix_granularity=2,
        lcm_block_bytes=8,
        num_lcm_blocks=1,
        groups=(PlanGroup("g", 1, 2),),
        planes=(Plane("p", 8, 0),),
        fields=(
            FieldSpec("g", "layer.1.b", "p", (4,), "uint8", 0, 8),
            FieldSpec("g", "layer.0.a", "p", (4,), "uint8", 4, 8),
        ),
    )
    contract = CacheContract(plan, (history_spec("g"),))
    assert [f.field_id for f in contract.fields_for_group("g")] == ["layer.0.a", "layer.1.b"]


def test_contracts_are_hashable_values() -> None:
    a = multi_layer_contract(layers=1, num_pages=2, heads=1, head_dim=1)
    b = multi_layer_contract(layers=1, num_pages=2, heads=1, head_dim=1)
    assert a == b
    assert hash(a) == hash(b)
    assert a != multi_layer_contract(layers=1, num_pages=3, heads=1, head_dim=1)
    # Contracts cross thread and process boundaries with their lookups intact.
    copied = pickle.loads(pickle.dumps(a))
    assert copied == a
    assert copied.fields_for_group("kv") == a.fields_for_group("kv")
    assert copied.page_offset("layer.0.v", 2) == a.page_offset("layer.0.v", 2)


# ----------------------------------------------- peers (docs/protocol.md#proto-peer-compat)


def _peer(**kw: Any) -> CacheContract:
    args: dict[str, Any] = {"layers": 2, "num_pages": 4, "heads": 2, "head_dim": 2, "tp_size": 2}
    args.update(kw)
    return multi_layer_contract(**args)


def test_compatible_peers_may_differ_in_capacity_and_tp() -> None:
    local = _peer(with_state_group=True)
    validate_peer_layout(local, _peer(num_pages=9, with_state_group=True))
    validate_peer_layout(local, _peer(heads=4, tp_size=1, with_state_group=True))
    validate_peer_layout(local, _peer(heads=1, tp_size=4, with_state_group=True))


def _mismatch(local: CacheContract, peer: CacheContract) -> str:
    with pytest.raises(ContractError) as info:
        validate_peer_layout(local, peer)
    return str(info.value)


def _replace_spec(contract: CacheContract, gid: str, **kw: Any) -> CacheContract:
    import dataclasses

    specs = tuple(
        dataclasses.replace(s, **kw) if s.group_id == gid else s for s in contract.group_specs
    )
    return CacheContract(contract.plan, specs, contract.transfer_schema)


def test_peer_mismatch_suffixes() -> None:
    local = _peer(with_state_group=True)
    prefix = "Cache P/D contract mismatch: "
    assert _mismatch(local, _peer(with_state_group=True, prefix_granularity=8)) == (
        prefix + "prefix_granularity"
    )
    reordered = CacheContract(local.plan, local.group_specs[::-1], local.transfer_schema)
    assert _mismatch(local, reordered) == prefix + "group order"
    assert _mismatch(local, _peer()) == prefix + "group order"
    for change in (
        {"rows_per_page": 1, "entry_stride_tokens": 4},
        {"transfer_policy": None},
        {"retention": "sliding_window", "sliding_window_tokens": 64},
    ):
        assert _mismatch(local, _replace_spec(local, "kv", **change)) == (
            prefix + "group 'kv' semantics"
        )
    assert _mismatch(local, _replace_spec(local, "state", checkpoint_granularity=8)) == (
        prefix + "group 'state' semantics"
    )
    assert _mismatch(local, _peer(layers=3, with_state_group=True)) == (
        prefix + "group 'kv' transfer field order"
    )
    assert _mismatch(local, _peer(dtype="float16", with_state_group=True)) == (
        prefix + "field 'layer.0.k' semantics"
    )
    assert _mismatch(local, _peer(head_dim=4, with_state_group=True)) == (
        prefix + "field 'layer.0.k' semantics"
    )
    assert _mismatch(local, _peer(global_heads=2, with_state_group=True)) == (
        prefix + "field 'layer.0.k' semantics"
    )
    assert _mismatch(local, _peer(state_dim=3, with_state_group=True)) == (
        prefix + "field 'layer.0.state' semantics"
    )


def test_peer_partition_presence_and_s1_prefix() -> None:
    local = _peer(heads=4, tp_size=1)
    unpartitioned = CacheContract(local.plan, local.group_specs, TransferSchema())
    with pytest.raises(
        ContractError,
        match=r"^Paged cache P/D contract mismatch: field 'layer\.0\.k' semantics$",
    ):
        validate_peer_layout(local, unpartitioned, prefix=S1_PEER_PREFIX)


def test_shard_count_is_not_compared_but_replayable_is() -> None:
    local = _peer()
    validate_peer_layout(local, _replace_spec(local, "kv", shard_count=4))
    sliding = _replace_spec(local, "kv", retention="sliding_window", sliding_window_tokens=8)
    validate_peer_layout(sliding, _replace_spec(sliding, "kv", replayable=False))
    assert _mismatch(sliding, _replace_spec(sliding, "kv", replayable=True)) == (
        "Cache P/D contract mismatch: group 'kv' semantics"
    )


# --------------------------------------------------------------------- properties

DTYPES = sorted(DTYPE_WIDTHS)
ids = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=6)


@st.composite
def contracts(draw: st.DrawFn, *, compat: bool = False) -> CacheContract:
    """Arbitrary valid contracts: 1..3 groups, each in its own plane with packed fields."""
    num_lcm_blocks = draw(st.integers(0, 5))
    parents = num_lcm_blocks + 1
    group_ids = draw(st.lists(ids, min_size=1, max_size=3, unique=True))
    groups, planes, fields, specs, schema = [], [], [], [], []
    offset = 0
    layer = 0
    for n, gid in enumerate(group_ids):
        per_parent = draw(st.integers(1, 3))
        groups.append(PlanGroup(gid, per_parent, 1 + num_lcm_blocks * per_parent))
        field_offset = 0
        group_fields = []
        for suffix in range(draw(st.integers(0, 3))):
            shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
            dtype = draw(st.sampled_from(DTYPES))
            fid = f"layer.{layer}.g{n}f{suffix}{draw(ids)}"
            layer += draw(st.integers(0, 1))
            group_fields.append((fid, shape, dtype, field_offset))
            field_offset += draw(st.integers(0, 3)) + DTYPE_WIDTHS[dtype] * _prod(shape)
            if draw(st.booleans()):
                axis = draw(st.integers(0, len(shape) - 1))
                shards = draw(st.integers(1, 4))
                extent = shape[axis] * shards
                parts: tuple[int, ...] = ()
                if shape[axis] >= 2 and draw(st.booleans()):
                    split = draw(st.integers(1, shape[axis] - 1))
                    parts = (split * shards, (shape[axis] - split) * shards)
                schema.append((fid, Partition(axis, extent, parts)))
        stride = max(1, field_offset)
        plane_id = f"plane{n}"
        planes.append(Plane(plane_id, stride * per_parent, offset))
        offset += parents * stride * per_parent
        fields.extend(
            FieldSpec(gid, fid, plane_id, shape, dtype, fo, stride)
            for fid, shape, dtype, fo in group_fields
        )
        specs.append(draw(specs_for(gid, compat=compat)))
    lcm = sum(p.bytes_per_lcm_block for p in planes) + draw(st.integers(0, 4))
    resident = draw(st.none() | st.integers(1, lcm))
    plan = CacheMemoryPlan(
        prefix_granularity=draw(st.integers(1, 64)),
        lcm_block_bytes=lcm,
        num_lcm_blocks=num_lcm_blocks,
        groups=tuple(groups),
        planes=tuple(planes),
        fields=tuple(draw(st.permutations(fields))),
        resident_block_bytes=resident,
    )
    order = draw(st.permutations(specs))
    return CacheContract(plan, tuple(order), TransferSchema(tuple(schema)))


def _prod(shape: tuple[int, ...]) -> int:
    out = 1
    for extent in shape:
        out *= extent
    return out


@st.composite
def specs_for(draw: st.DrawFn, gid: str, *, compat: bool) -> GroupSpec:
    family = draw(st.sampled_from(["history", "state"]))
    sliding = draw(st.booleans())
    checkpoint = family == "state" and draw(st.booleans())
    pos = st.integers(1, 32)
    return GroupSpec(
        group_id=gid,
        retention="sliding_window" if sliding else "full_history",
        rows_per_page=None if checkpoint else draw(pos),
        entry_stride_tokens=None if checkpoint else draw(pos),
        sliding_window_tokens=draw(pos) if sliding else None,
        family=family,
        transfer_policy=draw(st.sampled_from(["full_suffix", "latest_snapshot", None])),
        checkpoint_granularity=draw(pos) if checkpoint else None,
        replayable=(
            draw(st.none() | st.booleans()) if sliding else draw(st.none() | st.just(False))
        )
        if compat
        else None,
        shard_count=draw(st.integers(1, 4)) if compat else 1,
    )


@given(contracts())
def test_round_trip_is_exact_and_byte_stable(contract: CacheContract) -> None:
    data = contract.to_json()
    assert data.isascii()
    parsed = parse_contract(data)
    assert parsed == contract
    assert parsed.to_json() == data
    assert parse_contract(data, compat=True) == contract


@given(contracts(compat=True))
def test_compat_round_trip(contract: CacheContract) -> None:
    data = contract.to_json()
    parsed = parse_contract(data, compat=True)
    assert parsed == contract
    assert parsed.to_json() == data


@given(contracts())
def test_every_page_of_every_field_stays_in_its_plane(contract: CacheContract) -> None:
    check_local_contract(contract)  # packed planes, back to back: a tidy local contract
    layout_bytes = (contract.plan.num_lcm_blocks + 1) * contract.plan.lcm_block_bytes
    for f in contract.plan.fields:
        plane = contract.plane(f.plane_id)
        end = (
            plane.arena_offset_bytes
            + (contract.plan.num_lcm_blocks + 1) * plane.bytes_per_lcm_block
        )
        for page in range(contract.page_count(f.group_id)):
            start = contract.page_offset(f, page)
            assert plane.arena_offset_bytes <= start
            assert start + f.payload_bytes <= end <= layout_bytes


@given(st.binary(max_size=512))
def test_any_bytes_parse_or_raise_contract_error(data: bytes) -> None:
    with contextlib.suppress(ContractError):
        parse_contract(data)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=4),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)


@given(st.data())
def test_mutated_contracts_parse_or_raise_contract_error(data: st.DataObject) -> None:
    obj = wire(BASE)
    path = data.draw(st.sampled_from(KEY_PATHS))
    parent = _parent(obj, path)
    if data.draw(st.booleans()):
        parent[path[-1]] = data.draw(json_values)
    else:
        del parent[path[-1]]
    try:
        parsed = parse_contract(dump(obj), compat=data.draw(st.booleans()))
    except ContractError:
        return
    assert parse_contract(parsed.to_json(), compat=True) == parsed
