"""``tspd bench core``: what the sans-IO core costs on its hot paths.

Measured, with ``time.perf_counter`` loops after a warmup (best of a few rounds):

* decoding a pre-allocation the way a Prefill rank does (frame checks, then the
  manifest parse) for a realistic manifest, and encoding / decoding a status;
* planning one room's copies, per 1,000 pages of the room, for an equal-TP
  whole-copy route and a heterogeneous-TP fragment route (Prefill TP1 → Decode
  TP2, so every page is copied row by row), each without and with ``coalesce``,
  with the number of descriptors an engine would be handed before and after
  coalescing;
* one hand-over's plan (:func:`~tspd.core.copies.plan_steps`, coalesced, as
  ``PrefillCore.hand_over`` calls it) for rooms of 1, 8 and 1,000 scattered 4 KiB
  pages of a one-field contract (the ``tspd bench pd`` layout): small rooms take
  the plain-Python path, big ones numpy.

Figures only; nothing here asserts a speed.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import click
from rich.console import Console
from rich.table import Table

from tspd.core.contract import CacheContract
from tspd.core.copies import CopyPlan, coalesce, plan_copies, plan_steps
from tspd.core.interop import bootstrap_token_and_candidates
from tspd.core.manifest import BlockManifest, build_manifest
from tspd.core.planner import PlannedRegistration, plan_registration
from tspd.core.poll import TransferPoll
from tspd.core.wire import (
    StatusMessage,
    decode_preallocation,
    decode_status,
    encode_preallocation,
    encode_status,
)
from tspd.layouts import CacheTensor, HistoryGroup, PageAllocator, build_contract, mha_contract

__all__ = [
    "Row",
    "Sizes",
    "core",
    "fresh_manifest",
    "measure",
    "one_field_contract",
    "run_core_benchmarks",
]

_PAGE_TOKENS = 16
_HEADS = 8
_HEAD_DIM = 128
_SRC_BASE = 0x7F00_0000_0000
_DST_BASE = 0x7E00_0000_0000
#: Room sizes, in pages, of the hand-over plan rows.
HAND_OVER_PAGES = (1, 8, 1000)
_HAND_OVER_PAGE_BYTES = 4096


@dataclass(frozen=True, slots=True)
class Sizes:
    """How big and how long: model layers, pages in the room, seconds per round."""

    layers: int
    pages: int
    min_seconds: float
    rounds: int


FULL = Sizes(layers=32, pages=2048, min_seconds=0.2, rounds=5)
QUICK = Sizes(layers=2, pages=64, min_seconds=0.002, rounds=1)


@dataclass(frozen=True, slots=True)
class Row:
    """One line of the table: a measured cost and, for plans, the descriptor count."""

    what: str
    micros: float
    per: str
    descriptors: int | None = None


def measure(fn: Callable[[], object], *, min_seconds: float, rounds: int) -> float:
    """Seconds per call of ``fn``: the best of ``rounds`` rounds, each a loop grown
    until it runs at least ``min_seconds``, after one warmup round."""
    best = float("inf")
    for round_number in range(rounds + 1):
        n = 1
        while True:
            start = time.perf_counter()
            for _ in range(n):
                fn()
            elapsed = time.perf_counter() - start
            if elapsed >= min_seconds:
                break
            n *= 2
        if round_number:  # round 0 is the warmup
            best = min(best, elapsed / n)
    return best


def _micros(fn: Callable[[], object], sizes: Sizes) -> float:
    return measure(fn, min_seconds=sizes.min_seconds, rounds=sizes.rounds) * 1e6


def one_field_contract(*, num_pages: int, page_bytes: int) -> CacheContract:
    """Group ``"full"`` of 16-token pages holding one field, ``layer.0.kv``, of
    ``page_bytes`` bytes a page, whole on every rank: the smallest thing a transfer
    moves (the hand-over rows here, and ``tspd bench pd``)."""
    tensor = CacheTensor("kv", (page_bytes // 16,), dtype="uint8")
    group = HistoryGroup("full", (0,), (tensor,), page_tokens=16)
    return build_contract([group], num_pages=num_pages)


def fresh_manifest(
    contract: CacheContract,
    prompt_len: int,
    *,
    rng: random.Random | None = None,
    contiguous: bool = True,
) -> BlockManifest:
    """A manifest for one ``prompt_len``-token room from a fresh
    :class:`~tspd.layouts.PageAllocator` of ``contract``."""
    tables = PageAllocator(contract, rng=rng, contiguous=contiguous).allocate(prompt_len)
    return build_manifest(contract, tables, 0, prompt_len)


def _contract(sizes: Sizes, *, tp_size: int) -> CacheContract:
    """The benchmark model (``_HEADS`` KV heads of ``_HEAD_DIM``) on one TP rank."""
    return mha_contract(
        num_layers=sizes.layers,
        num_kv_heads=_HEADS,
        head_dim=_HEAD_DIM,
        page_tokens=_PAGE_TOKENS,
        num_pages=sizes.pages,
        tp_size=tp_size,
    )


def _plan_rows(
    label: str,
    sizes: Sizes,
    src: CacheContract,
    dst: CacheContract,
    registration: PlannedRegistration,
) -> list[Row]:
    prompt_len = sizes.pages * _PAGE_TOKENS
    src_manifest = fresh_manifest(src, prompt_len)
    dst_manifest = fresh_manifest(dst, prompt_len)

    def plan() -> CopyPlan:
        return plan_copies(
            src_contract=src,
            src_base=_SRC_BASE,
            dst_contract=dst,
            dst_base=_DST_BASE,
            dst_manifest=dst_manifest,
            source=src_manifest,
            registration=registration,
        )

    def plan_and_coalesce() -> CopyPlan:
        return coalesce(plan())

    per_kpage = 1000 / sizes.pages
    raw = len(plan())
    merged = len(plan_and_coalesce())
    return [
        Row(
            f"{label}: plan_copies",
            _micros(plan, sizes) * per_kpage,
            "1k pages",
            round(raw * per_kpage),
        ),
        Row(
            f"{label}: plan + coalesce",
            _micros(plan_and_coalesce, sizes) * per_kpage,
            "1k pages",
            round(merged * per_kpage),
        ),
    ]


def _hand_over_row(pages: int, sizes: Sizes) -> Row:
    """One room's coalesced plan the way ``PrefillCore.hand_over`` builds it."""
    contract = one_field_contract(num_pages=2 * pages + 8, page_bytes=_HAND_OVER_PAGE_BYTES)
    prompt_len = pages * 16
    src_manifest = fresh_manifest(contract, prompt_len, rng=random.Random(1), contiguous=False)
    dst_manifest = fresh_manifest(contract, prompt_len, rng=random.Random(2), contiguous=False)
    registration = plan_registration(
        prefill_tp=1,
        prefill_rank=0,
        prefill_contract=contract,
        decode_tp=1,
        decode_rank=0,
        decode_contract=contract,
    )

    def plan() -> tuple[CopyPlan, ...]:
        return plan_steps(
            src_contract=contract,
            src_base=_SRC_BASE,
            dst_contract=contract,
            dst_base=_DST_BASE,
            dst_manifest=dst_manifest,
            source=src_manifest,
            registration=registration,
            steps=(None,),
            coalesced=True,
        )

    label = f"hand_over plan, {pages:,} page{'s' if pages > 1 else ''}"
    return Row(label, _micros(plan, sizes), "room", len(plan()[0]))


def run_core_benchmarks(sizes: Sizes) -> tuple[list[Row], str]:
    """Measure every row; also return a caption describing the workload."""
    rows: list[Row] = []

    # Wire: a Decode manifest of `pages` pages, as a Prefill rank receives it.
    decode_tp1 = _contract(sizes, tp_size=1)
    manifest = fresh_manifest(decode_tp1, sizes.pages * _PAGE_TOKENS)
    frames = encode_preallocation(2**62 + 12345, "10.0.0.2:16001", manifest)

    def preallocation() -> object:
        return decode_preallocation(frames).manifest()

    rows.append(
        Row(
            "pre-allocation decode + manifest",
            _micros(preallocation, sizes),
            "message",
        )
    )
    token, candidates = bootstrap_token_and_candidates(0, 1_000_000, 3)
    status = StatusMessage(1_000_000, TransferPoll.SUCCESS, 3, token, candidates, 4096, -0.0625)
    status_frames = encode_status(status)
    rows.append(
        Row(
            "status encode (7 frames)",
            _micros(lambda: encode_status(status), sizes),
            "message",
        )
    )
    rows.append(
        Row(
            "status decode (7 frames)",
            _micros(lambda: decode_status(status_frames), sizes),
            "message",
        )
    )

    # Planning: equal TP (whole copy) and Prefill TP1 -> Decode TP2 (fragments).
    def whole() -> PlannedRegistration:
        return plan_registration(
            prefill_tp=1,
            prefill_rank=0,
            prefill_contract=decode_tp1,
            decode_tp=1,
            decode_rank=0,
            decode_contract=decode_tp1,
        )

    decode_tp2 = _contract(sizes, tp_size=2)

    def fragmented() -> PlannedRegistration:
        return plan_registration(
            prefill_tp=1,
            prefill_rank=0,
            prefill_contract=decode_tp1,
            decode_tp=2,
            decode_rank=1,
            decode_contract=decode_tp2,
        )

    rows.append(
        Row(
            "plan_registration TP1→2",
            _micros(fragmented, sizes),
            "route",
        )
    )
    rows.extend(_plan_rows("whole copy TP1→1", sizes, decode_tp1, decode_tp1, whole()))
    rows.extend(_plan_rows("fragments TP1→2", sizes, decode_tp1, decode_tp2, fragmented()))
    rows.extend(_hand_over_row(pages, sizes) for pages in HAND_OVER_PAGES)

    caption = (
        f"{sizes.layers} layers × K,V ({2 * sizes.layers} fields), {_HEADS} KV heads × "
        f"{_HEAD_DIM}, {_PAGE_TOKENS} tokens a page; room of {sizes.pages} pages; "
        f"manifest {len(frames[2]):,} bytes; contiguous pages (hand_over rows: one "
        f"{_HAND_OVER_PAGE_BYTES // 1024} KiB field, scattered pages)"
    )
    return rows, caption


def render(rows: list[Row], caption: str) -> Table:
    """The rich table of ``rows``."""
    table = Table(title="tspd bench core", caption=caption)
    table.add_column("measurement", no_wrap=True)
    table.add_column("µs", justify="right", no_wrap=True)
    table.add_column("per", no_wrap=True)
    table.add_column("descriptors", justify="right", no_wrap=True)
    for row in rows:
        table.add_row(
            row.what,
            f"{row.micros:,.2f}",
            row.per,
            "" if row.descriptors is None else f"{row.descriptors:,}",
        )
    return table


@click.command()
@click.option("--quick", is_flag=True, help="A small workload and short loops (a smoke run).")
@click.option("--layers", type=click.IntRange(1, 256), default=None, help="Model layers.")
@click.option("--pages", type=click.IntRange(1, 1 << 20), default=None, help="Pages in the room.")
def core(quick: bool, layers: int | None, pages: int | None) -> None:
    """Cost of the sans-IO core: wire codecs and copy planning."""
    base = QUICK if quick else FULL
    sizes = Sizes(
        layers=base.layers if layers is None else layers,
        pages=base.pages if pages is None else pages,
        min_seconds=base.min_seconds,
        rounds=base.rounds,
    )
    rows, caption = run_core_benchmarks(sizes)
    Console().print(render(rows, caption))
