"""Short runs of the layout fuzz targets (fuzz/fuzz_contract.py, fuzz/fuzz_manifest.py):
random bytes and mutated valid payloads reach the decoders, only ContractError is
ever swallowed, and whatever parses keeps the targets' invariants."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tspd.core.contract import CacheContract, parse_contract
from tspd.core.manifest import BlockManifest, ManifestGroup, parse_manifest
from tspd.testing.layouts import multi_layer_contract, room_manifest, simple_contract

FUZZ_DIR = Path(__file__).resolve().parents[2] / "fuzz"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, FUZZ_DIR / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


fc = _load("fuzz_contract")
fm = _load("fuzz_manifest")


def _compat(contract: CacheContract) -> bytes:
    data = contract.to_json()
    return data.replace(
        b'"checkpoint_granularity":null}', b'"checkpoint_granularity":null,"shard_count":2}', 1
    )


CONTRACT_SEEDS: list[bytes] = [
    b"\x00" + simple_contract(num_pages=4, page_bytes=64).to_json(),
    b"\x00"
    + multi_layer_contract(
        layers=2, num_pages=3, heads=2, head_dim=2, tp_size=2, with_state_group=True
    ).to_json(),
    b"\x01"
    + _compat(
        multi_layer_contract(layers=1, num_pages=2, heads=1, head_dim=1, sliding_window_tokens=9)
    ),
]

MANIFEST_SEEDS: list[bytes] = [
    room_manifest(fm.CONTRACT, 30).to_json(),
    room_manifest(fm.CONTRACT, 30, 8, contiguous=False).to_json(),
    BlockManifest(
        (ManifestGroup("kv", (5,)), ManifestGroup("state", (9,))), 12, 13, True
    ).to_json(),
]


def _mutate(seed: bytes, data: st.DataObject) -> bytes:
    """A few byte-level edits (overwrite, insert, delete) of ``seed``."""
    out = bytearray(seed)
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["set", "insert", "delete"]))
        at = data.draw(st.integers(0, max(0, len(out) - 1)))
        if op == "set" and out:
            out[at] = data.draw(st.sampled_from(b'0123456789-,:[]{}"ntfe.\\ \x00\xff'))
        elif op == "insert":
            out[at:at] = data.draw(st.sampled_from([b"1", b"-", b'"x"', b"[]", b",", b"null"]))
        elif out:
            del out[at : at + data.draw(st.integers(1, 8))]
    return bytes(out)


def test_seeds_take_the_valid_path() -> None:
    for seed in CONTRACT_SEEDS:
        assert isinstance(parse_contract(seed[1:], compat=bool(seed[0] & 1)), CacheContract)
        fc.test_one_input(seed)
    assert parse_contract(CONTRACT_SEEDS[2][1:], compat=True).group("kv").shard_count == 2
    for seed in MANIFEST_SEEDS:
        manifest = parse_manifest(seed)
        fm.check_manifest(manifest)
        fm.test_one_input(seed)


@given(st.binary(max_size=512))
def test_contract_target_random_bytes(data: bytes) -> None:
    fc.test_one_input(data)


@given(st.sampled_from(CONTRACT_SEEDS), st.data())
def test_contract_target_mutated_seeds(seed: bytes, data: st.DataObject) -> None:
    fc.test_one_input(seed[:1] + _mutate(seed[1:], data))


@given(st.binary(max_size=512))
def test_manifest_target_random_bytes(data: bytes) -> None:
    fm.test_one_input(data)


@given(st.sampled_from(MANIFEST_SEEDS), st.data())
def test_manifest_target_mutated_seeds(seed: bytes, data: st.DataObject) -> None:
    fm.test_one_input(_mutate(seed, data))


@given(st.integers(1, 64), st.data())
def test_manifest_target_every_valid_window(prompt: int, data: st.DataObject) -> None:
    prefix = 4 * data.draw(st.integers(0, (prompt - 1) // 4))
    seed = room_manifest(fm.CONTRACT, prompt, prefix, rng=data.draw(st.randoms()), contiguous=False)
    fm.check_manifest(seed)


def test_targets_let_other_errors_escape(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(data: bytes, *, compat: bool = False) -> CacheContract:
        raise IndexError("a decoder bug")

    monkeypatch.setattr(fc, "parse_contract", broken)
    with pytest.raises(IndexError):
        fc.test_one_input(b"\x00{}")
