"""The replay page's ``engine stages`` lane (duplexkit/replay.py) on a real in-process recording with
the scripted engine (which reports only ``total_ms``: one bar per unit), and the stage placement
shared with the trace spans (:func:`duplexkit.tracing.stage_windows`)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np

from duplexkit.clients import InlineDuplexClient
from duplexkit.recording import Recorder
from duplexkit.replay import LANES, load_recording, render_html, timeline
from duplexkit.testing import ScriptedEngine


def test_engine_stages_lane_from_recorded_unit_timings(tmp_path):
    rec = Recorder(tmp_path)

    async def run():
        async with InlineDuplexClient(ScriptedEngine(units_per_turn=2, random_weights=True, unit_delay_s=0.04),
                                      record=rec, request_timeout_s=30) as c:
            await c.send_audio(np.zeros(32_000, np.float32))
            h = await c.create_response()
            await h.wait(30)
            return c.recording

    r = asyncio.run(run())
    assert rec.flush(20)
    folder = r.folder
    events = [json.loads(x) for x in (folder / "events.jsonl").read_text().splitlines()]
    timings = [e for e in events if e["type"] == "engine.unit_timings"]
    assert timings and all("total_ms" in e["event"]["timings"] for e in timings)
    tl = timeline(load_recording(folder))
    lane = [s for s in tl["spans"] if s["lane"] == "engine stages"]
    assert len(lane) == len(timings) and {s["kind"] for s in lane} == {"engine"}
    for s, e in zip(lane, timings):
        assert s["end"] == e["t_ms"] and abs((s["end"] - s["start"]) - e["event"]["timings"]["total_ms"]) <= 1
    assert "engine stages" in LANES
    assert 'data-lane="engine stages"' in render_html(folder).read_text()


def test_stage_spans_of_full_timings():
    from duplexkit.replay import _stage_spans

    tm = {"total_ms": 900.0, "thinker_queue_ms": 10.0, "thinker_prefill_ms": 100.0, "thinker_decode_ms": 200.0,
          "thinker_ms": 300.0, "thinker_done_ms": 310.0, "talker_queue_ms": 5.0, "talker_ms": 250.0,
          "talker_done_ms": 570.0, "code2wav_queue_ms": 10.0, "code2wav_ms": 300.0}
    spans = _stage_spans(5000, {"unit_index": 4, "timings": tm})
    got = [(s["kind"], s["row"], s["start"], s["end"]) for s in spans]
    assert got == [("thinker.prefill", 0, 4110, 4210), ("thinker.decode", 0, 4210, 4410), ("talker", 1, 4420, 4670),
                   ("code2wav", 2, 4680, 4980)]
    assert _stage_spans(5000, {"timings": {}}) == []
