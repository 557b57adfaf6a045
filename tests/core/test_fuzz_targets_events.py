"""Short runs of fuzz/fuzz_kv_events.py: random and mutated inputs reach every KV-event
decoder and the tracker; only WireError is swallowed, and the target's invariants hold."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import msgpack
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from tspd.core.kv_events import BlockRemoved, BlockStored, KVEventBatch, encode_batch
from tspd.core.seqtrack import GapReason, SeqTracker

FUZZ_DIR = Path(__file__).resolve().parents[2] / "fuzz"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, FUZZ_DIR / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


fk = _load("fuzz_kv_events")

GOLDEN = encode_batch(
    KVEventBatch(1.5, (BlockStored((123,), None, (1, 2), 2), BlockRemoved((123,))), 2)
)
MAP_FORM = msgpack.packb(
    [2.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [3], "block_size": 1}], 0]
)
SEEDS = [
    b"\x00" + GOLDEN,
    b"\x00" + MAP_FORM,
    b"\x01kv|\x00\x00\x00\x00\x00\x00\x00\x05|payload",
    b"\x02client||\x00\x00\x00\x00\x00\x00\x00\x01",
    b"\x03|\xff\xff\xff\xff\xff\xff\xff\xff|",
    b"\x04\x01" + bytes([0, 0, 0, 0, 0, 5, 1, 0, 1, 2, 0, 0, 0, 0, 0]),
]


@pytest.mark.parametrize("seed", SEEDS)
def test_seed_inputs_pass(seed: bytes) -> None:
    fk.test_one_input(seed)


@given(st.binary(max_size=200))
@example(b"\x00" + GOLDEN[:-1])
@example(b"\x00" + MAP_FORM + b"\x00")
def test_random_bytes(data: bytes) -> None:
    fk.test_one_input(data)


@given(st.sampled_from(SEEDS), st.integers(0, 400), st.integers(0, 255))
def test_mutated_seeds(seed: bytes, index: int, value: int) -> None:
    data = bytearray(seed)
    data[1 + index % max(1, len(data) - 1)] = value
    fk.test_one_input(bytes(data))


ops = st.lists(st.tuples(st.integers(0, 4), st.integers(0, 40)), max_size=60).map(
    lambda steps: b"".join(bytes([op]) + seq.to_bytes(2, "big") for op, seq in steps)
)


@given(st.booleans(), ops)
def test_tracker_programs_keep_the_invariants(replay: bool, program: bytes) -> None:
    fk.check_tracker_program(bytes([int(replay)]) + program)


def test_the_tracker_invariant_check_can_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check is not vacuous: a tracker that skips a hole silently is caught."""

    class Silent(SeqTracker):
        def _lose(self, first: int, resumed_at: int, reason: GapReason) -> None:
            self._next = resumed_at

    monkeypatch.setattr(fk, "SeqTracker", Silent)
    with pytest.raises(AssertionError):
        fk.check_tracker_program(b"\x00" + bytes([0, 0, 0, 0, 0, 5]))
