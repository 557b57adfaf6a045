"""Short runs of the wire fuzz targets (fuzz/fuzz_wire.py): random bytes and mutated
valid messages reach every decoder, and only WireError is ever swallowed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tspd.core.poll import TransferPoll
from tspd.core.staging import gather_blob
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

FUZZ_FILE = Path(__file__).resolve().parents[2] / "fuzz" / "fuzz_wire.py"


def _load_fuzz_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fuzz_wire", FUZZ_FILE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("fuzz_wire", module)
    spec.loader.exec_module(module)
    return module


fw = _load_fuzz_module()

CONTRACT = simple_contract(num_pages=8, page_bytes=64)
MANIFEST = room_manifest(CONTRACT, prompt_len=40)
SEEDS: dict[str, list[list[bytes]]] = {
    "registration": [
        encode_registration(
            Registration(
                endpoint="127.0.0.1",
                port=5555,
                session_id="127.0.0.1:16001",
                arena_base=0x10000,
                contract=CONTRACT,
                contract_bytes=CONTRACT.to_json(),
                decode_tp_size=2,
                decode_tp_rank=1,
            )
        )
    ],
    "preallocation": [
        encode_preallocation(7, "127.0.0.1:16001", MANIFEST),
        encode_preallocation(8, "127.0.0.1:16001", None),
    ],
    "status": [
        encode_status(
            StatusMessage(7, TransferPoll.SUCCESS, 1, 42, (1, 2, 3), 16, -0.5),
        ),
        encode_status(StatusMessage(7, TransferPoll.SUCCESS, 1))[:5],
        failure_notice(9, 0),
    ],
    "embedding_status": [encode_embedding_status(EmbeddingStatus(3, TransferPoll.SUCCESS, 0))],
}


def test_split_and_join_are_inverse() -> None:
    frames = [b"None", b"", b"abc", b""]
    assert fw.split_frames(fw.join_frames(frames)) == frames
    assert fw.split_frames(b"") == []


@pytest.mark.parametrize("name", sorted(SEEDS))
def test_seeds_decode_through_their_target(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The target must reach its decoder and get a message back: make the decoder's
    # success observable by counting calls of the encoder the target re-encodes with.
    calls: list[object] = []
    encoder = {
        "registration": "encode_registration",
        "preallocation": "encode_preallocation",
        "status": "encode_status",
        "embedding_status": "encode_embedding_status",
    }[name]
    real = getattr(fw, encoder)

    def counting(*args: object) -> object:
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(fw, encoder, counting)
    for frames in SEEDS[name]:
        fw.TARGETS[name](fw.join_frames(frames))
    assert len(calls) >= len(SEEDS[name])


@pytest.mark.parametrize(
    ("name", "decoder"),
    [
        ("registration", "decode_registration"),
        ("preallocation", "decode_preallocation"),
        ("status", "decode_status"),
        ("embedding_status", "decode_embedding_status"),
    ],
)
def test_targets_let_non_wire_errors_escape(
    name: str, decoder: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(frames: list[bytes], **options: object) -> object:
        raise IndexError("a decoder bug")

    monkeypatch.setattr(fw, decoder, broken)
    with pytest.raises(IndexError):
        fw.TARGETS[name](fw.join_frames(SEEDS[name][0]))


def _mutate(data: bytes, draw: st.DrawFn) -> bytes:
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "truncate", "insert", "delete", "separator"]))
        at = draw(st.integers(0, len(data)))
        if op == "flip" and data:
            i = at % len(data)
            data = data[:i] + bytes([data[i] ^ (1 << draw(st.integers(0, 7)))]) + data[i + 1 :]
        elif op == "truncate":
            data = data[:at]
        elif op == "insert":
            data = data[:at] + draw(st.binary(min_size=1, max_size=8)) + data[at:]
        elif op == "delete":
            data = data[:at] + data[at + draw(st.integers(1, 8)) :]
        else:
            data = data[:at] + fw.SEPARATOR + data[at:]
    return data


@st.composite
def mutated_inputs(draw: st.DrawFn) -> tuple[str, bytes]:
    name = draw(st.sampled_from(sorted(SEEDS)))
    seed = fw.join_frames(draw(st.sampled_from(SEEDS[name])))
    return name, _mutate(seed, draw)


@given(case=mutated_inputs())
def test_mutated_seeds(case: tuple[str, bytes]) -> None:
    name, data = case
    fw.TARGETS[name](data)


@given(name=st.sampled_from(sorted(SEEDS)), data=st.binary(max_size=256))
def test_random_bytes(name: str, data: bytes) -> None:
    fw.TARGETS[name](data)


@given(name=st.sampled_from(sorted(SEEDS)), frames=st.lists(st.binary(max_size=24), max_size=9))
def test_random_frames(name: str, frames: list[bytes]) -> None:
    fw.TARGETS[name](fw.join_frames(frames))


@given(data=st.binary(max_size=256))
def test_combined_entry_point(data: bytes) -> None:
    fw.test_one_input(data)


@given(st.binary(max_size=600))
def test_the_staged_blob_target_takes_any_bytes(data: bytes) -> None:
    fw.fuzz_staged_blob(data)


def test_the_staged_blob_target_reads_a_real_blob(monkeypatch: pytest.MonkeyPatch) -> None:
    source = np.arange(256, dtype=np.uint8)
    out = np.zeros(256, dtype=np.uint8)
    offsets = np.array([0, 100], dtype=np.int64)
    lengths = np.array([10, 20], dtype=np.int64)
    size = gather_blob(out, source, offsets, offsets, lengths)
    read: list[int] = []
    real = fw.read_blob_table

    def counting(blob: Any, staged: int, slot: int) -> Any:
        table = real(blob, staged, slot)
        read.append(len(table[0]))
        return table

    monkeypatch.setattr(fw, "read_blob_table", counting)
    data = size.to_bytes(4, "little") + (256).to_bytes(4, "little") + out.tobytes()
    fw.fuzz_staged_blob(data)
    assert read == [2]
