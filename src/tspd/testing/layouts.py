"""Ready-made cache transfer contracts and block tables for tests.

Product code builds its contracts with :mod:`tspd.layouts` (the supported builders
for real model shapes) and allocates pages with :class:`tspd.layouts.PageAllocator`,
re-exported here. The builders below are test fixtures with test-only knobs (any
local/global head pairing, a toy state group); they return validated
:class:`~tspd.core.contract.CacheContract` objects with small but realistic arenas:

* :func:`simple_contract`: one full-history group, one plane, one field — the smallest
  thing a transfer can move (and the geometry of the interop vectors of
  docs/protocol.md#proto-interop).
* :func:`multi_layer_contract`: a model's per-layer K and V caches, each in its own
  plane, partitioned on the head axis so Prefill and Decode contracts of different TP
  sizes pair up (docs/protocol.md#proto-fragments); optionally a sliding window and a
  state group with the ``latest_snapshot`` policy.

:func:`allocate_tables` and :func:`room_manifest` stand in for an engine's block
manager: they hand one request a block id for every logical slot of its window,
from a fresh :class:`~tspd.layouts.PageAllocator`.
"""

from __future__ import annotations

import random

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
)
from tspd.core.errors import ConfigError
from tspd.core.manifest import BlockManifest, build_manifest
from tspd.layouts import PageAllocator

__all__ = [
    "PageAllocator",
    "allocate_tables",
    "multi_layer_contract",
    "room_manifest",
    "simple_contract",
]


def simple_contract(
    *,
    num_pages: int,
    page_bytes: int,
    group_id: str = "full",
    field_id: str = "layer.0.kv",
    dtype: str = "uint8",
    page_tokens: int = 16,
) -> CacheContract:
    """One full-history group of ``num_pages`` usable pages (plus the null page 0),
    one plane and one field whose page payload is ``page_bytes`` bytes.

    A page holds ``page_tokens`` tokens, which is also the prefix granularity.
    """
    width = DTYPE_WIDTHS.get(dtype)
    if width is None or page_bytes <= 0 or page_bytes % width:
        raise ConfigError(
            f"page_bytes={page_bytes} is not a positive whole number of {dtype!r} elements"
        )
    plan = CacheMemoryPlan(
        prefix_granularity=page_tokens,
        lcm_block_bytes=page_bytes,
        num_lcm_blocks=num_pages,
        groups=(PlanGroup(group_id, 1, num_pages + 1),),
        planes=(Plane("kv", page_bytes, 0),),
        fields=(FieldSpec(group_id, field_id, "kv", (page_bytes // width,), dtype, 0, page_bytes),),
    )
    spec = GroupSpec(
        group_id=group_id,
        retention="full_history",
        rows_per_page=page_tokens,
        entry_stride_tokens=1,
        sliding_window_tokens=None,
        family="history",
        transfer_policy="full_suffix",
        checkpoint_granularity=None,
    )
    return CacheContract(plan, (spec,), TransferSchema())


def multi_layer_contract(
    *,
    layers: int,
    num_pages: int,
    heads: int,
    head_dim: int,
    dtype: str = "bfloat16",
    tp_size: int = 1,
    global_heads: int | None = None,
    with_state_group: bool = False,
    prefix_granularity: int | None = None,
    page_tokens: int = 4,
    sliding_window_tokens: int | None = None,
    state_dim: int | None = None,
) -> CacheContract:
    """A model's KV cache on one TP rank.

    * Group ``"kv"`` (history family, ``page_tokens`` tokens a page; sliding when
      ``sliding_window_tokens`` is given): fields ``layer.<L>.k`` and ``layer.<L>.v``
      of shape ``(page_tokens, heads, head_dim)``, each in its own plane, so a
      field's consecutive pages are adjacent in the arena.
    * ``heads`` is this rank's (local) KV head count; ``global_heads`` defaults to
      ``heads * tp_size``. Every K/V field is partitioned on axis 1 with that global
      extent, so e.g. ``heads=4, tp_size=1`` and ``heads=2, tp_size=2`` describe the
      same model on TP1 and TP2; ``global_heads < heads * tp_size`` models GQA
      replicas.
    * ``with_state_group`` adds group ``"state"`` (state family, ``latest_snapshot``,
      a checkpoint every ``prefix_granularity`` tokens) with one field
      ``layer.<L>.state`` of shape ``(heads, state_dim)`` per layer, partitioned on
      axis 0, all packed into one plane at per-layer field offsets.

    ``prefix_granularity`` defaults to ``page_tokens`` and must be a multiple of it.
    """
    if layers <= 0 or heads <= 0 or head_dim <= 0 or tp_size <= 0 or page_tokens <= 0:
        raise ConfigError("layers, heads, head_dim, tp_size and page_tokens must be positive")
    grain = page_tokens if prefix_granularity is None else prefix_granularity
    if grain <= 0 or grain % page_tokens:
        raise ConfigError(
            f"prefix_granularity={grain} must be a positive multiple of page_tokens={page_tokens}"
        )
    total_heads = heads * tp_size if global_heads is None else global_heads
    width = DTYPE_WIDTHS.get(dtype)
    if width is None:
        raise ConfigError(f"unsupported cache dtype {dtype!r}")
    kv_payload = page_tokens * heads * head_dim * width
    planes: list[Plane] = []
    fields: list[FieldSpec] = []
    partitions: list[tuple[str, Partition]] = []
    parents = num_pages + 1
    offset = 0
    for layer in range(layers):
        for part in ("k", "v"):
            plane_id = f"layer.{layer}.{part}"
            planes.append(Plane(plane_id, kv_payload, offset))
            offset += parents * kv_payload
            fid = f"layer.{layer}.{part}"
            fields.append(
                FieldSpec("kv", fid, plane_id, (page_tokens, heads, head_dim), dtype, 0, kv_payload)
            )
            partitions.append((fid, Partition(axis=1, global_extent=total_heads)))
    groups = [PlanGroup("kv", 1, parents)]
    specs = [
        GroupSpec(
            group_id="kv",
            retention="full_history" if sliding_window_tokens is None else "sliding_window",
            rows_per_page=page_tokens,
            entry_stride_tokens=1,
            sliding_window_tokens=sliding_window_tokens,
            family="history",
            transfer_policy="full_suffix",
            checkpoint_granularity=None,
        )
    ]
    if with_state_group:
        dim = head_dim if state_dim is None else state_dim
        state_payload = heads * dim * width
        stride = layers * state_payload
        planes.append(Plane("state", stride, offset))
        offset += parents * stride
        for layer in range(layers):
            fid = f"layer.{layer}.state"
            fields.append(
                FieldSpec("state", fid, "state", (heads, dim), dtype, layer * state_payload, stride)
            )
            partitions.append((fid, Partition(axis=0, global_extent=total_heads)))
        groups.append(PlanGroup("state", 1, parents))
        specs.append(
            GroupSpec(
                group_id="state",
                retention="full_history",
                rows_per_page=None,
                entry_stride_tokens=None,
                sliding_window_tokens=None,
                family="state",
                transfer_policy="latest_snapshot",
                checkpoint_granularity=grain,
            )
        )
    plan = CacheMemoryPlan(
        prefix_granularity=grain,
        lcm_block_bytes=sum(p.bytes_per_lcm_block for p in planes),
        num_lcm_blocks=num_pages,
        groups=tuple(groups),
        planes=tuple(planes),
        fields=tuple(fields),
    )
    return CacheContract(plan, tuple(specs), TransferSchema(tuple(partitions)))


def allocate_tables(
    contract: CacheContract,
    prompt_len: int,
    prefix_len: int = 0,
    *,
    rng: random.Random | None = None,
    contiguous: bool = True,
) -> dict[str, list[int]]:
    """Block-table rows for one request from a fresh :class:`~tspd.layouts.PageAllocator`."""
    allocator = PageAllocator(contract, rng=rng, contiguous=contiguous)
    return allocator.allocate(prompt_len, prefix_len)


def room_manifest(
    contract: CacheContract,
    prompt_len: int,
    prefix_len: int = 0,
    *,
    rng: random.Random | None = None,
    contiguous: bool = True,
    allocator: PageAllocator | None = None,
) -> BlockManifest:
    """A validated manifest for one room: tables from ``allocator`` (a fresh one when
    not given) turned into a manifest by :func:`~tspd.core.manifest.build_manifest`."""
    source = allocator or PageAllocator(contract, rng=rng, contiguous=contiguous)
    tables = source.allocate(prompt_len, prefix_len)
    return build_manifest(contract, tables, prefix_len, prompt_len)
