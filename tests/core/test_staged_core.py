"""Staged transfers in the cores (docs/wire.md#staged-transfers): who offers what, and
what a Decode rank does with a staged Success it did not ask for, cannot hold or
cannot check. Driven directly, in virtual time."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from tspd.core import wire
from tspd.core.bootstrap import ParallelInfo, RankInfo
from tspd.core.commands import (
    Failed,
    PagesReleased,
    RemotePrefillDone,
    ScatterStaged,
    SendFrames,
    StartTransfer,
)
from tspd.core.decode import DecodeConfig, DecodeCore
from tspd.core.machines import RoomState
from tspd.core.manifest import build_manifest
from tspd.core.poll import TransferPoll
from tspd.core.prefill import PrefillConfig, PrefillCore
from tspd.core.staging import BLOB_ENTRY_BYTES, BLOB_HEADER_BYTES, blob_length
from tspd.testing.layouts import room_manifest, simple_contract

CONTRACT = simple_contract(num_pages=16, page_bytes=64)
ADDR = "127.0.0.1:8998"
REGION = (0x900000, 1 << 20)
PROMPT = 40


def _decode(staging: bool = True) -> DecodeCore:
    return DecodeCore(
        DecodeConfig(
            tp_size=1,
            tp_rank=0,
            contract=CONTRACT,
            arena_base=0x10000,
            session_id="127.0.0.1:9000",
            endpoint="127.0.0.1",
            port=8000,
            staging_bytes=REGION[1] if staging else 0,
            staging_base=REGION[0] if staging else 0,
            staging_min_bytes=1,
        )
    )


def _preallocated(
    core: DecodeCore, room: int, *, prefill_staging: bool = True
) -> tuple[list[bytes], list[bytes]]:
    """Route and pre-allocate ``room``; the registration and pre-allocation sent."""
    core.register_request(f"r{room}", room, ADDR, 0.0)
    core.parallel_info(ADDR, ParallelInfo(1, 1, CONTRACT.to_json().decode()), 0.0)
    core.rank_info(ADDR, 0, 0, RankInfo("127.0.0.1", 7000, staging=prefill_staging), 0.0)
    assert [type(e).__name__ for e in _conclude(core)] == ["Bootstrapped"]
    core.send_preallocation(room, room_manifest(CONTRACT, PROMPT, contiguous=False), 0.0)
    sent = [c for c in core.drain_commands() if isinstance(c, SendFrames)]
    assert len(sent) == 2
    return list(sent[0].frames), list(sent[1].frames)


def _success(room: int, staged: int = 0, rank: int = 0) -> list[bytes]:
    return wire.encode_status(
        wire.StatusMessage(room, TransferPoll.SUCCESS, rank, 9, (), 0, None, staged)
    )


def _conclude(core: DecodeCore, now: float = 0.0) -> list[object]:
    return list(core.conclude(core.poll_values(now), now))


def test_a_staging_decode_offers_a_slot_only_to_a_prefill_that_offers_staging() -> None:
    core = _decode()
    registration, preallocation = _preallocated(core, 1)
    reg = wire.decode_registration(registration, staging=True)
    assert reg.staging == REGION
    slot = wire.decode_preallocation(preallocation, staging=True).slot
    assert slot is not None
    assert slot[0] + slot[1] <= REGION[1]
    assert slot[1] >= blob_length(1, 1)
    assert core.statistics()["staging_slots"] == 1
    # A Prefill rank whose route does not offer staging sees the plain protocol.
    plain = _decode()
    registration, preallocation = _preallocated(plain, 2, prefill_staging=False)
    assert len(registration) == 8
    assert len(preallocation) == 3
    # So does every Prefill rank of a Decode rank without a staging region.
    registration, preallocation = _preallocated(_decode(staging=False), 3)
    assert len(registration) == 8
    assert len(preallocation) == 3


def test_a_staged_success_completes_the_room_only_once_its_blob_is_scattered() -> None:
    core = _decode()
    _, preallocation = _preallocated(core, 1)
    offset, length = wire.decode_preallocation(preallocation, staging=True).slot or (0, 0)
    core.receive_status(_success(1, staged=100), 1.0)
    core.receive_status(_success(1, staged=100), 1.0)  # repeated: one scatter
    (scatter,) = core.drain_commands()
    assert isinstance(scatter, ScatterStaged)
    assert (scatter.room, scatter.slot_offset, scatter.slot_length) == (1, offset, length)
    assert scatter.staged_bytes == 100
    assert core.room_state(1) is not RoomState.SUCCESS
    assert _conclude(core) == []
    core.staged_done(1, 0, None, 2.0)
    (event,) = _conclude(core, 2.0)
    assert isinstance(event, RemotePrefillDone)
    assert event.bootstrap_token == 9
    stats = core.statistics()
    assert stats["staging_slots"] == stats["scattering"] == stats["rooms"] == 0


def test_a_refused_blob_fails_only_its_room_with_the_reason() -> None:
    core = _decode()
    _preallocated(core, 1)
    core.receive_status(_success(1, staged=100), 1.0)
    core.drain_commands()
    core.staged_done(1, 0, "staged blob entry 0 writes outside the room's pages", 1.0)
    (event,) = _conclude(core, 1.0)
    assert isinstance(event, Failed)
    assert "was refused: staged blob entry 0 writes outside the room's pages" in event.reason
    # The Prefill rank said the room ended: nothing holds its pages or its slot.
    assert not event.pages_held
    assert core.statistics()["staging_slots"] == 0


@pytest.mark.parametrize(
    ("prefill_staging", "staged", "reason"),
    [
        (False, 100, "offered it no staging slot"),
        (True, 1 << 30, "larger than the"),
    ],
)
def test_a_staged_success_without_a_fitting_slot_fails_the_room(
    prefill_staging: bool, staged: int, reason: str
) -> None:
    core = _decode()
    _preallocated(core, 1, prefill_staging=prefill_staging)
    core.receive_status(_success(1, staged=staged), 1.0)
    assert not any(isinstance(c, ScatterStaged) for c in core.drain_commands())
    (event,) = _conclude(core, 1.0)
    assert isinstance(event, Failed)
    assert reason in event.reason


def test_a_room_that_fails_while_its_blob_is_scattered_keeps_its_pages_until_it_is_done() -> None:
    core = _decode()
    _preallocated(core, 1)
    core.receive_status(_success(1, staged=100), 1.0)
    core.drain_commands()
    # The waiting timeout passes while the blob is being copied in.
    late = 1.0 + core.config.waiting_timeout + core.config.quarantine_timeout + 1
    (event,) = _conclude(core, late)
    assert isinstance(event, Failed)
    assert event.pages_held
    # Past even the quarantine bound, a scatter in progress holds the pages.
    assert _conclude(core, late + 1000) == []
    assert core.statistics()["staging_slots"] == 1
    core.staged_done(1, 0, None, late + 1001)
    (released,) = _conclude(core, late + 1001)
    assert isinstance(released, PagesReleased)
    assert not released.timed_out
    stats = core.statistics()
    assert stats["staging_slots"] == stats["held_rooms"] == stats["scattering"] == 0


# --- the Prefill side ---------------------------------------------------------------


def _prefill(staging: bool = True) -> PrefillCore:
    return PrefillCore(
        PrefillConfig(
            tp_size=1,
            tp_rank=0,
            contract=CONTRACT,
            arena_base=0x1000,
            staging_bytes=1 << 20 if staging else 0,
            staging_base=0x800000 if staging else 0,
        )
    )


def _registration(staging: tuple[int, int] | None = REGION) -> list[bytes]:
    return wire.encode_registration(
        wire.Registration(
            endpoint="127.0.0.1",
            port=8000,
            session_id="127.0.0.1:9000",
            arena_base=0x10000,
            contract=CONTRACT,
            contract_bytes=CONTRACT.to_json(),
            decode_tp_size=1,
            decode_tp_rank=0,
            staging=staging,
        )
    )


def _failure_reasons(core: PrefillCore) -> Sequence[str]:
    return [c.reason for c in core.drain_commands() if hasattr(c, "reason")]


def test_a_prefill_without_staging_refuses_the_staged_forms() -> None:
    core = _prefill(staging=False)
    core.receive_control(_registration(), 0.0)
    assert not core.is_registered("127.0.0.1:9000")
    core.receive_control(_registration(None), 0.0)
    assert core.is_registered("127.0.0.1:9000")
    manifest = room_manifest(CONTRACT, PROMPT)
    core.register_request("r", 1, 0.0)
    core.receive_control(wire.encode_preallocation(1, "127.0.0.1:9000", manifest, (0, 4096)), 0.0)
    assert core.room_state(1) is not RoomState.BOOTSTRAPPED


@pytest.mark.parametrize(
    ("region", "slot", "reason"),
    [
        (None, (0, 4096), "registered no staging region"),
        (REGION, (REGION[1] - 4096, 8192), "ends past the session's"),
    ],
)
def test_a_slot_outside_the_registered_region_fails_the_room(
    region: tuple[int, int] | None, slot: tuple[int, int], reason: str
) -> None:
    core = _prefill()
    core.receive_control(_registration(region), 0.0)
    assert core.is_registered("127.0.0.1:9000")
    core.register_request("r", 1, 0.0)
    manifest = room_manifest(CONTRACT, PROMPT)
    core.receive_control(wire.encode_preallocation(1, "127.0.0.1:9000", manifest, slot), 0.0)
    assert core.room_state(1) is RoomState.FAILED
    assert any(reason in r for r in _failure_reasons(core))


@pytest.mark.parametrize("pages", [255, 256, 300])
def test_a_prefill_places_its_blob_so_the_data_starts_on_a_page(pages: int) -> None:
    """The blob's format is unchanged, but its data starts on a page of the Prefill's
    region whatever the entry count (at a page-aligned blob start, 256 entries put
    it 16 bytes past a page, where gathering 4 KiB pages runs ~3x slower), and the
    padded allocation goes back to the region with the room."""
    contract = simple_contract(num_pages=2 * pages + 8, page_bytes=4096)
    region = (0x40000000, 64 << 20)
    core = PrefillCore(
        PrefillConfig(
            tp_size=1,
            tp_rank=0,
            contract=contract,
            arena_base=0x1000,
            staging_bytes=16 << 20,
            staging_base=0x800000,
            staging_min_copies=2,
        )
    )
    session = "127.0.0.1:9000"
    core.receive_control(
        wire.encode_registration(
            wire.Registration(
                "127.0.0.1",
                8000,
                session,
                0x10000,
                contract,
                contract.to_json(),
                1,
                0,
                staging=region,
            )
        ),
        0.0,
    )
    tokens = pages * contract.group("full").rows_per_page
    # Every other page on both sides (id 0 is no page): no two copies coalesce, one
    # entry a page.
    decode_pages = list(range(2, 2 * pages + 2, 2))
    source_pages = list(range(3, 2 * pages + 3, 2))
    random.Random(pages).shuffle(decode_pages)
    manifest = build_manifest(contract, {"full": decode_pages}, 0, tokens)
    slot = (0, blob_length(pages, pages * 4096))
    core.register_request("r", 1, 0.0)
    core.receive_control(wire.encode_preallocation(1, session, manifest, slot), 0.0)
    core.conclude(core.poll_values(0.0), 0.0)
    core.drain_commands()
    core.hand_over(1, {"full": source_pages}, 7, (), 0.0)
    (transfer,) = [c for c in core.drain_commands() if isinstance(c, StartTransfer)]
    (write,) = transfer.intervals[0].writes
    staged = write.staged
    assert staged is not None
    assert len(write.plan) == pages
    assert staged.length == slot[1]
    data_start = staged.source_offset + BLOB_HEADER_BYTES + BLOB_ENTRY_BYTES * pages
    assert data_start % 4096 == 0
    assert staged.source_addr == 0x800000 + staged.source_offset
    assert staged.dest_addr == region[0]  # the Decode's slot: its layout is unchanged
    core.transfer_succeeded(1, 0.0)
    core.transfer_done(1, 0.0)
    assert core.statistics()["staged_rooms"] == 0
