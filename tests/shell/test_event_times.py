"""Events name their room and say when their outcome happened, on the host's
monotonic clock (docs/architecture.md#event-times), so a thread-hosted scheduler can
measure a room's latency without reaching into traces or Trio's clock."""

from __future__ import annotations

import time

import trio

from tspd.core.commands import Bootstrapped, Event, RemotePrefillDone, Succeeded
from tspd.core.manifest import BlockManifest
from tspd.shell.peer import host_clock_offset
from tspd.testing.local_pd import LocalPD

PROMPT = 12


async def _one_room(pd: LocalPD, room: int) -> tuple[float, dict[str, Event], float]:
    async with (
        pd.bootstrap_server() as server,
        pd.prefill_peer(server.address) as prefill,
        pd.decode_peer() as decode,
    ):
        start = time.monotonic()
        decode.register_request("r", room, server.address)
        prefill.register_request("r", room)
        seen: dict[str, Event] = {}
        manifest: BlockManifest | None = None
        with trio.fail_after(30):
            while "done" not in seen or "sent" not in seen:
                for event in await decode.poll():
                    if isinstance(event, Bootstrapped):
                        seen["decode-bootstrapped"] = event
                        manifest = pd.preallocation(room, PROMPT)
                        decode.send_preallocation(room, manifest)
                    elif isinstance(event, RemotePrefillDone):
                        seen["done"] = event
                for event in await prefill.poll():
                    if isinstance(event, Bootstrapped):
                        seen["prefill-bootstrapped"] = event
                        prefill.hand_over([pd.prompt("r", room, PROMPT).row])
                    elif isinstance(event, Succeeded):
                        seen["sent"] = event
                await trio.sleep(0.001)
        assert manifest is not None
        pd.check_outcome("r", seen["done"], room, manifest)
        return start, seen, time.monotonic()


def test_events_carry_their_room_and_host_monotonic_times() -> None:
    pd = LocalPD()
    try:
        start, seen, end = trio.run(_one_room, pd, 4242)
    finally:
        pd.close()
    for event in seen.values():
        assert event.room == 4242  # type: ignore[union-attr]
        assert start <= event.at <= end, (event, start, end)  # type: ignore[union-attr]
    sent, done = seen["sent"], seen["done"]
    assert isinstance(sent, Succeeded)
    assert isinstance(done, RemotePrefillDone)
    # The Prefill sent Success before the Decode received it: one clock for both.
    assert seen["prefill-bootstrapped"].at <= sent.at <= done.at  # type: ignore[union-attr]


def test_the_host_offset_is_the_trio_system_clock_offset() -> None:
    async def main() -> tuple[float, float, float]:
        before = time.monotonic()
        host = trio.current_time() - host_clock_offset()
        return before, host, time.monotonic()

    before, host, after = trio.run(main)
    assert before <= host <= after


def test_virtual_clocks_keep_their_own_times() -> None:
    async def main() -> float:
        return host_clock_offset()

    assert trio.run(main, clock=trio.testing.MockClock()) == 0.0
