"""KV-event publisher configuration: TokenSpeed's ``--kv-events-config`` and endpoint rules.

The configuration is a JSON object (docs/protocol.md#proto-kv-config) with the fields of
:class:`KVEventsConfig`; unknown keys are ignored the way TokenSpeed's pydantic
model ignores them, but they are reported in :attr:`KVEventsConfig.unknown_keys` so
the shell can warn about a misspelt field.

Endpoint rules (docs/protocol.md#proto-kv-endpoints, R-ev where the sources differ):

* a DP rank other than 0 moves a ``tcp`` endpoint's port by the rank; any other
  endpoint with a non-zero rank is refused (a second rank on the same IPC path
  would collide);
* the PUB socket **binds** when the endpoint is a wildcard (``*`` or ``::``) or an
  ``ipc://`` path, and **connects** otherwise (so a proxy can own a stable
  address); ``*`` means every interface (``0.0.0.0``);
* the replay ROUTER always binds;
* ``inproc://`` endpoints are refused: the publisher owns its own ZMQ context, so
  no peer could ever reach one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, Generic, TypeVar

from tspd.core.errors import ConfigError

__all__ = [
    "KVEventsConfig",
    "PublisherRegistry",
    "bind_address",
    "check_endpoint",
    "is_enabled",
    "offset_endpoint_port",
    "parse_kv_events_config",
    "pub_binds",
]

_DEFAULTS: Final[dict[str, Any]] = {
    "publisher": None,
    "endpoint": "tcp://*:5557",
    "replay_endpoint": None,
    "buffer_steps": 10_000,
    "hwm": 100_000,
    "max_queue_size": 100_000,
    "topic": "",
    "enable_kv_cache_events": False,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class KVEventsConfig:
    """TokenSpeed's ``KVEventsConfig``: where and how a rank publishes its KV events.

    ``publisher`` is the registered kind (``None`` means ``"zmq"``); ``hwm`` is the
    PUB socket's high-water mark; ``max_queue_size`` bounds the batches waiting
    between the caller and the socket task; ``buffer_steps`` is how many batches the
    replay socket can resend.
    """

    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    enable_kv_cache_events: bool = False
    unknown_keys: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(
                    f"KV events config field {name!r} must be a non-negative integer, got {value!r}"
                )
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(
                    f"KV events config field {name!r} must be a string, got {getattr(self, name)!r}"
                )
        for name in ("publisher", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ConfigError(
                    f"KV events config field {name!r} must be a string or null, got {value!r}"
                )
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ConfigError(
                "KV events config field 'enable_kv_cache_events' must be true or false, "
                f"got {self.enable_kv_cache_events!r}"
            )

    @property
    def kind(self) -> str:
        """The publisher kind to construct: ``"null"`` when disabled, else the named one."""
        if not self.enable_kv_cache_events:
            return "null"
        return self.publisher if self.publisher is not None else "zmq"

    def to_json(self) -> str:
        """The configuration as the JSON string TokenSpeed's ``--kv-events-config`` takes."""
        return json.dumps({name: getattr(self, name) for name in _DEFAULTS})


def parse_kv_events_config(text: str | None) -> KVEventsConfig | None:
    """Parse ``--kv-events-config``; ``None`` or an empty string means "not configured".

    Raises :class:`ConfigError` naming the field and the expected type.
    """
    if text is None or not text.strip():
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"--kv-events-config is not valid JSON ({exc.msg} at line {exc.lineno} "
            f"column {exc.colno}); pass a JSON object such as "
            '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}\''
        ) from None
    if not isinstance(obj, dict):
        raise ConfigError(f"--kv-events-config must be a JSON object, got {type(obj).__name__}")
    known = {k: v for k, v in obj.items() if k in _DEFAULTS}
    unknown = tuple(sorted(k for k in obj if k not in _DEFAULTS))
    return KVEventsConfig(**known, unknown_keys=unknown)


def is_enabled(config: KVEventsConfig | None) -> bool:
    """Whether events are published at all (config present and the switch on)."""
    return config is not None and config.enable_kv_cache_events


def check_endpoint(endpoint: str) -> None:
    """Refuse endpoints a publisher cannot serve, with what to use instead."""
    if endpoint.startswith("inproc://"):
        raise ConfigError(
            f"KV event publisher: unsupported endpoint {endpoint}: inproc:// is private "
            "to one ZMQ context; use tcp://host:port or ipc://path"
        )
    if not (endpoint.startswith("tcp://") or endpoint.startswith("ipc://")):
        raise ConfigError(
            f"KV event publisher: unsupported endpoint {endpoint}: "
            "use tcp://host:port or ipc://path"
        )


def offset_endpoint_port(endpoint: str, dp_rank: int) -> str:
    """The endpoint for attention-DP rank ``dp_rank``: its TCP port moved by the rank.

    ``tcp://*:5557`` for rank 2 is ``tcp://*:5559``. Rank 0 and the empty endpoint
    are unchanged. A ``tcp://`` endpoint without a port (``tcp://host``) cannot be
    moved: for a rank above 0 it is a :class:`ConfigError`, as in TokenSpeed (whose
    port parse fails) and the Rust seed.
    """
    if dp_rank < 0:
        raise ConfigError(f"KV event publisher: DP rank must be non-negative, got {dp_rank}")
    if dp_rank == 0 or not endpoint:
        return endpoint
    if "tcp" not in endpoint:
        raise ConfigError(
            f"KV event publisher: unsupported endpoint {endpoint} for DP rank {dp_rank}: "
            "only tcp:// endpoints can be offset per rank; give each rank its own address"
        )
    base, sep, port = endpoint.rpartition(":")
    if not sep:
        return endpoint
    if "/" in port or port.endswith("]"):
        # The last ':' is the scheme's (tcp://host) or inside an IPv6 host (tcp://[::1]).
        raise ConfigError(
            f"KV event publisher: endpoint {endpoint} has no port, so it cannot be moved "
            f"for DP rank {dp_rank}: give it one (e.g. {endpoint}:5557); DP rank r then "
            "uses that port + r"
        )
    try:
        number = int(port)
    except ValueError:
        raise ConfigError(
            f"KV event publisher: unsupported endpoint {endpoint}: the port {port!r} "
            "is not a number"
        ) from None
    if not 0 < number + dp_rank < 65536:
        raise ConfigError(
            f"KV event publisher: endpoint {endpoint} moved by DP rank {dp_rank} "
            f"leaves the TCP port range (port {number + dp_rank})"
        )
    return f"{base}:{number + dp_rank}"


def pub_binds(endpoint: str) -> bool:
    """Whether the PUB socket binds (wildcard or IPC) rather than connects."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith("ipc://")


def bind_address(endpoint: str) -> str:
    """The address to bind: ``*`` as a host means every interface."""
    return endpoint.replace("://*:", "://0.0.0.0:")


F = TypeVar("F", bound=Callable[..., Any])


class PublisherRegistry(Generic[F]):
    """Publisher kinds by name (TokenSpeed's ``EventPublisherFactory`` registry).

    The core keeps the names; the shell registers the factories (``"zmq"``,
    ``"null"``), and embedders may add their own kinds.
    """

    __slots__ = ("_kinds",)

    def __init__(self) -> None:
        self._kinds: dict[str, F] = {}

    def register(self, name: str, factory: F) -> None:
        """Add a kind; a name may be registered once."""
        if name in self._kinds:
            raise ConfigError(f"publisher '{name}' already registered")
        self._kinds[name] = factory

    def get(self, name: str) -> F:
        """The factory of ``name``; an unknown kind is a configuration error."""
        try:
            return self._kinds[name]
        except KeyError:
            raise ConfigError(f"Unknown event publisher '{name}'") from None

    def names(self) -> tuple[str, ...]:
        """Every registered kind, sorted."""
        return tuple(sorted(self._kinds))

    def __contains__(self, name: object) -> bool:
        return name in self._kinds
