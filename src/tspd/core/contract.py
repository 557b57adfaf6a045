"""The cache transfer contract ("layout"): one rank's KV-cache arena described as JSON.

A contract (docs/protocol.md#proto-contract) names the arena's physical geometry
(:class:`CacheMemoryPlan`: planes, page groups, fields), the semantics of each page
group (:class:`GroupSpec`) and how fields are split across tensor-parallel ranks
(:class:`TransferSchema`). It travels in registration frame 5, in the bootstrap
``PUT /route`` body and in the parallel-info reply, so its canonical serialisation is
part of the wire: two Prefill ranks are compatible iff their contracts are equal as
parsed objects, and a re-serialised contract must be byte-identical to the one
TokenSpeed would emit.

The value types validate on construction exactly what TokenSpeed (S1) validates (dtypes,
group-spec geometry, the transfer schema: docs/protocol.md#proto-contract-errors),
raising :class:`ContractError` with a specific message; :func:`parse_contract` wraps
every decoding or validation failure as ``"invalid cache transfer contract"`` with the
specific error chained, as the specification requires. A peer's contract describes the
peer's memory, so anything S1 accepts is accepted from a peer: planes may overlap or
interleave, strides and counts need not agree. The checks tspd adds on top apply only to
this rank's own contract, through :func:`check_local_contract` (called by the Prefill
and Decode configurations); the copy planner (:mod:`tspd.core.copies`) bounds-checks
every copy against both registered arenas whatever a peer's contract says.
"""

from __future__ import annotations

import dataclasses
import json
import math
import operator
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeVar, cast

from tspd.core.errors import ContractError

__all__ = [
    "DEFAULT_PEER_PREFIX",
    "DTYPE_WIDTHS",
    "FAMILIES",
    "LOCAL_CONTRACT_PREFIX",
    "MAX_ARENA_BYTES",
    "MAX_CONTRACT_BYTES",
    "MAX_GLOBAL_PARTS",
    "RETENTIONS",
    "S1_PEER_PREFIX",
    "TRANSFER_POLICIES",
    "CacheContract",
    "CacheMemoryPlan",
    "FieldSpec",
    "GroupSpec",
    "PageIndexError",
    "Partition",
    "PlanGroup",
    "Plane",
    "TransferSchema",
    "check_local_contract",
    "dtype_width",
    "is_bool",
    "page_index",
    "parse_contract",
    "validate_peer_layout",
]

MAX_CONTRACT_BYTES: Final = 256 << 10
"""Largest contract payload accepted or emitted (262144 bytes)."""

MAX_GLOBAL_PARTS: Final = 16
"""Most parts a composite partition (``global_parts``) may name."""

DEFAULT_PEER_PREFIX: Final = "Cache P/D contract mismatch: "
"""The S3/R-pd prefix of peer-compatibility errors (docs/protocol.md#proto-peer-compat)."""

S1_PEER_PREFIX: Final = "Paged cache P/D contract mismatch: "
"""The S1 prefix of peer-compatibility errors (docs/protocol.md#proto-peer-compat)."""

LOCAL_CONTRACT_PREFIX: Final = "local cache transfer contract: "
"""The prefix of every :func:`check_local_contract` error."""

MAX_ARENA_BYTES: Final = 1 << 62
"""Largest layout :func:`check_local_contract` accepts: the copy planner's address
bound (:data:`tspd.core.copies.MAX_ADDRESS`)."""

DTYPE_WIDTHS: Final[Mapping[str, int]] = {
    "uint8": 1,
    "int8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e8m0fnu": 1,
    "bfloat16": 2,
    "float16": 2,
    "int32": 4,
    "float32": 4,
    "int64": 8,
    "float64": 8,
}
"""Bytes per element of every cache dtype a contract may name."""

RETENTIONS: Final = ("full_history", "sliding_window")
FAMILIES: Final = ("history", "state")
TRANSFER_POLICIES: Final = ("full_suffix", "latest_snapshot")

Retention = Literal["full_history", "sliding_window"]
Family = Literal["history", "state"]
TransferPolicy = Literal["full_suffix", "latest_snapshot"]

_INVALID: Final = "invalid cache transfer contract"
_LAYER_ID = re.compile(r"[0-9]+")


class PageIndexError(ContractError, IndexError):
    """A page id lies outside its group's pages (TokenSpeed raises ``IndexError``)."""


def is_bool(value: object) -> bool:
    """Whether ``value`` is a ``bool``, Python's or numpy's: never a page or block
    id, whatever ``int(True)`` says."""
    if isinstance(value, bool):
        return True
    numpy = sys.modules.get("numpy")  # a numpy bool implies numpy is loaded
    return numpy is not None and isinstance(value, numpy.bool_)


def page_index(value: object) -> int | None:
    """``value`` as a page or block id, or ``None`` when it is not one: a bool
    (:func:`is_bool`) is not, an integer of any kind with ``__index__`` (numpy's
    included) is."""
    if is_bool(value):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def dtype_width(dtype: str) -> int:
    """Bytes per element of ``dtype``; an unknown name is a :class:`ContractError`."""
    try:
        return DTYPE_WIDTHS[dtype]
    except KeyError:
        raise ContractError(f"unsupported cache dtype {dtype!r}") from None


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ContractError(message)


# --------------------------------------------------------------------------- plan


@dataclass(frozen=True, slots=True)
class PlanGroup:
    """A page group of the arena: ``page_count`` pages, page 0 being the null page."""

    group_id: str
    cache_blocks_per_lcm_block: int
    page_count: int


@dataclass(frozen=True, slots=True)
class Plane:
    """A slice of the arena holding ``num_lcm_blocks + 1`` parents of
    ``bytes_per_lcm_block`` bytes each, starting at ``arena_offset_bytes``."""

    plane_id: str
    bytes_per_lcm_block: int
    arena_offset_bytes: int


@dataclass(frozen=True, slots=True)
class FieldSpec:
    """One cache tensor ("field"): a page of it is ``shape`` elements of ``dtype``,
    ``field_offset_bytes`` into each ``page_stride_bytes`` page slot of its plane."""

    group_id: str
    field_id: str
    plane_id: str
    shape: tuple[int, ...]
    dtype: str
    field_offset_bytes: int
    page_stride_bytes: int

    def __post_init__(self) -> None:
        dtype_width(self.dtype)

    @property
    def dtype_width(self) -> int:
        """Bytes per element."""
        return DTYPE_WIDTHS[self.dtype]

    @property
    def payload_bytes(self) -> int:
        """Bytes of one page of this field (``product(shape) * width``)."""
        return math.prod(self.shape) * DTYPE_WIDTHS[self.dtype]

    @property
    def layer(self) -> int:
        """The model layer owning this field, from its id ``layer.<L>.<suffix>``."""
        parts = self.field_id.split(".", 2)
        if len(parts) != 3 or parts[0] != "layer" or parts[2] == "":
            raise ContractError(f"cache field {self.field_id!r} is not owned by a model layer")
        if _LAYER_ID.fullmatch(parts[1]) is None:
            raise ContractError(f"cache field {self.field_id!r} has an invalid layer id")
        return int(parts[1])


@dataclass(frozen=True, slots=True)
class CacheMemoryPlan:
    """The arena's physical byte geometry (TokenSpeed's ``CacheMemoryPlan``).

    Like TokenSpeed, construction accepts any geometry (a peer's plan describes the
    peer's memory); :func:`check_local_contract` holds this rank's own plan to
    tspd's rules."""

    prefix_granularity: int
    lcm_block_bytes: int
    num_lcm_blocks: int
    groups: tuple[PlanGroup, ...]
    planes: tuple[Plane, ...]
    fields: tuple[FieldSpec, ...]
    resident_block_bytes: int | None = None


# --------------------------------------------------------------------------- specs


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """What a page group's blocks mean (TokenSpeed's group spec).

    History groups use row geometry (``rows_per_page`` rows every
    ``entry_stride_tokens`` tokens); state groups may instead snapshot every
    ``checkpoint_granularity`` tokens. ``replayable`` and ``shard_count`` are the S3
    extensions accepted only in compatibility mode (docs/protocol.md#proto-compat-levels).
    """

    group_id: str
    retention: Retention
    rows_per_page: int | None
    entry_stride_tokens: int | None
    sliding_window_tokens: int | None
    family: Family
    transfer_policy: TransferPolicy | None
    checkpoint_granularity: int | None
    replayable: bool | None = None
    shard_count: int = 1

    def __post_init__(self) -> None:
        gid = self.group_id
        _require(self.retention in RETENTIONS, f"cache group {gid!r} has an unknown retention")
        _require(self.family in FAMILIES, f"cache group {gid!r} has an unknown family")
        _require(
            self.transfer_policy is None or self.transfer_policy in TRANSFER_POLICIES,
            f"cache group {gid!r} has an unknown transfer policy",
        )
        rows = self.rows_per_page is not None and self.entry_stride_tokens is not None
        no_rows = self.rows_per_page is None and self.entry_stride_tokens is None
        if self.checkpoint_granularity is None:
            _require(rows, f"cache group {gid!r} needs rows_per_page and entry_stride_tokens")
        else:
            _require(
                no_rows,
                f"cache group {gid!r} cannot combine row geometry with checkpoint_granularity",
            )
            _require(
                self.family == "state",
                f"cache group {gid!r} uses checkpoint_granularity but is not a state group",
            )
        for name in (
            "rows_per_page",
            "entry_stride_tokens",
            "sliding_window_tokens",
            "checkpoint_granularity",
        ):
            value = getattr(self, name)
            _require(value is None or value > 0, f"cache group {gid!r} {name} must be positive")
        _require(
            self.replayable is not True or self.retention == "sliding_window",
            f"cache group {gid!r} is replayable but not sliding",
        )
        _require(self.shard_count >= 1, f"cache group {gid!r} shard_count must be positive")

    @property
    def block_granularity(self) -> int:
        """Tokens per block: ``checkpoint_granularity``, else rows × entry stride."""
        if self.checkpoint_granularity is not None:
            return self.checkpoint_granularity
        rows, stride = self.rows_per_page, self.entry_stride_tokens
        assert rows is not None
        assert stride is not None
        return rows * stride

    @property
    def is_sliding(self) -> bool:
        """Whether the group keeps only a sliding window of tokens."""
        return self.retention == "sliding_window"


@dataclass(frozen=True, slots=True)
class Partition:
    """How a field splits across TP ranks: ``axis`` has ``global_extent`` elements in
    total; ``global_parts`` (optional) splits that extent into composite parts that are
    each divided evenly across ranks."""

    axis: int
    global_extent: int
    global_parts: tuple[int, ...] = ()

    @property
    def parts(self) -> tuple[int, ...]:
        """The composite parts, or the whole extent as one part."""
        return self.global_parts or (self.global_extent,)


@dataclass(frozen=True, slots=True)
class TransferSchema:
    """The partitioned fields, in declaration order; a field not listed is replicated."""

    fields: tuple[tuple[str, Partition], ...] = ()

    def __post_init__(self) -> None:
        ids = [fid for fid, _ in self.fields]
        if len(set(ids)) != len(ids):
            raise ContractError("cache transfer schema contains a duplicate field")

    def partition_of(self, field_id: str) -> Partition | None:
        """The partition of ``field_id``, or ``None`` when it is replicated."""
        for fid, partition in self.fields:
            if fid == field_id:
                return partition
        return None


def _check_partition(f: FieldSpec, p: Partition) -> None:
    fid = f.field_id
    if not 0 <= p.axis < len(f.shape) or f.shape[p.axis] <= 0 or p.global_extent < f.shape[p.axis]:
        raise ContractError(f"cache field {fid!r} has invalid partition geometry")
    local = f.shape[p.axis]
    if p.global_extent % local != 0:
        raise ContractError(
            f"cache field {fid!r} global partition extent is not divisible by its local extent"
        )
    shards = p.global_extent // local
    parts = p.global_parts
    if parts and (
        not 2 <= len(parts) <= MAX_GLOBAL_PARTS
        or any(part <= 0 or part % shards != 0 for part in parts)
        or sum(parts) != p.global_extent
    ):
        raise ContractError(f"cache field {fid!r} has invalid global partition parts")


# --------------------------------------------------------------------------- contract


@dataclass(frozen=True, slots=True)
class _Index:
    specs: dict[str, GroupSpec]
    plan_groups: dict[str, PlanGroup]
    planes: dict[str, Plane]
    fields: dict[str, FieldSpec]
    by_group: dict[str, tuple[FieldSpec, ...]]
    partitions: dict[str, Partition]
    group_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class CacheContract:
    """One rank's cache transfer contract (docs/protocol.md#proto-contract).

    ``group_specs`` are in *group order*: the order every manifest and selection
    follows. Construction validates what TokenSpeed validates
    (docs/protocol.md#proto-contract-errors), so a peer's contract is accepted whenever
    S1 would accept it; :func:`check_local_contract` adds tspd's checks for this rank's
    own contract. :meth:`to_json` is the canonical wire form and :func:`parse_contract`
    its inverse.
    """

    plan: CacheMemoryPlan
    group_specs: tuple[GroupSpec, ...]
    transfer_schema: TransferSchema = dataclasses.field(default_factory=TransferSchema)
    _index: _Index = dataclasses.field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        specs = {s.group_id: s for s in self.group_specs}
        plan_groups = {g.group_id: g for g in self.plan.groups}
        fields = {f.field_id: f for f in self.plan.fields}
        unknown = sorted({fid for fid, _ in self.transfer_schema.fields} - set(fields))
        if unknown:
            raise ContractError(f"cache transfer schema references unknown fields {unknown}")
        partitions = dict(self.transfer_schema.fields)
        for fid, partition in partitions.items():
            _check_partition(fields[fid], partition)
        by_group = {
            gid: tuple(sorted((f for f in self.plan.fields if f.group_id == gid), key=_fid))
            for gid in specs
        }
        index = _Index(
            specs=specs,
            plan_groups=plan_groups,
            planes={p.plane_id: p for p in self.plan.planes},
            fields=fields,
            by_group=by_group,
            partitions=partitions,
            group_ids=tuple(s.group_id for s in self.group_specs),
        )
        object.__setattr__(self, "_index", index)

    # ----------------------------------------------------------------- lookups

    @property
    def group_ids(self) -> tuple[str, ...]:
        """Group ids in group order (computed once: a Prefill rank reads them for
        every manifest it checks and every room it plans)."""
        return self._index.group_ids

    @property
    def arena_bytes(self) -> int:
        """Length of the arena registered with the transfer engine."""
        per_parent = self.plan.resident_block_bytes or self.plan.lcm_block_bytes
        return (self.plan.num_lcm_blocks + 1) * per_parent

    def group(self, group_id: str) -> GroupSpec:
        """The semantic spec of ``group_id``."""
        try:
            return self._index.specs[group_id]
        except KeyError:
            raise ContractError(f"cache contract has no group {group_id!r}") from None

    def plan_group(self, group_id: str) -> PlanGroup:
        """The physical page group ``group_id``."""
        try:
            return self._index.plan_groups[group_id]
        except KeyError:
            raise ContractError(f"cache contract has no group {group_id!r}") from None

    def plane(self, plane_id: str) -> Plane:
        """The plane ``plane_id``."""
        try:
            return self._index.planes[plane_id]
        except KeyError:
            raise ContractError(f"cache contract has no plane {plane_id!r}") from None

    def field(self, field_id: str) -> FieldSpec:
        """The field ``field_id``."""
        try:
            return self._index.fields[field_id]
        except KeyError:
            raise ContractError(f"cache contract has no field {field_id!r}") from None

    def fields_for_group(self, group_id: str) -> tuple[FieldSpec, ...]:
        """The group's fields sorted by ``field_id``: the pairing and copy order."""
        self.group(group_id)
        return self._index.by_group[group_id]

    def partition_of(self, field_id: str) -> Partition | None:
        """The field's TP partition, or ``None`` when every rank holds it whole."""
        return self._index.partitions.get(field_id)

    def global_shape(self, f: FieldSpec | str) -> tuple[int, ...]:
        """The field's shape across all TP ranks: the partition axis (if any)
        replaced by its global extent. A :class:`FieldSpec` is resolved by its id in
        *this* contract."""
        spec = self.field(f if isinstance(f, str) else f.field_id)
        partition = self._index.partitions.get(spec.field_id)
        if partition is None:
            return spec.shape
        shape = list(spec.shape)
        shape[partition.axis] = partition.global_extent
        return tuple(shape)

    def page_count(self, group_id: str) -> int:
        """Pages of ``group_id``, the null page 0 included."""
        return self.plan_group(group_id).page_count

    def virtual_block_count(self, group_id: str) -> int:
        """Exclusive bound of the block ids a manifest may carry for the group (S3)."""
        pages = self.plan_group(group_id).page_count
        return 1 + (pages - 1) * self.group(group_id).shard_count

    def page_offset(self, f: FieldSpec | str, page: int) -> int:
        """Byte offset of page ``page`` of a field inside this arena
        (docs/protocol.md#proto-contract-derived).

        Page 1 starts right after the plane's null parent. A :class:`FieldSpec` is
        resolved by its id, so a peer's field of the same id gets this contract's
        plane, stride and offset. A page id that is not an integer (a ``bool``
        included) is out of range like any other.
        """
        fid = f if isinstance(f, str) else f.field_id
        spec = self._index.fields.get(fid)
        if spec is None:
            raise ContractError(f"cache contract has no field {fid!r}")
        pages = self.plan_group(spec.group_id).page_count
        index = page_index(page)
        if index is None or not 0 <= index < pages:
            raise PageIndexError(f"page_id {page} outside [0, {pages}) for group {spec.group_id!r}")
        page = index
        plane = self.plane(spec.plane_id)
        stride = spec.page_stride_bytes
        return (
            plane.arena_offset_bytes
            + plane.bytes_per_lcm_block
            - stride
            + page * stride
            + spec.field_offset_bytes
        )

    # ----------------------------------------------------------------- wire form

    def to_wire_object(self) -> dict[str, Any]:
        """The contract as the JSON object tree, keys in canonical order."""
        plan = self.plan
        plan_obj: dict[str, Any] = {
            "prefix_granularity": plan.prefix_granularity,
            "lcm_block_bytes": plan.lcm_block_bytes,
            "num_lcm_blocks": plan.num_lcm_blocks,
            "groups": [
                {
                    "group_id": g.group_id,
                    "cache_blocks_per_lcm_block": g.cache_blocks_per_lcm_block,
                    "page_count": g.page_count,
                }
                for g in plan.groups
            ],
            "planes": [
                {
                    "plane_id": p.plane_id,
                    "bytes_per_lcm_block": p.bytes_per_lcm_block,
                    "arena_offset_bytes": p.arena_offset_bytes,
                }
                for p in plan.planes
            ],
            "fields": [
                {
                    "group_id": f.group_id,
                    "field_id": f.field_id,
                    "plane_id": f.plane_id,
                    "shape": list(f.shape),
                    "dtype": f.dtype,
                    "field_offset_bytes": f.field_offset_bytes,
                    "page_stride_bytes": f.page_stride_bytes,
                }
                for f in plan.fields
            ],
        }
        if plan.resident_block_bytes is not None:
            plan_obj["resident_block_bytes"] = plan.resident_block_bytes
        return {
            "plan": plan_obj,
            "group_specs": [_spec_object(s) for s in self.group_specs],
            "transfer_schema": {
                "fields": [
                    {
                        "field_id": fid,
                        "partition": {
                            "axis": p.axis,
                            "global_extent": p.global_extent,
                            "global_parts": list(p.global_parts),
                        },
                    }
                    for fid, p in self.transfer_schema.fields
                ]
            },
        }

    def to_json(self) -> bytes:
        """The canonical wire form: compact, ASCII-escaped, keys in S1 order.

        Raises :class:`ContractError` when it exceeds :data:`MAX_CONTRACT_BYTES`.
        """
        data = json.dumps(
            self.to_wire_object(), separators=(",", ":"), ensure_ascii=True, allow_nan=False
        ).encode("ascii")
        if len(data) > MAX_CONTRACT_BYTES:
            raise ContractError(f"cache transfer contract exceeds {MAX_CONTRACT_BYTES} wire bytes")
        return data


def _fid(f: FieldSpec) -> str:
    return f.field_id


def _spec_object(s: GroupSpec) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "group_id": s.group_id,
        "retention": s.retention,
        "rows_per_page": s.rows_per_page,
        "entry_stride_tokens": s.entry_stride_tokens,
        "sliding_window_tokens": s.sliding_window_tokens,
    }
    if s.replayable is not None:
        obj["replayable"] = s.replayable
    obj["family"] = s.family
    obj["transfer_policy"] = s.transfer_policy
    obj["checkpoint_granularity"] = s.checkpoint_granularity
    if s.shard_count != 1:
        obj["shard_count"] = s.shard_count
    return obj


# ------------------------------------------------------------------ local checks


def check_local_contract(contract: CacheContract) -> None:
    """Refuse this rank's *own* contract when tspd could not serve it safely.

    TokenSpeed checks none of this (docs/protocol.md#proto-contract-local), and a peer's
    contract is never held to it: a peer's contract describes the peer's memory, and
    every copy is bounds-checked against both registered arenas before it is written.
    This rank's contract describes memory tspd registers, fills and receives into, so
    here tspd insists on:

    * positive ``prefix_granularity`` and ``lcm_block_bytes``, non-negative
      ``num_lcm_blocks``, ``resident_block_bytes`` (when set) within
      ``[1, lcm_block_bytes]``, a layout of at most :data:`MAX_ARENA_BYTES`, at
      least one page group;
    * non-empty, unique ids (plan groups, planes, fields, group specs), group specs
      naming exactly the plan's groups, every field naming a known group and plane;
    * a sliding group with ``sliding_window_tokens``, a full-history group without;
    * a positive ``cache_blocks_per_lcm_block`` and
      ``page_count == 1 + num_lcm_blocks * cache_blocks_per_lcm_block``; a positive
      ``bytes_per_lcm_block`` and a non-negative plane offset; a non-empty shape of
      positive extents, a non-negative field offset and a positive page stride;
    * every page of every field (the null page included) inside the layout,
      ``[0, (num_lcm_blocks + 1) * lcm_block_bytes)``;
    * no byte shared by two pages that transfers write (pages 1 and up), within a
      field (a payload larger than its stride) or across fields.

    Planes may overlap or interleave, and a field may reach past its plane or its
    page slot: TokenSpeed's own layouts do, and only the fields' bytes matter.
    Raises :class:`ContractError` prefixed with :data:`LOCAL_CONTRACT_PREFIX`.
    """
    try:
        _check_local(contract)
    except ContractError as err:
        raise ContractError(f"{LOCAL_CONTRACT_PREFIX}{err}; fix the cache layout") from None


def _check_local(contract: CacheContract) -> None:
    plan = contract.plan
    _require(plan.prefix_granularity > 0, "cache plan prefix_granularity must be positive")
    _require(plan.lcm_block_bytes > 0, "cache plan lcm_block_bytes must be positive")
    _require(plan.num_lcm_blocks >= 0, "cache plan num_lcm_blocks must not be negative")
    if plan.resident_block_bytes is not None:
        _require(
            0 < plan.resident_block_bytes <= plan.lcm_block_bytes,
            "cache plan resident_block_bytes must be in [1, lcm_block_bytes]",
        )
    layout_bytes = (plan.num_lcm_blocks + 1) * plan.lcm_block_bytes
    _require(
        layout_bytes <= MAX_ARENA_BYTES,
        f"cache layout of {layout_bytes} bytes exceeds the {MAX_ARENA_BYTES} tspd can address",
    )
    _require(len(plan.groups) > 0, "cache plan needs at least one page group")
    _unique([g.group_id for g in plan.groups], "cache plan group")
    _unique([p.plane_id for p in plan.planes], "cache plane")
    _unique([f.field_id for f in plan.fields], "cache field")
    _unique([s.group_id for s in contract.group_specs], "cache group spec")
    specs = {s.group_id for s in contract.group_specs}
    groups = {g.group_id: g for g in plan.groups}
    _require(
        specs == set(groups),
        f"cache group specs {sorted(specs)} disagree with the plan's groups {sorted(groups)}",
    )
    for spec in contract.group_specs:
        if spec.is_sliding:
            _require(
                spec.sliding_window_tokens is not None,
                f"sliding cache group {spec.group_id!r} needs sliding_window_tokens",
            )
        else:
            _require(
                spec.sliding_window_tokens is None,
                f"full-history cache group {spec.group_id!r} cannot have sliding_window_tokens",
            )
    for group in plan.groups:
        _require(
            group.cache_blocks_per_lcm_block > 0,
            f"cache plan group {group.group_id!r} needs a positive cache_blocks_per_lcm_block",
        )
        expected = 1 + plan.num_lcm_blocks * group.cache_blocks_per_lcm_block
        _require(
            group.page_count == expected,
            f"cache plan group {group.group_id!r} has page_count {group.page_count}; "
            f"1 + num_lcm_blocks * cache_blocks_per_lcm_block = {expected}",
        )
    for plane in plan.planes:
        _require(
            plane.bytes_per_lcm_block > 0,
            f"cache plane {plane.plane_id!r} needs a positive bytes_per_lcm_block",
        )
        _require(
            plane.arena_offset_bytes >= 0,
            f"cache plane {plane.plane_id!r} has a negative arena offset",
        )
    planes = {p.plane_id for p in plan.planes}
    runs: list[_PageRun] = []
    for f in plan.fields:
        fid = f.field_id
        _require(f.group_id in groups, f"cache field {fid!r} names unknown group {f.group_id!r}")
        _require(f.plane_id in planes, f"cache field {fid!r} names unknown plane {f.plane_id!r}")
        _require(
            len(f.shape) > 0 and all(extent > 0 for extent in f.shape),
            f"cache field {fid!r} needs a non-empty shape of positive extents",
        )
        _require(f.field_offset_bytes >= 0, f"cache field {fid!r} has a negative field offset")
        _require(f.page_stride_bytes > 0, f"cache field {fid!r} needs a positive page stride")
        _require(
            f.payload_bytes <= f.page_stride_bytes,
            f"cache field {fid!r} payload ({f.payload_bytes} bytes) is larger than its page "
            f"stride ({f.page_stride_bytes} bytes), so its pages overlap one another",
        )
        pages = groups[f.group_id].page_count
        first = contract.page_offset(f, 0)
        last_end = first + (pages - 1) * f.page_stride_bytes + f.payload_bytes
        _require(
            first >= 0 and last_end <= layout_bytes,
            f"cache field {fid!r} pages do not fit inside the layout "
            f"((num_lcm_blocks + 1) * lcm_block_bytes = {layout_bytes} bytes)",
        )
        if pages > 1:
            start = first + f.page_stride_bytes
            runs.append(_PageRun(fid, start, f.page_stride_bytes, pages - 1, f.payload_bytes))
    _check_disjoint(runs)


@dataclass(frozen=True, slots=True)
class _PageRun:
    """Pages 1 and up of one field: ``count`` pages of ``length`` bytes, the first
    at ``start``, one every ``stride`` bytes (``0 < length <= stride``)."""

    field_id: str
    start: int
    stride: int
    count: int
    length: int

    @property
    def end(self) -> int:
        return self.start + (self.count - 1) * self.stride + self.length


def _check_disjoint(runs: Sequence[_PageRun]) -> None:
    """Refuse two fields whose transferred pages share a byte. The sweep compares
    only fields whose spans meet (none when planes lie back to back); interleaved
    fields of equal stride cost O(1) a pair."""
    active: list[_PageRun] = []
    for run in sorted(runs, key=lambda r: r.start):
        active = [a for a in active if a.end > run.start]
        for other in active:
            if _runs_meet(other, run):
                raise ContractError(
                    f"cache fields {other.field_id!r} and {run.field_id!r} share bytes, so "
                    "a transfer into one would overwrite the other"
                )
        active.append(run)


def _runs_meet(a: _PageRun, b: _PageRun) -> bool:
    """Whether a page of ``a`` and a page of ``b`` share a byte."""
    if a.stride == b.stride:
        # Page i of a meets page j of b iff k = i - j, in [1 - b.count, a.count - 1],
        # has d - a.length < k * stride < d + b.length (d = b.start - a.start); the
        # smallest k above the lower bound decides.
        d, stride = b.start - a.start, a.stride
        k = max((d - a.length) // stride + 1, 1 - b.count)
        return k <= a.count - 1 and k * stride < d + b.length
    # Otherwise, per page of a: the first page of b ending after the page's start is
    # the first that can meet it (b's pages do not overlap one another).
    import numpy as np  # only here: parsing a contract does not need numpy

    x = a.start + np.arange(a.count, dtype=np.int64) * a.stride
    j = np.maximum((x - b.start - b.length) // b.stride + 1, 0)
    return bool(np.any((j < b.count) & (b.start + j * b.stride < x + a.length)))


def _unique(ids: Sequence[str], what: str) -> None:
    seen: set[str] = set()
    for ident in ids:
        _require(ident != "", f"{what} IDs must be non-empty")
        _require(ident not in seen, f"{what} ID {ident!r} is duplicated")
        seen.add(ident)


# --------------------------------------------------------------------------- parsing


class _Shape(Exception):
    """A structural problem in the JSON tree (missing key, wrong type, unknown key);
    chained under ``"invalid cache transfer contract"``."""


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name} is not JSON")


def parse_contract(data: bytes | str, *, compat: bool = False) -> CacheContract:
    """Decode and validate a contract payload (docs/protocol.md#proto-contract-errors).

    Unknown keys at the top level and directly inside ``plan`` and
    ``transfer_schema`` are ignored (and dropped from :meth:`CacheContract.to_json`);
    an unknown key inside any entry is invalid. ``compat=True`` additionally accepts
    the S3 group spec keys ``replayable`` and ``shard_count``
    (docs/protocol.md#proto-compat-levels). Every failure is a :class:`ContractError`
    carrying the message docs/protocol.md#proto-contract-errors gives.

    Only what S1 checks is checked, so a peer's contract is accepted whenever
    TokenSpeed would accept it (overlapping or interleaved planes included); hold
    this rank's own contract to :func:`check_local_contract` as well.
    """
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    if not 0 < len(raw) <= MAX_CONTRACT_BYTES:
        raise ContractError(
            f"cache transfer contract payload must be 1..{MAX_CONTRACT_BYTES} bytes"
        )
    try:
        tree = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except (ValueError, RecursionError) as err:
        raise ContractError("invalid cache transfer contract JSON") from err
    if not isinstance(tree, dict):
        raise ContractError("cache transfer contract payload must be a JSON object")
    try:
        return _contract_from(tree, compat=compat)
    except (_Shape, ContractError) as err:
        raise ContractError(_INVALID) from err


_SPEC_KEYS: Final = (
    "group_id",
    "retention",
    "rows_per_page",
    "entry_stride_tokens",
    "sliding_window_tokens",
    "family",
    "transfer_policy",
    "checkpoint_granularity",
)
_COMPAT_SPEC_KEYS: Final = ("replayable", "shard_count")


def _contract_from(tree: dict[str, Any], *, compat: bool) -> CacheContract:
    plan = _obj(_key(tree, "plan", "contract"), "plan")
    plan_obj = CacheMemoryPlan(
        prefix_granularity=_int(_key(plan, "prefix_granularity", "plan"), "prefix_granularity"),
        lcm_block_bytes=_int(_key(plan, "lcm_block_bytes", "plan"), "lcm_block_bytes"),
        num_lcm_blocks=_int(_key(plan, "num_lcm_blocks", "plan"), "num_lcm_blocks"),
        groups=_entries(plan, "groups", _plan_group),
        planes=_entries(plan, "planes", _plane),
        fields=_entries(plan, "fields", _field),
        resident_block_bytes=_resident(plan.get("resident_block_bytes")),
    )
    specs = tuple(
        _group_spec(entry, f"group_specs[{i}]", compat=compat)
        for i, entry in enumerate(_list(_key(tree, "group_specs", "contract"), "group_specs"))
    )
    schema = _obj(_key(tree, "transfer_schema", "contract"), "transfer_schema")
    # Like the top level and ``plan``, unknown keys here are read past (and dropped
    # from the canonical form); only the entries are built by keyword.
    partitions = tuple(
        _partitioned(entry, f"transfer_schema.fields[{i}]")
        for i, entry in enumerate(
            _list(_key(schema, "fields", "transfer_schema"), "transfer_schema.fields")
        )
    )
    return CacheContract(
        plan=plan_obj, group_specs=specs, transfer_schema=TransferSchema(partitions)
    )


def _resident(value: Any) -> int | None:
    """``plan.resident_block_bytes`` (S3/R): S1 does not read the key at all, so a
    value that is not an integer is ignored as if absent rather than refused."""
    return value if type(value) is int else None


def _plan_group(entry: dict[str, Any], where: str) -> PlanGroup:
    _exact_keys(entry, ("group_id", "cache_blocks_per_lcm_block", "page_count"), where)
    return PlanGroup(
        group_id=_str(entry["group_id"], f"{where}.group_id"),
        cache_blocks_per_lcm_block=_int(
            entry["cache_blocks_per_lcm_block"], f"{where}.cache_blocks_per_lcm_block"
        ),
        page_count=_int(entry["page_count"], f"{where}.page_count"),
    )


def _plane(entry: dict[str, Any], where: str) -> Plane:
    _exact_keys(entry, ("plane_id", "bytes_per_lcm_block", "arena_offset_bytes"), where)
    return Plane(
        plane_id=_str(entry["plane_id"], f"{where}.plane_id"),
        bytes_per_lcm_block=_int(entry["bytes_per_lcm_block"], f"{where}.bytes_per_lcm_block"),
        arena_offset_bytes=_int(entry["arena_offset_bytes"], f"{where}.arena_offset_bytes"),
    )


def _field(entry: dict[str, Any], where: str) -> FieldSpec:
    _exact_keys(
        entry,
        (
            "group_id",
            "field_id",
            "plane_id",
            "shape",
            "dtype",
            "field_offset_bytes",
            "page_stride_bytes",
        ),
        where,
    )
    return FieldSpec(
        group_id=_str(entry["group_id"], f"{where}.group_id"),
        field_id=_str(entry["field_id"], f"{where}.field_id"),
        plane_id=_str(entry["plane_id"], f"{where}.plane_id"),
        shape=_ints(entry["shape"], f"{where}.shape"),
        dtype=_str(entry["dtype"], f"{where}.dtype"),
        field_offset_bytes=_int(entry["field_offset_bytes"], f"{where}.field_offset_bytes"),
        page_stride_bytes=_int(entry["page_stride_bytes"], f"{where}.page_stride_bytes"),
    )


def _group_spec(entry: Any, where: str, *, compat: bool) -> GroupSpec:
    entry = _obj(entry, where)
    allowed = _SPEC_KEYS + _COMPAT_SPEC_KEYS if compat else _SPEC_KEYS
    extra = sorted(set(entry) - set(allowed))
    if extra:
        raise _Shape(f"{where} has unknown keys {extra}")
    missing = [k for k in _SPEC_KEYS if k not in entry]
    if missing:
        raise _Shape(f"{where} is missing keys {missing}")
    replayable = entry.get("replayable")
    if replayable is not None and not isinstance(replayable, bool):
        raise _Shape(f"{where}.replayable must be a boolean")
    shard_count = _int(entry.get("shard_count", 1), f"{where}.shard_count")
    return GroupSpec(
        group_id=_str(entry["group_id"], f"{where}.group_id"),
        retention=cast(Retention, _choice(entry["retention"], RETENTIONS, f"{where}.retention")),
        rows_per_page=_opt_int(entry["rows_per_page"], f"{where}.rows_per_page"),
        entry_stride_tokens=_opt_int(entry["entry_stride_tokens"], f"{where}.entry_stride_tokens"),
        sliding_window_tokens=_opt_int(
            entry["sliding_window_tokens"], f"{where}.sliding_window_tokens"
        ),
        family=cast(Family, _choice(entry["family"], FAMILIES, f"{where}.family")),
        transfer_policy=cast(
            TransferPolicy | None,
            None
            if entry["transfer_policy"] is None
            else _choice(entry["transfer_policy"], TRANSFER_POLICIES, f"{where}.transfer_policy"),
        ),
        checkpoint_granularity=_opt_int(
            entry["checkpoint_granularity"], f"{where}.checkpoint_granularity"
        ),
        replayable=replayable,
        shard_count=shard_count,
    )


def _partitioned(entry: Any, where: str) -> tuple[str, Partition]:
    entry = _obj(entry, where)
    _exact_keys(entry, ("field_id", "partition"), where)
    part = _obj(entry["partition"], f"{where}.partition")
    _exact_keys(part, ("axis", "global_extent", "global_parts"), f"{where}.partition")
    return _str(entry["field_id"], f"{where}.field_id"), Partition(
        axis=_int(part["axis"], f"{where}.partition.axis"),
        global_extent=_int(part["global_extent"], f"{where}.partition.global_extent"),
        global_parts=_ints(part["global_parts"], f"{where}.partition.global_parts"),
    )


# ------------------------------------------------------------------ typed accessors


def _key(obj: dict[str, Any], key: str, where: str) -> Any:
    if key not in obj:
        raise _Shape(f"{where} is missing key {key!r}")
    return obj[key]


def _obj(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _Shape(f"{where} must be a JSON object")
    return value


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise _Shape(f"{where} must be a JSON array")
    return value


def _exact_keys(obj: dict[str, Any], keys: Sequence[str], where: str) -> None:
    extra = sorted(set(obj) - set(keys))
    if extra:
        raise _Shape(f"{where} has unknown keys {extra}")
    missing = [k for k in keys if k not in obj]
    if missing:
        raise _Shape(f"{where} is missing keys {missing}")


_T = TypeVar("_T")


def _entries(
    plan: dict[str, Any], key: str, build: Callable[[dict[str, Any], str], _T]
) -> tuple[_T, ...]:
    values = _list(_key(plan, key, "plan"), f"plan.{key}")
    return tuple(
        build(_obj(v, f"plan.{key}[{i}]"), f"plan.{key}[{i}]") for i, v in enumerate(values)
    )


def _int(value: Any, where: str) -> int:
    if type(value) is not int:
        raise _Shape(f"{where} must be an integer")
    return value


def _opt_int(value: Any, where: str) -> int | None:
    return None if value is None else _int(value, where)


def _ints(value: Any, where: str) -> tuple[int, ...]:
    return tuple(_int(v, f"{where}[{i}]") for i, v in enumerate(_list(value, where)))


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise _Shape(f"{where} must be a string")
    return value


def _choice(value: Any, choices: Sequence[str], where: str) -> str:
    if value not in choices:
        raise _Shape(f"{where} must be one of {list(choices)}")
    return str(value)


# --------------------------------------------------------------------------- peers


def validate_peer_layout(
    local: CacheContract, peer: CacheContract, *, prefix: str = DEFAULT_PEER_PREFIX
) -> None:
    """Refuse a peer whose contract cannot exchange pages with ``local``
    (docs/protocol.md#proto-peer-compat).

    Capacity, packing, plane offsets, strides and arena sizes may differ; the
    token grain, group order and semantics, field pairing, dtypes, partitions and
    global shapes may not. ``shard_count`` is deliberately not compared. A mismatch
    is a :class:`ContractError` (TokenSpeed's ``CacheContractError``).
    """
    if local.plan.prefix_granularity != peer.plan.prefix_granularity:
        raise ContractError(prefix + "prefix_granularity")
    if local.group_ids != peer.group_ids:
        raise ContractError(prefix + "group order")
    for mine, theirs in zip(local.group_specs, peer.group_specs, strict=True):
        gid = mine.group_id
        if _semantics(mine) != _semantics(theirs):
            raise ContractError(prefix + f"group {gid!r} semantics")
        my_fields = local.fields_for_group(gid)
        peer_fields = peer.fields_for_group(gid)
        if [f.field_id for f in my_fields] != [f.field_id for f in peer_fields]:
            raise ContractError(prefix + f"group {gid!r} transfer field order")
        for a, b in zip(my_fields, peer_fields, strict=True):
            if (
                a.dtype != b.dtype
                or local.partition_of(a.field_id) != peer.partition_of(b.field_id)
                or local.global_shape(a) != peer.global_shape(b)
            ):
                raise ContractError(prefix + f"field {a.field_id!r} semantics")


def _semantics(s: GroupSpec) -> tuple[object, ...]:
    return (
        s.family,
        s.rows_per_page,
        s.entry_stride_tokens,
        s.checkpoint_granularity,
        s.retention,
        s.sliding_window_tokens,
        s.transfer_policy,
        bool(s.replayable),
    )
