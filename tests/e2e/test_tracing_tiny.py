"""Traces of a session on the REAL tiny engine (random weights, the real three-stage runtime on CPU)
through the in-process client: the speaking units carry stage spans (thinker prefill and decode,
talker, Code2Wav) placed inside the unit from the engine's ``UnitTimings``, in pipeline order."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.engine]
pytest.importorskip("torch")
pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from duplexkit.audio import read_wav  # noqa: E402
from duplexkit.clients import InlineDuplexClient  # noqa: E402

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "audio"
STAGES = ["thinker.prefill", "thinker.decode", "talker", "code2wav"]


def test_tiny_engine_session_has_stage_spans(tmp_path):
    from duplexkit.engine import DuplexEngine

    exp = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exp))
    engine = DuplexEngine.from_pretrained("tiny", layout="cpu", progress=False)

    async def run():
        speech = read_wav(FIX / "question_16k.wav", 16_000)[0]
        try:
            async with InlineDuplexClient(engine, answer_policy="on_request", max_output_tokens=24,
                                          session={"turn_detection": None, "tracing": {"workflow_name": "tiny"}},
                                          request_timeout_s=300, tracer_provider=provider,
                                          record=tmp_path) as c:
                for i in range(0, len(speech), 3200):
                    await c.send_audio(speech[i:i + 3200])
                h = await c.create_response()
                await h.wait(300)
                rec = c.recording
            assert rec.recorder.flush(60)
            return h
        finally:
            await engine.aclose()

    h = asyncio.run(run())
    assert h.status in ("completed", "incomplete")  # incomplete: the token cap ends a random-weight turn
    spans = exp.get_finished_spans()
    by_id = {s.context.span_id: s for s in spans}
    (root,) = [s for s in spans if s.parent is None]
    assert root.name == "tiny"
    (resp,) = [s for s in spans if s.name == "duplexkit.response"]
    assert by_id[resp.parent.span_id].name == "duplexkit.turn"
    units = [s for s in spans if s.name == "duplexkit.unit" and s.parent.span_id == resp.context.span_id]
    assert units
    for u in units:
        stages = sorted((s for s in spans if s.parent is not None and s.parent.span_id == u.context.span_id),
                        key=lambda s: s.start_time)
        names = [s.name for s in stages]
        assert names == STAGES or names == STAGES[:2], names  # a unit that ends the turn may have no audio stage
        for s in stages:
            assert u.start_time <= s.start_time <= s.end_time <= u.end_time
            assert s.attributes["duplexkit.stage.ms"] >= 0
        for a, b in zip(stages, stages[1:]):  # the pipeline's order: each stage starts after the one before ends
            assert a.end_time <= b.start_time + 1_000_000  # 1 ms of rounding
        ua = u.attributes
        assert ua["duplexkit.unit.thinker_ms"] > 0 and "duplexkit.unit.thinker_queue_ms" in ua
        if names == STAGES:
            assert ua["duplexkit.unit.talker_ms"] > 0 and ua["duplexkit.unit.code2wav_ms"] > 0
    assert any(len([s for s in spans if s.parent is not None and s.parent.span_id == u.context.span_id]) == 4
               for u in units)
    # listening units have their thinker stages too, under the session span
    listen = [s for s in spans if s.name == "duplexkit.unit" and s.parent.span_id == root.context.span_id]
    assert listen and {s.name for s in spans if s.parent is not None
                       and s.parent.span_id in {u.context.span_id for u in listen}} <= set(STAGES[:2])

    # the replay page's engine-stages lane shows the same stages, from the recorded UnitTimings
    from duplexkit.replay import find_recordings, load_recording, render_html, timeline

    (folder,) = find_recordings(tmp_path)
    tl = timeline(load_recording(folder))
    lane = [x for x in tl["spans"] if x["lane"] == "engine stages"]
    assert {x["kind"] for x in lane} == set(STAGES)
    assert {x["row"] for x in lane} == {0, 1, 2}
    assert all(x["start"] <= x["end"] for x in lane)
    assert 'data-lane="engine stages"' in render_html(folder).read_text()
