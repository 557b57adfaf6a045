"""What one run reports: outcomes, figures, violations and fencing reports."""

from __future__ import annotations

from dataclasses import dataclass, field

from tspd.sim.config import SimConfig
from tspd.sim.invariants import SimulationFailed, Violation
from tspd.sim.network import NetworkStats
from tspd.sim.staging import StagingStats
from tspd.sim.transfers import TransferStats

__all__ = ["Outcomes", "SimResult"]


@dataclass(slots=True)
class Outcomes:
    """How the requests' sides ended."""

    prefill_succeeded: int = 0
    prefill_failed: int = 0
    decode_succeeded: int = 0
    decode_failed: int = 0
    #: Sides lost with a crashed process (they end with it, unreported).
    lost: int = 0


@dataclass(frozen=True, slots=True)
class SimResult:
    """One run: its seed and configuration, what happened, what broke.

    ``violations`` are the strict ones (a run stops at the first); ``fenced`` the
    fencing violations counted in ``report`` mode; ``timelines`` the timeline of
    the room of each violation and of the first few fenced rooms;
    ``stale_registrations`` counts, over every Prefill rank at the end, the
    registrations of Decode sessions whose process had died (they are never
    dropped, so they grow with Decode churn). ``bootstrap_crashes`` and ``sleeps``
    count the bootstrap servers that crashed and the Prefill groups that slept,
    ``rank_crashes`` the ranks that died alone (``rank-crash``);
    ``staging`` what staged transfers did (``SimConfig.staging``).
    """

    seed: int
    config: SimConfig
    outcomes: Outcomes
    sim_seconds: float
    wall_seconds: float
    steps: int
    rooms: int
    network: NetworkStats
    transfers: TransferStats
    crashes: int
    partitions: int
    bootstrap_crashes: int
    sleeps: int
    violations: tuple[Violation, ...]
    fenced: tuple[Violation, ...]
    fenced_corruptions: int
    stale_registrations: int
    timelines: dict[int, str] = field(default_factory=dict)
    events: tuple[str, ...] = ()
    staging: StagingStats = field(default_factory=StagingStats)
    rank_crashes: int = 0

    @property
    def ok(self) -> bool:
        """Whether no strict invariant broke."""
        return not self.violations

    def failure(self) -> SimulationFailed | None:
        """The first strict violation as an exception, with what repeats it."""
        if not self.violations:
            return None
        violation = self.violations[0]
        timeline = self.timelines.get(violation.room, "") if violation.room is not None else ""
        if self.events:
            timeline = "cluster events:\n  " + "\n  ".join(self.events) + "\n" + timeline
        return SimulationFailed(
            self.seed, self.config.command(self.seed), violation, timeline or "(no room)"
        )

    def summary(self) -> str:
        """One line: outcomes, fencing, figures."""
        o = self.outcomes
        status = "ok" if self.ok else f"VIOLATION {self.violations[0].check}"
        extra = ""
        if self.config.faults.rank_crash:
            extra = f"; rank crashes {self.rank_crashes}"
        if self.config.staging:
            s = self.staging
            extra += (
                f"; staged {s.rooms} rooms ({s.scattered} blobs scattered, {s.refused} refused)"
            )
        return (
            f"seed {self.seed}: {status}; {self.rooms} rooms; prefill {o.prefill_succeeded} ok "
            f"{o.prefill_failed} failed; decode {o.decode_succeeded} ok {o.decode_failed} failed; "
            f"{o.lost} lost; fencing {len(self.fenced)}; stale registrations "
            f"{self.stale_registrations}{extra}; {self.sim_seconds:.1f} sim s in "
            f"{self.wall_seconds * 1000:.0f} ms ({self.steps} events)"
        )
