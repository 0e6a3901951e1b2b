"""``duplexkit replay DIR``: a recorded conversation (:mod:`duplexkit.recording`) as one
self-contained HTML page with a timeline picture, and optionally a PNG (docs/debugging.md).

Lanes, on the session clock (ms): user speech (server VAD ``speech_started`` -> ``speech_stopped``),
the model's per-unit decisions (``engine.decision`` placed on its unit's audio span; on the remote
client side ``response.speak`` / ``response.listen`` ticks), assistant audio generated and heard
(per response: first audio delta + ``generated_ms`` / ``heard_ms``), the engine's stage times per
unit (from ``engine.unit_timings``: thinker prefill and decode, talker, Code2Wav, each where it ran
after the unit was submitted; one bar of ``total_ms`` where the engine reports no stages), events (barge-ins, client
cancels, cancelled responses, tool calls, errors) and latency marks (end of user speech or commit ->
the next response's first audio). Both audio tracks (``user.wav``, ``assistant_heard.wav``; also the
generated one) are embedded as base64 WAV and play together under a moving cursor; a click on the
timeline seeks. The page needs no network.
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path
from typing import Optional, Union

from duplexkit.recording import RecordingError

__all__ = ["load_recording", "timeline", "render_html", "render_png", "find_recordings"]

LANES = ("user speech", "model decisions", "engine stages", "assistant generated", "assistant heard", "events",
         "latency")
_STAGE_ROWS = {"thinker.prefill": 0, "thinker.decode": 0, "thinker": 0, "talker": 1, "code2wav": 2, "engine": 0}
"""Row of each stage in the ``engine stages`` lane (thinker on top, then talker, then Code2Wav)."""
_COLORS = {"thinker.prefill": "#1d4ed8", "thinker.decode": "#60a5fa", "thinker": "#3b82f6", "talker": "#d97706",
           "code2wav": "#a855f7", "engine": "#64748b", "user speech": "#3b82f6", "listen": "#cbd5e1", "speak": "#22c55e", "assistant generated": "#f59e0b",
           "assistant heard": "#16a34a", "barge_in": "#dc2626", "cancel": "#b91c1c", "tool": "#7c3aed",
           "error": "#000000", "latency": "#0891b2"}


def find_recordings(path: Union[str, Path]) -> list:
    """Recording folders at ``path``: itself when it holds ``events.jsonl``, else its subfolders
    that do (sorted). Raises :class:`RecordingError` when ``path`` does not exist or there are none."""
    p = Path(path)
    if not p.exists():
        raise RecordingError(f"{p}: not found (pass a recording folder or the serve --record directory)")
    if (p / "events.jsonl").is_file():
        return [p]
    found = sorted(q for q in p.iterdir() if (q / "events.jsonl").is_file()) if p.is_dir() else []
    if not found:
        raise RecordingError(f"{p} is not a recording folder and holds none (no events.jsonl)")
    return found


def load_recording(folder: Union[str, Path]) -> dict:
    """``{"folder", "meta", "events", "bad_lines", "first_bad_line"}`` of one recording (meta ``{}``
    if missing). ``events.jsonl`` lines that are not a JSON object (a corrupt file, a line cut by a
    crash) are skipped: ``bad_lines`` counts them, ``first_bad_line`` is the first one's 1-based line
    number (None when all are good); blank lines are ignored.

    Raises:
        RecordingError: no readable ``events.jsonl``, or not one event could be read from it.
    """
    folder = Path(folder)
    path = folder / "events.jsonl"
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError as exc:
        raise RecordingError(f"{folder} is not a recording: {exc}") from exc
    events = []
    bad, first_bad = 0, None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except ValueError:
            event = None
        if not isinstance(event, dict):
            bad += 1
            first_bad = first_bad or n
            continue
        events.append(event)
    if not events:
        why = f"{bad} line(s) are not JSON events, the first at line {first_bad}" if bad else "it is empty"
        raise RecordingError(f"no event could be read from {path}: {why}")
    try:
        meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        meta = {}
    return {"folder": folder, "meta": meta, "events": events, "bad_lines": bad, "first_bad_line": first_bad}


def timeline(rec: dict) -> dict:
    """The picture's content: ``{"duration_ms", "spans": [{lane, start, end, kind, label}],
    "marks": [{lane, t, kind, label}]}`` (ms on the session clock)."""
    ev = rec["events"]
    meta = rec["meta"]
    spans, marks = [], []
    end = max([e.get("t_ms", 0) for e in ev] + [meta.get("duration_ms") or 0, 1])
    speech_on: Optional[int] = None
    active: set = set()
    units: dict = {}
    first_audio: dict = {}
    created: dict = {}
    user_end: Optional[int] = None
    for e in ev:
        t, typ, x = e.get("t_ms", 0), e.get("type"), e.get("event") or {}
        if typ == "input_audio_buffer.speech_started":
            speech_on = t
            if active:
                marks.append({"lane": "events", "t": t, "kind": "barge_in", "label": "barge-in (speech over answer)"})
        elif typ == "input_audio_buffer.speech_stopped":
            spans.append({"lane": "user speech", "start": speech_on if speech_on is not None else t, "end": t,
                          "kind": "user speech", "label": "user speech"})
            speech_on, user_end = None, t
        elif typ == "input_audio_buffer.committed" and user_end is None:
            user_end = t
        elif typ == "engine.append_unit" and "audio_start_ms" in x:
            units[x.get("unit_index")] = (x["audio_start_ms"], x["audio_start_ms"] + x.get("audio_ms", 1000))
        elif typ == "engine.unit_timings":
            spans += _stage_spans(t, x)
        elif typ == "engine.decision":
            s, f = units.get(x.get("unit_index"), (t - 1000, t))
            spans.append({"lane": "model decisions", "start": s, "end": f, "kind": x.get("decision", "listen"),
                          "label": f"unit {x.get('unit_index')}: {x.get('decision')}"})
        elif typ in ("response.speak", "response.listen") and e.get("dir") == "server" and not units:
            kind = "speak" if typ == "response.speak" else "listen"
            spans.append({"lane": "model decisions", "start": t - 1000, "end": t, "kind": kind, "label": kind})
        elif typ == "response.created":
            rid = (x.get("response") or {}).get("id")
            active.add(rid)
            created[rid] = t
        elif typ in ("response.output_audio.delta", "response.audio.delta"):
            rid = x.get("response_id")
            if rid not in first_audio:
                first_audio[rid] = t
                if user_end is not None:
                    marks.append({"lane": "latency", "t": t, "t0": user_end, "kind": "latency",
                                  "label": f"{t - user_end} ms end of user speech -> first audio"})
                    user_end = None
        elif typ == "response.done":
            r = x.get("response") or {}
            active.discard(r.get("id"))
            if r.get("status") == "cancelled":
                reason = (r.get("status_details") or {}).get("reason")
                marks.append({"lane": "events", "t": t, "kind": "cancel", "label": f"cancelled ({reason})"})
        elif typ in ("response.cancel", "output_audio_buffer.clear") and e.get("dir") == "client":
            marks.append({"lane": "events", "t": t, "kind": "cancel", "label": f"client {typ}"})
        elif typ == "response.function_call_arguments.done":
            marks.append({"lane": "events", "t": t, "kind": "tool", "label": f"tool call {x.get('name')}"})
        elif typ == "error":
            marks.append({"lane": "events", "t": t, "kind": "error",
                          "label": f"error {(x.get('error') or {}).get('code')}"})
    if speech_on is not None:
        spans.append({"lane": "user speech", "start": speech_on, "end": end, "kind": "user speech",
                      "label": "user speech"})
    rows = meta.get("responses") or []
    if not rows:  # an unfinished recording: figures from the deltas
        sent: dict = {}
        for e in ev:
            x = e.get("event") or {}
            if e.get("type") in ("response.output_audio.delta", "response.audio.delta"):
                sent[x.get("response_id")] = (x.get("metadata") or {}).get("audio_duration_ms") or 0
        rows = [{"response_id": r, "first_audio_ms": first_audio.get(r), "generated_ms": ms, "heard_ms": 0}
                for r, ms in sent.items()]
    for r in rows:
        s = r.get("first_audio_ms")
        if s is None:
            continue
        spans.append({"lane": "assistant generated", "start": s, "end": s + (r.get("generated_ms") or 0),
                      "kind": "assistant generated", "label": f"{r['response_id']} generated {r.get('generated_ms')} ms"})
        if r.get("heard_ms"):
            spans.append({"lane": "assistant heard", "start": s, "end": s + r["heard_ms"], "kind": "assistant heard",
                          "label": f"{r['response_id']} heard {r['heard_ms']} ms"})
        end = max(end, s + (r.get("generated_ms") or 0))
    return {"duration_ms": int(end), "spans": spans, "marks": marks}


def _stage_spans(t: int, x: dict) -> list:
    """The ``engine stages`` lane of one ``engine.unit_timings`` event seen at ``t``: the unit was
    submitted ``total_ms`` earlier; each stage sits where :func:`duplexkit.tracing.stage_windows`
    places it (the same placement as the trace spans). Timings without stage keys (the scripted
    engine) give one ``engine`` bar of ``total_ms``."""
    from duplexkit.tracing import stage_windows

    tm = x.get("timings") or {}
    total = tm.get("total_ms")
    if not isinstance(total, (int, float)):
        return []
    submit = t - float(total)
    k = x.get("unit_index")
    wins = stage_windows(tm) or [("engine", 0.0, float(total), {})]
    out = []
    for name, s_ms, e_ms, _a in wins:
        ms = e_ms - s_ms
        out.append({"lane": "engine stages", "start": round(submit + s_ms), "end": round(submit + e_ms), "kind": name,
                    "row": _STAGE_ROWS.get(name, 0), "label": f"unit {k}: {name} {ms:.1f} ms"})
    return out


def _svg(tl: dict, width: int = 1200) -> str:
    left, lane_h, top = 150, 34, 20
    dur = max(tl["duration_ms"], 1)
    x = lambda ms: left + (width - left - 10) * max(0, ms) / dur  # noqa: E731
    h = top + lane_h * len(LANES) + 30
    out = [f'<svg id="timeline" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{h}" '
           f'data-duration-ms="{dur}" data-left="{left}" data-right="{width - 10}">']
    for i, lane in enumerate(LANES):
        y = top + i * lane_h
        out.append(f'<g data-lane="{html.escape(lane)}"><rect x="{left}" y="{y}" width="{width - left - 10}" '
                   f'height="{lane_h - 6}" fill="#f8fafc" stroke="#e2e8f0"/>'
                   f'<text x="6" y="{y + lane_h / 2}" font-size="12" font-family="sans-serif">{lane}</text>')
        for s in tl["spans"]:
            if s["lane"] != lane:
                continue
            w = max(1.0, x(s["end"]) - x(s["start"]))
            sy, sh = (y + 2 + 9 * s["row"], 8) if "row" in s else (y + 3, lane_h - 12)
            out.append(f'<rect class="span" x="{x(s["start"]):.1f}" y="{sy}" width="{w:.1f}" height="{sh}" '
                       f'fill="{_COLORS.get(s["kind"], "#94a3b8")}"><title>{html.escape(s["label"])} '
                       f'({s["start"]}-{s["end"]} ms)</title></rect>')
        for m in tl["marks"]:
            if m["lane"] != lane:
                continue
            c = _COLORS.get(m["kind"], "#000")
            if m["kind"] == "latency":
                out.append(f'<line class="mark" x1="{x(m["t0"]):.1f}" x2="{x(m["t"]):.1f}" y1="{y + 14}" y2="{y + 14}" '
                           f'stroke="{c}" stroke-width="3"><title>{html.escape(m["label"])}</title></line>'
                           f'<text x="{x(m["t0"]):.1f}" y="{y + 10}" font-size="10" fill="{c}">'
                           f'{m["t"] - m["t0"]} ms</text>')
            else:
                out.append(f'<line class="mark" x1="{x(m["t"]):.1f}" x2="{x(m["t"]):.1f}" y1="{y + 2}" '
                           f'y2="{y + lane_h - 8}" stroke="{c}" stroke-width="3"><title>{html.escape(m["label"])} '
                           f'at {m["t"]} ms</title></line>')
        out.append("</g>")
    axis_y = top + lane_h * len(LANES) + 12
    step = 1000 if dur <= 20_000 else 5000 if dur <= 120_000 else 30_000
    for t in range(0, int(dur) + 1, step):
        out.append(f'<text x="{x(t):.1f}" y="{axis_y}" font-size="10" text-anchor="middle">{t / 1000:g}s</text>')
    out.append(f'<line id="cursor" x1="{left}" x2="{left}" y1="{top}" y2="{axis_y - 10}" stroke="#ef4444" '
               f'stroke-width="2"/></svg>')
    return "".join(out)


_JS = """
(function(){
  const svg = document.getElementById('timeline');
  const cursor = document.getElementById('cursor');
  const dur = Number(svg.dataset.durationMs), left = Number(svg.dataset.left), right = Number(svg.dataset.right);
  const players = Array.from(document.querySelectorAll('audio'));
  function place(ms){ const x = left + (right - left) * Math.min(Math.max(ms, 0), dur) / dur;
    cursor.setAttribute('x1', x); cursor.setAttribute('x2', x); }
  function tick(){ const p = players.find(a => !a.paused) || players[0];
    if (p) place(p.currentTime * 1000); requestAnimationFrame(tick); }
  function seek(ms){ players.forEach(a => { try { a.currentTime = ms / 1000; } catch (e) {} }); place(ms); }
  svg.addEventListener('click', ev => { const r = svg.getBoundingClientRect();
    seek((ev.clientX - r.left - left) / (right - left) * dur); });
  document.getElementById('playboth').addEventListener('click', () => {
    const t = players[0] ? players[0].currentTime : 0;
    players.filter(a => a.dataset.track !== 'generated').forEach(a => { a.currentTime = t; a.play(); }); });
  document.getElementById('pauseall').addEventListener('click', () => players.forEach(a => a.pause()));
  window.duplexkitReplay = {seek: seek, place: place, durationMs: dur,
    lanes: Array.from(svg.querySelectorAll('[data-lane]')).map(g => g.dataset.lane)};
  requestAnimationFrame(tick);
})();
"""


def render_html(folder: Union[str, Path], out: Optional[Union[str, Path]] = None, *, embed_audio: bool = True,
                recording: Optional[dict] = None) -> Path:
    """Write the page of one recording; returns its path (default ``<folder>/replay.html``).

    Args:
        embed_audio: True: the WAVs inside the page (base64; self-contained). False: referenced
            by relative path (the page must stay next to them).
        recording: ``folder``'s :func:`load_recording` result when the caller has it (not read again).
    Raises:
        RecordingError: not a recording, or no event in it could be read.
    """
    rec = recording if recording is not None else load_recording(folder)
    folder = rec["folder"]
    out = Path(out) if out is not None else folder / "replay.html"
    tl = timeline(rec)
    meta = rec["meta"]
    audio = []
    for track, name in (("user", "user.wav"), ("heard", "assistant_heard.wav"), ("generated", "assistant_generated.wav")):
        p = folder / name
        if not p.is_file():
            continue
        if embed_audio:
            src = "data:audio/wav;base64," + base64.b64encode(p.read_bytes()).decode("ascii")
        else:
            import os

            src = html.escape(os.path.relpath(p, out.parent))
        audio.append(f'<div><label>{track}</label> <audio controls preload="auto" data-track="{track}" '
                     f'src="{src}"></audio></div>')
    try:
        transcript = json.loads((folder / "transcript.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        transcript = []
    rows = "".join(f"<tr><td>{(r.get('t_ms') or 0) / 1000:.2f} s</td><td>{html.escape(r['role'])}</td>"
                   f"<td>{html.escape(r.get('text') or '')}</td><td>{html.escape(str(r.get('heard_ms', '')))}</td></tr>"
                   for r in transcript)
    facts = {k: meta.get(k) for k in ("session_id", "side", "model", "random_weights", "started_at", "duration_ms",
                                      "ref_voice_sha256", "capped", "failed")}
    facts["versions"] = meta.get("versions")
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>duplexkit replay {html.escape(str(meta.get('session_id') or folder.name))}</title>
<style>body{{font-family:sans-serif;margin:16px;color:#0f172a}} table{{border-collapse:collapse}}
td,th{{border:1px solid #e2e8f0;padding:3px 6px;font-size:13px;vertical-align:top}} pre{{background:#f1f5f9;padding:8px;font-size:12px}}
audio{{width:480px;vertical-align:middle}} label{{display:inline-block;width:80px}} svg{{cursor:crosshair}}</style></head>
<body><h1>Conversation {html.escape(str(meta.get('session_id') or folder.name))}</h1>
{_svg(tl)}
<p><button id="playboth">play user + heard</button> <button id="pauseall">pause</button>
<span style="font-size:12px"> click the timeline to seek; colors: listen grey, speak green, generated orange,
heard green, barge-in red, tool violet, latency cyan; engine stages: thinker blue, talker amber,
Code2Wav purple (one row each; grey: the unit's total where no stages are reported)</span></p>
{''.join(audio)}
<h2>Transcript</h2><table><tr><th>t</th><th>role</th><th>text</th><th>heard ms</th></tr>{rows}</table>
<h2>Session</h2><pre>{html.escape(json.dumps(facts, indent=1, default=str))}</pre>
<script>{_JS}</script></body></html>"""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    return out


def render_png(folder: Union[str, Path], out: Optional[Union[str, Path]] = None) -> Path:
    """The timeline as a PNG (default ``<folder>/replay.png``), drawn with matplotlib.

    Raises:
        OptionalDependencyError: matplotlib is not installed (``pip install 'duplexkit[replay]'``).
        RecordingError: not a recording.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        from duplexkit.errors import OptionalDependencyError

        raise OptionalDependencyError("matplotlib", "replay", "duplexkit replay --png") from exc
    rec = load_recording(folder)
    out = Path(out) if out is not None else rec["folder"] / "replay.png"
    tl = timeline(rec)
    fig, ax = plt.subplots(figsize=(12, 3.2), dpi=110)
    n = len(LANES)
    for i, lane in enumerate(LANES):
        y = n - 1 - i
        for s in (s for s in tl["spans"] if s["lane"] == lane):
            band = (y + 0.7 - 0.27 * s["row"], 0.24) if "row" in s else (y + 0.15, 0.7)
            ax.broken_barh([(s["start"] / 1000, max(0.01, (s["end"] - s["start"]) / 1000))], band,
                           facecolors=_COLORS.get(s["kind"], "#94a3b8"))
        for m in (m for m in tl["marks"] if m["lane"] == lane):
            c = _COLORS.get(m["kind"], "#000")
            if m["kind"] == "latency":
                ax.plot([m["t0"] / 1000, m["t"] / 1000], [y + 0.5, y + 0.5], color=c, lw=3)
                ax.text(m["t0"] / 1000, y + 0.75, f"{m['t'] - m['t0']} ms", fontsize=7, color=c)
            else:
                ax.vlines(m["t"] / 1000, y + 0.1, y + 0.9, colors=c, lw=2)
    ax.set_yticks([n - 1 - i + 0.5 for i in range(n)], LANES, fontsize=8)
    ax.set_xlim(0, tl["duration_ms"] / 1000)
    ax.set_ylim(0, n)
    ax.set_xlabel("session time (s)")
    ax.set_title(f"duplexkit recording {rec['meta'].get('session_id') or rec['folder'].name}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
