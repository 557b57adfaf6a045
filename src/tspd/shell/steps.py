"""The producer step counter: the host word layerwise transfers wait on (spec §5.7).

On a GPU host the device bumps a pinned host ``int64`` after each producer
step's KV write and transfer workers read it with a plain aligned load. Here
:class:`StepCounter` is that word in host memory (a one-element ``int64``
array, so its address is stable and a read is one aligned load); the producer
— an engine's forward, or the demo standing in for one — calls
:meth:`StepCounter.advance` after each step's KV is written.

:func:`wait_step` waits for a target step without a thread: it polls the word
with short Trio sleeps, so a wait is cancellable and never occupies one of the
engine's worker threads; the poll interval backs off from 100 µs (the
TokenSpeed figure) to 1 ms while nothing moves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import final

import numpy as np
import trio

from tspd.core.schedule import STEP_MODULUS, step_ready

__all__ = ["StepCounter", "wait_step"]


@final
class StepCounter:
    """A producer step counter word in host memory, modulo ``2**62``."""

    def __init__(self) -> None:
        self._word = np.zeros(1, dtype=np.int64)

    @property
    def address(self) -> int:
        """Where the word lives (what a device would write to)."""
        return int(self._word.ctypes.data)

    def read(self) -> int:
        """The counter's current value: the number of producer steps completed."""
        return int(self._word[0])

    def advance(self, steps: int = 1) -> int:
        """Record ``steps`` more completed producer steps; returns the new value."""
        value = (int(self._word[0]) + steps) % STEP_MODULUS
        self._word[0] = value
        return value


async def wait_step(
    read: Callable[[], int],
    target: int,
    *,
    give_up: Callable[[], str | None] | None = None,
    check_every: float = 0.1,
) -> str | None:
    """Wait until the counter is strictly past ``target`` (``step_ready``).

    ``give_up`` is consulted every ``check_every`` seconds; when it returns a
    reason the wait stops and returns it (the room ended, a destination's
    session failed). Returns ``None`` once the step is ready.
    """
    delay = 0.0001
    next_check = trio.current_time()
    while not step_ready(read(), target):
        if give_up is not None and trio.current_time() >= next_check:
            reason = give_up()
            if reason is not None:
                return reason
            next_check = trio.current_time() + check_every
        await trio.sleep(delay)
        delay = min(delay * 2, 0.001)
    return None
