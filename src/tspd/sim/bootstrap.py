"""A simulated bootstrap server: the real sans-IO state behind a simulated HTTP.

Each Prefill instance has one, on a host of its own. Prefill ranks ``PUT`` their
route when they start (and again after a restart, with their new control port);
Decode ranks ``GET`` the parallel info and rank endpoints and heartbeat
``/health`` (docs/protocol.md#proto-bootstrap-routes). Requests go through
:class:`~tspd.core.bootstrap.BootstrapState` exactly as the HTTP shell hands them
over, and replies are parsed with the clients' own parsers, so a refusal reaches
the Decode core as the error text the shell would pass.
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

    @property
    def name(self) -> str:
        """The process name, for timelines."""
        return f"b{self.instance}"

    @property
    def addr(self) -> str:
        """Its ``host:port``, the bootstrap address requests carry."""
        return f"{self.host}:{PORT}"

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
