"""A Mooncake peer in its own process, driven by JSON lines on stdin.

Started by ``test_mooncake_engine.py``: it builds a :class:`MooncakeEngine` on
127.0.0.1, registers an anonymous-mmap arena of ``argv[1]`` bytes and prints
``{"session", "addr", "size"}``. Then each stdin line is a command and each
stdout line its reply:

* ``{"op": "fill", "seed": s}`` fills the arena with seeded random bytes;
* ``{"op": "digest", "offset": o, "length": n}`` answers the SHA-256 of a span;
* ``{"op": "write", "peer": sid, "src": [offsets], "dst": [addrs], "lengths": [...]}``
  writes from the arena to a peer; the reply carries the error code on failure;
* ``{"op": "exit"}`` (or end of input) stops.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import sys

import numpy as np

from tspd.engines.base import TransferError
from tspd.engines.mooncake import MooncakeEngine


def main() -> None:
    size = int(sys.argv[1])
    engine = MooncakeEngine("127.0.0.1")
    buf = mmap.mmap(-1, size)
    arena = np.frombuffer(buf, dtype=np.uint8)
    base = int(arena.ctypes.data)
    engine.register_memory(base, size)
    print(json.dumps({"session": engine.session_id, "addr": base, "size": size}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        reply: dict[str, object] = {"ok": True}
        if cmd["op"] == "exit":
            break
        if cmd["op"] == "fill":
            arena[:] = np.random.default_rng(cmd["seed"]).integers(0, 256, size, dtype=np.uint8)
        elif cmd["op"] == "digest":
            span = arena[cmd["offset"] : cmd["offset"] + cmd["length"]]
            reply["sha256"] = hashlib.sha256(span.tobytes()).hexdigest()
        elif cmd["op"] == "write":
            try:
                engine.batch_write(
                    cmd["peer"], [base + o for o in cmd["src"]], cmd["dst"], cmd["lengths"]
                )
            except TransferError as err:
                reply = {"ok": False, "code": err.code, "detail": err.detail}
        print(json.dumps(reply), flush=True)
    engine.close()


if __name__ == "__main__":
    main()
