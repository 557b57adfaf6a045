"""``tspd.sim``: a deterministic simulator of whole PD clusters.

Several Prefill instances (TP groups, optionally several attention-DP groups),
several Decode instances of other TP sizes (DP groups too), a bootstrap server per
Prefill instance and the schedulers that drive them, all built from tspd's real
sans-IO cores (:mod:`tspd.core`) and run on one virtual clock, with a simulated
network (delays, loss, duplication, reordering, partitions), a simulated transfer
engine (latency, failures, hangs, late writes), full or layerwise transfers
(:mod:`tspd.sim.layerwise`), staged transfers between instances that have a
staging region (:mod:`tspd.sim.staging`), crashes and restarts of any process
(bootstrap servers included), Prefill sleeps, and a model of every arena that says
which room owns each page and what each page holds.

After every event the simulator checks the invariants of
:mod:`tspd.sim.invariants`. A run is a seed plus a
:class:`~tspd.sim.config.SimConfig`::

    from tspd.sim import SimConfig, parse_faults, run
    result = run(SimConfig(rooms=300, faults=parse_faults("loss=0.01,crash")), seed=7)
    assert result.ok, result.failure()

:func:`~tspd.sim.sweeps.sweep` runs many seeds; ``tspd sim`` is the command line
(docs/sim.md). This package re-exports the names above and
:class:`~tspd.sim.cluster.Cluster`, :class:`~tspd.sim.config.Faults`,
:class:`~tspd.sim.config.InstanceShape`, :class:`~tspd.sim.config.Timings`,
:func:`~tspd.sim.config.parse_shapes`, :func:`~tspd.sim.config.format_faults`,
:class:`~tspd.sim.result.SimResult`, :class:`~tspd.sim.result.Outcomes`,
:class:`~tspd.sim.invariants.Check`, :class:`~tspd.sim.invariants.Violation`,
:class:`~tspd.sim.invariants.SimulationFailed` and
:class:`~tspd.sim.sweeps.SweepResult`. It imports no I/O library: it is as
sans-IO as the cores it drives.
"""

from tspd.sim.cluster import Cluster as Cluster
from tspd.sim.cluster import run as run
from tspd.sim.config import Faults as Faults
from tspd.sim.config import InstanceShape as InstanceShape
from tspd.sim.config import SimConfig as SimConfig
from tspd.sim.config import Timings as Timings
from tspd.sim.config import format_faults as format_faults
from tspd.sim.config import parse_faults as parse_faults
from tspd.sim.config import parse_shapes as parse_shapes
from tspd.sim.invariants import Check as Check
from tspd.sim.invariants import SimulationFailed as SimulationFailed
from tspd.sim.invariants import Violation as Violation
from tspd.sim.result import Outcomes as Outcomes
from tspd.sim.result import SimResult as SimResult
from tspd.sim.sweeps import SweepResult as SweepResult
from tspd.sim.sweeps import sweep as sweep

__all__ = [
    "Check",
    "Cluster",
    "Faults",
    "InstanceShape",
    "Outcomes",
    "SimConfig",
    "SimResult",
    "SimulationFailed",
    "SweepResult",
    "Timings",
    "Violation",
    "format_faults",
    "parse_faults",
    "parse_shapes",
    "run",
    "sweep",
]
