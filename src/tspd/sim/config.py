"""What one simulated run is: the cluster's shape, its timings and its faults.

A run is a seed plus a :class:`SimConfig`; nothing else influences it. The config
is frozen and can be written back as the ``tspd sim`` command line that repeats the
run (:meth:`SimConfig.command`), which is what a violation report prints.

Shapes are written as on the command line: ``2xTP2`` is two Prefill (or Decode)
instances of TP size 2, ``1xTP2DP2`` one instance of two attention-DP groups of TP
2, and several shapes are joined with ``,`` (``1xTP2,2xTP1``).
Faults are ``name`` or ``name=value`` items joined with ``,``
(:func:`parse_faults`); a bare name takes the rate in :data:`FAULT_DEFAULTS`. A
fault whose field has an underscore is written with a hyphen (``bootstrap-crash``).

``layerwise`` switches the Prefill side from full transfers to layerwise streaming:
the prompt is computed in chunks of ``prefill_chunk`` tokens per forward, every
forward arms its chunks on every rank (:meth:`~tspd.core.prefill.PrefillCore.arm_layerwise`)
and advances each rank's producer step counter one layer at a time, and the
transfer engine waits for each interval's step (:mod:`tspd.sim.layerwise`).

``staging`` gives that share of the Prefill and of the Decode instances a staging
region (docs/wire.md#staged-transfers; which ones is drawn from the seed): between
two that have one, a full transfer's destination write goes as one blob, gathered
on the Prefill, written into a slot of the Decode's region and scattered there
(:mod:`tspd.sim.staging`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields, replace
from typing import Final, Literal

from tspd.core.errors import ConfigError
from tspd.layouts import kv_heads_per_rank

__all__ = [
    "FAULT_DEFAULTS",
    "FENCING_MODES",
    "Faults",
    "InstanceShape",
    "SimConfig",
    "Timings",
    "fault_name",
    "format_faults",
    "format_shapes",
    "parse_faults",
    "parse_shapes",
]

FencingMode = Literal["strict", "report"]
#: How the fencing check treats a write that lands in a Decode page after its room
#: ended there: ``strict`` fails the run, ``report`` counts and prints it.
FENCING_MODES: Final = ("strict", "report")

_SHAPE = re.compile(r"(?:(?P<count>\d+)x)?TP(?P<tp>\d+)(?:DP(?P<dp>\d+))?\Z", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class InstanceShape:
    """``count`` instances, each ``dp`` attention-DP groups of ``tp`` TP ranks."""

    count: int
    tp: int
    dp: int = 1

    def __str__(self) -> str:
        return f"{self.count}xTP{self.tp}" + (f"DP{self.dp}" if self.dp > 1 else "")


def parse_shapes(text: str, *, what: str, allow_dp: bool) -> tuple[InstanceShape, ...]:
    """``"2xTP2,1xTP1"`` as shapes; :class:`ConfigError` naming ``what`` otherwise."""
    shapes: list[InstanceShape] = []
    for item in text.split(","):
        match = _SHAPE.match(item.strip())
        if match is None:
            raise ConfigError(f"{what} shape {item.strip()!r} is not like 2xTP2 or 1xTP2DP2")
        count = int(match["count"] or 1)
        tp = int(match["tp"])
        dp = int(match["dp"] or 1)
        if count < 1 or tp < 1 or dp < 1:
            raise ConfigError(f"{what} shape {item.strip()!r} needs counts of at least 1")
        if dp > 1 and not allow_dp:
            raise ConfigError(f"{what} instances have no DP groups in the simulator")
        shapes.append(InstanceShape(count, tp, dp))
    return tuple(shapes)


def format_shapes(shapes: tuple[InstanceShape, ...]) -> str:
    """The command-line form of ``shapes``."""
    return ",".join(str(s) for s in shapes)


@dataclass(frozen=True, slots=True)
class Faults:
    """Fault rates. Message faults apply to every control message; ``partition``
    and ``crash`` are expected counts per run; the rest are per-event probabilities.

    * ``loss``, ``dup``: a message is dropped, or delivered twice.
    * ``reorder``: a message takes an extra random delay and may overtake others
      (without it each link delivers in order, as ZeroMQ over TCP does).
    * ``partition``: sets of hosts cut off from the rest for a while (messages
      dropped, HTTP requests time out, writes hang until the transfer timeout).
    * ``crash``: a Prefill DP group or a Decode instance dies and restarts with
      empty tables, new ports and (Decode) new transfer sessions; peers are not told.
    * ``xfail``: a write fails; ``hang``: a write hangs until the transfer timeout
      and is then reported failed; ``late``: such a hung write still lands later.
    * ``abort``: the Prefill scheduler aborts a request at a random moment.
    * ``hedge``: the router also sends a request to a second Decode instance under
      the same room (a retried request); the Prefill must not serve both.
    * ``bootstrap_crash`` (``bootstrap-crash``): a bootstrap server dies, is down
      for a while (requests to it are refused) and restarts with an empty table;
      Prefill ranks register again only when they restart themselves (as the shell
      does), or every ``Timings.reregister_interval`` when that is set.
    * ``sleep``: a Prefill DP group is put to sleep: the router stops sending it
      requests, the scheduler waits until it tracks none, every rank's
      :meth:`~tspd.core.prefill.PrefillCore.check_release` is asked and the arena's
      registration released (its contents are lost); it wakes after
      ``Timings.sleep_time`` and serves again.
    * ``garble``: a staged blob lands with its magic damaged (``SimConfig.staging``
      only), so the Decode must refuse it and fail the room.
    * ``rank_crash`` (``rank-crash``): one rank of a Prefill DP group or Decode
      instance of TP 2 or more dies alone (its tables, port, session and writes
      in flight gone; nobody told) while its siblings run on; the group's next step
      that needs every rank stalls, and ``Timings.agreement_timeout`` later the
      group goes down and restarts as with ``crash``.
    """

    loss: float = 0.0
    dup: float = 0.0
    reorder: float = 0.0
    partition: float = 0.0
    crash: float = 0.0
    xfail: float = 0.0
    hang: float = 0.0
    late: float = 0.0
    abort: float = 0.0
    hedge: float = 0.0
    bootstrap_crash: float = 0.0
    sleep: float = 0.0
    garble: float = 0.0
    rank_crash: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not value >= 0:
                raise ConfigError(f"fault {fault_name(f.name)} must not be negative, got {value}")
            if f.name not in _COUNTS and value > 1:
                raise ConfigError(f"fault {fault_name(f.name)} is a probability, got {value}")

    @property
    def any(self) -> bool:
        """Whether any fault is on."""
        return any(getattr(self, f.name) for f in fields(self))


#: The settings ``tspd sim`` takes as options.
_ON_THE_COMMAND_LINE: Final = frozenset(
    {
        "rooms",
        "prefill",
        "decode",
        "faults",
        "fencing",
        "layerwise",
        "layers",
        "layerwise_interval",
        "staging",
    }
)

#: Faults whose value is an expected count per run rather than a probability.
_COUNTS: Final = frozenset({"partition", "crash", "bootstrap_crash", "sleep", "rank_crash"})


def fault_name(field_name: str) -> str:
    """A :class:`Faults` field's name on the command line (``bootstrap-crash``)."""
    return field_name.replace("_", "-")


#: The rate a bare fault name (``reorder``, ``crash``...) takes.
FAULT_DEFAULTS: Final[dict[str, float]] = {
    "loss": 0.01,
    "dup": 0.01,
    "reorder": 0.1,
    "partition": 2.0,
    "crash": 1.0,
    "xfail": 0.01,
    "hang": 0.005,
    "late": 0.5,
    "abort": 0.02,
    "hedge": 0.02,
    "bootstrap_crash": 1.0,
    "sleep": 1.0,
    "garble": 0.01,
    "rank_crash": 1.0,
}


def parse_faults(text: str) -> Faults:
    """``"loss=0.01,dup=0.01,reorder,partition,crash"`` as :class:`Faults`; ``""``
    and ``"none"`` are no faults, ``"all"`` every fault at its default rate."""
    text = text.strip()
    if text in ("", "none"):
        return Faults()
    if text == "all":
        return Faults(**FAULT_DEFAULTS)
    values: dict[str, float] = {}
    for item in text.split(","):
        shown, sep, raw = item.strip().partition("=")
        name = shown.replace("-", "_")
        if name not in FAULT_DEFAULTS:
            known = ", ".join(fault_name(n) for n in FAULT_DEFAULTS)
            raise ConfigError(f"unknown fault {shown!r}; known: {known}")
        try:
            values[name] = float(raw) if sep else FAULT_DEFAULTS[name]
        except ValueError:
            raise ConfigError(f"fault {shown} needs a number, got {raw!r}") from None
    return Faults(**values)


def format_faults(faults: Faults) -> str:
    """The command-line form of ``faults`` (``none`` when all are off)."""
    items = [
        f"{fault_name(f.name)}={getattr(faults, f.name):g}"
        for f in fields(faults)
        if getattr(faults, f.name)
    ]
    return ",".join(items) or "none"


@dataclass(frozen=True, slots=True)
class Timings:
    """Virtual-time parameters, in seconds. Timeouts are the cores' (passed to
    their configs); the rest model the engines, the network and the schedulers.

    ``transfer_timeout`` is the engine's (Mooncake's ``MC_TRANSFER_TIMEOUT``): a
    hung write is reported failed after it. ``quarantine_timeout`` is how long a
    Decode core with write fencing holds a failed room's pages at most.
    ``http_timeout`` bounds every bootstrap request. ``arrival_rate`` is requests
    per second offered by the router; ``poll_interval`` the delay from an input to
    the scheduler's next iteration; ``decode_time`` how long a request decodes
    after its KV arrived.

    ``bootstrap_outage`` is the mean time a crashed bootstrap server stays down
    (each outage is drawn between a tenth and twice it); ``reregister_interval`` how
    often a Prefill rank ``PUT``\\ s its route again (0: never, only when it starts,
    as :mod:`tspd.shell.prefill` does); ``sleep_time`` how long a Prefill DP group
    sleeps once its arena is released. ``scatter_time`` is the mean time a Decode
    rank takes to check and scatter a staged blob (each scatter is drawn between
    half of it and ten and a half times it). ``agreement_timeout`` is how long a
    scheduler step that needs every rank of a TP group waits for a dead rank (the
    ``rank-crash`` fault) before the engine takes the whole group down.
    """

    bootstrap_timeout: float = 30.0
    waiting_timeout: float = 60.0
    failed_session_ttl: float = 30.0
    heartbeat_interval: float = 5.0
    heartbeat_max_failures: int = 2
    transfer_timeout: float = 10.0
    quarantine_timeout: float = 30.0
    http_timeout: float = 5.0
    connect_timeout: float = 2.0
    link_delay: float = 0.0005
    write_latency: float = 0.0005
    forward_per_token: float = 0.00005
    arrival_rate: float = 400.0
    poll_interval: float = 0.002
    decode_time: float = 0.05
    restart_delay: float = 1.0
    partition_time: float = 4.0
    bootstrap_outage: float = 8.0
    reregister_interval: float = 0.0
    sleep_time: float = 2.0
    scatter_time: float = 0.0002
    agreement_timeout: float = 1.0


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One simulated cluster and its workload (everything but the seed).

    The model has ``kv_heads`` global KV heads of ``head_dim`` elements, one layer
    (a K and a V field) and ``page_tokens`` tokens a page, ``num_pages`` pages a
    rank; prompts are 1 to ``max_prompt`` tokens. ``transfer_workers`` per Prefill
    rank. ``fencing`` is the fencing check's mode (:data:`FENCING_MODES`).

    ``layers`` is the model's layer count (each a K and a V field).
    ``layerwise`` streams KV layerwise (``layerwise_interval`` producer steps per
    transfer interval, one step per layer) instead of full transfers; the Prefill
    then computes prompts in forwards of at most ``prefill_chunk`` tokens.

    ``staging`` is the share of Prefill instances, and of Decode instances, that
    have a staging region of ``staging_bytes`` bytes on every rank (0: none, the
    plain protocol only; 1: all); each instance's draw comes from the seed. The
    cores' thresholds are ``staging_min_copies`` (Prefill) and
    ``staging_min_bytes`` (Decode), small enough here for most rooms to be staged;
    a blob is gathered and written in parts of ``staging_part_bytes`` bytes.
    """

    rooms: int = 200
    prefill: tuple[InstanceShape, ...] = (InstanceShape(2, 2),)
    decode: tuple[InstanceShape, ...] = (InstanceShape(3, 1),)
    faults: Faults = field(default_factory=Faults)
    fencing: FencingMode = "report"
    timings: Timings = field(default_factory=Timings)
    kv_heads: int = 4
    head_dim: int = 8
    page_tokens: int = 4
    num_pages: int = 512
    max_prompt: int = 32
    transfer_workers: int = 2
    max_inflight: int = 48
    layers: int = 1
    layerwise: bool = False
    layerwise_interval: int = 1
    prefill_chunk: int = 12
    staging: float = 0.0
    staging_bytes: int = 64 << 10
    staging_min_copies: int = 4
    staging_min_bytes: int = 512
    staging_part_bytes: int = 2048

    def __post_init__(self) -> None:
        if not 0.0 <= self.staging <= 1.0:
            raise ConfigError(
                f"staging is the share of instances with a staging region, in [0, 1]; "
                f"got {self.staging}"
            )
        if (
            self.staging_bytes < 0
            or self.staging_min_copies < 1
            or self.staging_min_bytes < 0
            or self.staging_part_bytes < 1
        ):
            raise ConfigError(
                f"staging_bytes ({self.staging_bytes}) and staging_min_bytes "
                f"({self.staging_min_bytes}) must not be negative, staging_min_copies "
                f"({self.staging_min_copies}) and staging_part_bytes "
                f"({self.staging_part_bytes}) must be at least 1"
            )
        if self.staging and self.head_dim < 4:
            # A staged blob carries each cell's tag in the cell's first 8 bytes.
            raise ConfigError(
                f"staged transfers need a head_dim of at least 4 (cells of 8 bytes or more), "
                f"got {self.head_dim}"
            )
        if self.rooms < 0:
            raise ConfigError(f"rooms must not be negative, got {self.rooms}")
        if self.layers < 1 or self.layerwise_interval < 1 or self.prefill_chunk < 1:
            raise ConfigError(
                f"layers ({self.layers}), the layerwise interval ({self.layerwise_interval}) "
                f"and the Prefill chunk ({self.prefill_chunk}) must be at least 1"
            )
        if self.fencing not in FENCING_MODES:
            raise ConfigError(f"fencing must be one of {FENCING_MODES}, got {self.fencing!r}")
        if not self.prefill or not self.decode:
            raise ConfigError("a cluster needs at least one Prefill and one Decode instance")
        for shape in (*self.prefill, *self.decode):
            kv_heads_per_rank(self.kv_heads, shape.tp)  # raises for an impossible split
        pages = -(-self.max_prompt // self.page_tokens)
        if self.max_inflight * pages > self.num_pages:
            raise ConfigError(
                f"{self.max_inflight} requests in flight of up to {pages} pages do not fit "
                f"in {self.num_pages} pages"
            )

    def with_(self, **changes: object) -> SimConfig:
        """A copy with ``changes`` applied (``dataclasses.replace``)."""
        return replace(self, **changes)  # type: ignore[arg-type]

    def command(self, seed: int) -> str:
        """The ``tspd sim`` command line that repeats the run of ``seed``; settings
        the command line cannot give follow as a comment (pass them to
        :class:`SimConfig` to repeat the run from Python)."""
        line = (
            f"tspd sim --seed {seed} --rooms {self.rooms} --prefill {format_shapes(self.prefill)} "
            f"--decode {format_shapes(self.decode)} --faults {format_faults(self.faults)} "
            f"--fencing {self.fencing}"
        )
        if self.layers != 1:
            line += f" --layers {self.layers}"
        if self.layerwise:
            line += " --layerwise"
            if self.layerwise_interval != 1:
                line += f" --layerwise-interval {self.layerwise_interval}"
        if self.staging:
            line += f" --staging {self.staging:g}"
        default = SimConfig()
        others = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in fields(self)
            if f.name not in _ON_THE_COMMAND_LINE
            and getattr(self, f.name) != getattr(default, f.name)
        ]
        return line + (f"  # and {', '.join(others)}" if others else "")
