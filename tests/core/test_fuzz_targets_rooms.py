"""Short runs of the room-table fuzz target (fuzz/fuzz_rooms.py): random scripts of
control frames and scheduler calls reach a PrefillCore, which only ever behaves as
documented and is empty once every room ended."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from hypothesis import given
from hypothesis import strategies as st

from tspd.core.commands import Bootstrapped, Succeeded

FUZZ_FILE = Path(__file__).resolve().parents[2] / "fuzz" / "fuzz_rooms.py"


def _load_fuzz_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fuzz_rooms", FUZZ_FILE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("fuzz_rooms", module)
    spec.loader.exec_module(module)
    return module


fr = _load_fuzz_module()
OPS = len(fr.OPERATIONS)


def _op(index: int, *args: int) -> bytes:
    return bytes([index, *args])


def test_a_scripted_success_path_runs_clean() -> None:
    script = b"".join(
        [
            _op(1, 0, 1),  # registration of session 0, unmodified
            _op(3, 2),  # request r1 for room 2
            _op(1, 5, 1),  # pre-allocation of room 2 from session 0
            _op(4, 0),  # poll: Bootstrapped
            _op(6, 2, 20, 0),  # hand over room 2, token 12
            _op(7, 2, 0),  # transfer succeeded
            _op(4, 0),  # poll: Succeeded
        ]
    )
    assert fr.run_script(script) == [Bootstrapped("r1"), Succeeded("r1")]


def test_every_operation_runs_on_an_empty_core() -> None:
    for index in range(OPS):
        assert fr.run_script(bytes([index]) + bytes(16)) == []


@given(st.binary(max_size=400))
def test_random_scripts_only_behave_as_documented(data: bytes) -> None:
    fr.test_one_input(data)


@given(
    st.lists(
        st.tuples(st.integers(0, OPS - 1), st.binary(min_size=4, max_size=6)),
        max_size=40,
    )
)
def test_structured_scripts_only_behave_as_documented(steps: list[tuple[int, bytes]]) -> None:
    fr.run_script(b"".join(bytes([op]) + args for op, args in steps))


def test_a_refused_duplicate_preallocation_waits_for_the_rooms_writes() -> None:
    """Found by atheris (coverage-guided, fuzz_rooms): a second pre-allocation of a
    room from the same session while the room's transfer is with the workers fails
    the room, and the Failed notice the refusal sends went out at once -- while a
    write of the room was in flight, so the Decode could reuse pages still being
    written. It now waits for the room's last write like every other notice."""
    script = b"".join(
        [
            _op(1, 0, 1),  # registration of session 0
            _op(1, 5, 1),  # pre-allocation of room 2: Bootstrapped
            _op(3, 3),  # request for room 3
            _op(6, 2, 20, 0),  # hand over room 2: its chunk goes to the workers
            _op(1, 5, 1),  # the same pre-allocation again: refused, room 2 fails
        ]
    )
    fr.run_script(script)
    fr.test_one_input(bytes.fromhex("b6b62b3d413dffff06b6b62b3d413d2b4113"))
