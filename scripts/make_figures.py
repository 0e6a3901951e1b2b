"""Build every picture in the docs from its source, or check that none is stale.

Usage::

    python scripts/make_figures.py                 # diagrams + benchmark plots (+ the Mermaid block)
    python scripts/make_figures.py --screenshots   # the same, then the browser page's screenshot
    python scripts/make_figures.py --check         # exit 1 naming every stale picture; builds nothing

What each picture is made from:

* ``docs/figures/architecture.svg``: the rooms and what each may import, from the import-rules
  table of ``docs/architecture.md`` (the table ``tests/unit/test_import_rules.py`` enforces),
  laid out by Graphviz ``dot``;
* ``docs/figures/session-phases.svg``: the Session's phase machine, from
  ``duplexkit.session.machine.TRANSITIONS`` (the same rules as the Mermaid block that
  ``scripts/gen_state_diagram.py`` writes: self-loops and ignored events left out, error answers
  as notes), laid out by ``dot``;
* ``docs/figures/latency-vs-sessions.svg``, ``rtf-vs-streams.svg``, ``stage-vs-floor.svg``:
  matplotlib plots of ``benchmarks/results/<same name>.json`` (numbers taken from the dated results
  files each series names);
* ``docs/img/browser-page.png``: written by the browser test
  ``tests/browser/test_browser_page.py::test_conversation_barge_in_and_playback_truth`` from the
  page in ``server/static/`` (``--screenshots`` runs that test with
  ``DUPLEXKIT_UPDATE_SCREENSHOT=1``).

Staleness: each SVG carries, in an XML comment on its second line, the SHA-256 of what it was drawn
from (the DOT text of a diagram; the JSON data plus the plotting function's code of a plot), and
the screenshot carries the SHA-256 of ``server/static/*`` in a PNG text chunk (key
``duplexkit-source-sha256``). ``--check`` recomputes them without Graphviz or matplotlib;
``tests/unit/test_figures.py`` runs the same check. Building needs the ``docs`` extra
(``pip install -e .[docs]``: matplotlib, graphviz) and Graphviz's ``dot`` program (Debian
``graphviz``, installed by ``scripts/setup.sh``).

Exit status: 0 done (or nothing stale); 1 stale pictures (``--check``) or a failed screenshot
run; 2 a missing tool (``dot``, matplotlib, the graphviz package), named on stderr.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "docs" / "figures"
RESULTS = ROOT / "benchmarks" / "results"
ARCH_DOC = ROOT / "docs" / "architecture.md"
STATIC = ROOT / "server" / "static"
SCREENSHOT = ROOT / "docs" / "img" / "browser-page.png"
SCREENSHOT_TEST = "tests/browser/test_browser_page.py::test_conversation_barge_in_and_playback_truth"

#: the comment every generated SVG carries on its second line (the first is the XML declaration).
STAMP = "<!-- duplexkit-figure source-sha256={digest} made by scripts/make_figures.py from {what}; do not edit -->"
STAMP_RE = re.compile(r"<!-- duplexkit-figure source-sha256=([0-9a-f]{64}) ")
#: the PNG text chunk key of the screenshot's stamp.
PNG_KEY = "duplexkit-source-sha256"

if str(ROOT) not in sys.path:  # run as a script from anywhere: import this checkout's duplexkit
    sys.path.insert(0, str(ROOT))


def sha256(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()


def stamp_svg(svg: str, digest: str, what: str) -> str:
    """``svg`` with the stamp comment after its XML declaration (or first, when it has none)."""
    line = STAMP.format(digest=digest, what=what)
    if svg.startswith("<?xml"):
        decl, _, rest = svg.partition("\n")
        return f"{decl}\n{line}\n{rest}"
    return f"{line}\n{svg}"


def svg_digest(path: Path) -> Optional[str]:
    """The source digest stamped into ``path``, None when the file or its stamp is missing."""
    if not path.is_file():
        return None
    m = STAMP_RE.search(path.read_text(errors="replace")[:2000])
    return m.group(1) if m else None


# ---------------------------------------------------------------- diagrams (Graphviz DOT text)

def import_rules(doc: Optional[str] = None) -> dict[str, list[str]]:
    """room -> the rooms it may import, read from the import-rules table of docs/architecture.md
    (in the table's order; names that are not rooms of the table, e.g. ``duplexkit`` or the standard
    library's, are left out)."""
    doc = ARCH_DOC.read_text() if doc is None else doc
    table = doc.split("<!-- import-rules:begin -->", 1)[1].split("<!-- import-rules:end -->", 1)[0]
    rows = [ln for ln in table.strip().splitlines()[2:] if ln.strip().startswith("|")]
    rules: dict[str, list[str]] = {}
    for line in rows:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rules[cells[0].strip("`")] = re.findall(r"`([^`]+)`", cells[1])
    return {room: [t for t in targets if t in rules and t != room] for room, targets in rules.items()}


def _q(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def architecture_dot(doc: Optional[str] = None) -> str:
    """The import rules as a DOT digraph: an arrow A -> B means room A may import room B."""
    rules = import_rules(doc)
    lines = [
        "digraph rooms {",
        '  graph [rankdir=TB, nodesep=0.2, ranksep=0.5, size="9,6", concentrate=true, fontname="Helvetica", fontsize=11,',
        '         label="An arrow A -> B: room A may import room B (docs/architecture.md, Import rules).\\n'
        'errors and _lazy are open to every room.", labelloc=b];',
        '  node [shape=box, style="rounded,filled", fillcolor="#eef3fb", color="#4a6fa5", fontname="Helvetica", fontsize=12];',
        '  edge [color="#7d8ca3", arrowsize=0.6];',
    ]
    for room in rules:
        lines.append(f"  {_q(room)};")
    for room, targets in rules.items():
        for t in targets:
            lines.append(f"  {_q(room)} -> {_q(t)};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def phases_dot() -> str:
    """``TRANSITIONS`` as a DOT digraph, by the rules of ``machine.mermaid_diagram``: one arrow per
    (phase, next phase) labelled with its events, self-loops and ignored events left out, each error
    answer a note beside its phase."""
    from duplexkit.session.machine import Phase, diagram_moves

    lines = [
        "digraph phases {",
        '  graph [rankdir=TB, nodesep=0.4, ranksep=0.6, fontname="Helvetica", fontsize=11,',
        '         label="The Session\'s phases (duplexkit.session.machine.TRANSITIONS); self-loops and ignored events left out.", labelloc=b];',
        '  node [shape=box, style="rounded,filled", fillcolor="#eef3fb", color="#4a6fa5", fontname="Helvetica", fontsize=13];',
        '  edge [fontname="Helvetica", fontsize=10, color="#4a6fa5", fontcolor="#1f2d3d"];',
        '  "[start]" [shape=circle, label="", width=0.18, style=filled, fillcolor=black, color=black];',
        '  "[end]" [shape=doublecircle, label="", width=0.14, style=filled, fillcolor=black, color=black];',
    ]
    for ph in Phase:
        lines.append(f"  {_q(ph.value)};")
    lines.append(f'  "[start]" -> {_q(Phase.NEW.value)};')
    notes = 0
    for ph in Phase:
        moves, errors = diagram_moves(ph)
        for nxt, evs in moves.items():
            style = ', style=dashed, color="#9aa7b8"' if nxt is Phase.CLOSED else ""
            lines.append(f"  {_q(ph.value)} -> {_q(nxt.value)} [label={_q(', '.join(evs))}{style}];")
        for code, evs in errors.items():
            notes += 1
            note = f"note{notes}"
            lines.append(f'  {note} [shape=note, style=filled, fillcolor="#fff6dd", color="#c9a227", fontsize=10, '
                         f"label={_q(', '.join(evs) + ' -> error ' + code)}];")
            lines.append(f'  {_q(ph.value)} -> {note} [style=dotted, arrowhead=none, color="#c9a227"];')
    lines.append(f'  {_q(Phase.CLOSED.value)} -> "[end]";')
    lines.append("}")
    return "\n".join(lines) + "\n"


def render_dot(dot_text: str) -> str:
    """SVG text of ``dot_text`` laid out by Graphviz ``dot`` (through the graphviz package)."""
    import graphviz  # the docs extra

    return graphviz.Source(dot_text).pipe(format="svg", encoding="utf-8")


# ---------------------------------------------------------------- plots (matplotlib)

def _style(plt) -> None:
    plt.rcParams.update({
        "svg.hashsalt": "duplexkit",  # stable element ids: the same data gives the same file
        "svg.fonttype": "none",  # text stays text
        "font.family": "DejaVu Sans",
        "font.size": 10,
        "axes.spines.top": False,
        "axes.spines.right": False,
        "axes.grid": True,
        "grid.alpha": 0.3,
    })


def plot_latency_vs_sessions(data: dict, plt):
    """create -> first audio p50 (line) and p90 (bar above it) per dated run, against the targets."""
    fig, ax = plt.subplots(figsize=(7.2, 4.2))
    for i, s in enumerate(data["series"]):
        x = [v * (1 + 0.04 * (i - 1.5)) for v in s["x"]]  # side by side on the log axis
        lo = [0] * len(x)
        hi = [p90 - p50 for p50, p90 in zip(s["p50"], s["p90"])]
        ax.errorbar(x, s["p50"], yerr=[lo, hi], marker="o", capsize=3, label=s["label"],
                    linestyle="-" if len(x) > 2 else "none")
    t = data["targets"]
    ax.scatter(t["x"], t["y"], marker="_", s=400, color="black", zorder=5, label="target (p50)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks([1, 8, 16, 32], labels=["1", "8", "16", "32"])
    ticks = [100, 200, 300, 500, 1000, 2000, 5000, 10000]
    ax.set_yticks(ticks, labels=[str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_ylim(120, 30000)
    ax.set_xlabel("concurrent sessions")
    ax.set_ylabel("ms (p50, bar to p90)")
    ax.set_title(data["title"], fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig


def plot_rtf_vs_streams(data: dict, plt):
    """RTF (left) and per-unit latency p50/p90 (right) against concurrent streams."""
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9.0, 3.8))
    for s in data["series"]:
        a1.plot(s["x"], s["rtf"], marker="o", label=s["label"])
        line, = a2.plot(s["x"], s["unit_p90"], marker="o", label=s["label"] + ", p90")
        a2.plot(s["x"], s["unit_p50"], marker=".", linestyle=":", color=line.get_color())
    a1.axhline(1.0, color="black", linewidth=0.8)
    a1.text(1, 1.005, "real time", fontsize=8, va="bottom")
    a2.axhline(1000, color="black", linewidth=0.8)
    a2.text(1, 1020, "1-s unit", fontsize=8, va="bottom")
    for ax in (a1, a2):
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 4, 8, 16, 32, 48, 64], labels=["1", "4", "8", "16", "32", "48", "64"])
        ax.set_xlabel("concurrent streams")
    a1.set_ylabel("RTF (wall / audio; < 1 keeps up)")
    a2.set_ylabel("unit latency, ms (p90 solid, p50 dotted)")
    a2.set_yscale("log")
    ticks = [100, 200, 500, 1000, 2000]
    a2.set_yticks(ticks, labels=[str(t) for t in ticks])
    a2.minorticks_off()
    a1.legend(fontsize=7, loc="upper left")
    fig.suptitle(data["title"], fontsize=9)
    fig.tight_layout()
    return fig


def plot_stage_vs_floor(data: dict, plt):
    """Measured ms per stage for each dated run (bars) against the stage's bandwidth floor (line)."""
    import numpy as np

    stages = data["stages"]
    series = data["series"]
    fig, ax = plt.subplots(figsize=(8.0, 4.2))
    x = np.arange(len(stages))
    w = 0.8 / len(series)
    for i, s in enumerate(series):
        bars = ax.bar(x + (i - (len(series) - 1) / 2) * w, s["ms"], w, label=s["label"])
        for b, v, f in zip(bars, s["ms"], data["floor"]["ms"]):
            ax.text(b.get_x() + b.get_width() / 2, v * 1.08, f"{v / f:.1f}x", ha="center", fontsize=7)
    for xi, f in zip(x, data["floor"]["ms"]):
        ax.hlines(f, xi - 0.45, xi + 0.45, color="black", linewidth=1.5)
    ax.plot([], [], color="black", linewidth=1.5, label=data["floor"]["label"])
    ax.set_yscale("log")
    ax.set_xticks(x, labels=[st.replace(" (", "\n(") for st in stages])
    ax.set_ylabel("ms at 1 stream (log; label: x the floor)")
    ax.set_title(data["title"], fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(axis="x", visible=False)
    fig.tight_layout()
    return fig


PLOTS: dict[str, Callable] = {
    "latency-vs-sessions": plot_latency_vs_sessions,
    "rtf-vs-streams": plot_rtf_vs_streams,
    "stage-vs-floor": plot_stage_vs_floor,
}


def plot_digest(name: str) -> str:
    """What a plot is drawn from: its JSON data and the code of its plotting function and style."""
    return sha256((RESULTS / f"{name}.json").read_text(), inspect.getsource(PLOTS[name]), inspect.getsource(_style))


def render_plot(name: str) -> str:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _style(plt)
    data = json.loads((RESULTS / f"{name}.json").read_text())
    fig = PLOTS[name](data, plt)
    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata={"Date": None})
    plt.close(fig)
    return buf.getvalue()


# ---------------------------------------------------------------- the browser page's screenshot

def page_digest() -> str:
    """SHA-256 over the files of ``server/static/`` (names and contents): what the screenshot shows."""
    parts = []
    for p in sorted(STATIC.rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts:
            parts += [p.relative_to(STATIC).as_posix(), p.read_text(errors="replace")]
    return sha256(*parts)


def png_digest(path: Path) -> Optional[str]:
    """The source digest in the PNG text chunk of ``path``, None when missing."""
    if not path.is_file():
        return None
    from PIL import Image

    with Image.open(path) as im:
        return getattr(im, "text", {}).get(PNG_KEY)


def write_screenshot(shot: Path, dest: Path = SCREENSHOT) -> None:
    """Copy the PNG ``shot`` to ``dest`` with the page's digest in a text chunk (pixels unchanged)."""
    from PIL import Image, PngImagePlugin

    info = PngImagePlugin.PngInfo()
    info.add_text(PNG_KEY, page_digest())
    dest.parent.mkdir(parents=True, exist_ok=True)
    with Image.open(shot) as im:
        im.save(dest, format="PNG", pnginfo=info, optimize=True)


def screenshot_is_stale(path: Path = SCREENSHOT) -> bool:
    return png_digest(path) != page_digest()


# ---------------------------------------------------------------- the set of pictures

def diagrams() -> dict[str, tuple[str, str]]:
    """file name -> (DOT text, what it is made from)."""
    return {
        "architecture.svg": (architecture_dot(), "the import-rules table of docs/architecture.md"),
        "session-phases.svg": (phases_dot(), "duplexkit/session/machine.py TRANSITIONS"),
    }


def expected_digests() -> dict[Path, str]:
    """Every generated SVG -> the digest its sources give now."""
    out = {FIGURES / name: sha256(dot_text) for name, (dot_text, _) in diagrams().items()}
    out.update({FIGURES / f"{name}.svg": plot_digest(name) for name in PLOTS})
    return out


def stale() -> list[str]:
    """Human-readable lines, one per stale or missing picture (empty: everything is current)."""
    bad = []
    for path, digest in expected_digests().items():
        have = svg_digest(path)
        rel = path.relative_to(ROOT)
        if have is None:
            bad.append(f"{rel}: missing or not stamped")
        elif have != digest:
            bad.append(f"{rel}: stale (its sources changed)")
    if screenshot_is_stale():
        bad.append(f"{SCREENSHOT.relative_to(ROOT)}: stale (server/static/ changed): "
                   f"python scripts/make_figures.py --screenshots")
    return bad


def build(out: Path = FIGURES) -> list[Path]:
    """Write every SVG into ``out``; return the paths written.

    Raises:
        FileNotFoundError: Graphviz's ``dot`` is not on PATH.
        ImportError: matplotlib or the graphviz package is missing (the ``docs`` extra).
    """
    if shutil.which("dot") is None:
        raise FileNotFoundError("Graphviz's `dot` is not on PATH (Debian: apt-get install graphviz)")
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (dot_text, what) in diagrams().items():
        svg = stamp_svg(render_dot(dot_text), sha256(dot_text), what)
        (out / name).write_text(svg)
        written.append(out / name)
    for name in PLOTS:
        svg = stamp_svg(render_plot(name), plot_digest(name), f"benchmarks/results/{name}.json")
        (out / f"{name}.svg").write_text(svg)
        written.append(out / f"{name}.svg")
    return written


def _gen_state_diagram():
    spec = importlib.util.spec_from_file_location("gen_state_diagram", ROOT / "scripts" / "gen_state_diagram.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 naming every stale picture; build nothing")
    ap.add_argument("--screenshots", action="store_true",
                    help="also run the browser test that writes docs/img/browser-page.png (headless Chromium)")
    args = ap.parse_args(argv)
    if args.check:
        bad = stale()
        for line in bad:
            print(line, file=sys.stderr)
        if bad:
            print("run: python scripts/make_figures.py", file=sys.stderr)
        return 1 if bad else 0
    try:
        for path in build():
            print(f"wrote {path.relative_to(ROOT)}")
    except ImportError as exc:
        print(f"make_figures: {exc} (pip install -e '.[docs]')", file=sys.stderr)
        return 2
    except FileNotFoundError as exc:
        print(f"make_figures: {exc}", file=sys.stderr)
        return 2
    _gen_state_diagram().main([])  # the Mermaid block of docs/architecture.md, from the same table
    print("wrote docs/architecture.md (state-diagram block)")
    if args.screenshots:
        env = dict(os.environ, DUPLEXKIT_UPDATE_SCREENSHOT="1")
        rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", SCREENSHOT_TEST],
                             cwd=ROOT, env=env)
        if rc != 0:
            print("make_figures: the screenshot test failed", file=sys.stderr)
            return 1
        print(f"wrote {SCREENSHOT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
