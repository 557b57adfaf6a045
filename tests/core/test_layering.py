"""The sans-IO core imports no I/O library and reads no clock."""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import tspd.core

FORBIDDEN_MODULES = ("trio", "zmq", "mooncake", "httpx", "hypercorn", "starlette", "anyio")
CORE_DIR = Path(tspd.core.__file__).parent


def test_importing_core_pulls_in_no_io_library() -> None:
    modules = [f"tspd.core.{m.name}" for m in pkgutil.iter_modules([str(CORE_DIR)])]
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN_MODULES!r})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout.strip()
    assert out == "", f"tspd.core imported I/O modules: {out}"


def test_core_source_reads_no_clock() -> None:
    offenders = []
    for path in CORE_DIR.rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names]
                mod = node.module if isinstance(node, ast.ImportFrom) else None
                if mod in ("time", "datetime") or any(n in ("time", "datetime") for n in names):
                    offenders.append(f"{path.name}:{node.lineno}")
    assert offenders == [], f"tspd.core must take `now` as an argument: {offenders}"
