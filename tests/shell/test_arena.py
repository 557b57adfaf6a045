"""Host arenas and the interop pattern, checked through the real planner across TP sizes."""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest

from tspd.core.contract import CacheContract
from tspd.core.copies import CopyPlan, coalesce, plan_copies
from tspd.core.errors import ConfigError
from tspd.core.interop import block_bytes
from tspd.core.manifest import BlockManifest, build_manifest
from tspd.core.planner import RoutePlanner, plan_registration
from tspd.shell.arena import HostArena, fill_room, verify_room
from tspd.testing.layouts import PageAllocator, multi_layer_contract, simple_contract


def _apply(plan: CopyPlan) -> None:
    for src, dst, length in plan:
        ctypes.memmove(dst, src, length)


def test_arena_is_page_aligned_sized_and_closes() -> None:
    contract = simple_contract(num_pages=8, page_bytes=4096)
    arena = HostArena.for_contract(contract)
    assert arena.size == contract.arena_bytes
    assert arena.base % 4096 == 0
    arena.view(0, 16)[:] = 1
    assert arena.array[:16].sum() == 16
    with pytest.raises(ConfigError, match="outside"):
        arena.view(arena.size - 1, 2)
    arena.close()
    arena.close()
    with pytest.raises(ConfigError, match="closed"):
        _ = arena.array


def test_tp1_fill_is_the_spec_pattern_at_the_page_address() -> None:
    contract = simple_contract(num_pages=4, page_bytes=4096, group_id="full", field_id="layer.0.kv")
    tables = {"full": [3, 1]}
    manifest = build_manifest(contract, tables, 0, 2 * contract.group("full").block_granularity)
    with HostArena.for_contract(contract) as arena:
        fill_room(arena, contract, manifest, seed=0, room=1000000)
        offset = contract.page_offset("layer.0.kv", 3)
        assert arena.view(offset, 16).tobytes().hex() == "742f864c028ea01c1c2b65921b811493"
        offset = contract.page_offset("layer.0.kv", 1)
        assert arena.view(offset, 16).tobytes().hex() == "eb0f2c950d00dadfac638d2a1d20a145"
        assert verify_room(arena, contract, manifest, seed=0, room=1000000) == []
        bad = verify_room(arena, contract, manifest, seed=1, room=1000000)
        assert {m.slot for m in bad} == {0, 1}


def _transfer(
    prefill_tp: int,
    decode_tp: int,
    prefill: list[CacheContract],
    decode: list[CacheContract],
    prompt_len: int,
    *,
    room: int,
    seed: int,
) -> list[list[str]]:
    """Fill every Prefill rank, plan and apply every route, verify every Decode rank."""
    p_arenas = [HostArena.for_contract(c) for c in prefill]
    d_arenas = [HostArena.for_contract(c) for c in decode]
    try:
        d_manifests: list[BlockManifest] = []
        for d, contract in enumerate(decode):
            tables = PageAllocator(contract, contiguous=False).allocate(prompt_len)
            d_manifests.append(build_manifest(contract, tables, 0, prompt_len))
            assert d < decode_tp
        for p, contract in enumerate(prefill):
            tables = PageAllocator(contract).allocate(prompt_len)
            source = build_manifest(contract, tables, 0, prompt_len)
            fill_room(
                p_arenas[p], contract, source, seed=seed, room=room, tp_size=prefill_tp, tp_rank=p
            )
            planner = RoutePlanner(prefill_tp, decode_tp, contract, decode[0])
            for d in range(decode_tp):
                if p not in planner.plan(d).fragments_by_prefill_rank:
                    continue
                registration = plan_registration(
                    prefill_tp=prefill_tp,
                    prefill_rank=p,
                    prefill_contract=contract,
                    decode_tp=decode_tp,
                    decode_rank=d,
                    decode_contract=decode[d],
                )
                plan = plan_copies(
                    src_contract=contract,
                    src_base=p_arenas[p].base,
                    dst_contract=decode[d],
                    dst_base=d_arenas[d].base,
                    dst_manifest=d_manifests[d],
                    source=source,
                    registration=registration,
                )
                _apply(coalesce(plan))
        return [
            [
                str(m)
                for m in verify_room(
                    d_arenas[d],
                    decode[d],
                    d_manifests[d],
                    seed=seed,
                    room=room,
                    tp_size=decode_tp,
                    tp_rank=d,
                )
            ]
            for d in range(decode_tp)
        ]
    finally:
        for arena in p_arenas + d_arenas:
            arena.close()


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2)])
def test_pattern_survives_heterogeneous_tp_routes(prefill_tp: int, decode_tp: int) -> None:
    def contract(tp: int) -> CacheContract:
        return multi_layer_contract(
            layers=2, num_pages=16, heads=4 // tp, head_dim=8, tp_size=tp, with_state_group=True
        )

    prefill = [contract(prefill_tp) for _ in range(prefill_tp)]
    decode = [contract(decode_tp) for _ in range(decode_tp)]
    result = _transfer(prefill_tp, decode_tp, prefill, decode, 13, room=77, seed=5)
    assert result == [[] for _ in range(decode_tp)]


def test_a_missing_transfer_is_reported_per_field_and_slot() -> None:
    contract = multi_layer_contract(layers=1, num_pages=8, heads=2, head_dim=4)
    tables = PageAllocator(contract).allocate(8)
    manifest = build_manifest(contract, tables, 0, 8)
    with HostArena.for_contract(contract) as arena:
        mismatches = verify_room(arena, contract, manifest, seed=0, room=1)
        assert {(m.field_id, m.slot) for m in mismatches} == {
            (f, s) for f in ("layer.0.k", "layer.0.v") for s in (0, 1)
        }
        assert "room 1" in str(mismatches[0])
        fill_room(arena, contract, manifest, seed=0, room=1, fields=frozenset({"layer.0.k"}))
        left = verify_room(arena, contract, manifest, seed=0, room=1)
        assert {m.field_id for m in left} == {"layer.0.v"}


def test_replicated_shard_is_the_whole_payload() -> None:
    contract = simple_contract(num_pages=2, page_bytes=64)
    field = contract.field("layer.0.kv")
    data = block_bytes(0, 1, "full", "layer.0.kv", 0, 64)
    from tspd.shell.arena import field_shard

    assert field_shard(contract, field, data, tp_size=4, tp_rank=3) == data
    assert np.frombuffer(data, np.uint8).size == 64


@pytest.mark.parametrize("tp_size", [1, 2, 4, 8])
def test_head_major_fill_equals_the_sliced_global_pattern(tp_size: int) -> None:
    """A field split on its first axis is filled from a prefix of the stream only;
    every rank's bytes must still equal its slice of the whole global tensor."""
    from tspd.demo.workload import demo_contract
    from tspd.shell.arena import field_shard

    heads = max(1, 4 // tp_size)
    contract = demo_contract(
        layers=1,
        num_pages=4,
        heads=heads,
        head_dim=8,
        page_tokens=2,
        tp_size=tp_size,
        global_heads=4,
    )
    manifest = build_manifest(contract, {"kv": [1, 3]}, 0, 4)
    for rank in range(tp_size):
        with HostArena.for_contract(contract) as arena:
            fill_room(arena, contract, manifest, seed=7, room=11, tp_size=tp_size, tp_rank=rank)
            for field in contract.fields_for_group("kv"):
                for slot, block in enumerate((1, 3)):
                    whole = block_bytes(7, 11, "kv", field.field_id, slot, 4 * 2 * 8 * 2)
                    want = field_shard(contract, field, whole, tp_size=tp_size, tp_rank=rank)
                    offset = contract.page_offset(field, block)
                    assert arena.view(offset, field.payload_bytes).tobytes() == want
            assert not verify_room(
                arena, contract, manifest, seed=7, room=11, tp_size=tp_size, tp_rank=rank
            )


def _resident_kib(base: int) -> int:
    """The resident KiB of this process's mapping that starts at ``base``."""
    start = f"{base:x}-"
    found = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            if not found:
                found = line.startswith(start)
            elif line.startswith("Rss:"):
                return int(line.split()[1])
    raise AssertionError(f"no mapping starts at {base:#x}")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux /proc only")
def test_prefault_backs_every_page_of_the_arena() -> None:
    with HostArena(8 << 20) as arena:
        assert _resident_kib(arena.base) == 0  # an anonymous mapping starts unbacked
        arena.prefault()
        assert _resident_kib(arena.base) == 8 << 10
        assert not arena.array.any()  # still zero
