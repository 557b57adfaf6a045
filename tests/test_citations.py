"""Citations of the protocol reference resolve, and references outside the repository
only ever become fewer.

Code, tests and docs cite ``docs/protocol.md`` by its section labels (the rule is
stated in the page's "How code cites this reference" section):

* in code comments, docstrings and plain text: ``docs/protocol.md#proto-<name>``;
* in the MyST pages under ``docs/``: ``{ref}`proto-<name>``` (or
  ``{ref}`text <proto-<name>>```).

Every cited label must exist, so renaming a section cannot leave a stale citation
behind, and ``test_no_reference_leaves_the_repository`` fails on any reference to a
document kept outside the repository. No test here builds the docs,
so the module runs in well under a second.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PROTOCOL = DOCS / "protocol.md"
THIS_FILE = Path(__file__).resolve()

#: Where citations and stray references are looked for.
SCANNED_DIRS = ("src", "tests", "fuzz", "examples", "docs")
#: Text files worth reading there (binary captures, images and diagrams are not).
SCANNED_SUFFIXES = frozenset(
    {".py", ".md", ".rst", ".txt", ".toml", ".cfg", ".ini", ".json", ".yaml", ".yml", ".mmd"}
)
#: Never scanned: build output and caches, and this file (it spells the patterns out).
SKIPPED_PARTS = frozenset({"_build", "__pycache__", ".hypothesis", ".pytest_cache"})
SKIPPED_FILES = frozenset({THIS_FILE})


LABEL = r"proto-[a-z0-9]+(?:-[a-z0-9]+)*"
_LABEL = re.compile(LABEL)
#: A label definition in a MyST page: ``(proto-name)=`` on a line of its own.
_DEFINITION = re.compile(r"^\((?P<label>[^)\s]+)\)=\s*$", re.MULTILINE)
#: The plain-text citation of code, tests and plain text.
_CODE_CITATION = re.compile(rf"docs/protocol\.md#(?P<label>{LABEL})")
#: Anything that looks like an attempt at the plain-text form, well formed or not.
_CODE_ATTEMPT = re.compile(r"(?:docs/)?protocol(?:\.md)?#[^\s`'\")\],;]*")
#: A MyST reference to a ``proto-`` label: {ref}`proto-x` or {ref}`text <proto-x>`.
_DOC_CITATION = re.compile(r"\{ref\}`(?:[^`<]*<)?(?P<label>proto-[^`>]*)>?`")

#: What a reference to a document outside the repository looks like: a section sign
#: followed by a number (the old "spec §7.9.5", "(§4.3)", "design §4"), or the path of
#: such a document.
_OUT_OF_REPO = re.compile(
    r"§\s*\d"
    r"|spec/protocol\.md"
    r"|notes/[\w.-]+\.md"
    r"|\bdesign\.md"
    r"|style[ -]anchors"
    r"|\.\./shared\b"
    r"|/work/shared\b"
    r"|\bshared/(?:spec|notes|seeds|bench)\b"
)


@dataclass(frozen=True, slots=True)
class Hit:
    """One match: where it is and what it says."""

    path: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.text}"


def scanned_files(root: Path = ROOT) -> Iterator[Path]:
    """Every text file of :data:`SCANNED_DIRS` that the checks read."""
    for name in SCANNED_DIRS:
        base = root / name
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*")):
            if (
                path.is_file()
                and path.suffix in SCANNED_SUFFIXES
                and SKIPPED_PARTS.isdisjoint(path.relative_to(root).parts)
                and path.resolve() not in SKIPPED_FILES
            ):
                yield path


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def _hits(pattern: re.Pattern[str], text: str, path: str, group: str | int = 0) -> list[Hit]:
    return [
        Hit(path, text.count("\n", 0, m.start()) + 1, m.group(group))
        for m in pattern.finditer(text)
    ]


def defined_labels(pages: Iterable[Path]) -> Counter[str]:
    """How often each ``proto-`` label is defined across ``pages``."""
    found: Counter[str] = Counter()
    for page in pages:
        for m in _DEFINITION.finditer(_read(page)):
            if m["label"].startswith("proto-"):
                found[m["label"]] += 1
    return found


def protocol_labels() -> set[str]:
    """The labels ``docs/protocol.md`` defines: what code may cite."""
    return set(defined_labels([PROTOCOL]))


def doc_pages() -> list[Path]:
    """The MyST pages of the docs."""
    return [p for p in scanned_files() if p.suffix == ".md" and p.is_relative_to(DOCS)]


def dangling_citations(text: str, path: str, *, labels: set[str], is_doc: bool) -> list[Hit]:
    """Citations in ``text`` that name no existing label, and attempts at the
    plain-text form that are not well formed (``docs/protocol#…``, a missing
    ``proto-`` prefix, a bare ``protocol.md#…``)."""
    bad = [h for h in _hits(_CODE_CITATION, text, path, "label") if h.text not in labels]
    well_formed = {m.start() for m in _CODE_CITATION.finditer(text)}
    for m in _CODE_ATTEMPT.finditer(text):
        # A well-formed citation's match starts at "docs/"; a bare "protocol.md#" is
        # malformed whether or not its label exists.
        if m.start() not in well_formed:
            bad.append(Hit(path, text.count("\n", 0, m.start()) + 1, m.group(0)))
    if is_doc:
        bad += [
            h
            for h in _hits(_DOC_CITATION, text, path, "label")
            if h.text not in labels or not _LABEL.fullmatch(h.text)
        ]
    return bad


def out_of_repo_references() -> list[Hit]:
    """Every reference to a document outside the repository, in scan order."""
    hits: list[Hit] = []
    for path in scanned_files():
        hits += _hits(_OUT_OF_REPO, _read(path), str(path.relative_to(ROOT)))
    return hits


# ----------------------------------------------------------------------------- tests


def test_protocol_labels_are_well_formed_unique_and_head_a_section() -> None:
    counts = defined_labels(doc_pages())
    assert len(counts) >= 60, "docs/protocol.md should define its section labels"
    assert [label for label, n in counts.items() if n > 1] == []
    assert [label for label in counts if not _LABEL.fullmatch(label)] == []
    text = _read(PROTOCOL)
    for m in _DEFINITION.finditer(text):
        following = text[m.end() :].lstrip("\n").split("\n", 1)[0]
        assert following.startswith("#"), f"label {m['label']} is not followed by a heading"
    # The page states the citation rule it is cited by.
    assert "docs/protocol.md#proto-registration" in text
    assert {"proto-citing", "proto-compat-levels"} <= set(counts)


def test_every_citation_names_an_existing_label() -> None:
    labels = protocol_labels()
    all_labels = set(defined_labels(doc_pages()))
    cited = 0
    bad: list[Hit] = []
    for path in scanned_files():
        text = _read(path)
        is_doc = path.suffix == ".md" and path.is_relative_to(DOCS)
        rel = str(path.relative_to(ROOT))
        cited += len(_CODE_CITATION.findall(text)) + (
            len(_DOC_CITATION.findall(text)) if is_doc else 0
        )
        # Code cites docs/protocol.md, so its labels must be that page's; the docs'
        # {ref} roles may name a proto- label of any page.
        bad += dangling_citations(text, rel, labels=labels, is_doc=False)
        if is_doc:
            bad += [
                h
                for h in _hits(_DOC_CITATION, text, rel, "label")
                if h.text not in all_labels or not _LABEL.fullmatch(h.text)
            ]
    assert bad == [], "citations of missing or malformed labels:\n" + "\n".join(map(str, bad))
    assert cited > 0


def test_the_citation_check_catches_dangling_and_malformed_citations() -> None:
    labels = {"proto-registration"}
    good = "Check order: docs/protocol.md#proto-registration. See {ref}`proto-registration`."
    assert dangling_citations(good, "x.md", labels=labels, is_doc=True) == []
    text = (
        "a docs/protocol.md#proto-gone b\n"
        "c docs/protocol#proto-registration d\n"
        "e protocol.md#registration f\n"
        "g {ref}`see <proto-vanished>` h\n"
    )
    found = [h.text for h in dangling_citations(text, "x.md", labels=labels, is_doc=True)]
    assert found == [
        "proto-gone",
        "docs/protocol#proto-registration",
        "protocol.md#registration",
        "proto-vanished",
    ]
    # In code, only the plain-text form counts; a {ref} there is not a citation.
    assert dangling_citations("{ref}`proto-vanished`", "x.py", labels=labels, is_doc=False) == []


def test_the_protocol_reference_cites_nothing_outside_the_repository() -> None:
    hits = _hits(_OUT_OF_REPO, _read(PROTOCOL), "docs/protocol.md")
    assert hits == [], "\n".join(map(str, hits))


def test_no_reference_leaves_the_repository(
    record_property: Callable[[str, object], None],
) -> None:
    hits = out_of_repo_references()
    count = len(hits)
    record_property("out_of_repo_references", count)
    by_file = Counter(h.path for h in hits)
    summary = ", ".join(f"{path} {n}" for path, n in by_file.most_common(8))
    print(f"\n{count} references to documents outside the repository remain: {summary}")
    assert count == 0, (
        f"{count} references to documents outside the repository: cite "
        "docs/protocol.md#proto-<label> instead. "
        f"Most in: {summary}"
    )
