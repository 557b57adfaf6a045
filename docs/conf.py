"""Sphinx configuration of the tspd documentation (MyST Markdown pages plus autodoc).

Built by ``tests/test_docs.py`` with warnings as errors, so a broken page, a bad
docstring or a stale include fails the test suite.
"""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS / "_ext"))

project = "tspd"
author = "the tspd authors"
copyright = "the tspd authors"
release = "0.1.0"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.viewcode",
    "sphinxcontrib.mermaid",
    "sphinx_click",
    "tspd_docs",
]

source_suffix = {".md": "markdown"}
exclude_patterns = ["_build", "README.md"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}

html_theme = "alabaster"
html_title = "tspd"
html_static_path: list[str] = []
