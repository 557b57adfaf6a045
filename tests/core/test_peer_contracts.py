"""A peer's contract is held to TokenSpeed's rules (S1, docs/protocol.md#proto-contract-errors)
only.

Any contract S1 accepts -- overlapping or interleaved planes, odd or negative strides
and offsets, inconsistent page counts, unknown keys at the top level and inside
``plan`` and ``transfer_schema`` -- arrives intact through both doors of the sans-IO
cores: a Decode's 8-frame registration at a Prefill rank, and a Prefill's
``cache_layout`` through the bootstrap server's parallel-info reply at a Decode rank.
Whatever such a contract says, a Prefill plans no copy outside either arena. tspd's
own checks (``check_local_contract``) bind only each rank's own contract.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tspd.core import wire
from tspd.core.bootstrap import BootstrapState, build_route_payload, parse_parallel_info
from tspd.core.commands import FetchParallelInfo, FetchRankInfo, Log, LogLevel, Rejected
from tspd.core.contract import (
    DTYPE_WIDTHS,
    CacheContract,
    CacheMemoryPlan,
    FieldSpec,
    GroupSpec,
    Partition,
    Plane,
    PlanGroup,
    TransferSchema,
    check_local_contract,
    parse_contract,
)
from tspd.core.copies import plan_steps
from tspd.core.decode import DecodeConfig, DecodeCore
from tspd.core.errors import ContractError, PlanError
from tspd.core.machines import RoomState
from tspd.core.manifest import BlockManifest, ManifestGroup
from tspd.core.planner import plan_registration
from tspd.core.prefill import PrefillConfig, PrefillCore
from tspd.testing.layouts import simple_contract

ADDR = "127.0.0.1:8998"
SESSION = "127.0.0.1:9000"
PREFILL_BASE = 0x10000
DECODE_BASE = 0x1000000

ids = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=6)
#: Any integer S1 would take where tspd's own contract needs a sensible one.
odd = st.integers(-64, 600) | st.sampled_from([0, 8, 16, 32, 64])


@dataclass(frozen=True, slots=True)
class Model:
    """What two compatible peers share (docs/protocol.md#proto-peer-compat): the token
    grain, the groups in order and their semantics, every field's dtype, shape and
    partition; and the TP size both run (equal TP, so local shapes are equal too)."""

    prefix_granularity: int
    specs: tuple[GroupSpec, ...]
    fields: tuple[tuple[str, str, tuple[int, ...], str, Partition | None], ...]
    tp: int


@st.composite
def models(draw: st.DrawFn) -> Model:
    tp = draw(st.sampled_from([1, 2]))
    specs = []
    fields: list[tuple[str, str, tuple[int, ...], str, Partition | None]] = []
    for n, gid in enumerate(draw(st.lists(ids, min_size=1, max_size=3, unique=True))):
        family = draw(st.sampled_from(["history", "state"]))
        sliding = draw(st.booleans())
        checkpoint = family == "state" and draw(st.booleans())
        pos = st.integers(1, 32)
        specs.append(
            GroupSpec(
                group_id=gid,
                retention="sliding_window" if sliding else "full_history",
                rows_per_page=None if checkpoint else draw(pos),
                entry_stride_tokens=None if checkpoint else draw(pos),
                sliding_window_tokens=draw(pos) if sliding else None,
                family=family,
                transfer_policy=draw(st.sampled_from(["full_suffix", "latest_snapshot", None])),
                checkpoint_granularity=draw(pos) if checkpoint else None,
            )
        )
        for i in range(draw(st.integers(0, 3))):
            shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
            partition = None
            if draw(st.booleans()):
                axis = draw(st.integers(0, len(shape) - 1))
                shards = draw(st.sampled_from(sorted({1, tp})))
                parts: tuple[int, ...] = ()
                if shape[axis] >= 2 and draw(st.booleans()):
                    split = draw(st.integers(1, shape[axis] - 1))
                    parts = (split * shards, (shape[axis] - split) * shards)
                partition = Partition(axis, shape[axis] * shards, parts)
            dtype = draw(st.sampled_from(sorted(DTYPE_WIDTHS)))
            fields.append((gid, f"layer.{i}.g{n}f{i}", shape, dtype, partition))
    return Model(draw(st.integers(1, 64)), tuple(specs), tuple(fields), tp)


def _schema(model: Model) -> TransferSchema:
    return TransferSchema(tuple((fid, p) for _, fid, _, _, p in model.fields if p is not None))


def _payload(shape: tuple[int, ...], dtype: str) -> int:
    return math.prod(shape) * DTYPE_WIDTHS[dtype]


@st.composite
def local_contracts(draw: st.DrawFn, model: Model) -> CacheContract:
    """This rank's tidy contract of ``model``: one plane a group, back to back, each
    page slot holding the group's fields packed."""
    num = draw(st.integers(1, 6))
    groups, planes, fields = [], [], []
    offset = 0
    for spec in model.specs:
        gid = spec.group_id
        per_parent = draw(st.integers(1, 2))
        groups.append(PlanGroup(gid, per_parent, 1 + num * per_parent))
        members = [f for f in model.fields if f[0] == gid]
        stride = max(1, sum(_payload(shape, dtype) for _, _, shape, dtype, _ in members))
        plane_id = f"plane-{gid}"
        planes.append(Plane(plane_id, stride * per_parent, offset))
        offset += (num + 1) * stride * per_parent
        field_offset = 0
        for _, fid, shape, dtype, _ in members:
            fields.append(FieldSpec(gid, fid, plane_id, shape, dtype, field_offset, stride))
            field_offset += _payload(shape, dtype)
    plan = CacheMemoryPlan(
        prefix_granularity=model.prefix_granularity,
        lcm_block_bytes=max(1, sum(p.bytes_per_lcm_block for p in planes)),
        num_lcm_blocks=num,
        groups=tuple(groups),
        planes=tuple(planes),
        fields=tuple(fields),
    )
    contract = CacheContract(plan, model.specs, _schema(model))
    check_local_contract(contract)
    return contract


@st.composite
def peer_contracts(draw: st.DrawFn, model: Model) -> tuple[CacheContract, bytes]:
    """A peer's contract of ``model`` with any geometry S1 accepts, and its payload as
    the peer sends it: keys S1 ignores added, fields in any order. Half the time the
    numbers are any integers; otherwise positive (planes still overlapping, strides
    and counts still unrelated), so that copies can often be planned."""
    wild = draw(st.booleans())

    def number(low: int, high: int) -> int:
        return draw(odd if wild else st.integers(low, high))

    plane_ids = [f"p{i}" for i in range(draw(st.integers(1, 3)))]
    planes = tuple(
        Plane(
            pid,
            number(1, 600),
            draw(st.sampled_from([0, 16, 64])) if draw(st.booleans()) else number(0, 600),
        )
        for pid in plane_ids
    )
    groups = tuple(PlanGroup(s.group_id, number(1, 4), number(2, 40)) for s in model.specs)
    fields = tuple(
        FieldSpec(
            gid,
            fid,
            draw(st.sampled_from(plane_ids)) if draw(st.integers(0, 9)) else "not-a-plane",
            shape,
            dtype,
            number(0, 64),
            number(1, 600),
        )
        for gid, fid, shape, dtype, _ in model.fields
    )
    plan = CacheMemoryPlan(
        prefix_granularity=model.prefix_granularity,
        lcm_block_bytes=number(64, 4096),
        num_lcm_blocks=draw(st.integers(-1, 6)) if wild else draw(st.integers(1, 6)),
        groups=groups,
        planes=planes,
        fields=tuple(draw(st.permutations(fields))),
        resident_block_bytes=draw(st.none() | odd) if wild else None,
    )
    contract = CacheContract(plan, model.specs, _schema(model))
    obj = contract.to_wire_object()
    extras = st.dictionaries(st.sampled_from(["future", "version", "x"]), st.integers() | st.none())
    obj.update(draw(extras))
    obj["plan"].update(draw(extras))
    obj["transfer_schema"].update(draw(extras))
    if draw(st.booleans()):
        obj["field_addresses"] = None
    return contract, json.dumps(obj).encode()


@dataclass(frozen=True, slots=True)
class Case:
    model: Model
    local: CacheContract
    peer: CacheContract
    payload: bytes


@st.composite
def cases(draw: st.DrawFn) -> Case:
    model = draw(models())
    peer, payload = draw(peer_contracts(model))
    return Case(model, draw(local_contracts(model)), peer, payload)


def _errors(commands: list[Any]) -> list[str]:
    return [
        c.message for c in commands if isinstance(c, Log | Rejected) and c.level is LogLevel.ERROR
    ]


@given(cases())
def test_the_canonical_form_drops_what_s1_ignores(case: Case) -> None:
    for compat in (False, True):
        parsed = parse_contract(case.payload, compat=compat)
        assert parsed == case.peer
        assert parsed.to_json() == case.peer.to_json()


@given(cases())
def test_a_registration_with_any_s1_contract_is_accepted(case: Case) -> None:
    frames = wire.encode_registration(
        wire.Registration(
            endpoint="127.0.0.1",
            port=8000,
            session_id=SESSION,
            arena_base=DECODE_BASE,
            contract=case.peer,
            contract_bytes=case.payload,
            decode_tp_size=case.model.tp,
            decode_tp_rank=0,
        )
    )
    decoded = wire.decode_registration(frames)
    assert decoded.contract == case.peer
    assert decoded.contract_bytes == case.payload
    core = PrefillCore(
        PrefillConfig(
            tp_size=case.model.tp, tp_rank=0, contract=case.local, arena_base=PREFILL_BASE
        )
    )
    core.receive_control(frames, 0.0)
    assert _errors(core.drain_commands()) == []
    assert core.is_registered(SESSION)
    assert core.statistics()["rejected"] == 0


@given(cases())
def test_a_bootstrap_layout_with_any_s1_contract_is_accepted(case: Case) -> None:
    tp = case.model.tp
    server = BootstrapState()
    for rank in range(tp):
        body = build_route_payload(
            rank_ip="127.0.0.1",
            rank_port=7000 + rank,
            engine_rank=rank,
            world_size=tp,
            dp_size=1,
            cache_layout=case.payload.decode(),
        )
        assert server.put_route(json.dumps(body).encode()).status == 200
    reply = server.get_route({"engine_rank": "-1", "target_dp_group": "-1"})
    assert reply.status == 200
    info = parse_parallel_info(reply.body)
    assert info.cache_layout == case.peer.to_json().decode()
    # The Decode core reads the stored layout, or the raw one another server keeps.
    for layout in (info.cache_layout, case.payload.decode()):
        core = DecodeCore(
            DecodeConfig(
                tp_size=tp,
                tp_rank=0,
                contract=case.local,
                arena_base=DECODE_BASE,
                session_id=SESSION,
                endpoint="127.0.0.1",
                port=8000,
            )
        )
        core.register_request("a", 1, ADDR, 0.0)
        assert core.drain_commands() == [FetchParallelInfo(ADDR)]
        core.parallel_info(ADDR, type(info)(tp, 1, layout), 0.0)
        assert core.room_failure(1) is None
        assert core.room_state(1) is RoomState.BOOTSTRAPPING
        commands = core.drain_commands()
        assert _errors(commands) == []
        assert FetchRankInfo(ADDR, 0, 0) in commands


@given(cases(), st.data())
def test_no_copy_leaves_either_arena_whatever_the_peer_contract_says(
    case: Case, data: st.DataObject
) -> None:
    """A Prefill writes into a Decode's arena as the Decode's contract describes it:
    every planned copy lies inside both arenas, or planning fails with a tspd error."""
    planned = plan_registration(
        prefill_tp=case.model.tp,
        prefill_rank=0,
        prefill_contract=case.local,
        decode_tp=case.model.tp,
        decode_rank=0,
        decode_contract=case.peer,
    )
    counts = [data.draw(st.integers(1, 3)) for _ in case.model.specs]

    def pages(gid: str) -> st.SearchStrategy[int]:
        """Block ids the peer's contract allows for the group (most of the time)."""
        return st.integers(1, max(1, case.peer.page_count(gid) - 1))

    src = BlockManifest(
        tuple(
            ManifestGroup(
                s.group_id,
                tuple(
                    data.draw(st.integers(1, max(1, case.local.page_count(s.group_id) - 1)))
                    for _ in range(n)
                ),
            )
            for s, n in zip(case.model.specs, counts, strict=True)
        ),
        0,
        1,
    )
    dst = BlockManifest(
        tuple(
            ManifestGroup(
                s.group_id,
                tuple(data.draw(st.integers(0, 40) | pages(s.group_id)) for _ in range(n)),
            )
            for s, n in zip(case.model.specs, counts, strict=True)
        ),
        0,
        1,
    )
    outcomes: list[object] = []
    for small_limit in (0, 48):
        try:
            (plan,) = plan_steps(
                src_contract=case.local,
                src_base=PREFILL_BASE,
                dst_contract=case.peer,
                dst_base=DECODE_BASE,
                dst_manifest=dst,
                source=src,
                registration=planned,
                steps=[None],
                small_limit=small_limit,
            )
        except (PlanError, ContractError) as err:
            outcomes.append(str(err))
            continue
        for s, d, n in plan:
            assert n > 0
            assert s >= PREFILL_BASE
            assert s + n <= PREFILL_BASE + case.local.arena_bytes
            assert d >= DECODE_BASE
            assert d + n <= DECODE_BASE + case.peer.arena_bytes
        outcomes.append(list(plan))
    assert outcomes[0] == outcomes[1]


# ------------------------------------------------------------------ fixed examples


def _overlapping_planes() -> bytes:
    """A Decode contract whose K and V planes interleave: both span the arena, V's
    starting half a parent into K's (what TokenSpeed's own recipes produce)."""
    obj = simple_contract(num_pages=3, page_bytes=32).to_wire_object()
    plan = obj["plan"]
    plan["lcm_block_bytes"] = 64
    plan["planes"] = [
        {"plane_id": "k", "bytes_per_lcm_block": 64, "arena_offset_bytes": 0},
        {"plane_id": "v", "bytes_per_lcm_block": 64, "arena_offset_bytes": 32},
    ]
    kv = plan["fields"][0]
    plan["fields"] = [
        dict(kv, field_id="layer.0.k", plane_id="k", page_stride_bytes=64),
        dict(kv, field_id="layer.0.v", plane_id="v", page_stride_bytes=64),
    ]
    obj["transfer_schema"]["note"] = "unknown keys are dropped"
    return json.dumps(obj).encode()


def test_a_decode_with_interleaved_planes_registers_and_receives_inside_its_arena() -> None:
    payload = _overlapping_planes()
    peer = parse_contract(payload)
    local = parse_contract(payload.replace(b'"arena_offset_bytes": 32', b'"arena_offset_bytes": 0'))
    # Here the fields share bytes: fine from a peer, refused as this rank's own.
    with pytest.raises(ContractError, match=r"^local cache transfer contract: cache fields"):
        check_local_contract(local)
    tidy = simple_contract(num_pages=3, page_bytes=32).to_wire_object()
    kv = tidy["plan"]["fields"][0]
    tidy["plan"]["planes"] = [
        {"plane_id": "k", "bytes_per_lcm_block": 32, "arena_offset_bytes": 0},
        {"plane_id": "v", "bytes_per_lcm_block": 32, "arena_offset_bytes": 128},
    ]
    tidy["plan"]["lcm_block_bytes"] = 64
    tidy["plan"]["fields"] = [
        dict(kv, field_id="layer.0.k", plane_id="k"),
        dict(kv, field_id="layer.0.v", plane_id="v"),
    ]
    packed = parse_contract(json.dumps(tidy).encode())
    core = PrefillCore(
        PrefillConfig(tp_size=1, tp_rank=0, contract=packed, arena_base=PREFILL_BASE)
    )
    frames = wire.encode_registration(
        wire.Registration("127.0.0.1", 8000, SESSION, DECODE_BASE, peer, payload, 1, 0)
    )
    core.receive_control(frames, 0.0)
    assert _errors(core.drain_commands()) == []
    assert core.is_registered(SESSION)
    planned = plan_registration(
        prefill_tp=1,
        prefill_rank=0,
        prefill_contract=packed,
        decode_tp=1,
        decode_rank=0,
        decode_contract=peer,
    )
    manifest = BlockManifest((ManifestGroup("full", (1, 2, 3)),), 0, 48)
    (plan,) = plan_steps(
        src_contract=packed,
        src_base=PREFILL_BASE,
        dst_contract=peer,
        dst_base=DECODE_BASE,
        dst_manifest=manifest,
        source=manifest,
        registration=planned,
        steps=[None],
    )
    # K pages land at 64, 128, 192 and V pages at 96, 160, 224 of the Decode arena.
    assert sorted(d - DECODE_BASE for _, d, _ in plan) == [64, 96, 128, 160, 192, 224]


def test_a_peer_contract_outside_the_address_range_fails_planning_not_the_process() -> None:
    local = simple_contract(num_pages=3, page_bytes=32)
    obj = local.to_wire_object()
    obj["plan"]["fields"][0]["page_stride_bytes"] = 1 << 62
    obj["plan"]["lcm_block_bytes"] = 1 << 70
    peer = parse_contract(json.dumps(obj).encode())
    planned = plan_registration(
        prefill_tp=1,
        prefill_rank=0,
        prefill_contract=local,
        decode_tp=1,
        decode_rank=0,
        decode_contract=peer,
    )
    manifest = BlockManifest((ManifestGroup("full", (1, 2)),), 0, 32)
    for small_limit in (0, 48):
        with pytest.raises(PlanError, match="destination"):
            plan_steps(
                src_contract=local,
                src_base=PREFILL_BASE,
                dst_contract=peer,
                dst_base=DECODE_BASE,
                dst_manifest=manifest,
                source=manifest,
                registration=planned,
                steps=[None],
                small_limit=small_limit,
            )


def test_an_incompatible_peer_is_a_contract_error_at_both_doors() -> None:
    local = simple_contract(num_pages=4, page_bytes=64)
    other = simple_contract(num_pages=4, page_bytes=64, page_tokens=8)  # prefix_granularity 8
    reason = "Cache P/D contract mismatch: prefix_granularity"
    with pytest.raises(ContractError, match=f"^{reason}$"):
        plan_registration(
            prefill_tp=1,
            prefill_rank=0,
            prefill_contract=local,
            decode_tp=1,
            decode_rank=0,
            decode_contract=other,
        )
    prefill = PrefillCore(
        PrefillConfig(tp_size=1, tp_rank=0, contract=local, arena_base=PREFILL_BASE)
    )
    prefill.receive_control(
        wire.encode_registration(
            wire.Registration("127.0.0.1", 8000, SESSION, DECODE_BASE, other, other.to_json(), 1, 0)
        ),
        0.0,
    )
    assert not prefill.is_registered(SESSION)
    assert prefill.statistics()["rejected"] == 1
    assert _errors(prefill.drain_commands())[-1].endswith(f"(127.0.0.1:8000): {reason}")
    decode = DecodeCore(
        DecodeConfig(
            tp_size=1,
            tp_rank=0,
            contract=local,
            arena_base=DECODE_BASE,
            session_id=SESSION,
            endpoint="127.0.0.1",
            port=8000,
        )
    )
    decode.register_request("a", 1, ADDR, 0.0)
    decode.parallel_info(
        ADDR,
        parse_parallel_info(
            json.dumps(
                {
                    "prefill_tp_size": 1,
                    "prefill_dp_size": 1,
                    "cache_layout": other.to_json().decode(),
                }
            )
        ),
        0.0,
    )
    assert decode.room_state(1) is RoomState.FAILED
    assert decode.room_failure(1) == reason


def test_a_rank_refuses_its_own_contract_when_tspd_could_not_serve_it() -> None:
    obj = simple_contract(num_pages=3, page_bytes=32).to_wire_object()
    obj["plan"]["groups"][0]["page_count"] = 9
    contract = parse_contract(json.dumps(obj).encode())  # fine from a peer
    message = (
        "local cache transfer contract: cache plan group 'full' has page_count 9; "
        "1 + num_lcm_blocks * cache_blocks_per_lcm_block = 4; fix the cache layout"
    )
    with pytest.raises(ContractError) as prefill:
        PrefillConfig(tp_size=1, tp_rank=0, contract=contract, arena_base=PREFILL_BASE)
    assert str(prefill.value) == message
    with pytest.raises(ContractError) as decode:
        DecodeConfig(
            tp_size=1,
            tp_rank=0,
            contract=contract,
            arena_base=DECODE_BASE,
            session_id=SESSION,
            endpoint="127.0.0.1",
            port=8000,
        )
    assert str(decode.value) == message


def test_the_demo_holds_its_contract_file_to_the_local_checks(tmp_path: Any) -> None:
    from tspd.demo.workload import Workload

    good = tmp_path / "interleaved.json"
    good.write_bytes(_overlapping_planes())  # planes overlap, fields do not
    assert Workload(rooms=range(1), contract_file=str(good)).contract(1) == parse_contract(
        _overlapping_planes()
    )
    bad = tmp_path / "clash.json"
    bad.write_bytes(
        _overlapping_planes().replace(b'"arena_offset_bytes": 32', b'"arena_offset_bytes": 0')
    )
    with pytest.raises(ContractError) as info:
        Workload(rooms=range(1), contract_file=str(bad)).contract(1)
    assert str(info.value) == (
        f"--contract {bad}: local cache transfer contract: cache fields 'layer.0.k' and "
        "'layer.0.v' share bytes, so a transfer into one would overwrite the other; "
        "fix the cache layout"
    )
    broken = tmp_path / "broken.json"
    broken.write_text("{}")
    with pytest.raises(ContractError, match=r"^--contract .*: invalid cache transfer contract \("):
        Workload(rooms=range(1), contract_file=str(broken)).contract(1)
