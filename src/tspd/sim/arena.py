"""The arena model: what each simulated rank's cache memory holds, cheaply.

Real arenas are never allocated. An arena is a Python list of *cells*, one per
``head_dim`` elements of one token of one KV head (the unit every planned copy is
made of, docs/protocol.md#proto-fragments); a cell holds a *tag* (an ``int``) or
``None`` (zeroed, or never written). The tag says what the cell's bytes would be:

    tag = ((((room_index * fields + field) * slots + slot) * page_tokens + token)
           * kv_heads + global_head)

so a Prefill rank "computes" a room's KV by writing the tags of its own heads into
its pages, a write copies tags cell for cell (list slices, as cheap as it gets),
and a Decode rank's page is right exactly when every cell holds the tag of *its*
global head at that slot and token of *that* room. The expected tags are derived
from the Decode rank's own geometry (:func:`tspd.layouts.kv_head_range`), never
from the transfer planner, so a planning or execution error shows up as data.

Geometry assumes the simulator's contracts (:func:`geometry_for`): one group,
token-major pages (``(page_tokens, heads, head_dim)``), one plane per field, a K
and a V field per layer. A layerwise forward fills one layer's fields of one chunk
of tokens at a time (:func:`fill_tokens`), so a write that reads its source before
the producer step that computes it copies stale cells.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache

from tspd.core.contract import CacheContract
from tspd.core.schedule import ProducerSchedule
from tspd.layouts import kv_head_range, mha_contract

__all__ = [
    "GROUP",
    "Geometry",
    "Mismatch",
    "PagePool",
    "TagCodec",
    "check",
    "clear",
    "contract_for",
    "fill",
    "fill_tokens",
    "geometry_for",
    "schedule_for",
    "zero",
]

#: The simulator's one page group.
GROUP = "kv"


@cache
def contract_for(
    tp_size: int,
    kv_heads: int,
    head_dim: int,
    page_tokens: int,
    num_pages: int,
    layers: int = 1,
) -> CacheContract:
    """The contract every rank of a TP group of ``tp_size`` registers: ``layers``
    layers of an MHA model, token-major and layer-major (cached: ranks share it)."""
    return mha_contract(
        num_layers=layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        page_tokens=page_tokens,
        num_pages=num_pages,
        tp_size=tp_size,
    )


@dataclass(frozen=True, slots=True)
class TagCodec:
    """Encodes what a cell should hold; shared by every rank of a run."""

    fields: int
    slots: int
    page_tokens: int
    kv_heads: int

    def base(self, room_index: int, field: int, slot: int) -> int:
        """The tag of token 0, head 0 of ``slot`` of ``field`` of the room."""
        return ((room_index * self.fields + field) * self.slots + slot) * (
            self.page_tokens * self.kv_heads
        )

    def room_of(self, tag: int) -> int:
        """The room index a tag belongs to."""
        return tag // (self.fields * self.slots * self.page_tokens * self.kv_heads)

    def describe(self, tag: int | None) -> str:
        """A tag as ``room#i field f slot s token t head h``."""
        if tag is None:
            return "nothing"
        rest, head = divmod(tag, self.kv_heads)
        rest, token = divmod(rest, self.page_tokens)
        rest, slot = divmod(rest, self.slots)
        room, fid = divmod(rest, self.fields)
        return f"room#{room} field {fid} slot {slot} token {token} head {head}"


@dataclass(frozen=True, slots=True)
class Mismatch:
    """The first wrong cell of a page: what it holds and what it should."""

    field: int
    slot: int
    page: int
    cell: int
    found: int | None
    wanted: int


class Geometry:
    """Cell layout of one rank's arena (one per TP size and rank)."""

    __slots__ = (
        "cell_bytes",
        "cells",
        "cells_per_page",
        "chunk_end",
        "field_ids",
        "field_index",
        "local_heads",
        "offsets",
        "page_of_cell",
        "page_starts",
        "page_tokens",
    )

    def __init__(self, contract: CacheContract, heads: range, kv_heads: int) -> None:
        fields = [f for f in contract.plan.fields if f.group_id == GROUP]
        first = fields[0]
        self.page_tokens, self.local_heads, head_dim = first.shape
        self.cell_bytes = head_dim * first.dtype_width
        self.cells_per_page = self.page_tokens * self.local_heads
        self.cells = contract.arena_bytes // self.cell_bytes
        self.field_ids = tuple(f.field_id for f in fields)
        #: Each field's number in the tags (its place in the contract's plan).
        self.field_index = {fid: i for i, fid in enumerate(self.field_ids)}
        pages = contract.page_count(GROUP)
        #: Per field, per page id: the page's first cell.
        self.page_starts = [
            [contract.page_offset(f, page) // self.cell_bytes for page in range(pages)]
            for f in fields
        ]
        #: Each cell's page id (``-1``: no page's payload; ``0``: the null page).
        self.page_of_cell = [-1] * self.cells
        #: Each cell's page chunk end (the first cell after its page's payload).
        self.chunk_end = list(range(1, self.cells + 1))
        per = self.cells_per_page
        for starts in self.page_starts:
            for page, start in enumerate(starts):
                self.page_of_cell[start : start + per] = [page] * per
                self.chunk_end[start : start + per] = [start + per] * per
        #: Per cell of a page (token-major): ``token * kv_heads + global_head``.
        self.offsets = [
            token * kv_heads + heads[local]
            for token in range(self.page_tokens)
            for local in range(self.local_heads)
        ]


@cache
def geometry_for(
    tp_size: int,
    tp_rank: int,
    kv_heads: int,
    head_dim: int,
    page_tokens: int,
    num_pages: int,
    layers: int = 1,
) -> Geometry:
    """The geometry of rank ``tp_rank`` of a TP group of ``tp_size`` (cached)."""
    contract = contract_for(tp_size, kv_heads, head_dim, page_tokens, num_pages, layers)
    return Geometry(contract, kv_head_range(kv_heads, tp_size, tp_rank), kv_heads)


@cache
def schedule_for(contract: CacheContract, layers: int) -> ProducerSchedule:
    """The producer schedule of ``contract``: one step per layer, holding that
    layer's K and V fields (:meth:`ProducerSchedule.from_contract`)."""
    return ProducerSchedule.from_contract(contract, layers)


def fill(
    arena: list[int | None],
    geometry: Geometry,
    codec: TagCodec,
    room_index: int,
    pages: Sequence[int],
) -> None:
    """A Prefill rank computes a room: every cell of its pages gets its tag."""
    offsets = geometry.offsets
    per = geometry.cells_per_page
    for field, starts in enumerate(geometry.page_starts):
        for slot, page in enumerate(pages):
            base = codec.base(room_index, field, slot)
            start = starts[page]
            arena[start : start + per] = [base + o for o in offsets]


def fill_tokens(
    arena: list[int | None],
    geometry: Geometry,
    codec: TagCodec,
    room_index: int,
    pages: Sequence[int],
    field_ids: Iterable[str],
    begin: int,
    end: int,
) -> None:
    """A forward computes tokens ``[begin, end)`` of the room's ``field_ids`` (one
    layer's step): their cells get their tags, the rest of each page is untouched."""
    offsets = geometry.offsets
    page_tokens, local = geometry.page_tokens, geometry.local_heads
    for fid in field_ids:
        field = geometry.field_index[fid]
        starts = geometry.page_starts[field]
        token = begin
        while token < end:
            slot, first = divmod(token, page_tokens)
            last = min(page_tokens, first + end - token)
            base = codec.base(room_index, field, slot)
            start = starts[pages[slot]]
            arena[start + first * local : start + last * local] = [
                base + o for o in offsets[first * local : last * local]
            ]
            token += last - first


def clear(arena: list[int | None]) -> None:
    """The arena's memory was released (a sleep): it holds nothing any more."""
    arena[:] = [None] * len(arena)


def zero(arena: list[int | None], geometry: Geometry, pages: Sequence[int]) -> None:
    """A Decode rank zeroes a room's pages before pre-allocating them."""
    per = geometry.cells_per_page
    blank: list[int | None] = [None] * per
    for starts in geometry.page_starts:
        for page in pages:
            start = starts[page]
            arena[start : start + per] = blank


def check(
    arena: Sequence[int | None],
    geometry: Geometry,
    codec: TagCodec,
    room_index: int,
    pages: Sequence[int],
    prompt_len: int,
) -> Mismatch | None:
    """The first cell of the room's pages (tokens below ``prompt_len``) that does
    not hold the room's data for this rank's heads, or ``None`` when all do."""
    offsets = geometry.offsets
    page_tokens = geometry.page_tokens
    local = geometry.local_heads
    for field, starts in enumerate(geometry.page_starts):
        for slot, page in enumerate(pages):
            valid = min(page_tokens, prompt_len - slot * page_tokens) * local
            if valid <= 0:
                break
            base = codec.base(room_index, field, slot)
            start = starts[page]
            found = arena[start : start + valid]
            wanted = [base + o for o in offsets[:valid]]
            if found != wanted:
                cell = next(i for i in range(valid) if found[i] != wanted[i])
                return Mismatch(field, slot, page, cell, found[cell], wanted[cell])
    return None


class PagePool:
    """Free page ids of one instance's group (page 0 is the null page, never
    handed out); pages are drawn at random from the run's generator, the worst
    case for coalescing, as a busy block manager hands them out."""

    __slots__ = ("_free", "_rng")

    def __init__(self, num_pages: int, rng: random.Random) -> None:
        self._free = list(range(1, num_pages + 1))
        self._rng = rng

    def __len__(self) -> int:
        return len(self._free)

    def take(self, count: int) -> list[int] | None:
        """``count`` distinct free pages, or ``None`` (nothing taken) if too few."""
        free = self._free
        if count > len(free):
            return None
        pages: list[int] = []
        rng = self._rng
        for _ in range(count):
            i = rng.randrange(len(free))
            free[i], free[-1] = free[-1], free[i]
            pages.append(free.pop())
        return pages

    def give(self, pages: Sequence[int]) -> None:
        """Return pages."""
        self._free.extend(pages)
