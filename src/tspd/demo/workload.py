"""What the demo's roles agree on without talking: contracts, rooms, prompt lengths.

A Prefill rank and a Decode rank of the demo run in separate processes (possibly
of different implementations). They agree on the request stream by construction:
the same ``--rooms`` range in the same order, and each room's prompt length drawn
from ``(seed, room)``. The KV bytes and the bootstrap token follow the spec §15
interop pattern, so the Decode side can check every byte it received.

Contracts: :func:`demo_contract` — per layer a K and a V field laid out
head-major, ``(heads, page_tokens, head_dim)``, partitioned on the head axis — or
a contract file a rank is given (``--contract``). Head-major matters for
heterogeneous TP: a Prefill rank's share of a Decode page is then one contiguous
run per field and page, where a token-major layout (``(page_tokens, heads,
head_dim)``) cuts it into one small row per token, and Mooncake over TCP pays
about 40 µs per descriptor.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from tspd.core.contract import (
    CacheContract,
    CacheMemoryPlan,
    FieldSpec,
    GroupSpec,
    Partition,
    Plane,
    PlanGroup,
    TransferSchema,
    dtype_width,
    parse_contract,
)
from tspd.core.errors import ConfigError

__all__ = ["Workload", "demo_contract", "parse_rooms"]


def demo_contract(
    *,
    layers: int,
    num_pages: int,
    heads: int,
    head_dim: int,
    page_tokens: int,
    tp_size: int,
    global_heads: int,
    dtype: str = "bfloat16",
) -> CacheContract:
    """One TP rank's KV cache: group ``"kv"`` (full history, ``page_tokens`` tokens a
    page) with fields ``layer.<L>.k`` / ``layer.<L>.v`` of local shape
    ``(heads, page_tokens, head_dim)``, each in its own plane, partitioned on axis 0
    with ``global_heads`` in all."""
    if heads * tp_size < global_heads or global_heads % heads:
        raise ConfigError(
            f"{heads} local KV heads on TP={tp_size} cannot hold {global_heads} global heads"
        )
    payload = heads * page_tokens * head_dim * dtype_width(dtype)
    planes: list[Plane] = []
    fields: list[FieldSpec] = []
    partitions: list[tuple[str, Partition]] = []
    offset = 0
    for layer in range(layers):
        for part in ("k", "v"):
            fid = f"layer.{layer}.{part}"
            planes.append(Plane(fid, payload, offset))
            offset += (num_pages + 1) * payload
            fields.append(
                FieldSpec("kv", fid, fid, (heads, page_tokens, head_dim), dtype, 0, payload)
            )
            partitions.append((fid, Partition(axis=0, global_extent=global_heads)))
    plan = CacheMemoryPlan(
        prefix_granularity=page_tokens,
        lcm_block_bytes=sum(p.bytes_per_lcm_block for p in planes),
        num_lcm_blocks=num_pages,
        groups=(PlanGroup("kv", 1, num_pages + 1),),
        planes=tuple(planes),
        fields=tuple(fields),
    )
    spec = GroupSpec(
        group_id="kv",
        retention="full_history",
        rows_per_page=page_tokens,
        entry_stride_tokens=1,
        sliding_window_tokens=None,
        family="history",
        transfer_policy="full_suffix",
        checkpoint_granularity=None,
    )
    return CacheContract(plan, (spec,), TransferSchema(tuple(partitions)))


def parse_rooms(text: str) -> range:
    """``A:B`` → rooms ``A, A+1, …, B-1``; a single ``A`` → just ``A``."""
    try:
        if ":" in text:
            first, _, stop = text.partition(":")
            rooms = range(int(first), int(stop))
        else:
            rooms = range(int(text), int(text) + 1)
    except ValueError:
        raise ConfigError(f"rooms must be 'A:B' (rooms A..B-1), got {text!r}") from None
    if not rooms or rooms.start < 0 or rooms.stop - 1 > 2**63 - 1:
        raise ConfigError(f"rooms {text!r} must be a non-empty range inside [0, 2^63-1]")
    return rooms


@dataclass(frozen=True, slots=True)
class Workload:
    """The request stream and cache geometry both sides of the demo use.

    ``max_prompt_pages`` bounds a prompt's pages (each room gets 1..max pages
    worth of tokens); ``fixed_prompt_pages`` gives every room exactly that many
    (the benchmarks). ``candidates`` is the number of speculative candidates sent
    with each bootstrap token.
    """

    rooms: range
    seed: int = 0
    layers: int = 2
    global_heads: int = 4
    head_dim: int = 64
    page_tokens: int = 16
    num_pages: int = 2048
    dtype: str = "bfloat16"
    max_prompt_pages: int = 8
    fixed_prompt_pages: int | None = None
    candidates: int = 2
    contract_file: str | None = None

    def contract(self, tp_size: int) -> CacheContract:
        """This workload's contract for a rank of a TP group of ``tp_size``."""
        if self.contract_file is not None:
            return parse_contract(Path(self.contract_file).read_bytes())
        # More ranks than KV heads: each rank holds one head and ranks replicate
        # heads (GQA), which gives the Prefill side dummy ranks (spec §6.4).
        heads = max(1, self.global_heads // tp_size)
        if self.global_heads % heads or tp_size % (self.global_heads // heads):
            raise ConfigError(
                f"{self.global_heads} KV heads cannot be split over TP={tp_size}; "
                "pick a TP size that divides the head count or a multiple of it"
            )
        return demo_contract(
            layers=self.layers,
            num_pages=self.num_pages,
            heads=heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            tp_size=tp_size,
            global_heads=self.global_heads,
            page_tokens=self.page_tokens,
        )

    def prompt_len(self, room: int, contract: CacheContract) -> int:
        """Room ``room``'s prompt length in tokens (the same on every rank)."""
        grain = min(spec.block_granularity for spec in contract.group_specs)
        if self.fixed_prompt_pages is not None:
            return self.fixed_prompt_pages * grain
        digest = hashlib.blake2b(f"{self.seed}:{room}".encode(), digest_size=8).digest()
        return 1 + int.from_bytes(digest, "little") % (self.max_prompt_pages * grain)

    @staticmethod
    def rid(room: int) -> str:
        """The request id both sides use for ``room``."""
        return f"room-{room}"
