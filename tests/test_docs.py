"""The documentation builds cleanly, and what it shows is what the code does.

The HTML build runs with warnings as errors, so a broken page, a bad docstring, a
missing include or a module autodoc cannot import fails the suite. The other
tests check the pages against the code they describe: the tutorial's script runs,
every cross-reference resolves, every module is in the API reference, every
command is in the CLI reference, and every variable and default of the
configuration page matches the code.
"""

from __future__ import annotations

import dataclasses
import html
import re
import subprocess
import sys
from pathlib import Path

import pytest

import tspd.core.config as pd_config
from tspd.core.kv_config import KVEventsConfig

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
HAND_WRITTEN = sorted(p.stem for p in DOCS.glob("*.md") if p.name != "README.md")
API_PAGES = {
    "tspd.core": "core",
    "tspd.shell": "shell",
    "tspd.engines": "engines",
    "tspd.hosts": "hosts",
    "tspd.testing": "testing",
    "tspd.log": "logging",
    "tspd.layouts": "layouts",
    "tspd.sim": "sim",
}


@pytest.fixture(scope="module")
def html_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The HTML docs, built once for this module with warnings as errors."""
    out = tmp_path_factory.mktemp("html")
    doctrees = tmp_path_factory.mktemp("doctrees")
    command = [sys.executable, "-m", "sphinx", "-b", "html", "-W", "--keep-going", "-q"]
    result = subprocess.run(
        [*command, "-d", str(doctrees), str(DOCS), str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, f"the docs do not build cleanly:\n{result.stderr}"
    return out


def _page(html_dir: Path, name: str) -> str:
    return (html_dir / f"{name}.html").read_text(encoding="utf-8")


def _text(markup: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", markup))


def test_docs_build_without_warnings(html_dir: Path) -> None:
    for name in ["index", *HAND_WRITTEN, "api/index"]:
        assert (html_dir / f"{name}.html").is_file(), name


def _unresolved_references(markup: str) -> list[str]:
    """Python cross-references that Sphinx rendered without a link: a name that
    does not exist (or is not documented) any more."""
    bad = []
    for match in re.finditer(r'<code class="xref py[^"]*">(.*?)</code>', markup, re.DOTALL):
        before = markup[max(0, match.start() - 400) : match.start()]
        if not re.search(r'<a class="reference internal"[^>]*>\s*$', before):
            bad.append(_text(match.group(1)))
    return bad


def test_every_cross_reference_on_the_guide_pages_resolves(html_dir: Path) -> None:
    checked = 0
    for name in HAND_WRITTEN:
        markup = _page(html_dir, name)
        assert _unresolved_references(markup) == [], name
        checked += markup.count('class="xref py')
    assert checked > 50


def test_the_unresolved_reference_check_catches_a_dangling_name() -> None:
    dangling = (
        '<p><code class="xref py py-class docutils literal notranslate">'
        '<span class="pre">tspd.core.Gone</span></code></p>'
    )
    linked = f'<a class="reference internal" href="#x" title="x">{dangling[3:-4]}</a>'
    assert _unresolved_references(dangling) == ["tspd.core.Gone"]
    assert _unresolved_references(linked) == []


def _modules(package: str) -> list[str]:
    import importlib
    import pkgutil

    root = importlib.import_module(package)
    found = [package]
    if not hasattr(root, "__path__"):
        return found
    for info in pkgutil.walk_packages(root.__path__, prefix=f"{package}."):
        if not info.name.rsplit(".", 1)[-1].startswith("_"):
            found.append(info.name)
    return found


@pytest.mark.parametrize(("package", "page"), API_PAGES.items())
def test_the_api_reference_documents_every_module(html_dir: Path, package: str, page: str) -> None:
    markup = _page(html_dir, f"api/{page}")
    modules = _modules(package)
    assert len(modules) > 1 or package in ("tspd.log", "tspd.layouts")
    for module in modules:
        assert f'id="module-{module}"' in markup, module
    # Docstrings are reStructuredText: none may leak through as raw markup.
    assert ".. py:" not in _text(markup)
    assert ":class:`" not in _text(markup)


def test_the_cli_reference_lists_every_command(html_dir: Path) -> None:
    from tspd.cli import _COMMANDS

    text = _text(_page(html_dir, "cli"))
    for name in _COMMANDS:
        assert f"tspd {name}" in text, name
    assert "--check" in text  # options come from the commands themselves


def test_the_state_machine_page_shows_every_committed_diagram(html_dir: Path) -> None:
    from tspd.cli.diagrams import DECLARATIONS

    markup = _page(html_dir, "state-machines")
    for declaration in DECLARATIONS:
        assert f"{declaration.name}.svg" in markup
        assert (html_dir / "_images" / f"{declaration.name}.svg").is_file()
        mermaid = (DOCS / "state-machines" / f"{declaration.name}.mmd").read_text("utf-8")
        edge = next(line.strip() for line in mermaid.splitlines() if "-->" in line)
        assert html.escape(edge, quote=False) in markup, edge


def test_the_metrics_page_lists_every_exposed_metric_with_its_labels(html_dir: Path) -> None:
    from prometheus_client import CollectorRegistry

    from tspd.shell.metrics import TokenSpeedLabels, TspdMetrics

    registry = CollectorRegistry()
    TspdMetrics(registry, tokenspeed=TokenSpeedLabels(model_name="m"))
    exposed = {metric.name for metric in registry.collect()}
    assert len(exposed) > 20
    rows = {
        _text(cells[0]): _text(cells[2])
        for row in re.findall(r"<tr[^>]*>(.*?)</tr>", _page(html_dir, "metrics"), re.DOTALL)
        for cells in [re.findall(r"<td[^>]*>(.*?)</td>", row, re.DOTALL)]
        if len(cells) == 4
    }
    for family in exposed:
        # A family's samples carry the suffix the exposition adds to counters.
        name = next((n for n in (family, f"{family}_total") if n in rows), None)
        assert name is not None, f"{family} is exposed but not on the metrics page"
        if name.startswith("tspd_"):
            assert rows[name] != "—", f"add {name}'s labels to tspd.shell.metrics' table"


def test_the_tutorial_includes_the_script_the_suite_runs(html_dir: Path) -> None:
    text = _text(_page(html_dir, "tutorial"))
    assert "open_prefill_peer(" in text
    assert "verify_room(" in text


def test_the_tutorial_script_moves_a_room_end_to_end() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "tutorial_loopback.py")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert "room 7: 40 tokens of KV moved from Prefill to Decode" in result.stdout


def test_the_configuration_page_lists_every_variable_with_its_default() -> None:
    page = (DOCS / "configuration.md").read_text(encoding="utf-8")
    names = [
        value
        for key, value in vars(pd_config).items()
        if key.startswith("ENV_") and isinstance(value, str)
    ]
    assert len(names) >= 9
    for name in names:
        assert f"`{name}`" in page, name
    defaults = pd_config.PDEnv()
    rows = {line.split("|")[4].strip(" `"): line for line in page.splitlines() if "| `" in line}
    for field in dataclasses.fields(pd_config.PDEnv):
        row = rows.get(field.name)
        assert row is not None, f"no row for PDEnv.{field.name}"
        value = getattr(defaults, field.name)
        shown = "unset" if value is None else f"`{value}`"
        assert shown in row, (field.name, value)
    assert f"`{pd_config.DEFAULT_BOOTSTRAP_PORT}`" in page


def test_the_configuration_page_lists_every_kv_events_field_with_its_default() -> None:
    page = (DOCS / "configuration.md").read_text(encoding="utf-8")
    defaults = KVEventsConfig()
    spelled = {None: "null", False: "false", True: "true"}
    for field in dataclasses.fields(KVEventsConfig):
        if field.name == "unknown_keys":
            continue
        value = getattr(defaults, field.name)
        if isinstance(value, bool) or value is None:
            shown = spelled[value]
        elif isinstance(value, str):
            shown = f'"{value}"'
        else:
            shown = str(value)
        assert f"| `{field.name}` | `{shown}` |" in page, (field.name, shown)


def test_the_fuzz_readme_covers_every_target() -> None:
    readme = (ROOT / "fuzz" / "README.md").read_text(encoding="utf-8")
    targets = sorted(p.name for p in (ROOT / "fuzz").glob("fuzz_*.py"))
    assert targets
    for target in targets:
        assert f"fuzz/{target}" in readme, target
    for test in sorted((ROOT / "tests" / "core").glob("test_fuzz_targets_*.py")):
        assert test.name in readme, test.name
