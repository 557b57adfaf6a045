"""Copy generation: a planned registration and a request's block ids → byte copies.

A copy is one ``(src, dst, length)`` descriptor handed to the transfer engine: ``src``
an absolute address in this rank's registered arena, ``dst`` one in the Decode rank's.
:func:`plan_copies` reproduces the emission order of docs/protocol.md#proto-copies
exactly (group → field or fragment → page → row), vectorised with numpy over pages and
rows so a room of tens of thousands of pages costs a few array operations, not a Python
loop per page. A small plan (at most :data:`SMALL_PLAN_COPIES` copies, a typical
hand-over of a few pages) is built with plain Python ints instead, where numpy's
per-call overhead would dominate: same copies, same order, same checks, and any input
the fast path does not plainly accept is re-planned by numpy, which raises the usual
error. Facts that depend only on the route (group order, arena lengths, per-field
offsets and strides) are derived once and kept across rooms.

Three transport-facing steps follow planning, each a pure function of a plan:

* :func:`coalesce` merges runs of copies that are adjacent on both sides. Mooncake
  over TCP costs about 40 µs a descriptor (``tspd bench pd`` measures it), so one
  write per contiguous run instead of one per page is the largest single saving
  (docs/protocol.md#proto-copies).
* :func:`check_bounds` proves every copy lies inside both registered arenas: the
  TCP transport does not check the local source, so a plan that leaves an arena is
  refused here, before any write.
* :func:`batches` cuts a plan into engine calls of at most
  :data:`DEFAULT_MAX_DESCRIPTORS` descriptors.

Every copy of every step is planned before the first write (docs/protocol.md#proto-copies):
:func:`plan_steps` returns all step plans at once or raises.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import final

import numpy as np
import numpy.typing as npt

from tspd.core.contract import CacheContract
from tspd.core.errors import PlanError
from tspd.core.manifest import BlockManifest, ManifestGroup, Selection, SelectionGroup
from tspd.core.planner import Fragment, OwnerFilter, PlannedRegistration

__all__ = [
    "DEFAULT_MAX_DESCRIPTORS",
    "MAX_ADDRESS",
    "SMALL_PLAN_COPIES",
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

#: Copies up to which :func:`plan_steps` plans in plain Python: below it numpy's
#: per-call overhead (about 1-5 µs a call, a few calls a field) costs more than the
#: arithmetic. Measured (scattered pages, coalesced): one 4 KiB field, 1 / 8 / 32 /
#: 48 / 64 pages plan in 7 / 11 / 20 / 27 / 32 µs in Python against 23 / 27 / 26 /
#: 27 / 28 µs through numpy; four fields break even near 96 copies (24 pages). The
#: Python path costs about 0.4 µs a copy.
SMALL_PLAN_COPIES = 48

Int64Array = npt.NDArray[np.int64]

#: Plans up to this many copies sum their lengths in Python (:attr:`CopyPlan.total_bytes`).
_SHORT_SUM = 64

_EMPTY: Int64Array = np.zeros(0, dtype=np.int64)
_EMPTY.setflags(write=False)


@final
class CopyPlan:
    """An ordered list of copies as three equal-length int64 arrays.

    ``src[i]`` and ``dst[i]`` are absolute addresses, ``length[i]`` the byte count
    of copy ``i``. A plan is a value: the constructor marks the arrays it is given
    read-only (copy them first to keep a writable array), and its attributes cannot
    be set. Iterating yields ``(src, dst, length)`` tuples of Python ints (for tests
    and logs; the shell hands :meth:`tolist`'s columns, or the arrays, to the
    engine).

    A small plan built in plain Python (:func:`plan_steps`' fast path) keeps its
    columns as the lists it was built from and makes the arrays only when they are
    read: a one-page room goes from planning to the engine call without numpy
    (building the arrays and reading them back was ~15 µs of a one-page hand-over on
    the 2-core host).
    """

    __slots__ = ("_columns", "_dst", "_length", "_src")

    _src: Int64Array | None
    _dst: Int64Array | None
    _length: Int64Array | None
    _columns: tuple[list[int], list[int], list[int]] | None

    def __init__(self, src: Int64Array, dst: Int64Array, length: Int64Array) -> None:
        if not (len(src) == len(dst) == len(length)):
            raise PlanError(
                f"copy plan arrays differ in length: {len(src)} sources, "
                f"{len(dst)} destinations, {len(length)} lengths"
            )
        for array in (src, dst, length):
            if array.dtype != np.int64 or array.ndim != 1:
                raise PlanError("copy plan arrays must be one-dimensional int64")
            array.setflags(write=False)
        _init(self, src, dst, length, None)

    @classmethod
    def _of_lists(cls, src: list[int], dst: list[int], length: list[int]) -> CopyPlan:
        """A plan of three equal-length lists of int64-range ints that the caller
        owns no more and has checked (the arrays come when read)."""
        plan = object.__new__(cls)
        _init(plan, None, None, None, (src, dst, length))
        return plan

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"a CopyPlan is immutable: cannot set {name!r}")

    def _arrays(self) -> tuple[Int64Array, Int64Array, Int64Array]:
        src, dst, length = self._src, self._dst, self._length
        if src is None or dst is None or length is None:
            assert self._columns is not None
            table = np.array(self._columns, dtype=np.int64).reshape(3, -1)
            table.setflags(write=False)
            src, dst, length = table[0], table[1], table[2]
            _init(self, src, dst, length, self._columns)
        return src, dst, length

    @property
    def src(self) -> Int64Array:
        """Source addresses (read-only)."""
        return self._src if self._src is not None else self._arrays()[0]

    @property
    def dst(self) -> Int64Array:
        """Destination addresses (read-only)."""
        return self._dst if self._dst is not None else self._arrays()[1]

    @property
    def length(self) -> Int64Array:
        """Byte counts (read-only)."""
        return self._length if self._length is not None else self._arrays()[2]

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
        columns = self._columns
        if columns is not None:
            return len(columns[2])
        assert self._length is not None
        return len(self._length)

    def __iter__(self) -> Iterator[tuple[int, int, int]]:
        return zip(*self.tolist(), strict=True)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CopyPlan):
            return NotImplemented
        if self._columns is not None and other._columns is not None:
            return self._columns == other._columns
        return (
            np.array_equal(self.src, other.src)
            and np.array_equal(self.dst, other.dst)
            and np.array_equal(self.length, other.length)
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"CopyPlan({len(self)} copies, {self.total_bytes} bytes)"

    def __reduce__(self) -> tuple[object, tuple[Int64Array, Int64Array, Int64Array]]:
        return (CopyPlan, self._arrays())

    @property
    def total_bytes(self) -> int:
        """Bytes moved by the whole plan (a Python sum for short plans, where a numpy
        reduction's fixed cost dominates)."""
        columns = self._columns
        if columns is not None:
            return sum(columns[2])
        length = self.length
        if len(length) <= _SHORT_SUM:
            return sum(length.tolist())
        return int(length.sum())

    def columns(self) -> tuple[Sequence[int] | Int64Array, ...]:
        """The three columns in the form at hand, for an engine call: the read-only
        lists a small plan was built from (do not change them), else the arrays."""
        columns = self._columns
        if columns is not None:
            return columns
        return self._arrays()

    def tolist(self) -> tuple[list[int], list[int], list[int]]:
        """The three columns as Python int lists (the engine's argument form), new
        lists the caller may keep or change."""
        columns = self._columns
        if columns is not None:
            return list(columns[0]), list(columns[1]), list(columns[2])
        src, dst, length = self._arrays()
        return src.tolist(), dst.tolist(), length.tolist()


def _init(
    plan: CopyPlan,
    src: Int64Array | None,
    dst: Int64Array | None,
    length: Int64Array | None,
    columns: tuple[list[int], list[int], list[int]] | None,
) -> None:
    setter = object.__setattr__
    setter(plan, "_src", src)
    setter(plan, "_dst", dst)
    setter(plan, "_length", length)
    setter(plan, "_columns", columns)


def coalesce(plan: CopyPlan) -> CopyPlan:
    """Merge consecutive copies that continue each other on both sides.

    Copy ``i+1`` joins copy ``i``'s run when ``src[i] + length[i] == src[i+1]`` and
    ``dst[i] + length[i] == dst[i+1]``. Only neighbours in emission order merge; the
    plan is never sorted. A merged run writes exactly the bytes its members would,
    in the same order relative to every other copy, so even a plan whose
    destinations overlap (which no valid manifest produces, and whose outcome a
    parallel engine would not define anyway) keeps its last-writer-wins result.
    Sorting first would find more runs in scattered plans, but the emission order of
    docs/protocol.md#proto-copies is page-major per field, so contiguous allocations
    are already neighbours.
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


# -- planning (docs/protocol.md#proto-copies) ------------------------------------


@dataclass(frozen=True, slots=True)
class _GroupPages:
    """One group's page pairs for one destination: source pages (local, after any
    owner filter) and destination pages, position by position."""

    group_id: str
    src_pages: Int64Array
    dst_pages: Int64Array


#: Element types that are not block ids, though numpy reads them as 0 and 1.
_NOT_IDS: frozenset[type] = frozenset((bool, np.bool_))


def _ids(ids: Sequence[int], *, what: str, group_id: str) -> Int64Array:
    """Block ids or positions as an int64 array (a value beyond int64 is refused, and
    so is a ``bool``, which numpy would silently read as 0 or 1)."""
    try:
        if not _NOT_IDS.isdisjoint(map(type, ids)):
            raise TypeError("a bool is not a block id")
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


#: One field or fragment of one group, as a step copies it: source start (arena base
#: + field page-0 offset + fragment offset), source page stride, destination start
#: and page stride, rows per page, source and destination row strides, bytes a row.
_Lane = tuple[int, int, int, int, int, int, int, int]


def _lanes(
    *,
    src_contract: CacheContract,
    src_base: int,
    dst_contract: CacheContract,
    dst_base: int,
    group_id: str,
    by_group: Mapping[str, Sequence[Fragment]] | None,
    fields: frozenset[str] | None,
) -> list[_Lane]:
    """The lanes of one group for one step, in the order of
    docs/protocol.md#proto-copies (fragments in registration order, else the group's
    fields sorted by id). Both planning paths share this, so they copy with the same
    offsets and strides. Each lane is checked to stay within :data:`MAX_ADDRESS` over
    all of its group's pages on both sides (a peer's contract may describe any
    geometry), so no int64 arithmetic downstream wraps."""
    lanes: list[_Lane] = []
    if by_group is not None:
        for fragment in by_group.get(group_id, ()):
            if fields is not None and fragment.field_id not in fields:
                continue
            src_field = src_contract.field(fragment.field_id)
            dst_field = dst_contract.field(fragment.field_id)
            lanes.append(
                (
                    src_base + src_contract.page_offset(src_field, 0) + fragment.src_byte_offset,
                    src_field.page_stride_bytes,
                    dst_base + dst_contract.page_offset(dst_field, 0) + fragment.dst_byte_offset,
                    dst_field.page_stride_bytes,
                    fragment.rows_per_page,
                    fragment.src_row_stride_bytes,
                    fragment.dst_row_stride_bytes,
                    fragment.bytes_per_row,
                )
            )
    else:
        for src_field in src_contract.fields_for_group(group_id):
            if fields is not None and src_field.field_id not in fields:
                continue
            dst_field = dst_contract.field(src_field.field_id)
            lanes.append(
                (
                    src_base + src_contract.page_offset(src_field, 0),
                    src_field.page_stride_bytes,
                    dst_base + dst_contract.page_offset(dst_field, 0),
                    dst_field.page_stride_bytes,
                    1,
                    0,
                    0,
                    src_field.payload_bytes,
                )
            )
    src_pages = src_contract.page_count(group_id)
    dst_pages = dst_contract.page_count(group_id)
    for lane in lanes:
        src_start, src_stride, dst_start, dst_stride, rows, srs, drs, length = lane
        for side, start, stride, pages, row_stride in (
            ("source", src_start, src_stride, src_pages, srs),
            ("destination", dst_start, dst_stride, dst_pages, drs),
        ):
            reach = (
                abs(start)
                + max(pages - 1, 0) * abs(stride)
                + max(rows - 1, 0) * abs(row_stride)
                + abs(length)
            )
            if reach > MAX_ADDRESS:
                raise PlanError(
                    f"the {side} contract's pages of cache group {group_id!r} reach past "
                    f"address {MAX_ADDRESS:#x}; no copy can be planned and nothing was written"
                )
    return lanes


def _fragments_by_group(fragments: Sequence[Fragment]) -> dict[str, list[Fragment]] | None:
    """Fragments per group in registration order; ``None`` for a whole-copy route."""
    if not fragments:
        return None
    by_group: dict[str, list[Fragment]] = {}
    for fragment in fragments:
        by_group.setdefault(fragment.group_id, []).append(fragment)
    return by_group


@dataclass(slots=True, eq=False)
class _Route:
    """What one (source contract and base, destination contract and base,
    registration) always derives, kept across rooms: group order, arena lengths,
    fragments per group, and each (step fields, group)'s lanes once first asked for
    (lazily, so a lane that cannot be built fails when and where it always did)."""

    src_contract: CacheContract
    src_base: int
    dst_contract: CacheContract
    dst_base: int
    registration: PlannedRegistration
    order: tuple[str, ...]
    src_len: int
    dst_len: int
    by_group: dict[str, list[Fragment]] | None
    lanes: dict[tuple[frozenset[str] | None, str], tuple[_Lane, ...]]

    def lanes_of(self, group_id: str, fields: frozenset[str] | None) -> tuple[_Lane, ...]:
        """The lanes of ``group_id`` for a step moving ``fields``."""
        key = (fields, group_id)
        found = self.lanes.get(key)
        if found is None:
            found = tuple(
                _lanes(
                    src_contract=self.src_contract,
                    src_base=self.src_base,
                    dst_contract=self.dst_contract,
                    dst_base=self.dst_base,
                    group_id=group_id,
                    by_group=self.by_group,
                    fields=fields,
                )
            )
            if len(self.lanes) < _MAX_CACHED_LANES:
                self.lanes[key] = found
        return found


#: Routes kept (a Prefill rank has one per Decode registration; the cache is dropped
#: whole when full) and (fields, group) lane lists kept per route.
_MAX_ROUTES = 256
_MAX_CACHED_LANES = 1024
_ROUTES: dict[tuple[int, int, int, int, int], _Route] = {}


def _route(
    src_contract: CacheContract,
    src_base: int,
    dst_contract: CacheContract,
    dst_base: int,
    registration: PlannedRegistration,
) -> _Route:
    """The cached :class:`_Route` of these (immutable) inputs. Keyed by identity: an
    entry holds its objects, so their ids cannot be reused while it lives."""
    key = (id(src_contract), src_base, id(dst_contract), dst_base, id(registration))
    route = _ROUTES.get(key)
    if (
        route is None
        or route.src_contract is not src_contract
        or route.dst_contract is not dst_contract
        or route.registration is not registration
    ):
        route = _Route(
            src_contract,
            src_base,
            dst_contract,
            dst_base,
            registration,
            tuple(src_contract.group_ids),
            src_contract.arena_bytes,
            dst_contract.arena_bytes,
            _fragments_by_group(registration.fragments),
            {},
        )
        if len(_ROUTES) >= _MAX_ROUTES:
            _ROUTES.clear()
        _ROUTES[key] = route
    return route


def _field_copies(lane: _Lane, pages: _GroupPages) -> CopyPlan:
    """Page-major, row-minor copies of one lane over a group's pages."""
    src_start, src_page_stride, dst_start, dst_page_stride, rows, srs, drs, bytes_per_row = lane
    src = src_start + pages.src_pages * src_page_stride
    dst = dst_start + pages.dst_pages * dst_page_stride
    if rows > 1:
        row = np.arange(rows, dtype=np.int64)
        src = (src[:, None] + row * srs).ravel()
        dst = (dst[:, None] + row * drs).ravel()
    return CopyPlan(src, dst, np.full(len(src), bytes_per_row, dtype=np.int64))


def _step_copies(
    route: _Route, groups: Sequence[_GroupPages], fields: frozenset[str] | None
) -> CopyPlan:
    parts: list[CopyPlan] = []
    for pages in groups:
        for lane in route.lanes_of(pages.group_id, fields):
            parts.append(_field_copies(lane, pages))
    return CopyPlan.concat(parts)


def _int_ids(ids: Sequence[int], limit: int) -> bool:
    """Whether every id is a plain Python int in ``[0, limit)`` (the small path's
    check; anything else goes to the numpy path, which names the problem). A plain
    loop: for the few ids of a small room a generator costs more than the test."""
    for i in ids:  # noqa: SIM110
        if type(i) is not int or not 0 <= i < limit:
            return False
    return True


def _small_pages(
    *,
    order: tuple[str, ...],
    src_contract: CacheContract,
    dst_contract: CacheContract,
    dst_manifest: BlockManifest,
    source: BlockManifest | Selection,
    owner_filters: Mapping[str, OwnerFilter | None],
    filtered: bool,
    limit: int,
) -> list[tuple[str, list[int], list[int]]] | None:
    """:func:`_group_pages` over Python lists, for rooms of at most ``limit`` source
    block ids: the same pairs, or ``None`` when the room is bigger or anything is
    not plainly valid (the numpy path then plans it, or raises its exact error).
    Both manifests must list exactly the contract's groups in its order."""
    dst_groups = dst_manifest.groups
    selection = isinstance(source, Selection)
    src_groups: Sequence[ManifestGroup | SelectionGroup] = source.groups
    if len(dst_groups) != len(order) or len(src_groups) != len(order):
        return None
    sources: list[tuple[Sequence[int], Sequence[int] | None]] = []
    total = 0
    for gid, dst_group, src_group in zip(order, dst_groups, src_groups, strict=True):
        if dst_group.group_id != gid or src_group.group_id != gid:
            return None
        if isinstance(src_group, SelectionGroup):
            sources.append((src_group.source_block_ids, src_group.destination_positions))
            total += len(src_group.source_block_ids)
        else:
            sources.append((src_group.block_ids, None))
            total += len(src_group.block_ids)
    if total > limit:  # at least one copy a kept block
        return None
    out = []
    for gid, dst_group, (src_ids, positions) in zip(order, dst_groups, sources, strict=True):
        dst_ids: Sequence[int] = dst_group.block_ids
        if selection:
            assert positions is not None
            if not _int_ids(positions, len(dst_ids)):
                return None
            dst_ids = [dst_ids[p] for p in positions]
        if len(src_ids) != len(dst_ids) or not _int_ids(dst_ids, dst_contract.page_count(gid)):
            return None
        if filtered and gid in owner_filters:
            owner = owner_filters[gid]
            if owner is None:
                if not all(type(i) is int and -(1 << 63) <= i < 1 << 63 for i in src_ids):
                    return None
                continue
            count, rank = owner.owner_count, owner.owner_rank
            if not _int_ids(src_ids, 1 + (src_contract.page_count(gid) - 1) * count):
                return None
            kept = [k for k, v in enumerate(src_ids) if v >= 1 and (v - 1) % count == rank]
            srcs = [(src_ids[k] - 1) // count + 1 for k in kept]
            dsts = [dst_ids[k] for k in kept]
        else:
            if not _int_ids(src_ids, src_contract.page_count(gid)):
                return None
            srcs, dsts = list(src_ids), list(dst_ids)
        if srcs:
            out.append((gid, srcs, dsts))
    return out


def _small_plans(
    route: _Route,
    *,
    dst_manifest: BlockManifest,
    source: BlockManifest | Selection,
    steps: Sequence[frozenset[str] | None],
    coalesced: bool,
    limit: int,
) -> tuple[CopyPlan, ...] | None:
    """:func:`plan_steps` in plain Python for plans of at most ``limit`` copies, where
    numpy's per-call overhead would cost more than the arithmetic: the same copies
    in the same order, bounds-checked the same way and coalesced alike. ``None``
    when the plan is bigger or anything fails a check; the numpy path then plans
    it or raises its exact error."""
    src_base, src_len = route.src_base, route.src_len
    dst_base, dst_len = route.dst_base, route.dst_len
    if src_len < 0 or dst_len < 0:
        return None
    registration = route.registration
    groups = _small_pages(
        order=route.order,
        src_contract=route.src_contract,
        dst_contract=route.dst_contract,
        dst_manifest=dst_manifest,
        source=source,
        owner_filters=registration.owner_filters,
        filtered=bool(registration.fragments),
        limit=limit,
    )
    if groups is None:
        return None
    step_lanes = []
    copies = 0
    for fields in steps:
        per_group = []
        for gid, srcs, dsts in groups:
            lanes = route.lanes_of(gid, fields)
            for lane in lanes:
                copies += len(srcs) * (lane[4] if lane[4] > 1 else 1)
            per_group.append((srcs, dsts, lanes))
        step_lanes.append(per_group)
    if copies > limit:
        return None
    src_end, dst_end = src_base + src_len, dst_base + dst_len
    plans = []
    for per_group in step_lanes:
        src: list[int] = []
        dst: list[int] = []
        length: list[int] = []
        for srcs, dsts, lanes in per_group:
            for s0, sp, d0, dp, rows, srs, drs, n in lanes:
                if rows > 1:
                    ss = [s0 + p * sp + r * srs for p in srcs for r in range(rows)]
                    ds = [d0 + p * dp + r * drs for p in dsts for r in range(rows)]
                else:
                    ss = [s0 + p * sp for p in srcs]
                    ds = [d0 + p * dp for p in dsts]
                if (
                    n <= 0
                    or min(ss) < src_base
                    or max(ss) > src_end - n
                    or min(ds) < dst_base
                    or max(ds) > dst_end - n
                ):
                    return None
                src += ss
                dst += ds
                length += [n] * len(ss)
        if coalesced and len(length) > 1:
            src, dst, length = _coalesce_lists(src, dst, length)
        plans.append(_plan_of_lists(src, dst, length))
    return tuple(plans)


def _coalesce_lists(
    src: list[int], dst: list[int], length: list[int]
) -> tuple[list[int], list[int], list[int]]:
    """:func:`coalesce` over Python lists: a copy continuing the previous run on both
    sides extends it (the run's end is its start plus the lengths merged so far)."""
    out_src, out_dst, out_len = [src[0]], [dst[0]], [length[0]]
    for s, d, n in zip(src[1:], dst[1:], length[1:], strict=True):
        if out_src[-1] + out_len[-1] == s and out_dst[-1] + out_len[-1] == d:
            out_len[-1] += n
        else:
            out_src.append(s)
            out_dst.append(d)
            out_len.append(n)
    return out_src, out_dst, out_len


def _plan_of_lists(src: list[int], dst: list[int], length: list[int]) -> CopyPlan:
    """A plan of three equal-length lists of int64-range ints, kept as lists (the
    columns are known good, so the constructor's checks are skipped)."""
    if not length:
        return CopyPlan.empty()
    return CopyPlan._of_lists(src, dst, length)


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
    coalesced: bool = False,
    small_limit: int = SMALL_PLAN_COPIES,
) -> tuple[CopyPlan, ...]:
    """Plan the copies to one destination for every entry of ``steps`` (R-pd's
    ``copies(steps)``): ``[None]`` moves every field (a full transfer), a layerwise
    transfer passes each interval's field set. All plans are built and checked
    against both arenas before this returns, so a bad plan fails before any write.

    ``source`` is this rank's block manifest (full mode) or the chunk's selection
    (layerwise). Each plan is in the emission order of docs/protocol.md#proto-copies,
    and passed through :func:`coalesce` when ``coalesced``. A plan of at most
    ``small_limit`` copies is built in plain Python (same copies, same checks); bigger
    ones, and any plan that fails a check, go through numpy. ``small_limit=0`` forces
    numpy.
    """
    route = _route(src_contract, src_base, dst_contract, dst_base, registration)
    src_len, dst_len = route.src_len, route.dst_len
    for name, base, size in (("source", src_base, src_len), ("destination", dst_base, dst_len)):
        if base < 0 or base + size > MAX_ADDRESS:
            raise PlanError(f"{name} arena [{base:#x}, +{size}) is not a valid address range")
    if small_limit > 0:
        small = _small_plans(
            route,
            dst_manifest=dst_manifest,
            source=source,
            steps=steps,
            coalesced=coalesced,
            limit=small_limit,
        )
        if small is not None:
            return small
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
        plan = _step_copies(route, groups, fields)
        check_bounds(plan, src_base=src_base, src_len=src_len, dst_base=dst_base, dst_len=dst_len)
        plans.append(coalesce(plan) if coalesced else plan)
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
    """The copies that move ``source``'s pages to one destination
    (docs/protocol.md#proto-copies), limited to ``fields`` when given. See
    :func:`plan_steps`."""
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
