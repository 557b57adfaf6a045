"""The demo roles' progress reports: one JSON object per line on stdout.

Every role process of the demo (and of ``tspd bench pd``) writes what happens as
JSON lines — ``ready`` with its endpoints, one ``room`` line per finished room,
``done`` with its CPU time and table sizes — so an orchestrator, a test or a
person can follow it. Timestamps are ``time.monotonic()``: on Linux that clock is
shared by every process on the host, so a Prefill's hand-over and a Decode's
completion can be subtracted.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, TextIO, final

__all__ = ["Reporter"]


@final
class Reporter:
    """Writes one JSON object per line, flushed at once."""

    def __init__(self, role: str, rank: int, stream: TextIO | None = None) -> None:
        self.role = role
        self.rank = rank
        self._stream = stream or sys.stdout

    def emit(self, event: str, **fields: Any) -> None:
        """Write ``{"event": event, "role": …, "rank": …, "t": now, **fields}``."""
        record = {"event": event, "role": self.role, "rank": self.rank, "t": time.monotonic()}
        record.update(fields)
        self._stream.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._stream.flush()

    def announce(self, text: str) -> None:
        """A line for a person on stderr (stdout carries only JSON)."""
        sys.stderr.write(f"{self.role} rank {self.rank}: {text}\n")
        sys.stderr.flush()
