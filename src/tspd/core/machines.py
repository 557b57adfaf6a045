"""The state machines of tspd, declared once as plain data and compiled to lookup tables.

Each machine is a :class:`MachineDeclaration` written in the vocabulary of the
``transitions`` package (``states``, ``initial`` and a list of
``{"trigger", "source", "dest"}`` dicts) so that ``transitions.Machine(**decl.as_kwargs())``
and its diagram support accept it unchanged. The core itself never imports
``transitions``: a ``Machine`` costs ~7.5 µs a trigger against ~0.2 µs for a dict
lookup (measured), so the hot path uses :class:`CompiledMachine`, a
``{(state, trigger): next_state}`` table built from the same declaration
(docs/state-machines.md).
``tests/core/test_machines.py`` drives a real ``transitions.Machine`` and the
compiled table through every (state, trigger) pair and requires identical outcomes.

Machines:

* :data:`PREFILL_ROOM` — one room on one Prefill rank
  (docs/protocol.md#proto-prefill-room-table).
* :data:`DECODE_ROOM` — one room on one Decode rank
  (docs/protocol.md#proto-decode-room-table).
* :data:`PREFILL_TRANSFER` — the outgoing transfer of one room on one Prefill rank:
  the sub-states of ``Bootstrapped`` (streaming layerwise chunks, the final chunk
  with the workers, written and waiting for the bootstrap token)
  (docs/protocol.md#proto-prefill-room-table).
* :data:`REQUEST` — one request a scheduler tracks on one rank, either side: how
  this rank's value for it concludes (room outcome, bootstrap or waiting timeout,
  injected fault) and how the group's agreed value ends it
  (docs/protocol.md#proto-prefill-poll, docs/protocol.md#proto-decode-poll).
* :data:`PREFILL_ADDRESS_HEALTH` — a Decode rank's view of one Prefill bootstrap
  address, driven by heartbeats (docs/protocol.md#proto-failure-prefill-death);
  reaching ``dead`` is what fails the address's rooms.

Room rules kept by the tables: ``Failed`` is sticky (every trigger from ``Failed``
stays ``Failed``, except those that end the room: ``forget``, and on Prefill
``ttl_expired``); other progress is monotonic (no trigger moves a room back to an
earlier status); a terminal room is forgotten (→ ``Absent``, i.e. no entry at all).
A timeout does not change a room's status (its peers may still report it): it
concludes the *request* ``Failed`` (:data:`REQUEST`), and the conclusion fails the
room. A (state, trigger) pair missing from a table is a driver bug and raises
:class:`~tspd.core.errors.ProtocolError`.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final

from tspd.core.errors import ProtocolError
from tspd.core.poll import TransferPoll

__all__ = [
    "DECODE_ROOM",
    "DECODE_ROOM_TABLE",
    "PREFILL_ADDRESS_HEALTH",
    "PREFILL_ADDRESS_HEALTH_TABLE",
    "PREFILL_ROOM",
    "PREFILL_ROOM_TABLE",
    "PREFILL_TRANSFER",
    "PREFILL_TRANSFER_TABLE",
    "REQUEST",
    "REQUEST_TABLE",
    "AddressHealth",
    "CompiledMachine",
    "DecodeTrigger",
    "HealthTrigger",
    "MachineDeclaration",
    "PrefillTrigger",
    "RequestState",
    "RequestTrigger",
    "RoomState",
    "TransferState",
    "TransferTrigger",
    "compile_machine",
    "fire_request",
    "fire_transfer",
]


class RoomState(enum.StrEnum):
    """A room's state on either side. ``ABSENT`` means "no entry": the room was never
    seen, or it ended and was forgotten. The others are the :class:`TransferPoll`
    values of the same name. Neither side ever sets ``Transferring`` itself
    (docs/protocol.md#proto-transfer-poll); a Decode room takes it when an expected
    Prefill rank reports it after the pre-allocation
    (docs/protocol.md#proto-decode-room-table; TokenSpeed's Prefill never sends it,
    other implementations may)."""

    ABSENT = "Absent"
    BOOTSTRAPPING = "Bootstrapping"
    BOOTSTRAPPED = "Bootstrapped"
    WAITING_FOR_INPUT = "WaitingForInput"
    TRANSFERRING = "Transferring"
    SUCCESS = "Success"
    FAILED = "Failed"

    @property
    def poll(self) -> TransferPoll | None:
        """The status this state reports in polls and on the wire; ``None`` when absent."""
        return _POLL_OF_STATE[self]


_POLL_OF_STATE: Final[Mapping[RoomState, TransferPoll | None]] = MappingProxyType(
    {
        RoomState.ABSENT: None,
        RoomState.BOOTSTRAPPING: TransferPoll.BOOTSTRAPPING,
        RoomState.BOOTSTRAPPED: TransferPoll.BOOTSTRAPPED,
        RoomState.WAITING_FOR_INPUT: TransferPoll.WAITING_FOR_INPUT,
        RoomState.TRANSFERRING: TransferPoll.TRANSFERRING,
        RoomState.SUCCESS: TransferPoll.SUCCESS,
        RoomState.FAILED: TransferPoll.FAILED,
    }
)


class PrefillTrigger(enum.StrEnum):
    """What happens to a room on a Prefill rank (docs/protocol.md#proto-prefill-room-table)."""

    #: The scheduler registered the room's request on this rank.
    REGISTER = "register"
    #: A pre-allocation was accepted; the room's destination set is not complete yet.
    PREALLOCATE = "preallocate"
    #: A pre-allocation completed a valid destination fan-out.
    FANOUT_COMPLETE = "fanout_complete"
    #: Every write of the room is done and its destinations were told.
    TRANSFER_SUCCEEDED = "transfer_succeeded"
    #: A transfer failure, a rejected or dead session, an invalid pre-allocation, or
    #: the group concluding the request ``Failed`` (another rank failed it, or its
    #: bootstrap timeout fired: :data:`REQUEST`).
    FAIL = "fail"
    #: The scheduler aborted the room (EPD give-up, explicit abort).
    ABORT = "abort"
    #: The room's request ended and its final event was processed.
    FORGET = "forget"
    #: No request on this rank claimed the room within the unclaimed-room TTL (the
    #: bootstrap timeout), or the unclaimed table was full: it is dropped, its
    #: destinations told ``Failed`` unless the room had failed.
    TTL_EXPIRED = "ttl_expired"


class DecodeTrigger(enum.StrEnum):
    """What happens to a room on a Decode rank (docs/protocol.md#proto-decode-room-table)."""

    #: The scheduler registered the request (its receiver was created).
    REGISTER = "register"
    #: The route is planned, every target's info is known and registrations went out.
    ROUTED = "routed"
    #: The manifest was validated and every pre-allocation went out.
    PREALLOCATED = "preallocated"
    #: An expected Prefill rank reported ``Transferring`` (a status other than
    #: ``Success``/``Failed``, a monotonic update:
    #: docs/protocol.md#proto-decode-room-table). A room this rank has pre-allocated
    #: moves to ``Transferring``; an earlier one keeps its state, since planning the
    #: route and pre-allocating are this rank's own steps and a peer's report cannot
    #: skip them; ``Success`` and ``Failed`` stay. The other statuses before ``Success``
    #: are never ahead of a pre-allocated room, so they change nothing and need no
    #: trigger.
    TRANSFERRING = "transferring"
    #: ``Success`` from an expected Prefill rank; the completion set is not full yet.
    RANK_DONE = "rank_done"
    #: ``Success`` completing the expected Prefill rank set.
    COMPLETED = "completed"
    #: Any failure with a reason (bootstrap fetches, planning, status, wrong rank...).
    FAIL = "fail"
    #: The room's Prefill address died (:data:`PREFILL_ADDRESS_HEALTH` reached
    #: ``dead``), or the Prefill rank restarted (its control endpoint moved).
    PREFILL_LOST = "prefill_lost"
    #: The room ended (terminal event processed).
    FORGET = "forget"


class TransferState(enum.StrEnum):
    """The outgoing transfer of a room on a Prefill rank (:data:`PREFILL_TRANSFER`):
    what ``Bootstrapped`` is made of until the room reports ``Success``. The room's
    status stays ``Bootstrapped`` meanwhile (TokenSpeed's Prefill reports nothing
    between ``Bootstrapped`` and ``Success``)."""

    #: No chunk went to the transfer workers yet.
    ABSENT = "Absent"
    #: Layerwise: chunks are armed on the producer steps; the final one is not.
    STREAMING = "Streaming"
    #: Layerwise: the final chunk is with the workers.
    FINAL_IN_FLIGHT = "FinalInFlight"
    #: Layerwise: every chunk is written; ``Success`` waits for the bootstrap token.
    AWAITING_TOKEN = "AwaitingToken"
    #: Layerwise: ``Success`` went to the destinations (a late token is kept).
    STREAMED = "Streamed"
    #: Full transfer: the room's one chunk is with the workers.
    SENDING = "Sending"


class TransferTrigger(enum.StrEnum):
    """What happens to a Prefill room's outgoing transfer."""

    #: A layerwise chunk other than the final one was armed.
    ARM_CHUNK = "arm_chunk"
    #: The final layerwise chunk was armed.
    ARM_FINAL_CHUNK = "arm_final_chunk"
    #: The hand-over planned a full transfer and gave it to the workers.
    HAND_OVER = "hand_over"
    #: The final chunk is written and the bootstrap token has not arrived.
    WRITTEN = "written"
    #: ``Success`` went to every destination (written, token known).
    REPORTED = "reported"
    #: The room failed or ended: nothing more goes out.
    STOPPED = "stopped"


class RequestState(enum.StrEnum):
    """A tracked request on one rank, either side (:data:`REQUEST`). While
    ``Registered`` or ``Announced`` the rank's poll value follows the room's status;
    from ``SucceededUnannounced``, ``Succeeded`` or ``Failed`` on it is fixed."""

    ABSENT = "Absent"
    #: Tracked; the scheduler has not had its ``Bootstrapped`` event yet.
    REGISTERED = "Registered"
    #: The scheduler had its ``Bootstrapped`` event.
    ANNOUNCED = "Announced"
    #: This rank concluded ``Success`` before the group announced ``Bootstrapped``:
    #: the announcement comes first, ``Success`` on a later poll.
    SUCCEEDED_UNANNOUNCED = "SucceededUnannounced"
    #: This rank concluded ``Success``; the group's agreement ends the request.
    SUCCEEDED = "Succeeded"
    #: This rank concluded ``Failed``; the group's MIN fails it at the next poll.
    FAILED = "Failed"


class RequestTrigger(enum.StrEnum):
    """What happens to a tracked request (docs/protocol.md#proto-prefill-poll,
    docs/protocol.md#proto-decode-poll)."""

    #: The scheduler registered the request on this rank.
    REGISTER = "register"
    #: The group's agreed value is ``Bootstrapped`` or later: ``Bootstrapped`` event.
    ANNOUNCE = "announce"
    #: The poll saw the room ``Success``.
    ROOM_SUCCEEDED = "room_succeeded"
    #: The poll saw the room ``Failed`` (or gone).
    ROOM_FAILED = "room_failed"
    #: Prefill: the room was still ``Bootstrapping`` a bootstrap timeout after the
    #: request was registered.
    BOOTSTRAP_TIMEOUT = "bootstrap_timeout"
    #: Decode: the room was still ``WaitingForInput``/``Transferring`` a waiting
    #: timeout after its pre-allocation.
    WAITING_TIMEOUT = "waiting_timeout"
    #: Poll-time fault injection (tests only) failed the request.
    FAULT_INJECTED = "fault_injected"
    #: The group agreed ``Success``: ``Succeeded``/``RemotePrefillDone`` event, forgotten.
    GROUP_SUCCEEDED = "group_succeeded"
    #: The group agreed ``Failed`` (any rank failed it): ``Failed`` event, forgotten.
    GROUP_FAILED = "group_failed"


class AddressHealth(enum.StrEnum):
    """A Prefill bootstrap address as a Decode rank's heartbeat sees it
    (docs/protocol.md#proto-failure-prefill-death)."""

    HEALTHY = "healthy"
    SUSPECT = "suspect"
    DEAD = "dead"


class HealthTrigger(enum.StrEnum):
    """Heartbeat outcomes for one Prefill bootstrap address."""

    #: ``GET /health`` answered 200: the failure count resets.
    BEAT_OK = "beat_ok"
    #: A heartbeat failed, still below the maximum consecutive failures.
    BEAT_FAILED = "beat_failed"
    #: The consecutive failures reached the maximum: the address is dead.
    GIVE_UP = "give_up"


@dataclass(frozen=True, slots=True)
class MachineDeclaration:
    """A state machine as plain data in ``transitions``' vocabulary.

    ``transitions`` holds one ``{"trigger", "source", "dest"}`` dict per allowed
    (source, trigger) pair; a pair not listed is not allowed.
    """

    name: str
    states: tuple[str, ...]
    initial: str
    triggers: tuple[str, ...]
    transitions: tuple[Mapping[str, str], ...]

    def as_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``transitions.Machine``: fresh lists and dicts."""
        return {
            "states": list(self.states),
            "transitions": [dict(t) for t in self.transitions],
            "initial": self.initial,
        }


@dataclass(frozen=True, slots=True)
class CompiledMachine:
    """The hot-path form of a :class:`MachineDeclaration`: one dict lookup per trigger."""

    name: str
    states: frozenset[str]
    triggers: frozenset[str]
    table: Mapping[tuple[str, str], str]

    def allowed(self, state: str, trigger: str) -> bool:
        """Whether ``trigger`` may fire in ``state``."""
        return (state, trigger) in self.table

    def fire(self, state: str, trigger: str) -> str:
        """The state ``trigger`` leads to from ``state``.

        Raises :class:`ProtocolError` when the pair is not allowed: the caller drove
        the machine out of order, which is a bug in the caller, not in a peer.
        """
        try:
            return self.table[(state, trigger)]
        except KeyError:
            raise ProtocolError(
                f"{self.name}: trigger {str(trigger)!r} is not allowed in state {str(state)!r}"
            ) from None


def compile_machine(declaration: MachineDeclaration) -> CompiledMachine:
    """Build the lookup table of ``declaration``, checking it is well formed."""
    states = frozenset(declaration.states)
    triggers = frozenset(declaration.triggers)
    if declaration.initial not in states:
        raise ProtocolError(f"{declaration.name}: initial state is not declared")
    table: dict[tuple[str, str], str] = {}
    for transition in declaration.transitions:
        source, trigger, dest = transition["source"], transition["trigger"], transition["dest"]
        if source not in states or dest not in states or trigger not in triggers:
            raise ProtocolError(f"{declaration.name}: undeclared name in {dict(transition)}")
        if (source, trigger) in table:
            raise ProtocolError(f"{declaration.name}: {trigger!r} from {source!r} is ambiguous")
        table[(source, trigger)] = dest
    return CompiledMachine(declaration.name, states, triggers, MappingProxyType(table))


def _declare(
    name: str,
    states: Iterable[enum.StrEnum],
    initial: enum.StrEnum,
    triggers: type[enum.StrEnum],
    moves: Mapping[enum.StrEnum, Mapping[enum.StrEnum, enum.StrEnum]],
) -> MachineDeclaration:
    """Flatten ``{trigger: {source: dest}}`` into ``transitions``' list of dicts."""
    transitions = tuple(
        {"trigger": str(trigger), "source": str(source), "dest": str(dest)}
        for trigger, edges in moves.items()
        for source, dest in edges.items()
    )
    return MachineDeclaration(
        name=name,
        states=tuple(str(s) for s in states),
        initial=str(initial),
        triggers=tuple(str(t) for t in triggers),
        transitions=transitions,
    )


_S = RoomState
_P = PrefillTrigger
_D = DecodeTrigger

#: Every room state but ``Absent``: the states that have an entry.
_KNOWN: Final = (
    _S.BOOTSTRAPPING,
    _S.BOOTSTRAPPED,
    _S.WAITING_FOR_INPUT,
    _S.TRANSFERRING,
    _S.SUCCESS,
    _S.FAILED,
)
_PREFILL_KNOWN: Final = (_S.BOOTSTRAPPING, _S.BOOTSTRAPPED, _S.SUCCESS, _S.FAILED)

#: A Prefill rank's room (docs/protocol.md#proto-prefill-room-table).
#: ``WaitingForInput`` and ``Transferring`` are never set on Prefill, so the declaration
#: does not list them.
PREFILL_ROOM: Final[MachineDeclaration] = _declare(
    "PrefillRoom",
    (_S.ABSENT, *_PREFILL_KNOWN),
    _S.ABSENT,
    PrefillTrigger,
    {
        # Monotonic: pre-allocations may have completed the room first.
        _P.REGISTER: {
            _S.ABSENT: _S.BOOTSTRAPPING,
            _S.BOOTSTRAPPING: _S.BOOTSTRAPPING,
            _S.BOOTSTRAPPED: _S.BOOTSTRAPPED,
            _S.SUCCESS: _S.SUCCESS,
            _S.FAILED: _S.FAILED,
        },
        # The destination is stored; the status is unchanged (or still absent).
        # A late pre-allocation for a room already complete (or done) changes nothing.
        _P.PREALLOCATE: {s: s for s in (_S.ABSENT, *_PREFILL_KNOWN)},
        _P.FANOUT_COMPLETE: {
            _S.ABSENT: _S.BOOTSTRAPPED,
            _S.BOOTSTRAPPING: _S.BOOTSTRAPPED,
            _S.BOOTSTRAPPED: _S.BOOTSTRAPPED,
            _S.SUCCESS: _S.SUCCESS,
            _S.FAILED: _S.FAILED,
        },
        _P.TRANSFER_SUCCEEDED: {_S.BOOTSTRAPPED: _S.SUCCESS, _S.FAILED: _S.FAILED},
        # Failed always wins, even over Success, and even before any state.
        _P.FAIL: {s: _S.FAILED for s in (_S.ABSENT, *_PREFILL_KNOWN)},
        _P.ABORT: {s: _S.FAILED for s in (_S.ABSENT, *_PREFILL_KNOWN)},
        _P.FORGET: {s: _S.ABSENT for s in (_S.ABSENT, *_PREFILL_KNOWN)},
        _P.TTL_EXPIRED: {s: _S.ABSENT for s in (_S.ABSENT, *_PREFILL_KNOWN)},
    },
)

#: A Decode rank's room (docs/protocol.md#proto-decode-room-table).
DECODE_ROOM: Final[MachineDeclaration] = _declare(
    "DecodeRoom",
    (_S.ABSENT, *_KNOWN),
    _S.ABSENT,
    DecodeTrigger,
    {
        _D.REGISTER: {_S.ABSENT: _S.BOOTSTRAPPING, _S.FAILED: _S.FAILED},
        _D.ROUTED: {_S.BOOTSTRAPPING: _S.BOOTSTRAPPED, _S.FAILED: _S.FAILED},
        _D.PREALLOCATED: {_S.BOOTSTRAPPED: _S.WAITING_FOR_INPUT, _S.FAILED: _S.FAILED},
        # A Prefill rank's progress report: monotonic, and never ahead of this rank's
        # own pre-allocation (see DecodeTrigger.TRANSFERRING).
        _D.TRANSFERRING: {
            _S.BOOTSTRAPPING: _S.BOOTSTRAPPING,
            _S.BOOTSTRAPPED: _S.BOOTSTRAPPED,
            _S.WAITING_FOR_INPUT: _S.TRANSFERRING,
            _S.TRANSFERRING: _S.TRANSFERRING,
            _S.SUCCESS: _S.SUCCESS,
            _S.FAILED: _S.FAILED,
        },
        # A partial completion changes nothing but the completion set.
        _D.RANK_DONE: {s: s for s in _KNOWN},
        _D.COMPLETED: {
            _S.BOOTSTRAPPING: _S.SUCCESS,
            _S.BOOTSTRAPPED: _S.SUCCESS,
            _S.WAITING_FOR_INPUT: _S.SUCCESS,
            _S.TRANSFERRING: _S.SUCCESS,
            _S.SUCCESS: _S.SUCCESS,
            _S.FAILED: _S.FAILED,
        },
        _D.FAIL: {s: _S.FAILED for s in _KNOWN},
        # A room that already succeeded keeps its KV when its Prefill dies.
        _D.PREFILL_LOST: {
            _S.BOOTSTRAPPING: _S.FAILED,
            _S.BOOTSTRAPPED: _S.FAILED,
            _S.WAITING_FOR_INPUT: _S.FAILED,
            _S.TRANSFERRING: _S.FAILED,
            _S.SUCCESS: _S.SUCCESS,
            _S.FAILED: _S.FAILED,
        },
        _D.FORGET: {s: _S.ABSENT for s in (_S.ABSENT, *_KNOWN)},
    },
)

_X = TransferState
_Y = TransferTrigger

#: A Prefill room's outgoing transfer (docs/protocol.md#proto-prefill-room-table):
#: layerwise chunks stream on the producer steps, the final one is written, and
#: ``Success`` goes out once the bootstrap token is known (the hand-over may bring it
#: before or after the final chunk is written); a full transfer is one chunk.
#: ``stopped`` (the room failed, or ended) drops it from any state.
PREFILL_TRANSFER: Final[MachineDeclaration] = _declare(
    "PrefillTransfer",
    TransferState,
    _X.ABSENT,
    TransferTrigger,
    {
        _Y.ARM_CHUNK: {_X.ABSENT: _X.STREAMING, _X.STREAMING: _X.STREAMING},
        _Y.ARM_FINAL_CHUNK: {_X.ABSENT: _X.FINAL_IN_FLIGHT, _X.STREAMING: _X.FINAL_IN_FLIGHT},
        _Y.HAND_OVER: {_X.ABSENT: _X.SENDING},
        _Y.WRITTEN: {_X.FINAL_IN_FLIGHT: _X.AWAITING_TOKEN},
        _Y.REPORTED: {
            _X.FINAL_IN_FLIGHT: _X.STREAMED,
            _X.AWAITING_TOKEN: _X.STREAMED,
            _X.SENDING: _X.ABSENT,
        },
        _Y.STOPPED: {s: _X.ABSENT for s in TransferState},
    },
)

_R = RequestState
_Q = RequestTrigger
_OPEN: Final = (_R.REGISTERED, _R.ANNOUNCED)

#: A tracked request on one rank, either side (docs/protocol.md#proto-prefill-poll,
#: docs/protocol.md#proto-decode-poll). Every poll, each rank computes a value per
#: request (the room's status while open, the concluded value after) and the group
#: agrees on the element-wise MIN; ``conclude`` fires ``announce``,
#: ``group_succeeded`` or ``group_failed`` from the agreed value. A MIN can be
#: ``Success`` only when every rank concluded ``Success``, so ``group_succeeded``
#: comes only from ``Succeeded``; any rank's ``Failed`` ends every rank's request.
REQUEST: Final[MachineDeclaration] = _declare(
    "Request",
    RequestState,
    _R.ABSENT,
    RequestTrigger,
    {
        _Q.REGISTER: {_R.ABSENT: _R.REGISTERED},
        _Q.ANNOUNCE: {
            _R.REGISTERED: _R.ANNOUNCED,
            _R.SUCCEEDED_UNANNOUNCED: _R.SUCCEEDED,
        },
        _Q.ROOM_SUCCEEDED: {
            _R.REGISTERED: _R.SUCCEEDED_UNANNOUNCED,
            _R.ANNOUNCED: _R.SUCCEEDED,
        },
        _Q.ROOM_FAILED: {s: _R.FAILED for s in _OPEN},
        _Q.BOOTSTRAP_TIMEOUT: {s: _R.FAILED for s in _OPEN},
        _Q.WAITING_TIMEOUT: {s: _R.FAILED for s in _OPEN},
        _Q.FAULT_INJECTED: {s: _R.FAILED for s in _OPEN},
        _Q.GROUP_SUCCEEDED: {_R.SUCCEEDED: _R.ABSENT},
        _Q.GROUP_FAILED: {s: _R.ABSENT for s in RequestState if s is not _R.ABSENT},
    },
)

_H = AddressHealth
_T = HealthTrigger

#: A Prefill bootstrap address seen from a Decode rank's heartbeat
#: (docs/protocol.md#proto-failure-prefill-death).
#: ``give_up`` fires on the ``heartbeat_max_failures``-th failure in a row
#: (``TOKENSPEED_PD_HEARTBEAT_MAX_FAILURES``). ``dead`` is terminal and is what
#: fails the address's rooms not yet ``Success`` (``prefill_lost`` on
#: :data:`DECODE_ROOM`): its cached info, routes and registrations are dropped, and
#: the next request for it starts a fresh, ``healthy`` entry.
PREFILL_ADDRESS_HEALTH: Final[MachineDeclaration] = _declare(
    "PrefillAddressHealth",
    AddressHealth,
    _H.HEALTHY,
    HealthTrigger,
    {
        _T.BEAT_OK: {_H.HEALTHY: _H.HEALTHY, _H.SUSPECT: _H.HEALTHY},
        _T.BEAT_FAILED: {_H.HEALTHY: _H.SUSPECT, _H.SUSPECT: _H.SUSPECT},
        _T.GIVE_UP: {_H.HEALTHY: _H.DEAD, _H.SUSPECT: _H.DEAD},
    },
)

PREFILL_ROOM_TABLE: Final[CompiledMachine] = compile_machine(PREFILL_ROOM)
DECODE_ROOM_TABLE: Final[CompiledMachine] = compile_machine(DECODE_ROOM)
PREFILL_ADDRESS_HEALTH_TABLE: Final[CompiledMachine] = compile_machine(PREFILL_ADDRESS_HEALTH)
REQUEST_TABLE: Final[CompiledMachine] = compile_machine(REQUEST)
PREFILL_TRANSFER_TABLE: Final[CompiledMachine] = compile_machine(PREFILL_TRANSFER)

#: :data:`REQUEST_TABLE` with its destinations as members, for the per-request loops.
_REQUEST_NEXT: Final[Mapping[tuple[str, str], RequestState]] = MappingProxyType(
    {key: RequestState(dest) for key, dest in REQUEST_TABLE.table.items()}
)


_TRANSFER_NEXT: Final[Mapping[tuple[str, str], TransferState]] = MappingProxyType(
    {key: TransferState(dest) for key, dest in PREFILL_TRANSFER_TABLE.table.items()}
)


def fire_transfer(state: TransferState, trigger: TransferTrigger) -> TransferState:
    """The state ``trigger`` moves a Prefill room's transfer to
    (:data:`PREFILL_TRANSFER`); raises :class:`ProtocolError` for a pair the machine
    does not allow."""
    new = _TRANSFER_NEXT.get((state, trigger))
    if new is None:
        return TransferState(PREFILL_TRANSFER_TABLE.fire(state, trigger))
    return new


def fire_request(state: RequestState, trigger: RequestTrigger) -> RequestState:
    """The state ``trigger`` moves a tracked request to (:data:`REQUEST`); raises
    :class:`ProtocolError` for a pair the machine does not allow."""
    new = _REQUEST_NEXT.get((state, trigger))
    if new is None:
        return RequestState(REQUEST_TABLE.fire(state, trigger))
    return new
