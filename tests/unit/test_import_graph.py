"""The module import graph of duplexkit/ and server/, read with ``ast``: no circles, no upward arrows.

Every ``import`` / ``from ... import`` counts: at module level, inside functions (deferred imports
are still dependencies) and under ``if TYPE_CHECKING:`` (a type-only import is still an arrow a
reader has to follow). An arrow goes from a module to the module it names: ``from a.b import c``
points at ``a.b.c`` when that is a module, else at ``a.b``; a package's ``__init__`` is the module
``a.b``; ``duplexkit_server`` is ``server``. Importing a submodule is not counted as importing its
parent packages (Python runs them, but they are not what the code depends on).

The checks:

* no circle between modules (strongly connected components of more than one module);
* no upward arrow: every arrow between two rooms points to a lower layer of the table under
  "Layers" in docs/architecture.md;
* the figures in docs/architecture.md ("Import graph") are the graph's.

``python tests/unit/test_import_graph.py`` prints the figures block for the docs.
"""

from __future__ import annotations

import ast
import functools
import re
import sys
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

ROOT = Path(__file__).resolve().parents[2]

#: circles left to the clients' restructuring (the clients helper owns duplexkit/clients/): each a
#: frozenset of the modules of one circle. The lead empties this after merging that work; an entry
#: that no longer matches a circle fails the test, so the list can only shrink.
KNOWN_CIRCLES: Set[frozenset] = set()  # none today: add one only with the reason beside it


class Graph:
    """The import graph of the tree under ``root``.

    Attributes:
        modules: dotted module name -> file.
        edges: module -> the modules it imports (within the tree).
        function_level: import statements inside a function or method.
        type_only: import statements under ``if TYPE_CHECKING:``.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        files = sorted((root / "duplexkit").rglob("*.py")) + sorted((root / "server").rglob("*.py"))
        self.modules: Dict[str, Path] = {self._name(p): p for p in files}
        self.edges: Dict[str, Set[str]] = {m: set() for m in self.modules}
        self.function_level = 0
        self.type_only = 0
        for mod, path in self.modules.items():
            self._read(mod, path)

    def _name(self, path: Path) -> str:
        parts = list(path.relative_to(self.root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        return ".".join(parts)

    def resolve(self, dotted: str) -> Optional[str]:
        """The tree's module a dotted name points at (the longest module prefix), or None."""
        parts = dotted.split(".")
        if parts[0] == "duplexkit_server":
            parts[0] = "server"
        while parts:
            name = ".".join(parts)
            if name in self.modules:
                return name
            parts.pop()
        return None

    def _read(self, mod: str, path: Path) -> None:
        tree = ast.parse(path.read_text())
        package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]

        def visit(node: ast.AST, in_function: bool, type_only: bool) -> None:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                self.function_level += int(in_function)
                self.type_only += int(type_only)
                for target in _targets(node, package):
                    found = self.resolve(target)
                    if found is not None and found != mod:
                        self.edges[mod].add(found)
                return
            if isinstance(node, ast.If) and _is_type_checking(node.test):
                for sub in node.body:
                    visit(sub, in_function, True)
                for sub in node.orelse:
                    visit(sub, in_function, type_only)
                return
            inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            for child in ast.iter_child_nodes(node):
                visit(child, inner, type_only)

        visit(tree, False, False)

    @property
    def arrows(self) -> int:
        return sum(len(v) for v in self.edges.values())

    def circles(self) -> List[frozenset]:
        """Strongly connected components of more than one module (Tarjan, iterative)."""
        index: Dict[str, int] = {}
        low: Dict[str, int] = {}
        on_stack: Set[str] = set()
        stack: List[str] = []
        out: List[frozenset] = []
        counter = 0
        for start in sorted(self.modules):
            if start in index:
                continue
            work: List[Tuple[str, List[str]]] = [(start, sorted(self.edges[start]))]
            index[start] = low[start] = counter
            counter += 1
            stack.append(start)
            on_stack.add(start)
            while work:
                v, todo = work[-1]
                if todo:
                    w = todo.pop()
                    if w not in index:
                        index[w] = low[w] = counter
                        counter += 1
                        stack.append(w)
                        on_stack.add(w)
                        work.append((w, sorted(self.edges[w])))
                    elif w in on_stack:
                        low[v] = min(low[v], index[w])
                    continue
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = set()
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.add(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(frozenset(comp))
        return out


def _is_type_checking(test: ast.AST) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _targets(node: ast.AST, package: List[str]) -> List[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        base = package[: len(package) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    return [f"{target}.{a.name}" for a in node.names]


def room(module: str) -> str:
    """The room of a module (docs/architecture.md): ``server``, ``engine.api``, the package's first
    level (``session``, ``engine``, ``preflight``, ...) or ``duplexkit`` for the top package."""
    parts = module.split(".")
    if parts[0] == "server":
        return "server"
    if len(parts) == 1:
        return "duplexkit"
    if parts[1] == "engine" and len(parts) > 2 and parts[2] == "api":
        return "engine.api"
    return parts[1]


def layers(root: Path = ROOT) -> Dict[str, int]:
    """room -> layer number from docs/architecture.md's layer table (the top row is the highest)."""
    doc = (root / "docs" / "architecture.md").read_text()
    table = doc.split("<!-- layers:begin -->", 1)[1].split("<!-- layers:end -->", 1)[0]
    rows = [line for line in table.strip().splitlines()[2:] if line.strip().startswith("|")]
    out: Dict[str, int] = {}
    for n, line in enumerate(rows):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        for name in re.findall(r"`([^`]+)`", cells[1]):
            out[name] = len(rows) - n
    return out


def upward_arrows(graph: Graph, layer: Dict[str, int]) -> List[str]:
    """Arrows between two rooms that do not point to a lower layer (``a -> b (room a Ln -> room b Lm)``)."""
    bad = []
    for src in sorted(graph.edges):
        for dst in sorted(graph.edges[src]):
            a, b = room(src), room(dst)
            if a == b:
                continue
            la, lb = layer.get(a), layer.get(b)
            if la is None or lb is None or lb >= la:
                bad.append(f"{src} -> {dst} ({a} L{la} -> {b} L{lb})")
    return bad


def figures(graph: Graph, layer: Dict[str, int]) -> str:
    """The figures block of docs/architecture.md, "Import graph"."""
    circles = graph.circles()
    return "\n".join([
        "| Figure | Value |",
        "|---|---|",
        f"| modules (duplexkit/ and server/) | {len(graph.modules)} |",
        f"| import arrows between modules | {graph.arrows} |",
        f"| circles | {len(circles)} ({len([c for c in circles if c in KNOWN_CIRCLES])} known) |",
        f"| upward arrows | {len(upward_arrows(graph, layer))} |",
        f"| function-level (deferred) import statements | {graph.function_level} |",
        f"| type-only (`TYPE_CHECKING`) import statements | {graph.type_only} |",
    ])


# ------------------------------------------------------------------------------------------ tests


@functools.lru_cache(maxsize=1)
def _graph() -> Graph:
    return Graph(ROOT)


def test_every_room_has_a_layer():
    graph, layer = _graph(), layers()
    missing = sorted({room(m) for m in graph.modules} - set(layer))
    assert missing == [], f"rooms without a layer in docs/architecture.md: {missing}"


def test_no_import_circles():
    circles = _graph().circles()
    new = sorted(sorted(c) for c in circles if c not in KNOWN_CIRCLES)
    assert new == [], f"import circles: {new}"
    gone = sorted(sorted(c) for c in KNOWN_CIRCLES if c not in circles)
    assert gone == [], f"known circles that no longer exist (remove them from KNOWN_CIRCLES): {gone}"


def test_no_upward_arrows():
    assert upward_arrows(_graph(), layers()) == []


def test_docs_figures_are_the_graphs():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    block = doc.split("<!-- import-figures:begin -->", 1)[1].split("<!-- import-figures:end -->", 1)[0]
    want = figures(_graph(), layers())
    assert block.strip() == want, f"docs/architecture.md's import figures are stale; they are now:\n{want}"


def _tree(tmp_path: Path, files: Dict[str, str]) -> Path:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    (tmp_path / "server").mkdir(exist_ok=True)
    return tmp_path


def test_the_checker_sees_deferred_and_type_only_circles(tmp_path):
    """A circle made of a function-level import and a TYPE_CHECKING import is found (the check can fail)."""
    root = _tree(tmp_path, {
        "duplexkit/__init__.py": "",
        "duplexkit/engine/__init__.py": "",
        "duplexkit/engine/a.py": "def f():\n    from .b import g\n",
        "duplexkit/engine/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from duplexkit.engine.a import f\n",
        "duplexkit/engine/c.py": "import duplexkit.engine.b\n",
    })
    graph = Graph(root)
    assert graph.circles() == [frozenset({"duplexkit.engine.a", "duplexkit.engine.b"})]
    assert graph.function_level == 1 and graph.type_only == 1 and graph.arrows == 3


def test_the_checker_sees_an_upward_arrow(tmp_path):
    """A model module importing the engine runtime is an upward arrow (the check can fail)."""
    root = _tree(tmp_path, {
        "duplexkit/__init__.py": "",
        "duplexkit/engine/__init__.py": "",
        "duplexkit/engine/runtime.py": "from duplexkit.models import m\n",
        "duplexkit/models/__init__.py": "",
        "duplexkit/models/m.py": "def f():\n    from duplexkit.engine.runtime import X\n",
    })
    bad = upward_arrows(Graph(root), layers())
    assert bad == ["duplexkit.models.m -> duplexkit.engine.runtime (models L3 -> engine L4)"]


if __name__ == "__main__":  # print the figures block for docs/architecture.md
    sys.stdout.write(figures(Graph(ROOT), layers()) + "\n")
