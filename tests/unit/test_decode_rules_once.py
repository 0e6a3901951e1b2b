"""One sampler and one duplex decision rule: checked on the source with ast.

* Sampling operations (top-k, cumulative-mass top-p, Exp noise / Gumbel draws, multinomial draws,
  ``penalty ** count``) are written only in ``duplexkit/models/minicpmo45/sampling.py``; no other
  module of duplexkit/ or server/ applies ``*``, ``/`` or ``**`` to a name that says ``penalty``.
* The duplex decision rule's functions are defined once (``duplex.py``), and the stream's turn
  state (``turn_ended``, ``force_speak_pending``) is assigned only there and by ``Thinker.end_turn``.

Docstrings and comments do not count (the check walks the syntax tree).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SAMPLER = ROOT / "duplexkit" / "models" / "minicpmo45" / "sampling.py"
RULE = ROOT / "duplexkit" / "models" / "minicpmo45" / "duplex.py"
AGENT = ROOT / "duplexkit" / "agent"
SAMPLING_CALLS = {"topk", "exponential_", "multinomial", "gumbel_softmax"}
"""Always sampling; ``cumsum`` counts on probabilities (``prob``/``softmax``/``pr``), ``pow`` with a penalty."""
RULE_FUNCTIONS = {"start_unit", "plan_step", "decide", "choose_tokens", "choose_tokens_device", "main_pass_logits",
                  "decode_rows"}


def _sources(root: Path = ROOT):
    for base in ("duplexkit", "server"):
        for path in sorted((root / base).rglob("*.py")):
            yield path, ast.parse(path.read_text(), filename=str(path))


def _names(node: ast.AST) -> str:
    return " ".join(n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node)
                    if isinstance(n, (ast.Name, ast.Attribute))).lower()


def sampling_ops_outside_sampler(root: Path = ROOT, sampler: Path = SAMPLER) -> list:
    """``path:line what`` for every sampling operation outside ``sampler``."""
    found = []
    for path, tree in _sources(root):
        if path.resolve() == sampler.resolve():
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                fn = node.func
                name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
                inner = _names(node)
                if name in SAMPLING_CALLS or (name == "cumsum" and any(w in inner.split() or w in inner
                                                                        for w in ("prob", "softmax", "pr"))) \
                        or (name == "pow" and "penalty" in inner):
                    found.append(f"{path.relative_to(root)}:{node.lineno} {name}()")
            elif isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Div, ast.Pow)):
                if "penalty" in _names(node.left) or "penalty" in _names(node.right):
                    found.append(f"{path.relative_to(root)}:{node.lineno} penalty arithmetic")
    return found


def test_sampling_operations_exist_only_in_the_sampler():
    assert sampling_ops_outside_sampler() == []


def test_the_sampling_check_catches_a_copy(tmp_path):
    pkg = tmp_path / "duplexkit"
    pkg.mkdir()
    (tmp_path / "server").mkdir()
    (pkg / "a.py").write_text("import torch\n\ndef f(x, k, rp):\n    v = torch.topk(x, k)\n    return x / rp.penalty\n")
    (pkg / "b.py").write_text("import torch\n\ndef g(x, pos, p):\n    pr = torch.softmax(x, -1)\n"
                              "    c = pr.cumsum(-1)\n    return pos.cumsum(0), torch.pow(p.repetition_penalty, c), x.pow(2)\n")
    got = sampling_ops_outside_sampler(tmp_path, tmp_path / "none.py")
    assert got == ["duplexkit/a.py:4 topk()", "duplexkit/a.py:5 penalty arithmetic",
                   "duplexkit/b.py:5 cumsum()", "duplexkit/b.py:6 pow()"]


def test_the_decision_rule_is_defined_once_and_owns_the_turn_state():
    defs, assigns = {}, []
    for path, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in RULE_FUNCTIONS:
                if node.name == "decide" and AGENT in path.parents:
                    continue  # ToolDecider.decide (docs/tools.md): a tool decision, not the duplex rule
                defs.setdefault(node.name, []).append(path)
            if isinstance(node, (ast.Assign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if isinstance(t, ast.Attribute) and t.attr in ("turn_ended", "force_speak_pending"):
                        assigns.append((path.name, t.attr))
    assert defs == {name: [RULE] for name in RULE_FUNCTIONS}
    assert {p for p, _ in assigns} == {"duplex.py", "thinker.py"}  # thinker.py: Thinker.end_turn only
    assert sum(1 for p, _ in assigns if p == "thinker.py") == 2
