"""``tspd bench hostile``: what a flood of hostile input costs the peers, and what they send back.

Live victims, each in its own process on 127.0.0.1 (:mod:`tspd.bench.victims`): the
bootstrap server, a Prefill rank and a Decode rank on the real Mooncake engine, and a
KV-event publisher with a subscriber bound for it. First a batch of good rooms
(bytes verified) and a snapshot of every process; then the attack — by default
1,000,000 messages from a seeded generator (:class:`HostileInput`), spread over every
receiving socket:

* the Prefill control PULL: random frames, truncated and extended registrations,
  registrations with one field made bad (endpoints such as ``*``, ``foo bar``, a
  300-character host; non-canonical, negative and huge numbers; broken, mutated and
  oversized contracts), valid registrations from ever new sessions whose reply
  endpoints the attacker chose (its own PULL sockets, which count every reply, or
  closed ports), conflicting re-registrations, pre-allocations with bad rooms,
  unknown sessions, broken, mutated, rendezvous-only and valid manifests, messages
  of too many frames and frames over the socket's size limit;
* the Decode status PULL: random frames, statuses with huge, negative and
  non-canonical numbers, candidate frames of every size up to over the limit, valid
  statuses for rooms no one asked about;
* the KV-event publisher's replay ROUTER (malformed requests, replays from 0 and from
  past the end, from several identities) and the subscriber's bound SUB (a second
  publisher: garbage, short sequence numbers, sequence jumps);
* the bootstrap server, at a lower rate over raw TCP: bad methods and paths, bad JSON,
  giant ``world_size``, bad ``rank_ip``, bad queries, malformed HTTP, oversized heads
  and bodies, and requests that stop half-way and hold their connection.

Then the same good rooms again, and the figures: messages/s absorbed (from the first
send until every victim is idle again), crashes (a victim that is not alive or does
not answer), RSS and descriptors of each process before and after, its log output
(lines and bytes it would have written at the ``tspd`` commands' default level,
WARNING), its tables, and what came back to the attacker: status messages arriving
at reply endpoints the attacker advertised (an amplification figure) and replayed
KV batches. Figures only; nothing here asserts anything.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import struct
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, final

import click
import zmq

from tspd.bench.victims import GOOD_ROOMS, Victim, close_all, wait_idle
from tspd.core import wire
from tspd.core.bootstrap import build_route_payload
from tspd.core.contract import CacheContract, parse_contract
from tspd.core.errors import WireError
from tspd.core.manifest import build_manifest
from tspd.core.poll import TransferPoll

__all__ = [
    "Attack",
    "AttackFigures",
    "HostileInput",
    "HttpAttack",
    "Targets",
    "hostile",
    "render",
    "report",
    "run_hostile_bench",
]

#: Rooms the attacker never names (the good traffic's).
_GOOD = range(GOOD_ROOMS, GOOD_ROOMS + 10**9)

_BAD_ENDPOINTS: Final = (
    b"*",
    b"foo bar",
    b"h" * 300,
    b"h" * 254,
    b"::1",
    b"[::1]:5000",
    b"",
    b"\xff\xfe",
    b"127.0.0.1\x00",
    b"-bad-.example",
    b"1.2.3.999",
    b"tcp://127.0.0.1",
    b":5000",
    b"a..b",
    b"x" * 64 + b".example",
    b"127.0.0.1\n",
    b"\t",
)
_BAD_UINTS: Final = (
    b"",
    b"-1",
    b"0",
    b"00",
    b"01",
    b"+1",
    b" 1",
    b"1 ",
    b"1_0",
    b"0x10",
    b"1e3",
    "\u0663".encode(),
    b"9" * 20,
    b"9" * 400,
    b"18446744073709551616",
    b"65536",
    b"99999",
    b"NaN",
    b"-0",
)
_BAD_SESSIONS: Final = (b"", b"s" * 513, b"\xff\xfe", "s\u00e9".encode())
_JSON_JUNK: Final[tuple[Any, ...]] = (
    -1,
    0,
    2**70,
    -(2**70),
    1e308,
    "x",
    "",
    None,
    True,
    [],
    {},
    [1, 2, 3],
    {"a": 1},
)


@dataclass(frozen=True, slots=True)
class Targets:
    """Where the victims listen (``None``: not attacked) and the contract the Prefill
    registered (valid registrations and manifests are built for it)."""

    contract: bytes
    control_port: int | None = None
    status_port: int | None = None
    bootstrap: str | None = None
    replay: str | None = None
    live: str | None = None
    prefill_control: str = "127.0.0.1"


@final
class HostileInput:
    """A seeded source of hostile messages (see the module doc for the kinds).

    ``sinks`` are ports of the attacker's own PULL sockets and ``closed`` ports that
    refuse connections: the reply endpoints valid registrations advertise.
    :attr:`kinds` counts what was generated, by ``socket:kind``.
    """

    def __init__(
        self,
        seed: int,
        contract: bytes,
        *,
        sinks: Sequence[int],
        closed: Sequence[int],
    ) -> None:
        self.rng = random.Random(seed)
        self.contract_bytes = contract
        self.contract: CacheContract = parse_contract(contract)
        self._tree: dict[str, Any] = json.loads(contract)
        self._sinks = list(sinks) or [1]
        self._closed = list(closed) or [1]
        self._next_session = 0
        #: Valid sessions registered so far (recent ones; bounded) -> their port.
        self.sessions: dict[str, int] = {}
        self.kinds: Counter[str] = Counter()
        gid = self.contract.group_ids[0]
        self._pages = self.contract.page_count(gid) - 1
        self._gid = gid
        self._grain = min(spec.block_granularity for spec in self.contract.group_specs)
        self._control: list[tuple[Callable[[], list[bytes]], int]] = [
            (self._random_frames, 8),
            (self._registration_truncated, 4),
            (self._registration_extended, 4),
            (self._registration_bad_field, 14),
            (self._registration_bad_contract, 6),
            (self._registration_valid, 10),
            (self._registration_conflicting, 3),
            (self._preallocation_bad_numbers, 8),
            (self._preallocation_unknown_session, 8),
            (self._preallocation_garbage_manifest, 10),
            (self._preallocation_mutated_manifest, 8),
            (self._preallocation_dummy, 3),
            (self._preallocation_valid, 6),
            (self._too_many_frames, 2),
        ]
        self._control_weights = [w for _, w in self._control]
        self._status: list[tuple[Callable[[], list[bytes]], int]] = [
            (self._random_frames, 10),
            (self._status_bad_numbers, 30),
            (self._status_candidates, 10),
            (self._status_valid_unknown_room, 15),
            (self._status_frame_count, 8),
            (self._too_many_frames, 2),
        ]
        self._status_weights = [w for _, w in self._status]

    # -- helpers -------------------------------------------------------------------

    def _bytes(self, low: int = 0, high: int = 64) -> bytes:
        return self.rng.randbytes(self.rng.randint(low, high))

    def _room(self) -> int:
        r = self.rng.random()
        if r < 0.6:
            room = self.rng.randrange(0, 1_000_000)
        elif r < 0.95:
            room = self.rng.randrange(0, wire.MAX_ROOM + 1)
        else:
            room = wire.MAX_ROOM
        return room if room not in _GOOD else room + len(_GOOD)

    def _new_session(self) -> str:
        self._next_session += 1
        n = self._next_session
        return f"10.{(n >> 16) & 255}.{(n >> 8) & 255}.{n & 255}:{1024 + n % 60000}"

    def _reply_port(self) -> int:
        pool = self._sinks if self.rng.random() < 0.7 else self._closed
        return self.rng.choice(pool)

    def _registration(self, session: str | None = None, port: int | None = None) -> list[bytes]:
        return [
            wire.REGISTRATION_MARKER,
            self.rng.choice((b"127.0.0.1", b"127.0.0.1", b"localhost", b"127.0.0.1:9")),
            b"%d" % (port if port is not None else self._reply_port()),
            (session if session is not None else self._new_session()).encode(),
            struct.pack("<Q", self.rng.randrange(1, 2**64)),
            self.contract_bytes,
            b"1",
            b"0",
        ]

    def _known_session(self) -> str | None:
        if not self.sessions:
            return None
        # dicts keep insertion order; a random recent one is enough
        keys = list(self.sessions)[-64:]
        return self.rng.choice(keys)

    def _manifest(self) -> bytes:
        pages = self.rng.randint(1, 3)
        blocks = self.rng.sample(range(1, self._pages + 1), pages)
        prompt = pages * self._grain - self.rng.randrange(self._grain)
        return build_manifest(self.contract, {self._gid: blocks}, 0, prompt).to_json()

    def _mutate_json(self, tree: Any, depth: int = 0) -> Any:
        """``tree`` with one value somewhere replaced, removed or duplicated."""
        if isinstance(tree, dict) and tree:
            key = self.rng.choice(list(tree))
            out = dict(tree)
            r = self.rng.random()
            if r < 0.2 or depth > 6:
                del out[key]
            elif r < 0.6:
                out[key] = self.rng.choice(_JSON_JUNK)
            else:
                out[key] = self._mutate_json(tree[key], depth + 1)
            return out
        if isinstance(tree, list) and tree:
            index = self.rng.randrange(len(tree))
            out_list = list(tree)
            if self.rng.random() < 0.5 or depth > 6:
                out_list[index] = self.rng.choice(_JSON_JUNK)
            else:
                out_list[index] = self._mutate_json(tree[index], depth + 1)
            return out_list
        return self.rng.choice(_JSON_JUNK)

    # -- Prefill control socket ---------------------------------------------------------

    def control(self) -> list[bytes]:
        """One message for the Prefill control socket."""
        (make,) = self.rng.choices(
            [m for m, _ in self._control], weights=self._control_weights, k=1
        )
        self.kinds["control:" + make.__name__.strip("_")] += 1
        return make()

    def _random_frames(self) -> list[bytes]:
        frames = [self._bytes() for _ in range(self.rng.randint(0, 12))]
        if frames and self.rng.random() < 0.3:
            frames[0] = wire.REGISTRATION_MARKER
        return frames or [b""]

    def _too_many_frames(self) -> list[bytes]:
        return [self._bytes(0, 8) for _ in range(self.rng.randint(17, 200))]

    def _registration_truncated(self) -> list[bytes]:
        return self._registration()[: self.rng.randint(1, 7)]

    def _registration_extended(self) -> list[bytes]:
        return self._registration() + [self._bytes() for _ in range(self.rng.randint(1, 8))]

    def _registration_bad_field(self) -> list[bytes]:
        frames = self._registration()
        index = self.rng.choice((1, 1, 1, 2, 2, 3, 4, 4, 6, 6, 7, 7))
        if index == 1:
            frames[1] = self.rng.choice(_BAD_ENDPOINTS)
        elif index == 3:
            frames[3] = self.rng.choice(_BAD_SESSIONS)
        elif index == 4:
            frames[4] = self.rng.choice((b"\x00" * 8, b"\x01" * 7, b"\x01" * 9, b""))
        elif index == 7 and self.rng.random() < 0.5:
            frames[7] = b"1"  # decode_tp_rank == decode_tp_size
        else:
            frames[index] = self.rng.choice(_BAD_UINTS)
        return frames

    def _registration_bad_contract(self) -> list[bytes]:
        frames = self._registration()
        r = self.rng.random()
        if r < 0.5:
            frames[5] = json.dumps(self._mutate_json(self._tree)).encode()
        elif r < 0.65:
            frames[5] = self.contract_bytes[: self.rng.randrange(len(self.contract_bytes))]
        elif r < 0.75:
            frames[5] = b"[" * 3000 + b"]" * 3000
        elif r < 0.85:
            frames[5] = self._bytes(0, 512)
        elif r < 0.95:
            frames[5] = self.rng.choice((b"{}", b"[]", b"null", b"1", b'"x"', b"NaN"))
        else:  # over the contract bound (256 KiB) but under the frame limit
            frames[5] = b'{"plan":' + b" " * (300 * 1024) + b"}"
        return frames

    def _registration_valid(self) -> list[bytes]:
        session = self._new_session()
        port = self._reply_port()
        self.sessions[session] = port
        if len(self.sessions) > 4096:
            del self.sessions[next(iter(self.sessions))]
        return self._registration(session, port)

    def _registration_conflicting(self) -> list[bytes]:
        session = self._known_session()
        if session is None:
            return self._registration_valid()
        return self._registration(session, self._reply_port())

    def _preallocation_bad_numbers(self) -> list[bytes]:
        session = (self._known_session() or "s").encode()
        if self.rng.random() < 0.7:
            return [self.rng.choice(_BAD_UINTS), session, self._manifest()]
        return [b"%d" % self._room(), self.rng.choice(_BAD_SESSIONS), self._manifest()]

    def _preallocation_unknown_session(self) -> list[bytes]:
        return [b"%d" % self._room(), self._new_session().encode(), self._manifest()]

    def _preallocation_garbage_manifest(self) -> list[bytes]:
        session = (self._known_session() or self._new_session()).encode()
        garbage = self.rng.choice(
            (
                self._bytes(1, 256),
                b"{",
                b"[]",
                b"null",
                b"[" * 5000,
                b'{"groups":' * 2000,
                b'{"groups":[],"prefix_len":0,"prompt_len":' + b"9" * 5000 + b"}",
            )
        )
        return [b"%d" % self._room(), session, garbage]

    def _preallocation_mutated_manifest(self) -> list[bytes]:
        session = (self._known_session() or self._new_session()).encode()
        tree = json.loads(self._manifest())
        r = self.rng.random()
        if r < 0.7:
            payload = json.dumps(self._mutate_json(tree)).encode()
        elif r < 0.9:
            tree["groups"][0]["block_ids"] = [
                self.rng.choice((-1, 0, self._pages + 1, 2**63, 2**80)) for _ in range(3)
            ]
            payload = json.dumps(tree).encode()
        elif r < 0.999:
            tree["prompt_len"] = self.rng.choice((0, 2**62, -5, self._pages * self._grain * 2))
            payload = json.dumps(tree).encode()
        else:  # a manifest just under its 2 MiB bound: parsing costs
            tree["groups"][0]["block_ids"] = [1] * ((wire.MAX_MANIFEST_BYTES - 200) // 2)
            payload = json.dumps(tree, separators=(",", ":")).encode()
        return [b"%d" % self._room(), session, payload]

    def _preallocation_dummy(self) -> list[bytes]:
        session = (self._known_session() or self._new_session()).encode()
        return [b"%d" % self._room(), session, b""]

    def _preallocation_valid(self) -> list[bytes]:
        session = (self._known_session() or self._new_session()).encode()
        return [b"%d" % self._room(), session, self._manifest()]

    # -- Decode status socket ---------------------------------------------------------

    def status(self) -> list[bytes]:
        """One message for the Decode status socket."""
        (make,) = self.rng.choices([m for m, _ in self._status], weights=self._status_weights, k=1)
        self.kinds["status:" + make.__name__.strip("_")] += 1
        return make()

    def _status_frames(self) -> list[bytes]:
        message = wire.StatusMessage(
            self._room(),
            self.rng.choice(list(TransferPoll)),
            self.rng.randrange(0, 8),
            self.rng.randrange(-1, 50_000),
            tuple(self.rng.randrange(-(2**31), 2**31) for _ in range(self.rng.randint(0, 4))),
            self.rng.randrange(0, 1000),
            self.rng.choice((None, -0.5)),
        )
        return wire.encode_status(message)

    def _status_bad_numbers(self) -> list[bytes]:
        frames = self._status_frames()
        index = self.rng.choice((0, 1, 2, 3, 5, 6))
        if index == 3:
            frames[3] = self.rng.choice(
                (b"-0", b"--1", b"+5", b"18446744073709551616", b"-9223372036854775809", b"1.5")
            )
        elif index == 6:
            frames[6] = self.rng.choice(
                (b"\x00" * 7, b"\x00" * 9, b"nan", struct.pack("<d", 1e308))
            )
        elif index == 1:
            frames[1] = self.rng.choice((b"6", b"9", b"-1", b"10", b"01", b""))
        else:
            frames[index] = self.rng.choice(_BAD_UINTS)
        return frames

    def _status_candidates(self) -> list[bytes]:
        frames = self._status_frames()
        size = self.rng.choice(
            (1, 3, 5, 4 * wire.MAX_SPEC_CANDIDATES, 4 * wire.MAX_SPEC_CANDIDATES - 1, 1022)
        )
        frames[4] = self.rng.randbytes(size)
        return frames

    def _status_valid_unknown_room(self) -> list[bytes]:
        return self._status_frames()

    def _status_frame_count(self) -> list[bytes]:
        frames = self._status_frames()
        if self.rng.random() < 0.5:
            return frames[: self.rng.randint(0, 2)] or [b""]
        return frames + [self._bytes() for _ in range(self.rng.randint(1, 9))]

    # -- KV-event sockets ---------------------------------------------------------------

    def replay_request(self) -> list[bytes]:
        """One message a DEALER sends the publisher's replay ROUTER."""
        r = self.rng.random()
        if r < 0.05:
            self.kinds["replay:from_zero"] += 1
            return [b"", (0).to_bytes(8, "big")]
        if r < 0.45:
            self.kinds["replay:past_the_end"] += 1
            return [b"", self.rng.randrange(2**40, 2**64).to_bytes(8, "big")]
        if r < 0.7:
            self.kinds["replay:bad_start"] += 1
            return [b"", self._bytes(0, 16)]
        self.kinds["replay:random_frames"] += 1
        return [self._bytes() for _ in range(self.rng.choice((1, 3, 4, 5, 9)))]

    def live_message(self) -> list[bytes]:
        """One message a second publisher sends the subscriber's bound SUB."""
        r = self.rng.random()
        if r < 0.4:
            self.kinds["live:random_frames"] += 1
            return [self._bytes() for _ in range(self.rng.randint(1, 6))]
        if r < 0.6:
            self.kinds["live:short_seq"] += 1
            return [b"", self._bytes(0, 7), self._bytes()]
        seq = self.rng.choice((0, 1, 2**63, 2**64 - 1, self.rng.randrange(2**64)))
        self.kinds["live:garbage_batch"] += 1
        return [b"", seq.to_bytes(8, "big"), self._bytes(0, 256)]

    # -- bootstrap HTTP -------------------------------------------------------------

    def http(self, payload: dict[str, Any]) -> tuple[str, bytes]:
        """One raw HTTP request for the bootstrap server and its kind. ``payload`` is a
        valid ``PUT /route`` body of the instance (only made invalid here)."""
        r = self.rng.random()
        if r < 0.1:
            method = self.rng.choice(("BREW", "PROPFIND", "CONNECT", "TRACE", "DELETE", "X" * 40))
            return "bad_method", _request(method, "/route", b"")
        if r < 0.2:
            path = self.rng.choice(
                ("/../../etc/passwd", "/" + "a" * 3000, "/%00", "/route/x", "//")
            )
            return "bad_path", _request("GET", path, b"")
        if r < 0.35:
            body = self.rng.choice(
                (b"{", b"[]", b"null", b"\xff\xfe", b"[" * 20000, b'{"a":' * 5000, b"1e999")
            )
            return "bad_json", _request("PUT", "/route", body)
        if r < 0.6:
            bad = dict(payload)
            key, value = self.rng.choice(
                (
                    ("world_size", 10**30),
                    ("world_size", -1),
                    ("world_size", "2"),
                    ("world_size", 2**31),
                    ("dp_size", 0),
                    ("rank_ip", "*"),
                    ("rank_ip", "foo bar"),
                    ("rank_ip", "h" * 300),
                    ("rank_ip", "::::"),
                    ("rank_ip", None),
                    ("rank_port", 0),
                    ("rank_port", 70000),
                    ("rank_port", "80"),
                    ("engine_rank", 5),
                    ("engine_rank", -1),
                    ("cache_layout", "{}"),
                    ("cache_layout", 7),
                    ("role", "x" * 1000),
                )
            )
            bad[key] = value
            return f"bad_field_{key}", _request("PUT", "/route", json.dumps(bad).encode())
        if r < 0.7:
            tree = json.loads(payload["cache_layout"])
            bad = dict(payload, cache_layout=json.dumps(self._mutate_json(tree)))
            return "bad_contract", _request("PUT", "/route", json.dumps(bad).encode())
        if r < 0.82:
            rank, group = self.rng.choice(
                (("abc", "0"), ("-5", "0"), ("9" * 40, "0"), ("0", "9" * 40), ("", ""), ("1", "-7"))
            )
            return "bad_query", _request(
                "GET", f"/route?engine_rank={rank}&target_dp_group={group}", b""
            )
        if r < 0.92:
            raw = self.rng.choice(
                (
                    self._bytes(1, 200),
                    b"GET /health HTTP/1.1\r\nHost: x\r\nX: " + b"y" * 40_000 + b"\r\n\r\n",
                    b"PUT /route HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999\r\n\r\n",
                    b"PUT /route HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
                    b"GET /health HTTP/9.9\r\n\r\n",
                    b"\r\n\r\n\r\n",
                )
            )
            return "malformed_http", raw
        return "giant_body", _request("PUT", "/route", b"x" * (2 << 20))


def _request(method: str, path: str, body: bytes) -> bytes:
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body


# ------------------------------------------------------------------------------ the attacker


@dataclass(slots=True)
class AttackFigures:
    """What the attacker sent and got back."""

    sent: Counter[str] = field(default_factory=Counter)
    send_timeouts: Counter[str] = field(default_factory=Counter)
    #: Messages arriving at the attacker's advertised reply endpoints, by status.
    replies: Counter[str] = field(default_factory=Counter)
    #: Replayed KV batches (and end markers) arriving at the attacker's DEALERs.
    replay_replies: int = 0
    replay_reply_bytes: int = 0
    #: HTTP answers by status code ("closed" when the server closed without one).
    http: Counter[str] = field(default_factory=Counter)
    http_by_kind: Counter[str] = field(default_factory=Counter)
    #: Half-sent requests the server closed within the allowed time, of those held.
    slow_closed: int = 0
    slow_held: int = 0
    seconds: float = 0.0

    @property
    def messages(self) -> int:
        """Messages sent on ZMQ sockets."""
        return sum(self.sent.values())


@final
class _Sinks:
    """The attacker's own PULL sockets (the reply endpoints it advertises) and ports
    that refuse connections, with a thread counting what arrives."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], count: int, closed: int) -> None:
        self.pulls: list[zmq.Socket[bytes]] = []
        self.ports: list[int] = []
        for _ in range(count):
            sock = ctx.socket(zmq.PULL)
            sock.setsockopt(zmq.LINGER, 0)
            self.ports.append(sock.bind_to_random_port("tcp://127.0.0.1"))
            self.pulls.append(sock)
        self._held: list[socket.socket] = []
        self.closed: list[int] = []
        for _ in range(closed):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
            self._held.append(s)
            self.closed.append(s.getsockname()[1])
        self.received: Counter[str] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drain, name="hostile-sinks", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        poller = zmq.Poller()
        for sock in self.pulls:
            poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(50):
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        self.received[wire.decode_status(frames).status.name] += 1
                    except WireError:
                        self.received["undecodable"] += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for sock in self.pulls:
            sock.close(linger=0)
        for s in self._held:
            s.close()


@final
class HttpAttack:
    """Raw HTTP/1.1 requests to a bootstrap server from a thread of their own; each on
    a new connection, the answer's status read within ``timeout`` seconds; ``slow``
    connections send half a request and wait for the server to close them."""

    def __init__(self, address: str, gen: HostileInput, payload: dict[str, Any]) -> None:
        host, _, port = address.rpartition(":")
        self._addr = (host, int(port))
        self._gen = gen
        self._payload = payload
        self.answers: Counter[str] = Counter()
        #: Answers by ``kind:status``.
        self.by_kind: Counter[str] = Counter()
        self.slow_closed = 0
        self.slow_held = 0

    def one(self, timeout: float = 5.0) -> None:
        """Send one request (generated) and read the status line of its answer."""
        kind, raw = self._gen.http(self._payload)
        self._gen.kinds["http:" + kind] += 1
        try:
            with socket.create_connection(self._addr, timeout=timeout) as s:
                with contextlib.suppress(OSError):
                    s.sendall(raw)
                head = s.recv(64)
        except OSError:
            answer = "error"
        else:
            parts = head.split(b" ", 2)
            if len(parts) >= 2 and parts[0].startswith(b"HTTP/"):
                answer = parts[1].decode("ascii", "replace")
            else:
                answer = "closed"
        self.answers[answer] += 1
        self.by_kind[f"{kind}:{answer}"] += 1

    @contextlib.contextmanager
    def slow(self, count: int) -> Iterator[list[socket.socket]]:
        """``count`` connections that sent a request head promising a body, then
        nothing; on exit, count those the server closed (:attr:`slow_closed`)."""
        held: list[socket.socket] = []
        try:
            for _ in range(count):
                with contextlib.suppress(OSError):
                    s = socket.create_connection(self._addr, timeout=5)
                    s.sendall(b"PUT /route HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
                    held.append(s)
            self.slow_held += len(held)
            yield held
        finally:
            for s in held:
                s.close()

    def closed_by_server(self, held: Sequence[socket.socket], within: float) -> int:
        """How many of ``held`` the server closed within ``within`` seconds."""
        deadline = time.monotonic() + within
        closed = 0
        for s in held:
            s.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                while s.recv(4096):
                    pass
                closed += 1
            except TimeoutError:
                pass
            except OSError:
                closed += 1
        self.slow_closed += closed
        return closed


#: How often each kind of traffic comes up, per ZMQ message (HTTP has its own rate).
MIX: Final = {"control": 46, "status": 46, "replay": 4, "live": 4}


@final
class Attack:
    """The attacker: sockets to every target, reply sinks, the generator. Synchronous
    (blocking pyzmq sends with a high-water mark, so the victims' pace sets the rate);
    run it in a thread from Trio code. Close it when done."""

    def __init__(
        self,
        targets: Targets,
        *,
        seed: int,
        sinks: int = 8,
        closed: int = 32,
        sockets: int = 4,
        send_timeout_ms: int = 30_000,
    ) -> None:
        self.targets = targets
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sinks = _Sinks(self.ctx, sinks, closed)
        self.gen = HostileInput(
            seed, targets.contract, sinks=self.sinks.ports, closed=self.sinks.closed
        )
        self.figures = AttackFigures()
        self._timeout = send_timeout_ms
        self._socks: dict[str, list[zmq.Socket[bytes]]] = {}
        self._dealers: list[zmq.Socket[bytes]] = []
        host = targets.prefill_control
        if targets.control_port is not None:
            self._socks["control"] = self._pushes(f"tcp://{host}:{targets.control_port}", sockets)
        if targets.status_port is not None:
            self._socks["status"] = self._pushes(f"tcp://127.0.0.1:{targets.status_port}", sockets)
        if targets.replay is not None:
            for _ in range(sockets):
                dealer = self._socket(zmq.DEALER)
                dealer.connect(targets.replay)
                self._dealers.append(dealer)
            self._socks["replay"] = self._dealers
        if targets.live is not None:
            pub = self._socket(zmq.PUB)
            pub.connect(targets.live)
            self._socks["live"] = [pub]
        self._oversize: list[tuple[zmq.Socket[bytes], float]] = []

    def _socket(self, kind: int) -> zmq.Socket[bytes]:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 200)
        sock.setsockopt(zmq.SNDTIMEO, self._timeout)
        return sock

    def _pushes(self, url: str, count: int) -> list[zmq.Socket[bytes]]:
        out = []
        for _ in range(count):
            sock = self._socket(zmq.PUSH)
            sock.connect(url)
            out.append(sock)
        return out

    @property
    def targets_attacked(self) -> list[str]:
        """The ZMQ targets this attack has sockets for."""
        return list(self._socks)

    def _frames(self, target: str) -> list[bytes]:
        gen = self.gen
        if target == "control":
            return gen.control()
        if target == "status":
            return gen.status()
        if target == "replay":
            return gen.replay_request()
        return gen.live_message()

    def send_oversized(self, target: str) -> None:
        """A frame over the socket's size limit, on a connection of its own (libzmq
        drops the connection that announces it)."""
        limit = wire.MAX_CONTROL_FRAME_BYTES if target == "control" else wire.MAX_STATUS_FRAME_BYTES
        port = self.targets.control_port if target == "control" else self.targets.status_port
        host = self.targets.prefill_control if target == "control" else "127.0.0.1"
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(f"tcp://{host}:{port}")
        with contextlib.suppress(zmq.Again):
            sock.send_multipart([b"1", b"s", bytes(limit + 1)], zmq.NOBLOCK)
        self.gen.kinds[f"{target}:oversized_frame"] += 1
        self._oversize.append((sock, time.monotonic()))
        while self._oversize and time.monotonic() - self._oversize[0][1] > 2.0:
            self._oversize.pop(0)[0].close(linger=0)

    def _drain_dealers(self) -> None:
        for dealer in self._dealers:
            while True:
                try:
                    frames = dealer.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self.figures.replay_replies += 1
                self.figures.replay_reply_bytes += sum(len(f) for f in frames)

    def run(self, messages: int, *, mix: dict[str, int] | None = None) -> AttackFigures:
        """Send ``messages`` messages, the targets drawn by ``mix`` weight (targets
        without a socket are skipped); one in 20,000 control and status messages is a
        frame over the limit."""
        weights = {t: w for t, w in (mix or MIX).items() if t in self._socks}
        targets = list(weights)
        shares = list(weights.values())
        rng = random.Random(self.gen.rng.random())
        sent = self.figures.sent
        start = time.monotonic()
        dead: set[str] = set()
        for i in range(messages):
            (target,) = rng.choices(targets, weights=shares, k=1)
            if target in dead:
                continue
            if target in ("control", "status") and rng.random() < 1 / 20_000:
                self.send_oversized(target)
                sent[target] += 1
                continue
            frames = self._frames(target)
            sock = self._socks[target][i % len(self._socks[target])]
            try:
                sock.send_multipart(frames)  # copied: zero-copy would start pyzmq's gc context
            except zmq.Again:
                self.figures.send_timeouts[target] += 1
                dead.add(target)  # the victim stopped reading: stop sending there
                continue
            sent[target] += 1
            if self._dealers and i % 64 == 0:
                self._drain_dealers()
        self.figures.seconds = time.monotonic() - start
        self._drain_dealers()
        return self.figures

    def settle(self, seconds: float = 0.5) -> None:
        """Keep reading replies for ``seconds``, then record what the sinks counted."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self._drain_dealers()
            time.sleep(0.01)
        self.figures.replies = Counter(self.sinks.received)

    def close(self) -> None:
        self.sinks.close()
        for sock, _ in self._oversize:
            sock.close(linger=0)
        self.ctx.destroy(linger=0)


# ------------------------------------------------------------------------------ the bench


@dataclass(slots=True)
class HostileFigures:
    """Everything ``tspd bench hostile`` measured."""

    messages: int
    seconds: float
    attack: AttackFigures
    kinds: Counter[str]
    before: dict[str, dict[str, Any]]
    after: dict[str, dict[str, Any]]
    alive: dict[str, bool]
    rooms_before: dict[str, Any]
    rooms_after: dict[str, Any]
    http_requests: int
    peak_rss: dict[str, float] = field(default_factory=dict)
    peak_fds: dict[str, float] = field(default_factory=dict)

    @property
    def crashes(self) -> int:
        """Victims that are not alive (or did not answer) at the end."""
        return sum(not ok for ok in self.alive.values())


def _payload(prefill: Victim) -> dict[str, Any]:
    return build_route_payload(
        rank_ip="127.0.0.1",
        rank_port=int(prefill.ready["control_port"]),
        engine_rank=0,
        world_size=1,
        dp_size=1,
        cache_layout=str(prefill.ready["contract"]),
    )


def _rooms(prefill: Victim, decode: Victim, start: int, count: int) -> dict[str, Any]:
    prefill.send(op="rooms", start=start, stop=start + count)
    decoded = decode.call("rooms", op="rooms", start=start, stop=start + count)
    served = prefill._read("rooms")
    return {"decode": decoded, "prefill": served}


def _snapshot(victims: dict[str, Victim]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, v in victims.items():
        try:
            out[name] = v.stats()
        except (RuntimeError, OSError, ValueError) as err:
            out[name] = {"error": str(err), "process": v.figures()}
    return out


@final
class _Peaks:
    """Samples each victim's RSS and descriptors every 0.2 s from a thread; keeps the
    highest."""

    def __init__(self, victims: dict[str, Victim]) -> None:
        self._victims = dict(victims)
        self.rss: dict[str, float] = dict.fromkeys(victims, 0.0)
        self.fds: dict[str, float] = dict.fromkeys(victims, 0.0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hostile-peaks", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            for name, v in self._victims.items():
                figures = v.figures()
                self.rss[name] = max(self.rss[name], figures["rss"])
                self.fds[name] = max(self.fds[name], figures["fds"])

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@dataclass(frozen=True, slots=True)
class HostileSettings:
    """The victims' timeouts: the Prefill's bootstrap timeout (unclaimed rooms are
    dropped after it) and the bootstrap server's request timeout (a half-sent request
    is closed after it). ``quick`` shortens both and the good batches."""

    bootstrap_timeout: float = 10.0
    request_timeout: float = 10.0
    good_rooms: int = 20
    http_every: int = 500
    slow_connections: int = 16


QUICK_SETTINGS: Final = HostileSettings(
    bootstrap_timeout=1.0, request_timeout=1.0, good_rooms=5, slow_connections=4
)


def run_hostile_bench(
    messages: int,
    *,
    seed: int = 1,
    settings: HostileSettings | None = None,
    log: Callable[[str], None] = lambda line: None,
) -> HostileFigures:
    """Start the victims, run good rooms, the attack, good rooms again; collect."""
    s = settings or HostileSettings()
    with tempfile.TemporaryDirectory(prefix="tspd-bench-hostile-") as logs:
        victims: dict[str, Victim] = {}
        attack: Attack | None = None
        peaks: _Peaks | None = None
        try:
            victims["bootstrap"] = Victim(
                "bootstrap",
                os.path.join(logs, "bootstrap.log"),
                limits={"request_timeout": s.request_timeout},
            )
            address = str(victims["bootstrap"].ready["address"])
            victims["prefill"] = Victim(
                "prefill",
                os.path.join(logs, "prefill.log"),
                bootstrap=address,
                config={"bootstrap_timeout": s.bootstrap_timeout},
            )
            victims["decode"] = Victim(
                "decode", os.path.join(logs, "decode.log"), bootstrap=address
            )
            victims["events"] = Victim("events", os.path.join(logs, "events.log"))
            prefill, decode, events = victims["prefill"], victims["decode"], victims["events"]
            log("victims up; good rooms before the attack")
            rooms_before = _rooms(prefill, decode, GOOD_ROOMS, s.good_rooms)
            time.sleep(0.5)
            before = _snapshot(victims)
            targets = Targets(
                contract=str(prefill.ready["contract"]).encode(),
                control_port=int(prefill.ready["control_port"]),
                status_port=int(decode.ready["status_port"]),
                bootstrap=address,
                replay=str(events.ready["replay"]),
                live=str(events.ready["live"]),
            )
            attack = Attack(targets, seed=seed)
            http = HttpAttack(address, attack.gen, _payload(prefill))
            http_quota = max(1, messages // s.http_every)

            def http_loop() -> None:
                for _ in range(http_quota):
                    http.one()

            log(f"attack: {messages:,} messages, {http_quota:,} HTTP requests")
            peaks = _Peaks(victims)
            with http.slow(s.slow_connections) as held:
                http_thread = threading.Thread(target=http_loop, name="hostile-http", daemon=True)
                start = time.monotonic()
                http_thread.start()
                attack.run(messages)
                http_thread.join()
                pids = [v.pid for v in victims.values() if v.alive]
                idle_at = wait_idle(pids, quiet=0.3)
                seconds = max(idle_at - start, 1e-9)
                peaks.stop()
                attack.settle(0.5)
                log("good rooms after the attack")
                rooms_after = _rooms(prefill, decode, GOOD_ROOMS + s.good_rooms, s.good_rooms)
                http.closed_by_server(held, within=s.request_timeout + 5.0)
            attack.figures.http = http.answers
            attack.figures.http_by_kind = http.by_kind
            attack.figures.slow_held = http.slow_held
            attack.figures.slow_closed = http.slow_closed
            # Rooms the attacker pre-allocated and no request claimed are dropped
            # after the bootstrap timeout: wait for that before the last snapshot.
            time.sleep(s.bootstrap_timeout + 1.0)
            attack.settle(0.2)
            after = _snapshot(victims)
            alive = {name: v.alive and "error" not in after[name] for name, v in victims.items()}
            return HostileFigures(
                messages=attack.figures.messages,
                seconds=seconds,
                attack=attack.figures,
                kinds=Counter(attack.gen.kinds),
                before=before,
                after=after,
                alive=alive,
                rooms_before=rooms_before,
                rooms_after=rooms_after,
                http_requests=sum(http.answers.values()),
                peak_rss=dict(peaks.rss),
                peak_fds=dict(peaks.fds),
            )
        finally:
            if peaks is not None:
                peaks.stop()
            if attack is not None:
                attack.close()
            close_all(victims.values())


# ------------------------------------------------------------------------------ report


def _mb(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def report(f: HostileFigures) -> dict[str, Any]:
    """The figures as nested JSON-friendly data."""
    processes: dict[str, Any] = {}
    for name in f.before:
        b, a = f.before[name], f.after[name]
        bp, ap = b.get("process", {}), a.get("process", {})
        processes[name] = {
            "alive": f.alive[name],
            "rss_before": bp.get("rss"),
            "rss_after": ap.get("rss"),
            "rss_peak": f.peak_rss.get(name),
            "fds_peak": f.peak_fds.get(name),
            "fds_before": bp.get("fds"),
            "fds_after": ap.get("fds"),
            "cpu_s": (ap.get("cpu") or 0) - (bp.get("cpu") or 0),
            "log_lines_warning": (a.get("log", {}).get("warning_lines", 0))
            - (b.get("log", {}).get("warning_lines", 0)),
            "log_bytes_warning": (a.get("log", {}).get("warning_bytes", 0))
            - (b.get("log", {}).get("warning_bytes", 0)),
            "log_lines_info": a.get("log", {}).get("by_level", {}).get("INFO", 0)
            - b.get("log", {}).get("by_level", {}).get("INFO", 0),
            "log_top": a.get("log", {}).get("top", []),
            "log_longest_record": a.get("log", {}).get("longest", 0),
            "stats_before": b.get("stats"),
            "stats_after": a.get("stats"),
        }
    control = f.attack.sent.get("control", 0)
    replies = sum(f.attack.replies.values())
    return {
        "messages": f.messages,
        "sent_by_socket": dict(f.attack.sent),
        "send_timeouts": dict(f.attack.send_timeouts),
        "seconds": f.seconds,
        "messages_per_s": f.messages / f.seconds,
        "crashes": f.crashes,
        "http_requests": f.http_requests,
        "http_answers": dict(f.attack.http),
        "http_answers_by_kind": dict(sorted(f.attack.http_by_kind.items())),
        "slow_requests_closed": f"{f.attack.slow_closed} of {f.attack.slow_held}",
        "replies_to_attacker_endpoints": dict(f.attack.replies),
        "replies_per_control_message": replies / control if control else 0.0,
        "kv_replay_replies": f.attack.replay_replies,
        "kv_replay_reply_bytes": f.attack.replay_reply_bytes,
        "good_rooms_before": f.rooms_before,
        "good_rooms_after": f.rooms_after,
        "processes": processes,
        "kinds": dict(sorted(f.kinds.items())),
    }


def render(out: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    rb, ra = out["good_rooms_before"], out["good_rooms_after"]
    summary = Table(title="tspd bench hostile — live peers on 127.0.0.1 (figures, not checks)")
    summary.add_column("figure")
    summary.add_column("value", justify="right")
    sent = ", ".join(f"{k} {v:,}" for k, v in out["sent_by_socket"].items())
    rows = [
        ("hostile ZMQ messages", f"{out['messages']:,} ({sent})"),
        ("absorbed (first send → every victim idle)", f"{out['messages_per_s']:,.0f} msg/s"),
        ("crashes", str(out["crashes"])),
        ("HTTP requests / answers", f"{out['http_requests']:,} / {out['http_answers']}"),
        ("half-sent requests closed by the server", out["slow_requests_closed"]),
        (
            "replies to endpoints the attacker chose",
            f"{sum(out['replies_to_attacker_endpoints'].values()):,} "
            f"({out['replies_per_control_message']:.3f} per control message) "
            f"{out['replies_to_attacker_endpoints']}",
        ),
        (
            "KV replay replies to the attacker",
            f"{out['kv_replay_replies']:,} messages, {_mb(out['kv_replay_reply_bytes'])}",
        ),
        (
            "good rooms before / after (Decode verified)",
            f"{rb['decode']['ok']}/{rb['decode']['ok'] + rb['decode']['failed']} / "
            f"{ra['decode']['ok']}/{ra['decode']['ok'] + ra['decode']['failed']}",
        ),
        ("send timeouts (victim stopped reading)", str(out["send_timeouts"] or 0)),
    ]
    for row in rows:
        summary.add_row(*row)
    console.print(summary)
    table = Table(title="per process (the log counts what it would write at WARNING, the default)")
    for column in (
        "process",
        "alive",
        "RSS before → peak → after",
        "FDs before → peak → after",
        "CPU s",
        "log lines ≥WARNING",
        "log bytes",
        "INFO lines",
        "longest record",
    ):
        table.add_column(column, justify="right")
    for name, p in out["processes"].items():
        table.add_row(
            name,
            "yes" if p["alive"] else "NO",
            f"{_mb(p['rss_before'] or 0)} → {_mb(p['rss_peak'] or 0)} → {_mb(p['rss_after'] or 0)}",
            f"{p['fds_before']} → {p['fds_peak']:.0f} → {p['fds_after']}",
            f"{p['cpu_s']:.1f}",
            f"{p['log_lines_warning']:,}",
            _mb(p["log_bytes_warning"]),
            f"{p['log_lines_info']:,}",
            f"{p.get('log_longest_record', 0):,} B",
        )
    console.print(table)
    tables = Table(title="tables after the attack (Prefill / Decode)")
    tables.add_column("peer")
    tables.add_column("non-zero statistics")
    for name in ("prefill", "decode", "events", "bootstrap"):
        stats = out["processes"][name]["stats_after"] or {}
        flat = {k: v for k, v in _flatten(stats).items() if v}
        tables.add_row(name, ", ".join(f"{k}={v}" for k, v in flat.items()))
    console.print(tables)
    top = Table(title="most frequent log lines during the run")
    top.add_column("process")
    top.add_column("count", justify="right")
    top.add_column("template")
    for name, p in out["processes"].items():
        for template, count in p["log_top"][:3]:
            top.add_row(name, f"{count:,}", template)
    console.print(top)


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


@click.command()
@click.option(
    "--messages",
    type=click.IntRange(min=1),
    default=1_000_000,
    show_default=True,
    help="Hostile ZMQ messages in all (HTTP requests come on top, one per 500).",
)
@click.option("--seed", type=int, default=1, show_default=True, help="The generator's seed.")
@click.option(
    "--quick",
    is_flag=True,
    help="Short victim timeouts (bootstrap 1 s, HTTP request 1 s) and 5 good rooms: "
    "for smoke runs with few messages.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
def hostile(messages: int, seed: int, quick: bool, as_json: bool) -> None:
    """A flood of hostile input at every receiving socket of live peers, then good rooms."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    figures = run_hostile_bench(
        messages,
        seed=seed,
        settings=QUICK_SETTINGS if quick else None,
        log=lambda line: click.echo(line, err=True),
    )
    out = report(figures)
    if as_json:
        click.echo(json.dumps(out, indent=2, default=str))
        return
    render(out)
