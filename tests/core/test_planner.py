"""Route planning (docs/protocol.md#proto-planning): golden vectors from
docs/protocol.md#proto-planning-examples, every planner error, and properties of
heterogeneous routes."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

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
from tspd.core.errors import ContractError, PlanError
from tspd.core.planner import (
    FanoutMember,
    Fragment,
    OwnerFilter,
    PlannedRegistration,
    RoutePlanner,
    plan_registration,
    validate_fanout,
    validate_owner_filters,
)

# A field: (group id, field id, local shape, dtype).
FieldDef = tuple[str, str, tuple[int, ...], str]

WIDTH = {"uint8": 1, "bfloat16": 2, "float32": 4}


def contract(
    fields: Sequence[FieldDef],
    partitions: Mapping[str, Partition] | None = None,
    *,
    blocks: int = 4,
    shard_counts: Mapping[str, int] | None = None,
    specs: Mapping[str, GroupSpec] | None = None,
    prefix_granularity: int = 1,
) -> CacheContract:
    """A contract with one plane per group, each group's fields packed side by side
    in every page slot (one page per LCM block)."""
    group_ids = list(dict.fromkeys(gid for gid, *_ in fields))
    planes, plan_fields = [], []
    offset = 0
    for gid in group_ids:
        mine = [f for f in fields if f[0] == gid]
        stride = sum(math.prod(shape) * WIDTH[dtype] for _, _, shape, dtype in mine)
        field_offset = 0
        for _, fid, shape, dtype in mine:
            plan_fields.append(
                FieldSpec(gid, fid, f"plane.{gid}", shape, dtype, field_offset, stride)
            )
            field_offset += math.prod(shape) * WIDTH[dtype]
        planes.append(Plane(f"plane.{gid}", stride, offset))
        offset += stride * (blocks + 1)
    plan = CacheMemoryPlan(
        prefix_granularity=prefix_granularity,
        lcm_block_bytes=sum(p.bytes_per_lcm_block for p in planes),
        num_lcm_blocks=blocks,
        groups=tuple(PlanGroup(gid, 1, blocks + 1) for gid in group_ids),
        planes=tuple(planes),
        fields=tuple(plan_fields),
    )
    shard_counts = shard_counts or {}
    specs = specs or {}
    return CacheContract(
        plan=plan,
        group_specs=tuple(
            specs.get(gid)
            or GroupSpec(
                gid,
                "full_history",
                1,
                1,
                None,
                "history",
                "full_suffix",
                None,
                shard_count=shard_counts.get(gid, 1),
            )
            for gid in group_ids
        ),
        transfer_schema=TransferSchema(tuple((partitions or {}).items())),
    )


def k_and_latent(k_shape: tuple[int, ...], heads: int = 4) -> CacheContract:
    """The fixture of docs/protocol.md#proto-planning-examples: bf16 ``layer.0.k``
    partitioned on axis 1 over ``heads`` global heads, plus a replicated
    ``layer.1.latent``."""
    return contract(
        [("full", "layer.0.k", k_shape, "bfloat16"), ("full", "layer.1.latent", (8,), "bfloat16")],
        {"layer.0.k": Partition(1, heads)},
    )


def frag(
    fid: str,
    src: int,
    dst: int,
    src_stride: int,
    dst_stride: int,
    size: int,
    rows: int,
    gid: str = "full",
) -> Fragment:
    return Fragment(gid, fid, src, dst, src_stride, dst_stride, size, rows)


# -- worked examples (docs/protocol.md#proto-planning-examples) ---------------


def test_tp1_to_tp2_splits_heads_and_replicates_latent() -> None:
    planner = RoutePlanner(1, 2, k_and_latent((2, 4, 2)), k_and_latent((2, 2, 2)))
    route = planner.plan(1)
    assert route.target_prefill_ranks == (0,)
    assert route.fragments_by_prefill_rank[0] == (
        frag("layer.0.k", 8, 0, 16, 8, 8, 2),
        frag("layer.1.latent", 0, 0, 16, 16, 16, 1),
    )
    assert planner.plan(0).fragments_by_prefill_rank[0][0] == frag("layer.0.k", 0, 0, 16, 8, 8, 2)
    assert planner.decode_ranks_by_prefill_rank(0) == {0, 1}
    assert planner.dummy_prefill_ranks() == ()


def test_tp2_to_tp1_gathers_heads_and_reads_latent_from_rank_zero() -> None:
    planner = RoutePlanner(2, 1, k_and_latent((2, 2, 2)), k_and_latent((2, 4, 2)))
    route = planner.plan(0)
    assert route.target_prefill_ranks == (0, 1)
    assert route.fragments_by_prefill_rank[0] == (
        frag("layer.0.k", 0, 0, 8, 16, 8, 2),
        frag("layer.1.latent", 0, 0, 16, 16, 16, 1),
    )
    assert route.fragments_by_prefill_rank[1] == (frag("layer.0.k", 0, 8, 8, 16, 8, 2),)
    assert planner.expected_prefill_ranks(0) == {0, 1}


def test_tp4_to_tp1_with_gqa_replicas_has_dummy_ranks() -> None:
    planner = RoutePlanner(4, 1, k_and_latent((2, 1, 2), heads=2), k_and_latent((2, 2, 2), 2))
    assert planner.plan(0).target_prefill_ranks == (0, 2)
    assert planner.dummy_prefill_ranks() == (1, 3)
    assert planner.target_tp_ranks(0) == (0, 1, 2, 3)
    assert planner.expected_prefill_ranks(0) == {0, 2}
    assert planner.decode_ranks_by_prefill_rank(1) == frozenset()


def test_tp2_to_tp3_with_six_heads() -> None:
    planner = RoutePlanner(2, 3, k_and_latent((2, 3, 2), 6), k_and_latent((2, 2, 2), 6))
    targets = [planner.plan(d).target_prefill_ranks for d in range(3)]
    assert targets == [(0,), (0, 1), (1,)]
    assert planner.decode_ranks_by_prefill_rank(0) == {0, 1}
    assert planner.decode_ranks_by_prefill_rank(1) == {1, 2}
    # Only Decode rank 0 adds dummies, and there are none here.
    assert planner.target_tp_ranks(1) == (0, 1)


def test_composite_conv_field_on_axis_zero() -> None:
    def conv(rows: int) -> CacheContract:
        return contract(
            [("state", "layer.0.conv", (rows, 2), "bfloat16")],
            {"layer.0.conv": Partition(0, 16, (4, 4, 8))},
        )

    route = RoutePlanner(1, 2, conv(16), conv(8)).plan(1)
    fragments = route.fragments_by_prefill_rank[0]
    assert [f.src_byte_offset for f in fragments] == [8, 24, 48]
    assert [f.dst_byte_offset for f in fragments] == [0, 8, 16]
    assert [f.bytes_per_row for f in fragments] == [8, 8, 16]
    assert {f.rows_per_page for f in fragments} == {1}


def test_composite_partition_on_inner_axis() -> None:
    def field(heads: int) -> CacheContract:
        return contract(
            [("full", "layer.0.k", (2, heads, 3), "bfloat16")],
            {"layer.0.k": Partition(1, 8, (4, 4))},
        )

    fragments = RoutePlanner(1, 2, field(8), field(4)).plan(1).fragments_by_prefill_rank[0]
    assert [f.src_byte_offset for f in fragments] == [12, 36]
    assert [f.dst_byte_offset for f in fragments] == [0, 12]
    assert {
        (f.rows_per_page, f.src_row_stride_bytes, f.dst_row_stride_bytes) for f in fragments
    } == {(2, 48, 24)}


def test_equal_tp_is_a_whole_copy_route() -> None:
    layout = k_and_latent((2, 2, 2))
    planner = RoutePlanner(2, 2, layout, layout)
    for d in range(2):
        route = planner.plan(d)
        assert route.fragments_by_prefill_rank == {d: ()}
        assert route.is_whole_copy
        assert planner.decode_ranks_by_prefill_rank(d) == {d}
    assert planner.plan(1) is planner.plan(1)  # cached


def test_rows_collapse_when_strides_equal_the_row() -> None:
    # One of 2 heads per rank on both sides (Decode TP4 holds 2 replicas of each):
    # both row strides equal the 1-head row, so the 2 rows merge into one.
    def one_head() -> CacheContract:
        return contract(
            [("full", "layer.0.k", (2, 1, 3), "bfloat16")], {"layer.0.k": Partition(1, 2)}
        )

    route = RoutePlanner(2, 4, one_head(), one_head()).plan(3)
    assert route.fragments_by_prefill_rank == {1: (frag("layer.0.k", 0, 0, 12, 12, 12, 1),)}


def test_rows_stay_when_the_partition_axis_is_outermost() -> None:
    def tokens(rows: int) -> CacheContract:
        return contract(
            [("full", "layer.0.k", (rows, 2, 3), "bfloat16")], {"layer.0.k": Partition(0, 8)}
        )

    (fragment,) = RoutePlanner(1, 2, tokens(8), tokens(4)).plan(1).fragments_by_prefill_rank[0]
    assert fragment == frag("layer.0.k", 48, 0, 96, 48, 48, 1)

    def inner(heads: int) -> CacheContract:
        return contract(
            [("full", "layer.0.k", (1, 3, heads), "bfloat16")], {"layer.0.k": Partition(2, 4)}
        )

    # Axis 2 of (1, 3, h): 3 rows of h elements; Decode rank 0 of TP2 from TP1.
    (fragment,) = RoutePlanner(1, 2, inner(4), inner(2)).plan(0).fragments_by_prefill_rank[0]
    assert (fragment.rows_per_page, fragment.bytes_per_row) == (3, 4)
    assert (fragment.src_row_stride_bytes, fragment.dst_row_stride_bytes) == (8, 4)


# -- validation (docs/protocol.md#proto-planner-checks) ---------------------------


@pytest.mark.parametrize(("p", "d"), [(0, 1), (1, 0), (-1, 2)])
def test_tp_sizes_must_be_positive(p: int, d: int) -> None:
    layout = k_and_latent((2, 4, 2))
    with pytest.raises(PlanError, match=r"^Cache TP sizes must be positive$"):
        RoutePlanner(p, d, layout, layout)


def test_tp_sizes_are_bounded() -> None:
    layout = k_and_latent((2, 4, 2))
    RoutePlanner(1024, 1024, layout, layout)
    with pytest.raises(PlanError, match=r"^Cache TP sizes cannot exceed 1024$"):
        RoutePlanner(1025, 1, layout, layout)


def test_incompatible_peers_are_refused_with_the_peer_check_message() -> None:
    # A contract error (TokenSpeed's CacheContractError), not a planning error: code
    # that catches contract errors catches an incompatible peer too.
    a = k_and_latent((2, 4, 2))
    b = contract([("full", "layer.0.k", (2, 4, 2), "float32")], {"layer.0.k": Partition(1, 4)})
    with pytest.raises(ContractError, match=r"^Cache P/D contract mismatch: ") as caught:
        RoutePlanner(1, 1, a, b)
    assert not isinstance(caught.value, PlanError)
    c = contract(
        [
            ("full", "layer.0.k", (2, 4, 2), "bfloat16"),
            ("full", "layer.1.latent", (8,), "bfloat16"),
        ],
        {"layer.0.k": Partition(1, 4)},
        prefix_granularity=2,
    )
    with pytest.raises(ContractError, match=r"^Cache P/D contract mismatch: prefix_granularity$"):
        RoutePlanner(1, 1, a, c)
    with pytest.raises(ContractError, match=r"^Cache P/D contract mismatch: prefix_granularity$"):
        plan_registration(
            prefill_tp=1,
            prefill_rank=0,
            prefill_contract=a,
            decode_tp=1,
            decode_rank=0,
            decode_contract=c,
        )


def test_equal_tp_requires_identical_local_geometry() -> None:
    # Same global shape (4 heads) but local extents differ: valid for TP1->TP2,
    # not for equal TP.
    with pytest.raises(
        ContractError, match=r"^equal-TP Cache field 'layer.0.k' rank-local geometry differs$"
    ):
        RoutePlanner(2, 2, k_and_latent((2, 4, 2)), k_and_latent((2, 2, 2)))


@pytest.mark.parametrize(
    ("p", "d", "prefill_heads", "decode_heads", "side_tp"),
    [
        (3, 1, 2, 4, 3),  # 2 shards on Prefill cannot spread over TP=3
        (1, 3, 4, 2, 3),  # 2 shards on Decode cannot spread over TP=3
    ],
)
def test_partition_must_map_onto_the_tp_size(
    p: int, d: int, prefill_heads: int, decode_heads: int, side_tp: int
) -> None:
    prefill, decode = k_and_latent((2, prefill_heads, 2)), k_and_latent((2, decode_heads, 2))
    with pytest.raises(PlanError) as caught:
        RoutePlanner(p, d, prefill, decode)
    assert str(caught.value) == (
        f"Cache field 'layer.0.k' cannot map global extent 4 and local extent 2 to TP={side_tp}"
    )


def test_more_shards_than_ranks_cannot_map() -> None:
    layout = k_and_latent((2, 1, 2))  # 4 shards
    with pytest.raises(PlanError, match=r"local extent 1 to TP=2$"):
        RoutePlanner(2, 1, layout, k_and_latent((2, 4, 2)))


def test_decode_rank_out_of_range() -> None:
    planner = RoutePlanner(1, 2, k_and_latent((2, 4, 2)), k_and_latent((2, 2, 2)))
    for d in (-1, 2):
        with pytest.raises(PlanError, match=rf"^decode_tp_rank={d} is out of range$"):
            planner.plan(d)


def test_a_contract_without_fields_has_no_source_fragments() -> None:
    empty = contract([("full", "layer.0.k", (1,), "uint8")])
    empty = replace(empty, plan=replace(empty.plan, fields=()))
    with pytest.raises(PlanError, match=r"^Cache decode TP rank 0 has no source fragments$"):
        RoutePlanner(1, 2, empty, empty).plan(0)


# -- DCP sharding (the S3 rows of docs/protocol.md#proto-planner-checks,
#    docs/protocol.md#proto-owner-filters) -----------------------------------------


def sharded(count: int, *, partitioned: bool = False) -> CacheContract:
    return contract(
        [("full", "layer.0.k", (2, 2, 2), "bfloat16"), ("swa", "layer.0.w", (4,), "uint8")],
        {"layer.0.k": Partition(1, 2)} if partitioned else {},
        shard_counts={"swa": count},
    )


def test_decode_groups_must_be_unsharded() -> None:
    with pytest.raises(
        PlanError,
        match=r"^cache group 'swa' is sharded on Decode; PD transfer into a DCP-sharded "
        r"destination is not supported$",
    ):
        RoutePlanner(2, 2, sharded(1), sharded(2))


def test_shard_count_must_divide_prefill_tp() -> None:
    with pytest.raises(
        PlanError, match=r"^cache group 'swa' shard count 2 does not divide Prefill TP=3$"
    ):
        RoutePlanner(3, 1, sharded(2), sharded(1))


def test_a_field_cannot_be_partitioned_and_sharded() -> None:
    layout = contract(
        [("full", "layer.0.k", (2, 2, 2), "bfloat16")],
        {"layer.0.k": Partition(1, 2)},
        shard_counts={"full": 2},
    )
    plain = contract([("full", "layer.0.k", (2, 2, 2), "bfloat16")], {"layer.0.k": Partition(1, 2)})
    with pytest.raises(
        PlanError,
        match=r"^cache field 'layer.0.k' is both head-partitioned and page-sharded on Prefill$",
    ):
        RoutePlanner(2, 1, layout, plain)


def test_sharded_group_reads_every_owner_of_the_aligned_subgroup() -> None:
    # Prefill TP4 with 'swa' dealt to 2 owners; Decode TP2 unsharded.
    planner = RoutePlanner(4, 2, sharded(2), sharded(1))
    assert not planner.plan(0).is_whole_copy
    route = planner.plan(1)  # replicated source floor(1*4/2) = 2 -> subgroup [2, 4)
    assert route.target_prefill_ranks == (2, 3)
    assert [f.field_id for f in route.fragments_by_prefill_rank[2]] == ["layer.0.k", "layer.0.w"]
    assert [f.field_id for f in route.fragments_by_prefill_rank[3]] == ["layer.0.w"]
    assert route.owner_filters[2] == {"swa": OwnerFilter(0, 2)}
    assert route.owner_filters[3] == {"swa": OwnerFilter(1, 2)}
    assert planner.dummy_prefill_ranks() == ()


def test_equal_tp_with_a_sharded_group_uses_fragments() -> None:
    planner = RoutePlanner(2, 2, sharded(2), sharded(1))
    route = planner.plan(0)
    assert route.target_prefill_ranks == (0, 1)
    assert route.owner_filters[1] == {"swa": OwnerFilter(1, 2)}
    assert [f.group_id for f in route.fragments_by_prefill_rank[1]] == ["swa"]


def test_owner_filter_bounds() -> None:
    for rank, count in [(0, 1), (2, 2), (-1, 3)]:
        with pytest.raises(
            PlanError, match=r"^cache page owner filter needs 0 <= rank < count >= 2$"
        ):
            OwnerFilter(rank, count)
    owner = OwnerFilter(1, 3)
    assert [v for v in range(10) if owner.owns(v)] == [2, 5, 8]
    assert [owner.local_page(v) for v in (2, 5, 8)] == [1, 2, 3]


def test_validate_owner_filters_messages() -> None:
    layout = sharded(2)
    w = frag("layer.0.w", 0, 0, 4, 4, 4, 1, gid="swa")
    k = frag("layer.0.k", 0, 0, 16, 16, 16, 1)
    validate_owner_filters(layout, (k, w), {"swa": OwnerFilter(0, 2)})
    validate_owner_filters(layout, (k,), {"swa": None})
    route_says = "the registration route carries"
    cases: list[tuple[Sequence[Fragment], dict[str, OwnerFilter | None], str]] = [
        (
            (k,),
            {"swa": None, "full": None},
            "owner filter names cache group 'full', which is not sharded",
        ),
        (
            (k,),
            {},
            f"cache group 'swa' is sharded but {route_says} no owner-filter decision for it",
        ),
        (
            (w,),
            {"swa": None},
            f"{route_says} fragments of sharded cache group 'swa' but no owner filter",
        ),
        (
            (w,),
            {"swa": OwnerFilter(0, 3)},
            "cache group 'swa' owner filter (3 owners) disagrees with its shard count 2",
        ),
        (
            (k,),
            {"swa": OwnerFilter(1, 2)},
            f"cache group 'swa' has an owner filter but {route_says} no fragment of it",
        ),
    ]
    for fragments, filters, message in cases:
        with pytest.raises(PlanError) as caught:
            validate_owner_filters(layout, fragments, filters)
        assert str(caught.value) == message


# -- Prefill-side registration planning (docs/protocol.md#proto-prefill-planning) --


def register(
    p_tp: int, p: int, d_tp: int, d: int, prefill: CacheContract, decode: CacheContract
) -> PlannedRegistration:
    return plan_registration(
        prefill_tp=p_tp,
        prefill_rank=p,
        prefill_contract=prefill,
        decode_tp=d_tp,
        decode_rank=d,
        decode_contract=decode,
    )


def test_registration_on_a_target_rank() -> None:
    planned = register(2, 1, 1, 0, k_and_latent((2, 2, 2)), k_and_latent((2, 4, 2)))
    assert planned.fragments == (frag("layer.0.k", 0, 8, 8, 16, 8, 2),)
    assert not planned.is_dummy
    assert planned.expected_decode_ranks == {0}
    assert planned.owner_filters == {}


def test_registration_equal_tp_is_whole_copy() -> None:
    layout = k_and_latent((2, 2, 2))
    planned = register(2, 1, 2, 1, layout, layout)
    assert planned == PlannedRegistration((), {}, False, frozenset({1}))


def test_registration_on_a_dummy_rank_expects_decode_rank_zero() -> None:
    planned = register(4, 3, 1, 0, k_and_latent((2, 1, 2), 2), k_and_latent((2, 2, 2), 2))
    assert planned == PlannedRegistration((), {}, True, frozenset({0}))


def test_registration_on_the_wrong_rank_is_refused() -> None:
    # TP2 -> TP3 over 6 heads: Decode rank 0 reads Prefill rank 0 only.
    prefill, decode = k_and_latent((2, 3, 2), 6), k_and_latent((2, 2, 2), 6)
    with pytest.raises(
        PlanError, match=r"^CachePD Decode registration targets the wrong Prefill TP rank$"
    ):
        register(2, 1, 3, 0, prefill, decode)
    # A dummy rank accepts only Decode rank 0.
    with pytest.raises(PlanError, match=r"targets the wrong Prefill TP rank$"):
        register(4, 1, 2, 1, k_and_latent((2, 1, 2), 2), k_and_latent((2, 1, 2), 2))


def test_registration_with_sharded_groups_carries_owner_filters() -> None:
    planned = register(4, 3, 2, 1, sharded(2), sharded(1))
    assert planned.owner_filters == {"swa": OwnerFilter(1, 2)}
    assert planned.expected_decode_ranks == {1}
    assert [f.group_id for f in planned.fragments] == ["swa"]


def test_registration_errors_are_plan_errors() -> None:
    layout = k_and_latent((2, 4, 2))
    with pytest.raises(PlanError, match=r"^decode_tp_rank=5 is out of range$"):
        register(1, 0, 1, 5, layout, layout)
    with pytest.raises(PlanError, match=r"^prefill_tp_rank=1 is out of range$"):
        register(1, 1, 1, 0, layout, layout)


# -- fan-out (docs/protocol.md#proto-fanout) -------------------------------------


def test_fanout_accepts_the_exact_rank_set() -> None:
    both = frozenset({0, 1})
    validate_fanout([FanoutMember(2, 1, both), (2, 0, both)])


BOTH = frozenset({0, 1})
UNREGISTERED = "CachePD request references an unregistered Decode session"
INCONSISTENT = "Cache-transfer room has inconsistent TP metadata"
DISAGREE = "Cache-transfer room destination ranks disagree with the typed route plan"


@pytest.mark.parametrize(
    ("members", "message"),
    [
        ([(2, 0, BOTH), None], UNREGISTERED),
        ([(2, 0, BOTH), (4, 1, BOTH)], INCONSISTENT),
        ([(2, 0, BOTH), (2, 1, frozenset({1}))], INCONSISTENT),
        ([], INCONSISTENT),
        ([(2, 0, BOTH)], DISAGREE),
        ([(2, 0, BOTH), (2, 0, BOTH)], DISAGREE),
        ([(2, 0, BOTH), (2, 0, BOTH), (2, 1, BOTH)], DISAGREE),
        ([(2, 0, BOTH), (2, 2, BOTH)], DISAGREE),
    ],
)
def test_fanout_errors(members: list[tuple[int, int, frozenset[int]] | None], message: str) -> None:
    with pytest.raises(PlanError) as caught:
        validate_fanout(members)
    assert str(caught.value) == message


# -- properties ------------------------------------------------------------------

TP_PAIRS = st.sampled_from(
    [(1, 2), (2, 1), (4, 1), (1, 4), (2, 3), (3, 2), (2, 4), (4, 2), (3, 6), (6, 4)]
)
Case = tuple[int, int, CacheContract, CacheContract]


@st.composite
def hetero_pair(draw: st.DrawFn) -> Case:
    """A Prefill/Decode TP pair with a partitioned (possibly composite) field whose
    head count fits both, plus a replicated field."""
    p, d = draw(TP_PAIRS)
    # Global heads: a multiple of the larger shard count; shards per side divide TP.
    shards_p = draw(st.sampled_from([s for s in range(1, p + 1) if p % s == 0]))
    shards_d = draw(st.sampled_from([s for s in range(1, d + 1) if d % s == 0]))
    unit = shards_p * shards_d // math.gcd(shards_p, shards_d)
    n_parts = draw(st.sampled_from([1, 2, 3]))
    parts = tuple(unit * draw(st.integers(1, 2)) for _ in range(n_parts))
    heads = sum(parts)
    axis = draw(st.integers(0, 2))
    shape = [draw(st.integers(1, 3)) for _ in range(3)]

    def side(shards: int) -> CacheContract:
        local = list(shape)
        local[axis] = heads // shards
        return contract(
            [("full", "layer.0.k", tuple(local), "bfloat16"), ("full", "layer.1.c", (3,), "uint8")],
            {"layer.0.k": Partition(axis, heads, parts if n_parts > 1 else ())},
        )

    return p, d, side(shards_p), side(shards_d)


@given(hetero_pair())
def test_served_sets_targets_and_dummies_agree(case: Case) -> None:
    p_tp, d_tp, prefill, decode = case
    planner = RoutePlanner(p_tp, d_tp, prefill, decode)
    served: dict[int, set[int]] = {p: set() for p in range(p_tp)}
    for d in range(d_tp):
        route = planner.plan(d)
        assert route.target_prefill_ranks == tuple(sorted(route.fragments_by_prefill_rank))
        assert planner.expected_prefill_ranks(d) == set(route.target_prefill_ranks)
        for p in route.target_prefill_ranks:
            served[p].add(d)
            planned = register(p_tp, p, d_tp, d, prefill, decode)
            assert planned.fragments == route.fragments_by_prefill_rank[p]
            assert not planned.is_dummy
    for p in range(p_tp):
        assert planner.decode_ranks_by_prefill_rank(p) == served[p]
    dummies = planner.dummy_prefill_ranks()
    assert set(dummies) == {p for p in range(p_tp) if not served[p]}
    union = set(planner.plan(0).target_prefill_ranks) | set(dummies)
    assert planner.target_tp_ranks(0) == tuple(sorted(union))
    for p in dummies:
        assert register(p_tp, p, d_tp, 0, prefill, decode).is_dummy


@given(hetero_pair())
def test_fragments_tile_each_decode_page_exactly_once(case: Case) -> None:
    """Every byte of every Decode rank's field page is written by exactly one
    fragment row, and every source range lies inside the Prefill field page."""
    p_tp, d_tp, prefill, decode = case
    planner = RoutePlanner(p_tp, d_tp, prefill, decode)
    for d in range(d_tp):
        hits = {f.field_id: [0] * f.payload_bytes for f in decode.plan.fields}
        for p, fragments in planner.plan(d).fragments_by_prefill_rank.items():
            for f in fragments:
                src_payload = prefill.field(f.field_id).payload_bytes
                for row in range(f.rows_per_page):
                    s = f.src_byte_offset + row * f.src_row_stride_bytes
                    assert s >= 0, (p, f)
                    assert s + f.bytes_per_row <= src_payload, (p, f)
                    start = f.dst_byte_offset + row * f.dst_row_stride_bytes
                    for byte in range(start, start + f.bytes_per_row):
                        hits[f.field_id][byte] += 1
        for fid, counts in hits.items():
            assert set(counts) == {1}, (d, fid)
