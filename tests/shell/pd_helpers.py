"""Helpers shared by the PD peer tests."""

from __future__ import annotations

from collections.abc import Callable

import trio


async def wait_until(
    condition: Callable[[], bool], limit: float = 10.0, step: float = 0.001
) -> None:
    """Poll ``condition`` until it holds; fail the test after ``limit`` seconds."""
    with trio.fail_after(limit):
        for _ in iter(int, 1):
            if condition():
                return
            await trio.sleep(step)
