"""The producer step counter: the host word layerwise transfers wait on.

The counter's rules are those of docs/protocol.md#proto-step-counter.

On a GPU host the device bumps a pinned host ``int64`` after each producer
step's KV write and transfer workers read it with a plain aligned load. Here
:class:`StepCounter` is that word in host memory (a one-element ``int64``
array, so its address is stable and a read is one aligned load); the producer
— an engine's forward, or the demo standing in for one — calls
:meth:`StepCounter.advance` after each step's KV is written.

Transfer workers wait on it with :func:`tspd.shell.offload.wait_step`.
"""

from __future__ import annotations

from typing import final

import numpy as np

from tspd.core.schedule import STEP_MODULUS

__all__ = ["StepCounter"]


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
