"""Cache transfer contracts for real model shapes, and a page allocator for embedders.

An engine tells its peers how its KV cache is laid out with a cache transfer
contract (:class:`~tspd.core.contract.CacheContract`). This module builds one from
the model's shape instead of by hand:

* :func:`mha_contract` — multi-head, grouped-query and multi-query attention: per
  layer a K and a V field, the KV heads split across tensor-parallel ranks;
* :func:`mla_contract` — multi-head latent attention: per layer one latent field
  (``kv_lora_rank + rope_dim`` elements a token), the same on every TP rank;
* :func:`build_contract` — any mix of page groups: full and sliding-window
  attention (:func:`attention_group`, :func:`latent_group`), recurrent state
  (:class:`StateGroup`, e.g. Mamba or linear-attention conv and SSM state) and any
  other per-token tensor (:class:`HistoryGroup` of :class:`CacheTensor`).

Tensors are described for the whole model (global head counts); the builders cut
this rank's share and record the split in the contract's transfer schema, so contracts
built for different TP sizes pair up (docs/protocol.md#proto-fragments). Heads are split
with the one rule the planner accepts: ``tp_size`` divides the head count (each rank
holds ``heads / tp_size``), or is a multiple of it (each rank holds one head, replicated
on ``tp_size / heads`` consecutive ranks); anything else is refused
(:func:`kv_heads_per_rank`).

Within a page, a tensor is token-major (``(page_tokens, heads, head_dim)``, "NHD")
or head-major (``(heads, page_tokens, head_dim)``, "HND"): see :data:`TokenLayout`.
Across pages, a group is layer-major (each layer's field in a plane of its own, so
a field's pages are adjacent) or page-major (one plane per group whose page slot
holds every layer's fields back to back): see :data:`ArenaLayout`. Every group gets
``num_pages`` usable pages (plus the null page 0).

Every contract is checked with :func:`~tspd.core.contract.check_local_contract`
before it is returned, since it describes memory this rank registers. A model
shape that cannot be laid out is a :class:`~tspd.core.errors.ConfigError` naming
the value to change; unknown dtypes included.

:class:`PageAllocator` hands one request a free page of every group at every
logical slot of its prompt window, for engines (and the demo) without a block
manager of their own.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Literal, final

from tspd.core.contract import (
    DTYPE_WIDTHS,
    MAX_GLOBAL_PARTS,
    CacheContract,
    CacheMemoryPlan,
    FieldSpec,
    GroupSpec,
    Partition,
    Plane,
    PlanGroup,
    TransferSchema,
    check_local_contract,
)
from tspd.core.errors import ConfigError
from tspd.core.manifest import logical_slots
from tspd.core.planner import MAX_TP_SIZE

__all__ = [
    "DTYPE_ALIASES",
    "ArenaLayout",
    "CacheTensor",
    "HistoryGroup",
    "PageAllocator",
    "StateGroup",
    "TokenLayout",
    "attention_group",
    "build_contract",
    "cache_dtype",
    "kv_head_range",
    "kv_heads_per_rank",
    "latent_group",
    "mha_contract",
    "mla_contract",
]

TokenLayout = Literal["token_major", "head_major"]
"""Where the token axis of an attention page goes: ``"token_major"`` pages are
``(page_tokens, heads, head_dim)`` (NHD, split on axis 1); ``"head_major"`` pages
are ``(heads, page_tokens, head_dim)`` (HND, split on axis 0), so a rank's share of
a page is one contiguous run and heterogeneous-TP copies need one descriptor per
field page instead of one per token."""

ArenaLayout = Literal["layer_major", "page_major"]
"""How a group's fields share the arena: ``"layer_major"`` gives every field a
plane of its own (plane id = field id; a field's pages are adjacent, what paged
attention kernels index); ``"page_major"`` gives the group one plane (plane id =
group id) whose page slot holds all its fields, layer by layer, back to back (one
page of every layer is adjacent)."""

DTYPE_ALIASES: Final[Mapping[str, str]] = {
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
    "fp32": "float32",
    "float": "float32",
    "fp64": "float64",
    "double": "float64",
}
"""Short dtype names :func:`cache_dtype` accepts besides the contract's own names
(:data:`~tspd.core.contract.DTYPE_WIDTHS`). ``"fp8"`` is E4M3 (``float8_e4m3fn``)."""


def cache_dtype(name: str) -> str:
    """The contract dtype for ``name``: a contract dtype name
    (:data:`~tspd.core.contract.DTYPE_WIDTHS`, e.g. ``"bfloat16"``), a short name
    from :data:`DTYPE_ALIASES` (``"bf16"``, ``"fp16"``, ``"fp8"``, ``"fp32"``…), or
    either spelled as PyTorch prints it (``"torch.bfloat16"``). Case does not
    matter. Anything else is a :class:`ConfigError` listing what is accepted."""
    key = name.strip().lower().removeprefix("torch.")
    if key in DTYPE_WIDTHS:
        return key
    if key in DTYPE_ALIASES:
        return DTYPE_ALIASES[key]
    raise ConfigError(
        f"unknown cache dtype {name!r}; use one of {', '.join(DTYPE_ALIASES)} "
        f"or a contract dtype name ({', '.join(DTYPE_WIDTHS)})"
    )


# ------------------------------------------------------------------- TP sharding


def _count(name: str, value: object, *, minimum: int = 1) -> int:
    """``value`` if it is an ``int`` (not a ``bool``) of at least ``minimum``."""
    if type(value) is not int or value < minimum:
        raise ConfigError(f"{name} must be a whole number of at least {minimum}, got {value!r}")
    return value


def _check_tp(tp_size: int) -> int:
    _count("tp_size", tp_size)
    if tp_size > MAX_TP_SIZE:
        raise ConfigError(f"tp_size must be at most {MAX_TP_SIZE}, got {tp_size}")
    return tp_size


def _local_extent(what: str, extent: int, parts: tuple[int, ...], tp_size: int) -> int:
    """This rank's extent of an axis of ``extent`` elements split over ``tp_size``."""
    if parts:
        if any(part % tp_size for part in parts):
            raise ConfigError(
                f"{what}: every composite part {parts} must divide by TP={tp_size}, "
                "since each part is split evenly across the ranks"
            )
        return extent // tp_size
    if extent % tp_size == 0:
        return extent // tp_size
    if tp_size % extent == 0:
        # Each element on tp_size / extent consecutive ranks (docs/protocol.md#proto-fragments).
        return 1
    raise ConfigError(
        f"{what} cannot be split over TP={tp_size}: the TP size must divide {extent} "
        f"(each rank holds {extent}/TP) or be a multiple of it (each rank holds one, "
        f"replicated on TP/{extent} ranks)"
    )


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads one rank of a TP group of ``tp_size`` holds.

    ``num_kv_heads / tp_size`` when ``tp_size`` divides the head count; 1 when
    ``tp_size`` is a multiple of it (GQA/MQA with more ranks than KV heads: each head is
    replicated on ``tp_size / num_kv_heads`` consecutive ranks). Any other pair is a
    :class:`ConfigError`: the transfer planner (docs/protocol.md#proto-fragments) cannot
    map it.
    """
    _count("num_kv_heads", num_kv_heads)
    _check_tp(tp_size)
    return _local_extent(f"{num_kv_heads} KV heads", num_kv_heads, (), tp_size)


def kv_head_range(num_kv_heads: int, tp_size: int, tp_rank: int) -> range:
    """The global KV heads TP rank ``tp_rank`` holds (docs/protocol.md#proto-fragments:
    ``N`` distinct shards, replica groups of ``R = tp_size / N`` consecutive ranks,
    shard ``tp_rank // R``)."""
    local = kv_heads_per_rank(num_kv_heads, tp_size)
    if type(tp_rank) is not int or not 0 <= tp_rank < tp_size:
        raise ConfigError(f"tp_rank must be in [0, {tp_size}), got {tp_rank!r}")
    replicas = tp_size // (num_kv_heads // local)
    first = (tp_rank // replicas) * local
    return range(first, first + local)


# ------------------------------------------------------------------- model shapes


@dataclass(frozen=True, slots=True)
class CacheTensor:
    """One cache tensor of every layer of a group, described for the whole model.

    The contract names it ``layer.<L>.<name>``. ``shape`` is the global shape of one
    token's entry (history groups; ``()`` for a scalar) or of one snapshot (state
    groups). ``split_axis`` is the axis of ``shape`` split across TP ranks (``None``:
    every rank holds it whole); ``parts`` makes that axis composite, e.g. a conv
    state whose channels are Q, K and V widths back to back, each split on its own.
    ``dtype`` (any name :func:`cache_dtype` accepts) defaults to the contract's.
    ``token_axis`` (history groups only) is where the page's token axis goes in the
    field's shape: 0 is token-major, ``len(shape)`` puts tokens last.
    """

    name: str
    shape: tuple[int, ...]
    split_axis: int | None = None
    parts: tuple[int, ...] = ()
    dtype: str | None = None
    token_axis: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))
        object.__setattr__(self, "parts", tuple(self.parts))
        what = f"cache tensor {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"a cache tensor needs a non-empty name, got {self.name!r}")
        for extent in self.shape:
            _count(f"{what} shape {self.shape} extents", extent)
        if not 0 <= self.token_axis <= len(self.shape):
            raise ConfigError(
                f"{what}: token_axis {self.token_axis} must be in [0, {len(self.shape)}]"
            )
        if self.split_axis is None:
            if self.parts:
                raise ConfigError(f"{what}: composite parts {self.parts} need a split_axis")
        elif type(self.split_axis) is not int or not 0 <= self.split_axis < len(self.shape):
            raise ConfigError(
                f"{what}: split_axis {self.split_axis!r} is not an axis of shape {self.shape}"
            )
        elif self.parts:
            for part in self.parts:
                _count(f"{what} parts", part)
            if not 2 <= len(self.parts) <= MAX_GLOBAL_PARTS:
                raise ConfigError(
                    f"{what}: give 2..{MAX_GLOBAL_PARTS} composite parts, got {self.parts}"
                )
            if sum(self.parts) != self.shape[self.split_axis]:
                raise ConfigError(
                    f"{what}: composite parts {self.parts} sum to {sum(self.parts)}, not "
                    f"the extent {self.shape[self.split_axis]} of axis {self.split_axis}"
                )
        if self.dtype is not None:
            cache_dtype(self.dtype)


def _layers(layers: int | Sequence[int]) -> tuple[int, ...]:
    if isinstance(layers, int):
        return tuple(range(_count("num_layers", layers)))
    return tuple(layers)


def _check_layers(group_id: str, layers: tuple[int, ...]) -> None:
    if not layers:
        raise ConfigError(f"cache group {group_id!r} needs at least one layer")
    for layer in layers:
        _count(f"cache group {group_id!r} layer ids", layer, minimum=0)
    if len(set(layers)) != len(layers):
        raise ConfigError(f"cache group {group_id!r} lists a layer twice: {layers}")


def _check_group(group: HistoryGroup | StateGroup) -> None:
    object.__setattr__(group, "layers", tuple(group.layers))
    object.__setattr__(group, "tensors", tuple(group.tensors))
    group_id, layers, tensors = group.group_id, group.layers, group.tensors
    if not isinstance(group_id, str) or not group_id:
        raise ConfigError(f"a cache group needs a non-empty group_id, got {group_id!r}")
    _check_layers(group_id, layers)
    if not tensors or not all(isinstance(t, CacheTensor) for t in tensors):
        raise ConfigError(f"cache group {group_id!r} needs one or more CacheTensor")
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise ConfigError(f"cache group {group_id!r} names a tensor twice: {names}")


@dataclass(frozen=True, slots=True)
class HistoryGroup:
    """A paged history group: every token's entry kept (or the last
    ``sliding_window`` tokens' when set), ``page_tokens`` tokens a page, each page
    holding ``page_tokens / entry_stride_tokens`` rows of every tensor of every
    layer in ``layers``. Use :func:`attention_group` and :func:`latent_group` for
    the usual attention shapes."""

    group_id: str
    layers: tuple[int, ...]
    tensors: tuple[CacheTensor, ...]
    page_tokens: int
    sliding_window: int | None = None
    entry_stride_tokens: int = 1
    arena_layout: ArenaLayout = "layer_major"

    def __post_init__(self) -> None:
        _check_group(self)
        what = f"cache group {self.group_id!r}"
        _count(f"{what} page_tokens", self.page_tokens)
        _count(f"{what} entry_stride_tokens", self.entry_stride_tokens)
        if self.page_tokens % self.entry_stride_tokens:
            raise ConfigError(
                f"{what}: page_tokens={self.page_tokens} must be a multiple of "
                f"entry_stride_tokens={self.entry_stride_tokens}"
            )
        if self.sliding_window is not None:
            _count(f"{what} sliding_window", self.sliding_window)
        _check_arena_layout(what, self.arena_layout)

    @property
    def block_tokens(self) -> int:
        """Tokens one page covers."""
        return self.page_tokens


@dataclass(frozen=True, slots=True)
class StateGroup:
    """A recurrent-state group (Mamba, linear attention): one snapshot of every
    tensor of every layer in ``layers`` per page, taken every
    ``checkpoint_tokens`` tokens (the contract's prefix granularity when ``None``).
    Only the latest snapshot is transferred. ``token_axis`` of its tensors is
    ignored."""

    group_id: str
    layers: tuple[int, ...]
    tensors: tuple[CacheTensor, ...]
    checkpoint_tokens: int | None = None
    arena_layout: ArenaLayout = "page_major"

    def __post_init__(self) -> None:
        _check_group(self)
        what = f"cache group {self.group_id!r}"
        if self.checkpoint_tokens is not None:
            _count(f"{what} checkpoint_tokens", self.checkpoint_tokens)
        for tensor in self.tensors:
            if not tensor.shape:
                raise ConfigError(f"{what}: state tensor {tensor.name!r} needs a non-empty shape")
        _check_arena_layout(what, self.arena_layout)


def _check_arena_layout(what: str, layout: str) -> None:
    if layout not in ("layer_major", "page_major"):
        raise ConfigError(
            f"{what}: arena_layout must be 'layer_major' or 'page_major', got {layout!r}"
        )


def attention_group(
    *,
    layers: int | Sequence[int],
    num_kv_heads: int,
    head_dim: int,
    page_tokens: int,
    v_head_dim: int | None = None,
    sliding_window: int | None = None,
    token_layout: TokenLayout = "token_major",
    arena_layout: ArenaLayout = "layer_major",
    group_id: str = "kv",
) -> HistoryGroup:
    """MHA/GQA/MQA K and V caches: fields ``layer.<L>.k`` (``num_kv_heads`` ×
    ``head_dim``) and ``layer.<L>.v`` (``num_kv_heads`` × ``v_head_dim``, default
    ``head_dim``) per token, split across TP ranks by head (:func:`kv_heads_per_rank`).

    ``layers`` is a layer count (layers ``0..n-1``) or the layer ids, e.g. the
    sliding-window layers of a model that alternates (give those a second group
    with its own ``group_id`` and ``sliding_window``)."""
    if token_layout not in ("token_major", "head_major"):
        raise ConfigError(
            f"token_layout must be 'token_major' or 'head_major', got {token_layout!r}"
        )
    _count("num_kv_heads", num_kv_heads)
    _count("head_dim", head_dim)
    v_dim = head_dim if v_head_dim is None else _count("v_head_dim", v_head_dim)
    token_axis = 0 if token_layout == "token_major" else 1
    tensors = (
        CacheTensor("k", (num_kv_heads, head_dim), split_axis=0, token_axis=token_axis),
        CacheTensor("v", (num_kv_heads, v_dim), split_axis=0, token_axis=token_axis),
    )
    return HistoryGroup(
        group_id=group_id,
        layers=_layers(layers),
        tensors=tensors,
        page_tokens=page_tokens,
        sliding_window=sliding_window,
        arena_layout=arena_layout,
    )


def latent_group(
    *,
    layers: int | Sequence[int],
    kv_lora_rank: int,
    rope_dim: int,
    page_tokens: int,
    sliding_window: int | None = None,
    arena_layout: ArenaLayout = "layer_major",
    group_id: str = "kv",
) -> HistoryGroup:
    """MLA latent cache: one field ``layer.<L>.latent_kv`` of
    ``kv_lora_rank + rope_dim`` elements per token (the compressed KV and the
    decoupled RoPE key), not split by TP: every rank holds it whole."""
    _count("kv_lora_rank", kv_lora_rank)
    _count("rope_dim", rope_dim, minimum=0)
    tensor = CacheTensor("latent_kv", (kv_lora_rank + rope_dim,))
    return HistoryGroup(
        group_id=group_id,
        layers=_layers(layers),
        tensors=(tensor,),
        page_tokens=page_tokens,
        sliding_window=sliding_window,
        arena_layout=arena_layout,
    )


# ------------------------------------------------------------------- contracts


@dataclass(frozen=True, slots=True)
class _Field:
    spec: FieldSpec
    partition: Partition | None


def _fields(group: HistoryGroup | StateGroup, dtype: str, tp_size: int) -> list[_Field]:
    """The group's fields on this rank, layer by layer (plane, offset, stride unset)."""
    out: list[_Field] = []
    for layer in group.layers:
        for tensor in group.tensors:
            fid = f"layer.{layer}.{tensor.name}"
            shape = list(tensor.shape)
            partition = None
            axis = tensor.split_axis
            if axis is not None:
                extent = tensor.shape[axis]
                shape[axis] = _local_extent(
                    f"cache group {group.group_id!r} tensor {tensor.name!r} "
                    f"({extent} on axis {axis})",
                    extent,
                    tensor.parts,
                    tp_size,
                )
                if isinstance(group, HistoryGroup) and tensor.token_axis <= axis:
                    axis += 1  # the page's token axis goes in front of it
                partition = Partition(axis, extent, tensor.parts)
            if isinstance(group, HistoryGroup):
                shape.insert(tensor.token_axis, group.page_tokens // group.entry_stride_tokens)
            field_dtype = cache_dtype(tensor.dtype) if tensor.dtype is not None else dtype
            spec = FieldSpec(group.group_id, fid, "", tuple(shape), field_dtype, 0, 0)
            out.append(_Field(spec, partition))
    return out


def _spec(group: HistoryGroup | StateGroup, grain: int) -> GroupSpec:
    if isinstance(group, HistoryGroup):
        return GroupSpec(
            group_id=group.group_id,
            retention="full_history" if group.sliding_window is None else "sliding_window",
            rows_per_page=group.page_tokens // group.entry_stride_tokens,
            entry_stride_tokens=group.entry_stride_tokens,
            sliding_window_tokens=group.sliding_window,
            family="history",
            transfer_policy="full_suffix",
            checkpoint_granularity=None,
        )
    return GroupSpec(
        group_id=group.group_id,
        retention="full_history",
        rows_per_page=None,
        entry_stride_tokens=None,
        sliding_window_tokens=None,
        family="state",
        transfer_policy="latest_snapshot",
        checkpoint_granularity=group.checkpoint_tokens or grain,
    )


def _grain(groups: Sequence[HistoryGroup | StateGroup], prefix_granularity: int | None) -> int:
    blocks = {
        g.group_id: g.page_tokens if isinstance(g, HistoryGroup) else g.checkpoint_tokens
        for g in groups
    }
    known = [b for b in blocks.values() if b is not None]
    if prefix_granularity is None:
        if not known:
            raise ConfigError("state groups alone need checkpoint_tokens or a prefix_granularity")
        return math.lcm(*known)
    grain = _count("prefix_granularity", prefix_granularity)
    for gid, block in blocks.items():
        if block is not None and grain % block:
            raise ConfigError(
                f"prefix_granularity={grain} must be a multiple of cache group {gid!r}'s "
                f"{block}-token pages"
            )
    return grain


def build_contract(
    groups: Sequence[HistoryGroup | StateGroup],
    *,
    num_pages: int,
    dtype: str = "bfloat16",
    tp_size: int = 1,
    prefix_granularity: int | None = None,
) -> CacheContract:
    """One TP rank's contract for a model whose cache is ``groups``, in group order.

    Every group has ``num_pages`` usable pages (page 0 is the null page). ``dtype``
    is the element type of every tensor that names none. ``prefix_granularity``,
    the token grain both peers must share, defaults to the least common multiple
    of the groups' page and checkpoint sizes and must be a multiple of each.
    Planes are laid out back to back in group order (see :data:`ArenaLayout`); the
    fields and their TP partitions follow group, layer and tensor order.

    Raises :class:`ConfigError` for a shape that cannot be laid out (a layer's
    tensor in two groups, a split TP cannot make, …) and
    :class:`~tspd.core.errors.ContractError` when the result breaks a
    :func:`~tspd.core.contract.check_local_contract` rule or does not fit the wire
    (e.g. an arena past 2⁶² bytes, a contract over 256 KiB).
    """
    _count("num_pages", num_pages)
    _check_tp(tp_size)
    element = cache_dtype(dtype)
    if not groups:
        raise ConfigError("a cache contract needs at least one group")
    for group in groups:
        if not isinstance(group, HistoryGroup | StateGroup):
            raise ConfigError(f"not a cache group: {group!r}")
    ids = [g.group_id for g in groups]
    if len(set(ids)) != len(ids):
        raise ConfigError(f"cache group ids must be unique, got {ids}")
    grain = _grain(groups, prefix_granularity)

    owner: dict[str, str] = {}
    planes: list[Plane] = []
    fields: list[FieldSpec] = []
    partitions: list[tuple[str, Partition]] = []
    parents = num_pages + 1
    offset = 0
    for group in groups:
        flat = _fields(group, element, tp_size)
        for f in flat:
            other = owner.setdefault(f.spec.field_id, group.group_id)
            if other != group.group_id:
                raise ConfigError(
                    f"cache field {f.spec.field_id!r} is in groups {other!r} and "
                    f"{group.group_id!r}; give the groups disjoint layers or "
                    "distinct tensor names"
                )
        if group.arena_layout == "layer_major":
            for f in flat:
                payload = f.spec.payload_bytes
                fid = f.spec.field_id
                planes.append(Plane(fid, payload, offset))
                offset += parents * payload
                fields.append(_placed(f.spec, fid, 0, payload))
        else:
            slot = sum(f.spec.payload_bytes for f in flat)
            planes.append(Plane(group.group_id, slot, offset))
            offset += parents * slot
            within = 0
            for f in flat:
                fields.append(_placed(f.spec, group.group_id, within, slot))
                within += f.spec.payload_bytes
        partitions.extend((f.spec.field_id, f.partition) for f in flat if f.partition)

    plan = CacheMemoryPlan(
        prefix_granularity=grain,
        lcm_block_bytes=sum(p.bytes_per_lcm_block for p in planes),
        num_lcm_blocks=num_pages,
        groups=tuple(PlanGroup(g.group_id, 1, parents) for g in groups),
        planes=tuple(planes),
        fields=tuple(fields),
    )
    specs = tuple(_spec(g, grain) for g in groups)
    contract = CacheContract(plan, specs, TransferSchema(tuple(partitions)))
    check_local_contract(contract)
    contract.to_json()  # raises ContractError past the wire's size bound
    return contract


def _placed(spec: FieldSpec, plane_id: str, offset: int, stride: int) -> FieldSpec:
    return FieldSpec(spec.group_id, spec.field_id, plane_id, spec.shape, spec.dtype, offset, stride)


def mha_contract(
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    page_tokens: int,
    num_pages: int,
    dtype: str = "bfloat16",
    tp_size: int = 1,
    v_head_dim: int | None = None,
    sliding_window: int | None = None,
    token_layout: TokenLayout = "token_major",
    arena_layout: ArenaLayout = "layer_major",
) -> CacheContract:
    """One TP rank's contract for an MHA/GQA/MQA model: one group ``"kv"`` of
    ``num_pages`` pages of ``page_tokens`` tokens (sliding when ``sliding_window``
    is given) holding ``layer.<L>.k`` and ``layer.<L>.v`` for every layer, the
    ``num_kv_heads`` KV heads split across ``tp_size`` ranks
    (:func:`kv_heads_per_rank`). See :func:`attention_group` and
    :func:`build_contract`."""
    kv_heads_per_rank(num_kv_heads, tp_size)  # refuse an impossible split by its name
    group = attention_group(
        layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_tokens=page_tokens,
        v_head_dim=v_head_dim,
        sliding_window=sliding_window,
        token_layout=token_layout,
        arena_layout=arena_layout,
    )
    return build_contract([group], num_pages=num_pages, dtype=dtype, tp_size=tp_size)


def mla_contract(
    *,
    num_layers: int,
    kv_lora_rank: int,
    rope_dim: int,
    page_tokens: int,
    num_pages: int,
    dtype: str = "bfloat16",
    arena_layout: ArenaLayout = "layer_major",
) -> CacheContract:
    """The contract of an MLA model (e.g. ``kv_lora_rank=512, rope_dim=64``): one
    group ``"kv"`` holding ``layer.<L>.latent_kv`` for every layer. The latent
    cache is not split by TP, so every rank of any TP size has this contract."""
    group = latent_group(
        layers=num_layers,
        kv_lora_rank=kv_lora_rank,
        rope_dim=rope_dim,
        page_tokens=page_tokens,
        arena_layout=arena_layout,
    )
    return build_contract([group], num_pages=num_pages, dtype=dtype)


# ------------------------------------------------------------------- pages


@final
class PageAllocator:
    """Free pages per group of a contract, handed out one request at a time.

    ``contiguous=True`` hands out the lowest free ids in order (a fresh allocator
    gives a request pages ``1, 2, 3, …``); otherwise pages are drawn at random from
    ``rng`` (``random.Random(0)`` when not given), the worst case for coalescing.
    """

    def __init__(
        self,
        contract: CacheContract,
        *,
        rng: random.Random | None = None,
        contiguous: bool = True,
    ) -> None:
        self.contract = contract
        self._rng = random.Random(0) if rng is None else rng
        self._contiguous = contiguous
        self._free = {gid: set(range(1, contract.page_count(gid))) for gid in contract.group_ids}
        #: Contiguous mode: per group, a min-heap holding exactly the free ids, so a
        #: request's lowest free ids cost O(pages taken × log pages), not a sort of
        #: every free page.
        self._lowest = {gid: sorted(free) if contiguous else [] for gid, free in self._free.items()}

    def free_pages(self, group_id: str) -> int:
        """How many pages of ``group_id`` are free."""
        return len(self._free[group_id])

    def allocate(self, prompt_len: int, prefix_len: int = 0) -> dict[str, list[int]]:
        """One request's block-table rows: per group, a distinct free block id at every
        logical slot of the window ``[prefix_len, prompt_len)``
        (docs/protocol.md#proto-logical-slots); slots before the window hold the null id
        0. Raises :class:`ConfigError` (and takes nothing) when a group runs out of
        pages."""
        if not 0 <= prefix_len < prompt_len:
            raise ConfigError(f"need 0 <= prefix_len < prompt_len, got {prefix_len}, {prompt_len}")
        windows = {
            gid: logical_slots(self.contract.group(gid), prefix_len, prompt_len)
            for gid in self.contract.group_ids
        }
        for gid, slots in windows.items():
            if len(slots) > len(self._free[gid]):
                raise ConfigError(
                    f"group {gid!r} has {len(self._free[gid])} free pages; "
                    f"a {prompt_len}-token prompt needs {len(slots)}"
                )
        tables: dict[str, list[int]] = {}
        for gid, slots in windows.items():
            free = self._free[gid]
            if self._contiguous:
                picked = self._take_lowest(gid, len(slots))
            else:
                picked = self._rng.sample(sorted(free), len(slots))
            free.difference_update(picked)
            row = [0] * (slots.stop if slots else 0)
            for slot, block in zip(slots, picked, strict=True):
                row[slot] = block
            tables[gid] = row
        return tables

    def release(self, tables: Mapping[str, Sequence[int]]) -> None:
        """Return a request's pages (ids ≤ 0 are padding, not pages)."""
        for gid, row in tables.items():
            free, lowest = self._free[gid], self._lowest[gid]
            for block in map(int, row):
                if block > 0 and block not in free:
                    free.add(block)
                    if self._contiguous:
                        heapq.heappush(lowest, block)

    def _take_lowest(self, group_id: str, count: int) -> list[int]:
        """The ``count`` lowest free ids of ``group_id``, in order (the caller
        checked that many are free and takes them off the free set)."""
        lowest = self._lowest[group_id]  # exactly the free ids
        return [heapq.heappop(lowest) for _ in range(count)]
