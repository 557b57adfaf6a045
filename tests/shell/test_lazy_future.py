"""LazyFuture: a concurrent.futures.Future that makes its Condition only on demand."""

from __future__ import annotations

import concurrent.futures
import gc
import threading

import pytest

from tspd.shell.threadsafe import LazyFuture


def _tracked_per_future(make: type[concurrent.futures.Future[int]]) -> float:
    gc.collect()
    before = len(gc.get_objects())
    futures = [make() for _ in range(500)]
    for future in futures:
        future.set_running_or_notify_cancel()
        future.set_result(1)
    gc.collect()
    return (len(gc.get_objects()) - before) / len(futures)


def test_a_future_nobody_waits_on_holds_no_condition() -> None:
    future: LazyFuture[int] = LazyFuture()
    assert future.set_running_or_notify_cancel()
    future.set_result(7)
    assert "_condition" not in vars(future)
    assert _tracked_per_future(LazyFuture) <= 2.5
    assert _tracked_per_future(concurrent.futures.Future) >= 8  # what it replaces
    assert future.result() == 7
    assert future.done()


def test_a_waiter_that_came_first_is_woken() -> None:
    future: LazyFuture[str] = LazyFuture()
    got: list[str] = []
    waiter = threading.Thread(target=lambda: got.append(future.result(timeout=5)))
    waiter.start()
    while "_condition" not in vars(future):  # the waiter made it, and waits on it
        threading.Event().wait(0.001)
    assert future.set_running_or_notify_cancel()
    future.set_result("late")
    waiter.join(5)
    assert got == ["late"]


def test_errors_callbacks_wait_and_cancel_keep_the_standard_behaviour() -> None:
    failed: LazyFuture[int] = LazyFuture()
    failed.set_running_or_notify_cancel()
    failed.set_exception(KeyError("boom"))
    with pytest.raises(KeyError, match="boom"):
        failed.result(timeout=1)
    assert isinstance(failed.exception(timeout=1), KeyError)

    called: list[int] = []
    done: LazyFuture[int] = LazyFuture()
    done.add_done_callback(lambda f: called.append(f.result()))
    done.set_running_or_notify_cancel()
    done.set_result(3)
    assert called == [3]
    waited = concurrent.futures.wait([done, failed], timeout=1)
    assert waited.done == {done, failed}

    cancelled: LazyFuture[int] = LazyFuture()
    assert cancelled.cancel()
    assert not cancelled.set_running_or_notify_cancel()
    with pytest.raises(concurrent.futures.CancelledError):
        cancelled.result(timeout=1)

    finished: LazyFuture[int] = LazyFuture()
    finished.set_result(1)
    with pytest.raises(concurrent.futures.InvalidStateError):
        finished.set_result(2)
    with pytest.raises(AttributeError, match="no attribute 'missing'"):
        finished.missing  # noqa: B018  # the lookup is the test


def test_outcomes_racing_waiters_are_never_lost() -> None:
    """Setters and waiters in two threads, the Condition made by whichever comes
    first: every waiter gets its future's value (a lost wake-up would time out)."""
    futures: list[LazyFuture[int]] = [LazyFuture() for _ in range(2000)]
    got: list[int] = []
    start = threading.Barrier(2)

    def wait_all() -> None:
        start.wait()
        got.extend(future.result(timeout=5) for future in futures)

    waiter = threading.Thread(target=wait_all)
    waiter.start()
    start.wait()
    for i, future in enumerate(futures):
        assert future.set_running_or_notify_cancel()
        future.set_result(i)
    waiter.join(30)
    assert got == list(range(2000))


def test_reading_a_finished_future_makes_no_condition() -> None:
    ok: LazyFuture[int] = LazyFuture()
    assert not ok.done()
    ok.set_running_or_notify_cancel()
    ok.set_result(5)
    failed: LazyFuture[int] = LazyFuture()
    failed.set_running_or_notify_cancel()
    failed.set_exception(ValueError("no"))
    assert ok.done()
    assert failed.done()
    assert ok.result(timeout=0) == 5
    assert ok.exception(timeout=0) is None
    assert isinstance(failed.exception(timeout=0), ValueError)
    with pytest.raises(ValueError, match="no"):
        failed.result(timeout=0)
    assert "_condition" not in vars(ok)
    assert "_condition" not in vars(failed)
    pending: LazyFuture[int] = LazyFuture()
    with pytest.raises(TimeoutError):
        pending.result(timeout=0.01)  # waiting makes it
    assert "_condition" in vars(pending)
