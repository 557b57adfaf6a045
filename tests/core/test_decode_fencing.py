"""Write fencing end to end, in virtual time: an engine whose writes are delayed and
a Decode scheduler that reuses a failed room's pages as soon as it is allowed. No
page of a new room may ever be written by an old room's transfer."""

from __future__ import annotations

import random

import pytest

from tspd.core.commands import Event, Failed, PagesReleased, RemotePrefillDone
from tspd.testing.core_pair import CorePair
from tspd.testing.layouts import simple_contract

CONTRACT = simple_contract(num_pages=6, page_bytes=32)
PROMPT = 40  # three pages of 16 tokens: two rooms cannot both fit without reuse
ADDR = "127.0.0.1:8998"


def _scenario(seed: int) -> CorePair:
    rng = random.Random(seed)
    pair = CorePair([CONTRACT], [CONTRACT], waiting_timeout=10.0, seed=seed)
    pair.auto_transfer = False
    free: set[str] = set()

    def scheduler(events: list[Event]) -> None:
        for event in events:
            reusable = isinstance(event, PagesReleased | RemotePrefillDone) or (
                isinstance(event, Failed) and not event.pages_held
            )
            if reusable:
                free.add(event.rid)

    pair.register_decode("old", 1)
    pair.register_prefill("old", 1)
    scheduler(pair.poll_decode())
    pair.preallocate(1, PROMPT)
    pair.poll_prefill()
    pair.hand_over(1, PROMPT)  # the write waits in its worker's queue
    fault = rng.choice(["decode-timeout", "prefill-abort", "heartbeat", "write-error", "none"])
    if fault == "decode-timeout":
        pair.now += 10.0
    elif fault == "prefill-abort":
        pair.prefill[0].abort(1, "engine aborted", pair.now)
        pair.pump()
    elif fault == "heartbeat":
        for _ in range(2):
            pair.decode[0].heartbeat(ADDR, False, pair.now)
        pair.pump()
    elif fault == "write-error":
        pair.write_errors[CorePair.decode_session(0)] = "connection reset"
    steps = rng.randrange(1, 6)  # when the delayed write lands at the latest
    for step in range(12):
        if step == steps or rng.random() < 0.3:
            pair.run_transfers()
            pair.pump()
        scheduler(pair.poll_decode())
        scheduler(pair.poll_prefill())
        if "old" in free and 2 not in pair._rooms:
            # Reuse at once: the next room gets the freed pages.
            pair.release_room(1)
            free.discard("old")
            pair.write_errors.clear()
            pair.register_decode("new", 2)
            pair.register_prefill("new", 2)
            scheduler(pair.poll_decode())
            pair.preallocate(2, PROMPT)
        # Every delayed write lands within 5 steps of at most 5 s: inside the
        # Decode's quarantine bound (DecodeConfig.quarantine_timeout, 60 s).
        pair.now += rng.choice([0.0, 1.0, 2.0, 5.0])
    pair.run_transfers()
    pair.pump()
    return pair


@pytest.mark.parametrize("block", range(4))
def test_no_page_of_a_new_room_is_written_by_an_old_rooms_transfer(block: int) -> None:
    reused = 0
    for seed in range(block * 750, (block + 1) * 750):
        pair = _scenario(seed)
        try:
            assert pair.fencing_violations == [], (seed, pair.fencing_violations[:3])
            reused += 2 in pair._rooms
        finally:
            pair.close()
    # The scenario does reach page reuse (else it would prove nothing).
    assert reused > 100


def test_a_room_failed_on_the_decode_alone_keeps_its_pages_until_the_prefill_says() -> None:
    pair = CorePair([CONTRACT], [CONTRACT], waiting_timeout=10.0)
    try:
        pair.auto_transfer = False
        pair.register_decode("a", 1)
        pair.register_prefill("a", 1)
        pair.poll_decode()
        pair.preallocate(1, PROMPT)
        pair.poll_prefill()
        pair.hand_over(1, PROMPT)
        pair.now += 10.0
        (failed,) = pair.poll_decode()
        assert isinstance(failed, Failed)
        assert failed.pages_held
        assert pair.decode[0].has_in_flight()  # the scheduler keeps polling
        assert pair.poll_decode() == []
        # The Prefill writes, then says Success: the pages are free again.
        pair.run_transfers()
        pair.pump()
        assert pair.poll_decode() == [PagesReleased("a", 1, False)]
        assert pair.decode[0].statistics()["held_rooms"] == 0
    finally:
        pair.close()


def test_the_quarantine_bound_releases_pages_with_a_warning() -> None:
    pair = CorePair([CONTRACT], [CONTRACT], waiting_timeout=10.0)
    try:
        pair.dropped_ports.add(7000)  # the Prefill never hears the pre-allocation
        pair.register_decode("a", 1)
        pair.poll_decode()
        pair.preallocate(1, PROMPT)
        pair.now += 10.0
        (failed,) = pair.poll_decode()
        assert isinstance(failed, Failed)
        assert failed.pages_held
        bound = pair.decode[0].config.quarantine_timeout
        pair.now += bound - 1
        assert pair.poll_decode() == []
        pair.now += 1
        assert pair.poll_decode() == [PagesReleased("a", 1, True)]
        assert any("releasing the pages of failed room 1" in log.message for _, _, log in pair.logs)
    finally:
        pair.close()


def test_a_prefill_failed_status_frees_the_pages_at_once() -> None:
    pair = CorePair([CONTRACT], [CONTRACT])
    try:
        pair.register_decode("a", 1)
        pair.register_prefill("a", 1)
        pair.poll_decode()
        pair.preallocate(1, PROMPT)
        pair.prefill[0].abort(1, "engine aborted", pair.now)
        pair.pump()
        (failed,) = pair.poll_decode()
        assert isinstance(failed, Failed)
        assert not failed.pages_held
        assert not pair.decode[0].has_in_flight()
    finally:
        pair.close()
