""":class:`duplexkit.engine.process.EngineProcess` driven directly (a real spawned process, a real
pipe): per-stream order under flow control, chat through the process, kv_usage reaching /metrics,
load errors that do not pickle or a child that exits while loading, and aclose joining the child."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from duplexkit.engine.api import (AppendUnit, AudioChunk, ChatMessage, ChatRequest, Decision, SpeakText, StreamConfig,
                                  TextDelta, ToolCall, TurnEnd)
from duplexkit.engine.process import OUTPUT_CREDITS, EngineProcess, EngineSpec
from duplexkit.errors import EngineLoadError, EngineProcessError

pytestmark = pytest.mark.e2e


def _unit(sid: str, k: int) -> AppendUnit:
    return AppendUnit(sid, 0, unit_index=k, audio=np.zeros(16_560 if k == 0 else 16_000, np.float32), force_speak=True)


async def _start(factory: str, **kwargs) -> EngineProcess:
    return await asyncio.to_thread(EngineProcess(EngineSpec(factory, (), kwargs)).start)


async def test_order_is_kept_per_stream_when_the_consumer_lags_behind_the_credits():
    eng = await _start("_engine_factories:metered", units_per_turn=None)  # every unit speaks: 4 outputs
    try:
        n_units, sids = 60, ["a", "b", "c", "d"]
        streams = [await eng.open_stream(s, StreamConfig()) for s in sids]
        for k in range(n_units):
            for st in streams:
                st.submit(_unit(st.stream_id, k))
        # nobody reads yet: 4 x 60 x 4 outputs are far more than the engine process may have in flight
        assert len(sids) * n_units * 4 > OUTPUT_CREDITS

        async def read(st) -> list:
            got = []
            async for out in st.outputs():
                got.append(out)
                if isinstance(out, Decision) and out.unit_index == n_units - 1:
                    break
            return got

        await asyncio.sleep(0.5)
        results = await asyncio.gather(*(read(st) for st in streams))
        for sid, got in zip(sids, results):
            assert {o.stream_id for o in got} == {sid}
            decided = [o.unit_index for o in got if isinstance(o, Decision)]
            assert decided == list(range(n_units))
            chunks = [o for o in got if isinstance(o, AudioChunk)]
            assert [c.unit_index for c in chunks] == list(range(n_units - 1))  # the last unit's chunk follows
            assert len(chunks[0].audio) == 20_160 and all(len(c.audio) == 24_000 for c in chunks[1:])
        for st in streams:
            await st.aclose()
        assert eng.num_streams == 0
    finally:
        await eng.aclose()
    assert eng.exitcode == 0


async def test_chat_and_early_closed_chat_stream_through_the_process():
    eng = await _start("duplexkit.engine.loading:load_engine", model="scripted", checked=True)
    try:
        req = ChatRequest(messages=[ChatMessage("user", ["Say hello."])], output_audio=True)
        res = await eng.generate(req)
        assert res.text == "This is a scripted chat reply." and res.audio.dtype == np.float32
        assert len(res.audio) == 6 * 9600
        agen = eng.generate_stream(req)
        first = await agen.__anext__()
        assert first.text == "This " and len(first.audio) == 9600
        await agen.aclose()  # abandoned: cancelled in the engine process
        texts = [d.text async for d in eng.generate_stream(req)]
        assert "".join(texts) == "This is a scripted chat reply."
    finally:
        await eng.aclose()


async def test_speak_text_and_tool_calls_cross_the_process_boundary():
    eng = await _start("_engine_factories:metered", units_per_turn=None,
                       tool_script=[("get_weather", {"city": "Paris"})])
    try:
        tools = ({"type": "function", "name": "get_weather",
                  "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},)
        req = ChatRequest(messages=[ChatMessage("user", ["Weather?"])], tools=tools, tool_choice="auto")
        res = await eng.generate(req)
        assert res.finish_reason == "tool_calls" and res.tool_calls == (ToolCall("get_weather", '{"city": "Paris"}'),)
        last = [d async for d in eng.generate_stream(ChatRequest(messages=req.messages, tools=tools,
                                                                  tool_choice="required"))][-1]
        assert last.finish_reason == "tool_calls" and last.tool_calls[0].arguments == "{}"
        st = await eng.open_stream("s", StreamConfig())
        st.submit(SpeakText("s", 0, text="Two words and three more.", tokens_per_unit=2))
        for k in range(4):
            st.submit(AppendUnit("s", 0, unit_index=k, audio=np.zeros(16_560 if k == 0 else 16_000, np.float32),
                                 force_listen=True))
        got = []
        async for out in st.outputs():
            got.append(out)
            if isinstance(out, TurnEnd):
                break
        assert "".join(o.text for o in got if isinstance(o, TextDelta)) == "Two words and three more."
        assert [o.decision for o in got if isinstance(o, Decision)] == ["speak"] * 3
        await st.aclose()
    finally:
        await eng.aclose()


async def test_kv_usage_reaches_the_metrics_of_a_server_using_the_process():
    from prometheus_client.parser import text_string_to_metric_families

    from duplexkit_server import create_app

    eng = await _start("_engine_factories:metered")
    try:
        state = create_app(eng).state.duplexkit
        st = await eng.open_stream("s1", StreamConfig())
        for _ in range(600):  # the engine process reports once a second
            if eng.kv_usage().get("thinker", {}).get("slots_used") == 1:
                break
            await asyncio.sleep(0.1)
        body, _ = state.metrics.render()
        got = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(body.decode()) for s in f.samples}
        assert got[("duplexkit_kv_slots", (("kind", "used"), ("stage", "thinker")))] == 1
        assert got[("duplexkit_kv_slots", (("kind", "total"), ("stage", "thinker")))] == 4
        await st.aclose()
    finally:
        await eng.aclose()


def test_a_load_error_that_does_not_pickle_arrives_as_engine_load_error_with_its_text():
    proc = EngineProcess(EngineSpec("_engine_factories:fails_oddly"))
    with pytest.raises(EngineLoadError, match="engine failed to load: OddLoadError: the weights failed: a missing shard"):
        proc.start()
    assert proc.exitcode == 0


def test_a_child_that_exits_while_loading_is_a_load_error():
    with pytest.raises(EngineLoadError, match="exited with code 3 while loading"):
        EngineProcess(EngineSpec("_engine_factories:exits_while_loading")).start()


async def test_calls_after_aclose_raise_engine_process_error():
    eng = await _start("duplexkit.engine.loading:load_engine", model="scripted", checked=True)
    await eng.aclose()
    assert eng.exitcode == 0
    with pytest.raises(EngineProcessError):
        await eng.open_stream("x", StreamConfig())
    with pytest.raises(EngineProcessError):
        await eng.generate(ChatRequest(messages=[ChatMessage("user", ["hi"])]))


def test_a_loading_engine_ignores_sigint_and_cancel_stops_it(tmp_path):
    """A terminal's Ctrl+C reaches the engine process too; the server alone decides when it stops
    (a load that ended by itself on SIGINT was reported as "engine failed to load"). The server's
    shutdown path stops the load with ``cancel()``: the child is killed and reaped, ``start()``
    raises at once."""
    import os
    import signal
    import threading
    import time

    from _timing import bound

    marker = tmp_path / "loading"
    proc = EngineProcess(EngineSpec("_engine_factories:slow_load", (str(marker), 120.0)))
    box: dict = {}

    def start() -> None:
        try:
            proc.start()
            box["result"] = "loaded"
        except BaseException as exc:  # noqa: BLE001 - inspected below
            box["result"] = exc

    t = threading.Thread(target=start)
    t.start()
    deadline = time.monotonic() + bound(60)
    while not marker.exists() and t.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), box
    os.kill(proc.pid, signal.SIGINT)  # as a terminal's Ctrl+C reaches the whole process group
    os.kill(proc.pid, signal.SIGTERM)
    t.join(1.0)
    assert t.is_alive() and "result" not in box  # still loading
    t0 = time.monotonic()
    proc.cancel()
    t.join(bound(10))
    assert not t.is_alive() and time.monotonic() - t0 < bound(5)
    assert isinstance(box["result"], EngineLoadError) and "cancelled" in str(box["result"]), box
    assert proc.exitcode == -signal.SIGKILL
    assert not os.path.exists(f"/proc/{proc.pid}")  # reaped, not a zombie
