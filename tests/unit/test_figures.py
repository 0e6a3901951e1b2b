"""The docs' pictures are current (scripts/make_figures.py).

Every generated SVG carries the SHA-256 of what it was drawn from; the screenshot of the browser page
carries the SHA-256 of ``server/static/``. These tests recompute them from today's sources (no
Graphviz or matplotlib needed), show that a change of a source is caught, check that the diagrams say
what their sources say, that the plotted numbers are the ones in the dated results files they cite,
and, where Graphviz and matplotlib are installed, rebuild every SVG in a temporary folder.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("make_figures", ROOT / "scripts" / "make_figures.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("make_figures", mod)
    spec.loader.exec_module(mod)
    return mod


mf = _load()


def test_no_picture_is_stale():
    assert mf.stale() == [], "run: python scripts/make_figures.py (--screenshots for the page's PNG)"


def test_check_cli_exits_zero_when_current():
    assert mf.main(["--check"]) == 0


def test_a_changed_transition_makes_the_phase_diagram_stale(monkeypatch):
    from duplexkit.session import machine
    from duplexkit.session.machine import Phase, PhaseEvent

    table = {ph: dict(evs) for ph, evs in machine.TRANSITIONS.items()}
    table[Phase.IDLE][PhaseEvent.TOOL_CALL] = Phase.SPEAKING  # a move the real table does not have
    monkeypatch.setattr(machine, "TRANSITIONS", table)
    assert '"idle" -> "speaking" [label="speak, tool_call"]' in mf.phases_dot()
    assert any("session-phases.svg: stale" in line for line in mf.stale())


def test_a_changed_import_rule_makes_the_architecture_stale(monkeypatch, tmp_path):
    doc = mf.ARCH_DOC.read_text()
    changed = doc.replace("| `protocol` | — |", "| `protocol` | `audio` |", 1)
    assert changed != doc
    (tmp_path / "architecture.md").write_text(changed)
    monkeypatch.setattr(mf, "ARCH_DOC", tmp_path / "architecture.md")
    assert '"protocol" -> "audio";' in mf.architecture_dot()
    assert [line for line in mf.stale() if "docs/figures/" in line] == ["docs/figures/architecture.svg: stale (its sources changed)"]


def test_a_changed_result_makes_its_plot_stale(monkeypatch, tmp_path):
    for p in mf.RESULTS.glob("*.json"):
        shutil.copy(p, tmp_path / p.name)
    data = json.loads((tmp_path / "rtf-vs-streams.json").read_text())
    data["series"][0]["rtf"][0] = 0.5
    (tmp_path / "rtf-vs-streams.json").write_text(json.dumps(data))
    monkeypatch.setattr(mf, "RESULTS", tmp_path)
    assert [line for line in mf.stale() if "docs/figures/" in line] == ["docs/figures/rtf-vs-streams.svg: stale (its sources changed)"]


def test_a_changed_page_makes_the_screenshot_stale(monkeypatch, tmp_path):
    static = tmp_path / "static"
    shutil.copytree(mf.STATIC, static)
    monkeypatch.setattr(mf, "STATIC", static)
    shot = tmp_path / "page.png"
    mf.write_screenshot(mf.SCREENSHOT, shot)  # stamped with the copy's digest
    assert not mf.screenshot_is_stale(shot)
    (static / "app.js").write_text((static / "app.js").read_text() + "\n// changed\n")
    assert mf.screenshot_is_stale(shot)
    mf.write_screenshot(mf.SCREENSHOT, shot)  # what the browser test does then
    assert not mf.screenshot_is_stale(shot)


def test_screenshot_stamp_keeps_the_pixels(tmp_path):
    from PIL import Image

    out = tmp_path / "page.png"
    mf.write_screenshot(mf.SCREENSHOT, out)
    assert mf.png_digest(out) == mf.page_digest()
    with Image.open(mf.SCREENSHOT) as a, Image.open(out) as b:
        assert a.size == b.size and a.convert("RGBA").tobytes() == b.convert("RGBA").tobytes()


def test_phase_diagram_draws_every_move_of_the_mermaid_block():
    from duplexkit.session.machine import mermaid_diagram

    dot = mf.phases_dot()
    moves = re.findall(r"^\s+(\w+) --> (\w+): (.+)$", mermaid_diagram(), re.M)
    notes = re.findall(r"^\s+note right of (\w+): (.+)$", mermaid_diagram(), re.M)
    assert len(moves) >= 8 and notes
    for src, dst, evs in moves:
        assert f'"{src}" -> "{dst}" [label="{evs}"' in dot, (src, dst, evs)
    for _phase, text in notes:
        assert f'label="{text}"' in dot, text
    edges = re.findall(r'^\s+("[^"]+"|\w+) -> ("[^"]+"|\w+)', dot, re.M)
    assert len(edges) == len(moves) + len(notes) + 2  # + the start and end markers


def test_architecture_draws_every_import_rule():
    rules = mf.import_rules()
    assert {"session", "engine", "server", "cli", "protocol"} <= set(rules)
    assert "models" in rules["engine"] and "session" not in rules["engine"]
    dot = mf.architecture_dot()
    edges = re.findall(r'^\s+"([\w.]+)" -> "([\w.]+)";$', dot, re.M)
    assert sorted(edges) == sorted((r, t) for r, ts in rules.items() for t in ts)
    svg = (mf.FIGURES / "architecture.svg").read_text()
    for room in rules:
        assert f">{room}</text>" in svg, room


def _numbers(series: dict) -> list:
    out = []
    for key, value in series.items():
        if isinstance(value, list) and key != "x" and all(isinstance(v, (int, float)) for v in value):
            out += value
    return out


def _fmt(v) -> str:
    return str(v)


def test_plotted_numbers_are_in_the_results_they_cite():
    checked = 0
    for path in sorted(mf.RESULTS.glob("*.json")):
        data = json.loads(path.read_text())
        entries = list(data["series"]) + ([data["floor"]] if "floor" in data else [])
        for s in entries:
            src = ROOT / s["source"]
            assert src.is_file(), (path.name, s["source"])
            assert s["entry"], path.name
            text = src.read_text()
            for v in _numbers(s):
                pattern = r"(?<![\d.])" + re.escape(_fmt(v)) + r"(?![\d])"
                assert re.search(pattern, text), f"{path.name}: {s['label']}: {v} not in {s['source']}"
                checked += 1
    assert checked >= 60


def test_docs_embed_every_figure():
    arch = (ROOT / "docs" / "architecture.md").read_text()
    assert "](figures/architecture.svg)" in arch and "](figures/session-phases.svg)" in arch
    bench = (ROOT / "docs" / "benchmarks.md").read_text()
    readme = (ROOT / "benchmarks" / "README.md").read_text()
    for name in mf.PLOTS:
        assert f"](figures/{name}.svg)" in bench, name
        assert f"](../docs/figures/{name}.svg)" in readme, name


def test_every_svg_is_xml_with_its_stamp():
    for path, digest in mf.expected_digests().items():
        text = path.read_text()
        ET.fromstring(text.split("\n", 1)[1] if text.startswith("<?xml") else text)
        assert mf.svg_digest(path) == digest


def test_rebuild_in_a_temporary_folder(tmp_path):
    pytest.importorskip("graphviz")
    pytest.importorskip("matplotlib")
    if shutil.which("dot") is None:
        pytest.skip("Graphviz's dot is not installed (Debian graphviz)")
    written = mf.build(tmp_path)
    assert sorted(p.name for p in written) == sorted(p.name for p in mf.expected_digests())
    for p in written:
        committed = mf.FIGURES / p.name
        assert mf.svg_digest(p) == mf.svg_digest(committed), p.name
        new_text = p.read_text()
        ET.fromstring(new_text.split("\n", 1)[1])
        if p.name in ("architecture.svg", "session-phases.svg"):  # the same nodes and edges, whatever dot's version
            titles = lambda t: sorted(re.findall(r"<title>(.*?)</title>", t))
            assert titles(new_text) == titles(committed.read_text()), p.name
