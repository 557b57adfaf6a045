"""``tspd.layouts``: contracts for real model shapes.

Every contract the builders make parses back to itself and re-serialises to the
same bytes; TP shards of one model hold every head exactly once, and the planner's
routes between any two TP sizes put every global byte of a field exactly once
into every Decode rank's page; impossible shapes are refused with operator-facing
errors; and the demo's and benchmarks' contracts are the bytes they were before
the builders moved here.
"""

from __future__ import annotations

import math
import random
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tspd.bench.core import one_field_contract
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
    dtype_width,
    parse_contract,
)
from tspd.core.errors import ConfigError, ContractError
from tspd.core.planner import RoutePlanner
from tspd.demo.workload import Workload
from tspd.layouts import (
    DTYPE_ALIASES,
    CacheTensor,
    HistoryGroup,
    PageAllocator,
    StateGroup,
    attention_group,
    build_contract,
    cache_dtype,
    kv_head_range,
    kv_heads_per_rank,
    latent_group,
    mha_contract,
    mla_contract,
)
from tspd.shell.arena import field_shard
from tspd.testing import layouts as testing_layouts
from tspd.testing.layouts import multi_layer_contract

ROOT = Path(__file__).resolve().parents[2]


def valid_tp_sizes(extent: int, most: int = 16) -> list[int]:
    """TP sizes an axis of ``extent`` can be split over: divisors and multiples."""
    return [t for t in range(1, most + 1) if extent % t == 0 or t % extent == 0]


def roundtrips(contract: CacheContract) -> None:
    data = contract.to_json()
    parsed = parse_contract(data)
    assert parsed == contract
    assert parsed.to_json() == data
    check_local_contract(parsed)


# --------------------------------------------------------------- the demo's bytes


def reference_demo_contract(
    *,
    layers: int,
    num_pages: int,
    heads: int,
    head_dim: int,
    page_tokens: int,
    tp_size: int,
    global_heads: int,
    dtype: str = "bfloat16",
) -> CacheContract:
    """The demo's contract builder as it was before ``tspd.layouts`` (frozen copy)."""
    payload = heads * page_tokens * head_dim * dtype_width(dtype)
    planes: list[Plane] = []
    fields: list[FieldSpec] = []
    partitions: list[tuple[str, Partition]] = []
    offset = 0
    for layer in range(layers):
        for part in ("k", "v"):
            fid = f"layer.{layer}.{part}"
            planes.append(Plane(fid, payload, offset))
            offset += (num_pages + 1) * payload
            fields.append(
                FieldSpec("kv", fid, fid, (heads, page_tokens, head_dim), dtype, 0, payload)
            )
            partitions.append((fid, Partition(axis=0, global_extent=global_heads)))
    plan = CacheMemoryPlan(
        prefix_granularity=page_tokens,
        lcm_block_bytes=sum(p.bytes_per_lcm_block for p in planes),
        num_lcm_blocks=num_pages,
        groups=(PlanGroup("kv", 1, num_pages + 1),),
        planes=tuple(planes),
        fields=tuple(fields),
    )
    spec = GroupSpec(
        group_id="kv",
        retention="full_history",
        rows_per_page=page_tokens,
        entry_stride_tokens=1,
        sliding_window_tokens=None,
        family="history",
        transfer_policy="full_suffix",
        checkpoint_granularity=None,
    )
    return CacheContract(plan, (spec,), TransferSchema(tuple(partitions)))


def reference_workload_contract(w: Workload, tp_size: int) -> CacheContract:
    return reference_demo_contract(
        layers=w.layers,
        num_pages=w.num_pages,
        heads=max(1, w.global_heads // tp_size),
        head_dim=w.head_dim,
        page_tokens=w.page_tokens,
        tp_size=tp_size,
        global_heads=w.global_heads,
        dtype=w.dtype,
    )


@pytest.mark.parametrize("tp_size", [1, 2, 4, 8, 16])
def test_the_default_demo_contract_keeps_its_bytes(tp_size: int) -> None:
    workload = Workload(rooms=range(1))
    new = workload.contract(tp_size).to_json()
    assert new == reference_workload_contract(workload, tp_size).to_json()


@given(
    layers=st.integers(1, 4),
    global_heads=st.sampled_from([1, 2, 3, 4, 6, 8, 16]),
    head_dim=st.integers(1, 128),
    page_tokens=st.integers(1, 64),
    num_pages=st.integers(1, 64),
    data=st.data(),
)
def test_every_demo_shape_keeps_its_bytes(
    layers: int,
    global_heads: int,
    head_dim: int,
    page_tokens: int,
    num_pages: int,
    data: st.DataObject,
) -> None:
    tp_size = data.draw(st.sampled_from(valid_tp_sizes(global_heads)))
    workload = Workload(
        rooms=range(1),
        layers=layers,
        global_heads=global_heads,
        head_dim=head_dim,
        page_tokens=page_tokens,
        num_pages=num_pages,
    )
    expected = reference_workload_contract(workload, tp_size).to_json()
    assert workload.contract(tp_size).to_json() == expected


def test_a_demo_tp_size_that_cannot_split_the_heads_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^4 KV heads cannot be split over TP=3: "):
        Workload(rooms=range(1)).contract(3)


@pytest.mark.parametrize(("layers", "pages", "tp_size"), [(32, 2048, 1), (32, 2048, 2), (2, 64, 2)])
def test_the_benchmark_model_keeps_its_bytes(layers: int, pages: int, tp_size: int) -> None:
    # tspd bench core's model: 8 KV heads of 128, bf16, 16-token pages, token-major.
    old = multi_layer_contract(
        layers=layers,
        num_pages=pages,
        heads=8 // tp_size,
        head_dim=128,
        tp_size=tp_size,
        global_heads=8,
        page_tokens=16,
    )
    new = mha_contract(
        num_layers=layers,
        num_kv_heads=8,
        head_dim=128,
        page_tokens=16,
        num_pages=pages,
        tp_size=tp_size,
    )
    assert new.to_json() == old.to_json()


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_tiny_uint8_models_keep_their_bytes(tp_size: int) -> None:
    # tspd bench rooms' journeys: 2 layers, 4 heads of 1 byte, 4-token pages.
    old = multi_layer_contract(
        layers=2, num_pages=64, heads=4 // tp_size, head_dim=1, tp_size=tp_size, dtype="uint8"
    )
    new = mha_contract(
        num_layers=2,
        num_kv_heads=4,
        head_dim=1,
        page_tokens=4,
        num_pages=64,
        dtype="uint8",
        tp_size=tp_size,
    )
    assert new.to_json() == old.to_json()


def test_the_testing_state_group_is_a_page_major_state_group() -> None:
    old = multi_layer_contract(
        layers=2,
        num_pages=5,
        heads=2,
        head_dim=4,
        tp_size=2,
        with_state_group=True,
        prefix_granularity=8,
        page_tokens=4,
        sliding_window_tokens=12,
        state_dim=3,
    )
    new = build_contract(
        [
            attention_group(layers=2, num_kv_heads=4, head_dim=4, page_tokens=4, sliding_window=12),
            StateGroup("state", (0, 1), (CacheTensor("state", (4, 3), split_axis=0),)),
        ],
        num_pages=5,
        tp_size=2,
        prefix_granularity=8,
    )
    assert new.to_json() == old.to_json()


def test_the_one_field_benchmark_contract_moves_whole_pages() -> None:
    contract = one_field_contract(num_pages=8, page_bytes=4096)
    (field,) = contract.plan.fields
    assert (field.field_id, field.payload_bytes, field.dtype) == ("layer.0.kv", 4096, "uint8")
    assert contract.partition_of("layer.0.kv") is None
    assert contract.group("full").block_granularity == 16
    roundtrips(contract)


def test_page_allocator_moved_and_is_re_exported_for_tests() -> None:
    assert testing_layouts.PageAllocator is PageAllocator
    allocator = PageAllocator(
        mha_contract(num_layers=1, num_kv_heads=1, head_dim=1, page_tokens=4, num_pages=4)
    )
    assert allocator.allocate(9) == {"kv": [1, 2, 3]}
    assert allocator.free_pages("kv") == 1
    with pytest.raises(ConfigError, match="has 1 free pages; a 9-token prompt needs 3"):
        allocator.allocate(9)
    allocator.release({"kv": [0, 2]})
    assert allocator.free_pages("kv") == 2


@given(
    st.lists(
        st.tuples(st.booleans(), st.integers(1, 40), st.integers(0, 3)), min_size=1, max_size=60
    )
)
def test_contiguous_allocation_hands_out_the_lowest_free_ids(
    script: list[tuple[bool, int, int]],
) -> None:
    """Against a model that sorts every free page: the same rows, requests and errors,
    whatever order requests are released in (duplicates and padding included)."""
    contract = mha_contract(num_layers=1, num_kv_heads=1, head_dim=1, page_tokens=4, num_pages=32)
    allocator = PageAllocator(contract)
    model = set(range(1, contract.page_count("kv")))
    held: list[dict[str, list[int]]] = []
    for allocate, prompt_len, which in script:
        if allocate or not held:
            want = sorted(model)[: -(-prompt_len // 4)]
            if len(want) < -(-prompt_len // 4):
                with pytest.raises(ConfigError):
                    allocator.allocate(prompt_len)
                continue
            tables = allocator.allocate(prompt_len)
            assert tables == {"kv": want}
            model.difference_update(want)
            held.append(tables)
        else:
            tables = held.pop(which % len(held))
            row = [*tables["kv"], 0, *tables["kv"][:1]]  # padding and a repeat
            allocator.release({"kv": row})
            model.update(tables["kv"])
        assert allocator.free_pages("kv") == len(model)


# --------------------------------------------------------------- round trips


DTYPES = sorted({*DTYPE_WIDTHS, *DTYPE_ALIASES})


@st.composite
def attention_models(draw: st.DrawFn) -> dict[str, Any]:
    heads = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    return {
        "num_layers": draw(st.integers(1, 4)),
        "num_kv_heads": heads,
        "head_dim": draw(st.integers(1, 16)),
        "v_head_dim": draw(st.none() | st.integers(1, 16)),
        "page_tokens": draw(st.integers(1, 32)),
        "num_pages": draw(st.integers(1, 12)),
        "dtype": draw(st.sampled_from(DTYPES)),
        "sliding_window": draw(st.none() | st.integers(1, 200)),
        "token_layout": draw(st.sampled_from(["token_major", "head_major"])),
        "arena_layout": draw(st.sampled_from(["layer_major", "page_major"])),
    }


@given(attention_models(), st.data())
def test_attention_contracts_round_trip(model: dict[str, Any], data: st.DataObject) -> None:
    tp_size = data.draw(st.sampled_from(valid_tp_sizes(model["num_kv_heads"])))
    contract = mha_contract(tp_size=tp_size, **model)
    roundtrips(contract)
    local = kv_heads_per_rank(model["num_kv_heads"], tp_size)
    head_axis = 1 if model["token_layout"] == "token_major" else 0
    for field in contract.plan.fields:
        assert field.shape[head_axis] == local
        assert contract.global_shape(field)[head_axis] == model["num_kv_heads"]
        assert field.dtype == cache_dtype(model["dtype"])
    assert len(contract.plan.fields) == 2 * model["num_layers"]
    assert contract.group("kv").is_sliding == (model["sliding_window"] is not None)


@given(
    layers=st.integers(1, 4),
    rank=st.integers(1, 64),
    rope=st.integers(0, 16),
    page_tokens=st.integers(1, 64),
    dtype=st.sampled_from(DTYPES),
    arena=st.sampled_from(["layer_major", "page_major"]),
)
def test_mla_contracts_round_trip_and_are_not_split(
    layers: int, rank: int, rope: int, page_tokens: int, dtype: str, arena: Any
) -> None:
    contract = mla_contract(
        num_layers=layers,
        kv_lora_rank=rank,
        rope_dim=rope,
        page_tokens=page_tokens,
        num_pages=3,
        dtype=dtype,
        arena_layout=arena,
    )
    roundtrips(contract)
    assert contract.transfer_schema.fields == ()
    assert [f.field_id for f in contract.plan.fields] == [
        f"layer.{n}.latent_kv" for n in range(layers)
    ]
    assert all(f.shape == (page_tokens, rank + rope) for f in contract.plan.fields)


@st.composite
def hybrid_models(draw: st.DrawFn) -> tuple[list[HistoryGroup | StateGroup], int]:
    """A full-attention group, maybe a sliding one on other layers, maybe an MLA-like
    replicated group and a state group with a composite split, and a TP size all of
    them can be split over."""
    tp = draw(st.sampled_from([1, 2, 4]))
    layers = draw(st.integers(2, 6))
    page = draw(st.sampled_from([1, 2, 4, 8, 16]))
    heads = draw(st.sampled_from([h for h in (1, 2, 4, 8) if h % tp == 0 or tp % h == 0]))
    even, odd = list(range(0, layers, 2)), list(range(1, layers, 2))
    groups: list[HistoryGroup | StateGroup] = [
        attention_group(
            layers=even,
            num_kv_heads=heads,
            head_dim=draw(st.integers(1, 8)),
            page_tokens=page,
            group_id="full",
            token_layout=draw(st.sampled_from(["token_major", "head_major"])),
            arena_layout=draw(st.sampled_from(["layer_major", "page_major"])),
        )
    ]
    if draw(st.booleans()):
        groups.append(
            attention_group(
                layers=odd,
                num_kv_heads=heads,
                head_dim=draw(st.integers(1, 8)),
                page_tokens=draw(st.sampled_from([page, 2 * page])),
                sliding_window=draw(st.integers(1, 64)),
                group_id="swa",
            )
        )
    if draw(st.booleans()):
        groups.append(
            latent_group(
                layers=odd,
                kv_lora_rank=draw(st.integers(1, 8)),
                rope_dim=2,
                page_tokens=page,
                group_id="mla",
            )
        )
    if draw(st.booleans()):
        width = tp * draw(st.integers(1, 3))
        groups.append(
            StateGroup(
                "state",
                (layers, layers + 1),
                (
                    CacheTensor("conv", (3 * width, 2), split_axis=0, parts=(width,) * 3),
                    CacheTensor("ssm", (tp, 2, 3), split_axis=0, dtype="fp32"),
                    CacheTensor("meta", (2,), dtype="int64"),
                ),
                checkpoint_tokens=draw(st.sampled_from([None, 4 * page])),
                arena_layout=draw(st.sampled_from(["layer_major", "page_major"])),
            )
        )
    return groups, tp


@given(hybrid_models(), st.integers(1, 8))
def test_hybrid_contracts_round_trip(model: tuple[list[Any], int], pages: int) -> None:
    groups, tp = model
    contract = build_contract(groups, num_pages=pages, tp_size=tp)
    roundtrips(contract)
    assert contract.group_ids == tuple(g.group_id for g in groups)
    for group in groups:
        assert contract.page_count(group.group_id) == pages + 1
        spec = contract.group(group.group_id)
        assert contract.plan.prefix_granularity % spec.block_granularity == 0
    ids = [f.field_id for f in contract.plan.fields]
    assert len(ids) == len(set(ids))


# --------------------------------------------------------------- TP shards


@given(st.integers(1, 64), st.data())
def test_tp_shards_hold_every_head_exactly_once(heads: int, data: st.DataObject) -> None:
    tp = data.draw(st.sampled_from(valid_tp_sizes(heads, most=128)))
    ranges = [kv_head_range(heads, tp, rank) for rank in range(tp)]
    distinct = sorted(set(ranges), key=lambda r: r.start)
    assert [h for r in distinct for h in r] == list(range(heads))  # a partition of the heads
    replicas = tp // len(distinct)
    assert all(ranges.count(r) == replicas for r in distinct)
    # Replicas of a shard are consecutive ranks: shard = rank // R
    # (docs/protocol.md#proto-fragments).
    assert ranges == [distinct[rank // replicas] for rank in range(tp)]
    assert all(len(r) == kv_heads_per_rank(heads, tp) for r in ranges)


def _copy_field(
    prefill: list[CacheContract],
    decode: CacheContract,
    route_fragments: dict[int, tuple[Any, ...]],
    field_id: str,
    global_bytes: bytes,
    prefill_tp: int,
) -> tuple[bytearray, list[int]]:
    """Apply one Decode rank's fragments to one field page; return the page and how
    many times each byte was written."""
    size = decode.field(field_id).payload_bytes
    page, writes = bytearray(size), [0] * size
    for p, fragments in route_fragments.items():
        src = field_shard(
            prefill[p], prefill[p].field(field_id), global_bytes, tp_size=prefill_tp, tp_rank=p
        )
        if not fragments:  # equal TP: the whole field
            page[:], writes = bytearray(src), [w + 1 for w in writes]
        for frag in fragments:
            if frag.field_id != field_id:
                continue
            for row in range(frag.rows_per_page):
                s = frag.src_byte_offset + row * frag.src_row_stride_bytes
                d = frag.dst_byte_offset + row * frag.dst_row_stride_bytes
                page[d : d + frag.bytes_per_row] = src[s : s + frag.bytes_per_row]
                for i in range(d, d + frag.bytes_per_row):
                    writes[i] += 1
    return page, writes


@given(hybrid_models(), st.data())
def test_routes_between_tp_sizes_deliver_every_byte_once(
    model: tuple[list[Any], int], data: st.DataObject
) -> None:
    groups, tp = model

    def splits(tp_size: int) -> bool:
        try:
            build_contract(groups, num_pages=1, tp_size=tp_size)
        except ConfigError:
            return False
        return True

    sizes = [t for t in (1, 2, 3, 4, 8) if splits(t)]
    assert tp in sizes
    prefill_tp = data.draw(st.sampled_from(sizes))
    decode_tp = data.draw(st.sampled_from(sizes))
    prefill = [build_contract(groups, num_pages=2, tp_size=prefill_tp)] * prefill_tp
    decode = build_contract(groups, num_pages=3, tp_size=decode_tp)
    planner = RoutePlanner(prefill_tp, decode_tp, prefill[0], decode)
    rng = random.Random(data.draw(st.integers(0, 2**32)))
    for d in range(decode_tp):
        fragments = dict(planner.plan(d).fragments_by_prefill_rank)
        for field in decode.plan.fields:
            whole = rng.randbytes(math.prod(decode.global_shape(field)) * field.dtype_width)
            page, writes = _copy_field(
                prefill, decode, fragments, field.field_id, whole, prefill_tp
            )
            expected = field_shard(decode, field, whole, tp_size=decode_tp, tp_rank=d)
            assert bytes(page) == expected, field.field_id
            assert set(writes) == {1}, field.field_id


# --------------------------------------------------------------- dtypes and errors


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("bf16", "bfloat16"),
        ("BF16", "bfloat16"),
        ("torch.bfloat16", "bfloat16"),
        ("fp16", "float16"),
        ("half", "float16"),
        ("fp8", "float8_e4m3fn"),
        ("fp8_e5m2", "float8_e5m2"),
        ("fp32", "float32"),
        ("float8_e8m0fnu", "float8_e8m0fnu"),
        ("uint8", "uint8"),
    ],
)
def test_dtype_names(name: str, dtype: str) -> None:
    assert cache_dtype(name) == dtype


def test_an_unknown_dtype_lists_what_is_accepted() -> None:
    with pytest.raises(
        ConfigError, match=r"^unknown cache dtype 'fp4'; use one of fp16, .*bfloat16"
    ):
        mha_contract(
            num_layers=1, num_kv_heads=1, head_dim=1, page_tokens=1, num_pages=1, dtype="fp4"
        )


BASE: dict[str, Any] = {
    "num_layers": 2,
    "num_kv_heads": 8,
    "head_dim": 64,
    "page_tokens": 16,
    "num_pages": 4,
}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"num_kv_heads": 6, "tp_size": 4},
            "6 KV heads cannot be split over TP=4: the TP size must divide 6",
        ),
        ({"num_kv_heads": 8, "tp_size": 12}, "8 KV heads cannot be split over TP=12"),
        ({"tp_size": 0}, "tp_size must be a whole number of at least 1, got 0"),
        ({"tp_size": 2048}, "tp_size must be at most 1024, got 2048"),
        ({"num_layers": 0}, "num_layers must be a whole number of at least 1, got 0"),
        ({"num_layers": True}, "num_layers must be a whole number of at least 1, got True"),
        ({"head_dim": 0}, "head_dim must be a whole number of at least 1, got 0"),
        ({"num_kv_heads": -1}, "num_kv_heads must be a whole number of at least 1, got -1"),
        ({"page_tokens": 0}, "cache group 'kv' page_tokens must be a whole number of at least 1"),
        ({"num_pages": 0}, "num_pages must be a whole number of at least 1, got 0"),
        ({"sliding_window": 0}, "cache group 'kv' sliding_window must be a whole number"),
        ({"token_layout": "nhd"}, "token_layout must be 'token_major' or 'head_major', got 'nhd'"),
        ({"arena_layout": "x"}, "arena_layout must be 'layer_major' or 'page_major', got 'x'"),
    ],
)
def test_impossible_attention_shapes_are_refused(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        mha_contract(**{**BASE, **overrides})


def _kv(layers: Any = (0, 1), **overrides: Any) -> HistoryGroup:
    return attention_group(layers=layers, num_kv_heads=2, head_dim=2, page_tokens=4, **overrides)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: build_contract([], num_pages=1), "a cache contract needs at least one group"),
        (lambda: build_contract([_kv(), _kv()], num_pages=1), "cache group ids must be unique"),
        (
            lambda: build_contract([_kv(), _kv(group_id="swa", sliding_window=8)], num_pages=1),
            "cache field 'layer.0.k' is in groups 'kv' and 'swa'; give the groups disjoint layers",
        ),
        (lambda: _kv(layers=(0, 0)), "cache group 'kv' lists a layer twice: (0, 0)"),
        (lambda: _kv(layers=()), "cache group 'kv' needs at least one layer"),
        (
            lambda: _kv(layers=(-1,)),
            "cache group 'kv' layer ids must be a whole number of at least 0",
        ),
        (lambda: _kv(group_id=""), "a cache group needs a non-empty group_id"),
        (
            lambda: build_contract([_kv()], num_pages=1, prefix_granularity=6),
            "prefix_granularity=6 must be a multiple of cache group 'kv''s 4-token pages",
        ),
        (
            lambda: build_contract([StateGroup("s", (0,), (CacheTensor("x", (2,)),))], num_pages=1),
            "state groups alone need checkpoint_tokens or a prefix_granularity",
        ),
        (
            lambda: StateGroup("s", (0,), (CacheTensor("x", ()),)),
            "cache group 's': state tensor 'x' needs a non-empty shape",
        ),
        (lambda: StateGroup("s", (0,), ()), "cache group 's' needs one or more CacheTensor"),
        (
            lambda: StateGroup("s", (0,), (CacheTensor("x", (2,)), CacheTensor("x", (3,)))),
            "cache group 's' names a tensor twice",
        ),
        (
            lambda: HistoryGroup(
                "h", (0,), (CacheTensor("x", (2,)),), page_tokens=6, entry_stride_tokens=4
            ),
            "page_tokens=6 must be a multiple of entry_stride_tokens=4",
        ),
        (lambda: CacheTensor("", (1,)), "a cache tensor needs a non-empty name"),
        (lambda: CacheTensor("x", (0, 2)), "cache tensor 'x' shape (0, 2) extents must be"),
        (lambda: CacheTensor("x", (2,), split_axis=1), "split_axis 1 is not an axis of shape (2,)"),
        (lambda: CacheTensor("x", (2,), parts=(1, 1)), "composite parts (1, 1) need a split_axis"),
        (
            lambda: CacheTensor("x", (6,), split_axis=0, parts=(2, 2)),
            "composite parts (2, 2) sum to 4, not the extent 6 of axis 0",
        ),
        (lambda: CacheTensor("x", (6,), split_axis=0, parts=(6,)), "give 2..16 composite parts"),
        (lambda: CacheTensor("x", (2,), token_axis=2), "token_axis 2 must be in [0, 1]"),
        (lambda: CacheTensor("x", (2,), dtype="fp4"), "unknown cache dtype 'fp4'"),
        (
            lambda: build_contract(
                [
                    StateGroup(
                        "s",
                        (0,),
                        (CacheTensor("c", (6,), split_axis=0, parts=(2, 4)),),
                        checkpoint_tokens=4,
                    )
                ],
                num_pages=1,
                tp_size=4,
            ),
            "every composite part (2, 4) must divide by TP=4",
        ),
        (
            lambda: build_contract(
                [
                    StateGroup(
                        "s", (0,), (CacheTensor("c", (6, 2), split_axis=0),), checkpoint_tokens=4
                    )
                ],
                num_pages=1,
                tp_size=4,
            ),
            "cache group 's' tensor 'c' (6 on axis 0) cannot be split over TP=4",
        ),
        (lambda: kv_head_range(4, 2, 2), "tp_rank must be in [0, 2), got 2"),
    ],
)
def test_impossible_layouts_are_refused(build: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        build()


def test_a_contract_too_big_for_the_wire_is_refused() -> None:
    with pytest.raises(ContractError, match="exceeds 262144 wire bytes"):
        mha_contract(num_layers=2000, num_kv_heads=1, head_dim=1, page_tokens=1, num_pages=1)


def test_an_arena_past_the_address_bound_is_refused() -> None:
    with pytest.raises(ContractError, match=r"^local cache transfer contract: .* exceeds"):
        mha_contract(
            num_layers=1, num_kv_heads=1024, head_dim=1024, page_tokens=1024, num_pages=2**40
        )


# --------------------------------------------------------------- documentation


def test_the_tutorial_contract_examples_run() -> None:
    text = (ROOT / "docs" / "tutorial.md").read_text(encoding="utf-8")
    section = text[text.index("## Your model's contract") : text.index("## Where to go next")]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    namespace: dict[str, Any] = {}
    exec(code, namespace)  # the docs' own example
    contract = namespace["contract"]
    assert contract.group_ids == ("full", "swa", "state")
    roundtrips(contract)


def test_the_api_reference_lists_the_module() -> None:
    api = ROOT / "docs" / "api"
    assert "<!-- tspd-api: tspd.layouts -->" in (api / "layouts.md").read_text(encoding="utf-8")
    assert "\nlayouts\n" in (api / "index.md").read_text(encoding="utf-8")
