"""The import rules of docs/architecture.md ("Import rules"), checked on the source with ast.

Every ``import`` / ``from ... import`` in duplexkit/ and server/ counts, including the ones inside
functions (lazy imports are still dependencies). ``errors``, ``_lazy`` and ``units`` are open to every
room.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]
OPEN = {"errors", "_lazy", "units"}


def _rules() -> dict[str, set]:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    table = doc.split("<!-- import-rules:begin -->", 1)[1].split("<!-- import-rules:end -->", 1)[0]
    rules = {}
    for line in table.strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        room = cells[0].strip("`")
        rules[room] = set(re.findall(r"`([^`]+)`", cells[1]))
    return rules


def _exists(*parts: str) -> bool:
    base = ROOT.joinpath(*parts)
    return base.is_dir() or base.with_suffix(".py").is_file()


def _room(module: str) -> Optional[str]:
    """The room of a dotted name (a module, or a name imported from one)."""
    parts = module.split(".")
    if parts[0] in ("server", "duplexkit_server"):
        return "server"
    if parts[0] != "duplexkit":
        return None
    if len(parts) == 1 or not _exists("duplexkit", parts[1]):
        return "duplexkit"  # the top package or a name it defines (``__version__``)
    if parts[1] == "engine" and len(parts) > 2:
        if parts[2] == "api" or (not _exists("duplexkit", "engine", parts[2]) and parts[2] in _api_names()):
            return "engine.api"  # the contract, also when re-exported by duplexkit.engine
    return parts[1]


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[str, int]]:
    """(imported dotted name, line) for every import of ``path``: ``import a.b`` yields ``a.b``,
    ``from a import n`` yields ``a.n`` (relative imports resolved)."""
    mod = _module_name(path)
    package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out += [(f"{target}.{a.name}", node.lineno) for a in node.names]
    return out


def _violations() -> list[str]:
    rules = _rules()
    bad = []
    files = sorted((ROOT / "duplexkit").rglob("*.py")) + sorted((ROOT / "server").rglob("*.py"))
    for path in files:
        src = _room(_module_name(path))
        if src not in rules:
            continue
        allowed = rules[src] | OPEN | {src}
        for target, line in _imports(path):
            room = _room(target)
            if room is None or room in allowed:
                continue
            bad.append(f"{path.relative_to(ROOT)}:{line}: {src} imports {target} ({room})")
    return bad


def _api_names() -> set:
    path = ROOT / "duplexkit" / "engine" / "api.py"
    if path in _API_CACHE:
        return _API_CACHE[path]
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    _API_CACHE[path] = names
    return names


_API_CACHE: dict = {}


def test_rules_table_names_every_room():
    rules = _rules()
    assert {"protocol", "audio", "engine.api", "models", "session", "testing", "engine", "driver", "clients",
            "server", "cli", "agent"} <= set(rules)


def test_no_room_imports_what_it_may_not():
    assert _violations() == []


def test_the_checker_catches_a_forbidden_import(tmp_path):
    """A session module importing the runtime is reported (the check can fail)."""
    fake_root = tmp_path
    (fake_root / "docs").mkdir()
    (fake_root / "docs" / "architecture.md").write_text((ROOT / "docs" / "architecture.md").read_text())
    pkg = fake_root / "duplexkit" / "session"
    pkg.mkdir(parents=True)
    (pkg / "bad.py").write_text("def f():\n    from duplexkit.engine.runtime import StageRuntime\n")
    (fake_root / "duplexkit" / "engine").mkdir()
    (fake_root / "duplexkit" / "engine" / "api.py").write_text("X = 1\n")
    (fake_root / "server").mkdir()
    globals()["ROOT"] = fake_root
    try:
        bad = _violations()
    finally:
        globals()["ROOT"] = ROOT_REAL
    assert bad == ["duplexkit/session/bad.py:2: session imports duplexkit.engine.runtime.StageRuntime (engine)"]


ROOT_REAL = ROOT
