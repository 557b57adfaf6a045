"""The demo starts its Decode ranks beside its Prefill ranks, not after them, and
its bootstrap server on a port the OS picks.

A Prefill rank registers its requests as soon as it is ready, and each request's
bootstrap timeout runs from there; a Decode rank started only then would spend that
timeout on its own start (imports, engine, arena), which on a busy host can take
seconds. Each Decode rank waits for the Prefill instance itself."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio

from tspd.demo import orchestrate
from tspd.demo.orchestrate import DemoOptions, RoleProcess, run_demo
from tspd.demo.workload import Workload


@dataclass
class _Process:
    """What the orchestrator reads of a child: its exit status; and how it stops one."""

    returncode: int | None = 0

    def send_signal(self, signal: int) -> None:
        self.returncode = -signal


@dataclass
class _Spawns:
    """Stand-in children: the bootstrap server is ready at once, a Prefill rank only
    once a Decode rank was started (as if its start outlasted a Decode's)."""

    names: list[str] = field(default_factory=list)
    roles: dict[str, RoleProcess] = field(default_factory=dict)
    argvs: dict[str, list[str]] = field(default_factory=dict)

    async def spawn(
        self,
        nursery: trio.Nursery,
        name: str,
        argv: Sequence[str],
        on_record: Callable[[RoleProcess, dict[str, Any]], None],
        log_dir: str,
        extra_env: Mapping[str, str] | None = None,
    ) -> RoleProcess:
        self.names.append(name)
        self.argvs[name] = list(argv)
        log = Path(log_dir) / f"{name}.log"
        log.write_text("")
        running = _Process(returncode=None if name == "bootstrap" else 0)
        role = RoleProcess(name, running, str(log))  # type: ignore[arg-type]
        self.roles[name] = role
        if name == "bootstrap":
            role.records.append({"event": "ready", "address": "127.0.0.1:40401"})
            role.ready.set()
        if name.startswith("decode"):
            for prefill in (r for n, r in self.roles.items() if n.startswith("prefill")):
                prefill.records.append({"event": "ready", "registered": True})
                prefill.ready.set()
        role.finished.set()
        return role


async def test_the_decode_ranks_start_before_the_prefill_ranks_are_ready(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spawns = _Spawns()
    monkeypatch.setattr(orchestrate, "spawn", spawns.spawn)
    summary = await run_demo(
        DemoOptions(workload=Workload(rooms=range(1, 2)), prefill_tp=2, decode_tp=1, timeout=5)
    )
    assert spawns.names == ["bootstrap", "prefill-0", "prefill-1", "decode-0"]
    # Before the change the orchestrator waited for the Prefill ranks first, and
    # (these never ready until a Decode starts) timed out.
    assert not [e for e in summary.errors if "did not finish" in e], summary.errors


async def test_a_prefill_rank_that_does_not_register_still_stops_the_demo(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spawns = _Spawns()

    async def spawn_unregistered(*args: Any, **kwargs: Any) -> RoleProcess:
        role = await spawns.spawn(*args, **kwargs)
        if role.name.startswith("decode"):
            for name, prefill in spawns.roles.items():
                if name.startswith("prefill"):
                    prefill.records[:] = [{"event": "ready", "registered": False}]
        return role

    monkeypatch.setattr(orchestrate, "spawn", spawn_unregistered)
    summary = await run_demo(
        DemoOptions(workload=Workload(rooms=range(1, 2)), prefill_tp=1, decode_tp=1, timeout=5)
    )
    assert any("prefill-0 did not start or register" in e for e in summary.errors), summary


async def test_the_bootstrap_server_binds_a_port_the_os_picks_and_the_ranks_get_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not a port probed free first (another process could take it before the server
    binds it): ``--port 0``, and the ranks are given the address the server reports."""
    spawns = _Spawns()
    monkeypatch.setattr(orchestrate, "spawn", spawns.spawn)
    await run_demo(
        DemoOptions(workload=Workload(rooms=range(1, 2)), prefill_tp=1, decode_tp=1, timeout=5)
    )
    server = spawns.argvs["bootstrap"]
    assert server[server.index("--port") + 1] == "0"
    for rank in ("prefill-0", "decode-0"):
        argv = spawns.argvs[rank]
        assert argv[argv.index("--bootstrap") + 1] == "127.0.0.1:40401"
