"""Many seeds of one configuration, and what they add up to.

A sweep runs seeds in order (in several processes if asked: runs share nothing)
and keeps going past failures unless told to stop at the first; the result lists
the seeds that broke a strict invariant (each one repeats with ``tspd sim --seed
S`` and the same configuration) and totals the figures: fencing reports, stale
registrations, outcomes, simulated and wall time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from itertools import repeat

from tspd.sim.cluster import run
from tspd.sim.config import SimConfig
from tspd.sim.result import SimResult

__all__ = ["SweepResult", "sweep"]


@dataclass(slots=True)
class SweepResult:
    """The totals of a sweep, and the runs that broke a strict invariant."""

    config: SimConfig
    seeds: int = 0
    rooms: int = 0
    steps: int = 0
    sim_seconds: float = 0.0
    wall_seconds: float = 0.0
    fenced: int = 0
    fenced_seeds: int = 0
    fenced_corruptions: int = 0
    stale_registrations: int = 0
    succeeded: int = 0
    failed: int = 0
    lost: int = 0
    #: Ranks that died alone (``rank-crash``).
    rank_crashes: int = 0
    #: Staged transfers: rooms with a blob scattered, blobs scattered and refused.
    staged_rooms: int = 0
    scattered: int = 0
    refused: int = 0
    failures: list[SimResult] = field(default_factory=list)
    #: The first run that reported fencing violations, to show one.
    first_fenced: SimResult | None = None

    @property
    def ok(self) -> bool:
        """Whether every seed kept every strict invariant."""
        return not self.failures

    def add(self, result: SimResult) -> None:
        """Fold one run in."""
        self.seeds += 1
        self.rooms += result.rooms
        self.steps += result.steps
        self.sim_seconds += result.sim_seconds
        self.wall_seconds += result.wall_seconds
        self.fenced += len(result.fenced)
        self.fenced_corruptions += result.fenced_corruptions
        self.stale_registrations += result.stale_registrations
        if result.fenced:
            self.fenced_seeds += 1
            if self.first_fenced is None:
                self.first_fenced = result
        o = result.outcomes
        self.succeeded += o.decode_succeeded
        self.failed += o.decode_failed
        self.lost += o.lost
        self.rank_crashes += result.rank_crashes
        self.staged_rooms += result.staging.rooms
        self.scattered += result.staging.scattered
        self.refused += result.staging.refused
        if not result.ok:
            self.failures.append(result)

    def summary(self) -> str:
        """A few lines: seeds, failures, fencing, throughput."""
        wall = self.wall_seconds or 1e-9
        shown = ", ".join(str(r.seed) for r in self.failures[:10])
        failing = f" ({shown})" if shown else ""
        lines = [
            f"{self.seeds} seeds, {self.rooms} rooms: {len(self.failures)} seeds broke a strict "
            f"invariant{failing}",
            f"decode requests: {self.succeeded} succeeded, {self.failed} failed, {self.lost} lost "
            "with a crash",
            f"fencing ({self.config.fencing}): {self.fenced} late writes in "
            f"{self.fenced_seeds} seeds ({self.fenced_corruptions} corrupted a later room's page)",
            f"stale registrations at the end: {self.stale_registrations}",
        ]
        if self.config.faults.rank_crash:
            lines.append(f"rank crashes: {self.rank_crashes} ranks died alone")
        if self.config.staging:
            lines.append(
                f"staged transfers: {self.staged_rooms} rooms staged, {self.scattered} blobs "
                f"scattered, {self.refused} refused"
            )
        lines += [
            f"{self.seeds / wall:.1f} seeds/s, {self.sim_seconds / wall:.0f} simulated s per "
            f"wall s, {self.rooms / wall:.0f} rooms/s ({self.steps / wall:.0f} events/s)",
        ]
        return "\n".join(lines)


def sweep(
    config: SimConfig,
    seeds: Iterable[int],
    *,
    jobs: int = 1,
    stop_at_first: bool = False,
    progress: Callable[[SimResult], None] | None = None,
) -> SweepResult:
    """Run ``config`` for every seed, in ``jobs`` processes (results are folded in
    seed order either way); ``progress`` sees each result."""
    total = SweepResult(config)
    started = time.perf_counter()
    if jobs <= 1:
        results: Iterator[SimResult] = (run(config, seed) for seed in seeds)
        _fold(total, results, stop_at_first, progress)
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            _fold(total, pool.map(run, repeat(config), seeds, chunksize=4), stop_at_first, progress)
            pool.shutdown(cancel_futures=True)
    total.wall_seconds = time.perf_counter() - started
    return total


def _fold(
    total: SweepResult,
    results: Iterator[SimResult],
    stop_at_first: bool,
    progress: Callable[[SimResult], None] | None,
) -> None:
    for result in results:
        total.add(result)
        if progress is not None:
            progress(result)
        if stop_at_first and not result.ok:
            break
