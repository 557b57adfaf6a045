"""A simulated bootstrap server: the real sans-IO state behind a simulated HTTP.

Each Prefill instance has one, on a host of its own. Prefill ranks ``PUT`` their
route when they start (and again after a restart, with their new control port);
Decode ranks ``GET`` the parallel info and rank endpoints and heartbeat
``/health`` (docs/protocol.md#proto-bootstrap-routes). Requests go through
:class:`~tspd.core.bootstrap.BootstrapState` exactly as the HTTP shell hands them
over, and replies are parsed with the clients' own parsers, so a refusal reaches
the Decode core as the error text the shell would pass.

With the ``bootstrap-crash`` fault a server dies (:meth:`BootstrapServer.crash`):
while it is down every request to it fails after a round trip (connection refused),
and an exchange that was in flight when it died fails too (each exchange carries
the server's incarnation). It restarts (:meth:`BootstrapServer.restart`) with an
empty :class:`~tspd.core.bootstrap.BootstrapState`: until every rank of the
instance ``PUT`` its route again the ``GET`` routes answer ``503`` (``Bootstrap
server is waiting for …``), which the Decode core gets as the lookup's error. The
shell's Prefill ranks ``PUT`` only when they start (:mod:`tspd.shell.prefill`),
so they register again when they restart, or every
``Timings.reregister_interval`` when that is set.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tspd.core.bootstrap import (
    BootstrapState,
    HttpReply,
    ParallelInfo,
    RankInfo,
    encode_route_payload,
    parse_parallel_info,
    parse_rank_info,
)
from tspd.core.errors import TspdError

__all__ = ["BootstrapServer"]

PORT = 8998


@dataclass(slots=True)
class BootstrapServer:
    """The bootstrap server of Prefill instance ``instance``."""

    instance: int
    host: str
    state: BootstrapState = field(default_factory=BootstrapState)
    up: bool = True
    puts: int = 0
    #: Bumped at each crash: an exchange begun with an older one gets no answer.
    incarnation: int = 0
    crashes: int = 0

    @property
    def name(self) -> str:
        """The process name, for timelines."""
        return f"b{self.instance}"

    @property
    def addr(self) -> str:
        """Its ``host:port``, the bootstrap address requests carry."""
        return f"{self.host}:{PORT}"

    def answers(self, incarnation: int) -> bool:
        """Whether an exchange begun while incarnation ``incarnation`` ran gets its
        answer now (the server is up and has not restarted since)."""
        return self.up and self.incarnation == incarnation

    def crash(self) -> None:
        """The server dies: its table is lost, requests are refused."""
        self.up = False
        self.incarnation += 1
        self.crashes += 1
        self.state = BootstrapState()

    def restart(self) -> None:
        """The server is back, with an empty table."""
        self.up = True

    def put_route(self, payload: dict[str, object]) -> HttpReply:
        """One Prefill rank's ``PUT /route``."""
        self.puts += 1
        return self.state.handle("PUT", "/route", {}, encode_route_payload(payload))

    def parallel_info(self) -> ParallelInfo | str:
        """``GET /route?engine_rank=-1&target_dp_group=-1``, parsed as Decode's client
        does: the info, or the error text the Decode core is given."""
        reply = self.state.handle(
            "GET", "/route", {"engine_rank": "-1", "target_dp_group": "-1"}, b""
        )
        if reply.status != 200:
            return f"bootstrap server answered {reply.status}: {reply.body}"
        try:
            return parse_parallel_info(reply.body)
        except TspdError as err:
            return str(err)

    def rank_info(self, engine_rank: int, dp_group: int) -> RankInfo | str:
        """``GET /route?engine_rank=..&target_dp_group=..``, parsed likewise."""
        query = {"engine_rank": str(engine_rank), "target_dp_group": str(dp_group)}
        reply = self.state.handle("GET", "/route", query, b"")
        if reply.status != 200:
            return f"bootstrap server answered {reply.status}: {reply.body}"
        try:
            return parse_rank_info(reply.body)
        except TspdError as err:
            return str(err)
