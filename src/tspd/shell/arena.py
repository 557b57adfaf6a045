"""Host-memory KV arenas and the interop test pattern over a room's blocks.

A :class:`HostArena` is one rank's whole KV cache arena in host memory: a single
page-aligned anonymous mapping of ``contract.arena_bytes`` bytes, registered once
with a transfer engine (docs/protocol.md#proto-contract-derived,
docs/protocol.md#proto-transfer-engine). The demo, the benchmarks and the end-to-end
tests use it where a real engine would use GPU memory.

:func:`fill_room` writes the interop pattern (docs/protocol.md#proto-interop) into the
blocks a Prefill rank sends for a room, and :func:`verify_room` checks, on a Decode
rank, that the blocks of its manifest hold exactly those bytes — so either side can face
a peer of another implementation and check it byte for byte.

Tensor parallelism: the pattern defines a field's bytes for one block as
``SHAKE-256(M)`` truncated to the field's payload. Here that payload is the field's
*global* tensor (the local shape with the partition axis widened to its global extent,
docs/protocol.md#proto-peer-compat); a rank holds its shard of it, sliced along the
partition axis exactly as the planner maps shards (docs/protocol.md#proto-fragments).
For a replicated field, or any field on TP 1, the local payload is the global one and
this is the pattern word for word; for a head-partitioned field it is what makes the
bytes of a Prefill of one TP size checkable on a Decode of another.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from dataclasses import dataclass
from typing import final

import numpy as np
import numpy.typing as npt

from tspd.core.contract import CacheContract, FieldSpec
from tspd.core.errors import ConfigError
from tspd.core.interop import block_bytes
from tspd.core.manifest import BlockManifest, logical_slots

__all__ = [
    "BlockMismatch",
    "HostArena",
    "clear_room",
    "field_shard",
    "fill_room",
    "iter_room_blocks",
    "verify_room",
]


@final
class HostArena:
    """A page-aligned host buffer of ``size`` bytes with a stable base address.

    The mapping stays at the same address for the arena's whole life, so a
    release/restore of its transfer-engine registration (sleep/wake,
    docs/protocol.md#proto-sleep-wake) never invalidates the address a peer cached from
    a registration.
    """

    def __init__(self, size: int) -> None:
        if size <= 0:
            raise ConfigError(f"a host arena needs a positive size, got {size} bytes")
        self._map: mmap.mmap | None = mmap.mmap(-1, size)
        self._array: npt.NDArray[np.uint8] | None = np.frombuffer(self._map, dtype=np.uint8)
        self.size = size
        self.base = int(self._array.ctypes.data)

    @classmethod
    def for_contract(cls, contract: CacheContract) -> HostArena:
        """An arena sized to hold ``contract``'s whole cache (``arena_bytes``)."""
        return cls(contract.arena_bytes)

    @property
    def array(self) -> npt.NDArray[np.uint8]:
        """The arena's bytes as a writable ``uint8`` array (no copy)."""
        if self._array is None:
            raise ConfigError("the host arena was closed; open a new one")
        return self._array

    def prefault(self) -> None:
        """Back every page of the arena with memory now (a write to each page), so
        its first use pays no page faults: a 64 MiB region first touched by a transfer
        took 16,384 of them, and the first staged room after a start ran at half the
        speed of the next. Blocks while the kernel backs the pages (160 MiB: ~0.12 s
        on a 2-core host): call it from a worker thread."""
        self.array[:: mmap.PAGESIZE] = 0

    def view(self, offset: int, length: int) -> npt.NDArray[np.uint8]:
        """``length`` bytes at ``offset``, bounds-checked (no copy)."""
        if offset < 0 or length < 0 or offset + length > self.size:
            raise ConfigError(
                f"arena range [{offset}, {offset + length}) is outside its {self.size} bytes"
            )
        return self.array[offset : offset + length]

    def close(self) -> None:
        """Unmap the arena. Idempotent; the caller deregisters it from its engine first."""
        if self._map is None:
            return
        self._array = None
        self._map.close()
        self._map = None

    def __enter__(self) -> HostArena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True, slots=True)
class BlockMismatch:
    """One field of one block whose bytes differ from the interop pattern."""

    room: int
    group_id: str
    field_id: str
    slot: int
    block_id: int
    first_bad_byte: int

    def __str__(self) -> str:
        return (
            f"room {self.room}: group {self.group_id!r} field {self.field_id!r} slot "
            f"{self.slot} (block {self.block_id}) differs from byte {self.first_bad_byte}"
        )


def field_shard(
    contract: CacheContract,
    field: FieldSpec,
    global_bytes: bytes,
    *,
    tp_size: int,
    tp_rank: int,
) -> bytes:
    """The bytes of ``field`` a rank of ``tp_size`` holds, out of its global tensor.

    ``global_bytes`` is the whole (un-partitioned) tensor, C order. A replicated
    field is returned whole; a partitioned one is sliced along its axis, part by
    part, at this rank's shard (docs/protocol.md#proto-fragments: ``N = G / L``
    shards, replica groups of ``R = T / N`` ranks, shard ``rank // R``).
    """
    partition = contract.partition_of(field.field_id)
    if partition is None:
        return global_bytes
    local_extent = field.shape[partition.axis]
    shards = partition.global_extent // local_extent
    if shards <= 0 or tp_size % shards != 0:
        raise ConfigError(
            f"cache field {field.field_id!r} cannot map global extent "
            f"{partition.global_extent} and local extent {local_extent} to TP={tp_size}"
        )
    shard = tp_rank // (tp_size // shards)
    global_shape = list(field.shape)
    global_shape[partition.axis] = partition.global_extent
    tensor = np.frombuffer(global_bytes, dtype=np.uint8).reshape((*global_shape, field.dtype_width))
    parts = partition.parts
    indices: list[npt.NDArray[np.int64]] = []
    offset = 0
    for part in parts:
        width = part // shards
        start = offset + shard * width
        indices.append(np.arange(start, start + width, dtype=np.int64))
        offset += part
    local = np.take(tensor, np.concatenate(indices), axis=partition.axis)
    return local.tobytes()


def _global_payload(contract: CacheContract, field: FieldSpec) -> int:
    partition = contract.partition_of(field.field_id)
    if partition is None:
        return field.payload_bytes
    local_extent = field.shape[partition.axis]
    return field.payload_bytes // local_extent * partition.global_extent


def iter_room_blocks(
    contract: CacheContract, block_ids: BlockManifest
) -> Iterator[tuple[str, FieldSpec, int, int]]:
    """Every ``(group_id, field, slot, block_id)`` a room's manifest names.

    ``block_ids`` carries the window (``prefix_len``, ``prompt_len``) and, per
    group in contract order, the block ids of the request's logical slots
    (docs/protocol.md#proto-logical-slots); the i-th id holds slot ``first_slot + i``.
    """
    for group in block_ids.groups:
        spec = contract.group(group.group_id)
        slots = logical_slots(spec, block_ids.prefix_len, block_ids.prompt_len)
        fields = contract.fields_for_group(group.group_id)
        for slot, block_id in zip(slots, group.block_ids, strict=True):
            for field in fields:
                yield group.group_id, field, slot, block_id


def _expected(
    contract: CacheContract,
    field: FieldSpec,
    *,
    seed: int,
    room: int,
    group_id: str,
    slot: int,
    tp_size: int,
    tp_rank: int,
) -> bytes:
    span = _leading_shard_span(contract, field, tp_size=tp_size, tp_rank=tp_rank)
    if span is not None:
        # The shard is one byte range of the global stream: generate the stream only
        # up to its end and take the range (a SHAKE stream cannot start mid-way).
        start, stop = span
        return block_bytes(seed, room, group_id, field.field_id, slot, stop)[start:]
    whole = block_bytes(
        seed, room, group_id, field.field_id, slot, _global_payload(contract, field)
    )
    return field_shard(contract, field, whole, tp_size=tp_size, tp_rank=tp_rank)


def _leading_shard_span(
    contract: CacheContract, field: FieldSpec, *, tp_size: int, tp_rank: int
) -> tuple[int, int] | None:
    """The ``[start, stop)`` bytes of the global tensor that are this rank's shard,
    when they are one range: the field is partitioned on its first axis in a single
    part (the demo's head-major KV pages). ``None`` otherwise; :func:`field_shard`
    handles every layout, and reports one that does not fit ``tp_size``."""
    partition = contract.partition_of(field.field_id)
    if partition is None or partition.axis != 0 or len(partition.parts) != 1:
        return None
    local_extent = field.shape[0]
    shards = partition.global_extent // local_extent
    if shards <= 0 or tp_size % shards != 0 or shards * local_extent != partition.global_extent:
        return None
    row = field.payload_bytes // local_extent
    shard = tp_rank // (tp_size // shards)
    start = shard * local_extent * row
    return start, start + local_extent * row


def fill_room(
    arena: HostArena,
    contract: CacheContract,
    manifest: BlockManifest,
    *,
    seed: int,
    room: int,
    tp_size: int = 1,
    tp_rank: int = 0,
    fields: frozenset[str] | None = None,
) -> int:
    """Write the interop pattern into every block of ``manifest`` (Prefill side).

    ``manifest`` is the rank's *source* manifest: its own block ids for the
    Decode window. ``fields`` restricts the fill to some fields (a layerwise
    producer step). Returns the bytes written.
    """
    written = 0
    for group_id, field, slot, block_id in iter_room_blocks(contract, manifest):
        if fields is not None and field.field_id not in fields:
            continue
        data = _expected(
            contract,
            field,
            seed=seed,
            room=room,
            group_id=group_id,
            slot=slot,
            tp_size=tp_size,
            tp_rank=tp_rank,
        )
        offset = contract.page_offset(field, block_id)
        arena.view(offset, len(data))[:] = np.frombuffer(data, dtype=np.uint8)
        written += len(data)
    return written


def clear_room(arena: HostArena, contract: CacheContract, manifest: BlockManifest) -> None:
    """Zero every field payload of ``manifest``'s blocks (a Decode rank clears the
    pages it hands out before publishing their manifest, so stale bytes of an
    earlier room can never pass for a transfer)."""
    for _, field, _, block_id in iter_room_blocks(contract, manifest):
        arena.view(contract.page_offset(field, block_id), field.payload_bytes)[:] = 0


def verify_room(
    arena: HostArena,
    contract: CacheContract,
    manifest: BlockManifest,
    *,
    seed: int,
    room: int,
    tp_size: int = 1,
    tp_rank: int = 0,
) -> list[BlockMismatch]:
    """Check every block of ``manifest`` against the interop pattern (Decode side).

    Returns one :class:`BlockMismatch` per field and block whose bytes differ
    (empty when the transfer was exact).
    """
    mismatches: list[BlockMismatch] = []
    for group_id, field, slot, block_id in iter_room_blocks(contract, manifest):
        want = np.frombuffer(
            _expected(
                contract,
                field,
                seed=seed,
                room=room,
                group_id=group_id,
                slot=slot,
                tp_size=tp_size,
                tp_rank=tp_rank,
            ),
            dtype=np.uint8,
        )
        got = arena.view(contract.page_offset(field, block_id), len(want))
        if not np.array_equal(got, want):
            first = int(np.flatnonzero(got != want)[0])
            mismatches.append(BlockMismatch(room, group_id, field.field_id, slot, block_id, first))
    return mismatches
