"""The tspd docs' own Sphinx extension: pages generated from the code they describe.

Two markers are replaced when Sphinx reads a page, so the pages cannot drift from
the code:

* ``<!-- tspd-api: PACKAGE -->`` becomes one section and one ``automodule`` per
  module of ``PACKAGE`` (found by walking the installed package), so a new module
  appears in the API reference without anyone editing the docs;
* ``<!-- tspd-metrics -->`` becomes a table of every Prometheus metric a
  :class:`tspd.shell.metrics.TspdMetrics` registry exposes (with the opt-in
  TokenSpeed-named ones), read from a live registry: name, kind and help text,
  with the labels that the module's own table lists.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from typing import Any

_MARKER = re.compile(r"^<!-- tspd-api: (?P<package>[\w.]+) -->$", re.MULTILINE)
_METRICS_MARKER = re.compile(r"^<!-- tspd-metrics -->$", re.MULTILINE)
_LABELS_ROW = re.compile(
    r"^``(?P<name>[\w:]+)``\s+(?:counter|gauge|histogram)\s+(?P<labels>.+?)\s*$", re.MULTILINE
)


def modules_of(package: str) -> list[str]:
    """``package`` and every module below it, sorted by name (just ``package`` when
    it is a plain module)."""
    root = importlib.import_module(package)
    names = [package]
    if not hasattr(root, "__path__"):  # a plain module, not a package
        return names
    for info in pkgutil.walk_packages(root.__path__, prefix=f"{package}."):
        if not info.name.rsplit(".", 1)[-1].startswith("_"):
            names.append(info.name)
    return sorted(names)


def _api_section(match: re.Match[str]) -> str:
    parts = []
    for name in modules_of(match["package"]):
        # A package's own page is its docstring: what its __all__ re-exports is
        # documented once, in the module that defines it.
        is_package = hasattr(importlib.import_module(name), "__path__")
        options = "   :no-members:\n" if is_package else ""
        # eval-rst: the docstrings are reStructuredText, not Markdown.
        parts.append(f"## `{name}`\n\n```{{eval-rst}}\n.. automodule:: {name}\n{options}```\n")
    return "\n".join(parts)


def exposed_metrics() -> list[tuple[str, str, str]]:
    """``(name, kind, help)`` of every metric family a fresh registry exposes, in
    exposition order, ``_created`` companions left out."""
    from tspd.shell.metrics import TokenSpeedLabels, TspdMetrics

    body, _ = TspdMetrics(tokenspeed=TokenSpeedLabels(model_name="model")).render()
    helps: dict[str, str] = {}
    out = []
    for line in body.decode("utf-8").splitlines():
        if line.startswith("# HELP "):
            name, _, text = line[len("# HELP ") :].partition(" ")
            helps[name] = text
        elif line.startswith("# TYPE "):
            name, _, kind = line[len("# TYPE ") :].partition(" ")
            if not name.endswith("_created"):
                out.append((name, kind, helps.get(name, "")))
    return out


def _metrics_table(match: re.Match[str]) -> str:
    import tspd.shell.metrics

    documented = tspd.shell.metrics.__doc__ or ""
    labels = {m["name"]: m["labels"] for m in _LABELS_ROW.finditer(documented)}
    rows = ["| Metric | Kind | Labels | Meaning |", "|---|---|---|---|"]
    for name, kind, text in exposed_metrics():
        cell = text.replace("|", "\\|")
        rows.append(f"| `{name}` | {kind} | {labels.get(name, '—')} | {cell} |")
    return "\n".join(rows) + "\n"


def _expand(app: Any, docname: str, source: list[str]) -> None:
    source[0] = _MARKER.sub(_api_section, source[0])
    source[0] = _METRICS_MARKER.sub(_metrics_table, source[0])


def setup(app: Any) -> dict[str, Any]:
    app.connect("source-read", _expand)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
