"""Size figures of the sans-I/O Session (docs/architecture.md, "The sans-I/O Session").

For every class of ``duplexkit/session/*.py``: code lines (lines holding code, excluding blank
lines, comments and docstrings), methods (functions defined in the class body, properties
included) and attributes (names assigned as ``self.<name>`` in its methods, plus class-level
annotated names and ``__slots__``). ``Session`` is also counted as one object together with every
class of the package in its MRO (its mixins, if any), which is what a reader of one ``self`` faces.

Usage::

    python scripts/session_metrics.py            # a table
    python scripts/session_metrics.py --json     # the same as JSON
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "duplexkit" / "session"


def code_lines(source: str) -> set[int]:
    """Line numbers (1-based) holding code: not blank, not only a comment, not in a docstring."""
    tree = ast.parse(source)
    doc: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                doc.update(range(body[0].lineno, body[0].end_lineno + 1))
        # attribute docstrings: a bare string right after an assignment at module or class level
        if isinstance(node, (ast.Module, ast.ClassDef)):
            for prev, cur in zip(node.body, node.body[1:]):
                if isinstance(prev, (ast.Assign, ast.AnnAssign)) and isinstance(cur, ast.Expr) \
                        and isinstance(cur.value, ast.Constant) and isinstance(cur.value.value, str):
                    doc.update(range(cur.lineno, cur.end_lineno + 1))
    lines: set[int] = set()
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENDMARKER, tokenize.ENCODING}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in skip:
            continue
        for ln in range(tok.start[0], tok.end[0] + 1):
            if ln not in doc:
                lines.add(ln)
    return lines


def _attrs(cls: ast.ClassDef) -> set[str]:
    names: set[str] = set()
    for st in cls.body:
        if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
            names.add(st.target.id)
        elif isinstance(st, ast.Assign):
            for t in st.targets:
                if isinstance(t, ast.Name) and t.id == "__slots__" and isinstance(st.value, (ast.Tuple, ast.List)):
                    names.update(e.value for e in st.value.elts if isinstance(e, ast.Constant))
    for fn in cls.body:
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            flat = []
            for t in targets:
                flat.extend(t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])
            for t in flat:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    names.add(t.attr)
    return names


def measure() -> dict:
    """``{"classes": {name: {...}}, "files": {file: code_lines}, "session_as_one": {...}}``."""
    classes: dict[str, dict] = {}
    files: dict[str, int] = {}
    for path in sorted(PKG.glob("*.py")):
        src = path.read_text()
        lines = code_lines(src)
        files[path.name] = len(lines)
        for node in ast.parse(src).body:
            if not isinstance(node, ast.ClassDef):
                continue
            span = set(range(node.lineno, node.end_lineno + 1))
            methods = [f.name for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
            classes[node.name] = {
                "module": path.name,
                "bases": [b.id for b in node.bases if isinstance(b, ast.Name)],
                "code_lines": len(lines & span),
                "methods": len(methods),
                "attributes": sorted(_attrs(node)),
            }
    # Session as one object: itself and every package class among its bases (transitively)
    seen, todo = [], ["Session"]
    while todo:
        name = todo.pop()
        if name in classes and name not in seen:
            seen.append(name)
            todo.extend(classes[name]["bases"])
    attrs = set().union(*(set(classes[c]["attributes"]) for c in seen))
    one = {"classes": seen, "code_lines": sum(classes[c]["code_lines"] for c in seen),
           "methods": sum(classes[c]["methods"] for c in seen), "attributes": len(attrs)}
    return {"classes": classes, "files": files, "session_as_one": one}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print JSON")
    args = ap.parse_args(argv)
    m = measure()
    if args.json:
        print(json.dumps(m, indent=2))
        return 0
    print(f"{'class':<24} {'module':<18} {'code':>5} {'meth':>5} {'attr':>5}")
    for name, c in sorted(m["classes"].items(), key=lambda kv: (kv[1]["module"], kv[0])):
        print(f"{name:<24} {c['module']:<18} {c['code_lines']:>5} {c['methods']:>5} {len(c['attributes']):>5}")
    one = m["session_as_one"]
    print(f"\nSession as one object ({' + '.join(one['classes'])}): {one['code_lines']} code lines, "
          f"{one['methods']} methods, {one['attributes']} attributes")
    print("files (code lines): " + ", ".join(f"{k} {v}" for k, v in m["files"].items()))
    print(f"package total: {sum(m['files'].values())} code lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
