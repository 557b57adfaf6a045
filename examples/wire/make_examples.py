"""Regenerate the example captures in this directory.

    .venv/bin/python examples/wire/make_examples.py

Each ``*.hex`` file is one ZMQ message, one frame per line as hex (a blank line is
an empty frame), headed by ``#`` comments: ``# kind: <kind>`` names the
``tspd wire decode --kind`` to use, and ``bad-*`` files carry
``# expect-error: <message>``, the exact error the decoder must report. The
``*.json`` files are raw contract and manifest payloads (kind = file stem).

Try one::

    tspd wire decode --kind status examples/wire/status.hex

The values follow the interop pattern of docs/protocol.md#proto-interop (seed 0,
room 1000000), so the token and candidates in ``status.hex`` are the ones a tspd
Prefill would send.
``tests/core/test_cli_wire.py`` checks that the committed files are what this
script writes and that each decodes (or fails) as its header says.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tspd.core.interop import bootstrap_token_and_candidates
from tspd.core.kv_events import BlockRemoved, BlockStored, KVEventBatch, encode_batch
from tspd.core.poll import TransferPoll
from tspd.core.wire import (
    EmbeddingStatus,
    Registration,
    StatusMessage,
    encode_embedding_status,
    encode_preallocation,
    encode_registration,
    encode_status,
    failure_notice,
)
from tspd.testing.layouts import room_manifest, simple_contract

HERE = Path(__file__).resolve().parent

ROOM = 1_000_000
SESSION = "127.0.0.1:16001"


def _hex_file(kind: str, title: str, frames: list[bytes], expect_error: str | None = None) -> str:
    lines = [f"# {title}", f"# kind: {kind}"]
    if expect_error is not None:
        lines.append(f"# expect-error: {expect_error}")
    lines.extend(frame.hex() for frame in frames)
    return "\n".join(lines) + "\n"


def examples() -> dict[str, str]:
    """File name → content of every example."""
    contract = simple_contract(num_pages=64, page_bytes=4096)
    manifest = room_manifest(contract, prompt_len=100)
    registration = Registration(
        endpoint="127.0.0.1",
        port=17001,
        session_id=SESSION,
        arena_base=0x7F3A_0000_0000,
        contract=contract,
        contract_bytes=contract.to_json(),
        decode_tp_size=1,
        decode_tp_rank=0,
    )
    token, candidates = bootstrap_token_and_candidates(0, ROOM, 3)
    success = StatusMessage(
        room=ROOM,
        status=TransferPoll.SUCCESS,
        prefill_rank=0,
        bootstrap_token=token,
        spec_candidate_ids=candidates,
        cached_tokens=32,
        bootstrap_logprob=-0.125,
    )
    registration_frames = encode_registration(registration)
    status_frames = encode_status(success)
    zero_pointer = list(registration_frames)
    zero_pointer[4] = bytes(8)
    batch = KVEventBatch(
        ts=1_700_000_000.5,
        events=(
            BlockStored((0x1234_5678_9ABC_DEF0,), None, tuple(range(16)), 16),
            BlockRemoved((0x0FED_CBA9_8765_4321,)),
        ),
        dp_rank=0,
    )
    return {
        "contract.json": contract.to_json().decode("ascii") + "\n",
        "manifest.json": manifest.to_json().decode("ascii") + "\n",
        "registration.hex": _hex_file(
            "registration", "Decode rank 0 of 1 registers with a Prefill rank", registration_frames
        ),
        "preallocation.hex": _hex_file(
            "preallocation",
            f"pre-allocation of room {ROOM}: a 100-token prompt on 7 pages",
            encode_preallocation(ROOM, SESSION, manifest),
        ),
        "preallocation-dummy.hex": _hex_file(
            "preallocation",
            "pre-allocation for a dummy Prefill rank: empty manifest frame",
            encode_preallocation(ROOM, SESSION, None),
        ),
        "status.hex": _hex_file(
            "status",
            "7-frame Success status (S3/R-pd form) with token and candidates",
            status_frames,
        ),
        "status-5frame.hex": _hex_file(
            "status", "5-frame Success status as S1 sends it", status_frames[:5]
        ),
        "status-failed.hex": _hex_file(
            "status", "bare Failed notice (abort or failure)", failure_notice(ROOM, 0)
        ),
        "embedding-status.hex": _hex_file(
            "embedding-status",
            "EPD embedding status: encode rank 0 sent the room's embedding",
            encode_embedding_status(EmbeddingStatus(ROOM, TransferPoll.SUCCESS, 0)),
        ),
        "kv-batch.hex": _hex_file(
            "kv-batch", "one KV event batch payload (msgpack)", [encode_batch(batch)]
        ),
        "bad-status.hex": _hex_file(
            "status",
            "status with a non-canonical room (leading zero)",
            [b"01000000", *status_frames[1:]],
            "Rejecting malformed Prefill status message: "
            "room must be canonical unsigned ASCII, got b'01000000'",
        ),
        "bad-status-candidates.hex": _hex_file(
            "status",
            "status whose candidate frame is not whole int32 values",
            [*status_frames[:4], status_frames[4][:-1], *status_frames[5:]],
            "Rejecting malformed Prefill status message: "
            "speculative candidate frame has 11 bytes, not a multiple of 4",
        ),
        "bad-registration.hex": _hex_file(
            "registration",
            "registration with a null arena pointer",
            zero_pointer,
            "CachePD slab pointer must be nonzero",
        ),
        "bad-preallocation.hex": _hex_file(
            "preallocation",
            "pre-allocation whose room does not fit 63 bits",
            [b"9223372036854775808", SESSION.encode(), manifest.to_json()],
            "CachePD room is out of range",
        ),
        "bad-manifest-preallocation.hex": _hex_file(
            "preallocation",
            "pre-allocation whose manifest frame is not JSON",
            [b"%d" % ROOM, SESSION.encode(), b"{groups"],
            "invalid Cache block manifest JSON",
        ),
    }


def main() -> None:
    """Write every example next to this script."""
    for name, content in examples().items():
        (HERE / name).write_text(content)
    print(f"wrote {len(examples())} examples to {HERE}", file=sys.stderr)


if __name__ == "__main__":
    main()
