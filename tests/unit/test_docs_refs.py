"""Docs, examples, docstrings and error messages refer only to files that are in the repository.

Scans README.md, docs/, examples/, duplexkit/ and server/ for

* ``*.md`` names (``PROTOCOL.md``, ``docs/protocol.md``, ``[x](clients.md#y)``): each must resolve
  to a file relative to the referring file, to the repository root, or to ``docs/``;
* paths outside the repository: ``../shared`` and ``/work/...`` (the development machine's layout).

and fails listing every reference that does not resolve, as ``path:line: reference``.

Two named exceptions:

* :data:`TEST_DATA_NOTES`: files that explain which tests use the optional shared test data next to a
  development checkout (``../shared``); they may name it, nothing else may.
* :data:`PENDING_AFTER_MERGE`: references still to be rewritten in files other developers are editing;
  empty now. An entry that no longer matches anything fails the test, so the list can only shrink.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ["README.md", "docs", "examples", "duplexkit", "server"]
SUFFIXES = {".md", ".py", ".sh", ".html", ".js", ".css", ".yaml", ".yml", ".toml", ".txt"}

#: ``name.md`` with an optional path before it (``docs/protocol.md``, ``../docs/x.md``).
MD_REF = re.compile(r"(?<![\w/.-])((?:\.{1,2}/)?(?:[\w-]+/)*[\w-]+\.md)\b")
#: paths that point outside the repository.
OUTSIDE_REF = re.compile(r"(\.\./shared\b[\w/.-]*|/work/[\w/.-]+)")

#: file (relative to the root) -> may name ``../shared`` (optional test data of a development checkout).
TEST_DATA_NOTES = {"README.md", "docs/model.md", "docs/troubleshooting.md"}

#: file -> references still to be rewritten in files other developers are editing (empty).
PENDING_AFTER_MERGE: dict[str, set[str]] = {}


def _files() -> list[Path]:
    out: list[Path] = []
    for name in SCANNED:
        p = ROOT / name
        if p.is_file():
            out.append(p)
        elif p.is_dir():
            out.extend(f for f in sorted(p.rglob("*"))
                       if f.is_file() and f.suffix in SUFFIXES and "__pycache__" not in f.parts)
    return out


def _resolves(ref: str, referrer: Path) -> bool:
    return any((base / ref).is_file() for base in (referrer.parent, ROOT, ROOT / "docs"))


def find_bad_refs() -> tuple[list[str], dict[str, set[str]]]:
    """Return (unresolved ``path:line: ref`` strings, allow-listed refs actually seen per file)."""
    bad: list[str] = []
    seen_pending: dict[str, set[str]] = {}
    for f in _files():
        rel = f.relative_to(ROOT).as_posix()
        pending = PENDING_AFTER_MERGE.get(rel, set())
        for lineno, line in enumerate(f.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            refs = [m for m in MD_REF.findall(line) if not _resolves(m, f)]
            if rel not in TEST_DATA_NOTES:
                refs += OUTSIDE_REF.findall(line)
            for ref in refs:
                if ref in pending:
                    seen_pending.setdefault(rel, set()).add(ref)
                else:
                    bad.append(f"{rel}:{lineno}: {ref}")
    return bad, seen_pending


def test_no_reference_to_files_outside_the_repository():
    bad, _ = find_bad_refs()
    assert not bad, ("references to files that are not in the repository (use docs/protocol.md §N, "
                     "docs/model.md §N, docs/architecture.md):\n" + "\n".join(bad))


def test_pending_allow_list_only_shrinks():
    _, seen = find_bad_refs()
    stale = sorted(f"{path}: {ref}" for path, refs in PENDING_AFTER_MERGE.items()
                   for ref in refs - seen.get(path, set()))
    assert not stale, "PENDING_AFTER_MERGE entries that no longer occur; delete them:\n" + "\n".join(stale)


@pytest.mark.parametrize("text, expected", [
    ("see PROTOCOL.md §7.5", ["PROTOCOL.md"]),
    ("see docs/protocol.md §7.5 and [x](clients.md#a)", []),
    ("data in ../shared/parity", ["../shared/parity"]),
])
def test_the_scanner_flags_what_it_should(tmp_path, text, expected):
    f = ROOT / "docs" / "index.md"  # resolve relative to docs/, like a page would
    found = [m for m in MD_REF.findall(text) if not _resolves(m, f)] + OUTSIDE_REF.findall(text)
    assert found == expected


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation (including §) dropped, spaces -> '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_doc_anchors_resolve():
    """Every ``[x](page.md#anchor)`` / ``[x](#anchor)`` in README.md and docs/ names a heading of
    that page (so "docs/protocol.md §7.5"-style links land on their section)."""
    pages = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
    heads = {p.resolve(): {_slug(m) for m in re.findall(r"(?m)^#+\s+(.*)$", p.read_text(encoding="utf-8"))}
             for p in pages}
    bad = []
    for page in pages:
        for lineno, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            for target, anchor in re.findall(r"\]\(([\w./-]*\.md)?#([^)\s]+)\)", line):
                dest = (page.parent / target).resolve() if target else page.resolve()
                if dest in heads and anchor not in heads[dest]:
                    bad.append(f"{page.relative_to(ROOT)}:{lineno}: {target}#{anchor}")
    assert not bad, "links to headings that do not exist:\n" + "\n".join(bad)


#: the only tests that may name ``../shared``: the model parity tests and their fixtures, which the
#: README's "Tests and ../shared" paragraph explains (they skip without it).
PARITY_TEST_DIR = "tests/model/"


def test_tests_name_shared_only_for_the_parity_pack_the_readme_explains():
    outside = []
    for f in sorted((ROOT / "tests").rglob("*.py")):
        rel = f.relative_to(ROOT).as_posix()
        if rel == "tests/unit/test_docs_refs.py" or rel.startswith(PARITY_TEST_DIR):
            continue
        for lineno, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            outside += [f"{rel}:{lineno}: {ref}" for ref in OUTSIDE_REF.findall(line)]
    assert not outside, "tests outside the parity pack that name files outside the repository:\n" + "\n".join(outside)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    note = readme[readme.index("**Tests and `../shared`.**"):]
    assert "tests/model/test_parity_" in note and "skip" in note
