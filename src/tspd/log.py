"""Structured logging: one logger per component, ids as fields, quiet by default.

Every tspd logger lives under ``tspd``: :func:`component_logger` gives
``tspd.prefill``, ``tspd.decode``, ``tspd.transfer``, ``tspd.bootstrap``,
``tspd.events``, ``tspd.metrics``... Rooms, peers and ranks travel as ``extra``
fields, never only inside the message, so a log pipeline can filter on them::

    log.warning("room %d failed: %s", room, reason, extra=fields(room=room, side="prefill"))

A library must not print on its own: importing this module installs a
``NullHandler`` on ``tspd``, so nothing is shown until the application configures
logging (its own handlers see every record, as usual) or calls
:func:`configure_logging`, which the ``tspd`` commands do. That renders the fields
as ``key=value`` after the message, or one JSON object per line.

How much to log (docs/configuration.md#logging; TokenSpeed's INFO logging costs ~30 % of
its rooms/s): one line per *failure* with its reason and class, never one per room. A
successful room's story is in its trace and the metrics, not the log.
:func:`log_command` applies that to the cores' :class:`~tspd.core.commands.Log` and
:class:`~tspd.core.commands.RoomFailed` commands.

What a peer, a client or the network sends must not flood the log either: a line
about something refused goes through a :class:`RateLimitedLog`, which writes at most
one line per ``(peer, reason)`` every few seconds and says on the next one how many
similar lines it held back::

    refusals = RateLimitedLog(log, interval=10.0)
    refusals.warning(client_ip, "bad_field", "bootstrap PUT from %s refused: %s", client_ip, why)
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import Final, TextIO, final

from tspd.core.commands import Command, Log, LogLevel, Rejected, RoomFailed

__all__ = [
    "COMPONENTS",
    "LEVELS",
    "JsonFormatter",
    "KeyValueFormatter",
    "LogLimits",
    "RateLimitedLog",
    "component_logger",
    "configure_logging",
    "fields",
    "log_command",
]

ROOT: Final = "tspd"

#: The components that log, each under ``tspd.<component>``.
COMPONENTS: Final = (
    "prefill",
    "decode",
    "transfer",
    "bootstrap",
    "events",
    "metrics",
    "engine",
    "demo",
)

#: :class:`~tspd.core.commands.LogLevel` → :mod:`logging` level.
LEVELS: Final[Mapping[LogLevel, int]] = {
    LogLevel.DEBUG: logging.DEBUG,
    LogLevel.INFO: logging.INFO,
    LogLevel.WARNING: logging.WARNING,
    LogLevel.ERROR: logging.ERROR,
}

logging.getLogger(ROOT).addHandler(logging.NullHandler())

# Attributes every LogRecord has; anything else on a record came in through ``extra``.
_STANDARD: Final = frozenset(
    {
        *logging.LogRecord("", 0, "", 0, "", None, None).__dict__,
        "message",
        "asctime",
        "taskName",
    }
)


def component_logger(component: str) -> logging.Logger:
    """The logger of one tspd component: ``tspd.<component>`` (a dotted name nests
    further, e.g. ``"bootstrap.http"``)."""
    return logging.getLogger(f"{ROOT}.{component}")


def fields(**values: object) -> dict[str, object]:
    """``extra`` for a log call: the given fields, without those that are ``None``."""
    return {key: value for key, value in values.items() if value is not None}


def record_fields(record: logging.LogRecord) -> dict[str, object]:
    """The fields a record carries (what came in through ``extra``), in order."""
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD}


def _render(value: object) -> str:
    text = str(value)
    if not text or any(c.isspace() or c in '="' for c in text):
        return json.dumps(text)
    return text


class KeyValueFormatter(logging.Formatter):
    """``time level logger: message key=value ...``; values with spaces, ``=`` or
    quotes are JSON-quoted so a line always splits back into its fields."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extra = record_fields(record)
        if not extra:
            return line
        head, newline, rest = line.partition("\n")
        pairs = " ".join(f"{key}={_render(value)}" for key, value in extra.items())
        return f"{head} {pairs}{newline}{rest}"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts``, ``level``, ``logger``, ``message``, then
    the record's fields (``exc`` holds a traceback when there is one)."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": record.created,
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in record_fields(record).items():
            entry.setdefault(key, value if isinstance(value, int | float | bool) else str(value))
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


_HANDLER_MARK: Final = "_tspd_configured"


def configure_logging(
    level: int | str = logging.WARNING, *, json: bool = False, stream: TextIO | None = None
) -> logging.Handler:
    """Show tspd's logs at ``level`` and above on ``stream`` (standard error by
    default), as ``key=value`` lines or (``json=True``) JSON lines. For the ``tspd``
    commands and small hosts; applications with their own logging setup need not
    call it. Calling it again replaces the handler it installed before."""
    logger = logging.getLogger(ROOT)
    for handler in list(logger.handlers):
        if getattr(handler, _HANDLER_MARK, False):
            logger.removeHandler(handler)
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter() if json else KeyValueFormatter())
    setattr(handler, _HANDLER_MARK, True)
    logger.addHandler(handler)
    logger.setLevel(level.upper() if isinstance(level, str) else level)
    return handler


def log_command(
    logger: logging.Logger,
    command: Command,
    *,
    limits: LogLimits | None = None,
    **context: object,
) -> bool:
    """Log a core's :class:`Log`, :class:`RoomFailed` or :class:`Rejected` command on
    ``logger`` with ``context`` (``side=``, ``rank=``...) as fields; ``True`` if it
    was one of them.

    A failure is one WARNING line with its reason and ``reason_class`` (and
    ``timeout_stage`` for a timeout): the cores emit one :class:`RoomFailed` per
    failed room and no other line about it. A rejected message is one line at its
    level. With ``limits`` (a peer's :class:`LogLimits`), what a peer can repeat at
    will is rate-limited: rejections per reason, failures per reason class, each
    beyond a burst and with a suppressed count.
    """
    if isinstance(command, RoomFailed):
        if logger.isEnabledFor(logging.WARNING):
            extra = {
                "room": command.room,
                "reason_class": str(command.reason_class),
                "timeout_stage": command.timeout_stage,
                **context,
            }
            if limits is None:
                logger.warning(
                    "room %d failed: %s", command.room, command.reason, extra=fields(**extra)
                )
            else:
                limits.failures.log(
                    logging.WARNING,
                    "rooms",
                    str(command.reason_class),
                    "room %d failed: %s",
                    command.room,
                    command.reason,
                    exc_info=False,
                    **extra,
                )
        return True
    if isinstance(command, Rejected):
        level = LEVELS[command.level]
        if limits is None:
            if logger.isEnabledFor(level):
                extra = {"peer": command.peer, "reason": str(command.reason), **context}
                logger.log(level, "%s", command.message, extra=fields(room=command.room, **extra))
        else:
            # Keyed by reason alone: the peer a message names is whatever its sender
            # chose (a PULL socket does not say who sent), so an attacker could
            # rotate it to get a line per message. The name is still a field.
            limits.rejections.log(
                level,
                RateLimitedLog.OTHER_PEERS,
                str(command.reason),
                "%s",
                command.message,
                exc_info=False,
                room=command.room,
                claimed_peer=command.peer,
                **context,
            )
        return True
    if isinstance(command, Log):
        level = LEVELS[command.level]
        if limits is not None and command.limit_key is not None:
            limits.rejections.log(
                level,
                RateLimitedLog.OTHER_PEERS,
                command.limit_key,
                "%s",
                command.message,
                exc_info=False,
                room=command.room,
                **context,
            )
        elif logger.isEnabledFor(level):
            logger.log(level, "%s", command.message, extra=fields(room=command.room, **context))
        return True
    return False


@final
class LogLimits:
    """The rate limits of one peer's log lines about what others send it:
    ``rejections`` (up to 5 lines per reason every ``interval`` seconds, whatever
    peer the messages name) and
    ``failures`` (up to ``failure_burst`` failed-room lines per reason class every
    ``interval`` seconds, then a count). See :func:`log_command`."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        interval: float = 10.0,
        failure_burst: int = 20,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rejections = RateLimitedLog(logger, interval=interval, burst=5, clock=clock)
        self.failures = RateLimitedLog(
            logger, interval=interval, burst=failure_burst, max_keys=64, clock=clock
        )


@final
class RateLimitedLog:
    """At most ``burst`` log lines per ``(peer, reason)`` every ``interval`` seconds.

    For lines about things a peer, client or the network can repeat at will
    (refused requests, malformed messages): the first line of a kind is written at
    once; similar lines within ``interval`` seconds of it are counted, not written,
    and the next line of that kind that is written ends with ``(N similar lines
    suppressed in the last S s)`` and carries a ``suppressed=N`` field.

    The table of kinds is bounded: at most ``max_keys`` ``(peer, reason)`` pairs are
    tracked; once it is full (and none of its entries has expired), a new peer is
    counted under the peer ``"*"`` for its reason, so a flood from many addresses
    still writes at most one line per reason per interval. ``peer`` and ``reason``
    are also passed as record fields. ``burst`` (1 by default) lets that many lines
    of a kind through in each interval before counting starts (for lines that are
    worth reading one by one until they become a flood). ``clock`` (seconds,
    monotonic) is for tests.
    """

    OTHER_PEERS: Final = "*"

    def __init__(
        self,
        logger: logging.Logger,
        *,
        interval: float = 10.0,
        max_keys: int = 1024,
        burst: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not interval >= 0 or max_keys < 1 or burst < 1:
            raise ValueError(
                "RateLimitedLog needs interval >= 0, max_keys >= 1 and burst >= 1, got "
                f"{interval}, {max_keys}, {burst}"
            )
        self.logger = logger
        self.interval = interval
        self.max_keys = max_keys
        self.burst = burst
        self._clock = clock
        # (peer, reason) -> [start of its interval, lines suppressed in it, lines
        # written in it]; in the order intervals started, so expired ones are first.
        self._keys: dict[tuple[str, str], list[float]] = {}
        #: Lines held back in total (every key, since construction).
        self.suppressed_total = 0

    def __len__(self) -> int:
        """How many ``(peer, reason)`` pairs are tracked now (at most ``max_keys``)."""
        return len(self._keys)

    def _key(self, peer: str, reason: str, now: float) -> tuple[str, str]:
        key = (peer, reason)
        if key in self._keys or len(self._keys) < self.max_keys:
            return key
        for old in list(self._keys):  # oldest first: forget what has expired
            if now - self._keys[old][0] < self.interval:
                break
            del self._keys[old]
        if len(self._keys) < self.max_keys:
            return key
        other = (self.OTHER_PEERS, reason)
        if other not in self._keys:
            del self._keys[next(iter(self._keys))]  # make room: the oldest line's entry
        return other

    def log(
        self,
        level: int,
        peer: str,
        reason: str,
        msg: str,
        *args: object,
        exc_info: bool = False,
        **extra: object,
    ) -> bool:
        """Write ``msg % args`` at ``level`` unless a line for ``(peer, reason)`` was
        written less than ``interval`` seconds ago; ``extra`` are record fields and
        ``exc_info=True`` adds the exception being handled. ``True`` if the line was
        written."""
        if not self.logger.isEnabledFor(level):
            return False
        now = self._clock()
        key = self._key(peer, reason, now)
        entry = self._keys.get(key)
        if entry is not None and now - entry[0] < self.interval:
            if entry[2] >= self.burst:
                entry[1] += 1
                self.suppressed_total += 1
                return False
            entry[2] += 1
            suppressed = 0
        else:
            suppressed = int(entry[1]) if entry is not None else 0
            if entry is not None:
                del self._keys[key]  # re-insert at the back: the newest interval
            self._keys[key] = [now, 0, 1]
        if suppressed:
            since = now - entry[0] if entry is not None else 0.0
            msg = f"{msg} ({suppressed} similar lines suppressed in the last {since:.0f} s)"
        self.logger.log(
            level,
            msg,
            *args,
            exc_info=exc_info,
            extra=fields(peer=key[0], reason=reason, suppressed=suppressed or None, **extra),
        )
        return True

    def warning(
        self,
        peer: str,
        reason: str,
        msg: str,
        *args: object,
        exc_info: bool = False,
        **extra: object,
    ) -> bool:
        """:meth:`log` at WARNING."""
        return self.log(logging.WARNING, peer, reason, msg, *args, exc_info=exc_info, **extra)

    def error(
        self,
        peer: str,
        reason: str,
        msg: str,
        *args: object,
        exc_info: bool = False,
        **extra: object,
    ) -> bool:
        """:meth:`log` at ERROR."""
        return self.log(logging.ERROR, peer, reason, msg, *args, exc_info=exc_info, **extra)
