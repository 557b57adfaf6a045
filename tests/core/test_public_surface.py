"""Every module of tspd says what its API is: an ``__all__`` whose names exist and are
public, so a newcomer tells API from internals at a glance."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import tspd

#: Modules that need an optional extra to import (asyncio embedding).
_OPTIONAL = {"tspd.hosts.aio"}


def _modules() -> list[str]:
    names = ["tspd"]
    for info in pkgutil.walk_packages(tspd.__path__, "tspd."):
        names.append(info.name)
    return sorted(names)


@pytest.mark.parametrize("name", _modules())
def test_every_module_declares_its_api(name: str) -> None:
    try:
        module = importlib.import_module(name)
    except ImportError as err:
        if name in _OPTIONAL:
            pytest.skip(f"{name} needs an optional extra: {err}")
        raise
    exported = getattr(module, "__all__", None)
    assert isinstance(exported, list), f"{name} has no __all__ list"
    for attr in exported:
        assert hasattr(module, attr), f"{name}.__all__ names {attr!r}, which it lacks"
        assert not attr.startswith("_") or attr == "__version__", (
            f"{name}.__all__ exports the private name {attr!r}"
        )
    assert len(set(exported)) == len(exported), f"{name}.__all__ repeats a name"
