"""TokenSpeed's variables that the Trio shell reads through ``from_env``: transfer
workers, write concurrency and the heartbeat interval (docs/configuration.md)."""

from __future__ import annotations

import pytest

from tspd.core.config import ENV_HEARTBEAT_INTERVAL, ENV_QUEUE_SIZE, ENV_THREAD_POOL_SIZE
from tspd.core.errors import ConfigError
from tspd.core.prefill import PrefillConfig
from tspd.shell.arena import HostArena
from tspd.shell.decode import DecodeSettings
from tspd.shell.offload import DEFAULT_WRITE_CONCURRENCY, EngineRunner
from tspd.shell.prefill import open_prefill_peer
from tspd.testing.fake_engine import AsyncFakeEngine, FakeEngine, FakeFabric
from tspd.testing.layouts import simple_contract

CONTRACT = simple_contract(num_pages=8, page_bytes=64)


@pytest.mark.parametrize("workers", [1, 3])
async def test_queue_size_variable_sets_the_peers_transfer_workers(workers: int) -> None:
    config = PrefillConfig.from_env(
        {ENV_QUEUE_SIZE: str(workers)}, tp_size=1, tp_rank=0, contract=CONTRACT, arena_base=1
    )
    with HostArena.for_contract(CONTRACT) as arena:
        engine = AsyncFakeEngine(fabric=FakeFabric())
        async with open_prefill_peer(config, engine, arena) as peer:
            assert peer._workers.count == workers


def test_thread_pool_variable_bounds_concurrent_writes() -> None:
    fabric = FakeFabric()
    runner = EngineRunner.from_env(FakeEngine(fabric=fabric), {ENV_THREAD_POOL_SIZE: "5"})
    assert runner.limiter.total_tokens == 5
    runner = EngineRunner.from_env(FakeEngine(fabric=fabric), {})
    assert runner.limiter.total_tokens == DEFAULT_WRITE_CONCURRENCY
    runner = EngineRunner.from_env(FakeEngine(fabric=fabric), {}, default_concurrency=3)
    assert runner.limiter.total_tokens == 3
    with pytest.raises(ConfigError, match=ENV_THREAD_POOL_SIZE):
        EngineRunner.from_env(FakeEngine(fabric=fabric), {ENV_THREAD_POOL_SIZE: "lots"})


def test_heartbeat_interval_variable() -> None:
    assert DecodeSettings.from_env({ENV_HEARTBEAT_INTERVAL: "3.5"}).heartbeat_interval == 3.5
    assert DecodeSettings.from_env({}).heartbeat_interval == 5.0
    explicit = DecodeSettings.from_env({ENV_HEARTBEAT_INTERVAL: "3.5"}, heartbeat_interval=0.1)
    assert explicit.heartbeat_interval == 0.1
    with pytest.raises(ConfigError, match=ENV_HEARTBEAT_INTERVAL):
        DecodeSettings.from_env({ENV_HEARTBEAT_INTERVAL: "1"})


def test_demo_tunables_take_option_then_variable_then_demo_default() -> None:
    from tspd.core.config import ENV_BOOTSTRAP_TIMEOUT, ENV_HEARTBEAT_MAX_FAILURE
    from tspd.demo.roles import DemoTunables

    environ = {ENV_BOOTSTRAP_TIMEOUT: "90", ENV_QUEUE_SIZE: "3", ENV_HEARTBEAT_MAX_FAILURE: "4"}
    tuned = DemoTunables.resolve(environ, bootstrap_timeout=None, workers=5)
    assert tuned.bootstrap_timeout == 90
    assert tuned.workers == 5
    assert tuned.heartbeat_max_failures == 4
    assert tuned.waiting_timeout == DemoTunables().waiting_timeout


def test_demo_role_refuses_an_invalid_variable_naming_it() -> None:
    from click.testing import CliRunner

    from tspd.cli import main

    result = CliRunner().invoke(
        main, ["demo", "decode", "--rooms", "1:2"], env={ENV_QUEUE_SIZE: "zero"}
    )
    assert result.exit_code == 2
    assert f"{ENV_QUEUE_SIZE}='zero' is not" in result.output
