"""Process helpers for failure tests (a hung peer is a stopped process)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

__all__ = ["stop_process"]


def _all_threads_stopped(pid: int) -> bool:
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except FileNotFoundError:
        return False
    for task in tasks:
        try:
            stat = (task / "stat").read_text()
        except FileNotFoundError:
            continue  # the thread ended
        # The state letter follows the parenthesised command name.
        if stat[stat.rindex(")") + 2] not in "Tt":
            return False
    return True


def stop_process(pid: int, *, timeout: float = 5.0) -> None:
    """Send SIGSTOP to ``pid`` and return once every one of its threads is stopped.

    ``os.kill`` only queues the signal: a write issued right after it can still be
    served by a peer thread that has not stopped yet, so a "hung peer" test must
    wait for the stop to take effect. Raises ``TimeoutError`` if it does not.
    """
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while not _all_threads_stopped(pid):
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} did not stop within {timeout} s of SIGSTOP")
        time.sleep(0.001)
