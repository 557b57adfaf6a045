"""KVEventsConfig parsing, endpoint offsets and bind rules, the publisher registry."""

from __future__ import annotations

import json

import pytest

from tspd.core.errors import ConfigError
from tspd.core.kv_config import (
    KVEventsConfig,
    PublisherRegistry,
    bind_address,
    check_endpoint,
    is_enabled,
    offset_endpoint_port,
    parse_kv_events_config,
    pub_binds,
)


def test_no_config_means_not_configured() -> None:
    assert parse_kv_events_config(None) is None
    assert parse_kv_events_config("  ") is None
    assert not is_enabled(None)


def test_defaults_follow_tokenspeed() -> None:
    config = parse_kv_events_config("{}")
    assert config == KVEventsConfig()
    assert config is not None
    assert (config.endpoint, config.buffer_steps, config.hwm, config.max_queue_size) == (
        "tcp://*:5557",
        10_000,
        100_000,
        100_000,
    )
    assert config.replay_endpoint is None
    assert config.topic == ""
    assert not is_enabled(config)
    assert config.kind == "null"


def test_full_config_and_json_round_trip() -> None:
    text = json.dumps(
        {
            "publisher": "zmq",
            "endpoint": "tcp://*:6000",
            "replay_endpoint": "tcp://*:6100",
            "buffer_steps": 5,
            "hwm": 7,
            "max_queue_size": 9,
            "topic": "kv@pod",
            "enable_kv_cache_events": True,
        }
    )
    config = parse_kv_events_config(text)
    assert config is not None
    assert is_enabled(config)
    assert config.kind == "zmq"
    assert config.replay_endpoint == "tcp://*:6100"
    assert (config.buffer_steps, config.hwm, config.max_queue_size) == (5, 7, 9)
    assert parse_kv_events_config(config.to_json()) == config


def test_kind_defaults_to_zmq_when_enabled_and_null_stays_null() -> None:
    assert KVEventsConfig(enable_kv_cache_events=True).kind == "zmq"
    assert KVEventsConfig(enable_kv_cache_events=True, publisher="null").kind == "null"


def test_unknown_keys_are_kept_for_a_warning() -> None:
    config = parse_kv_events_config('{"buffer_step": 3, "enable_kv_cache_events": true}')
    assert config is not None
    assert config.unknown_keys == ("buffer_step",)
    assert config.buffer_steps == 10_000


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1]", "must be a JSON object, got list"),
        ('{"buffer_steps": -1}', "'buffer_steps' must be a non-negative integer, got -1"),
        ('{"hwm": "many"}', "'hwm' must be a non-negative integer"),
        ('{"max_queue_size": true}', "'max_queue_size' must be a non-negative integer"),
        ('{"endpoint": null}', "'endpoint' must be a string"),
        ('{"replay_endpoint": 5}', "'replay_endpoint' must be a string or null"),
        ('{"enable_kv_cache_events": "yes"}', "must be true or false"),
    ],
)
def test_invalid_configs_raise_config_error(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_kv_events_config(text)


@pytest.mark.parametrize(
    ("endpoint", "rank", "expected"),
    [
        ("tcp://*:5557", 0, "tcp://*:5557"),
        ("tcp://*:5557", 2, "tcp://*:5559"),
        ("tcp://127.0.0.1:5557", 3, "tcp://127.0.0.1:5560"),
        ("tcp://[::1]:5557", 1, "tcp://[::1]:5558"),
        ("", 4, ""),
        ("ipc:///tmp/kv", 0, "ipc:///tmp/kv"),
        ("tcp://host", 0, "tcp://host"),
    ],
)
def test_dp_rank_moves_the_tcp_port(endpoint: str, rank: int, expected: str) -> None:
    assert offset_endpoint_port(endpoint, rank) == expected


@pytest.mark.parametrize(
    ("endpoint", "rank", "message"),
    [
        ("ipc:///tmp/kv", 1, "unsupported endpoint ipc:///tmp/kv for DP rank 1"),
        ("inproc://kv", 1, "unsupported endpoint inproc://kv"),
        ("tcp://*:port", 1, "is not a number"),
        ("tcp://*:65535", 1, "leaves the TCP port range"),
        ("tcp://*:5557", -1, "must be non-negative"),
        # No port to move: TokenSpeed's int() of "//host" fails, the Rust seed's parse too.
        ("tcp://host", 1, r"endpoint tcp://host has no port, so it cannot be moved for DP rank 1"),
        ("tcp://[::1]", 2, r"endpoint tcp://\[::1\] has no port"),
    ],
)
def test_bad_offsets_raise_config_error(endpoint: str, rank: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        offset_endpoint_port(endpoint, rank)


def test_bind_or_connect_rules() -> None:
    assert pub_binds("tcp://*:5557")
    assert pub_binds("tcp://[::]:5557")
    assert pub_binds("ipc:///tmp/kv")
    assert not pub_binds("tcp://127.0.0.1:5557")
    assert not pub_binds("tcp://proxy.local:5557")
    assert bind_address("tcp://*:5557") == "tcp://0.0.0.0:5557"
    assert bind_address("tcp://127.0.0.1:5557") == "tcp://127.0.0.1:5557"


def test_unsupported_endpoints_are_refused_with_advice() -> None:
    check_endpoint("tcp://127.0.0.1:1")
    check_endpoint("ipc:///tmp/x")
    with pytest.raises(ConfigError, match=r"inproc:// is private"):
        check_endpoint("inproc://kv")
    with pytest.raises(ConfigError, match=r"unsupported endpoint udp://x:1"):
        check_endpoint("udp://x:1")


def test_registry_names_and_errors_are_tokenspeeds() -> None:
    registry: PublisherRegistry[type[object]] = PublisherRegistry()
    registry.register("zmq", object)
    assert registry.get("zmq") is object
    assert "zmq" in registry
    assert registry.names() == ("zmq",)
    with pytest.raises(ConfigError, match=r"^publisher 'zmq' already registered$"):
        registry.register("zmq", object)
    with pytest.raises(ConfigError, match=r"^Unknown event publisher 'kafka'$"):
        registry.get("kafka")
