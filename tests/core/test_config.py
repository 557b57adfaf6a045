"""TokenSpeed's PD environment variables and the typed peer configs (spec §7.8)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tspd.core.config import (
    ENV_BOOTSTRAP_TIMEOUT,
    ENV_FAILED_SESSION_TTL,
    ENV_HEARTBEAT_INTERVAL,
    ENV_HEARTBEAT_MAX_FAILURE,
    ENV_LAYERWISE_DEBUG,
    ENV_METADATA_TIMEOUT,
    ENV_QUEUE_SIZE,
    ENV_TEST_FAILURE_PROB,
    ENV_THREAD_POOL_SIZE,
    ENV_WAITING_TIMEOUT,
    DecodeConfig,
    PDEnv,
    PrefillConfig,
    default_thread_pool_size,
    parse_bool,
    parse_pd_env,
)
from tspd.core.errors import ConfigError


def test_defaults_when_nothing_is_set() -> None:
    env = parse_pd_env({}, cpu_count=2)
    assert env == PDEnv(
        bootstrap_timeout=120,
        waiting_timeout=300,
        failed_session_ttl=30,
        heartbeat_interval=5.0,
        heartbeat_max_failures=2,
        queue_size=4,
        thread_pool_size=4,
        metadata_log_interval=5.0,
        layerwise_debug=False,
        test_failure_prob=0.0,
        host_ip="",
    )
    assert env.warnings == ()


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
            ENV_METADATA_TIMEOUT: "0.5",
            ENV_LAYERWISE_DEBUG: "Yes",
            ENV_TEST_FAILURE_PROB: "0.25",
            "HOST_IP": "10.1.1.1",
        }
    )
    assert (env.bootstrap_timeout, env.waiting_timeout, env.failed_session_ttl) == (7, 9, 0)
    assert (env.heartbeat_interval, env.heartbeat_max_failures) == (2.5, 5)
    assert (env.queue_size, env.thread_pool_size) == (2, 3)
    assert env.metadata_log_interval == 0.5
    assert env.layerwise_debug is True
    assert env.test_failure_prob == 0.25
    assert env.host_ip == "10.1.1.1"
    assert env.warnings == ()


def test_tokenspeed_host_ip_wins_over_host_ip() -> None:
    env = parse_pd_env({"TOKENSPEED_HOST_IP": "10.0.0.1", "HOST_IP": "10.0.0.2"})
    assert env.host_ip == "10.0.0.1"
    assert parse_pd_env({"TOKENSPEED_HOST_IP": "", "HOST_IP": "10.0.0.2"}).host_ip == "10.0.0.2"


@pytest.mark.parametrize(
    ("name", "raw", "attr", "default"),
    [
        (ENV_BOOTSTRAP_TIMEOUT, "12.5", "bootstrap_timeout", 120),
        (ENV_WAITING_TIMEOUT, "soon", "waiting_timeout", 300),
        (ENV_FAILED_SESSION_TTL, "x", "failed_session_ttl", 30),
        (ENV_HEARTBEAT_INTERVAL, "nan", "heartbeat_interval", 5.0),
        (ENV_HEARTBEAT_MAX_FAILURE, "two", "heartbeat_max_failures", 2),
        (ENV_METADATA_TIMEOUT, "inf", "metadata_log_interval", 5.0),
        (ENV_LAYERWISE_DEBUG, "maybe", "layerwise_debug", False),
        (ENV_TEST_FAILURE_PROB, "1/2", "test_failure_prob", 0.0),
        (ENV_QUEUE_SIZE, "many", "queue_size", 4),
    ],
)
def test_unparsable_values_warn_and_take_the_default(
    name: str, raw: str, attr: str, default: object
) -> None:
    env = parse_pd_env({name: raw}, cpu_count=2)
    assert getattr(env, attr) == default
    assert len(env.warnings) == 1
    assert name in env.warnings[0]
    assert repr(raw) in env.warnings[0]


def test_empty_values_count_as_unset() -> None:
    env = parse_pd_env({ENV_BOOTSTRAP_TIMEOUT: "", ENV_LAYERWISE_DEBUG: "  "})
    assert env.bootstrap_timeout == 120
    assert env.warnings == ()


def test_floors_and_clamps() -> None:
    env = parse_pd_env(
        {
            ENV_HEARTBEAT_INTERVAL: "0.5",
            ENV_HEARTBEAT_MAX_FAILURE: "0",
            ENV_METADATA_TIMEOUT: "0.001",
            ENV_FAILED_SESSION_TTL: "-5",
        }
    )
    assert env.heartbeat_interval == 2.0
    assert env.heartbeat_max_failures == 1
    assert env.metadata_log_interval == 0.01
    assert env.failed_session_ttl == 0
    assert len(env.warnings) == 4


@pytest.mark.parametrize("word", ["true", "1", "yes", "y", "TRUE", "Y"])
def test_true_spellings(word: str) -> None:
    assert parse_bool(word) is True


@pytest.mark.parametrize("word", ["false", "0", "no", "n", "No"])
def test_false_spellings(word: str) -> None:
    assert parse_bool(word) is False


def test_bad_boolean() -> None:
    with pytest.raises(ValueError, match="boolean"):
        parse_bool("on")


@pytest.mark.parametrize(
    ("cpus", "size"), [(1, 4), (8, 4), (48, 4), (64, 6), (128, 12), (1024, 12)]
)
def test_default_thread_pool_size(cpus: int, size: int) -> None:
    assert default_thread_pool_size(cpus) == size
    assert parse_pd_env({}, cpu_count=cpus).thread_pool_size == size


def test_thread_pool_smaller_than_queue_is_the_exact_config_error() -> None:
    with pytest.raises(ConfigError) as err:
        parse_pd_env({ENV_THREAD_POOL_SIZE: "2", ENV_QUEUE_SIZE: "3"})
    assert str(err.value) == (
        "TOKENSPEED_DISAGGREGATION_THREAD_POOL_SIZE=2 must be greater than or equal to "
        "TOKENSPEED_DISAGGREGATION_QUEUE_SIZE=3."
    )
    assert isinstance(err.value, ValueError)
    # The computed default is checked too.
    with pytest.raises(ConfigError, match="THREAD_POOL_SIZE=4 must be"):
        parse_pd_env({ENV_QUEUE_SIZE: "5"}, cpu_count=2)


def test_queue_size_below_one_is_refused() -> None:
    with pytest.raises(ConfigError, match="at least 1"):
        parse_pd_env({ENV_QUEUE_SIZE: "0"})


def test_prefill_config_from_env() -> None:
    cfg = PrefillConfig.from_env(
        {ENV_BOOTSTRAP_TIMEOUT: "30", ENV_QUEUE_SIZE: "bad"},
        cpu_count=2,
        host="127.0.0.1",
        tp_size=2,
        tp_rank=1,
        layerwise_interval=0,
    )
    assert cfg.bootstrap_timeout == 30
    assert cfg.queue_size == 4
    assert cfg.status_rank == 1
    assert not cfg.layerwise
    assert cfg.failed_session_fast_fail
    assert cfg.metadata_server == "P2PHANDSHAKE"
    assert len(cfg.warnings) == 1
    assert ENV_QUEUE_SIZE in cfg.warnings[0]


def test_explicit_fields_win_over_the_environment() -> None:
    cfg = PrefillConfig.from_env(
        {ENV_BOOTSTRAP_TIMEOUT: "30"},
        host="h",
        tp_size=1,
        tp_rank=0,
        bootstrap_timeout=5,
        status_rank=3,
    )
    assert cfg.bootstrap_timeout == 5
    assert cfg.status_rank == 3


def test_decode_config_from_env_ignores_prefill_only_checks() -> None:
    cfg = DecodeConfig.from_env(
        {
            ENV_WAITING_TIMEOUT: "60",
            ENV_HEARTBEAT_INTERVAL: "1",
            ENV_THREAD_POOL_SIZE: "1",
            ENV_QUEUE_SIZE: "8",
        },
        host="127.0.0.1",
        tp_size=4,
        tp_rank=3,
    )
    assert cfg.waiting_timeout == 60
    assert cfg.heartbeat_interval == 2.0
    assert cfg.heartbeat_max_failures == 2
    assert any(ENV_HEARTBEAT_INTERVAL in w for w in cfg.warnings)


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"tp_size": 0, "tp_rank": 0}, "tp_size"),
        ({"tp_size": 1025, "tp_rank": 0}, "tp_size"),
        ({"tp_size": 2, "tp_rank": 2}, "tp_rank"),
        ({"host": ""}, "host"),
        ({"transfer_backend": "nixl"}, "CachePD supports only the Mooncake backend"),
        ({"dp_size": 2, "dp_rank": 2}, "dp_rank"),
        ({"bootstrap_port": 0}, "bootstrap_port"),
        ({"status_rank": -2}, "status_rank"),
        ({"test_failure_prob": 1.5}, "DISAGGREGATION_TEST_FAILURE_PROB"),
        ({"queue_size": 8, "thread_pool_size": 4}, "must be greater than or equal"),
    ],
)
def test_prefill_config_validation(fields: dict[str, object], needle: str) -> None:
    base: dict[str, object] = {"host": "127.0.0.1", "tp_size": 2, "tp_rank": 0}
    base.update(fields)
    with pytest.raises(ConfigError, match=needle):
        PrefillConfig(**base)  # type: ignore[arg-type]


def test_decode_config_validation() -> None:
    with pytest.raises(ConfigError, match="heartbeat"):
        DecodeConfig(host="h", tp_size=1, tp_rank=0, heartbeat_max_failures=0)
    with pytest.raises(ConfigError, match="Mooncake"):
        DecodeConfig(host="h", tp_size=1, tp_rank=0, transfer_backend="nixl")


_NAMES = [
    ENV_BOOTSTRAP_TIMEOUT,
    ENV_WAITING_TIMEOUT,
    ENV_FAILED_SESSION_TTL,
    ENV_HEARTBEAT_INTERVAL,
    ENV_HEARTBEAT_MAX_FAILURE,
    ENV_METADATA_TIMEOUT,
    ENV_LAYERWISE_DEBUG,
    ENV_TEST_FAILURE_PROB,
]


@given(st.dictionaries(st.sampled_from(_NAMES), st.text(max_size=8)))
def test_any_values_parse_with_warnings_never_errors(environ: dict[str, str]) -> None:
    env = parse_pd_env(environ, cpu_count=4)
    assert env.heartbeat_interval >= 2.0
    assert env.heartbeat_max_failures >= 1
    assert env.metadata_log_interval >= 0.01
    assert env.failed_session_ttl >= 0
    assert len(env.warnings) <= len(environ) + 4
