"""Transfer route planning between a Prefill TP group and a Decode TP group.

The rules are those of docs/protocol.md#proto-planning. A *route* says, for one Decode
TP rank, which Prefill TP ranks hold its bytes and which byte ranges of each field page
each one sends (:class:`Fragment`). Equal TP sizes use the whole-copy route: Decode rank
``d`` reads Prefill rank ``d`` and an empty fragment tuple means "copy every field
whole". Heterogeneous TP sizes split head-partitioned fields into per-rank intervals and
read replicated fields from one Prefill rank.

Both peers plan: Decode with :class:`RoutePlanner` to learn which Prefill ranks to
register with and expect status from (docs/protocol.md#proto-dummies), Prefill with
:func:`plan_registration` once per registration to learn what to send
(docs/protocol.md#proto-prefill-planning). Planning is per registration, never per
room, so :class:`RoutePlanner` caches every rank's route.

Error messages use TokenSpeed's newer "Cache …" wording (S3/R-pd) verbatim.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NamedTuple

from tspd.core.contract import CacheContract, FieldSpec, Partition, validate_peer_layout
from tspd.core.errors import ContractError, PlanError

__all__ = [
    "MAX_TP_SIZE",
    "DecodeRoute",
    "FanoutMember",
    "Fragment",
    "OwnerFilter",
    "PlannedRegistration",
    "RoutePlanner",
    "plan_registration",
    "validate_fanout",
    "validate_owner_filters",
]

#: Largest TP size either peer may declare (docs/protocol.md#proto-planner-checks).
MAX_TP_SIZE = 1024


@dataclass(frozen=True, slots=True)
class Fragment:
    """One byte range of one field page that a Prefill rank sends a Decode rank.

    Per page, ``rows_per_page`` rows of ``bytes_per_row`` bytes are copied; row ``r``
    starts ``src_byte_offset + r * src_row_stride_bytes`` into the source field page
    and ``dst_byte_offset + r * dst_row_stride_bytes`` into the destination's. Arena
    bases, page offsets and page strides come from the two contracts at copy time.
    """

    group_id: str
    field_id: str
    src_byte_offset: int
    dst_byte_offset: int
    src_row_stride_bytes: int
    dst_row_stride_bytes: int
    bytes_per_row: int
    rows_per_page: int


@dataclass(frozen=True, slots=True)
class OwnerFilter:
    """Which virtual blocks of a DCP-sharded Prefill group this rank owns
    (docs/protocol.md#proto-owner-filters).

    Virtual block ``v >= 1`` belongs to owner ``(v - 1) % owner_count`` and lives in
    that owner's local page ``(v - 1) // owner_count + 1``; block 0 is never owned.
    """

    owner_rank: int
    owner_count: int

    def __post_init__(self) -> None:
        if not (self.owner_count >= 2 and 0 <= self.owner_rank < self.owner_count):
            raise PlanError("cache page owner filter needs 0 <= rank < count >= 2")

    def owns(self, block_id: int) -> bool:
        """Whether virtual block ``block_id`` is stored on this owner."""
        return block_id >= 1 and (block_id - 1) % self.owner_count == self.owner_rank

    def local_page(self, block_id: int) -> int:
        """The owner's local page holding virtual block ``block_id``."""
        return (block_id - 1) // self.owner_count + 1


#: Per sharded group id: the owner filter, or ``None`` for "send nothing of it".
OwnerFilters = Mapping[str, OwnerFilter | None]

_NO_FILTERS: OwnerFilters = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class DecodeRoute:
    """Where one Decode rank's bytes come from.

    ``fragments_by_prefill_rank`` maps each source Prefill rank (ascending) to its
    fragments in group, field, part order; an empty tuple is the equal-TP whole
    copy. ``owner_filters`` maps each source rank to its decision per sharded group.
    """

    decode_rank: int
    fragments_by_prefill_rank: Mapping[int, tuple[Fragment, ...]]
    owner_filters: Mapping[int, OwnerFilters] = field(default_factory=dict)

    @property
    def target_prefill_ranks(self) -> tuple[int, ...]:
        """The Prefill ranks that send data to this Decode rank, ascending."""
        return tuple(sorted(self.fragments_by_prefill_rank))

    @property
    def is_whole_copy(self) -> bool:
        """Whether this is the equal-TP route (every field copied whole)."""
        return all(not fragments for fragments in self.fragments_by_prefill_rank.values())


@dataclass(frozen=True, slots=True)
class PlannedRegistration:
    """What one Prefill rank keeps for one Decode rank's registration
    (docs/protocol.md#proto-prefill-planning).

    ``is_dummy``: this Prefill rank owns no data for the Decode TP group and only
    takes part in the status agreement; it then expects Decode rank 0 alone.
    ``expected_decode_ranks``: the Decode ranks whose pre-allocations complete a
    room's destination set on this Prefill rank. Compared for equality (a changed
    plan makes a re-registration conflicting), never hashed.
    """

    fragments: tuple[Fragment, ...]
    owner_filters: OwnerFilters
    is_dummy: bool
    expected_decode_ranks: frozenset[int]


class FanoutMember(NamedTuple):
    """One destination of a room as :func:`validate_fanout` sees it: the TP metadata
    of the registration its session maps to."""

    decode_tp_size: int
    decode_tp_rank: int
    expected_decode_ranks: frozenset[int]


@dataclass(frozen=True, slots=True)
class _Shards:
    """How a partitioned field is split over one peer's TP group
    (docs/protocol.md#proto-fragments)."""

    local_extent: int
    replicas: int  # R = T / N: ranks holding the same shard
    parts: tuple[int, ...]  # global extents of the parts, in order
    shard_count: int  # N = G / L

    def intervals(self, rank: int) -> list[tuple[int, int, int]]:
        """Per part: ``(global start, global end, local offset)`` of ``rank``'s shard."""
        shard = rank // self.replicas
        out = []
        global_offset = 0
        local_offset = 0
        for part in self.parts:
            width = part // self.shard_count
            start = global_offset + shard * width
            out.append((start, start + width, local_offset))
            global_offset += part
            local_offset += width
        return out


def _check_tp_sizes(prefill_tp: int, decode_tp: int) -> None:
    if prefill_tp <= 0 or decode_tp <= 0:
        raise PlanError("Cache TP sizes must be positive")
    if prefill_tp > MAX_TP_SIZE or decode_tp > MAX_TP_SIZE:
        raise PlanError("Cache TP sizes cannot exceed 1024")


def _shards(spec: FieldSpec, partition: Partition, tp: int) -> _Shards:
    """How ``spec``'s partition spreads over ``tp`` ranks, or :class:`PlanError`."""
    local = spec.shape[partition.axis]
    extent = partition.global_extent
    shards = extent // local
    if extent % local or shards > tp or tp % shards or any(p % shards for p in partition.parts):
        raise PlanError(
            f"Cache field {spec.field_id!r} cannot map global extent {extent} "
            f"and local extent {local} to TP={tp}"
        )
    return _Shards(local, tp // shards, partition.parts, shards)


def _shard_count(contract: CacheContract, group_id: str) -> int:
    """A group's DCP shard count (S3 ``shard_count``; 1 = unsharded, the only value
    an S1 contract can carry)."""
    return contract.group(group_id).shard_count


class RoutePlanner:
    """Routes between a Prefill TP group of ``prefill_tp`` ranks and a Decode TP
    group of ``decode_tp`` ranks, validated once (docs/protocol.md#proto-planner-checks)
    and cached per Decode rank.

    Raises :class:`ContractError` when the two contracts are incompatible
    (docs/protocol.md#proto-peer-compat, or different rank-local field geometry at equal
    TP sizes) and :class:`PlanError` when the peers cannot exchange caches otherwise:
    bad TP sizes, a partition that does not map onto a TP size, or an unsupported DCP
    sharding.
    """

    def __init__(
        self,
        prefill_tp: int,
        decode_tp: int,
        prefill: CacheContract,
        decode: CacheContract,
    ) -> None:
        _check_tp_sizes(prefill_tp, decode_tp)
        validate_peer_layout(prefill, decode)
        self.prefill_tp = prefill_tp
        self.decode_tp = decode_tp
        self.prefill = prefill
        self.decode = decode
        self._routes: dict[int, DecodeRoute] = {}
        self._served: dict[int, frozenset[int]] | None = None
        # Per Decode rank, asked for every room routed: computed once.
        self._expected: dict[int, frozenset[int]] = {}
        self._targets: dict[int, tuple[int, ...]] = {}

        self._group_ids: tuple[str, ...] = tuple(prefill.group_ids)
        # Field pairs per group, in sorted-id order (fields_for_group,
        # docs/protocol.md#proto-contract-derived).
        self._pairs: dict[str, tuple[tuple[FieldSpec, FieldSpec], ...]] = {
            gid: tuple(
                zip(prefill.fields_for_group(gid), decode.fields_for_group(gid), strict=True)
            )
            for gid in self._group_ids
        }
        pairs = [pair for group in self._pairs.values() for pair in group]
        # Checks in the order of the table in docs/protocol.md#proto-planner-checks,
        # so that a contract with several faults reports the one TokenSpeed would.
        if prefill_tp == decode_tp:
            for local, peer in pairs:
                if local.shape != peer.shape or local.payload_bytes != peer.payload_bytes:
                    raise ContractError(
                        f"equal-TP Cache field {local.field_id!r} rank-local geometry differs"
                    )
        self._partitions: dict[str, tuple[_Shards, _Shards]] = {}
        for local, peer in pairs:
            partition = prefill.partition_of(local.field_id)
            if partition is not None:
                self._partitions[local.field_id] = (
                    _shards(local, partition, prefill_tp),
                    _shards(peer, partition, decode_tp),
                )
        self._sharded: dict[str, int] = {}
        for gid in self._group_ids:
            if _shard_count(decode, gid) > 1:
                raise PlanError(
                    f"cache group {gid!r} is sharded on Decode; PD transfer into a "
                    "DCP-sharded destination is not supported"
                )
        for gid in self._group_ids:
            shards = _shard_count(prefill, gid)
            if shards > 1:
                if prefill_tp % shards:
                    raise PlanError(
                        f"cache group {gid!r} shard count {shards} does not divide "
                        f"Prefill TP={prefill_tp}"
                    )
                self._sharded[gid] = shards
        for local, _ in pairs:
            if local.field_id in self._partitions and local.group_id in self._sharded:
                raise PlanError(
                    f"cache field {local.field_id!r} is both head-partitioned and "
                    "page-sharded on Prefill"
                )
        self._whole_copy = prefill_tp == decode_tp and not self._sharded

    @property
    def sharded_groups(self) -> Mapping[str, int]:
        """Prefill groups dealt over DCP owners, with their shard counts."""
        return MappingProxyType(self._sharded)

    # -- routes ---------------------------------------------------------------

    def plan(self, decode_rank: int) -> DecodeRoute:
        """The route of Decode TP rank ``decode_rank`` (cached)."""
        route = self._routes.get(decode_rank)
        if route is None:
            route = self._plan(decode_rank)
            self._routes[decode_rank] = route
        return route

    def _plan(self, d: int) -> DecodeRoute:
        if not 0 <= d < self.decode_tp:
            raise PlanError(f"decode_tp_rank={d} is out of range")
        if self._whole_copy:
            return DecodeRoute(d, MappingProxyType({d: ()}), MappingProxyType({}))
        by_rank: dict[int, list[Fragment]] = {}
        replicated_source = d * self.prefill_tp // self.decode_tp
        for gid in self._group_ids:
            shards = self._sharded.get(gid, 1)
            for local, peer in self._pairs[gid]:
                split = self._partitions.get(local.field_id)
                if split is None:
                    first = replicated_source - replicated_source % shards
                    fragment = Fragment(
                        group_id=gid,
                        field_id=local.field_id,
                        src_byte_offset=0,
                        dst_byte_offset=0,
                        src_row_stride_bytes=local.payload_bytes,
                        dst_row_stride_bytes=peer.payload_bytes,
                        bytes_per_row=local.payload_bytes,
                        rows_per_page=1,
                    )
                    for p in range(first, first + shards):
                        by_rank.setdefault(p, []).append(fragment)
                    continue
                for p, fragment in self._partitioned(gid, local, peer, split, d):
                    by_rank.setdefault(p, []).append(fragment)
        if not by_rank:
            raise PlanError(f"Cache decode TP rank {d} has no source fragments")
        fragments = {p: tuple(by_rank[p]) for p in sorted(by_rank)}
        filters: dict[int, OwnerFilters] = {}
        for p, frags in fragments.items():
            present = {f.group_id for f in frags}
            filters[p] = MappingProxyType(
                {
                    gid: OwnerFilter(p % shards, shards) if gid in present else None
                    for gid, shards in self._sharded.items()
                }
            )
        return DecodeRoute(d, MappingProxyType(fragments), MappingProxyType(filters))

    def _partitioned(
        self,
        gid: str,
        local: FieldSpec,
        peer: FieldSpec,
        split: tuple[_Shards, _Shards],
        d: int,
    ) -> Iterable[tuple[int, Fragment]]:
        """Fragments of one partitioned field for Decode rank ``d``, by source rank."""
        src_split, dst_split = split
        partition = self.prefill.partition_of(local.field_id)
        assert partition is not None
        axis = partition.axis
        shape = local.shape
        inner = math.prod(shape[axis + 1 :]) * local.dtype_width
        rows = math.prod(shape[:axis])
        src_stride = shape[axis] * inner
        dst_stride = peer.shape[axis] * inner
        dst_intervals = dst_split.intervals(d)
        for p in range(0, self.prefill_tp, src_split.replicas):
            for (sa, sb, s_local), (da, db, d_local) in zip(
                src_split.intervals(p), dst_intervals, strict=True
            ):
                a, b = max(sa, da), min(sb, db)
                if a >= b:
                    continue
                width = (b - a) * inner
                if rows > 1 and src_stride == width and dst_stride == width:
                    row_bytes, n_rows, s_step, d_step = width * rows, 1, width * rows, width * rows
                else:
                    row_bytes, n_rows, s_step, d_step = width, rows, src_stride, dst_stride
                yield (
                    p,
                    Fragment(
                        group_id=gid,
                        field_id=local.field_id,
                        src_byte_offset=(s_local + a - sa) * inner,
                        dst_byte_offset=(d_local + a - da) * inner,
                        src_row_stride_bytes=s_step,
                        dst_row_stride_bytes=d_step,
                        bytes_per_row=row_bytes,
                        rows_per_page=n_rows,
                    ),
                )

    # -- served sets, expected ranks, dummies (docs/protocol.md#proto-dummies) ----

    def _served_sets(self) -> dict[int, frozenset[int]]:
        if self._served is None:
            served: dict[int, set[int]] = {p: set() for p in range(self.prefill_tp)}
            for d in range(self.decode_tp):
                for p in self.plan(d).fragments_by_prefill_rank:
                    served[p].add(d)
            self._served = {p: frozenset(ds) for p, ds in served.items()}
        return self._served

    def decode_ranks_by_prefill_rank(self, prefill_rank: int) -> frozenset[int]:
        """The Decode ranks whose route reads Prefill rank ``prefill_rank``."""
        if not 0 <= prefill_rank < self.prefill_tp:
            raise PlanError(f"prefill_tp_rank={prefill_rank} is out of range")
        return self._served_sets()[prefill_rank]

    def dummy_prefill_ranks(self) -> tuple[int, ...]:
        """Prefill ranks that serve no Decode rank (rendezvous only), ascending."""
        return tuple(p for p, served in sorted(self._served_sets().items()) if not served)

    def expected_prefill_ranks(self, decode_rank: int) -> frozenset[int]:
        """The Prefill ranks whose status message Decode rank ``decode_rank`` awaits
        (its route's targets; dummies never report)."""
        expected = self._expected.get(decode_rank)
        if expected is None:
            expected = frozenset(self.plan(decode_rank).fragments_by_prefill_rank)
            self._expected[decode_rank] = expected
        return expected

    def target_tp_ranks(self, decode_rank: int) -> tuple[int, ...]:
        """The Prefill ranks Decode rank ``decode_rank`` registers and pre-allocates
        with: its targets, plus every dummy rank for Decode rank 0."""
        cached = self._targets.get(decode_rank)
        if cached is not None:
            return cached
        targets = set(self.plan(decode_rank).fragments_by_prefill_rank)
        if decode_rank == 0:
            targets.update(self.dummy_prefill_ranks())
        self._targets[decode_rank] = ordered = tuple(sorted(targets))
        return ordered


# -- Prefill side (docs/protocol.md#proto-prefill-planning) --------------------


def validate_owner_filters(
    contract: CacheContract,
    fragments: Sequence[Fragment],
    owner_filters: OwnerFilters,
) -> None:
    """Check one registration's owner filters against the local group specs
    (docs/protocol.md#proto-owner-filters)."""
    sharded = {gid: _shard_count(contract, gid) for gid in contract.group_ids}
    sharded = {gid: count for gid, count in sharded.items() if count > 1}
    with_fragments = {fragment.group_id for fragment in fragments}
    for gid in owner_filters:
        if gid not in sharded:
            raise PlanError(f"owner filter names cache group {gid!r}, which is not sharded")
    for gid, count in sharded.items():
        if gid not in owner_filters:
            raise PlanError(
                f"cache group {gid!r} is sharded but the registration route carries no "
                "owner-filter decision for it"
            )
        owner = owner_filters[gid]
        if owner is None:
            if gid in with_fragments:
                raise PlanError(
                    f"the registration route carries fragments of sharded cache group "
                    f"{gid!r} but no owner filter"
                )
            continue
        if owner.owner_count != count:
            raise PlanError(
                f"cache group {gid!r} owner filter ({owner.owner_count} owners) disagrees "
                f"with its shard count {count}"
            )
        if gid not in with_fragments:
            raise PlanError(
                f"cache group {gid!r} has an owner filter but the registration route "
                "carries no fragment of it"
            )


def plan_registration(
    *,
    prefill_tp: int,
    prefill_rank: int,
    prefill_contract: CacheContract,
    decode_tp: int,
    decode_rank: int,
    decode_contract: CacheContract,
) -> PlannedRegistration:
    """Plan what Prefill rank ``prefill_rank`` sends for one Decode rank's
    registration (docs/protocol.md#proto-prefill-planning). Raises
    :class:`ContractError` (incompatible contracts) or :class:`PlanError`, whose
    message becomes the registration's rejection reason
    (docs/protocol.md#proto-registration-handling)."""
    planner = RoutePlanner(prefill_tp, decode_tp, prefill_contract, decode_contract)
    route = planner.plan(decode_rank)
    served = planner.decode_ranks_by_prefill_rank(prefill_rank)
    if prefill_rank in route.fragments_by_prefill_rank:
        planned = PlannedRegistration(
            fragments=route.fragments_by_prefill_rank[prefill_rank],
            owner_filters=route.owner_filters.get(prefill_rank, _NO_FILTERS),
            is_dummy=False,
            expected_decode_ranks=served,
        )
    elif decode_rank == 0 and not served:
        planned = PlannedRegistration(
            fragments=(),
            owner_filters=MappingProxyType(dict.fromkeys(planner.sharded_groups)),
            is_dummy=True,
            expected_decode_ranks=frozenset({0}),
        )
    else:
        raise PlanError("CachePD Decode registration targets the wrong Prefill TP rank")
    validate_owner_filters(prefill_contract, planned.fragments, planned.owner_filters)
    return planned


def validate_fanout(
    members: Sequence[FanoutMember | tuple[int, int, frozenset[int]] | None],
) -> None:
    """Check a room's complete destination set on a Prefill rank
    (docs/protocol.md#proto-fanout).

    ``members`` has one entry per destination: its registration's
    ``(decode_tp_size, decode_tp_rank, expected_decode_ranks)``, or ``None`` when the
    destination's session is not registered. Every destination must share one TP
    size and one expected set, and their ranks must be exactly that set, once each.
    """
    if len(members) == 1 and members[0] is not None:  # one destination: its own rank
        _, rank, wanted = members[0]
        if len(wanted) == 1 and rank in wanted:
            return
    known: list[FanoutMember] = []
    for member in members:
        if member is None:
            raise PlanError("CachePD request references an unregistered Decode session")
        known.append(FanoutMember(*member))
    sizes = {member.decode_tp_size for member in known}
    expected = {member.expected_decode_ranks for member in known}
    if len(sizes) != 1 or len(expected) != 1:
        raise PlanError("Cache-transfer room has inconsistent TP metadata")
    (wanted,) = expected
    ranks = [member.decode_tp_rank for member in known]
    if len(ranks) != len(wanted) or set(ranks) != wanted:
        raise PlanError("Cache-transfer room destination ranks disagree with the typed route plan")
