"""The ``tspd demo`` roles: workload, role runners, reports and the orchestrator."""

__all__: list[str] = []
