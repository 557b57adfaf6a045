"""TokenSpeed's PD environment variables: the one place tspd reads them.

The peers take typed configurations (:class:`tspd.core.prefill.PrefillConfig`,
:class:`tspd.core.decode.DecodeConfig`, the shells' settings and
:class:`tspd.shell.offload.EngineRunner`); each has a ``from_env(environ, ...)``
constructor whose defaults come from :func:`parse_pd_env` and whose explicit
keyword arguments win. The core never reads ``os.environ`` itself: the caller
passes the mapping.

Parsing: an unset or empty variable takes its default. Unlike TokenSpeed, which
logs a warning and falls back to the default, a value that does not parse or is out
of range is a :class:`ConfigError` that names the variable, so a typo never runs
a cluster on settings nobody chose. Booleans accept ``true/1/yes/y`` and
``false/0/no/n`` in any case. A negative failed-session TTL means "disabled", as
in TokenSpeed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final, TypeVar

from tspd.core.errors import ConfigError
from tspd.core.topology import MAX_CACHE_TP_SIZE, ParallelTopology

__all__ = [
    "DEFAULT_BOOTSTRAP_PORT",
    "DEFAULT_STAGING_MIN_BYTES",
    "DEFAULT_STAGING_MIN_COPIES",
    "ENV_BOOTSTRAP_PROTECT_GET",
    "ENV_BOOTSTRAP_TIMEOUT",
    "ENV_BOOTSTRAP_TOKEN_FILE",
    "ENV_CURVE_ALLOW_DIR",
    "ENV_CURVE_SECRET_KEY_FILE",
    "ENV_FAILED_SESSION_TTL",
    "ENV_HEARTBEAT_INTERVAL",
    "ENV_HEARTBEAT_MAX_FAILURE",
    "ENV_LAYERWISE_DEBUG",
    "ENV_QUEUE_SIZE",
    "ENV_TEST_FAILURE_PROB",
    "ENV_THREAD_POOL_SIZE",
    "ENV_TLS_CA_FILE",
    "ENV_TLS_CERT_FILE",
    "ENV_TLS_KEY_FILE",
    "ENV_WAITING_TIMEOUT",
    "MAX_CACHE_TP_SIZE",
    "MIN_HEARTBEAT_INTERVAL",
    "PDEnv",
    "SecurityEnv",
    "check_rank_config",
    "check_staging",
    "parse_bool",
    "parse_pd_env",
    "parse_security_env",
]

ENV_BOOTSTRAP_TIMEOUT: Final = "TOKENSPEED_DISAGGREGATION_BOOTSTRAP_TIMEOUT"
ENV_WAITING_TIMEOUT: Final = "TOKENSPEED_DISAGGREGATION_WAITING_TIMEOUT"
ENV_FAILED_SESSION_TTL: Final = "TOKENSPEED_DISAGGREGATION_FAILED_SESSION_TTL"
ENV_HEARTBEAT_INTERVAL: Final = "TOKENSPEED_DISAGGREGATION_HEARTBEAT_INTERVAL"
ENV_HEARTBEAT_MAX_FAILURE: Final = "TOKENSPEED_DISAGGREGATION_HEARTBEAT_MAX_FAILURE"
ENV_QUEUE_SIZE: Final = "TOKENSPEED_DISAGGREGATION_QUEUE_SIZE"
ENV_THREAD_POOL_SIZE: Final = "TOKENSPEED_DISAGGREGATION_THREAD_POOL_SIZE"
ENV_LAYERWISE_DEBUG: Final = "TOKENSPEED_PD_LAYERWISE_DEBUG"
ENV_TEST_FAILURE_PROB: Final = "DISAGGREGATION_TEST_FAILURE_PROB"
# tspd's own secure mode (docs/security.md); TokenSpeed has no such variables.
ENV_CURVE_SECRET_KEY_FILE: Final = "TSPD_CURVE_SECRET_KEY_FILE"
ENV_CURVE_ALLOW_DIR: Final = "TSPD_CURVE_ALLOW_DIR"
ENV_TLS_CA_FILE: Final = "TSPD_TLS_CA_FILE"
ENV_TLS_CERT_FILE: Final = "TSPD_TLS_CERT_FILE"
ENV_TLS_KEY_FILE: Final = "TSPD_TLS_KEY_FILE"
ENV_BOOTSTRAP_TOKEN_FILE: Final = "TSPD_BOOTSTRAP_TOKEN_FILE"
ENV_BOOTSTRAP_PROTECT_GET: Final = "TSPD_BOOTSTRAP_PROTECT_GET"

DEFAULT_BOOTSTRAP_PORT: Final = 8998
"""``--disaggregation-bootstrap-port`` default."""

MIN_HEARTBEAT_INTERVAL: Final = 2.0
"""Shortest heartbeat interval TokenSpeed allows (its floor), in seconds."""

_TRUE: Final = frozenset({"true", "1", "yes", "y"})
_FALSE: Final = frozenset({"false", "0", "no", "n"})

_T = TypeVar("_T")


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


@dataclass(frozen=True, slots=True, kw_only=True)
class PDEnv:
    """TokenSpeed's PD environment variables after defaults.

    ``thread_pool_size`` is ``None`` when the variable is unset (each user then
    keeps its own default).
    """

    bootstrap_timeout: int = 120
    waiting_timeout: int = 300
    failed_session_ttl: int = 30
    heartbeat_interval: float = 5.0
    heartbeat_max_failures: int = 2
    queue_size: int = 4
    thread_pool_size: int | None = None
    layerwise_debug: bool = False
    test_failure_prob: float = 0.0


class _Reader:
    """Reads and checks variables from one mapping; any bad value is a ConfigError."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self.environ = environ

    def get(
        self,
        name: str,
        parse: Callable[[str], _T],
        default: _T,
        kind: str,
        check: Callable[[_T], bool] = lambda _: True,
    ) -> _T:
        raw = self.environ.get(name)
        if raw is None or not raw.strip():
            return default
        try:
            value = parse(raw.strip())
        except ValueError:
            value = None
        if value is None or not check(value):
            raise ConfigError(
                f"{name}={raw!r} is not {kind}; fix it or unset it to use the default {default!r}"
            )
        return value


def parse_pd_env(environ: Mapping[str, str], *, prefill: bool = True) -> PDEnv:
    """Read TokenSpeed's PD variables from ``environ`` (pass ``os.environ``).

    Raises :class:`ConfigError` naming the variable for a value that does not
    parse or is out of range. With ``prefill`` (the default) also refuses a thread
    pool smaller than the queue size, with TokenSpeed's exact message.
    """
    r = _Reader(environ)
    # -1 is TokenSpeed's spelling of "unset".
    pool = r.get(ENV_THREAD_POOL_SIZE, int, -1, "a whole number >= 1", lambda v: v >= 1 or v == -1)
    positive = "a positive whole number of seconds"
    env = PDEnv(
        bootstrap_timeout=r.get(ENV_BOOTSTRAP_TIMEOUT, int, 120, positive, lambda v: v > 0),
        waiting_timeout=r.get(ENV_WAITING_TIMEOUT, int, 300, positive, lambda v: v > 0),
        failed_session_ttl=max(
            0, r.get(ENV_FAILED_SESSION_TTL, int, 30, "a whole number of seconds")
        ),
        heartbeat_interval=r.get(
            ENV_HEARTBEAT_INTERVAL,
            _parse_float,
            5.0,
            f"a number of seconds >= {MIN_HEARTBEAT_INTERVAL}",
            lambda v: v >= MIN_HEARTBEAT_INTERVAL,
        ),
        heartbeat_max_failures=r.get(
            ENV_HEARTBEAT_MAX_FAILURE, int, 2, "a whole number >= 1", lambda v: v >= 1
        ),
        queue_size=r.get(
            ENV_QUEUE_SIZE, int, 4, "a whole number of transfer workers >= 1", lambda v: v >= 1
        ),
        thread_pool_size=pool if pool > 0 else None,
        layerwise_debug=r.get(ENV_LAYERWISE_DEBUG, parse_bool, False, "a boolean (true/false)"),
        test_failure_prob=r.get(
            ENV_TEST_FAILURE_PROB,
            _parse_float,
            0.0,
            "a probability in [0, 1]",
            lambda v: 0.0 <= v <= 1.0,
        ),
    )
    if prefill and pool > 0 and pool < env.queue_size:
        raise ConfigError(
            f"{ENV_THREAD_POOL_SIZE}={pool} must be greater than or equal to "
            f"{ENV_QUEUE_SIZE}={env.queue_size}."
        )
    return env


#: A Prefill rank stages a destination's write only when its coalesced plan has at
#: least this many copies: Mooncake over TCP pays tens of µs a descriptor, so a plan
#: of many small copies is what staging speeds up (docs/wire.md#staged-transfers).
DEFAULT_STAGING_MIN_COPIES: Final = 64

#: A Decode rank offers a staging slot only for a room of at least this many bytes
#: on this rank: below it, the slot's memory is better left to larger rooms.
DEFAULT_STAGING_MIN_BYTES: Final = 1 << 20

_MAX_STAGING_ADDRESS: Final = 1 << 62


def check_staging(size: int, base: int) -> None:
    """Refuse a staging region that cannot be one (:class:`ConfigError`): a negative
    size, or a base and size past the 64-bit address range tspd plans in."""
    if size < 0:
        raise ConfigError(f"the staging region size must not be negative, got {size}")
    if base < 0 or base + size > _MAX_STAGING_ADDRESS:
        raise ConfigError(
            f"the staging region (base {base:#x}, {size} bytes) must lie below "
            f"{_MAX_STAGING_ADDRESS:#x}"
        )


def check_rank_config(
    tp_size: int, tp_rank: int, topology: ParallelTopology | None, failure_prob: float
) -> None:
    """The checks both peers' configurations make on their rank: TP size and rank in
    range, the engine's topology (when given) consistent with them and one tspd can
    plan for (no context parallelism), the fault-injection probability in [0, 1]."""
    if not 0 < tp_size <= MAX_CACHE_TP_SIZE:
        raise ConfigError(f"tp_size must be in [1, {MAX_CACHE_TP_SIZE}], got {tp_size}")
    if not 0 <= tp_rank < tp_size:
        raise ConfigError(f"tp_rank must be in [0, {tp_size}), got {tp_rank}")
    if topology is not None:
        topology.require_no_context_parallel()
        if (topology.tp_size, topology.tp_rank) != (tp_size, tp_rank):
            raise ConfigError(
                f"the engine's parallel topology has tp_size={topology.tp_size} "
                f"tp_rank={topology.tp_rank}, but the peer is configured with "
                f"tp_size={tp_size} tp_rank={tp_rank}: pass the topology's attention-TP "
                "coordinates"
            )
    if not 0.0 <= failure_prob <= 1.0:
        raise ConfigError(
            f"the fault-injection probability ({ENV_TEST_FAILURE_PROB}) must be in [0, 1], "
            f"got {failure_prob}"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class SecurityEnv:
    """tspd's secure-mode variables (docs/security.md), as paths and flags; the shell
    loads the files (:class:`tspd.shell.security.SecurityConfig`). Every path is
    ``None`` when its variable is unset or empty."""

    curve_secret_key_file: str | None = None
    curve_allow_dir: str | None = None
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    bootstrap_token_file: str | None = None
    protect_get: bool = False


def parse_security_env(environ: Mapping[str, str]) -> SecurityEnv:
    """Read tspd's secure-mode variables from ``environ``. The CURVE key file and
    allow-list directory go together, and so do the TLS certificate and key: one
    without the other is a :class:`ConfigError` naming both (a half-configured
    secure mode must never run as plain mode)."""

    def path(name: str) -> str | None:
        raw = environ.get(name, "").strip()
        return raw or None

    env = SecurityEnv(
        curve_secret_key_file=path(ENV_CURVE_SECRET_KEY_FILE),
        curve_allow_dir=path(ENV_CURVE_ALLOW_DIR),
        tls_ca_file=path(ENV_TLS_CA_FILE),
        tls_cert_file=path(ENV_TLS_CERT_FILE),
        tls_key_file=path(ENV_TLS_KEY_FILE),
        bootstrap_token_file=path(ENV_BOOTSTRAP_TOKEN_FILE),
        protect_get=_Reader(environ).get(
            ENV_BOOTSTRAP_PROTECT_GET, parse_bool, False, "a boolean (true/false)"
        ),
    )
    for first, second, a, b in (
        (
            env.curve_secret_key_file,
            env.curve_allow_dir,
            ENV_CURVE_SECRET_KEY_FILE,
            ENV_CURVE_ALLOW_DIR,
        ),
        (env.tls_cert_file, env.tls_key_file, ENV_TLS_CERT_FILE, ENV_TLS_KEY_FILE),
    ):
        if (first is None) != (second is None):
            given, missing = (a, b) if first is not None else (b, a)
            raise ConfigError(
                f"{given} is set but {missing} is not: secure mode needs both "
                "(docs/security.md); set both, or unset both for plain mode"
            )
    return env
