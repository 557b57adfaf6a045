"""Copy generation (docs/protocol.md#proto-copies), coalescing, bounds and batching.

Golden vectors come from docs/protocol.md#proto-planning-examples; the properties
compare the numpy planner against a small loop-per-page reference written here from the
rules of docs/protocol.md#proto-copies.
"""

from __future__ import annotations

import math
import pickle
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tspd.core.contract import (
    CacheContract,
    CacheMemoryPlan,
    FieldSpec,
    GroupSpec,
    Partition,
    Plane,
    PlanGroup,
    TransferSchema,
)
from tspd.core.copies import (
    DEFAULT_MAX_DESCRIPTORS,
    SMALL_PLAN_COPIES,
    CopyPlan,
    batches,
    check_bounds,
    coalesce,
    plan_copies,
    plan_steps,
)
from tspd.core.errors import ContractError, PlanError
from tspd.core.manifest import BlockManifest, ManifestGroup, Selection, SelectionGroup
from tspd.core.planner import (
    Fragment,
    OwnerFilter,
    PlannedRegistration,
    RoutePlanner,
    plan_registration,
)
from tspd.testing.layouts import multi_layer_contract, room_manifest

WIDTH = {"uint8": 1, "bfloat16": 2, "float32": 4}

# A field: (field id, local shape, dtype).
FieldDef = tuple[str, tuple[int, ...], str]


def spec(gid: str, shard_count: int = 1) -> GroupSpec:
    return GroupSpec(
        gid, "full_history", 1, 1, None, "history", "full_suffix", None, shard_count=shard_count
    )


def layout(
    groups: Mapping[str, Sequence[FieldDef]],
    partitions: Mapping[str, Partition] | None = None,
    *,
    blocks: int = 8,
    pads: Mapping[str, int] | None = None,
    gaps: Sequence[int] = (),
    per_parent: int = 1,
    split_planes: bool = False,
    shard_counts: Mapping[str, int] | None = None,
) -> CacheContract:
    """A contract with one plane per group (or per field with ``split_planes``),
    fields packed in order with ``pads[field]`` spare bytes after each, planes back
    to back with ``gaps[i]`` spare bytes before plane ``i``, ``per_parent`` pages per
    LCM block."""
    pads = pads or {}
    slots: list[tuple[str, list[FieldDef]]] = []
    for gid, fields in groups.items():
        if split_planes:
            slots.extend((gid, [f]) for f in fields)
        else:
            slots.append((gid, list(fields)))
    planes, specs = [], []
    offset = 0
    for i, (gid, fields) in enumerate(slots):
        offset += gaps[i] if i < len(gaps) else 0
        stride = sum(math.prod(s) * WIDTH[t] + pads.get(fid, 0) for fid, s, t in fields)
        field_offset = 0
        for fid, shape, dtype in fields:
            specs.append(FieldSpec(gid, fid, f"p{i}", shape, dtype, field_offset, stride))
            field_offset += math.prod(shape) * WIDTH[dtype] + pads.get(fid, 0)
        planes.append(Plane(f"p{i}", stride * per_parent, offset))
        offset += stride * per_parent * (blocks + 1)
    plan = CacheMemoryPlan(
        prefix_granularity=1,
        lcm_block_bytes=-(-offset // (blocks + 1)),
        num_lcm_blocks=blocks,
        groups=tuple(PlanGroup(gid, per_parent, 1 + blocks * per_parent) for gid in groups),
        planes=tuple(planes),
        fields=tuple(specs),
    )
    counts = shard_counts or {}
    return CacheContract(
        plan=plan,
        group_specs=tuple(spec(gid, counts.get(gid, 1)) for gid in groups),
        transfer_schema=TransferSchema(tuple((partitions or {}).items())),
    )


def manifest(**groups: Sequence[int]) -> BlockManifest:
    return BlockManifest(
        groups=tuple(ManifestGroup(gid, tuple(ids)) for gid, ids in groups.items()),
        prefix_len=0,
        prompt_len=1,
    )


WHOLE = PlannedRegistration((), {}, False, frozenset({0}))

#: ``small_limit`` values that force the numpy path and the plain-Python path.
NUMPY_PATH, PYTHON_PATH = 0, 1 << 30
PATHS = (NUMPY_PATH, PYTHON_PATH)


def copies(**kwargs: object) -> list[tuple[int, int, int]]:
    return list(plan_copies(**kwargs))  # type: ignore[arg-type]


# -- reference implementation (loops, straight from docs/protocol.md#proto-copies) --


def reference(
    src: CacheContract,
    src_base: int,
    dst: CacheContract,
    dst_base: int,
    dst_manifest: BlockManifest,
    source: BlockManifest | Selection,
    planned: PlannedRegistration,
    fields: frozenset[str] | None = None,
) -> list[tuple[int, int, int]]:
    out = []
    for gid in src.group_ids:
        if isinstance(source, Selection):
            chosen = source.group(gid)
            src_ids = list(chosen.source_block_ids)
            dst_ids = [dst_manifest.block_ids(gid)[i] for i in chosen.destination_positions]
        else:
            src_ids = list(source.block_ids(gid))
            dst_ids = list(dst_manifest.block_ids(gid))
        if planned.fragments and gid in planned.owner_filters:
            owner = planned.owner_filters[gid]
            if owner is None:
                continue
            count, rank = owner.owner_count, owner.owner_rank
            keep = [i for i, v in enumerate(src_ids) if v >= 1 and (v - 1) % count == rank]
            src_ids = [(src_ids[i] - 1) // count + 1 for i in keep]
            dst_ids = [dst_ids[i] for i in keep]
        if planned.fragments:
            for f in planned.fragments:
                if f.group_id != gid or (fields is not None and f.field_id not in fields):
                    continue
                for sp, dp in zip(src_ids, dst_ids, strict=True):
                    s0 = src_base + src.page_offset(f.field_id, sp) + f.src_byte_offset
                    d0 = dst_base + dst.page_offset(f.field_id, dp) + f.dst_byte_offset
                    for row in range(f.rows_per_page):
                        s = s0 + row * f.src_row_stride_bytes
                        d = d0 + row * f.dst_row_stride_bytes
                        out.append((s, d, f.bytes_per_row))
        else:
            for field in src.fields_for_group(gid):
                if fields is not None and field.field_id not in fields:
                    continue
                for sp, dp in zip(src_ids, dst_ids, strict=True):
                    out.append(
                        (
                            src_base + src.page_offset(field, sp),
                            dst_base + dst.page_offset(field.field_id, dp),
                            field.payload_bytes,
                        )
                    )
    return out


def apply(
    plan: Sequence[tuple[int, int, int]] | CopyPlan,
    src_bytes: bytes,
    src_base: int,
    dst_len: int,
    dst_base: int,
) -> bytes:
    """Run copies one by one into a zeroed destination arena."""
    out = bytearray(dst_len)
    for s, d, n in plan:
        out[d - dst_base : d - dst_base + n] = src_bytes[s - src_base : s - src_base + n]
    return bytes(out)


# -- golden vectors (docs/protocol.md#proto-planning-examples) --------------------


def test_fragment_copy_addresses() -> None:
    src = layout({"full": [("layer.0.k", (16,), "uint8")]}, pads={"layer.0.k": 16})
    dst = layout({"full": [("layer.0.k", (32,), "uint8")]}, pads={"layer.0.k": 32})
    assert (src.page_offset("layer.0.k", 0), src.field("layer.0.k").page_stride_bytes) == (0, 32)
    assert (dst.page_offset("layer.0.k", 0), dst.field("layer.0.k").page_stride_bytes) == (0, 64)
    fragment = Fragment("full", "layer.0.k", 0, 8, 8, 16, 8, 2)
    plan = plan_copies(
        src_contract=src,
        src_base=0x1000,
        dst_contract=dst,
        dst_base=0x2000,
        dst_manifest=manifest(full=[2]),
        source=manifest(full=[1]),
        registration=PlannedRegistration((fragment,), {}, False, frozenset({0})),
    )
    (batch,) = batches(plan)
    assert batch.tolist() == ([0x1020, 0x1028], [0x2088, 0x2098], [8, 8])


def whole_copy_pair() -> tuple[CacheContract, CacheContract]:
    """The whole-copy fixture of docs/protocol.md#proto-planning-examples: history and
    state fields of 16 bytes; the source has stride 32 and page-zero offsets 0/16, the
    destination stride 64 and 8/40."""
    src = CacheContract(
        plan=CacheMemoryPlan(
            prefix_granularity=1,
            lcm_block_bytes=32,
            num_lcm_blocks=6,
            groups=(PlanGroup("history", 1, 7), PlanGroup("state", 1, 7)),
            planes=(Plane("slot", 32, 0),),
            fields=(
                FieldSpec("history", "layer.0.h", "slot", (16,), "uint8", 0, 32),
                FieldSpec("state", "layer.0.s", "slot", (8,), "bfloat16", 16, 32),
            ),
        ),
        group_specs=(spec("history"), spec("state")),
    )
    dst = CacheContract(
        plan=CacheMemoryPlan(
            prefix_granularity=1,
            lcm_block_bytes=64,
            num_lcm_blocks=6,
            groups=(PlanGroup("history", 1, 7), PlanGroup("state", 1, 7)),
            planes=(Plane("slot", 64, 0),),
            fields=(
                FieldSpec("history", "layer.0.h", "slot", (16,), "uint8", 8, 64),
                FieldSpec("state", "layer.0.s", "slot", (8,), "bfloat16", 40, 64),
            ),
        ),
        group_specs=(spec("history"), spec("state")),
    )
    return src, dst


def test_whole_copy_with_different_page_zero_offsets() -> None:
    src, dst = whole_copy_pair()
    plan = plan_copies(
        src_contract=src,
        src_base=0x10000,
        dst_contract=dst,
        dst_base=0x20000,
        dst_manifest=manifest(history=[5, 6], state=[3]),
        source=manifest(history=[1, 2], state=[4]),
        registration=WHOLE,
    )
    assert plan.tolist() == (
        [0x10020, 0x10040, 0x10090],
        [0x20148, 0x20188, 0x200E8],
        [16, 16, 16],
    )
    assert len(plan) == 3
    assert plan.total_bytes == 48


# -- emission rules ----------------------------------------------------------------


def two_groups() -> CacheContract:
    return layout(
        {
            "full": [("layer.0.k", (4, 2), "bfloat16"), ("layer.0.v", (4, 2), "bfloat16")],
            "swa": [("layer.1.w", (6,), "uint8")],
        },
        pads={"layer.0.v": 4},
    )


def test_whole_copy_order_is_group_then_field_then_page() -> None:
    c = two_groups()
    kw = {
        "src_contract": c,
        "src_base": 0,
        "dst_contract": c,
        "dst_base": 0x100000,
        "dst_manifest": manifest(full=[3, 4], swa=[5]),
        "source": manifest(full=[1, 2], swa=[7]),
        "registration": WHOLE,
    }
    got = copies(**kw)
    fid_of = {}
    for f in c.plan.fields:
        for page in range(c.page_count(f.group_id)):
            fid_of[c.page_offset(f, page)] = (f.field_id, page)
    assert [fid_of[s] for s, _, _ in got] == [
        ("layer.0.k", 1),
        ("layer.0.k", 2),
        ("layer.0.v", 1),
        ("layer.0.v", 2),
        ("layer.1.w", 7),
    ]
    assert got == reference(c, 0, c, 0x100000, kw["dst_manifest"], kw["source"], WHOLE)  # type: ignore[arg-type]


def test_field_filter_limits_the_copies() -> None:
    c = two_groups()
    plans = plan_steps(
        src_contract=c,
        src_base=0,
        dst_contract=c,
        dst_base=0,
        dst_manifest=manifest(full=[3, 4], swa=[5]),
        source=manifest(full=[1, 2], swa=[7]),
        registration=WHOLE,
        steps=[None, frozenset({"layer.0.v"}), frozenset({"layer.1.w"}), frozenset()],
    )
    assert [len(p) for p in plans] == [5, 2, 1, 0]
    everything = list(plans[0])
    assert list(plans[1]) == everything[2:4]
    assert list(plans[2]) == everything[4:]


def test_a_group_without_fragments_emits_nothing() -> None:
    c = two_groups()
    fragment = Fragment("full", "layer.0.k", 0, 0, 16, 16, 16, 1)
    planned = PlannedRegistration((fragment,), {}, False, frozenset({0}))
    got = copies(
        src_contract=c,
        src_base=0,
        dst_contract=c,
        dst_base=0,
        dst_manifest=manifest(full=[3, 4], swa=[5]),
        source=manifest(full=[1, 2], swa=[7]),
        registration=planned,
    )
    assert [n for _, _, n in got] == [16, 16]
    assert [s for s, _, _ in got] == [c.page_offset("layer.0.k", p) for p in (1, 2)]


def test_layerwise_selection_maps_positions() -> None:
    c = two_groups()
    dst_manifest = manifest(full=[3, 4, 6], swa=[5])
    selection = Selection(
        groups=(SelectionGroup("full", (8, 2), (2, 0)), SelectionGroup("swa", (), ())),
        is_final=False,
    )
    got = copies(
        src_contract=c,
        src_base=0,
        dst_contract=c,
        dst_base=0,
        dst_manifest=dst_manifest,
        source=selection,
        registration=WHOLE,
    )
    assert got == reference(c, 0, c, 0, dst_manifest, selection, WHOLE)
    assert [d for _, d, _ in got[:2]] == [c.page_offset("layer.0.k", p) for p in (6, 3)]


def test_owner_filter_keeps_owned_blocks_and_translates_pages() -> None:
    c = layout({"swa": [("layer.0.w", (4,), "uint8")]}, shard_counts={"swa": 2}, blocks=4)
    d = layout({"swa": [("layer.0.w", (4,), "uint8")]}, blocks=8)
    fragment = Fragment("swa", "layer.0.w", 0, 0, 4, 4, 4, 1)
    source = manifest(swa=[1, 2, 5, 4, 3, 7])
    dst_manifest = manifest(swa=[3, 4, 5, 6, 7, 8])
    owned = {0: [(1, 3), (3, 5), (2, 7), (4, 8)], 1: [(1, 4), (2, 6)]}
    for owner, pages in owned.items():
        planned = PlannedRegistration(
            (fragment,), {"swa": OwnerFilter(owner, 2)}, False, frozenset({0})
        )
        got = copies(
            src_contract=c,
            src_base=0,
            dst_contract=d,
            dst_base=0,
            dst_manifest=dst_manifest,
            source=source,
            registration=planned,
        )
        want = [
            (c.page_offset("layer.0.w", sp), d.page_offset("layer.0.w", dp), 4) for sp, dp in pages
        ]
        assert got == want
        assert got == reference(c, 0, d, 0, dst_manifest, source, planned)
    skipped = PlannedRegistration((fragment,), {"swa": None}, False, frozenset({0}))
    got = copies(
        src_contract=c,
        src_base=0,
        dst_contract=d,
        dst_base=0,
        dst_manifest=dst_manifest,
        source=source,
        registration=skipped,
    )
    assert got == []
    # Virtual ids run to 1 + (pages - 1) * owners = 9 on a 5-page, 2-owner group.
    with pytest.raises(PlanError) as caught:
        copies(
            src_contract=c,
            src_base=0,
            dst_contract=d,
            dst_base=0,
            dst_manifest=manifest(swa=[3, 4]),
            source=manifest(swa=[8, 9]),
            registration=PlannedRegistration(
                (fragment,), {"swa": OwnerFilter(0, 2)}, False, frozenset({0})
            ),
        )
    assert str(caught.value) == "source virtual block 9 of cache group 'swa' is outside [0, 9)"


# -- planning errors ---------------------------------------------------------------


def plan_error(**overrides: object) -> str:
    c = two_groups()
    kw: dict[str, object] = {
        "src_contract": c,
        "src_base": 0,
        "dst_contract": c,
        "dst_base": 0,
        "dst_manifest": manifest(full=[3, 4], swa=[5]),
        "source": manifest(full=[1, 2], swa=[7]),
        "registration": WHOLE,
    }
    kw.update(overrides)
    messages = []
    for small_limit in PATHS:
        with pytest.raises(PlanError) as caught:
            plan_steps(**kw, steps=(None,), small_limit=small_limit)  # type: ignore[arg-type]
        messages.append(str(caught.value))
    assert len(set(messages)) == 1, messages  # the Python and numpy paths agree
    return messages[0]


def test_planning_errors() -> None:
    assert plan_error(source=manifest(full=[1], swa=[7])) == (
        "cache group 'full' pairs 1 source blocks with 2 destination blocks"
    )
    assert plan_error(source=manifest(swa=[7], full=[1, 2])) == (
        "source manifest group order disagrees with the source layout"
    )
    assert plan_error(dst_manifest=manifest(full=[3, 4])) == (
        "destination manifest group order disagrees with the source layout"
    )
    assert plan_error(source=manifest(full=[1, 9], swa=[7])) == (
        "source block 9 of cache group 'full' is outside [0, 9)"
    )
    assert plan_error(dst_manifest=manifest(full=[3, -1], swa=[5])) == (
        "destination block -1 of cache group 'full' is outside [0, 9)"
    )
    selection = Selection(
        (SelectionGroup("full", (1,), (2,)), SelectionGroup("swa", (), ())), is_final=False
    )
    assert plan_error(source=selection) == (
        "layerwise selection position 2 of cache group 'full' is outside [0, 2)"
    )
    assert plan_error(source=manifest(full=[1, 1 << 70], swa=[7])) == (
        "source blocks of cache group 'full' are not all 64-bit integers"
    )
    assert plan_error(src_base=-1).startswith("source arena [")
    assert plan_error(dst_base=1 << 62).startswith("destination arena [")


@pytest.mark.parametrize("bad", [True, False, np.True_])
def test_a_bool_is_not_a_block_id(bad: object) -> None:
    # numpy would read it as 0 or 1; it is refused like an id out of range.
    for where in ("source", "destination"):
        blocks: Any = [1, bad]
        kw: dict[str, Any] = (
            {"source": manifest(full=blocks, swa=[7])}
            if where == "source"
            else {"dst_manifest": manifest(full=blocks, swa=[5])}
        )
        assert plan_error(**kw) == (
            f"{where} blocks of cache group 'full' are not all 64-bit integers"
        )


def test_a_fragment_leaving_the_destination_arena_is_refused() -> None:
    c = two_groups()
    bad = Fragment("swa", "layer.1.w", 0, c.arena_bytes, 6, 6, 6, 1)
    message = plan_error(registration=PlannedRegistration((bad,), {}, False, frozenset({0})))
    assert message.startswith("copy 0 (src ")
    assert "leaves the destination arena [0x0, " in message
    assert message.endswith("; nothing was written")


# -- CopyPlan, coalesce, bounds, batches -------------------------------------------


def test_copy_plan_basics() -> None:
    plan = CopyPlan.from_copies([(0, 100, 4), (4, 104, 4)])
    assert len(plan) == 2
    assert list(plan) == [(0, 100, 4), (4, 104, 4)]
    assert plan.total_bytes == 8
    assert not plan.src.flags.writeable
    assert CopyPlan.empty() == CopyPlan.from_copies([])
    assert len(CopyPlan.empty()) == 0
    with pytest.raises(PlanError, match="differ in length"):
        CopyPlan(plan.src, plan.dst, plan.length[:1])
    with pytest.raises(PlanError, match="int64"):
        CopyPlan(plan.src.astype(np.int32), plan.dst, plan.length)


def test_a_plan_of_lists_is_the_same_value_and_makes_its_arrays_once_when_read() -> None:
    """The plain-Python path's plan keeps its lists (an engine call takes them as
    they are, no numpy in between) and builds read-only arrays only when they are
    read; either way it is the same immutable value as the array-built plan."""
    cols = ([0, 64], [100, 164], [4, 8])
    plan = CopyPlan._of_lists(*(list(c) for c in cols))
    same = CopyPlan.from_copies([(0, 100, 4), (64, 164, 8)])
    src, dst, length = plan.columns()
    assert type(src) is list
    assert (src, dst, length) == cols
    assert len(plan) == 2
    assert plan.total_bytes == 12
    assert list(plan) == list(same)
    copied = plan.tolist()
    copied[0][0] = 999  # tolist() hands out new lists
    assert plan.tolist() == cols
    assert plan == same
    assert same == plan
    assert plan.src is plan.src  # made once
    assert plan.src.tolist() == [0, 64]
    assert plan.length.dtype == np.int64
    assert not plan.src.flags.writeable
    assert not plan.dst.flags.writeable
    assert type(plan.columns()[0]) is list  # the lists stay what an engine call gets
    assert type(same.columns()[0]) is np.ndarray
    with pytest.raises(AttributeError, match="immutable"):
        plan.src = same.src  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(plan)) == same
    assert plan != CopyPlan.from_copies([(0, 100, 4)])


@pytest.mark.parametrize("n", [0, 1, 64, 65, 1000])
def test_total_bytes_short_and_long_plans(n: int) -> None:
    lengths = [(i % 7 + 1) * (1 << 40) for i in range(n)]  # sums beyond int32
    plan = CopyPlan.from_copies([(i, i, length) for i, length in enumerate(lengths)])
    assert plan.total_bytes == sum(lengths)
    assert type(plan.total_bytes) is int


def test_coalesce_merges_only_neighbours_adjacent_on_both_sides() -> None:
    plan = CopyPlan.from_copies(
        [
            (0, 100, 4),
            (4, 104, 4),  # joins
            (8, 200, 4),  # src adjacent, dst not
            (100, 204, 4),  # dst adjacent, src not
            (104, 208, 4),  # joins
            (0, 0, 1),
        ]
    )
    assert list(coalesce(plan)) == [(0, 100, 8), (8, 200, 4), (100, 204, 8), (0, 0, 1)]
    single = CopyPlan.from_copies([(0, 0, 1)])
    assert coalesce(single) is single
    # Adjacent but out of order is not merged: order is never changed.
    swapped = CopyPlan.from_copies([(4, 104, 4), (0, 100, 4)])
    assert coalesce(swapped) == swapped


def test_check_bounds_names_the_first_bad_copy() -> None:
    ok = CopyPlan.from_copies([(0x10, 0x20, 0x10), (0x1F0, 0x3F0, 0x10)])
    check_bounds(ok, src_base=0x10, src_len=0x1F0, dst_base=0x20, dst_len=0x3E0)
    cases = [
        ([(0x10, 0x20, 0)], "copy 0 (src 0x10, dst 0x20, 0 bytes) has a non-positive length"),
        (
            [(0x10, 0x20, 1), (0x8, 0x20, 1)],
            "copy 1 (src 0x8, dst 0x20, 1 bytes) leaves the source arena [0x10, 0x200)",
        ),
        (
            [(0x1F1, 0x20, 0x10)],
            "copy 0 (src 0x1f1, dst 0x20, 16 bytes) leaves the source arena [0x10, 0x200)",
        ),
        (
            [(0x10, 0x3F1, 0x10)],
            "copy 0 (src 0x10, dst 0x3f1, 16 bytes) leaves the destination arena [0x20, 0x400)",
        ),
        (
            [(0x10, 0x1F, 1)],
            "copy 0 (src 0x10, dst 0x1f, 1 bytes) leaves the destination arena [0x20, 0x400)",
        ),
    ]
    for rows, why in cases:
        with pytest.raises(PlanError) as caught:
            check_bounds(
                CopyPlan.from_copies(rows),
                src_base=0x10,
                src_len=0x1F0,
                dst_base=0x20,
                dst_len=0x3E0,
            )
        assert str(caught.value) == why + "; nothing was written"
    with pytest.raises(PlanError, match="source arena"):
        check_bounds(ok, src_base=-1, src_len=1, dst_base=0, dst_len=1)


def test_batches_cut_in_order() -> None:
    plan = CopyPlan.from_copies([(i, i, 1) for i in range(10)])
    cut = list(batches(plan, 4))
    assert [len(b) for b in cut] == [4, 4, 2]
    assert CopyPlan.concat(cut) == plan
    assert list(batches(CopyPlan.empty())) == []
    assert [len(b) for b in batches(plan)] == [10]
    with pytest.raises(PlanError):
        list(batches(plan, 0))


def test_default_batch_stays_under_mooncake_tcp_queue() -> None:
    # Two calls in flight to one peer must still fit the 2,048-transfer queue.
    assert 2 * DEFAULT_MAX_DESCRIPTORS <= 2048


# -- properties ----------------------------------------------------------------------

TP_PAIRS = [(1, 1), (2, 2), (1, 2), (2, 1), (4, 1), (1, 4), (2, 3), (3, 2), (2, 4), (4, 2)]
K, LATENT, CONV = "layer.0.k", "layer.0.latent", "layer.1.conv"


def divisors(n: int) -> list[int]:
    return [s for s in range(1, n + 1) if n % s == 0]


@dataclass(frozen=True)
class Scenario:
    """A Prefill/Decode pair with one request's manifests (or a selection) on both
    sides, arena bases and a seed for the source bytes."""

    p_tp: int
    d_tp: int
    prefill: CacheContract
    decode: CacheContract
    dst_manifest: BlockManifest
    source: BlockManifest | Selection
    src_base: int
    dst_base: int
    seed: int

    def registration(self, p: int, d: int) -> PlannedRegistration:
        return plan_registration(
            prefill_tp=self.p_tp,
            prefill_rank=p,
            prefill_contract=self.prefill,
            decode_tp=self.d_tp,
            decode_rank=d,
            decode_contract=self.decode,
        )

    def plan(
        self,
        planned: PlannedRegistration,
        *,
        small_limit: int = SMALL_PLAN_COPIES,
        steps: Sequence[frozenset[str] | None] = (None,),
        coalesced: bool = False,
    ) -> CopyPlan:
        return CopyPlan.concat(
            plan_steps(
                src_contract=self.prefill,
                src_base=self.src_base,
                dst_contract=self.decode,
                dst_base=self.dst_base,
                dst_manifest=self.dst_manifest,
                source=self.source,
                registration=planned,
                steps=steps,
                coalesced=coalesced,
                small_limit=small_limit,
            )
        )

    def reference(self, planned: PlannedRegistration) -> list[tuple[int, int, int]]:
        return reference(
            self.prefill,
            self.src_base,
            self.decode,
            self.dst_base,
            self.dst_manifest,
            self.source,
            planned,
        )

    def source_bytes(self, p: int) -> bytes:
        rng = np.random.default_rng([self.seed, p])
        return rng.integers(0, 256, self.prefill.arena_bytes, dtype=np.uint8).tobytes()


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    p_tp, d_tp = draw(st.sampled_from(TP_PAIRS))
    shards_p = draw(st.sampled_from(divisors(p_tp)))
    shards_d = shards_p if p_tp == d_tp else draw(st.sampled_from(divisors(d_tp)))
    unit = math.lcm(shards_p, shards_d)
    parts = tuple(unit * draw(st.integers(1, 2)) for _ in range(draw(st.integers(1, 3))))
    heads = sum(parts)
    axis = draw(st.integers(0, 2))
    shape = [draw(st.integers(1, 3)) for _ in range(3)]
    latent = draw(st.integers(1, 5))
    partition = Partition(axis, heads, parts if len(parts) > 1 else ())

    # The state group may be dealt over DCP owners on Prefill (never on Decode).
    dcp = draw(st.sampled_from(divisors(p_tp)))

    def side(shards: int, dcp: int = 1) -> CacheContract:
        local = list(shape)
        local[axis] = heads // shards
        return layout(
            {
                "full": [(K, tuple(local), "bfloat16"), (LATENT, (latent,), "uint8")],
                "state": [(CONV, (3, 2), "float32")],
            },
            {K: partition},
            blocks=draw(st.integers(2, 6)),
            pads={fid: draw(st.integers(0, 5)) for fid in (K, LATENT, CONV)},
            gaps=draw(st.lists(st.integers(0, 9), max_size=3)),
            per_parent=draw(st.integers(1, 2)),
            split_planes=draw(st.booleans()),
            shard_counts={"state": dcp},
        )

    prefill, decode = side(shards_p, dcp), side(shards_d)
    dst_groups: dict[str, list[int]] = {}
    src_groups: dict[str, list[int]] = {}
    for gid in ("full", "state"):
        dst_pages, src_pages = decode.page_count(gid), prefill.virtual_block_count(gid)
        n = draw(st.integers(0, min(4, dst_pages - 1)))
        dst_groups[gid] = draw(
            st.lists(st.integers(1, dst_pages - 1), min_size=n, max_size=n, unique=True)
        )
        src_groups[gid] = draw(st.lists(st.integers(1, src_pages - 1), min_size=n, max_size=n))
    source: BlockManifest | Selection = manifest(**src_groups)
    if draw(st.booleans()):
        chosen = []
        for gid in ("full", "state"):
            n = len(dst_groups[gid])
            positions = draw(st.permutations(range(n)))[: draw(st.integers(0, n))]
            ids = tuple(src_groups[gid][: len(positions)])
            chosen.append(SelectionGroup(gid, ids, tuple(positions)))
        source = Selection(tuple(chosen), is_final=False)
    return Scenario(
        p_tp,
        d_tp,
        prefill,
        decode,
        manifest(**dst_groups),
        source,
        draw(st.integers(0, 1 << 40)),
        draw(st.integers(0, 1 << 40)),
        draw(st.integers(0, 2**32 - 1)),
    )


def inside(plan: CopyPlan, base: int, size: int, column: str) -> bool:
    addresses = getattr(plan, column)
    return bool(((addresses >= base) & (addresses + plan.length <= base + size)).all())


@given(scenarios())
def test_plans_match_the_reference_and_stay_inside_both_arenas(case: Scenario) -> None:
    planner = RoutePlanner(case.p_tp, case.d_tp, case.prefill, case.decode)
    for d in range(case.d_tp):
        for p in planner.plan(d).target_prefill_ranks:
            planned = case.registration(p, d)
            expected = case.reference(planned)
            for small_limit in PATHS:
                assert list(case.plan(planned, small_limit=small_limit)) == expected
            plan = case.plan(planned)
            assert inside(plan, case.src_base, case.prefill.arena_bytes, "src")
            assert inside(plan, case.dst_base, case.decode.arena_bytes, "dst")
            assert (plan.length > 0).all()
            merged = coalesce(plan)
            assert len(merged) <= len(plan)
            assert merged.total_bytes == plan.total_bytes
            src = case.source_bytes(p)
            want = apply(expected, src, case.src_base, case.decode.arena_bytes, case.dst_base)
            got = apply(merged, src, case.src_base, case.decode.arena_bytes, case.dst_base)
            assert got == want


@given(scenarios(), st.lists(st.sets(st.sampled_from([K, LATENT, CONV])), max_size=3))
def test_python_and_numpy_paths_plan_identically(
    case: Scenario, field_sets: list[set[str]]
) -> None:
    """Below and above the size threshold the same inputs give the same plans, step
    by step, coalesced or not: same copies, same order, int64 arrays both ways."""
    steps: list[frozenset[str] | None] = [None, *(frozenset(f) for f in field_sets)]
    planner = RoutePlanner(case.p_tp, case.d_tp, case.prefill, case.decode)
    for d in range(case.d_tp):
        for p in planner.plan(d).target_prefill_ranks:
            planned = case.registration(p, d)
            for coalesced in (False, True):
                by_path = [
                    plan_steps(
                        src_contract=case.prefill,
                        src_base=case.src_base,
                        dst_contract=case.decode,
                        dst_base=case.dst_base,
                        dst_manifest=case.dst_manifest,
                        source=case.source,
                        registration=planned,
                        steps=steps,
                        coalesced=coalesced,
                        small_limit=small_limit,
                    )
                    for small_limit in PATHS
                ]
                numpy_plans, python_plans = by_path
                assert len(numpy_plans) == len(python_plans) == len(steps)
                for a, b in zip(numpy_plans, python_plans, strict=True):
                    # Read before any array: the plain-Python path's lists, as built.
                    assert [list(c) for c in b.columns()] == list(a.tolist())
                    assert len(b) == len(a)
                    assert a == b
                    assert a.total_bytes == b.total_bytes
                    for column in (b.src, b.dst, b.length):
                        assert column.dtype == np.int64
                        assert column.ndim == 1
                        assert not column.flags.writeable
                    if coalesced:
                        assert a == coalesce(a)


@given(
    st.dictionaries(
        st.sampled_from(["full", "swa"]),
        st.lists(st.integers(-2, 11), max_size=4),
        min_size=2,
    ),
    st.dictionaries(
        st.sampled_from(["full", "swa"]),
        st.lists(st.integers(-2, 11), max_size=4),
        min_size=2,
    ),
    st.integers(-1, 3),
    st.sampled_from(["whole", "fragment", "owner", "absent-owner"]),
)
def test_python_and_numpy_paths_fail_alike(
    dst_ids: dict[str, list[int]],
    src_ids: dict[str, list[int]],
    shift: int,
    route: str,
) -> None:
    """Valid or not, the two paths give the same plan or the same error."""
    c = two_groups()
    fragment = Fragment("swa", "layer.1.w", shift, 0, 6, 6, 6 - abs(shift), 1)
    registration = {
        "whole": WHOLE,
        "fragment": PlannedRegistration((fragment,), {}, False, frozenset({0})),
        "owner": PlannedRegistration((fragment,), {"swa": OwnerFilter(1, 2)}, False, frozenset()),
        "absent-owner": PlannedRegistration((fragment,), {"swa": None}, False, frozenset()),
    }[route]
    outcomes = []
    for small_limit in PATHS:
        try:
            outcomes.append(
                plan_steps(
                    src_contract=c,
                    src_base=0,
                    dst_contract=c,
                    dst_base=0x4000,
                    dst_manifest=manifest(**dst_ids),
                    source=manifest(**src_ids),
                    registration=registration,
                    steps=(None, frozenset({"layer.1.w"})),
                    coalesced=True,
                    small_limit=small_limit,
                )
            )
        except PlanError as err:
            outcomes.append(str(err))  # type: ignore[arg-type]
    assert outcomes[0] == outcomes[1]


def test_the_threshold_counts_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan of more than ``small_limit`` copies goes through numpy; the result is
    the same either way."""
    import tspd.core.copies as copies_module

    python_built: list[bool] = []
    small_plans = copies_module._small_plans

    def spy(*args: object, **kwargs: object) -> object:
        result = small_plans(*args, **kwargs)  # type: ignore[arg-type]
        python_built.append(result is not None)
        return result

    monkeypatch.setattr(copies_module, "_small_plans", spy)
    c = two_groups()
    kw: dict[str, object] = {
        "src_contract": c,
        "src_base": 0,
        "dst_contract": c,
        "dst_base": 0x100000,
        "dst_manifest": manifest(full=[3, 4], swa=[5]),
        "source": manifest(full=[1, 2], swa=[7]),
        "registration": WHOLE,
        "steps": (None,),
    }
    plans = [plan_steps(**kw, small_limit=limit) for limit in (4, 5, 6, 0)]  # type: ignore[arg-type]
    assert all(plan == plans[0] for plan in plans)
    assert len(plans[0][0]) == 5  # two fields x two pages, one field x one page
    # 4: five copies exceed it; 5 and 6: they fit; 0: the Python path is not tried.
    assert python_built == [False, True, True]


def test_routes_are_kept_per_inputs_and_lanes_fail_where_they_always_did() -> None:
    """Per-registration facts are derived once per (contracts, bases, registration);
    a lane that cannot be built is not kept and fails the same on every call and
    on both paths."""
    import tspd.core.copies as copies_module

    c = two_groups()
    first = copies_module._route(c, 0, c, 0x1000, WHOLE)
    assert copies_module._route(c, 0, c, 0x1000, WHOLE) is first
    assert copies_module._route(c, 0, c, 0x2000, WHOLE) is not first
    assert copies_module._route(two_groups(), 0, c, 0x1000, WHOLE) is not first
    # The destination lacks layer.0.v: every call and both paths name it.
    dst = layout(
        {"full": [("layer.0.k", (4, 2), "bfloat16")], "swa": [("layer.1.w", (6,), "uint8")]}
    )
    for small_limit in (*PATHS, *PATHS):
        with pytest.raises(ContractError, match=r"'layer\.0\.v'"):
            plan_steps(
                src_contract=c,
                src_base=0,
                dst_contract=dst,
                dst_base=0x100000,
                dst_manifest=manifest(full=[3], swa=[5]),
                source=manifest(full=[1], swa=[7]),
                registration=WHOLE,
                steps=(None,),
                small_limit=small_limit,
            )
    # Only the swa group's lanes exist, so only they are planned.
    plans = plan_steps(
        src_contract=c,
        src_base=0,
        dst_contract=dst,
        dst_base=0x100000,
        dst_manifest=manifest(full=[3], swa=[5]),
        source=manifest(full=[1], swa=[7]),
        registration=WHOLE,
        steps=(frozenset({"layer.1.w"}),),
    )
    assert len(plans[0]) == 1


def test_the_route_cache_is_bounded() -> None:
    import tspd.core.copies as copies_module

    c = two_groups()
    for base in range(copies_module._MAX_ROUTES + 5):
        copies_module._route(c, base * 0x1000, c, 0, WHOLE)
    assert len(copies_module._ROUTES) <= copies_module._MAX_ROUTES


@given(scenarios())
def test_every_destination_byte_is_written_exactly_once(case: Scenario) -> None:
    """Across all Prefill ranks' plans for one Decode rank, each byte of each field
    payload of each destination page is written once and nothing else is."""
    planner = RoutePlanner(case.p_tp, case.d_tp, case.prefill, case.decode)
    for d in range(case.d_tp):
        counts = np.zeros(case.decode.arena_bytes, dtype=np.int64)
        for p in planner.plan(d).target_prefill_ranks:
            plan = case.plan(case.registration(p, d))
            for dst, n in zip(plan.dst.tolist(), plan.length.tolist(), strict=True):
                counts[dst - case.dst_base : dst - case.dst_base + n] += 1
        expected = np.zeros_like(counts)
        for gid in case.decode.group_ids:
            if isinstance(case.source, Selection):
                ids = case.dst_manifest.block_ids(gid)
                pages = [ids[i] for i in case.source.group(gid).destination_positions]
            else:
                pages = list(case.dst_manifest.block_ids(gid))
            for f in case.decode.fields_for_group(gid):
                for page in pages:
                    start = case.decode.page_offset(f, page)
                    expected[start : start + f.payload_bytes] += 1
        assert np.array_equal(counts, expected)


@given(
    st.integers(1, 6),
    st.integers(0, 1),
    st.integers(0, 1),
    st.lists(st.integers(0, 9), max_size=3),
)
def test_contiguous_pages_collapse_to_one_copy_per_field(
    n: int, src_first: int, dst_first: int, gaps: list[int]
) -> None:
    groups: dict[str, list[FieldDef]] = {
        "full": [(K, (2, 4), "bfloat16"), (LATENT, (3,), "uint8")],
        "state": [(CONV, (3, 2), "float32")],
    }
    src = layout(groups, blocks=8, gaps=gaps, split_planes=True)
    dst = layout(groups, blocks=8, split_planes=True)
    src_pages = list(range(1 + src_first, 1 + src_first + n))
    dst_pages = list(range(1 + dst_first, 1 + dst_first + n))
    plan = plan_copies(
        src_contract=src,
        src_base=0x1000,
        dst_contract=dst,
        dst_base=0x9000,
        dst_manifest=manifest(full=dst_pages, state=dst_pages),
        source=manifest(full=src_pages, state=src_pages),
        registration=WHOLE,
    )
    assert len(plan) == 3 * n
    merged = coalesce(plan)
    assert len(merged) == 3
    assert merged.length.tolist() == [f.payload_bytes * n for f in src.plan.fields]


# -- realistic layouts (tspd.testing.layouts) ------------------------------------------


def test_a_large_contiguous_room_is_a_handful_of_descriptors() -> None:
    """4,096 pages (above Mooncake TCP's 2,048 queued transfers per peer) of 2 layers'
    K and V: 16,384 page copies coalesce into one run per field, one engine call."""
    c = multi_layer_contract(layers=2, num_pages=4096, heads=1, head_dim=8)
    room = room_manifest(c, prompt_len=4096 * 4)
    plan = plan_copies(
        src_contract=c,
        src_base=0x10000,
        dst_contract=c,
        dst_base=0x7000_0000,
        dst_manifest=room,
        source=room,
        registration=WHOLE,
    )
    assert len(plan) == 4 * 4096
    merged = coalesce(plan)
    assert len(merged) == 4
    assert merged.total_bytes == plan.total_bytes
    assert [len(b) for b in batches(merged)] == [4]
    assert len(list(batches(plan))) == 16


@pytest.mark.parametrize(("p_tp", "d_tp", "heads"), [(1, 2, 4), (2, 1, 4), (4, 1, 2), (2, 4, 2)])
def test_model_layouts_cover_every_decode_byte_once(p_tp: int, d_tp: int, heads: int) -> None:
    def rank_layout(tp: int) -> CacheContract:
        local = max(1, heads // tp)
        return multi_layer_contract(
            layers=2,
            num_pages=12,
            heads=local,
            head_dim=4,
            tp_size=tp,
            global_heads=heads,
            with_state_group=True,
            state_dim=3,
        )

    prefill, decode = rank_layout(p_tp), rank_layout(d_tp)
    planner = RoutePlanner(p_tp, d_tp, prefill, decode)
    rng = random.Random(7)
    source = room_manifest(prefill, prompt_len=30, rng=rng, contiguous=False)
    for d in range(d_tp):
        room = room_manifest(decode, prompt_len=30, rng=rng, contiguous=False)
        counts = np.zeros(decode.arena_bytes, dtype=np.int64)
        for p in planner.plan(d).target_prefill_ranks:
            planned = plan_registration(
                prefill_tp=p_tp,
                prefill_rank=p,
                prefill_contract=prefill,
                decode_tp=d_tp,
                decode_rank=d,
                decode_contract=decode,
            )
            plan = coalesce(
                plan_copies(
                    src_contract=prefill,
                    src_base=0,
                    dst_contract=decode,
                    dst_base=0,
                    dst_manifest=room,
                    source=source,
                    registration=planned,
                )
            )
            for dst, n in zip(plan.dst.tolist(), plan.length.tolist(), strict=True):
                counts[dst : dst + n] += 1
        expected = np.zeros_like(counts)
        for group in room.groups:
            for f in decode.fields_for_group(group.group_id):
                for page in group.block_ids:
                    start = decode.page_offset(f, page)
                    expected[start : start + f.payload_bytes] += 1
        assert expected.sum() > 0
        assert np.array_equal(counts, expected)
