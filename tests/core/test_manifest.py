"""Logical slots (docs/protocol.md#proto-logical-slots), block manifests
(docs/protocol.md#proto-manifest) and layerwise selection
(docs/protocol.md#proto-layerwise-selection)."""

from __future__ import annotations

import contextlib
import json
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
    Plane,
    PlanGroup,
    TransferSchema,
)
from tspd.core.errors import ContractError
from tspd.core.manifest import (
    MAX_MANIFEST_BYTES,
    BlockManifest,
    ManifestGroup,
    Selection,
    build_manifest,
    build_selection,
    logical_slots,
    parse_manifest,
    require_same_prompt_window,
    same_prompt_window,
    select_chunk,
    validate_manifest,
)
from tspd.testing.layouts import (
    allocate_tables,
    multi_layer_contract,
    room_manifest,
    simple_contract,
)


def spec(
    policy: str | None = "full_suffix",
    *,
    rows: int = 4,
    window: int | None = None,
    checkpoint: int | None = None,
) -> GroupSpec:
    return GroupSpec(
        group_id="g",
        retention="full_history" if window is None else "sliding_window",
        rows_per_page=None if checkpoint else rows,
        entry_stride_tokens=None if checkpoint else 1,
        sliding_window_tokens=window,
        family="state" if checkpoint else "history",
        transfer_policy=policy,  # type: ignore[arg-type]
        checkpoint_granularity=checkpoint,
    )


def grouped_contract(num_lcm_blocks: int = 31) -> CacheContract:
    """R-pd's `grouped_layout()` in the S1 schema: a history group of 2-token blocks
    and two latest-snapshot state groups checkpointing every 2 tokens."""
    parents = num_lcm_blocks + 1
    ids = ("history", "state-a", "state-b")
    plan = CacheMemoryPlan(
        prefix_granularity=2,
        lcm_block_bytes=32,
        num_lcm_blocks=num_lcm_blocks,
        groups=tuple(PlanGroup(g, 1, parents) for g in ids),
        planes=(Plane("p0", 32, 0),),
        fields=(
            FieldSpec("history", "layer.0.kv", "p0", (4,), "bfloat16", 0, 32),
            FieldSpec("state-a", "layer.2.state", "p0", (4,), "bfloat16", 8, 32),
            FieldSpec("state-b", "layer.4.state", "p0", (4,), "bfloat16", 16, 32),
        ),
    )
    specs = [
        GroupSpec("history", "full_history", 2, 1, None, "history", "full_suffix", None),
        *(
            GroupSpec(g, "full_history", None, None, None, "state", "latest_snapshot", 2)
            for g in ids[1:]
        ),
    ]
    return CacheContract(plan, tuple(specs), TransferSchema())


# -------------------------------------------- slots (docs/protocol.md#proto-logical-slots)


@pytest.mark.parametrize(
    ("group", "prefix", "prompt", "expected"),
    [
        (spec(), 0, 1, range(0, 1)),
        (spec(), 0, 4, range(0, 1)),
        (spec(), 0, 5, range(0, 2)),
        (spec(), 4, 9, range(1, 3)),
        (spec(), 8, 9, range(2, 3)),
        # Sliding window of 6 tokens: the window starts at token max(0, 20 - 6 + 1) = 15.
        (spec(window=6), 0, 20, range(3, 5)),
        (spec(window=6), 16, 20, range(4, 5)),
        (spec(window=100), 4, 20, range(1, 5)),
        (spec("latest_snapshot"), 0, 9, range(2, 3)),
        (spec("latest_snapshot"), 4, 8, range(1, 2)),
        (spec(None), 0, 1, range(0, 1)),
        (spec("latest_snapshot", checkpoint=64), 0, 200, range(3, 4)),
    ],
)
def test_logical_slots(group: GroupSpec, prefix: int, prompt: int, expected: range) -> None:
    assert logical_slots(group, prefix, prompt) == expected


# --------------------------------------------------------------------- manifest codec


def test_manifest_json_golden() -> None:
    manifest = BlockManifest((ManifestGroup("kv", (1, 2, 3)), ManifestGroup("state", (7,))), 4, 10)
    data = manifest.to_json()
    assert data == (
        b'{"groups":[{"group_id":"kv","block_ids":[1,2,3]},{"group_id":"state",'
        b'"block_ids":[7]}],"prefix_len":4,"prompt_len":10}'
    )
    assert parse_manifest(data) == manifest
    flagged = BlockManifest(manifest.groups, 4, 10, state_prefix_cached=False)
    assert flagged.to_json().endswith(b',"prompt_len":10,"state_prefix_cached":false}')
    assert parse_manifest(flagged.to_json()) == flagged
    assert manifest.block_ids("state") == (7,)
    with pytest.raises(ContractError, match="has no group 'x'"):
        manifest.block_ids("x")


def test_manifest_ignores_unknown_keys_and_null_flag() -> None:
    obj = {
        "prompt_len": 3,
        "groups": [{"block_ids": [5], "group_id": "g", "extra": 1}],
        "prefix_len": 0,
        "future": [1],
        "state_prefix_cached": None,
    }
    parsed = parse_manifest(json.dumps(obj, indent=1).encode())
    assert parsed == BlockManifest((ManifestGroup("g", (5,)),), 0, 3)
    assert parsed.state_prefix_cached is None


def test_manifest_encode_bound() -> None:
    big = BlockManifest((ManifestGroup("g", (123456,) * 400_000),), 0, 1)
    with pytest.raises(ContractError, match=r"^Cache block manifest exceeds 2097152 wire bytes$"):
        big.to_json()


@pytest.mark.parametrize("payload", [b"", b" " * (MAX_MANIFEST_BYTES + 1)])
def test_manifest_size_bounds(payload: bytes) -> None:
    with pytest.raises(
        ContractError, match=r"^Cache block manifest payload must be 1\.\.2097152 bytes$"
    ):
        parse_manifest(payload)


@pytest.mark.parametrize("payload", [b"{", b"\xc3\x28", b"nope", b"[" * 50_000, b"NaN"])
def test_manifest_not_json(payload: bytes) -> None:
    with pytest.raises(ContractError, match=r"^invalid Cache block manifest JSON$"):
        parse_manifest(payload)


@pytest.mark.parametrize("payload", [b"[]", b"0", b'"x"', b"null"])
def test_manifest_not_object(payload: bytes) -> None:
    with pytest.raises(
        ContractError, match=r"^Cache block manifest payload must be a JSON object$"
    ):
        parse_manifest(payload)


GOOD: dict[str, Any] = {
    "groups": [{"group_id": "g", "block_ids": [1, 2]}],
    "prefix_len": 0,
    "prompt_len": 5,
}


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda o: o.pop("groups"), "Cache block manifest is missing key 'groups'"),
        (lambda o: o.pop("prefix_len"), "Cache block manifest is missing key 'prefix_len'"),
        (lambda o: o.pop("prompt_len"), "Cache block manifest is missing key 'prompt_len'"),
        (
            lambda o: o["groups"][0].pop("group_id"),
            "Cache block manifest groups[0] is missing key 'group_id'",
        ),
        (
            lambda o: o["groups"][0].pop("block_ids"),
            "Cache block manifest groups[0] is missing key 'block_ids'",
        ),
        (lambda o: o.update(groups={}), "Cache block manifest key 'groups' must be an array"),
        (lambda o: o["groups"].append(3), "Cache block manifest groups[1] must be an object"),
        (
            lambda o: o["groups"][0].update(group_id=1),
            "Cache block manifest groups[0].group_id must be a string",
        ),
        (
            lambda o: o["groups"][0].update(block_ids=[1, 2.0]),
            "Cache block manifest groups[0].block_ids must be an array of integers",
        ),
        (
            lambda o: o["groups"][0].update(block_ids=[True]),
            "Cache block manifest groups[0].block_ids must be an array of integers",
        ),
        (
            lambda o: o["groups"][0].update(block_ids="1,2"),
            "Cache block manifest groups[0].block_ids must be an array of integers",
        ),
        (
            lambda o: o.update(prefix_len=-1),
            "Cache block manifest key 'prefix_len' must be a non-negative integer",
        ),
        (
            lambda o: o.update(prompt_len="5"),
            "Cache block manifest key 'prompt_len' must be a non-negative integer",
        ),
        (
            lambda o: o.update(prompt_len=False),
            "Cache block manifest key 'prompt_len' must be a non-negative integer",
        ),
        (
            lambda o: o.update(state_prefix_cached=0),
            "Cache block manifest key 'state_prefix_cached' must be a boolean",
        ),
    ],
)
def test_manifest_shape_errors(mutate: Any, message: str) -> None:
    obj = json.loads(json.dumps(GOOD))
    mutate(obj)
    with pytest.raises(ContractError) as info:
        parse_manifest(json.dumps(obj).encode())
    assert str(info.value) == message


# --------------------------------------------------------------------- validation

CONTRACT = multi_layer_contract(
    layers=2, num_pages=8, heads=2, head_dim=2, with_state_group=True, page_tokens=4
)


def manifest(
    kv: tuple[int, ...], state: tuple[int, ...], prefix: int, prompt: int
) -> BlockManifest:
    return BlockManifest((ManifestGroup("kv", kv), ManifestGroup("state", state)), prefix, prompt)


def test_valid_manifests() -> None:
    validate_manifest(manifest((1, 2, 3), (4,), 0, 10), CONTRACT, "destination")
    validate_manifest(manifest((2, 3), (8,), 4, 10), CONTRACT, "source")
    validate_manifest(manifest((8,), (1,), 8, 9), CONTRACT, "source")


@pytest.mark.parametrize("peer", ["destination", "source"])
@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (manifest((), (4,), 10, 10), "{peer} manifest requires prefix_len < prompt_len"),
        (manifest((1,), (4,), 12, 10), "{peer} manifest requires prefix_len < prompt_len"),
        (
            BlockManifest((ManifestGroup("state", (4,)), ManifestGroup("kv", (1, 2, 3))), 0, 10),
            "{peer} manifest group order disagrees with layout",
        ),
        (
            BlockManifest((ManifestGroup("kv", (1, 2, 3)),), 0, 10),
            "{peer} manifest group order disagrees with layout",
        ),
        (
            manifest((1, 2), (4,), 2, 10),
            "{peer} manifest prefix_len is not aligned to prefix_granularity",
        ),
        (
            manifest((1, 2), (4,), 0, 10),
            "{peer} manifest group 'kv' block count disagrees with its transfer policy",
        ),
        (
            manifest((1, 2, 3), (4, 5), 0, 10),
            "{peer} manifest group 'state' block count disagrees with its transfer policy",
        ),
        (manifest((1, 0, 3), (4,), 0, 10), "{peer} manifest group 'kv' has an out-of-bounds block"),
        (manifest((1, 9, 3), (4,), 0, 10), "{peer} manifest group 'kv' has an out-of-bounds block"),
        (
            manifest((1, 2, 3), (-1,), 0, 10),
            "{peer} manifest group 'state' has an out-of-bounds block",
        ),
    ],
)
def test_validate_manifest_rules(peer: Any, bad: BlockManifest, message: str) -> None:
    with pytest.raises(ContractError) as info:
        validate_manifest(bad, CONTRACT, peer)
    assert str(info.value) == message.format(peer=peer)


def test_validate_manifest_uses_virtual_block_count_for_sharded_groups() -> None:
    import dataclasses

    specs = tuple(
        dataclasses.replace(s, shard_count=2) if s.group_id == "kv" else s
        for s in CONTRACT.group_specs
    )
    sharded = CacheContract(CONTRACT.plan, specs, CONTRACT.transfer_schema)
    assert sharded.virtual_block_count("kv") == 17
    validate_manifest(manifest((1, 16, 9), (4,), 0, 10), sharded, "source")
    with pytest.raises(ContractError, match="out-of-bounds"):
        validate_manifest(manifest((1, 17, 9), (4,), 0, 10), sharded, "source")


# --------------------------------------------------------------------- building


def test_build_manifest_orders_groups_by_contract() -> None:
    tables = {"state": [0, 0, 7, 8], "kv": np.array([5, 6, 7, 0, 9])}
    built = build_manifest(CONTRACT, tables, 4, 10)
    assert built == manifest((6, 7), (7,), 4, 10)
    validate_manifest(built, CONTRACT, "destination")
    assert build_manifest(CONTRACT, tables, 0, 10, state_prefix_cached=True) == BlockManifest(
        (ManifestGroup("kv", (5, 6, 7)), ManifestGroup("state", (7,))), 0, 10, True
    )


@pytest.mark.parametrize(
    ("tables", "prefix", "prompt", "message"),
    [
        ({"kv": [1], "state": [1]}, 4, 4, "Cache-transfer PD requires prefix_len < prompt_len"),
        (
            {"kv": [1], "state": [1]},
            -4,
            4,
            "Cache-transfer PD requires a non-negative prefix_len, got -4",
        ),
        (
            {"kv": [1], "state": [1]},
            2,
            4,
            "Cache-transfer PD prefix_len must be aligned to prefix_granularity",
        ),
        (
            {"kv": [1]},
            0,
            4,
            "scheduler group IDs disagree with the Paged cache layout: missing=['state'], extra=[]",
        ),
        (
            {"kv": [1], "other": [1]},
            0,
            4,
            "scheduler group IDs disagree with the Paged cache layout: missing=['state'], "
            "extra=['other']",
        ),
        (
            {"kv": [1], "state": [1], "zz": [], "aa": []},
            0,
            4,
            "scheduler group IDs disagree with the Paged cache layout: missing=[], "
            "extra=['aa', 'zz']",
        ),
        ({"kv": [1, 2], "state": [1, 2, 3]}, 0, 10, "table 'kv' misses logical slot 2"),
        ({"kv": [1, 2, 3], "state": [1, 2]}, 0, 10, "table 'state' misses logical slot 2"),
        (
            {"kv": [1, 0, 3], "state": [1, 2, 3]},
            0,
            10,
            "table 'kv' logical slot 1 has invalid block ID 0",
        ),
        (
            {"kv": [1, 2, -1], "state": [1, 2, 3]},
            0,
            10,
            "table 'kv' logical slot 2 has invalid block ID -1",
        ),
        (
            {"kv": [1, 2, 3], "state": [1, 2, 9]},
            0,
            10,
            "table 'state' logical slot 2 has invalid block ID 9",
        ),
    ],
)
def test_build_manifest_rules(
    tables: dict[str, list[int]], prefix: int, prompt: int, message: str
) -> None:
    with pytest.raises(ContractError) as info:
        build_manifest(CONTRACT, tables, prefix, prompt)
    assert str(info.value) == message


@pytest.mark.parametrize("bad", [True, np.True_])
def test_a_bool_is_not_a_block_id(bad: object) -> None:
    # int(True) == 1, a valid page; a bool is refused like an id out of range.
    tables: Any = {"kv": [1, bad, 3], "state": [1, 2, 3]}
    with pytest.raises(ContractError) as info:
        build_manifest(CONTRACT, tables, 0, 10)
    assert str(info.value) == f"table 'kv' logical slot 1 has invalid block ID {bad}"
    assert build_manifest(CONTRACT, {"kv": np.array([1, 2, 3]), "state": [1, 2, 3]}, 0, 10) == (
        manifest((1, 2, 3), (3,), 0, 10)
    )
    blocks: Any = (1, bad, 3)
    with pytest.raises(ContractError, match=r"^destination manifest group 'kv' has an out-of"):
        validate_manifest(manifest(blocks, (4,), 0, 10), CONTRACT, "destination")


def test_padding_outside_the_window_is_not_read() -> None:
    # Slots before the window (Decode's prefix) may hold padding.
    assert build_manifest(CONTRACT, {"kv": [-1, 0, 3], "state": [0, 0, 5]}, 8, 10) == manifest(
        (3,), (5,), 8, 10
    )


def test_prompt_windows() -> None:
    a = manifest((1,), (2,), 0, 4)
    assert same_prompt_window(a, manifest((5,), (6,), 0, 4))
    assert not same_prompt_window(a, manifest((5,), (6,), 0, 3))
    assert not same_prompt_window(a, manifest((5, 6), (6,), 4, 8))
    flagged = BlockManifest(a.groups, 0, 4, state_prefix_cached=False)
    assert not same_prompt_window(a, flagged)
    require_same_prompt_window([a])
    require_same_prompt_window([a, manifest((9,), (9,), 0, 4)])
    with pytest.raises(
        ContractError, match=r"^Cache-transfer destinations disagree on the prompt window$"
    ):
        require_same_prompt_window([a, a, flagged])


# --------------------------------------------------------------------- selection


def _history(selection: Selection | None) -> tuple[bool, tuple[int, ...], tuple[int, ...]]:
    assert selection is not None
    group = selection.group("history")
    return selection.is_final, group.source_block_ids, group.destination_positions


def test_r_pd_whole_prompt_chunk_sends_state_slots() -> None:
    """R-pd `a_forward_arms_a_chunk_per_destined_row_only_when_every_row_plans`."""
    contract = grouped_contract()
    rows = [
        {"history": [1, 2], "state-a": [5, 6], "state-b": [9, 10]},
        {"history": [3, 4], "state-a": [7, 8], "state-b": [11, 12]},
    ]
    window = BlockManifest((), 0, 4)
    picked = [select_chunk(contract, row, window, 0, 4, first=True) for row in rows]
    assert [s.group("state-a").source_block_ids for s in picked if s] == [(6,), (8,)]
    assert [s.is_final for s in picked if s] == [True, True]
    assert _history(picked[0]) == (True, (1, 2), (0, 1))
    rows[1]["history"][0] = 0
    with pytest.raises(ContractError, match="invalid block ID"):
        select_chunk(contract, rows[1], window, 0, 4, first=True)


def test_r_pd_first_chunk_carries_a_deeper_prefill_cache_hit() -> None:
    """R-pd `a_rooms_first_chunk_carries_a_deeper_prefill_cache_hit`: Decode holds 2
    tokens of the 9-token prompt, Prefill's own cache 4."""
    contract = grouped_contract()
    tables = {"history": [1, 2, 3, 4, 5], "state-a": [6, 7, 8, 9, 10], "state-b": [11] * 5}
    window = BlockManifest((), 2, 9)
    first = select_chunk(contract, tables, window, 4, 7, first=True)
    assert _history(first) == (False, (2, 3), (0, 1))
    assert first is not None
    assert first.group("state-a").source_block_ids == ()
    last = select_chunk(contract, tables, window, 7, 9, first=False)
    assert _history(last) == (True, (4, 5), (2, 3))
    assert last is not None
    assert last.group("state-a").source_block_ids == (10,)
    assert last.group("state-a").destination_positions == (0,)


def test_selection_skips_only_empty_non_final_chunks() -> None:
    contract = grouped_contract()
    tables = {"history": [1, 2, 3, 4, 5], "state-a": [6] * 5, "state-b": [7] * 5}
    window = BlockManifest((), 0, 9)
    # [2, 3) completes no 2-token block.
    assert select_chunk(contract, tables, window, 2, 3, first=False) is None
    # The final chunk is never skipped, even if it completes nothing new for history.
    final = select_chunk(contract, tables, window, 8, 9, first=False)
    assert final is not None
    assert final.is_final
    assert _history(final) == (True, (5,), (4,))
    with pytest.raises(
        ContractError, match=r"^Cache-transfer Prefill chunk extends past Decode's prompt manifest$"
    ):
        select_chunk(contract, tables, window, 8, 10, first=False)


@pytest.mark.parametrize(
    ("prefix", "prompt", "start", "end", "message"),
    [
        (1, 9, 2, 4, "Cache-transfer PD prefix_len must be aligned to prefix_granularity"),
        (-2, 9, 2, 4, "layerwise selection requires a non-negative prefix_len, got -2"),
        (10, 9, 2, 4, "layerwise selection requires prefix_len < prompt_len"),
        (0, 9, 4, 4, "layerwise selection requires chunk_start < chunk_end"),
        (0, 9, 4, 10, "layerwise selection requires chunk_end <= prompt_len"),
    ],
)
def test_selection_preconditions(
    prefix: int, prompt: int, start: int, end: int, message: str
) -> None:
    tables = {"history": [1, 2, 3, 4, 5], "state-a": [6] * 5, "state-b": [7] * 5}
    with pytest.raises(ContractError) as info:
        build_selection(grouped_contract(), tables, prefix, prompt, start, end)
    assert str(info.value) == message


def test_selection_table_checks() -> None:
    contract = grouped_contract()
    with pytest.raises(ContractError, match="missing=\\['state-b'\\], extra=\\[\\]"):
        build_selection(contract, {"history": [1], "state-a": [1]}, 0, 4, 0, 4)
    with pytest.raises(ContractError, match=r"^table 'history' misses logical slot 1$"):
        build_selection(
            contract, {"history": [1], "state-a": [1, 2], "state-b": [1, 2]}, 0, 4, 0, 4
        )


def test_sliding_group_selection_starts_at_the_window() -> None:
    contract = multi_layer_contract(
        layers=1, num_pages=16, heads=1, head_dim=1, page_tokens=4, sliding_window_tokens=8
    )
    tables = {"kv": list(range(1, 9))}
    # Prompt 30: the window starts at token 23 (slot 5); slots 5..7.
    full = build_manifest(contract, tables, 0, 30)
    assert full.block_ids("kv") == (6, 7, 8)
    early = build_selection(contract, tables, 0, 30, 0, 16)
    assert early.group("kv").destination_positions == ()
    mid = build_selection(contract, tables, 0, 30, 16, 28)
    assert mid.group("kv").source_block_ids == (6, 7)
    assert mid.group("kv").destination_positions == (0, 1)
    last = build_selection(contract, tables, 0, 30, 28, 30)
    assert last.group("kv").source_block_ids == (8,)
    assert last.group("kv").destination_positions == (2,)


# --------------------------------------------------------------------- properties


@st.composite
def windows(draw: st.DrawFn) -> tuple[CacheContract, int, int, int, list[int]]:
    """A contract, Decode's window, Prefill's own cache hit and chunk boundaries."""
    page_tokens = draw(st.sampled_from([1, 2, 4]))
    contract = multi_layer_contract(
        layers=1,
        num_pages=64,
        heads=1,
        head_dim=1,
        page_tokens=page_tokens,
        prefix_granularity=page_tokens * draw(st.sampled_from([1, 2])),
        with_state_group=True,
        sliding_window_tokens=draw(st.none() | st.integers(1, 40)),
    )
    grain = contract.plan.prefix_granularity
    prompt = draw(st.integers(1, 60))
    prefix = grain * draw(st.integers(0, (prompt - 1) // grain))
    own = draw(st.integers(0, prompt - 1))
    cuts = sorted({*draw(st.lists(st.integers(own + 1, prompt), max_size=6)), prompt})
    return contract, prefix, prompt, own, cuts


@given(windows(), st.randoms(use_true_random=False))
def test_chunk_selections_partition_the_manifest(
    case: tuple[CacheContract, int, int, int, list[int]], rng: Any
) -> None:
    """However a prompt is chunked, the chunks' selections send every block of the
    source manifest exactly once, at its position in Decode's manifest."""
    contract, prefix, prompt, own, cuts = case
    tables = allocate_tables(contract, prompt, 0, rng=rng, contiguous=False)
    source = build_manifest(contract, tables, prefix, prompt)
    validate_manifest(source, contract, "source")
    window = BlockManifest((), prefix, prompt)
    sent: dict[str, list[tuple[int, int]]] = {gid: [] for gid in contract.group_ids}
    begin = own
    for n, end in enumerate(cuts):
        selection = select_chunk(contract, tables, window, begin, end, first=n == 0)
        begin = end
        if selection is None:
            continue
        assert selection.is_final == (end == prompt)
        for group in selection.groups:
            sent[group.group_id].extend(
                zip(group.destination_positions, group.source_block_ids, strict=True)
            )
    for group in source.groups:
        assert sent[group.group_id] == list(enumerate(group.block_ids))


@given(
    st.lists(
        st.tuples(st.text(max_size=5), st.lists(st.integers(-(2**63), 2**63), max_size=5)),
        max_size=4,
    ),
    st.integers(0, 2**40),
    st.integers(0, 2**40),
    st.none() | st.booleans(),
)
def test_manifest_round_trip(
    groups: list[tuple[str, list[int]]], prefix: int, prompt: int, flag: bool | None
) -> None:
    m = BlockManifest(
        tuple(ManifestGroup(g, tuple(ids)) for g, ids in groups), prefix, prompt, flag
    )
    data = m.to_json()
    assert data.isascii()
    assert parse_manifest(data) == m
    assert parse_manifest(data).to_json() == data


class _Five(int):
    """An int subclass whose ``str`` is not its JSON form."""

    def __str__(self) -> str:
        return "five"


def _dumps_reference(m: BlockManifest) -> bytes:
    obj: dict[str, Any] = {
        "groups": [{"group_id": g.group_id, "block_ids": list(g.block_ids)} for g in m.groups],
        "prefix_len": m.prefix_len,
        "prompt_len": m.prompt_len,
    }
    if m.state_prefix_cached is not None:
        obj["state_prefix_cached"] = m.state_prefix_cached
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=True).encode("ascii")


_ODD_IDS = st.integers(-(2**70), 2**70) | st.booleans() | st.builds(_Five, st.integers(0, 9))


@given(
    st.lists(
        st.tuples(
            st.text(max_size=6),
            st.lists(st.integers(0, 2**63), max_size=40) | st.lists(_ODD_IDS, max_size=40),
        ),
        max_size=3,
    ),
    st.integers(0, 2**40) | st.booleans(),
    st.integers(0, 2**40),
    st.none() | st.booleans() | st.integers(0, 1),
)
def test_manifest_json_is_what_json_dumps_writes(
    groups: list[tuple[str, list[Any]]], prefix: Any, prompt: int, flag: Any
) -> None:
    """to_json writes short id lists itself: the bytes are json.dumps's for any
    value (int subclasses, bools, unicode group ids, ids past 64 bits, long lists)."""
    m = BlockManifest(
        tuple(ManifestGroup(g, tuple(ids)) for g, ids in groups), prefix, prompt, flag
    )
    assert m.to_json() == _dumps_reference(m)


def test_manifest_json_of_numpy_ids_fails_as_json_dumps_does() -> None:
    m = BlockManifest((ManifestGroup("g", (np.int64(5),)),), 0, 1)
    with pytest.raises(TypeError, match="int64 is not JSON serializable"):
        m.to_json()


@given(st.binary(max_size=256))
def test_any_bytes_parse_or_raise_contract_error(data: bytes) -> None:
    with contextlib.suppress(ContractError):
        parse_manifest(data)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=4),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)


@given(
    st.dictionaries(
        st.sampled_from(["groups", "prefix_len", "prompt_len", "state_prefix_cached", "x"]),
        json_values,
    )
)
def test_any_json_object_parses_or_raises_contract_error(obj: dict[str, Any]) -> None:
    with contextlib.suppress(ContractError):
        parsed = parse_manifest(json.dumps(obj).encode())
        assert parse_manifest(parsed.to_json()) == parsed
        with contextlib.suppress(ContractError):
            validate_manifest(parsed, CONTRACT, "destination")


def test_room_manifest_helper_is_valid() -> None:
    m = room_manifest(CONTRACT, 10, 4)
    validate_manifest(m, CONTRACT, "destination")
    assert m == manifest((1, 2), (1,), 4, 10)


def test_a_huge_prompt_len_from_a_peer_is_a_contract_error_not_an_overflow() -> None:
    from tspd.core.errors import ContractError
    from tspd.core.manifest import parse_manifest, validate_manifest
    from tspd.testing.layouts import simple_contract

    contract = simple_contract(num_pages=8, page_bytes=64)
    group = contract.group_ids[0]
    payload = (
        f'{{"groups":[{{"group_id":"{group}","block_ids":[1,2]}}],"prefix_len":0,'
        '"prompt_len":1180591620717411303424}'
    ).encode()
    manifest = parse_manifest(payload)
    with pytest.raises(ContractError, match="block count disagrees"):
        validate_manifest(manifest, contract, "destination")


def _read_one_by_one(table: Any, slots: range, bound: int) -> tuple[int, ...] | str:
    """The definition: every slot's value, an integer that is not a bool, in (0, bound)."""
    ids = []
    for slot in slots:
        raw = table[slot]
        if isinstance(raw, bool | np.bool_) or not 0 < int(raw) < bound:
            return f"table 'full' logical slot {slot} has invalid block ID {raw}"
        ids.append(int(raw))
    return tuple(ids)


#: 64 pages of one group: rows of up to 40 slots, enough for the fast read.
_WIDE = simple_contract(num_pages=64, page_bytes=64)


@given(
    ids=st.lists(st.integers(1, 63), min_size=40, max_size=40),
    corrupt=st.lists(
        st.tuples(
            st.integers(0, 39),
            st.one_of(st.integers(-3, 100), st.booleans(), st.integers(0, 70).map(np.int64)),
        ),
        max_size=2,
    ),
    form=st.sampled_from(["list", "tuple", "int64", "int32", "uint16", "bool"]),
    pages=st.integers(1, 40),
)
def test_a_row_reads_the_same_in_every_form(
    ids: list[Any], corrupt: list[tuple[int, Any]], form: str, pages: int
) -> None:
    """Lists, tuples and integer arrays are read at C speed when every id is plain
    and in range (rows of 16 slots or more); whatever they hold, the result or the
    error is the one-by-one definition's."""
    values: list[Any] = list(ids)
    for at, value in corrupt:
        values[at] = value
    if form in ("list", "tuple"):
        table: Any = list(values) if form == "list" else tuple(values)
    else:
        raw = [int(v) for v in values]
        if form in ("uint16", "bool") and min(raw) < 0:
            return
        table = np.array(raw, dtype=form)
    tokens = pages * _WIDE.group("full").rows_per_page
    slots = logical_slots(_WIDE.group("full"), 0, tokens)
    want = _read_one_by_one(table, slots, _WIDE.virtual_block_count("full"))
    if isinstance(want, str):
        with pytest.raises(ContractError) as info:
            build_manifest(_WIDE, {"full": table}, 0, tokens)
        assert str(info.value) == want
    else:
        built = build_manifest(_WIDE, {"full": table}, 0, tokens)
        assert built.groups[0].block_ids == want


@given(
    ids=st.lists(st.integers(1, 63), min_size=1, max_size=40),
    corrupt=st.lists(
        st.tuples(
            st.integers(0, 39),
            st.one_of(st.integers(-3, 100), st.booleans(), st.integers(-2, 70).map(np.int64)),
        ),
        max_size=2,
    ),
)
def test_validate_manifest_bounds_every_id_as_one_by_one(
    ids: list[Any], corrupt: list[tuple[int, Any]]
) -> None:
    """Plain-int rows are bounds-checked at C speed, anything else id by id: the
    verdict is the one-by-one definition's either way (a bool is never an id)."""
    values: list[Any] = list(ids)
    for at, value in corrupt:
        if at < len(values):
            values[at] = value
    bound = _WIDE.virtual_block_count("full")
    bad = any(isinstance(v, bool | np.bool_) or not 0 < v < bound for v in values)
    tokens = len(values) * _WIDE.group("full").rows_per_page
    row = BlockManifest((ManifestGroup("full", tuple(values)),), 0, tokens)
    if bad:
        with pytest.raises(ContractError, match=r"has an out-of-bounds block$"):
            validate_manifest(row, _WIDE, "source")
    else:
        validate_manifest(row, _WIDE, "source")
