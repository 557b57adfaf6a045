"""Per-room traces: milestones, phase durations, failure classes and bounded memory,
on both cores (driven through CorePair in virtual time) and on the tracer alone."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tspd.core import wire
from tspd.core.commands import Bootstrapped, Failed, RemotePrefillDone, Succeeded
from tspd.core.errors import ConfigError
from tspd.core.machines import RoomState
from tspd.core.poll import TransferPoll
from tspd.core.reasons import Failure
from tspd.core.trace import (
    Mark,
    Outcome,
    ReasonClass,
    RoomTrace,
    RoomTracer,
    Side,
    TraceConfig,
)
from tspd.testing.core_pair import CorePair
from tspd.testing.layouts import simple_contract

CONTRACT = simple_contract(num_pages=16, page_bytes=64)
PROMPT = 40  # three 16-token pages
ADDR = "127.0.0.1:8998"


@pytest.fixture
def pair() -> Iterator[CorePair]:
    p = CorePair([CONTRACT], [CONTRACT])
    yield p
    p.close()


def _marks(trace: RoomTrace) -> list[Mark]:
    return [mark for mark, _ in trace.marks]


def _only(traces: list[RoomTrace]) -> RoomTrace:
    assert len(traces) == 1, traces
    return traces[0]


# --- a successful room, step by step ---------------------------------------------------


def test_success_records_every_milestone_and_phase_on_both_sides(pair: CorePair) -> None:
    prefill, decode = pair.prefill[0], pair.decode[0]
    pair.register_decode("r", 5)  # t=0: registered and routed at once
    pair.register_prefill("r", 5)
    assert pair.poll_decode() == [Bootstrapped("r")]
    pair.now = 1.0
    pair.preallocate(5, PROMPT)  # Decode pre-allocates; Prefill is Bootstrapped
    live = prefill.trace(5)
    assert live is not None
    assert live.outcome is None
    assert live.rid == "r"
    assert _marks(live) == [Mark.REGISTERED, Mark.PREALLOCATED, Mark.BOOTSTRAPPED]
    assert pair.poll_prefill() == [Bootstrapped("r")]
    pair.now = 3.0
    pair.hand_over(5, PROMPT)  # transfer runs at once in CorePair
    pair.now = 3.5
    assert pair.poll_prefill() == [Succeeded("r")]
    pair.now = 4.0
    (done,) = [e for e in pair.poll_decode() if isinstance(e, RemotePrefillDone)]
    assert done.rid == "r"

    p = _only(prefill.drain_finished())
    assert p.outcome is Outcome.SUCCESS
    assert (p.side, p.rank, p.room, p.rid) == (Side.PREFILL, 0, 5, "r")
    assert _marks(p) == [
        Mark.REGISTERED,
        Mark.PREALLOCATED,
        Mark.BOOTSTRAPPED,
        Mark.TRANSFER_STARTED,
        Mark.WRITTEN,
        Mark.NOTIFIED,
        Mark.CONCLUDED,
    ]
    assert p.phases == {
        "bootstrapping": 1.0,
        "waiting_for_input": 2.0,
        "transfer": 0.0,
        "notification": 0.0,
    }
    assert p.duration == 3.5
    assert p.bytes == pair.bytes_written == 3 * 64
    assert p.descriptors == 1  # three contiguous pages, coalesced
    assert p.chunks == 1
    assert p.reason is None
    assert p.reason_class is None

    d = _only(decode.drain_finished())
    assert d.outcome is Outcome.SUCCESS
    assert _marks(d) == [
        Mark.REGISTERED,
        Mark.BOOTSTRAPPED,
        Mark.PREALLOCATED,
        Mark.COMPLETED,
        Mark.CONCLUDED,
    ]
    assert d.phases == {
        "bootstrapping": 0.0,
        "waiting_for_preallocation": 1.0,
        "transfer": 2.0,
        "notification": 1.0,
    }
    # Fast successful rooms are not kept; drained traces are not drained twice.
    assert prefill.trace(5) is None
    assert decode.trace(5) is None
    assert prefill.recent_traces() == []
    assert decode.recent_traces() == []
    assert prefill.drain_finished() == []
    assert decode.drain_finished() == []
    assert pair.room_tables_empty()


def test_a_slow_success_is_kept_for_inspection(pair: CorePair) -> None:
    pair.register_decode("r", 9)
    pair.register_prefill("r", 9)
    pair.poll_decode()
    pair.now = 6.0  # Decode allocated its pages late: over the 5 s default threshold
    pair.preallocate(9, PROMPT)
    pair.poll_prefill()
    pair.hand_over(9, PROMPT)
    pair.poll_prefill()
    pair.poll_decode()
    kept = pair.prefill[0].trace(9)
    assert kept is not None
    assert kept.outcome is Outcome.SUCCESS
    assert kept.phases["bootstrapping"] == 6.0
    assert pair.prefill[0].recent_traces() == [kept]
    assert pair.decode[0].trace(9) is not None
    assert "waiting_for_preallocation" in pair.decode[0].trace(9).phases  # type: ignore[union-attr]


# --- failures: reason, class, both sides ------------------------------------------------


def _bootstrapped(pair: CorePair, rid: str, room: int) -> None:
    pair.register_decode(rid, room)
    pair.register_prefill(rid, room)
    pair.poll_decode()
    pair.preallocate(room, PROMPT)
    pair.poll_prefill()


def test_a_failed_transfer_is_classified_and_kept_on_both_sides(pair: CorePair) -> None:
    pair.write_errors[CorePair.decode_session(0)] = "connection reset"
    _bootstrapped(pair, "a", 1)
    pair.now = 2.0
    pair.hand_over(1, PROMPT)
    (failed,) = pair.poll_prefill()
    assert isinstance(failed, Failed)
    pair.poll_decode()

    p = pair.prefill[0].trace(1)
    assert p is not None
    assert p.outcome is Outcome.FAILED
    assert p.reason == failed.reason
    assert p.reason_class is ReasonClass.TRANSFER
    assert p.at(Mark.FAILED) == 2.0
    assert Mark.WRITTEN not in _marks(p)
    d = pair.decode[0].trace(1)
    assert d is not None
    assert d.reason_class is ReasonClass.PEER_FAILED
    # The RoomFailed commands carry the same class, for the failure metric.
    classes = {(side, f.reason_class) for side, _, f in pair.failures}
    assert classes == {("prefill", ReasonClass.TRANSFER), ("decode", ReasonClass.PEER_FAILED)}
    assert [t.room for t in pair.prefill[0].recent_traces()] == [1]
    assert "failed [transfer] CachePD transfer failed" in p.describe()
    assert pair.room_tables_empty()


def test_timeouts_name_their_phase(pair: CorePair) -> None:
    pair.register_decode("a", 1)
    pair.register_prefill("a", 1)
    pair.now = 120.0
    assert isinstance(pair.poll_prefill()[0], Failed)
    p = pair.prefill[0].trace(1)
    assert p is not None
    assert (p.reason_class, p.timeout_stage) == (ReasonClass.TIMEOUT_BOOTSTRAPPING, "bootstrapping")

    pair.register_decode("b", 2)
    pair.poll_decode()
    pair.preallocate(2, PROMPT)
    pair.advance(300.0)
    events = pair.poll_decode()
    assert any(isinstance(e, Failed) and e.rid == "b" for e in events)
    d = pair.decode[0].trace(2)
    assert d is not None
    assert (d.reason_class, d.timeout_stage) == (ReasonClass.TIMEOUT_WAITING, "waiting_for_input")
    assert d.phases["waiting_for_preallocation"] == 0.0
    assert "transfer" not in d.phases


def test_an_abort_is_aborted_whatever_its_text(pair: CorePair) -> None:
    _bootstrapped(pair, "a", 1)
    pair.prefill[0].abort(1, "the engine gave up on this request", pair.now)
    pair.pump()
    pair.poll_prefill()
    trace = pair.prefill[0].trace(1)
    assert trace is not None
    assert trace.reason == "the engine gave up on this request"
    assert trace.reason_class is ReasonClass.ABORTED


def test_an_unclaimed_room_is_dropped_with_its_own_class(pair: CorePair) -> None:
    pair.register_decode("a", 3)
    pair.poll_decode()
    pair.now = 1.0
    pair.preallocate(3, PROMPT)  # Prefill never registers the request
    prefill = pair.prefill[0]
    assert _marks(prefill.trace(3)) == [Mark.PREALLOCATED, Mark.BOOTSTRAPPED]  # type: ignore[arg-type]
    pair.advance(120.0)
    dropped = _only(prefill.drain_finished())
    assert dropped.outcome is Outcome.DROPPED
    assert dropped.reason_class is ReasonClass.UNCLAIMED
    assert dropped.at(Mark.DROPPED) == 121.0
    assert dropped.phases == {"bootstrapping": 0.0}
    assert prefill.trace(3) == dropped
    assert prefill.statistics()["traces"] == 0


def test_decode_route_failures_are_incompatible_or_bootstrap() -> None:
    pair = CorePair([CONTRACT], [simple_contract(num_pages=16, page_bytes=128)])
    try:
        pair.register_decode("a", 1)
        trace = pair.decode[0].trace(1)
        assert trace is not None
        assert trace.reason_class is ReasonClass.INCOMPATIBLE
    finally:
        pair.close()
    pair = CorePair([CONTRACT], [CONTRACT])
    try:
        pair.parallel_info_error = "connection refused"
        pair.register_decode("b", 2)
        assert pair.decode[0].trace(2).reason_class is ReasonClass.BOOTSTRAP  # type: ignore[union-attr]
    finally:
        pair.close()


# --- classification -----------------------------------------------------------------


def test_a_failure_carries_its_class_and_a_timeout_its_stage() -> None:
    timeout = Failure(ReasonClass.TIMEOUT_WAITING, "Request 1 timed out after 3.0s in x")
    assert timeout.timeout_stage == "waiting_for_input"
    assert Failure(ReasonClass.TIMEOUT_BOOTSTRAPPING, "t").timeout_stage == "bootstrapping"
    assert Failure(ReasonClass.TRANSFER, "CachePD transfer failed: x").timeout_stage is None
    assert str(timeout) == timeout.message


def test_rewording_a_message_does_not_reclassify_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The class is decided where the failure arises, never read back from the text:
    the same failure with another message keeps its class on the trace."""
    import tspd.core.decode as decode_core

    reworded = Failure(ReasonClass.PEER_FAILED, "the Prefill said no (reworded)")
    monkeypatch.setattr(decode_core, "_PREFILL_FAILED", reworded)
    pair = CorePair([CONTRACT], [CONTRACT])
    try:
        _bootstrapped(pair, "b", 2)
        pair.decode[0].receive_status(
            wire.encode_status(
                wire.StatusMessage(room=2, status=TransferPoll.FAILED, prefill_rank=0)
            ),
            pair.now,
        )
        trace = pair.decode[0].trace(2)
        assert trace is not None
        assert (trace.reason, trace.reason_class) == (reworded.message, ReasonClass.PEER_FAILED)
    finally:
        pair.close()


# --- the tracer alone: bounds ---------------------------------------------------------


def test_tracer_keeps_each_mark_once_and_the_first_reason() -> None:
    tracer = RoomTracer(Side.DECODE, 2)
    tracer.mark(1, Mark.REGISTERED, 0.0, rid="x")
    tracer.mark(1, Mark.REGISTERED, 5.0, rid="y")
    first = Failure(
        ReasonClass.PROTOCOL, "Received KV completion before its transfer route was registered"
    )
    assert tracer.fail(1, first, 1.0) is first
    assert tracer.fail(1, Failure(ReasonClass.ABORTED, "later"), 2.0) == first
    trace = tracer.finish(1, RoomState.FAILED, Mark.CONCLUDED, 3.0)
    assert trace is not None
    assert trace.rid == "x"
    assert trace.marks == ((Mark.REGISTERED, 0.0), (Mark.FAILED, 1.0), (Mark.CONCLUDED, 3.0))
    assert trace.reason == "Received KV completion before its transfer route was registered"
    assert tracer.finish(1, RoomState.FAILED, Mark.CONCLUDED, 4.0) is None


def test_tracer_memory_is_bounded() -> None:
    tracer = RoomTracer(Side.PREFILL, 0, TraceConfig(keep=2, slow_after=1.0, pending=3))
    for room in range(5):
        tracer.mark(room, Mark.REGISTERED, 0.0)
        tracer.fail(room, Failure(ReasonClass.OTHER, "x"), 0.5)
        tracer.finish(room, RoomState.FAILED, Mark.CONCLUDED, 0.5)
    assert [t.room for t in tracer.recent()] == [3, 4]
    assert tracer.trace(0) is None
    assert [t.room for t in tracer.drain_finished()] == [2, 3, 4]
    assert tracer.finished_dropped == 2
    # A fast success is queued for metrics but not kept; a slow one is kept.
    tracer.mark(10, Mark.REGISTERED, 0.0)
    tracer.finish(10, RoomState.SUCCESS, Mark.CONCLUDED, 0.9)
    tracer.mark(11, Mark.REGISTERED, 0.0)
    tracer.finish(11, RoomState.SUCCESS, Mark.CONCLUDED, 1.0)
    assert [t.room for t in tracer.recent()] == [4, 11]
    assert [t.room for t in tracer.drain_finished()] == [10, 11]
    assert len(tracer) == 0
    silent = RoomTracer(Side.PREFILL, 0, TraceConfig(keep=0, pending=0))
    silent.mark(1, Mark.REGISTERED, 0.0)
    silent.finish(1, RoomState.FAILED, Mark.CONCLUDED, 1.0)
    assert silent.drain_finished() == []
    assert silent.recent() == []
    assert silent.finished_dropped == 1


@pytest.mark.parametrize(
    "kwargs", [{"keep": -1}, {"pending": -1}, {"slow_after": 0.0}, {"slow_after": float("nan")}]
)
def test_trace_config_is_validated(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        TraceConfig(**kwargs)  # type: ignore[arg-type]


_MARKS = st.sampled_from(list(Mark))


@given(
    steps=st.lists(
        st.tuples(st.integers(0, 3), _MARKS, st.floats(0.0, 10.0)), min_size=1, max_size=40
    ),
    side=st.sampled_from(list(Side)),
)
def test_any_mark_sequence_gives_ordered_marks_and_non_negative_phases(
    steps: list[tuple[int, Mark, float]], side: Side
) -> None:
    tracer = RoomTracer(side, 0, TraceConfig(keep=2, pending=8))
    now = 0.0
    for room, mark, dt in steps:
        now += dt
        tracer.mark(room, mark, now)
    rooms = sorted({room for room, _, _ in steps})
    assert len(tracer) == len(rooms)
    for room in rooms:
        trace = tracer.finish(room, RoomState.SUCCESS, Mark.CONCLUDED, now)
        assert trace is not None
        times = [when for _, when in trace.marks]
        assert times == sorted(times)
        assert len({mark for mark, _ in trace.marks}) == len(trace.marks)
        assert all(duration >= 0.0 for duration in trace.phases.values())
        assert trace.duration == pytest.approx(times[-1] - times[0])
    assert len(tracer) == 0
    assert len(tracer.recent()) <= 2


def test_statistics_count_live_traces(pair: CorePair) -> None:
    pair.register_decode("a", 1)
    pair.register_prefill("a", 1)
    assert pair.prefill[0].statistics()["traces"] == 1
    assert pair.decode[0].statistics()["traces"] == 1
    pair.prefill[0].receive_control(wire.encode_preallocation(2, "ghost:1", None), pair.now)
    pair.pump()
    # A room failed by a bad pre-allocation has a trace until the unclaimed sweep.
    assert pair.prefill[0].trace(2).reason_class is ReasonClass.PREALLOCATION  # type: ignore[union-attr]
    assert pair.prefill[0].statistics()["traces"] == 2


def test_kept_traces_share_their_milestones_and_stay_light_for_the_collector() -> None:
    tracer = RoomTracer(Side.DECODE, 0, TraceConfig(keep=1000, slow_after=1e-9))
    for room in range(1, 301):
        tracer.mark(room, Mark.REGISTERED, float(room), rid=f"r{room}")
        tracer.mark(room, Mark.BOOTSTRAPPED, room + 0.5)
        tracer.finish(room, RoomState.SUCCESS, Mark.CONCLUDED, room + 1.0)
    kept = tracer.recent()
    assert len(kept) == 300
    assert len({id(trace.kinds) for trace in kept}) == 1  # one shared sequence
    assert kept[4].marks == (
        (Mark.REGISTERED, 5.0),
        (Mark.BOOTSTRAPPED, 5.5),
        (Mark.CONCLUDED, 6.0),
    )
    assert kept[4].at(Mark.BOOTSTRAPPED) == 5.5
    assert kept[4].duration == 1.0
    gc.collect()
    tracked = {id(o) for o in gc.get_objects()}
    assert sum(id(trace) in tracked for trace in kept) == 300
    assert sum(id(trace.times) in tracked for trace in kept) == 0  # floats only
    rebuilt = RoomTrace.of(5, Side.DECODE, 0, "r5", kept[4].marks, outcome=kept[4].outcome)
    assert rebuilt.kinds is kept[4].kinds
    assert rebuilt.times == kept[4].times
