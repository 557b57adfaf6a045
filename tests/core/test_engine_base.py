"""Engine protocol helpers and Mooncake's import-failure messages (no Mooncake needed)."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from tspd.engines.base import EngineUnavailable, TransferError, as_address_list
from tspd.engines.mooncake import MooncakeEngine, load_mooncake, transfer_timeout


def test_as_address_list_accepts_ints_and_integer_arrays() -> None:
    assert as_address_list([1, np.int64(2)], what="src") == [1, 2]
    out = as_address_list(np.array([3, 4], dtype=np.uint64), what="src")
    assert out == [3, 4]
    assert all(type(v) is int for v in out)


@pytest.mark.parametrize(
    "bad",
    [np.array([1.0]), np.zeros((2, 2), dtype=np.int64), [1, 2.5], [True], ["1"]],
)
def test_as_address_list_refuses_non_integers(bad: object) -> None:
    with pytest.raises(TypeError, match="dst"):
        as_address_list(bad, what="dst")  # type: ignore[arg-type]


def test_transfer_error_message_names_peer_and_code() -> None:
    err = TransferError("10.0.0.1:1234", -1, "peer hung")
    assert str(err) == "transfer to 10.0.0.1:1234 failed (code -1): peer hung"


def _broken_mooncake(monkeypatch: pytest.MonkeyPatch, message: str) -> None:
    """Make ``from mooncake.engine import TransferEngine`` raise ImportError(message)."""
    module = types.ModuleType("mooncake.engine")

    def __getattr__(name: str) -> object:
        raise ImportError(message)

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    monkeypatch.setitem(sys.modules, "mooncake", types.ModuleType("mooncake"))
    monkeypatch.setitem(sys.modules, "mooncake.engine", module)


@pytest.mark.parametrize(
    ("message", "hint"),
    [
        ("libibverbs.so.1: cannot open shared object file", "apt-get install"),
        ("libcudart.so.12: cannot open shared object file", "mooncake-transfer-engine-non-cuda"),
        ("No module named 'mooncake'", "tspd[mooncake-cpu]"),
    ],
)
def test_import_failures_say_what_to_install(
    monkeypatch: pytest.MonkeyPatch, message: str, hint: str
) -> None:
    _broken_mooncake(monkeypatch, message)
    with pytest.raises(EngineUnavailable) as err:
        load_mooncake()
    assert hint in str(err.value)
    assert message in str(err.value)
    with pytest.raises(EngineUnavailable):
        MooncakeEngine("127.0.0.1")


def test_max_descriptors_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_descriptors"):
        MooncakeEngine("127.0.0.1", max_descriptors=0)


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (None, 30.0),
        ("5", 5.0),
        ("12", 12.0),
        ("3", 5.0),
        ("0", 5.0),
        ("-4", 5.0),
        ("7s", 7.0),
        ("abc", 5.0),
        (" 9", 9.0),
    ],
)
def test_transfer_timeout_reads_mc_transfer_timeout_like_mooncake(
    value: str | None, seconds: float
) -> None:
    environ = {} if value is None else {"MC_TRANSFER_TIMEOUT": value}
    assert transfer_timeout(environ) == seconds
