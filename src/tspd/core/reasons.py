"""Why a room failed: a typed cause and the operator's message, decided where it arises.

Every failure path of the cores builds one :class:`Failure`: a :class:`ReasonClass`
(what kind of failure it is, a small fixed set for metric labels, log fields and
traces) and the message the scheduler, the peers and the operator read. The class
is chosen by the code that detects the failure, so traces, metrics and logs read
the type and never the text: rewording a message never reclassifies it.

A timeout's stage (the metric ``tspd_room_timeouts_total`` counts timeouts by
stage) is part of its class (:attr:`Failure.timeout_stage`).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

__all__ = ["TIMEOUT_STAGES", "Failure", "ReasonClass"]


class ReasonClass(enum.StrEnum):
    """A small fixed set of failure causes, for metric labels and log fields."""

    #: Prefill: Decode never completed the pre-allocations in time.
    TIMEOUT_BOOTSTRAPPING = "timeout-bootstrapping"
    #: Decode: the KV never arrived within the waiting timeout.
    TIMEOUT_WAITING = "timeout-waiting"
    #: A write failed or the transfer could not be planned.
    TRANSFER = "transfer"
    #: The peer is gone: a dead Decode session, a lost Prefill bootstrap address.
    PEER_DEAD = "peer-dead"
    #: Decode: a Prefill rank reported the room ``Failed``.
    PEER_FAILED = "peer-failed"
    #: Another rank of this side's TP group failed the request.
    REPLICA = "replica"
    #: Prefill: the Decode session's registration was rejected.
    REGISTRATION = "registration"
    #: The pre-allocation (manifest) was invalid.
    PREALLOCATION = "preallocation"
    #: Decode: a bootstrap-server lookup failed.
    BOOTSTRAP = "bootstrap"
    #: Decode: the Prefill instance's layout or topology cannot be served.
    INCOMPATIBLE = "incompatible"
    #: A peer broke the protocol (completion before the route, unexpected rank...).
    PROTOCOL = "protocol"
    #: The engine aborted the request (EPD give-up, explicit abort).
    ABORTED = "aborted"
    #: Prefill: the room was never claimed by a request on this rank.
    UNCLAIMED = "unclaimed"
    #: A test's fault injection (``DISAGGREGATION_TEST_FAILURE_PROB``) failed it.
    INJECTED = "injected"
    #: A cause outside this list (kept for peers' and tools' sake; the cores never
    #: produce it).
    OTHER = "other"


#: The timeout classes and their stage names.
TIMEOUT_STAGES: Final[Mapping[ReasonClass, str]] = MappingProxyType(
    {
        ReasonClass.TIMEOUT_BOOTSTRAPPING: "bootstrapping",
        ReasonClass.TIMEOUT_WAITING: "waiting_for_input",
    }
)


@dataclass(frozen=True, slots=True)
class Failure:
    """One failure: its class and the message everyone reads (the room's reason)."""

    cls: ReasonClass
    message: str

    @property
    def timeout_stage(self) -> str | None:
        """``"bootstrapping"`` or ``"waiting_for_input"`` for a timeout, else ``None``."""
        return TIMEOUT_STAGES.get(self.cls)

    def __str__(self) -> str:
        return self.message
