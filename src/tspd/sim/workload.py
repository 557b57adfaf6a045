"""The workload of a run: every request, drawn up front from the seed.

A request has a room (a random 62-bit ``bootstrap_room``, distinct within the
run), a prompt of 1 to ``max_prompt`` tokens, an arrival time (Poisson arrivals at
``arrival_rate``), a Prefill instance and a Decode instance, the first token and
cached-token count the Prefill reports, and, with the faults, an abort delay and a
second (hedged) Decode instance. Drawing everything first keeps the workload of a
seed the same whatever the faults do.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from tspd.sim.config import SimConfig

__all__ = ["Request", "draw_requests"]


@dataclass(slots=True, eq=False)
class Request:
    """One request as the router sends it to one Prefill and one Decode instance
    (a hedged request is two of these, one per Decode instance, sharing the room)."""

    rid: str
    room: int
    #: The room's index in the run (the arena tags' room number).
    index: int
    prompt_len: int
    #: Pages the prompt needs on every rank.
    pages: int
    arrival: float
    prefill: int
    decode: int
    token: int
    cached_tokens: int
    abort_after: float | None = None
    #: The Decode instance a hedged copy goes to, on the original only.
    hedge: int | None = None


def draw_requests(config: SimConfig, rng: random.Random) -> list[Request]:
    """Every request of a run, in arrival order."""
    timings, faults = config.timings, config.faults
    prefill_instances = sum(shape.count for shape in config.prefill)
    decode_instances = sum(shape.count for shape in config.decode)
    requests: list[Request] = []
    rooms: set[int] = set()
    now = 0.0
    for index in range(config.rooms):
        now += rng.expovariate(timings.arrival_rate)
        room = rng.getrandbits(62)
        while room in rooms:
            room = rng.getrandbits(62)
        rooms.add(room)
        prompt_len = rng.randint(1, config.max_prompt)
        decode = rng.randrange(decode_instances)
        request = Request(
            rid=f"r{index}",
            room=room,
            index=index,
            prompt_len=prompt_len,
            pages=-(-prompt_len // config.page_tokens),
            arrival=now,
            prefill=rng.randrange(prefill_instances),
            decode=decode,
            token=rng.randrange(1, 50_000),
            cached_tokens=rng.randrange(prompt_len),
        )
        if faults.abort and rng.random() < faults.abort:
            request.abort_after = rng.uniform(0.0, 0.05)
        if faults.hedge and decode_instances > 1 and rng.random() < faults.hedge:
            request.hedge = (decode + rng.randrange(1, decode_instances)) % decode_instances
        requests.append(request)
    return requests
