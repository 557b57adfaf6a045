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


SRC_DIR = CORE_DIR.parent
TESTING_DIR = SRC_DIR / "testing"


def _module_name(path: Path, src: Path) -> str:
    parts = path.relative_to(src).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_modules(path: Path, src: Path) -> set[str]:
    """Every module an ``import`` anywhere in ``path`` (a module under the source
    root ``src``) names: relative imports resolved, and ``from pkg import name``
    counted as ``pkg.name`` too, since ``name`` may be a module."""
    module = _module_name(path, src)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: package.count(".") + 2 - node.level]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _is_testing(name: str) -> bool:
    return name == "tspd.testing" or name.startswith("tspd.testing.")


def _testing_imports() -> set[tuple[str, str]]:
    """``(importer, tspd.testing module)`` for every product module outside
    ``tspd.testing`` (``from m import name`` reported as ``m`` alone)."""
    src = SRC_DIR.parent
    offenders = set()
    for path in SRC_DIR.rglob("*.py"):
        if not path.is_relative_to(TESTING_DIR):
            module = _module_name(path, src)
            offenders |= {(module, n) for n in _imported_modules(path, src) if _is_testing(n)}
    return {(m, n) for m, n in offenders if (m, n.rpartition(".")[0]) not in offenders}


def test_product_code_does_not_import_the_test_helpers() -> None:
    """``tspd.testing`` is for tests, with no exception: product code builds
    contracts and allocates pages with ``tspd.layouts``, finds the in-process
    engines in ``tspd.engines.memory``, and the benchmarks wire cores themselves
    (``tspd.bench.pair``)."""
    assert _testing_imports() == set(), "import tspd.layouts or tspd.engines, not tspd.testing"


def test_the_testing_import_scan_sees_every_spelling(tmp_path: Path) -> None:
    package = tmp_path / "tspd" / "demo"
    package.mkdir(parents=True)
    sources = {
        "a.py": "import tspd.testing.layouts\n",
        "b.py": "from tspd.testing.layouts import PageAllocator\n",
        "c.py": "from tspd import testing\n",
        "d.py": "def f():\n    from ..testing import fake_engine\n",
        "e.py": "from tspd.layouts import PageAllocator\nfrom . import roles\n",
    }
    hits = {}
    for name, text in sources.items():
        (package / name).write_text(text)
        hits[name] = any(map(_is_testing, _imported_modules(package / name, tmp_path)))
    assert hits == {"a.py": True, "b.py": True, "c.py": True, "d.py": True, "e.py": False}


def test_importing_layouts_pulls_in_no_io_library() -> None:
    code = (
        "import sys, tspd.layouts\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN_MODULES!r})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout.strip()
    assert out == "", f"tspd.layouts imported I/O modules: {out}"
