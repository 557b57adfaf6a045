"""TokenSpeed's PD environment variables: parsing, and that every documented variable
changes what a peer does (docs/configuration.md)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tspd.core.commands import Bootstrapped, Failed, Log, StartTransfer
from tspd.core.config import (
    ENV_BOOTSTRAP_TIMEOUT,
    ENV_FAILED_SESSION_TTL,
    ENV_HEARTBEAT_INTERVAL,
    ENV_HEARTBEAT_MAX_FAILURE,
    ENV_LAYERWISE_DEBUG,
    ENV_QUEUE_SIZE,
    ENV_TEST_FAILURE_PROB,
    ENV_THREAD_POOL_SIZE,
    ENV_WAITING_TIMEOUT,
    PDEnv,
    parse_bool,
    parse_pd_env,
)
from tspd.core.decode import DecodeConfig
from tspd.core.errors import ConfigError
from tspd.core.machines import RoomState
from tspd.core.prefill import ExtendRow, PrefillConfig
from tspd.core.schedule import ProducerSchedule
from tspd.core.topology import ParallelTopology
from tspd.testing.core_pair import CorePair
from tspd.testing.layouts import multi_layer_contract, simple_contract

CONTRACT = simple_contract(num_pages=16, page_bytes=64)
PROMPT = 40
ADDR = "127.0.0.1:8998"
DEAD = "Failed to get kvcache from prefill instance, it might be dead"


@pytest.fixture
def pairs() -> Iterator[list[CorePair]]:
    made: list[CorePair] = []
    yield made
    for pair in made:
        pair.close()


def _pair(pairs: list[CorePair], environ: dict[str, str], **kw: object) -> CorePair:
    pair = CorePair([CONTRACT], [CONTRACT], environ=environ, **kw)  # type: ignore[arg-type]
    pairs.append(pair)
    return pair


# --- parsing


def test_defaults_when_nothing_is_set() -> None:
    assert parse_pd_env({}) == PDEnv(
        bootstrap_timeout=120,
        waiting_timeout=300,
        failed_session_ttl=30,
        heartbeat_interval=5.0,
        heartbeat_max_failures=2,
        queue_size=4,
        thread_pool_size=None,
        layerwise_debug=False,
        test_failure_prob=0.0,
    )


def test_values_are_read() -> None:
    env = parse_pd_env(
        {
            ENV_BOOTSTRAP_TIMEOUT: "7",
            ENV_WAITING_TIMEOUT: " 9 ",
            ENV_FAILED_SESSION_TTL: "0",
            ENV_HEARTBEAT_INTERVAL: "2.5",
            ENV_HEARTBEAT_MAX_FAILURE: "5",
            ENV_QUEUE_SIZE: "2",
            ENV_THREAD_POOL_SIZE: "3",
            ENV_LAYERWISE_DEBUG: "Yes",
            ENV_TEST_FAILURE_PROB: "0.25",
        }
    )
    assert (env.bootstrap_timeout, env.waiting_timeout, env.failed_session_ttl) == (7, 9, 0)
    assert (env.heartbeat_interval, env.heartbeat_max_failures) == (2.5, 5)
    assert (env.queue_size, env.thread_pool_size) == (2, 3)
    assert env.layerwise_debug is True
    assert env.test_failure_prob == 0.25


@pytest.mark.parametrize(
    ("name", "raw"),
    [
        (ENV_BOOTSTRAP_TIMEOUT, "12.5"),
        (ENV_BOOTSTRAP_TIMEOUT, "0"),
        (ENV_WAITING_TIMEOUT, "soon"),
        (ENV_WAITING_TIMEOUT, "-3"),
        (ENV_FAILED_SESSION_TTL, "x"),
        (ENV_HEARTBEAT_INTERVAL, "nan"),
        (ENV_HEARTBEAT_INTERVAL, "0.5"),
        (ENV_HEARTBEAT_MAX_FAILURE, "two"),
        (ENV_HEARTBEAT_MAX_FAILURE, "0"),
        (ENV_LAYERWISE_DEBUG, "maybe"),
        (ENV_TEST_FAILURE_PROB, "1/2"),
        (ENV_TEST_FAILURE_PROB, "1.5"),
        (ENV_QUEUE_SIZE, "many"),
        (ENV_QUEUE_SIZE, "0"),
        (ENV_THREAD_POOL_SIZE, "0"),
    ],
)
def test_an_invalid_value_is_an_error_naming_the_variable(name: str, raw: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_pd_env({name: raw})
    assert str(err.value).startswith(f"{name}={raw!r} is not ")
    assert "unset it to use the default" in str(err.value)


def test_empty_values_count_as_unset_and_negative_ttl_disables() -> None:
    env = parse_pd_env(
        {ENV_BOOTSTRAP_TIMEOUT: "", ENV_LAYERWISE_DEBUG: "  ", ENV_FAILED_SESSION_TTL: "-5"}
    )
    assert env.bootstrap_timeout == 120
    assert env.failed_session_ttl == 0


@pytest.mark.parametrize("word", ["true", "1", "yes", "y", "TRUE", "Y"])
def test_true_spellings(word: str) -> None:
    assert parse_bool(word) is True


@pytest.mark.parametrize("word", ["false", "0", "no", "n", "No"])
def test_false_spellings(word: str) -> None:
    assert parse_bool(word) is False


def test_bad_boolean() -> None:
    with pytest.raises(ValueError, match="boolean"):
        parse_bool("on")


def test_thread_pool_smaller_than_queue_is_the_exact_config_error() -> None:
    with pytest.raises(ConfigError) as err:
        parse_pd_env({ENV_THREAD_POOL_SIZE: "2", ENV_QUEUE_SIZE: "3"})
    assert str(err.value) == (
        "TOKENSPEED_DISAGGREGATION_THREAD_POOL_SIZE=2 must be greater than or equal to "
        "TOKENSPEED_DISAGGREGATION_QUEUE_SIZE=3."
    )
    # A Decode uses neither; -1 is TokenSpeed's "unset".
    assert parse_pd_env({ENV_THREAD_POOL_SIZE: "2", ENV_QUEUE_SIZE: "3"}, prefill=False)
    assert parse_pd_env({ENV_THREAD_POOL_SIZE: "-1"}).thread_pool_size is None


@given(st.dictionaries(st.sampled_from([ENV_BOOTSTRAP_TIMEOUT, ENV_QUEUE_SIZE]), st.text()))
def test_any_value_parses_or_is_a_config_error(environ: dict[str, str]) -> None:
    message = ""
    try:
        parse_pd_env(environ)
    except ConfigError as err:
        message = str(err)
    assert not message or any(name in message for name in environ)


# --- the configurations


def test_explicit_fields_win_over_the_environment() -> None:
    environ = {ENV_BOOTSTRAP_TIMEOUT: "30", ENV_QUEUE_SIZE: "3"}
    cfg = PrefillConfig.from_env(environ, tp_size=1, tp_rank=0, contract=CONTRACT, arena_base=1)
    assert (cfg.bootstrap_timeout, cfg.transfer_workers) == (30.0, 3)
    cfg = PrefillConfig.from_env(
        environ, tp_size=1, tp_rank=0, contract=CONTRACT, arena_base=1, bootstrap_timeout=5.0
    )
    assert cfg.bootstrap_timeout == 5.0


def test_an_invalid_variable_fails_the_configuration() -> None:
    with pytest.raises(ConfigError, match=ENV_WAITING_TIMEOUT):
        DecodeConfig.from_env(
            {ENV_WAITING_TIMEOUT: "ten"},
            tp_size=1,
            tp_rank=0,
            contract=CONTRACT,
            arena_base=1,
            session_id="s",
            endpoint="127.0.0.1",
            port=1,
        )


def _topology(cp_size: int = 1, tp_size: int = 2, tp_rank: int = 1) -> ParallelTopology:
    return ParallelTopology(tp_size, tp_rank, cp_size, 0, 1, 0, tp_size * cp_size, tp_rank)


def test_context_parallelism_is_refused_by_both_peers() -> None:
    message = "CachePD does not support context parallelism: cp_size=2; cp_size must be 1"
    with pytest.raises(ConfigError) as err:
        PrefillConfig(2, 1, CONTRACT, 1, topology=_topology(cp_size=2))
    assert str(err.value) == message
    with pytest.raises(ConfigError) as err:
        DecodeConfig(2, 1, CONTRACT, 1, "s", "127.0.0.1", 1, topology=_topology(cp_size=2))
    assert str(err.value) == message
    assert PrefillConfig(2, 1, CONTRACT, 1, topology=_topology()).topology is not None


def test_a_topology_that_disagrees_with_the_rank_is_refused() -> None:
    with pytest.raises(ConfigError, match="tp_size=2 tp_rank=1, but the peer is configured"):
        PrefillConfig(2, 0, CONTRACT, 1, topology=_topology())


# --- every variable changes behaviour


def test_bootstrap_timeout_variable_fails_requests_sooner(pairs: list[CorePair]) -> None:
    pair = _pair(pairs, {ENV_BOOTSTRAP_TIMEOUT: "7"})
    pair.register_decode("a", 1)
    pair.register_prefill("a", 1)
    pair.now = 6.9
    assert pair.poll_prefill() == []
    pair.now = 7.0
    assert pair.poll_prefill() == [
        Failed("a", "Request 1 timed out after 7.0s in TransferPoll.Bootstrapping")
    ]


def test_waiting_timeout_variable_fails_waits_sooner(pairs: list[CorePair]) -> None:
    pair = _pair(pairs, {ENV_WAITING_TIMEOUT: "9"})
    pair.register_decode("a", 1)
    assert pair.poll_decode() == [Bootstrapped("a")]
    pair.preallocate(1, PROMPT)
    pair.now = 9.0
    assert pair.poll_decode() == [
        Failed("a", "Request 1 timed out after 9.0s in TransferPoll.WaitingForInput")
    ]


def _fail_a_write(pair: CorePair) -> None:
    pair.write_errors[CorePair.decode_session(0)] = "connection reset"
    pair.full_journey("a", 1, PROMPT)
    del pair.write_errors[CorePair.decode_session(0)]


@pytest.mark.parametrize(("ttl", "alive_after_5s"), [("0", True), ("10", False)])
def test_failed_session_ttl_variable(pairs: list[CorePair], ttl: str, alive_after_5s: bool) -> None:
    pair = _pair(pairs, {ENV_FAILED_SESSION_TTL: ttl})
    _fail_a_write(pair)
    pair.advance(5.0)
    assert pair.prefill[0].session_alive(CorePair.decode_session(0), pair.now) is alive_after_5s


@pytest.mark.parametrize("failures", [1, 3])
def test_heartbeat_max_failure_variable(pairs: list[CorePair], failures: int) -> None:
    pair = _pair(pairs, {ENV_HEARTBEAT_MAX_FAILURE: str(failures)})
    core = pair.decode[0]
    pair.register_decode("a", 1)
    pair.poll_decode()
    for _ in range(failures - 1):
        core.heartbeat(ADDR, False, pair.now)
    assert core.room_state(1) is RoomState.BOOTSTRAPPED
    core.heartbeat(ADDR, False, pair.now)
    assert core.room_state(1) is RoomState.FAILED


def test_failure_probability_variable_fails_every_request_on_both_sides(
    pairs: list[CorePair],
) -> None:
    pair = _pair(pairs, {ENV_TEST_FAILURE_PROB: "1"})
    pair.register_decode("a", 1)
    pair.register_prefill("a", 1)
    (prefill_failed,) = pair.poll_prefill()
    assert isinstance(prefill_failed, Failed)
    assert "fault injection (DISAGGREGATION_TEST_FAILURE_PROB=1.0)" in prefill_failed.reason
    (decode_failed,) = pair.poll_decode()
    assert isinstance(decode_failed, Failed)
    assert "fault injection" in decode_failed.reason
    assert {f.reason_class for _, _, f in pair.failures} == {"injected"}
    assert pair.room_tables_empty()


def test_failure_probability_zero_injects_nothing(pairs: list[CorePair]) -> None:
    pair = _pair(pairs, {ENV_TEST_FAILURE_PROB: "0"})
    prefill_events, decode_events = pair.full_journey("a", 1, PROMPT)
    assert not any(isinstance(e, Failed) for e in [*prefill_events, *decode_events])


@pytest.mark.parametrize("debug", ["true", "false"])
def test_layerwise_debug_variable_logs_every_armed_chunk(pairs: list[CorePair], debug: str) -> None:
    contracts = [multi_layer_contract(layers=3, num_pages=8, heads=2, head_dim=4)]
    schedule = ProducerSchedule.from_contract(contracts[0], 3)
    pair = CorePair(contracts, contracts, layerwise=schedule, environ={ENV_LAYERWISE_DEBUG: debug})
    pairs.append(pair)
    pair.register_decode("r", 5)
    pair.register_prefill("r", 5)
    pair.poll_decode()
    pair.preallocate(5, 12)
    pair.poll_prefill()
    pair.prefill_tables(5, 12)
    pair.prefill[0].arm_layerwise([ExtendRow("r", 0, 12, pair.tables_of(5, 0))], pair.now)
    pair.pump()
    assert any(isinstance(c, StartTransfer) for _, c in pair.transfers)
    lines = [
        log.message
        for side, _, log in pair.logs
        if side == "prefill"
        and isinstance(log, Log)
        and "[cache_layerwise_transfer]" in log.message
    ]
    assert len(lines) == (1 if debug == "true" else 0)
    if lines:
        assert lines[0].startswith("[cache_layerwise_transfer] room=5 wait_cache_steps=[")
