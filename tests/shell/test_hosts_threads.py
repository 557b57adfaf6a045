"""A plain-thread host drives the PD peers and KV events through a background Trio thread.

The "engine" is a scheduler loop in an ordinary thread: it registers requests,
polls, hands KV over, publishes its events and reads them back through
:mod:`tspd.hosts.threads`, whose entry points return at once; then errors that
cross, futures that cancel Trio tasks, and a crash of the Trio thread.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import inspect
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import trio

from tspd.core.commands import Bootstrapped, Event, Failed, RemotePrefillDone, Succeeded
from tspd.core.errors import ProtocolError
from tspd.core.kv_events import AllBlocksCleared, BlockStored, KVEvent
from tspd.hosts.bridge import BridgeClosed
from tspd.hosts.services import ServiceNursery
from tspd.hosts.threads import (
    IDLE_CALL_RUNNERS,
    ThreadedDecode,
    ThreadedPeer,
    ThreadedPrefill,
    ThreadedSubscriber,
    TrioThread,
    open_trio_thread,
)
from tspd.shell.decode import DecodePeer
from tspd.shell.kv_subscriber import ReceivedBatch
from tspd.shell.peer import INLINE_CONCLUDE_MAX
from tspd.shell.prefill import ExtendRow, PrefillOutbox, PrefillPeer, ReleaseRefused
from tspd.shell.steps import StepCounter
from tspd.testing.fake_engine import AsyncFakeEngine
from tspd.testing.local_pd import LocalPD, Prompt

PROMPT = 10


@pytest.fixture
def pd() -> Iterator[LocalPD]:
    rig = LocalPD()
    yield rig
    rig.close()


def _read_stored(sub: ThreadedSubscriber, count: int, limit: float = 20.0) -> list[KVEvent]:
    stored: list[KVEvent] = []
    deadline = time.monotonic() + limit
    while len(stored) < count and time.monotonic() < deadline:
        item = sub.get(timeout=0.1)
        if isinstance(item, ReceivedBatch):
            stored.extend(e for e in item.batch.events if isinstance(e, BlockStored))
    return stored


def _join(host: TrioThread, pub: Any, sub: ThreadedSubscriber) -> None:
    """Announce an empty cache until the subscriber saw a batch (the PUB connects
    asynchronously; earlier batches are healed by replay)."""
    for _ in range(200):
        pub.publish([AllBlocksCleared()])
        item = sub.get(timeout=0.05)
        while item is not None:
            if isinstance(item, ReceivedBatch):
                return
            item = sub.get(timeout=0.01)
    raise AssertionError("the KV-event subscriber never saw the publisher")


def _scheduler(host: TrioThread, pd: LocalPD, rids: list[str]) -> dict[str, Any]:
    server = host.enter(pd.bootstrap_server())
    prefill = ThreadedPrefill(host, host.enter(pd.prefill_peer(server.address)))
    decode = ThreadedDecode(host, host.enter(pd.decode_peer()))
    sub = ThreadedSubscriber(host, host.enter(pd.subscriber()))
    pub = host.enter(pd.publisher())
    _join(host, pub, sub)

    rooms = {rid: 2000 + i for i, rid in enumerate(rids)}
    posted = []
    for rid, room in rooms.items():
        posted.append(decode.register_request(rid, room, server.address))
        posted.append(prefill.register_request(rid, room))
    prompts: dict[str, Prompt] = {}
    manifests = {}
    prefill_done: dict[str, Event] = {}
    decode_done: dict[str, Event] = {}
    hand_over_seconds: list[float] = []
    deadline = time.monotonic() + 20
    while len(prefill_done) < len(rids) or len(decode_done) < len(rids):
        assert time.monotonic() < deadline, (prefill_done, decode_done)
        for event in decode.poll():
            if isinstance(event, Bootstrapped):
                manifests[event.rid] = pd.preallocation(rooms[event.rid], PROMPT)
                decode.send_preallocation(rooms[event.rid], manifests[event.rid])
            elif isinstance(event, RemotePrefillDone | Failed):
                decode_done[event.rid] = event
        for event in prefill.poll():
            if isinstance(event, Bootstrapped):
                prompt = prompts[event.rid] = pd.prompt(event.rid, rooms[event.rid], PROMPT)
                started = time.monotonic()
                prefill.hand_over([prompt.row])
                hand_over_seconds.append(time.monotonic() - started)
            elif isinstance(event, Succeeded | Failed):
                prefill_done[event.rid] = event
                if isinstance(event, Succeeded):
                    pub.publish(pd.stored_events(prompts[event.rid]))
        time.sleep(0.002)
    for future in posted:
        assert future.result(timeout=1) is None
    stored = _read_stored(sub, (PROMPT // 4) * len(rids))
    return {
        "prefill": prefill_done,
        "decode": decode_done,
        "mismatches": {rid: pd.verify(rooms[rid], manifests[rid]) for rid in decode_done},
        "tokens": {rid: pd.expected_token(room) for rid, room in rooms.items()},
        "stored": stored,
        "expected": [e for rid in rids for e in pd.stored_events(prompts[rid])],
        "hand_over_seconds": hand_over_seconds,
        "decode_rooms": decode.statistics()["rooms"],
    }


def test_a_scheduler_thread_serves_requests_end_to_end(pd: LocalPD) -> None:
    rids = ["x", "y", "z"]
    with open_trio_thread() as host:
        report = _scheduler(host, pd, rids)
    assert not host.running
    assert all(isinstance(e, Succeeded) for e in report["prefill"].values()), report["prefill"]
    for rid in rids:
        event = report["decode"][rid]
        assert isinstance(event, RemotePrefillDone), event
        assert event.bootstrap_token == report["tokens"][rid]
        assert report["mismatches"][rid] == []
    assert report["stored"] == report["expected"]
    assert report["decode_rooms"] == 0
    assert len(report["hand_over_seconds"]) == len(rids)


def test_entry_points_return_while_the_transfer_hangs(pd: LocalPD) -> None:
    """A hand-over whose write hangs still returns at once; the poll sees the
    request in flight, never blocks on it."""
    with open_trio_thread() as host:
        server = host.enter(pd.bootstrap_server())
        peer = host.enter(pd.prefill_peer(server.address))
        prefill = ThreadedPrefill(host, peer)
        decode = ThreadedDecode(host, host.enter(pd.decode_peer()))
        decode_peer = decode.peer
        engine = peer.engine
        assert isinstance(engine, AsyncFakeEngine)
        engine.hang_next(decode_peer.session_id, seconds=1.0)
        decode.register_request("slow", 7, server.address)
        prefill.register_request("slow", 7)
        deadline = time.monotonic() + 10
        prompt = None
        while prompt is None:
            assert time.monotonic() < deadline
            for event in decode.poll():
                if isinstance(event, Bootstrapped):
                    decode.send_preallocation(7, pd.preallocation(7, PROMPT))
            for event in prefill.poll():
                if isinstance(event, Bootstrapped):
                    prompt = pd.prompt("slow", 7, PROMPT)
            time.sleep(0.002)
        started = time.monotonic()
        future = prefill.hand_over([prompt.row])
        returned = time.monotonic() - started
        future.result(timeout=1)
        time.sleep(0.2)
        polled = time.monotonic()
        events = prefill.poll()
        poll_seconds = time.monotonic() - polled
        in_flight = host.call_sync(peer.has_in_flight)
        prefill.abort(7, "the test gave up on the hung write").result(timeout=1)
    assert returned < 0.5
    assert poll_seconds < 1.0
    assert not any(isinstance(e, Succeeded) for e in events)
    assert in_flight


def test_a_forward_thread_arms_layerwise_chunks_without_waiting(pd: LocalPD) -> None:
    """Arming returns before any producer step completed; the chunks then go out
    as the forward advances the counter, and Decode gets the bytes."""
    counter = StepCounter()
    with open_trio_thread() as host:
        server = host.enter(pd.bootstrap_server())
        prefill = ThreadedPrefill(
            host, host.enter(pd.prefill_peer(server.address, step_counter=counter))
        )
        decode = ThreadedDecode(host, host.enter(pd.decode_peer()))
        decode.register_request("lw", 11, server.address)
        prefill.register_request("lw", 11)
        manifest = None
        prefill_ready = False
        deadline = time.monotonic() + 10
        while manifest is None or not prefill_ready:
            assert time.monotonic() < deadline
            for event in decode.poll():
                if isinstance(event, Bootstrapped):
                    manifest = pd.preallocation(11, PROMPT)
                    decode.send_preallocation(11, manifest)
            prefill_ready |= any(isinstance(e, Bootstrapped) for e in prefill.poll())
            time.sleep(0.002)
        prompt = pd.prompt("lw", 11, PROMPT)
        armed = prefill.arm_layerwise([ExtendRow("lw", 0, PROMPT, prompt.row.tables)])
        assert armed.result(timeout=5) == 0
        time.sleep(0.05)
        written_before_steps = prefill.statistics()["bytes_written"]
        for _ in pd.schedule.steps:
            counter.advance()
            time.sleep(0.01)
        prefill.hand_over([prompt.row])
        outcome: Event | None = None
        while outcome is None:
            assert time.monotonic() < deadline + 10
            outcome = next(
                (e for e in decode.poll() if isinstance(e, RemotePrefillDone | Failed)), None
            )
            prefill.poll()
            time.sleep(0.002)
    assert written_before_steps == 0
    assert isinstance(outcome, RemotePrefillDone), outcome
    assert pd.verify(11, manifest) == []


def test_errors_cross_to_the_calling_thread(pd: LocalPD) -> None:
    async def fails() -> None:
        await trio.lowlevel.checkpoint()
        raise KeyError("from trio")

    with open_trio_thread() as host:
        server = host.enter(pd.bootstrap_server())
        prefill = ThreadedPrefill(host, host.enter(pd.prefill_peer(server.address)))
        future = prefill.register_request("bad", -1)
        with pytest.raises(ProtocolError, match="bootstrap_room -1 of request bad"):
            future.result(timeout=5)
        with pytest.raises(KeyError, match="from trio"):
            host.call(fails)
        with pytest.raises(KeyError, match="from trio"):
            host.submit(fails).result(timeout=5)
        with pytest.raises(TimeoutError, match=r"did not finish within 0\.05 s"):
            host.call(trio.sleep_forever, timeout=0.05)


def test_cancelling_a_running_future_cancels_its_trio_task() -> None:
    unwound = threading.Event()

    async def forever() -> None:
        try:
            await trio.sleep_forever()
        finally:
            unwound.set()

    with open_trio_thread() as host:
        future = host.submit(forever)
        deadline = time.monotonic() + 5
        while not future.running():
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert future.cancel()
        assert unwound.wait(5)
        with pytest.raises(concurrent.futures.CancelledError, match="forever was cancelled"):
            future.result(timeout=5)
        assert host.running
        assert not future.cancel()


def test_a_call_in_flight_when_the_host_closes_fails_with_bridge_closed() -> None:
    with open_trio_thread() as host:
        future = host.submit(trio.sleep_forever)
        host.call(trio.sleep, 0.01)
    with pytest.raises(BridgeClosed, match="stopped before the call finished"):
        future.result(timeout=1)


def test_blocking_calls_run_after_earlier_posts_and_hand_back_their_outcome() -> None:
    seen: list[int] = []

    async def snapshot() -> list[int]:
        await trio.lowlevel.checkpoint()
        return list(seen)

    def fails() -> None:
        raise KeyError("from call_sync")

    with open_trio_thread() as host:
        for i in range(100):
            host.post(seen.append, i)
        assert host.call(snapshot) == list(range(100))
        host.post(seen.append, 100)
        assert host.call_sync(lambda: list(seen)) == list(range(101))
        with pytest.raises(KeyError, match="from call_sync"):
            host.call_sync(fails)
        assert host.call_sync(len, seen) == 101  # the host still runs


def test_a_blocking_call_from_a_trio_task_is_refused_not_deadlocked() -> None:
    with open_trio_thread() as host:

        async def inside() -> str:
            with pytest.raises(RuntimeError, match="make it from a plain thread"):
                host.call_sync(int)
            with pytest.raises(RuntimeError, match="make it from a plain thread"):
                host.call(trio.sleep, 0)
            return "refused"

        assert host.call(inside) == "refused"


async def _current_task() -> trio.lowlevel.Task:
    await trio.lowlevel.checkpoint()
    return trio.lowlevel.current_task()


def test_blocking_calls_reuse_a_parked_runner_and_keep_their_outcomes_apart() -> None:
    """A blocking call runs on a parked call runner, not a task spawned for it, and a
    failed or timed-out call leaves the runner serving the next one."""

    async def fails() -> None:
        await trio.lowlevel.checkpoint()
        raise KeyError("from call")

    with open_trio_thread() as host:
        first = host.call(_current_task)
        assert host.call(_current_task) is first  # one runner, parked between calls
        with pytest.raises(KeyError, match="from call"):
            host.call(fails)
        assert host.call(_current_task) is first
        with pytest.raises(TimeoutError, match="did not finish within"):
            host.call(trio.sleep_forever, timeout=0.01)
        assert host.call(_current_task) is first
        assert host.call(trio.sleep, 0) is None


def test_concurrent_blocking_calls_get_runners_of_their_own_and_few_stay_parked() -> None:
    """Calls that overlap each run on a runner of their own (none waits for another);
    once they are done at most IDLE_CALL_RUNNERS stay parked, and the host closes
    with them parked."""
    callers = IDLE_CALL_RUNNERS * 3
    barrier = threading.Barrier(callers)
    gate: dict[str, trio.Event] = {}
    tasks: list[trio.lowlevel.Task] = []
    errors: list[BaseException] = []

    async def meet() -> None:
        tasks.append(trio.lowlevel.current_task())
        if len(tasks) == callers:
            gate["all"].set()
        with trio.fail_after(10):  # every call is in flight at once, or this fails
            await gate["all"].wait()

    def caller(host: TrioThread) -> None:
        try:
            barrier.wait(10)
            host.call(meet)
        except BaseException as exc:
            errors.append(exc)

    with open_trio_thread() as host:
        gate["all"] = host.call_sync(trio.Event)
        threads = [threading.Thread(target=caller, args=(host,)) for _ in range(callers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert not errors, errors
        assert len(set(map(id, tasks))) == callers
        parked = host.call_sync(lambda: len(host._idle_runners))
        assert parked == IDLE_CALL_RUNNERS
    assert not host.running


def test_a_blocking_call_in_flight_when_the_host_closes_fails_with_bridge_closed() -> None:
    outcome: list[BaseException] = []
    started = threading.Event()
    host = TrioThread("closing")
    host.start_thread()

    async def forever() -> None:
        started.set()
        await trio.sleep_forever()

    def wait_forever() -> None:
        try:
            host.call(forever)
        except BaseException as exc:
            outcome.append(exc)

    caller = threading.Thread(target=wait_forever)
    caller.start()
    assert started.wait(5)
    host.close()
    caller.join(5)
    assert not caller.is_alive()
    assert len(outcome) == 1
    assert isinstance(outcome[0], BridgeClosed), outcome  # not trio.Cancelled
    assert "stopped before the call finished" in str(outcome[0])
    with pytest.raises(BridgeClosed, match="has stopped; the call was not run"):
        host.call(trio.sleep, 0)
    with pytest.raises(BridgeClosed, match="has stopped; the call was not run"):
        host.call_sync(int)


def test_a_future_cancelled_before_it_ran_never_runs() -> None:
    ran: list[str] = []

    async def work() -> None:
        ran.append("ran")
        await trio.lowlevel.checkpoint()

    with open_trio_thread() as host:
        gate = threading.Event()
        host.post(gate.wait, 5)
        future = host.submit(work)
        assert future.cancel()
        gate.set()
        host.call(trio.sleep, 0.05)
    assert ran == []


def test_a_crash_of_the_trio_thread_fails_calls_and_is_raised_on_close() -> None:
    async def crash(*, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await trio.sleep(0.02)
        raise RuntimeError("service crashed")

    host = TrioThread("crashy")
    host.start_thread()
    host.start(crash)
    deadline = time.monotonic() + 5
    while host.running:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    with pytest.raises(BridgeClosed, match="crashed: RuntimeError"):
        host.post(int).result(timeout=1)
    with pytest.raises(RuntimeError, match="service crashed"):
        host.close()


def test_services_close_newest_first() -> None:
    order: list[str] = []

    @contextlib.asynccontextmanager
    async def service(name: str) -> Any:
        await trio.lowlevel.checkpoint()
        try:
            yield name
        finally:
            order.append(name)

    with open_trio_thread() as host:
        names = [host.enter(service(n)) for n in ("bootstrap", "prefill", "decode")]
    assert names == ["bootstrap", "prefill", "decode"]
    assert order == ["decode", "prefill", "bootstrap"]


async def test_a_service_that_will_not_close_is_named_then_cancelled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    @contextlib.asynccontextmanager
    async def service(name: str, linger: float) -> Any:
        try:
            yield name
        finally:
            await trio.sleep(linger)  # until the owner cancels it

    async with trio.open_nursery() as nursery:
        services = ServiceNursery(nursery, owner="the test host")
        await services.enter(service("quick", 0), name="quick")
        await services.enter(service("stuck", 5), name="stuck")
        await services.close_within(0.05)
        nursery.cancel_scope.cancel()
    assert "the test host: services quick, stuck did not close within" in caplog.text


def test_posts_run_in_order_from_many_threads() -> None:
    seen: list[tuple[int, int]] = []
    with open_trio_thread() as host:

        def producer(tid: int) -> list[concurrent.futures.Future[None]]:
            return [host.post(seen.append, (tid, i)) for i in range(200)]

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [f for fs in pool.map(producer, range(4)) for f in fs]
        concurrent.futures.wait(futures, timeout=5)
    for tid in range(4):
        assert [i for t, i in seen if t == tid] == list(range(200))


def test_a_thread_scheduler_sleeps_until_its_peer_sees_activity(pd: LocalPD) -> None:
    """A reactive driver: block in wait_for_activity (no timer polling), then poll."""
    with open_trio_thread() as host:
        server = host.enter(pd.bootstrap_server())
        prefill = ThreadedPrefill(host, host.enter(pd.prefill_peer(server.address)))
        decode = ThreadedDecode(host, host.enter(pd.decode_peer()))
        # Nothing happened yet: the wait times out.
        assert decode.wait_for_activity(0.05) is False
        decode.register_request("w", 3000, server.address).result(timeout=5)
        prefill.register_request("w", 3000).result(timeout=5)
        # The parallel-info lookup answers in the Trio thread: that wakes the driver.
        assert decode.wait_for_activity(5.0) is True
        done: Event | None = None
        deadline = time.monotonic() + 20
        while done is None:
            assert time.monotonic() < deadline
            for event in decode.poll():
                if isinstance(event, Bootstrapped):
                    manifest = pd.preallocation(3000, PROMPT)
                    decode.send_preallocation(3000, manifest)
                elif isinstance(event, RemotePrefillDone | Failed):
                    done = event
            for event in prefill.poll():
                if isinstance(event, Bootstrapped):
                    prefill.hand_over([pd.prompt("w", 3000, PROMPT).row])
            if done is None:
                # Each side's activity wakes its own waiter; bound each wait.
                decode.wait_for_activity(0.2) or prefill.wait_for_activity(0.2)
        assert isinstance(done, RemotePrefillDone), done


def _public_members(*apis: type) -> set[str]:
    """The public methods and properties of ``apis``, inherited ones included."""
    return {
        name
        for api in apis
        for name in dir(api)
        if not name.startswith("_")
        and (callable(value := inspect.getattr_static(api, name)) or isinstance(value, property))
    }


@pytest.mark.parametrize(
    ("facade", "apis"),
    [(ThreadedPrefill, (PrefillPeer, PrefillOutbox)), (ThreadedDecode, (DecodePeer,))],
)
def test_the_facades_cover_the_peers_api(
    facade: type[ThreadedPeer[Any]], apis: tuple[type, ...]
) -> None:
    """Every public member of the peer (and Prefill's outbox) is either on the facade
    or listed, with a reason, in its ``not_exposed``: the facade cannot fall behind."""
    public = _public_members(*apis)
    not_exposed = dict(facade.not_exposed)
    exposed = {name for name in public if hasattr(facade, name)}
    missing = sorted(public - exposed - set(not_exposed))
    assert missing == [], f"{facade.__name__} neither exposes nor lists as not exposed: {missing}"
    assert sorted(set(not_exposed) - public) == [], "not_exposed names a member the peer lacks"
    assert sorted(set(not_exposed) & exposed) == [], "not_exposed names an exposed member"
    assert all(reason.strip() for reason in not_exposed.values())
    for name in exposed:
        method = getattr(facade, name)
        source = getattr(method, "_derived_from", None)
        if source is None:  # written by hand: poll, wait_for_activity
            continue
        assert source.__name__ == name
        wrapped = list(inspect.signature(source).parameters)
        assert list(inspect.signature(method).parameters) == wrapped, name
        assert inspect.cleandoc(source.__doc__ or "") in (method.__doc__ or ""), name


def test_a_thread_scheduler_puts_prefill_to_sleep_and_wakes_it(pd: LocalPD) -> None:
    """Sleep and wake through the facade: refused while a request is tracked, then
    the arena leaves the engine and comes back."""
    with open_trio_thread() as host:
        server = host.enter(pd.bootstrap_server())
        peer = host.enter(pd.prefill_peer(server.address))
        prefill = ThreadedPrefill(host, peer)
        regions = peer.engine.engine.regions  # type: ignore[attr-defined]
        prefill.register_request("s", 41).result(timeout=5)
        with pytest.raises(ReleaseRefused, match=r"rooms \[41\]"):
            prefill.release_registration()
        prefill.abort(41, "the scheduler goes to sleep").result(timeout=5)
        deadline = time.monotonic() + 10
        while not any(isinstance(e, Failed) for e in prefill.poll(wait=0.05)):
            assert time.monotonic() < deadline
        assert prefill.release_registration() is None
        assert peer.arena.base not in regions()
        assert prefill.restore_registration() is None
        assert peer.arena.base in regions()


def test_poll_with_wait_brings_the_events_of_the_wake_in_one_call(pd: LocalPD) -> None:
    """``poll(wait=t)`` sleeps until the peer concluded events (at most ``t``), then
    returns them: an idle round lasts about ``t``, a busy one returns at once with
    the events."""
    with open_trio_thread() as host:
        server = host.enter(pd.bootstrap_server())
        prefill = ThreadedPrefill(host, host.enter(pd.prefill_peer(server.address)))
        decode = ThreadedDecode(host, host.enter(pd.decode_peer()))
        started = time.monotonic()
        assert decode.poll(wait=0.05) == []
        assert time.monotonic() - started >= 0.04
        decode.register_request("pw", 3100, server.address)
        prefill.register_request("pw", 3100)
        started = time.monotonic()
        events: list[Event] = []
        while not events:  # the lookups' answers wake the round
            events = decode.poll(wait=5.0)
        assert time.monotonic() - started < 4.0
        assert [type(e) for e in events] == [Bootstrapped]
        decode.send_preallocation(3100, pd.preallocation(3100, PROMPT))
        done: Event | None = None
        deadline = time.monotonic() + 20
        while done is None:
            assert time.monotonic() < deadline
            for event in prefill.poll(wait=0.05):
                if isinstance(event, Bootstrapped):
                    prefill.hand_over([pd.prompt("pw", 3100, PROMPT).row])
            done = next(
                (e for e in decode.poll(wait=0.05) if isinstance(e, RemotePrefillDone | Failed)),
                None,
            )
        assert isinstance(done, RemotePrefillDone), done


def test_a_group_of_one_polls_without_crossing_and_a_tp_group_must_agree(
    pd: LocalPD,
) -> None:
    """A facade's ``poll()`` on a one-rank group never crosses into the Trio thread:
    a posted call is concluded there (an abort's ``Failed`` arrives with a wake),
    and a poll returns at once even while the Trio thread is blocked. The peer's
    ``poll_now`` is not used; on a TP group it refuses, since its ranks must agree
    with each other."""

    class TwoRanks:
        group_size = 2

        async def agree(self, values: list[int]) -> list[int]:
            raise AssertionError("not reached")

    with open_trio_thread() as host:
        server = host.enter(pd.bootstrap_server())
        peer = host.enter(pd.prefill_peer(server.address))
        prefill = ThreadedPrefill(host, peer)
        ran: list[str] = []
        real = peer.poll_now

        def counted() -> list[Event]:
            ran.append(threading.current_thread().name)
            return real()

        peer.poll_now = counted  # type: ignore[method-assign]
        prefill.register_request("one", 51).result(timeout=5)
        prefill.abort(51, "the test ends the request").result(timeout=5)
        deadline = time.monotonic() + 10
        events: list[Event] = []
        while not any(isinstance(e, Failed) for e in events):
            assert time.monotonic() < deadline
            events = prefill.poll(wait=0.2)
        assert ran == []
        hold = threading.Event()
        blocker = host.post(hold.wait, 5.0)
        try:
            started = time.monotonic()
            assert prefill.poll() == []
            assert time.monotonic() - started < 1.0, "the poll waited for the Trio thread"
        finally:
            hold.set()
            assert blocker.result(timeout=5) is True
        peer.agreement = TwoRanks()  # type: ignore[assignment]
        with pytest.raises(RuntimeError, match="group of one rank; this one has 2"):
            host.call_sync(real)
        with pytest.raises(RuntimeError, match="eager conclusion needs a group of one"):
            host.call_sync(peer.conclude_eagerly)


def test_an_eager_poll_on_a_stopped_host_raises(pd: LocalPD) -> None:
    """With nothing concluded and the host stopped, an eager poll raises instead of
    returning nothing forever (a scheduler loop would spin on it)."""
    with open_trio_thread() as host:
        server = host.enter(pd.bootstrap_server())
        prefill = ThreadedPrefill(host, host.enter(pd.prefill_peer(server.address)))
        assert prefill.poll() == []
    with pytest.raises(BridgeClosed, match="has stopped"):
        prefill.poll()


def test_scheduler_calls_that_leave_events_are_concluded_without_the_sweep(
    pd: LocalPD,
) -> None:
    """With the sweep out of the way, a posted call that leaves events for a poll
    is concluded at once and wakes the scheduler thread: a Decode registration at an
    address whose route is known (``Bootstrapped`` at once) and a Prefill abort."""
    with open_trio_thread() as host:
        server = host.enter(pd.bootstrap_server())
        prefill = ThreadedPrefill(host, host.enter(pd.prefill_peer(server.address)))
        decode = ThreadedDecode(host, host.enter(pd.decode_peer()))
        decode.register_request("first", 3300, server.address)
        deadline = time.monotonic() + 10
        events: list[Event] = []
        while not events:  # the lookups' answers are input: concluded as they come
            assert time.monotonic() < deadline
            events = decode.poll(wait=0.2)
        assert [type(e) for e in events] == [Bootstrapped]

        def no_sweep() -> None:
            decode.peer.eager_sweep = prefill.peer.eager_sweep = 3600.0
            decode.peer._conclude_due.set()  # the task re-reads the interval
            prefill.peer._conclude_due.set()

        host.call_sync(no_sweep)
        decode.register_request("second", 3301, server.address).result(timeout=5)
        # Bounds far above the conclusion's milliseconds, and below the Decode's 5 s
        # heartbeat, the only other input either peer would get.
        assert decode.wait_for_activity(2.0) is True
        assert [(type(e), e.room) for e in decode.poll()] == [(Bootstrapped, 3301)]
        prefill.register_request("third", 3302).result(timeout=5)
        prefill.abort(3302, "the test ends the request").result(timeout=5)
        assert prefill.wait_for_activity(2.0) is True
        assert [(type(e), e.room) for e in prefill.poll()] == [(Failed, 3302)]


def test_with_few_requests_a_call_is_concluded_in_the_call_and_under_load_once_later(
    pd: LocalPD,
) -> None:
    """While at most INLINE_CONCLUDE_MAX requests are tracked, a scheduler call that
    leaves events is concluded in that call: its events are ready before the Trio
    thread runs anything else (no pass of the conclusion task). With more tracked,
    the conclusion task concludes the burst once, after the call."""
    with open_trio_thread() as host:
        server = host.enter(pd.bootstrap_server())
        prefill = ThreadedPrefill(host, host.enter(pd.prefill_peer(server.address)))
        peer = prefill.peer

        def register_and_abort(room: int, also: int) -> list[Event]:
            for extra in range(also):
                peer.register_request(f"bystander-{room}-{extra}", room + 1 + extra)
            peer.register_request(f"r{room}", room)
            peer.abort(room, "the test ends the request")
            return peer.take_ready()  # no checkpoint since the abort

        events = host.call_sync(register_and_abort, 3400, 0)
        assert [(type(e), e.room) for e in events] == [(Failed, 3400)]
        assert prefill.poll() == []  # taken above; this clears the thread's wake
        # More requests than a conclusion in the call is worth: the task concludes.
        assert INLINE_CONCLUDE_MAX < 12
        assert host.call_sync(register_and_abort, 3500, 12) == []
        deadline = time.monotonic() + 10
        while not events or events[0].room != 3500:
            assert time.monotonic() < deadline
            events = prefill.poll(wait=0.5)
        assert [(type(e), e.room) for e in events] == [(Failed, 3500)]


def test_a_wake_carries_its_events_and_poll_takes_them_without_a_crossing(
    pd: LocalPD,
) -> None:
    """A group of one concludes in the Trio thread as input arrives: the scheduler
    thread's wake comes with the events, and ``poll()`` takes them even while the
    Trio thread is busy (a crossing could not finish); events not yet taken keep
    ``has_in_flight()`` true."""
    with open_trio_thread() as host:
        server = host.enter(pd.bootstrap_server())
        prefill = ThreadedPrefill(host, host.enter(pd.prefill_peer(server.address)))
        decode = ThreadedDecode(host, host.enter(pd.decode_peer()))
        assert decode.peer.eager
        assert prefill.peer.eager
        decode.register_request("e", 3200, server.address)
        prefill.register_request("e", 3200)

        def while_trio_is_busy(poll: Any) -> list[Event]:
            hold = threading.Event()
            blocker = host.post(hold.wait, 5.0)
            try:
                return list(poll(timeout=0.5))
            finally:
                hold.set()
                assert blocker.result(timeout=5) is True

        assert decode.wait_for_activity(5.0) is True  # the lookups' answers, concluded
        assert [type(e) for e in while_trio_is_busy(decode.poll)] == [Bootstrapped]
        decode.send_preallocation(3200, pd.preallocation(3200, PROMPT))
        deadline = time.monotonic() + 20
        handed = False
        while not handed:
            assert time.monotonic() < deadline
            prefill.wait_for_activity(0.2)
            for event in prefill.poll():
                if isinstance(event, Bootstrapped):
                    prefill.hand_over([pd.prompt("e", 3200, PROMPT).row])
                    handed = True
        events: list[Event] = []
        while not events:
            assert time.monotonic() < deadline
            if decode.wait_for_activity(0.2):
                # Concluded already: the room's events wait for the scheduler.
                assert decode.has_in_flight()
                events = while_trio_is_busy(decode.poll)
        assert [type(e) for e in events][:1] == [RemotePrefillDone], events
        assert decode.poll() == []

        async def woken() -> bool:
            with trio.move_on_after(0.2):
                await decode.peer.wait_for_activity()
                return True
            return False

        # A Trio-side waiter is not woken by wakes whose events a poll took already.
        assert host.call(woken) is False


def test_an_eager_group_of_one_still_sees_a_timeout_only_a_poll_notices(pd: LocalPD) -> None:
    """A bootstrap timeout comes from no input (no Decode ever claims the room): a
    facade that concludes eagerly still reports it, through the conclusion the Trio
    thread makes at least every ``EAGER_SWEEP_S`` while requests are in flight."""
    with open_trio_thread() as host:
        server = host.enter(pd.bootstrap_server())
        prefill = ThreadedPrefill(
            host, host.enter(pd.prefill_peer(server.address, bootstrap_timeout=0.3))
        )
        assert prefill.peer.eager
        prefill.register_request("lonely", 53).result(timeout=5)
        started = time.monotonic()
        failed: Failed | None = None
        while failed is None:
            assert time.monotonic() - started < 10
            failed = next((e for e in prefill.poll(wait=0.05) if isinstance(e, Failed)), None)
        assert failed.room == 53
        assert "timed out" in failed.reason, failed
        assert time.monotonic() - started >= 0.3
        assert not prefill.has_in_flight()


def test_a_burst_of_posts_wakes_the_trio_thread_once_and_keeps_its_order() -> None:
    """Posts queued while the Trio thread is busy run in one drain, in order, and
    before a call made after them; posts after the host closed fail at once."""
    with open_trio_thread() as host:
        seen: list[int] = []
        wakes: list[int] = []
        real = host._drain_posts

        def counted() -> None:
            wakes.append(1)
            real()

        host._drain_posts = counted  # type: ignore[method-assign]
        hold = threading.Event()
        blocker = host.post(hold.wait, 5.0)  # keeps the Trio thread busy in the drain
        futures = [host.post(seen.append, i) for i in range(200)]
        hold.set()
        assert host.call_sync(lambda: list(seen)) == list(range(200))
        assert blocker.result(timeout=5) is True
        assert all(f.result(timeout=5) is None for f in futures)
        assert wakes == [1]  # one drain, one wake-up, ran the whole burst
    late = host.post(seen.append, -1)
    with pytest.raises(BridgeClosed):
        late.result(timeout=5)
    assert -1 not in seen
