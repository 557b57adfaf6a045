"""Copy generation: a planned registration and a request's block ids → byte copies.

A copy is one ``(src, dst, length)`` descriptor handed to the transfer engine: ``src``
an absolute address in this rank's registered arena, ``dst`` one in the Decode
rank's. :func:`plan_copies` reproduces the emission order of spec §6.7 exactly
(group → field or fragment → page → row), vectorised with numpy over pages and rows
so a room of tens of thousands of pages costs a few array operations, not a Python
loop per page.

Three transport-facing steps follow planning, each a pure function of a plan:

* :func:`coalesce` merges runs of copies that are adjacent on both sides. Mooncake
  over TCP costs about 40 µs a descriptor, so one write per contiguous run instead
  of one per page is the largest single saving (``notes/environment.md`` §2, §9).
* :func:`check_bounds` proves every copy lies inside both registered arenas: the
  TCP transport does not check the local source, so a plan that leaves an arena is
  refused here, before any write.
* :func:`batches` cuts a plan into engine calls of at most
  :data:`DEFAULT_MAX_DESCRIPTORS` descriptors.

Every copy of every step is planned before the first write (spec §12 item 10):
:func:`plan_steps` returns all step plans at once or raises.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from tspd.core.contract import CacheContract
from tspd.core.errors import PlanError
from tspd.core.manifest import BlockManifest, Selection
from tspd.core.planner import Fragment, OwnerFilter, PlannedRegistration

__all__ = [
    "DEFAULT_MAX_DESCRIPTORS",
    "MAX_ADDRESS",
    "CopyPlan",
    "batches",
    "check_bounds",
    "coalesce",
    "plan_copies",
    "plan_steps",
]

#: Descriptors per engine call. Mooncake's TCP transport queues at most 2,048
#: transfers per peer (``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``); TokenSpeed hands it
#: up to 4,096 a call and so fails every room above 2,048 pages. Half the queue
#: keeps a room of any size under the limit even with a second call to the same
#: peer in flight (two transfer workers, or a layerwise interval overlapping a full
#: transfer), since every call waits for its descriptors to finish before the next
#: one starts. After :func:`coalesce` a contiguous room is far fewer descriptors.
DEFAULT_MAX_DESCRIPTORS = 1024

#: Addresses and lengths are int64: every address, and every ``address + length``,
#: must stay below this bound (user-space addresses on current 64-bit hosts are
#: below 2**57), so the arithmetic never wraps.
MAX_ADDRESS = 1 << 62

Int64Array = npt.NDArray[np.int64]

_EMPTY: Int64Array = np.zeros(0, dtype=np.int64)
_EMPTY.setflags(write=False)


@dataclass(frozen=True, slots=True, eq=False)
class CopyPlan:
    """An ordered list of copies as three equal-length int64 arrays.

    ``src[i]`` and ``dst[i]`` are absolute addresses, ``length[i]`` the byte count
    of copy ``i``. A plan is a value: the constructor marks the arrays it is given
    read-only (copy them first to keep a writable array). Iterating yields ``(src, dst, length)``
    tuples of Python ints (for tests and logs; the shell hands the arrays, or their
    ``tolist()``, to the engine).
    """

    src: Int64Array
    dst: Int64Array
    length: Int64Array

    def __post_init__(self) -> None:
        if not (len(self.src) == len(self.dst) == len(self.length)):
            raise PlanError(
                f"copy plan arrays differ in length: {len(self.src)} sources, "
                f"{len(self.dst)} destinations, {len(self.length)} lengths"
            )
        for array in (self.src, self.dst, self.length):
            if array.dtype != np.int64 or array.ndim != 1:
                raise PlanError("copy plan arrays must be one-dimensional int64")
            array.setflags(write=False)

    @classmethod
    def empty(cls) -> CopyPlan:
        """A plan with no copies (an engine call is skipped for it)."""
        return cls(_EMPTY, _EMPTY, _EMPTY)

    @classmethod
    def from_copies(cls, copies: Sequence[tuple[int, int, int]]) -> CopyPlan:
        """Build a plan from ``(src, dst, length)`` tuples."""
        if not copies:
            return cls.empty()
        table = np.asarray(copies, dtype=np.int64).reshape(-1, 3)
        return cls(table[:, 0].copy(), table[:, 1].copy(), table[:, 2].copy())

    @classmethod
    def concat(cls, plans: Sequence[CopyPlan]) -> CopyPlan:
        """The copies of ``plans`` one after another."""
        plans = [plan for plan in plans if len(plan)]
        if not plans:
            return cls.empty()
        if len(plans) == 1:
            return plans[0]
        return cls(
            np.concatenate([plan.src for plan in plans]),
            np.concatenate([plan.dst for plan in plans]),
            np.concatenate([plan.length for plan in plans]),
        )

    def __len__(self) -> int:
        return len(self.length)

    def __iter__(self) -> Iterator[tuple[int, int, int]]:
        return zip(self.src.tolist(), self.dst.tolist(), self.length.tolist(), strict=True)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CopyPlan):
            return NotImplemented
        return (
            np.array_equal(self.src, other.src)
            and np.array_equal(self.dst, other.dst)
            and np.array_equal(self.length, other.length)
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"CopyPlan({len(self)} copies, {self.total_bytes} bytes)"

    @property
    def total_bytes(self) -> int:
        """Bytes moved by the whole plan."""
        return int(self.length.sum())

    def tolist(self) -> tuple[list[int], list[int], list[int]]:
        """The three columns as Python int lists (the engine's argument form)."""
        return self.src.tolist(), self.dst.tolist(), self.length.tolist()


def coalesce(plan: CopyPlan) -> CopyPlan:
    """Merge consecutive copies that continue each other on both sides.

    Copy ``i+1`` joins copy ``i``'s run when ``src[i] + length[i] == src[i+1]`` and
    ``dst[i] + length[i] == dst[i+1]``. Only neighbours in emission order merge; the
    plan is never sorted. A merged run writes exactly the bytes its members would,
    in the same order relative to every other copy, so even a plan whose
    destinations overlap (which no valid manifest produces, and whose outcome a
    parallel engine would not define anyway) keeps its last-writer-wins result.
    Sorting first would find more runs in scattered plans, but §6.7 emission order
    is page-major per field, so contiguous allocations are already neighbours.
    """
    n = len(plan)
    if n < 2:
        return plan
    src, dst, length = plan.src, plan.dst, plan.length
    continues = (src[:-1] + length[:-1] == src[1:]) & (dst[:-1] + length[:-1] == dst[1:])
    if not continues.any():
        return plan
    starts = np.flatnonzero(np.concatenate(([True], ~continues)))
    return CopyPlan(src[starts], dst[starts], np.add.reduceat(length, starts))


def check_bounds(
    plan: CopyPlan, *, src_base: int, src_len: int, dst_base: int, dst_len: int
) -> None:
    """Require every copy to have a positive length and lie inside both arenas.

    ``[src_base, src_base + src_len)`` is this rank's registered arena and
    ``[dst_base, dst_base + dst_len)`` the destination's. Raises :class:`PlanError`
    naming the first offending copy; callers add the room and peer.
    """
    for name, base, size in (("source", src_base, src_len), ("destination", dst_base, dst_len)):
        if base < 0 or size < 0 or base + size > MAX_ADDRESS:
            raise PlanError(f"{name} arena [{base:#x}, +{size}) is not a valid address range")
    if not len(plan):
        return
    src, dst, length = plan.src, plan.dst, plan.length
    bad = (
        (length <= 0)
        | (src < src_base)
        | (src > src_base + src_len - length)
        | (dst < dst_base)
        | (dst > dst_base + dst_len - length)
    )
    if not bad.any():
        return
    i = int(np.argmax(bad))
    s, d, n = int(src[i]), int(dst[i]), int(length[i])
    if n <= 0:
        why = "has a non-positive length"
    elif not src_base <= s <= src_base + src_len - n:
        why = f"leaves the source arena [{src_base:#x}, {src_base + src_len:#x})"
    else:
        why = f"leaves the destination arena [{dst_base:#x}, {dst_base + dst_len:#x})"
    raise PlanError(f"copy {i} (src {s:#x}, dst {d:#x}, {n} bytes) {why}; nothing was written")


def batches(plan: CopyPlan, max_descriptors: int = DEFAULT_MAX_DESCRIPTORS) -> Iterator[CopyPlan]:
    """Cut ``plan`` into consecutive engine calls of at most ``max_descriptors``
    copies each, in order. An empty plan yields nothing (no call is made)."""
    if max_descriptors < 1:
        raise PlanError(f"max_descriptors must be at least 1, got {max_descriptors}")
    n = len(plan)
    for start in range(0, n, max_descriptors):
        stop = min(start + max_descriptors, n)
        yield CopyPlan(plan.src[start:stop], plan.dst[start:stop], plan.length[start:stop])


# -- planning (§6.7) -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _GroupPages:
    """One group's page pairs for one destination: source pages (local, after any
    owner filter) and destination pages, position by position."""

    group_id: str
    src_pages: Int64Array
    dst_pages: Int64Array


def _ids(ids: Sequence[int], *, what: str, group_id: str) -> Int64Array:
    """Block ids or positions as an int64 array (a value beyond int64 is refused)."""
    try:
        return np.asarray(ids, dtype=np.int64).reshape(-1)
    except (OverflowError, TypeError, ValueError):
        raise PlanError(f"{what} of cache group {group_id!r} are not all 64-bit integers") from None


def _check_range(ids: Int64Array, limit: int, *, what: str, group_id: str) -> None:
    """Require every entry of ``ids`` to lie in ``[0, limit)``."""
    bad = (ids < 0) | (ids >= limit)
    if bad.any():
        value = int(ids[int(np.argmax(bad))])
        raise PlanError(f"{what} {value} of cache group {group_id!r} is outside [0, {limit})")


def _group_pages(
    *,
    src_contract: CacheContract,
    dst_contract: CacheContract,
    dst_manifest: BlockManifest,
    source: BlockManifest | Selection,
    owner_filters: Mapping[str, OwnerFilter | None],
    filtered: bool,
) -> list[_GroupPages]:
    """Pair source and destination pages per group, in contract group order.

    Source ids of a DCP-sharded group are virtual block ids: with an owner filter
    only the owned positions are kept and translated to local pages; without one
    (``None``) the group sends nothing from this rank.
    """
    order = tuple(src_contract.group_ids)
    dst_groups = _manifest_groups(dst_manifest)
    if tuple(dst_groups) != order:
        raise PlanError("destination manifest group order disagrees with the source layout")
    selected = _selection_groups(source) if isinstance(source, Selection) else None
    src_groups = _manifest_groups(source) if isinstance(source, BlockManifest) else None
    if tuple(selected or src_groups or ()) != order:
        what = "layerwise selection" if selected is not None else "source manifest"
        raise PlanError(f"{what} group order disagrees with the source layout")

    out = []
    for gid in order:
        dst_ids = _ids(dst_groups[gid], what="destination blocks", group_id=gid)
        if selected is not None:
            src_list, position_list = selected[gid]
            src_ids = _ids(src_list, what="source blocks", group_id=gid)
            positions = _ids(position_list, what="selection positions", group_id=gid)
            _check_range(positions, len(dst_ids), what="layerwise selection position", group_id=gid)
            dst_ids = dst_ids[positions]
        else:
            assert src_groups is not None
            src_ids = _ids(src_groups[gid], what="source blocks", group_id=gid)
        if len(src_ids) != len(dst_ids):
            raise PlanError(
                f"cache group {gid!r} pairs {len(src_ids)} source blocks with "
                f"{len(dst_ids)} destination blocks"
            )
        _check_range(dst_ids, dst_contract.page_count(gid), what="destination block", group_id=gid)
        if filtered and gid in owner_filters:
            owner = owner_filters[gid]
            if owner is None:
                continue
            _check_range(
                src_ids,
                1 + (src_contract.page_count(gid) - 1) * owner.owner_count,
                what="source virtual block",
                group_id=gid,
            )
            kept = (src_ids >= 1) & ((src_ids - 1) % owner.owner_count == owner.owner_rank)
            src_ids = (src_ids[kept] - 1) // owner.owner_count + 1
            dst_ids = dst_ids[kept]
        else:
            _check_range(src_ids, src_contract.page_count(gid), what="source block", group_id=gid)
        if len(src_ids):
            out.append(_GroupPages(gid, src_ids, dst_ids))
    return out


def _manifest_groups(manifest: BlockManifest) -> dict[str, Sequence[int]]:
    groups: dict[str, Sequence[int]] = {}
    for group in manifest.groups:
        if group.group_id in groups:
            raise PlanError(f"manifest lists cache group {group.group_id!r} twice")
        groups[group.group_id] = group.block_ids
    return groups


def _selection_groups(selection: Selection) -> dict[str, tuple[Sequence[int], Sequence[int]]]:
    groups: dict[str, tuple[Sequence[int], Sequence[int]]] = {}
    for group in selection.groups:
        if group.group_id in groups:
            raise PlanError(f"layerwise selection lists cache group {group.group_id!r} twice")
        groups[group.group_id] = (group.source_block_ids, group.destination_positions)
    return groups


def _field_copies(
    src_start: int,
    src_page_stride: int,
    dst_start: int,
    dst_page_stride: int,
    pages: _GroupPages,
    *,
    rows: int = 1,
    src_row_stride: int = 0,
    dst_row_stride: int = 0,
    bytes_per_row: int,
) -> CopyPlan:
    """Page-major, row-minor copies of one field or fragment over a group's pages."""
    src = src_start + pages.src_pages * src_page_stride
    dst = dst_start + pages.dst_pages * dst_page_stride
    if rows > 1:
        row = np.arange(rows, dtype=np.int64)
        src = (src[:, None] + row * src_row_stride).ravel()
        dst = (dst[:, None] + row * dst_row_stride).ravel()
    return CopyPlan(src, dst, np.full(len(src), bytes_per_row, dtype=np.int64))


def _step_copies(
    *,
    src_contract: CacheContract,
    src_base: int,
    dst_contract: CacheContract,
    dst_base: int,
    groups: Sequence[_GroupPages],
    fragments: Sequence[Fragment],
    fields: frozenset[str] | None,
) -> CopyPlan:
    parts: list[CopyPlan] = []
    by_group: dict[str, list[Fragment]] = {}
    for fragment in fragments:
        by_group.setdefault(fragment.group_id, []).append(fragment)
    for pages in groups:
        gid = pages.group_id
        if fragments:
            for fragment in by_group.get(gid, ()):
                if fields is not None and fragment.field_id not in fields:
                    continue
                src_field = src_contract.field(fragment.field_id)
                dst_field = dst_contract.field(fragment.field_id)
                parts.append(
                    _field_copies(
                        src_base
                        + src_contract.page_offset(src_field, 0)
                        + fragment.src_byte_offset,
                        src_field.page_stride_bytes,
                        dst_base
                        + dst_contract.page_offset(dst_field, 0)
                        + fragment.dst_byte_offset,
                        dst_field.page_stride_bytes,
                        pages,
                        rows=fragment.rows_per_page,
                        src_row_stride=fragment.src_row_stride_bytes,
                        dst_row_stride=fragment.dst_row_stride_bytes,
                        bytes_per_row=fragment.bytes_per_row,
                    )
                )
        else:
            for src_field in src_contract.fields_for_group(gid):
                if fields is not None and src_field.field_id not in fields:
                    continue
                dst_field = dst_contract.field(src_field.field_id)
                parts.append(
                    _field_copies(
                        src_base + src_contract.page_offset(src_field, 0),
                        src_field.page_stride_bytes,
                        dst_base + dst_contract.page_offset(dst_field, 0),
                        dst_field.page_stride_bytes,
                        pages,
                        bytes_per_row=src_field.payload_bytes,
                    )
                )
    return CopyPlan.concat(parts)


def plan_steps(
    *,
    src_contract: CacheContract,
    src_base: int,
    dst_contract: CacheContract,
    dst_base: int,
    dst_manifest: BlockManifest,
    source: BlockManifest | Selection,
    registration: PlannedRegistration,
    steps: Sequence[frozenset[str] | None],
) -> tuple[CopyPlan, ...]:
    """Plan the copies to one destination for every entry of ``steps`` (R-pd's
    ``copies(steps)``): ``[None]`` moves every field (a full transfer), a layerwise
    transfer passes each interval's field set. All plans are built and checked
    against both arenas before this returns, so a bad plan fails before any write.

    ``source`` is this rank's block manifest (full mode) or the chunk's selection
    (layerwise). Each plan is in §6.7 emission order and not coalesced.
    """
    src_len = src_contract.arena_bytes
    dst_len = dst_contract.arena_bytes
    for name, base, size in (("source", src_base, src_len), ("destination", dst_base, dst_len)):
        if base < 0 or base + size > MAX_ADDRESS:
            raise PlanError(f"{name} arena [{base:#x}, +{size}) is not a valid address range")
    groups = _group_pages(
        src_contract=src_contract,
        dst_contract=dst_contract,
        dst_manifest=dst_manifest,
        source=source,
        owner_filters=registration.owner_filters,
        filtered=bool(registration.fragments),
    )
    plans = []
    for fields in steps:
        plan = _step_copies(
            src_contract=src_contract,
            src_base=src_base,
            dst_contract=dst_contract,
            dst_base=dst_base,
            groups=groups,
            fragments=registration.fragments,
            fields=fields,
        )
        check_bounds(plan, src_base=src_base, src_len=src_len, dst_base=dst_base, dst_len=dst_len)
        plans.append(plan)
    return tuple(plans)


def plan_copies(
    *,
    src_contract: CacheContract,
    src_base: int,
    dst_contract: CacheContract,
    dst_base: int,
    dst_manifest: BlockManifest,
    source: BlockManifest | Selection,
    registration: PlannedRegistration,
    fields: frozenset[str] | None = None,
) -> CopyPlan:
    """The copies that move ``source``'s pages to one destination (spec §6.7),
    limited to ``fields`` when given. See :func:`plan_steps`."""
    (plan,) = plan_steps(
        src_contract=src_contract,
        src_base=src_base,
        dst_contract=dst_contract,
        dst_base=dst_base,
        dst_manifest=dst_manifest,
        source=source,
        registration=registration,
        steps=(fields,),
    )
    return plan
