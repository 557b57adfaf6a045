"""The in-process engines tests use: re-exported from :mod:`tspd.engines.memory`,
where the benchmarks and the simulator find them too."""

from tspd.engines.memory import (
    DEFAULT_FABRIC,
    AsyncFakeEngine,
    FakeEngine,
    FakeEngineStats,
    FakeFabric,
)

__all__ = [
    "DEFAULT_FABRIC",
    "AsyncFakeEngine",
    "FakeEngine",
    "FakeEngineStats",
    "FakeFabric",
]
