"""The tspd docs' own Sphinx extension: API pages generated from the package tree.

A page holds a line ``<!-- tspd-api: PACKAGE -->``; when Sphinx reads the page the
line becomes one section and one ``automodule`` per module of ``PACKAGE`` (found by
walking the installed package), so a new module appears in the API reference
without anyone editing the docs.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from typing import Any

_MARKER = re.compile(r"^<!-- tspd-api: (?P<package>[\w.]+) -->$", re.MULTILINE)


def modules_of(package: str) -> list[str]:
    """``package`` and every module below it, sorted by name."""
    root = importlib.import_module(package)
    names = [package]
    for info in pkgutil.walk_packages(root.__path__, prefix=f"{package}."):
        if not info.name.rsplit(".", 1)[-1].startswith("_"):
            names.append(info.name)
    return sorted(names)


def _api_section(match: re.Match[str]) -> str:
    parts = []
    for name in modules_of(match["package"]):
        # eval-rst: the docstrings are reStructuredText, not Markdown.
        parts.append(f"## `{name}`\n\n```{{eval-rst}}\n.. automodule:: {name}\n```\n")
    return "\n".join(parts)


def _expand(app: Any, docname: str, source: list[str]) -> None:
    source[0] = _MARKER.sub(_api_section, source[0])


def setup(app: Any) -> dict[str, Any]:
    app.connect("source-read", _expand)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
