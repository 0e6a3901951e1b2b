"""The server (the bundled FastAPI app behind a real WebSocket, in this process) and the in-process
client produce the same span tree for the same conversation: the same spans by name and parent,
the same response and unit counts, the same attribute keys (duplexkit.tracing.configure and
InlineDuplexClient(tracer_provider=) on the scripted engine, real speech)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from duplexkit import tracing  # noqa: E402
from duplexkit.audio import VirtualPlayer, read_wav  # noqa: E402
from duplexkit.clients import DuplexClient, InlineDuplexClient  # noqa: E402
from duplexkit.testing import ScriptedEngine  # noqa: E402
from _timing import bound  # noqa: E402

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "audio"
TD = {"type": "server_vad", "create_response": False, "interrupt_response": True, "silence_duration_ms": 500}
SESSION = {"turn_detection": TD, "tracing": {"workflow_name": "parity", "group_id": "g"}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.asynccontextmanager
async def _server(engine):
    import uvicorn

    from duplexkit_server.app import ServerSettings, create_app

    app = create_app(engine, ServerSettings())
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    task = asyncio.get_running_loop().create_task(server.serve())
    for _ in range(500):
        if server.started:
            break
        await asyncio.sleep(0.02)
    try:
        yield f"ws://127.0.0.1:{port}/v1/realtime?duplex=1"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, bound(20))


async def _talk(c) -> str:
    speech = read_wav(FIX / "question_16k.wav", 16_000)[0]
    for i in range(0, len(speech), 1600):
        await c.send_audio(speech[i:i + 1600])
        await asyncio.sleep(0.01)
    await c.commit()
    h = await c.create_response()
    await h.wait(bound(30))
    await h.wait_heard(bound(30))
    return h.status


def _shape(spans) -> tuple:
    by_id = {s.context.span_id: s for s in spans}
    edges = Counter((s.name, by_id[s.parent.span_id].name if s.parent is not None else None) for s in spans
                    if s.name != "duplexkit.unit" or by_id[s.parent.span_id].name != "parity")
    keys = {s.name: sorted(k for k in s.attributes if not k.startswith("duplexkit.tracing.metadata"))
            for s in spans if s.name != "duplexkit.unit"}
    speak = sorted(s.attributes["duplexkit.unit.decision"] for s in spans
                   if s.name == "duplexkit.unit" and by_id[s.parent.span_id].name == "duplexkit.response")
    return edges, keys, speak


def test_server_and_inline_client_make_the_same_tree():
    exp_srv = InMemorySpanExporter()
    p_srv = TracerProvider()
    p_srv.add_span_processor(SimpleSpanProcessor(exp_srv))
    exp_inl = InMemorySpanExporter()
    p_inl = TracerProvider()
    p_inl.add_span_processor(SimpleSpanProcessor(exp_inl))

    async def run():
        tracing.configure(p_srv)  # the server's sessions (every driver of this process without its own provider)
        try:
            async with _server(ScriptedEngine(units_per_turn=3, random_weights=True)) as url:
                async with DuplexClient(url, session=SESSION, player=VirtualPlayer(block_ms=20), input_rate=16_000,
                                        request_timeout_s=bound(30)) as c:
                    s1 = await _talk(c)
                await asyncio.sleep(0.5)  # the server notices the close and ends its driver
        finally:
            tracing.configure(None)
        async with InlineDuplexClient(ScriptedEngine(units_per_turn=3, random_weights=True), session=SESSION,
                                      player=VirtualPlayer(block_ms=20), request_timeout_s=bound(30),
                                      tracer_provider=p_inl) as c:
            s2 = await _talk(c)
        return s1, s2

    assert asyncio.run(run()) == ("completed", "completed")
    for _ in range(100):
        if any(s.name == "parity" for s in exp_srv.get_finished_spans()):
            break
        asyncio.run(asyncio.sleep(0.1))
    srv, inl = exp_srv.get_finished_spans(), exp_inl.get_finished_spans()
    e_srv, k_srv, u_srv = _shape(srv)
    e_inl, k_inl, u_inl = _shape(inl)
    assert e_srv == e_inl and e_srv[("duplexkit.response", "duplexkit.turn")] == 1
    assert k_srv == k_inl
    assert u_srv == u_inl == ["speak"] * 3
