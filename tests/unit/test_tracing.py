"""OpenTelemetry traces (duplexkit/tracing.py, docs/debugging.md "Traces"): the span tree of real
in-process sessions (scripted engine, real speech) checked with the SDK's in-memory exporter;
the ``tracing`` session field; stage placement; nothing imported while tracing is off."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from duplexkit import tracing  # noqa: E402
from duplexkit.audio import VirtualPlayer, read_wav  # noqa: E402
from duplexkit.clients import InlineDuplexClient  # noqa: E402
from duplexkit.testing import ScriptedEngine  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FIX = REPO / "tests" / "fixtures" / "audio"
TD = {"type": "server_vad", "create_response": False, "interrupt_response": True, "silence_duration_ms": 500}


def _provider():
    exp = InMemorySpanExporter()
    p = TracerProvider()
    p.add_span_processor(SimpleSpanProcessor(exp))
    return p, exp


async def _session(provider, *, session=None, units=3, answers=1, **kw):
    speech = read_wav(FIX / "question_16k.wav", 16_000)[0]
    handles = []
    async with InlineDuplexClient(ScriptedEngine(units_per_turn=units, random_weights=True, **kw),
                                  session=dict({"turn_detection": TD}, **(session or {})),
                                  player=VirtualPlayer(block_ms=20), request_timeout_s=30,
                                  tracer_provider=provider) as c:
        sid = c.session["id"]
        for _ in range(answers):
            for i in range(0, len(speech), 1600):
                await c.send_audio(speech[i:i + 1600])
                await asyncio.sleep(0.005)
            await c.commit()
            h = await c.create_response()
            await h.wait(30)
            await h.wait_heard(30)
            handles.append(h)
        honoured = c.session_machine.tracing_honoured
    return sid, handles, honoured


def _tree(spans):
    by_id = {s.context.span_id: s for s in spans}

    def parent(s):
        return by_id.get(s.parent.span_id) if s.parent is not None else None

    return by_id, parent


def check_tree(spans, *, session_name="duplexkit.session", stages=False) -> dict:
    """Assert the session > turn > response > unit (> stage) shape, parentage and time order;
    returns the spans by kind."""
    by_id, parent = _tree(spans)
    roots = [s for s in spans if parent(s) is None]
    assert [r.name for r in roots] == [session_name], [r.name for r in roots]
    root = roots[0]
    kinds = {"turn": [], "response": [], "unit": [], "stage": [], "other": []}
    for s in spans:
        p = parent(s)
        if s.name == "duplexkit.turn":
            kinds["turn"].append(s)
            assert p is root
        elif s.name == "duplexkit.response":
            kinds["response"].append(s)
            assert p.name == "duplexkit.turn"
        elif s.name == "duplexkit.unit":
            kinds["unit"].append(s)
            assert p.name in ("duplexkit.response", session_name)
            if p is root:
                assert s.attributes["duplexkit.unit.decision"] != "speak" or s.attributes.get("duplexkit.unit.index") is not None
        elif s.name in ("thinker.prefill", "thinker.decode", "thinker", "talker", "code2wav"):
            kinds["stage"].append(s)
            assert p.name == "duplexkit.unit"
        elif s is not root:
            kinds["other"].append(s)
        # every span lies inside its parent, and ends after it starts
        assert s.start_time <= s.end_time, s.name
        if p is not None:
            assert p.start_time <= s.start_time and s.end_time <= p.end_time, (s.name, p.name)
        assert s.context.trace_id == root.context.trace_id
    assert kinds["turn"] and kinds["response"] and kinds["unit"]
    if stages:
        assert kinds["stage"]
    return {"root": root, **kinds}


def test_inline_session_span_tree():
    provider, exp = _provider()
    sid, (h,), honoured = asyncio.run(_session(provider, session={"tracing": "auto"}))
    spans = exp.get_finished_spans()
    k = check_tree(spans)
    root = k["root"]
    assert root.attributes["duplexkit.session.id"] == sid
    assert root.attributes["duplexkit.model"] == "scripted"
    assert root.attributes["duplexkit.responses"] == 1 and root.attributes["duplexkit.units"] >= 3
    (resp,) = k["response"]
    a = resp.attributes
    assert a["duplexkit.response.id"] == h.id and a["duplexkit.response.status"] == "completed"
    assert a["duplexkit.response.trigger"] == "client" and isinstance(a["duplexkit.epoch"], int)
    assert a["duplexkit.response.ttfp_ms"] > 0 and a["duplexkit.response.units"] == 3
    speak = [u for u in k["unit"] if u.parent.span_id == resp.context.span_id]
    assert len(speak) == 3
    for u in speak:
        ua = u.attributes
        assert ua["duplexkit.unit.decision"] == "speak" and ua["duplexkit.unit.tokens"] > 0
        assert ua["duplexkit.unit.total_ms"] >= 0 and "duplexkit.unit.queue_ms" in ua
        assert abs((u.end_time - u.start_time) / 1e6 - ua["duplexkit.unit.total_ms"]) < 5
    assert sorted(u.attributes["duplexkit.unit.index"] for u in speak) == \
        sorted({u.attributes["duplexkit.unit.index"] for u in speak})
    assert speak[0].attributes["duplexkit.unit.force_speak"] in (True, False)
    # the user's speech opened the turn (server VAD), before the answer
    (turn,) = k["turn"]
    assert turn.attributes["duplexkit.turn.speech_started"] is True
    assert turn.attributes["duplexkit.turn.speech_ms"] > 0
    assert turn.attributes["duplexkit.turn.speech_audio_ms"] > 1000  # the question is ~2 s of speech
    listen = [u for u in k["unit"] if u.parent.span_id == root.context.span_id]
    assert listen and all(u.attributes["duplexkit.unit.decision"] == "listen" for u in listen)
    assert honoured


def test_the_tracing_field_is_warned_about_only_where_nothing_traces():
    sys.path.insert(0, str(REPO / "tests" / "unit" / "session"))
    from _driver import Driver

    for honoured, expect in ((False, ["session.tracing"]), (True, [])):
        d = Driver()
        d.s.tracing_honoured = honoured
        d.send({"type": "session.update", "session": {"tracing": {"workflow_name": "w"}}})
        assert [e["param"] for e in d.events if e["type"] == "session.warning"] == expect


def test_two_turns_and_the_workflow_name():
    provider, exp = _provider()
    tr = {"workflow_name": "support-call", "group_id": "grp_42", "metadata": {"customer": "c1", "tier": 2}}
    sid, hs, _ = asyncio.run(_session(provider, session={"tracing": tr}, units=2, answers=2))
    k = check_tree(exp.get_finished_spans(), session_name="support-call")
    a = k["root"].attributes
    assert a["duplexkit.tracing.workflow_name"] == "support-call" and a["duplexkit.tracing.group_id"] == "grp_42"
    assert a["duplexkit.tracing.metadata.customer"] == "c1" and a["duplexkit.tracing.metadata.tier"] == 2
    assert len(k["turn"]) == 2 and len(k["response"]) == 2
    turns = sorted(k["turn"], key=lambda s: s.start_time)
    assert [t.attributes["duplexkit.turn.index"] for t in turns] == [1, 2]
    assert turns[0].end_time <= turns[1].end_time
    by_turn = {t.context.span_id: t for t in turns}
    ids = [r.attributes["duplexkit.response.id"] for r in sorted(k["response"], key=lambda s: s.start_time)]
    assert ids == [h.id for h in hs]
    assert {r.parent.span_id for r in k["response"]} == set(by_turn)


def test_tracing_null_disables_the_session():
    provider, exp = _provider()
    asyncio.run(_session(provider, session={"tracing": None}, units=1))
    assert exp.get_finished_spans() == ()


def test_bad_tracing_value_is_refused_and_the_session_lives():
    provider, exp = _provider()

    async def run():
        async with InlineDuplexClient(ScriptedEngine(units_per_turn=1, random_weights=True),
                                      tracer_provider=provider, request_timeout_s=30) as c:
            with pytest.raises(Exception) as ei:
                await c.update(tracing={"workflow_name": 7})
            await c.send_audio(np.zeros(16_000, np.float32))
            h = await c.create_response()
            await h.wait(30)
            return ei.value, h

    err, h = asyncio.run(run())
    assert "tracing" in str(err)
    assert h.status == "completed"
    check_tree(exp.get_finished_spans())


def test_stage_windows_place_the_stages_inside_the_unit():
    tm = {"total_ms": 100.0, "queue_ms": 12.0, "thinker_queue_ms": 5.0, "thinker_prefill_ms": 20.0,
          "thinker_decode_ms": 25.0, "thinker_ms": 50.0, "thinker_done_ms": 55.0, "talker_queue_ms": 3.0,
          "talker_ms": 20.0, "talker_done_ms": 80.0, "code2wav_queue_ms": 4.0, "code2wav_ms": 10.0,
          "decode_steps": 7, "thinker_batch": 2}
    w = {name: (s, e, a) for name, s, e, a in tracing.stage_windows(tm)}
    assert list(w) == ["thinker.prefill", "thinker.decode", "talker", "code2wav"]
    assert w["thinker.prefill"][:2] == (5.0, 25.0) and w["thinker.decode"][:2] == (25.0, 50.0)
    assert w["talker"][:2] == (60.0, 80.0) and w["code2wav"][:2] == (84.0, 94.0)
    assert w["thinker.prefill"][2]["duplexkit.stage.queue_ms"] == 5.0
    assert w["thinker.decode"][2]["duplexkit.stage.steps"] == 7
    assert tracing.stage_windows({"total_ms": 10.0, "queue_ms": 0.0}) == []
    assert tracing.stage_windows({}) == []
    # a stage that overran the unit's total (clock skew) is clamped into it
    w2 = tracing.stage_windows({"total_ms": 10.0, "code2wav_ms": 30.0})
    assert all(0.0 <= s <= e <= 10.0 for _n, s, e, _a in w2)


def test_parse_tracing_field():
    assert tracing.parse_tracing_field(None) is None
    assert tracing.parse_tracing_field("auto") == {}
    assert tracing.parse_tracing_field({"workflow_name": "w", "metadata": {"a": 1}}) == \
        {"workflow_name": "w", "metadata": {"a": 1}}
    for bad in ("on", 3, {"group_id": 5}, {"metadata": "x"}):
        with pytest.raises(tracing.TracingError):
            tracing.parse_tracing_field(bad)


def test_env_switch_and_protocols(monkeypatch):
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}
    assert tracing.env_enabled(env)
    assert tracing.env_enabled({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://x:4318/v1/traces"})
    assert not tracing.env_enabled({})
    assert not tracing.env_enabled(dict(env, OTEL_SDK_DISABLED="true"))
    assert not tracing.env_enabled(dict(env, OTEL_TRACES_EXPORTER="none"))
    assert tracing._protocol({}) == "http/protobuf"
    assert tracing._protocol({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}) == "grpc"
    assert tracing._protocol({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                              "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}) == "http/protobuf"
    with pytest.raises(tracing.TracingError, match="http/json"):
        tracing._protocol({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})


def test_without_otel_env_nothing_imports_opentelemetry():
    """A session through the inline client with tracing off: ``opentelemetry`` never enters
    ``sys.modules`` and the driver has no tracer. The server package adds no OpenTelemetry SDK or
    exporter either (FastAPI itself imports ``opentelemetry``'s API when it is installed)."""
    code = r"""
import asyncio, sys
import numpy as np
from duplexkit.clients import InlineDuplexClient
from duplexkit.testing import ScriptedEngine

async def main():
    async with InlineDuplexClient(ScriptedEngine(units_per_turn=1, random_weights=True), request_timeout_s=30) as c:
        assert c._driver.tracer is None
        await c.send_audio(np.zeros(16000, np.float32))
        h = await c.create_response()
        await h.wait(30)
asyncio.run(main())
print("OTEL_MODULES", sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry"))
import duplexkit_server.app
print("SDK_MODULES", sorted(m for m in sys.modules if m.startswith(("opentelemetry.sdk", "opentelemetry.exporter"))))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         cwd=str(REPO))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OTEL_MODULES []" in out.stdout, out.stdout + out.stderr[-2000:]
    assert "SDK_MODULES []" in out.stdout, out.stdout + out.stderr[-2000:]


def test_tracing_null_mid_session_stops_and_a_new_workflow_renames():
    provider, exp = _provider()
    speech = read_wav(FIX / "question_16k.wav", 16_000)[0]

    async def answer(c):
        for i in range(0, len(speech), 1600):
            await c.send_audio(speech[i:i + 1600])
            await asyncio.sleep(0.005)
        await c.commit()
        h = await c.create_response()
        await h.wait(30)
        return h

    async def run():
        async with InlineDuplexClient(ScriptedEngine(units_per_turn=1, random_weights=True),
                                      session={"turn_detection": TD}, request_timeout_s=30,
                                      tracer_provider=provider) as c:
            await c.update(tracing={"workflow_name": "first"})
            h1 = await answer(c)
            await asyncio.sleep(0.3)  # the response's last unit timings come in
            await c.update(tracing=None)
            h2 = await answer(c)
            return h1, h2

    h1, h2 = asyncio.run(run())
    spans = exp.get_finished_spans()
    k = check_tree(spans, session_name="first")
    assert [r.attributes["duplexkit.response.id"] for r in k["response"]] == [h1.id]
    assert h2.id not in {s.attributes.get("duplexkit.response.id") for s in spans}


def test_a_tool_call_and_its_answer_stay_in_one_turn():
    from duplexkit.agent import tool

    notes = []

    @tool(filler="Writing it down.")
    async def add_note(text: str) -> dict:
        """Add a note.

        Args:
            text: the note.
        """
        notes.append(text)
        return {"id": len(notes)}

    provider, exp = _provider()
    speech = read_wav(FIX / "question_16k.wav", 16_000)[0]

    async def run():
        eng = ScriptedEngine(units_per_turn=2, tool_script=[("add_note", {"text": "buy milk"})])
        async with InlineDuplexClient(eng, tools=[add_note], answer_policy="on_request", request_timeout_s=30,
                                      session={"turn_detection": None}, tracer_provider=provider) as c:
            for i in range(0, len(speech), 1600):
                await c.send_audio(speech[i:i + 1600])
            await c.commit()
            seen = []
            async with asyncio.timeout(30):
                while True:
                    ev = await c.events().get()
                    seen.append(ev)
                    if getattr(ev, "type", None) == "response.done" and ev.response.trigger == "client":
                        break
            await asyncio.sleep(0.3)
            return [e.response for e in seen if getattr(e, "type", None) == "response.done"]

    done = asyncio.run(run())
    assert notes == ["buy milk"] and len(done) >= 2
    spans = exp.get_finished_spans()
    k = check_tree(spans)
    assert len(k["turn"]) == 1
    resp = sorted(k["response"], key=lambda s: s.start_time)
    assert [r.attributes["duplexkit.response.id"] for r in resp] == [d.id for d in done]
    assert any(r.attributes["duplexkit.response.tool_call"] for r in resp)
    assert resp[-1].attributes["duplexkit.response.trigger"] == "client"
    decide = [s for s in k["other"] if s.name == "duplexkit.decide_tools"]
    assert decide and all(s.attributes["duplexkit.elapsed_ms"] >= 0 for s in decide)


def test_a_failing_otlp_endpoint_warns_once_and_does_not_hold_the_shutdown(caplog):
    """The guard around the OTLP exporter (duplexkit.tracing._GuardedExporter): the exporter's line
    per retry becomes one warning of duplexkit.tracing, and a shutdown waits at most
    SHUTDOWN_FLUSH_S for an export that hangs in retries (real SDK provider and batch processor;
    the stand-in exporter logs as the OTLP one does and blocks until shut down)."""
    import logging
    import threading
    import time

    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from duplexkit import tracing

    exporter_log = logging.getLogger(tracing.EXPORTER_LOGGERS[0])

    class Hanging:
        def __init__(self):
            self.stop = threading.Event()
            self.calls = 0

        def export(self, spans):
            self.calls += 1
            for _ in range(3):
                exporter_log.warning("Transient error HTTPConnectionPool(host='127.0.0.1', port=9): Max retries "
                                     "exceeded (Caused by NewConnectionError(\"Failed to establish a new connection: "
                                     "[Errno 111] Connection refused\")) encountered while exporting spans batch, "
                                     "retrying in 0.89s.")
            self.stop.wait(30)  # the exporter's retries, until its shutdown
            return None

        def shutdown(self):
            self.stop.set()

    inner = Hanging()
    guard = tracing._GuardedExporter(inner, "http://127.0.0.1:9")
    try:
        provider = TracerProvider(shutdown_on_exit=False)
        provider.add_span_processor(tracing._bounded_processor_class(BatchSpanProcessor)(guard))
        tracer = provider.get_tracer("t")
        caplog.set_level(logging.DEBUG)
        for i in range(3):
            tracer.start_span(f"s{i}").end()
        assert provider.force_flush() is False  # the export fails (bounded: SHUTDOWN_FLUSH_S)
        assert inner.calls == 1
        t0 = time.monotonic()
        provider.shutdown()
        assert time.monotonic() - t0 < tracing.SHUTDOWN_FLUSH_S + 1.0
    finally:
        for name in tracing.EXPORTER_LOGGERS:
            logging.getLogger(name).removeFilter(guard._filter)
        inner.stop.set()
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(loud) == 1 and loud[0].name == "duplexkit.tracing", [r.getMessage() for r in loud]
    assert "cannot be exported to http://127.0.0.1:9 (Connection refused)" in loud[0].getMessage()
    assert sum("OTLP exporter: Transient error" in r.getMessage() for r in caplog.records) == 3  # at DEBUG
