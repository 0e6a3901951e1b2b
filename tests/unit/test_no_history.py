"""The product says what things are and do, not when or why they were made.

Docs, docstrings, comments, benchmark scripts and tests must not refer to the development process by
number ("stop 18", "issue 10 item 6", "before stop 19"): a user reading them would meet the project's
diary instead of a description. Git history keeps the story; dated benchmark logs live in
``benchmarks/results/`` and name dates, not milestones.

Scans README.md and the text files of docs/, duplexkit/, server/, benchmarks/, scripts/, examples/ and
tests/, and fails listing every hit as ``path:line: text``.

Exceptions:

* :data:`PENDING_SWEEP`: files other engineers are editing right now (their branches may still add
  hits when merged); they are swept after merging and the list is then emptied.
* :data:`EXCEPTIONS`: files with a justified hit, each with its reason.
* Durations are not history: "stop 2 s", "issue 30 ms later" are not matched (see :data:`HISTORY`).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ["README.md", "docs", "duplexkit", "server", "benchmarks", "scripts", "examples", "tests"]
SUFFIXES = {".py", ".md", ".sh", ".js", ".html", ".yaml", ".yml", ".toml", ".txt"}

#: "stop 18", "Issue 36", "issues 10", "stops 16": a milestone named by number. Not a duration: a number
#: followed by a time unit or a percent ("stop 2 s", "issue 30 ms later") is left alone, and a number
#: never matches part of a longer one or a decimal.
HISTORY = re.compile(
    r"(?<![\w-])(?:stop|issue)s? \d+(?!\d)(?![.,]\d)(?!\s*(?:ms|s|secs?|seconds?|min|minutes?|h|hours?|%)\b)",
    re.IGNORECASE)

#: Paths (files, or folders ending in "/") owned by engineers still working when the history sweep
#: landed; they are swept after merging. Empty it then.
PENDING_SWEEP: set[str] = set()  # none: every path is swept

#: file -> why its hits are not history.
EXCEPTIONS: dict[str, str] = {
    "tests/unit/test_no_history.py": "this test: the pattern's own examples of what it matches",
}


def _files() -> list[Path]:
    out: list[Path] = []
    for name in SCANNED:
        p = ROOT / name
        if p.is_file():
            out.append(p)
        elif p.is_dir():
            out.extend(f for f in sorted(p.rglob("*"))
                       if f.is_file() and f.suffix in SUFFIXES
                       and not {"__pycache__", ".venv", "node_modules"} & set(f.parts))
    return out


def _pending(rel: str) -> str | None:
    for entry in sorted(PENDING_SWEEP):
        if rel == entry or (entry.endswith("/") and rel.startswith(entry)):
            return entry
    return None


def find_history() -> list[str]:
    """Return the ``path:line: text`` hits outside :data:`PENDING_SWEEP`."""
    bad: list[str] = []
    for f in _files():
        rel = f.relative_to(ROOT).as_posix()
        if _pending(rel) is not None or rel in EXCEPTIONS:
            continue
        for lineno, line in enumerate(f.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            for m in HISTORY.finditer(line):
                bad.append(f"{rel}:{lineno}: {m.group(0)!r} in {line.strip()[:120]}")
    return bad


def test_pattern_matches_history_and_not_durations():
    for text in ("the path before stop 18", "(issue 10 item 6)", "Issue 36 over a real socket",
                 "float16 since stop 20;", "issues 13 and 14", "Stop 17 (2026-12-02)",
                 "target (issue 35, one H200)", "issue 19's step 8"):
        assert HISTORY.search(text), text
    for text in ("the stream may stop 2 s later", "issue 30 ms after", "stop_words = 3",
                 "non-stop 10", "issue 1.5 s later", "stop 0.5 seconds", "tissue 12", "nonstop 3"):
        assert not HISTORY.search(text), text


def test_no_development_history_in_the_product():
    bad = find_history()
    assert not bad, ("the development process is named by number; say what the thing is or does "
                     "(dated history goes to benchmarks/results/, the rest to git history):\n"
                     + "\n".join(bad))
