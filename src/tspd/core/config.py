"""Typed configuration of the Prefill and Decode peers, and TokenSpeed's environment.

:func:`parse_pd_env` reads every TokenSpeed variable of spec §7.8 with its default,
floor and clamp. Parsing follows S1: an unset variable takes its default; a value
that does not parse is *not* an error but a warning and the default (an empty
value counts as unset). Booleans accept ``true/1/yes/y`` and ``false/0/no/n`` in
any case. The core never logs: warnings come back as data (``.warnings``) for the
shell to log. The one hard error is TokenSpeed's thread-pool check, raised as
:class:`ConfigError` with its exact message.

:class:`PrefillConfig` and :class:`DecodeConfig` combine those values with what the
embedding engine knows (host, TP size and rank, …); ``from_env(environ, ...)``
builds one from an environment mapping plus those keyword fields.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Self, TypeVar

from tspd.core.errors import ConfigError

__all__ = [
    "DEFAULT_BOOTSTRAP_PORT",
    "ENV_BOOTSTRAP_TIMEOUT",
    "ENV_FAILED_SESSION_TTL",
    "ENV_HEARTBEAT_INTERVAL",
    "ENV_HEARTBEAT_MAX_FAILURE",
    "ENV_LAYERWISE_DEBUG",
    "ENV_METADATA_TIMEOUT",
    "ENV_QUEUE_SIZE",
    "ENV_TEST_FAILURE_PROB",
    "ENV_THREAD_POOL_SIZE",
    "ENV_WAITING_TIMEOUT",
    "MAX_CACHE_TP_SIZE",
    "DecodeConfig",
    "PDEnv",
    "PrefillConfig",
    "default_thread_pool_size",
    "parse_bool",
    "parse_pd_env",
]

ENV_BOOTSTRAP_TIMEOUT: Final = "TOKENSPEED_DISAGGREGATION_BOOTSTRAP_TIMEOUT"
ENV_WAITING_TIMEOUT: Final = "TOKENSPEED_DISAGGREGATION_WAITING_TIMEOUT"
ENV_FAILED_SESSION_TTL: Final = "TOKENSPEED_DISAGGREGATION_FAILED_SESSION_TTL"
ENV_HEARTBEAT_INTERVAL: Final = "TOKENSPEED_DISAGGREGATION_HEARTBEAT_INTERVAL"
ENV_HEARTBEAT_MAX_FAILURE: Final = "TOKENSPEED_DISAGGREGATION_HEARTBEAT_MAX_FAILURE"
ENV_QUEUE_SIZE: Final = "TOKENSPEED_DISAGGREGATION_QUEUE_SIZE"
ENV_THREAD_POOL_SIZE: Final = "TOKENSPEED_DISAGGREGATION_THREAD_POOL_SIZE"
ENV_METADATA_TIMEOUT: Final = "TOKENSPEED_PD_PREFILL_METADATA_TIMEOUT"
ENV_LAYERWISE_DEBUG: Final = "TOKENSPEED_PD_LAYERWISE_DEBUG"
ENV_TEST_FAILURE_PROB: Final = "DISAGGREGATION_TEST_FAILURE_PROB"
ENV_HOST_IP: Final = ("TOKENSPEED_HOST_IP", "HOST_IP")

DEFAULT_BOOTSTRAP_PORT: Final = 8998
"""``--disaggregation-bootstrap-port`` default."""

MAX_CACHE_TP_SIZE: Final = 1024
"""Largest TP size either side may have (spec §1.3)."""

_TRUE: Final = frozenset({"true", "1", "yes", "y"})
_FALSE: Final = frozenset({"false", "0", "no", "n"})

_T = TypeVar("_T")
_N = TypeVar("_N", int, float)


def parse_bool(text: str) -> bool:
    """TokenSpeed's boolean spelling; raises :class:`ValueError` for anything else."""
    word = text.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"not a finite number: {text!r}")
    return value


def default_thread_pool_size(cpu_count: int) -> int:
    """TokenSpeed's thread-pool size when the variable is unset:
    ``min(max(4, int(0.75 * cpu_count) // 8), 12)``."""
    return min(max(4, int(0.75 * cpu_count) // 8), 12)


class _Reader:
    """Reads variables from one mapping, collecting warnings."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self.environ = environ
        self.warnings: list[str] = []

    def get(self, name: str, parse: Callable[[str], _T], default: _T, kind: str) -> _T:
        raw = self.environ.get(name)
        if raw is None or not raw.strip():
            return default
        try:
            return parse(raw)
        except ValueError:
            self.warnings.append(
                f"{name}={raw!r} is not a valid {kind}; using the default {default!r}"
            )
            return default

    def floored(self, name: str, value: _N, floor: _N) -> _N:
        if value < floor:
            self.warnings.append(f"{name}={value!r} is below its minimum; using {floor!r}")
            return floor
        return value


@dataclass(frozen=True, slots=True, kw_only=True)
class PDEnv:
    """TokenSpeed's PD environment variables after defaults, floors and clamps
    (spec §7.8). ``warnings`` says which values were unusable or adjusted."""

    bootstrap_timeout: int = 120
    waiting_timeout: int = 300
    failed_session_ttl: int = 30
    heartbeat_interval: float = 5.0
    heartbeat_max_failures: int = 2
    queue_size: int = 4
    thread_pool_size: int = 4
    metadata_log_interval: float = 5.0
    layerwise_debug: bool = False
    test_failure_prob: float = 0.0
    host_ip: str = ""
    warnings: tuple[str, ...] = dataclasses.field(default=(), compare=False)


def parse_pd_env(
    environ: Mapping[str, str], *, cpu_count: int | None = None, prefill: bool = True
) -> PDEnv:
    """Read §7.8's variables from ``environ``.

    ``cpu_count`` sizes the default thread pool (the host's count when omitted).
    With ``prefill`` (the default) raises :class:`ConfigError` when the thread pool
    is smaller than the queue size (TokenSpeed's ``ValueError``, same text) or the
    queue size is below 1; a Decode (``prefill=False``) does not use those two.
    """
    r = _Reader(environ)
    bootstrap_timeout = r.get(ENV_BOOTSTRAP_TIMEOUT, int, 120, "integer")
    waiting_timeout = r.get(ENV_WAITING_TIMEOUT, int, 300, "integer")
    ttl = r.get(ENV_FAILED_SESSION_TTL, int, 30, "integer")
    if ttl < 0:
        r.warnings.append(f"{ENV_FAILED_SESSION_TTL}={ttl} is negative; using 0 (disabled)")
        ttl = 0
    heartbeat = r.floored(
        ENV_HEARTBEAT_INTERVAL, r.get(ENV_HEARTBEAT_INTERVAL, _parse_float, 5.0, "number"), 2.0
    )
    max_failures = r.floored(
        ENV_HEARTBEAT_MAX_FAILURE, r.get(ENV_HEARTBEAT_MAX_FAILURE, int, 2, "integer"), 1
    )
    queue_size = r.get(ENV_QUEUE_SIZE, int, 4, "integer")
    if prefill and queue_size < 1:
        raise ConfigError(
            f"{ENV_QUEUE_SIZE}={queue_size} must be at least 1: it is the number of "
            "transfer workers"
        )
    pool = r.get(ENV_THREAD_POOL_SIZE, int, -1, "integer")
    if pool == -1:
        cpus = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
        pool = default_thread_pool_size(cpus)
    if prefill and pool < queue_size:
        raise ConfigError(
            f"{ENV_THREAD_POOL_SIZE}={pool} must be greater than or equal to "
            f"{ENV_QUEUE_SIZE}={queue_size}."
        )
    metadata = r.floored(
        ENV_METADATA_TIMEOUT, r.get(ENV_METADATA_TIMEOUT, _parse_float, 5.0, "number"), 0.01
    )
    debug = r.get(ENV_LAYERWISE_DEBUG, parse_bool, False, "boolean")
    prob = r.get(ENV_TEST_FAILURE_PROB, _parse_float, 0.0, "number")
    host_ip = next((environ[n] for n in ENV_HOST_IP if environ.get(n)), "")
    return PDEnv(
        bootstrap_timeout=bootstrap_timeout,
        waiting_timeout=waiting_timeout,
        failed_session_ttl=ttl,
        heartbeat_interval=heartbeat,
        heartbeat_max_failures=max_failures,
        queue_size=queue_size,
        thread_pool_size=pool,
        metadata_log_interval=metadata,
        layerwise_debug=debug,
        test_failure_prob=prob,
        host_ip=host_ip,
        warnings=tuple(r.warnings),
    )


def _check_topology(tp_size: int, tp_rank: int) -> None:
    if not 0 < tp_size <= MAX_CACHE_TP_SIZE:
        raise ConfigError(f"tp_size must be in [1, {MAX_CACHE_TP_SIZE}], got {tp_size}")
    if not 0 <= tp_rank < tp_size:
        raise ConfigError(f"tp_rank must be in [0, {tp_size}), got {tp_rank}")


def _check_common(host: str, transfer_backend: str, failure_prob: float) -> None:
    if not host:
        raise ConfigError("host must name this rank's address (e.g. '127.0.0.1'), got ''")
    if transfer_backend != "mooncake":
        raise ConfigError("CachePD supports only the Mooncake backend")
    if not 0.0 <= failure_prob <= 1.0:
        raise ConfigError(f"{ENV_TEST_FAILURE_PROB} must be in [0, 1], got {failure_prob}")


def _from_env(cls: type[Any], env: PDEnv, fields: Mapping[str, Any]) -> Any:
    """Build ``cls`` from the env values it has fields for, overridden by ``fields``."""
    names = {f.name for f in dataclasses.fields(cls)}
    values = {
        f.name: getattr(env, f.name)
        for f in dataclasses.fields(env)
        if f.name in names and f.name != "warnings"
    }
    values.update(fields)
    values.setdefault("warnings", env.warnings)
    return cls(**values)


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefillConfig:
    """What one Prefill rank's peer needs.

    ``status_rank`` is this rank in Decode's completion-tracking rank space
    (``pp_rank * tp_size + tp_rank``; ``tp_rank`` when omitted). ``queue_size`` is
    the number of transfer workers; ``layerwise_interval`` ≤ 0 selects the
    non-layerwise path. ``metadata_log_interval`` is what TokenSpeed calls the
    "prefill metadata timeout" (only a debug-log interval).
    """

    host: str
    tp_size: int
    tp_rank: int
    status_rank: int = -1
    dp_size: int = 1
    dp_rank: int = 0
    bootstrap_host: str = "127.0.0.1"
    bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT
    bootstrap_timeout: int = 120
    failed_session_ttl: int = 30
    queue_size: int = 4
    thread_pool_size: int = 4
    metadata_log_interval: float = 5.0
    layerwise_interval: int = 1
    layerwise_debug: bool = False
    test_failure_prob: float = 0.0
    host_ip: str = ""
    transfer_backend: str = "mooncake"
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    ib_device: str = ""
    warnings: tuple[str, ...] = dataclasses.field(default=(), compare=False)

    def __post_init__(self) -> None:
        _check_topology(self.tp_size, self.tp_rank)
        _check_common(self.host, self.transfer_backend, self.test_failure_prob)
        if self.status_rank == -1:
            object.__setattr__(self, "status_rank", self.tp_rank)
        if self.status_rank < 0:
            raise ConfigError(f"status_rank must be >= 0, got {self.status_rank}")
        if self.dp_size < 1 or not 0 <= self.dp_rank < self.dp_size:
            raise ConfigError(
                f"dp_rank must be in [0, dp_size) with dp_size >= 1, got dp_rank="
                f"{self.dp_rank} dp_size={self.dp_size}"
            )
        if not 0 < self.bootstrap_port < 65536:
            raise ConfigError(f"bootstrap_port must be in [1, 65535], got {self.bootstrap_port}")
        if self.queue_size < 1 or self.thread_pool_size < self.queue_size:
            raise ConfigError(
                f"{ENV_THREAD_POOL_SIZE}={self.thread_pool_size} must be greater than or "
                f"equal to {ENV_QUEUE_SIZE}={self.queue_size}."
            )

    @property
    def layerwise(self) -> bool:
        """Whether layerwise streaming is on (interval > 0)."""
        return self.layerwise_interval > 0

    @property
    def failed_session_fast_fail(self) -> bool:
        """Whether failed sessions are remembered (TTL > 0)."""
        return self.failed_session_ttl > 0

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str], *, cpu_count: int | None = None, **fields: Any
    ) -> Self:
        """A config from TokenSpeed's variables in ``environ`` plus ``fields``
        (``host``, ``tp_size``, ``tp_rank`` at least); explicit fields win."""
        env = parse_pd_env(environ, cpu_count=cpu_count)
        config: Self = _from_env(cls, env, fields)
        return config


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodeConfig:
    """What one Decode rank's peer needs.

    ``heartbeat_interval`` and ``heartbeat_max_failures`` drive the Prefill
    liveness checks (§7.9.3); ``waiting_timeout`` bounds ``WaitingForInput``.
    """

    host: str
    tp_size: int
    tp_rank: int
    dp_size: int = 1
    dp_rank: int = 0
    waiting_timeout: int = 300
    heartbeat_interval: float = 5.0
    heartbeat_max_failures: int = 2
    bootstrap_get_timeout: float = 5.0
    test_failure_prob: float = 0.0
    transfer_backend: str = "mooncake"
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    ib_device: str = ""
    warnings: tuple[str, ...] = dataclasses.field(default=(), compare=False)

    def __post_init__(self) -> None:
        _check_topology(self.tp_size, self.tp_rank)
        _check_common(self.host, self.transfer_backend, self.test_failure_prob)
        if self.dp_size < 1 or not 0 <= self.dp_rank < self.dp_size:
            raise ConfigError(
                f"dp_rank must be in [0, dp_size) with dp_size >= 1, got dp_rank="
                f"{self.dp_rank} dp_size={self.dp_size}"
            )
        if self.heartbeat_interval <= 0 or self.heartbeat_max_failures < 1:
            raise ConfigError(
                "heartbeat_interval must be positive and heartbeat_max_failures at least 1, "
                f"got {self.heartbeat_interval} and {self.heartbeat_max_failures}"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str], **fields: Any) -> Self:
        """A config from TokenSpeed's variables in ``environ`` plus ``fields``
        (``host``, ``tp_size``, ``tp_rank`` at least); explicit fields win."""
        env = parse_pd_env(environ, cpu_count=1, prefill=False)
        config: Self = _from_env(cls, env, fields)
        return config
