"""Staged transfers: the slot pool, the blob format, room bounds and the full
gather → write → check → scatter path, checked through the real planner and the
interop pattern of the host arenas."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tspd.core.contract import (
    CacheContract,
    CacheMemoryPlan,
    FieldSpec,
    GroupSpec,
    PageIndexError,
    Plane,
    PlanGroup,
    check_local_contract,
)
from tspd.core.copies import CopyPlan, coalesce, plan_copies
from tspd.core.errors import WireError
from tspd.core.manifest import BlockManifest, ManifestGroup, build_manifest
from tspd.core.planner import RoutePlanner, plan_registration
from tspd.core.staging import (
    BLOB_ENTRY_BYTES,
    BLOB_HEADER_BYTES,
    BLOB_MAGIC,
    MAX_BLOB_OFFSET,
    SlotPool,
    blob_data_pad,
    blob_length,
    check_within,
    gather_blob,
    gather_blob_parts,
    read_blob_table,
    room_ranges,
    scatter_blob,
)
from tspd.shell.arena import HostArena, clear_room, fill_room, iter_room_blocks, verify_room
from tspd.testing.layouts import (
    PageAllocator,
    multi_layer_contract,
    room_manifest,
    simple_contract,
)

I64 = np.int64


def i64(values: Sequence[int]) -> np.ndarray:
    return np.asarray(values, dtype=I64)


# --------------------------------------------------------------------------- SlotPool


def test_pool_rejects_bad_geometry_and_lengths() -> None:
    with pytest.raises(ValueError, match="size"):
        SlotPool(-1)
    for align in (0, 3, 4095, -4096):
        with pytest.raises(ValueError, match="power of two"):
            SlotPool(1 << 20, align=align)
    pool = SlotPool(1 << 20)
    with pytest.raises(ValueError, match="at least 1 byte"):
        pool.alloc(0)
    with pytest.raises(ValueError, match="offset 4096"):
        pool.free(4096)


def test_pool_first_fit_rounding_and_coalescing() -> None:
    pool = SlotPool(10 * 4096 + 100)
    a = pool.alloc(1)
    b = pool.alloc(4097)
    c = pool.alloc(4096)
    assert (a, b, c) == (0, 4096, 3 * 4096)
    assert a is not None
    assert b is not None
    assert c is not None
    assert pool.used == 4 * 4096
    assert pool.slots == 3
    pool.free(b)
    # The 8 KiB hole at 4096 is the first that fits a 1-byte slot.
    assert pool.alloc(10) == 4096
    # 6 pages + 100 bytes remain at the tail: 7 pages do not fit anywhere.
    assert pool.largest_free == 6 * 4096 + 100
    assert pool.alloc(6 * 4096 + 1) is None
    assert pool.alloc(6 * 4096) == 4 * 4096
    assert pool.largest_free == 4096
    for offset in (a, 4096, c, 4 * 4096):
        pool.free(offset)
    assert pool.holes() == [(0, 10 * 4096 + 100)]
    assert pool.used == 0
    assert pool.slots == 0
    with pytest.raises(ValueError, match="already freed"):
        pool.free(a)


def test_empty_and_tiny_pools_never_allocate() -> None:
    assert SlotPool(0).alloc(1) is None
    assert SlotPool(0).largest_free == 0
    tiny = SlotPool(4095)
    assert tiny.alloc(1) is None
    assert SlotPool(4095, align=1).alloc(4095) == 0


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(1, 40_000)),
        st.tuples(st.just("free"), st.integers(0, 1 << 30)),
    ),
    max_size=80,
)


@given(
    size=st.integers(0, 200_000),
    align_log=st.integers(0, 13),
    ops=_OPS,
    release_order=st.randoms(use_true_random=False),
)
def test_pool_matches_a_simple_model(
    size: int, align_log: int, ops: list[tuple[str, int]], release_order: random.Random
) -> None:
    align = 1 << align_log
    pool = SlotPool(size, align=align)
    held: dict[int, int] = {}  # offset -> rounded length

    def holes_of_model() -> list[tuple[int, int]]:
        holes, at = [], 0
        for offset in sorted(held):
            if offset > at:
                holes.append((at, offset - at))
            at = offset + held[offset]
        if size > at:
            holes.append((at, size - at))
        return holes

    for op, value in ops:
        if op == "alloc":
            need = -(-value // align) * align
            expected = next((start for start, n in holes_of_model() if n >= need), None)
            got = pool.alloc(value)
            assert got == expected  # first fit, and None only when no hole holds it
            if got is not None:
                assert got % align == 0
                assert got + need <= size
                held[got] = need
        elif held:
            offset = sorted(held)[value % len(held)]
            pool.free(offset)
            del held[offset]
        # Invariants: no overlap, inside the buffer, accounting, full coalescing.
        spans = sorted(held.items())
        for (o1, n1), (o2, _) in itertools.pairwise(spans):
            assert o1 + n1 <= o2
        assert all(o + n <= size for o, n in spans)
        assert pool.used == sum(held.values())
        assert pool.slots == len(held)
        assert pool.holes() == holes_of_model()
        assert pool.largest_free == max((n for _, n in holes_of_model()), default=0)
    offsets = list(held)
    release_order.shuffle(offsets)
    for offset in offsets:
        pool.free(offset)
    assert pool.holes() == ([(0, size)] if size else [])
    assert pool.used == 0
    assert pool.largest_free == size


# --------------------------------------------------------------------------- blobs


def _blob(
    source: np.ndarray, src: Sequence[int], dst: Sequence[int], lengths: Sequence[int]
) -> np.ndarray:
    out = np.zeros(blob_length(len(lengths), sum(lengths)), dtype=np.uint8)
    assert gather_blob(out, source, i64(src), i64(dst), i64(lengths)) == len(out)
    return out


def _header(count: int) -> bytes:
    return BLOB_MAGIC + count.to_bytes(8, "little")


def _raw(count: int, entries: Sequence[tuple[int, int]], data: bytes) -> np.ndarray:
    body = b"".join(d.to_bytes(8, "little") + n.to_bytes(8, "little") for d, n in entries)
    return np.frombuffer(_header(count) + body + data, dtype=np.uint8).copy()


def test_blob_layout_is_header_table_then_data() -> None:
    source = np.arange(256, dtype=np.uint8)
    blob = _blob(source, [10, 200], [4096, 77], [3, 2])
    assert blob_length(2, 5) == BLOB_HEADER_BYTES + 2 * BLOB_ENTRY_BYTES + 5 == len(blob)
    assert blob[:16].tobytes() == b"tspd-stg" + (2).to_bytes(8, "little")
    table = blob[16:48].view("<u8").tolist()
    assert table == [4096, 3, 77, 2]
    assert blob[48:].tolist() == [10, 11, 12, 200, 201]
    dst, lengths = read_blob_table(blob, len(blob), len(blob))
    assert dst.tolist() == [4096, 77]
    assert lengths.tolist() == [3, 2]
    assert dst.dtype == I64
    assert lengths.dtype == I64
    # Copies: a peer overwriting the slot later does not change the table read.
    blob[16:24] = 0
    assert dst.tolist() == [4096, 77]


def test_empty_blob_round_trips() -> None:
    out = np.full(64, 7, dtype=np.uint8)
    assert gather_blob(out, np.zeros(8, np.uint8), i64([]), i64([]), i64([])) == 16
    assert out[16:].tolist() == [7] * 48  # bytes past the blob are left alone
    dst, lengths = read_blob_table(out, 16, 64)
    assert len(dst) == len(lengths) == 0
    check_within(dst, lengths, i64([]), i64([]))
    scatter_blob(out, dst, lengths, np.zeros(8, np.uint8))


def test_gather_checks_every_range_before_copying() -> None:
    source = np.arange(100, dtype=np.uint8)
    out = np.zeros(1024, dtype=np.uint8)
    cases = [
        (([0, 95], [0, 0], [4, 6]), "reads bytes 95..100, outside the 100-byte source"),
        (([0, -1], [0, 0], [4, 1]), "reads bytes -1..-1"),
        (([0, 1], [0, 0], [4, 0]), "range 1 has length 0"),
        (([0], [-5], [4]), "destination offset -5..-2"),
        (([0], [MAX_BLOB_OFFSET - 4], [4]), "outside \\[0, 2\\*\\*62\\)"),
    ]
    for (src, dst, lengths), message in cases:
        with pytest.raises(ValueError, match=message):
            gather_blob(out, source, i64(src), i64(dst), i64(lengths))
        assert not out.any()
    with pytest.raises(ValueError, match="holds 51 bytes, but the blob of 2 ranges needs 52"):
        gather_blob(out[:51], source, i64([0, 1]), i64([0, 9]), i64([2, 2]))
    with pytest.raises(ValueError, match="differ in length"):
        gather_blob(out, source, i64([0, 1]), i64([0]), i64([2, 2]))
    read_only = out.copy()
    read_only.setflags(write=False)
    with pytest.raises(ValueError, match="read-only"):
        gather_blob(read_only, source, i64([0]), i64([0]), i64([1]))
    assert not out.any()


def _reject(blob: np.ndarray, staged_len: int, slot_len: int, fragment: str) -> None:
    with pytest.raises(WireError, match=fragment) as info:
        read_blob_table(blob, staged_len, slot_len)
    assert str(info.value).startswith("staged blob ")


def test_hostile_blobs_are_refused_with_what_is_wrong() -> None:
    good = _raw(2, [(0, 3), (100, 2)], b"abcde")
    n = len(good)
    assert [a.tolist() for a in read_blob_table(good, n, n)] == [[0, 100], [3, 2]]
    _reject(good, 15, n, "of 15 bytes is outside the 16..53 bytes")
    _reject(good, n, n - 1, "of 53 bytes is outside the 16..52 bytes its slot allows")
    _reject(good, n + 1, 1 << 20, f"of 54 bytes is longer than its {n}-byte buffer")
    _reject(good[:10], 16, 16, "longer than its 10-byte buffer")
    wrong = good.copy()
    wrong[:8] = np.frombuffer(b"tspd-stG", np.uint8)
    _reject(wrong, n, n, "starts with b'tspd-stG', not the magic")
    _reject(_raw(3, [(0, 3), (100, 2)], b"abcde"), n, n, "claims 3 entries, whose table")
    _reject(_raw(1 << 63, [], b""), 16, 16, f"claims {1 << 63} entries")
    _reject(_raw(2, [(0, 3), (100, 0)], b"abcde"), n, n, "entry 1 has length 0")
    _reject(_raw(2, [(0, 3), (100, 3)], b"abcde"), n, n, "sum to 6 bytes, but carries 5 data")
    _reject(_raw(2, [(0, 2), (100, 2)], b"abcde"), n, n, "sum to 4 bytes, but carries 5 data")
    _reject(_raw(1, [(0, 3)], b"abcde"), 16 + 16 + 5, 64, "sum to 3 bytes, but carries 5")
    _reject(_raw(0, [], b"ab"), 18, 18, "has 0 entries whose lengths sum to 0 bytes")
    _reject(_raw(1, [(0, 6)], b"abcde"), 37, 37, "length 6, more than the 5 data bytes")
    _reject(_raw(2, [(1 << 62, 3), (0, 2)], b"abcde"), n, n, "entry 0 writes bytes")
    _reject(_raw(1, [((1 << 62) - 2, 5)], b"abcde"), 37, 37, "beyond offset 2\\*\\*62")
    # Lengths whose uint64 sum wraps around to the data size are still refused.
    wrap = [(0, 3), (0, 1 << 63), (0, (1 << 63) + 2)]
    blob = _raw(3, wrap, b"abcde")
    _reject(blob, len(blob), len(blob), f"entry 1 has length {1 << 63}, more than the 5")
    wraps = [(0, (1 << 61) - 1)] * 8 + [(0, 13)]
    blob = _raw(9, wraps, bytes(5))
    _reject(blob, len(blob), len(blob), "entry 0 has length")


@given(data=st.binary(max_size=200), staged_len=st.integers(-5, 260), slot_len=st.integers(0, 260))
def test_arbitrary_bytes_parse_consistently_or_raise_wire_error(
    data: bytes, staged_len: int, slot_len: int
) -> None:
    _check_parse(np.frombuffer(data, dtype=np.uint8), staged_len, slot_len)


@given(
    entries=st.lists(st.tuples(st.integers(0, (1 << 64) - 1), st.integers(0, 40)), max_size=6),
    count_delta=st.integers(-2, 2),
    data_delta=st.integers(-3, 3),
    flips=st.lists(st.tuples(st.integers(0, 400), st.integers(0, 255)), max_size=3),
)
def test_near_valid_blobs_parse_consistently_or_raise_wire_error(
    entries: list[tuple[int, int]],
    count_delta: int,
    data_delta: int,
    flips: list[tuple[int, int]],
) -> None:
    count = max(0, len(entries) + count_delta)
    data = bytes(max(0, sum(n for _, n in entries) + data_delta))
    blob = _raw(count, entries, data)
    for at, value in flips:
        if at < len(blob):
            blob[at] = value
    _check_parse(blob, len(blob), len(blob) + 8)


def _check_parse(blob: np.ndarray, staged_len: int, slot_len: int) -> None:
    refused: str | None = None
    try:
        dst, lengths = read_blob_table(blob, staged_len, slot_len)
    except WireError as err:
        refused = str(err)
    if refused is not None:
        assert refused.startswith("staged blob ")
        return
    n = len(lengths)
    assert 16 <= staged_len <= min(slot_len, len(blob))
    assert blob[:8].tobytes() == BLOB_MAGIC
    assert int.from_bytes(blob[8:16].tobytes(), "little") == n
    assert blob_length(n, int(lengths.sum())) == staged_len
    assert (lengths >= 1).all()
    assert (dst >= 0).all()
    assert (dst + lengths < MAX_BLOB_OFFSET).all()
    assert dst.tolist() == blob[16 : 16 + 16 * n].view("<u8")[0::2].tolist()


# --------------------------------------------------------------------------- room bounds


def _padded_contract(num_pages: int = 20) -> CacheContract:
    """One group, two fields in one plane with spare bytes after each (pages of a
    field are never adjacent), plus a second group with a single packed field."""
    stride = 96
    plan = CacheMemoryPlan(
        prefix_granularity=4,
        lcm_block_bytes=stride + 32,
        num_lcm_blocks=num_pages,
        groups=(PlanGroup("a", 1, num_pages + 1), PlanGroup("b", 1, num_pages + 1)),
        planes=(Plane("pa", stride, 0), Plane("pb", 32, stride * (num_pages + 1))),
        fields=(
            FieldSpec("a", "layer.0.k", "pa", (10,), "float32", 0, stride),
            FieldSpec("a", "layer.0.v", "pa", (4, 4), "bfloat16", 48, stride),
            FieldSpec("b", "layer.0.s", "pb", (32,), "uint8", 0, 32),
        ),
    )
    spec = GroupSpec("a", "full_history", 4, 1, None, "history", "full_suffix", None)
    state = GroupSpec("b", "full_history", None, None, None, "state", "latest_snapshot", 4)
    contract = CacheContract(plan, (spec, state))
    check_local_contract(contract)
    return contract


def _contracts() -> list[CacheContract]:
    return [
        simple_contract(num_pages=32, page_bytes=256),
        multi_layer_contract(layers=2, num_pages=24, heads=2, head_dim=4),
        multi_layer_contract(
            layers=3, num_pages=24, heads=2, head_dim=4, with_state_group=True, state_dim=3
        ),
        multi_layer_contract(
            layers=1, num_pages=24, heads=1, head_dim=8, sliding_window_tokens=9, page_tokens=4
        ),
        _padded_contract(),
    ]


def _mask(size: int, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    mask = np.zeros(size, dtype=bool)
    for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
        mask[a:b] = True
    return mask


@pytest.mark.parametrize("which", range(len(_contracts())))
@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_room_ranges_are_exactly_the_bytes_the_arena_helpers_touch(
    which: int, contiguous: bool, seed: int
) -> None:
    contract = _contracts()[which]
    prompt_len = random.Random(seed).randint(1, 60)
    manifest = room_manifest(contract, prompt_len, rng=random.Random(seed), contiguous=contiguous)
    starts, ends = room_ranges(contract, manifest)
    assert starts.dtype == ends.dtype == I64
    # Sorted, disjoint and not touching (merged), each non-empty.
    assert (starts < ends).all()
    assert (ends[:-1] < starts[1:]).all()
    expected = sum(f.payload_bytes for _, f, _, _ in iter_room_blocks(contract, manifest))
    assert int((ends - starts).sum()) == expected
    with HostArena.for_contract(contract) as arena:
        mask = _mask(arena.size, starts, ends)
        # clear_room zeroes exactly the room's payloads: on a 0xFF arena the zeroed
        # bytes are the room's bytes, byte for byte.
        arena.array[:] = 0xFF
        clear_room(arena, contract, manifest)
        assert np.array_equal(arena.array == 0, mask)
        # fill_room writes only inside, and as many bytes as the ranges hold.
        arena.array[:] = 0
        assert fill_room(arena, contract, manifest, seed=seed, room=5) == expected
        assert not arena.array[~mask].any()


def test_room_ranges_merge_adjacent_pages_and_keep_gaps() -> None:
    contract = simple_contract(num_pages=16, page_bytes=256)
    manifest = BlockManifest((ManifestGroup("full", (3, 4, 5, 9, 8)),), 0, 80)
    starts, ends = room_ranges(contract, manifest)
    off = contract.page_offset("layer.0.kv", 0)
    assert starts.tolist() == [off + 3 * 256, off + 8 * 256]
    assert ends.tolist() == [off + 6 * 256, off + 10 * 256]
    padded = _padded_contract()
    starts, ends = room_ranges(padded, BlockManifest((ManifestGroup("a", (2, 3)),), 0, 8))
    k, v = padded.field("layer.0.k"), padded.field("layer.0.v")
    pages = [(padded.page_offset(f, p), f.payload_bytes) for p in (2, 3) for f in (k, v)]
    assert list(zip(starts.tolist(), ends.tolist(), strict=True)) == sorted(
        (a, a + n) for a, n in pages
    )
    empty = room_ranges(padded, BlockManifest((ManifestGroup("a", ()),), 0, 8))
    assert [len(a) for a in empty] == [0, 0]


def test_room_ranges_refuses_ids_that_are_not_this_ranks_pages() -> None:
    contract = simple_contract(num_pages=4, page_bytes=64)
    for bad in (5, -1):
        with pytest.raises(PageIndexError, match=f"page_id {bad} outside \\[0, 5\\)"):
            room_ranges(contract, BlockManifest((ManifestGroup("full", (1, bad)),), 0, 32))
    with pytest.raises(PageIndexError, match="not all 64-bit"):
        room_ranges(contract, BlockManifest((ManifestGroup("full", (1, True)),), 0, 32))


def test_check_within_names_the_first_entry_outside() -> None:
    starts, ends = i64([100, 300]), i64([200, 400])
    check_within(i64([100, 150, 300, 399]), i64([100, 50, 100, 1]), starts, ends)
    cases = [
        (i64([100, 199]), i64([10, 2]), "entry 1 writes bytes 199..200 of the arena"),
        (i64([150, 99]), i64([1, 1]), "entry 1 writes bytes 99..99"),
        (i64([150]), i64([200]), "entry 0 writes bytes 150..349"),  # spans a gap
        (i64([250]), i64([1]), "entry 0 writes bytes 250..250"),
        (i64([400]), i64([1]), "entry 0 writes bytes 400..400"),
        (i64([150]), i64([0]), "entry 0 writes bytes 150..149"),
        (i64([MAX_BLOB_OFFSET - 1]), i64([MAX_BLOB_OFFSET]), "entry 0 writes"),
    ]
    for dst, lengths, message in cases:
        with pytest.raises(WireError, match=message) as info:
            check_within(dst, lengths, starts, ends)
        assert str(info.value).startswith("staged blob entry ")
        assert str(info.value).endswith("outside the room's pages")
    with pytest.raises(WireError, match="entry 0"):
        check_within(i64([0]), i64([1]), i64([]), i64([]))


def test_scatter_checks_the_target_and_the_data() -> None:
    source = np.arange(64, dtype=np.uint8)
    blob = _blob(source, [0, 8], [4, 40], [4, 4])
    dst, lengths = read_blob_table(blob, len(blob), len(blob))
    target = np.zeros(44, dtype=np.uint8)
    with pytest.raises(ValueError, match="does not fit the 43-byte target"):
        scatter_blob(blob, dst, lengths, target[:43])
    assert not target.any()
    with pytest.raises(ValueError, match="shorter than its table says"):
        scatter_blob(blob[:-1], dst, lengths, target)
    scatter_blob(blob, dst, lengths, target)
    assert target[4:8].tolist() == [0, 1, 2, 3]
    assert target[40:44].tolist() == [8, 9, 10, 11]
    assert target[8:40].sum() == 0


# --------------------------------------------------------------------------- round trips


@given(
    pages=st.integers(1, 64),
    page_bytes=st.sampled_from([1, 7, 64, 256]),
    prompt_len=st.integers(1, 64 * 4),
    rng=st.randoms(use_true_random=False),
    cut=st.integers(1, 5),
)
def test_scattered_pages_round_trip_through_a_blob(
    pages: int, page_bytes: int, prompt_len: int, rng: random.Random, cut: int
) -> None:
    contract = simple_contract(num_pages=pages, page_bytes=page_bytes, page_tokens=4)
    prompt_len = min(prompt_len, pages * 4)
    dst_manifest = room_manifest(contract, prompt_len, rng=rng, contiguous=False)
    src_manifest = room_manifest(contract, prompt_len, rng=rng, contiguous=False)
    field = contract.field("layer.0.kv")
    source = np.frombuffer(rng.randbytes(contract.arena_bytes), dtype=np.uint8)
    # Copies page by page, each page cut into up to ``cut`` pieces (as a TP
    # fragment cuts a page into rows).
    src: list[int] = []
    dst: list[int] = []
    lengths: list[int] = []
    for s, d in zip(src_manifest.block_ids("full"), dst_manifest.block_ids("full"), strict=True):
        bounds = sorted({0, page_bytes, *(rng.randrange(page_bytes) for _ in range(cut - 1))})
        for a, b in itertools.pairwise(bounds):
            src.append(contract.page_offset(field, s) + a)
            dst.append(contract.page_offset(field, d) + a)
            lengths.append(b - a)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    src, dst, lengths = ([xs[i] for i in order] for xs in (src, dst, lengths))

    direct = np.zeros(contract.arena_bytes, dtype=np.uint8)
    for s, d, n in zip(src, dst, lengths, strict=True):
        direct[d : d + n] = source[s : s + n]

    pool = SlotPool(1 << 20, align=64)
    staging = np.zeros(pool.size, dtype=np.uint8)
    need = blob_length(len(lengths), sum(lengths))
    slot = pool.alloc(need)
    assert slot is not None
    assert gather_blob(staging[slot:], source, i64(src), i64(dst), i64(lengths)) == need
    received = staging[slot : slot + pool.rounded(need)].copy()  # the peer's slot
    got_dst, got_len = read_blob_table(received, need, len(received))
    assert got_dst.tolist() == dst
    assert got_len.tolist() == lengths
    check_within(got_dst, got_len, *room_ranges(contract, dst_manifest))
    staged = np.zeros(contract.arena_bytes, dtype=np.uint8)
    scatter_blob(received, got_dst, got_len, staged)
    assert np.array_equal(staged, direct)
    pool.free(slot)
    # A blob aimed at another room's pages is refused before it is scattered.
    others = [p for p in range(1, pages + 1) if p not in dst_manifest.block_ids("full")]
    if others:
        with pytest.raises(WireError, match="outside the room's pages"):
            check_within(
                i64([contract.page_offset(field, others[0])]),
                i64([1]),
                *room_ranges(contract, dst_manifest),
            )


def _staged_apply(
    plan: CopyPlan, p_arena: HostArena, d_arena: HostArena, starts: np.ndarray, ends: np.ndarray
) -> None:
    """What a staged room does with a copy plan: gather on Prefill, one write of the
    blob into Decode's slot, check and scatter on Decode."""
    src = plan.src - p_arena.base
    dst = plan.dst - d_arena.base
    need = blob_length(len(plan), plan.total_bytes)
    prefill_pool, decode_pool = SlotPool(1 << 22), SlotPool(1 << 22)
    prefill_staging = np.zeros(prefill_pool.size, dtype=np.uint8)
    decode_staging = np.zeros(decode_pool.size, dtype=np.uint8)
    mine, theirs = prefill_pool.alloc(need), decode_pool.alloc(need)
    assert mine is not None
    assert theirs is not None
    written = gather_blob(prefill_staging[mine:], p_arena.array, src, dst, plan.length)
    decode_staging[theirs : theirs + written] = prefill_staging[mine : mine + written]
    slot_len = decode_pool.rounded(need)
    slot = decode_staging[theirs : theirs + slot_len]
    dst_offsets, lengths = read_blob_table(slot, written, slot_len)
    check_within(dst_offsets, lengths, starts, ends)
    scatter_blob(slot, dst_offsets, lengths, d_arena.array)


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 1), (2, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("coalesced", [False, True])
def test_staged_rooms_pass_the_interop_check_across_tp_routes(
    prefill_tp: int, decode_tp: int, coalesced: bool
) -> None:
    def contract(tp: int) -> CacheContract:
        return multi_layer_contract(
            layers=2, num_pages=16, heads=4 // tp, head_dim=8, tp_size=tp, with_state_group=True
        )

    prompt_len, seed, room = 13, 5, 77
    prefill = [contract(prefill_tp) for _ in range(prefill_tp)]
    decode = [contract(decode_tp) for _ in range(decode_tp)]
    p_arenas = [HostArena.for_contract(c) for c in prefill]
    d_arenas = [HostArena.for_contract(c) for c in decode]
    try:
        d_manifests = []
        for c in decode:
            tables = PageAllocator(c, contiguous=False, rng=random.Random(3)).allocate(prompt_len)
            d_manifests.append(build_manifest(c, tables, 0, prompt_len))
        for p, c in enumerate(prefill):
            tables = PageAllocator(c, contiguous=False, rng=random.Random(p)).allocate(prompt_len)
            source = build_manifest(c, tables, 0, prompt_len)
            fill_room(p_arenas[p], c, source, seed=seed, room=room, tp_size=prefill_tp, tp_rank=p)
            for d in range(decode_tp):
                if (
                    p
                    not in RoutePlanner(prefill_tp, decode_tp, c, decode[d])
                    .plan(d)
                    .fragments_by_prefill_rank
                ):
                    continue
                registration = plan_registration(
                    prefill_tp=prefill_tp,
                    prefill_rank=p,
                    prefill_contract=c,
                    decode_tp=decode_tp,
                    decode_rank=d,
                    decode_contract=decode[d],
                )
                plan = plan_copies(
                    src_contract=c,
                    src_base=p_arenas[p].base,
                    dst_contract=decode[d],
                    dst_base=d_arenas[d].base,
                    dst_manifest=d_manifests[d],
                    source=source,
                    registration=registration,
                )
                plan = coalesce(plan) if coalesced else plan
                starts, ends = room_ranges(decode[d], d_manifests[d])
                _staged_apply(plan, p_arenas[p], d_arenas[d], starts, ends)
        for d in range(decode_tp):
            mismatches = verify_room(
                d_arenas[d],
                decode[d],
                d_manifests[d],
                seed=seed,
                room=room,
                tp_size=decode_tp,
                tp_rank=d,
            )
            assert [str(m) for m in mismatches] == []
    finally:
        for arena in p_arenas + d_arenas:
            arena.close()


@pytest.mark.parametrize("part_bytes", [1, 100, 4096, 1 << 30])
def test_a_blob_gathered_in_parts_is_the_same_blob(part_bytes: int) -> None:
    rng = np.random.default_rng(7)
    source = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    lengths = rng.integers(1, 300, 40).astype(np.int64)
    src = rng.integers(0, (1 << 16) - 300, 40).astype(np.int64)
    dst = np.cumsum(lengths) + 1000
    whole = np.zeros(1 << 15, dtype=np.uint8)
    size = gather_blob(whole, source, src, dst, lengths)
    pieces = np.zeros(1 << 15, dtype=np.uint8)
    parts = list(gather_blob_parts(pieces, source, src, dst, lengths, part_bytes))
    assert parts[0][0] == 0
    assert parts[-1][1] == size
    assert all(a[1] == b[0] for a, b in itertools.pairwise(parts))
    assert all(end - start >= part_bytes for start, end in parts[:-1])
    assert bytes(pieces[:size]) == bytes(whole[:size])


def test_a_blob_may_open_with_a_smaller_part() -> None:
    """``first_part_bytes``: the first part (the table and the first ranges) is cut
    sooner, so its write starts after a short gather; the rest keep ``part_bytes``."""
    source = np.arange(1 << 16, dtype=np.uint64).view(np.uint8)[: 1 << 16].copy()
    lengths = np.full(64, 512, dtype=np.int64)
    src = np.arange(64, dtype=np.int64) * 1024
    dst = np.arange(64, dtype=np.int64) * 512
    out = np.zeros(1 << 16, dtype=np.uint8)
    table = BLOB_HEADER_BYTES + BLOB_ENTRY_BYTES * 64
    parts = list(gather_blob_parts(out, source, src, dst, lengths, 8192, first_part_bytes=1024))
    assert parts[0] == (0, table + 1024)
    assert [end - start for start, end in parts[1:-1]] == [8192] * (len(parts) - 2)
    assert parts[-1][1] == table + 64 * 512
    with pytest.raises(ValueError, match="at least 1 byte"):
        next(gather_blob_parts(out, source, src, dst, lengths, 8192, first_part_bytes=0))


def _reference_parts(
    source: np.ndarray,
    src: list[int],
    dst: list[int],
    lengths: list[int],
    part_bytes: int,
    first_part_bytes: int | None = None,
) -> tuple[bytes, list[tuple[int, int]]]:
    """The blob and its parts, range by range (the format's definition)."""
    n = len(lengths)
    table = b"".join(
        d.to_bytes(8, "little") + m.to_bytes(8, "little") for d, m in zip(dst, lengths, strict=True)
    )
    blob = bytearray(_header(n) + table)
    first = part_bytes if first_part_bytes is None else first_part_bytes
    parts, start, due = [], 0, len(blob) + first
    for s, m in zip(src, lengths, strict=True):
        blob += bytes(source[s : s + m])
        if len(blob) >= due:
            parts.append((start, len(blob)))
            start, due = len(blob), len(blob) + part_bytes
    if len(blob) > start or start == 0:
        parts.append((start, len(blob)))
    return bytes(blob), parts


@given(
    unit=st.sampled_from([1, 3, 64, 256, 512, 4096]),
    shape=st.lists(st.tuples(st.integers(0, 60), st.integers(1, 4)), min_size=0, max_size=24),
    part_bytes=st.sampled_from([1, 300, 4096, 20_000, 1 << 40]),
    first_part_bytes=st.sampled_from([None, 1, 300, 4096]),
    seed=st.integers(0, 2**32 - 1),
)
def test_gather_and_scatter_match_the_range_by_range_definition(
    unit: int,
    shape: list[tuple[int, int]],
    part_bytes: int,
    first_part_bytes: int | None,
    seed: int,
) -> None:
    """Whole rows of ≥ 256 bytes go through numpy's row gather and scatter (without
    the GIL), anything else range by range: the blob, its parts and the scattered
    arena are the same either way."""
    slots = 64
    rng = np.random.default_rng(seed)
    source = rng.integers(0, 256, slots * 4 * unit, dtype=np.uint8)
    src = [row * unit for row, _ in shape]
    lengths = [count * unit for _, count in shape]
    order = rng.permutation(slots).tolist()
    dst = [order[i % slots] * 4 * unit for i in range(len(shape))]  # distinct, in range
    want, want_parts = _reference_parts(source, src, dst, lengths, part_bytes, first_part_bytes)
    out = np.zeros(len(want) + 5, dtype=np.uint8)
    cols = (np.array(src, I64), np.array(dst, I64), np.array(lengths, I64))
    parts = gather_blob_parts(out, source, *cols, part_bytes, first_part_bytes=first_part_bytes)
    assert list(parts) == want_parts
    assert bytes(out[: len(want)]) == want
    target = np.zeros(slots * 4 * unit, dtype=np.uint8)
    expected = target.copy()
    for s, d, m in zip(src, dst, lengths, strict=True):
        expected[d : d + m] = source[s : s + m]
    table_dst, table_len = read_blob_table(out, len(want), len(out))
    scatter_blob(out, table_dst, table_len, target)
    assert bytes(target) == bytes(expected)


@pytest.mark.parametrize(
    ("count", "align", "pad"),
    [(0, 4096, 4080), (255, 4096, 0), (256, 4096, 4080), (3, 64, 0), (4, 64, 48), (7, 1, 0)],
)
def test_blob_data_pad_puts_the_data_on_the_boundary(count: int, align: int, pad: int) -> None:
    assert blob_data_pad(count, align) == pad
    assert (pad + BLOB_HEADER_BYTES + BLOB_ENTRY_BYTES * count) % align == 0


def test_blob_data_pad_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="non-negative entry count"):
        blob_data_pad(-1, 4096)
    with pytest.raises(ValueError, match="positive alignment"):
        blob_data_pad(1, 0)
