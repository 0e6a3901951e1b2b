"""duplexkit.protocol.vocabulary: the one home of the wire's names and numbers.

* every server event type the server can emit is classified: a GA OpenAI Realtime event, a beta
  mirror of one (the one GA <-> beta table), or a duplexkit extension, and nothing is two of these;
* every extension event is advertised where the server advertises extensions
  (``session.capabilities.extension_events`` of ``session.created``), ``session.warning`` included;
* the copies that used to exist now read the vocabulary.
"""

from __future__ import annotations

import ast
import json
import typing
from pathlib import Path

import pytest

from duplexkit.protocol import (BETA_EVENT_ALIASES, CLIENT_EVENT_ALIASES, CLIENT_EVENT_MODELS, SERVER_EVENT_MODELS,
                                parse_server_event)
from duplexkit.protocol import vocabulary as v

ROOT = Path(__file__).resolve().parents[2]


def _openai_ga_server_event_types() -> set[str]:
    """The ``type`` of every member of ``openai.types.realtime.RealtimeServerEvent`` (the GA API)."""
    rt = pytest.importorskip("openai.types.realtime")
    union = typing.get_args(rt.RealtimeServerEvent)[0]
    out = set()
    for model in typing.get_args(union):
        out.update(typing.get_args(model.model_fields["type"].annotation))
    assert len(out) > 30
    return out


def _dict_event_types(paths) -> set[str]:
    """``type`` values of dict literals ``{"type": "a.b", ...}`` in ``paths`` that are server events:
    client events (which the server builds for its own transports), their aliases and ASGI messages
    are left out."""
    out = set()
    for path in paths:
        for n in ast.walk(ast.parse(path.read_text())):
            if not isinstance(n, ast.Dict):
                continue
            for k, val in zip(n.keys, n.values):
                if (isinstance(k, ast.Constant) and k.value == "type" and isinstance(val, ast.Constant)
                        and isinstance(val.value, str) and "." in val.value):
                    t = val.value
                    if t in CLIENT_EVENT_MODELS or t in CLIENT_EVENT_ALIASES or t.startswith(("http.", "websocket.")):
                        continue
                    out.add(t)
    return out


def _emitted_types() -> set[str]:
    """Every server event type the server can send: the models the Session serialises, the events the
    server's transports build themselves, and what the ``beta`` / ``both`` dialects make of them."""
    from duplexkit_server.dialect import translate

    ga = set(SERVER_EVENT_MODELS)
    ga |= _dict_event_types(sorted((ROOT / "server").glob("*.py")) + sorted((ROOT / "duplexkit" / "session").glob("*.py"))
                            + [ROOT / "duplexkit" / "driver.py"])
    out = set(ga)
    for t in ga:
        for dialect in ("beta", "both"):
            out |= {e["type"] for e in translate({"type": t, "event_id": "e"}, dialect)}
    return out


def classify(t: str, ga_types: set[str]) -> str:
    """``extension``, ``beta mirror`` (a name of the GA <-> beta table's beta side; OpenAI's GA types
    still list ``conversation.item.created``, which duplexkit sends only as the beta rename) or
    ``ga``; ``unclassified`` otherwise."""
    if t in v.EXTENSION_EVENT_TYPES:
        return "extension"
    if t in v.BETA_TO_GA_EVENTS:
        return "beta mirror" if v.BETA_TO_GA_EVENTS[t] in ga_types else "unclassified"
    return "ga" if t in ga_types else "unclassified"


def test_the_classes_do_not_overlap():
    ga = _openai_ga_server_event_types()
    assert not v.EXTENSION_EVENT_TYPES & ga
    assert not v.EXTENSION_EVENT_TYPES & (set(v.BETA_TO_GA_EVENTS) | set(v.GA_TO_BETA_EVENTS))
    assert set(v.GA_TO_BETA_EVENTS) <= ga


def test_every_emitted_event_type_is_classified():
    ga = _openai_ga_server_event_types()
    emitted = _emitted_types()
    assert {"session.warning", "output_audio_buffer.started", "response.audio.delta", "session.resumed"} <= emitted
    assert {t: classify(t, ga) for t in sorted(emitted) if classify(t, ga) == "unclassified"} == {}


def test_classification_rejects_an_unregistered_event():
    ga = _openai_ga_server_event_types()
    assert classify("session.invented", ga) == "unclassified"
    assert classify("response.output_audio.delta", ga) == "ga"
    assert classify("response.audio.delta", ga) == "beta mirror"
    assert classify("session.warning", ga) == "extension"


def test_every_extension_event_has_a_model():
    assert v.EXTENSION_EVENT_TYPES <= set(SERVER_EVENT_MODELS)


def _created(**cfg) -> dict:
    from duplexkit.session import Session, SessionConfig

    s = Session(SessionConfig(**cfg), now_ms=0)
    s.start(0)
    return next(e for e in s.drain() if isinstance(e, dict) and e.get("type") == "session.created")


def test_every_extension_event_is_advertised_by_the_session():
    caps = _created(profile="duplex", supports_session_resume=True)["session"]["capabilities"]
    assert sorted(caps["extension_events"]) == sorted(v.EXTENSION_EVENT_TYPES)
    assert "session.warning" in caps["extension_events"]
    no_resume = _created(profile="duplex", supports_session_resume=False)["session"]["capabilities"]
    assert set(no_resume["extension_events"]) == v.EXTENSION_EVENT_TYPES - {"session.resumed"}
    assert set(no_resume["extension_events"]) == set(v.ALWAYS_ADVERTISED_EXTENSION_EVENTS)
    compat = _created(profile="compat")["session"].get("capabilities") or {}
    assert not compat.get("extension_events")


def test_the_server_advertises_every_extension_event():
    """``session.created`` of a duplex WebSocket session of the bundled server (resume on, the default)."""
    from fastapi.testclient import TestClient

    from duplexkit.testing import ScriptedEngine
    from duplexkit_server import ServerSettings, create_app

    app = create_app(ScriptedEngine(), ServerSettings())
    with TestClient(app, base_url="http://127.0.0.1") as c, c.websocket_connect("ws://127.0.0.1/v1/duplex") as ws:
        created = json.loads(ws.receive_text())
    assert created["type"] == "session.created"
    assert sorted(created["session"]["capabilities"]["extension_events"]) == sorted(v.EXTENSION_EVENT_TYPES)


def test_one_ga_beta_table_both_directions():
    assert dict(v.BETA_TO_GA_EVENTS) == {b: g for g, b in v.GA_TO_BETA_EVENTS.items()}
    assert len(v.BETA_TO_GA_EVENTS) == len(v.GA_TO_BETA_EVENTS)  # a bijection
    assert BETA_EVENT_ALIASES is v.BETA_TO_GA_EVENTS  # what the client parser reads
    from duplexkit_server.dialect import GA_TO_BETA, translate

    assert GA_TO_BETA.items() <= v.GA_TO_BETA_EVENTS.items() and set(GA_TO_BETA) == v.BETA_MIRRORED_EVENTS
    for ga, beta in v.GA_TO_BETA_EVENTS.items():
        assert translate({"type": ga, "event_id": "e"}, "beta")[0]["type"] == beta
        back = parse_server_event({"type": beta, "event_id": "e"})
        assert back.raw_type == beta and (back.type == ga or back.type == beta)  # unknown body -> raw kept


def test_format_types_and_rates():
    assert set(v.ENCODINGS) == {"pcm16", "pcm_f32le", "g711_ulaw", "g711_alaw"}
    for t, enc in v.FORMAT_TYPE_ENCODINGS.items():
        assert v.FORMAT_TYPE_ENCODINGS[v.ENCODING_FORMAT_TYPES[enc]] in (enc, "pcm16")
    assert v.default_rate("g711_alaw") == v.G711_RATE == 8000 and v.default_rate("pcm16") == v.PCM_RATE == 24000
    from duplexkit_server.webrtc import input_format

    assert input_format({"audio": {"input": {"format": {"type": "audio/pcmu"}}}}) == ("g711_ulaw", 8000)
    assert input_format({"audio": {"input": {"format": {"type": "audio/pcm"}}}}) == ("pcm16", 24000)


def test_the_wire_output_rate_is_the_model_output_rate():
    """Two facts that must agree: OpenAI's ``audio/pcm`` rate (the wire) and MiniCPM-o's HiFT rate."""
    from duplexkit.engine.api import CODES_PER_CHUNK, OUTPUT_SAMPLE_RATE, SAMPLES_PER_CODE

    assert OUTPUT_SAMPLE_RATE == v.PCM_RATE == CODES_PER_CHUNK * SAMPLES_PER_CODE


def test_close_codes_and_reasons():
    from duplexkit.clients.base import CLOSE_CODES

    assert CLOSE_CODES is v.CLOSE_CODE_OF_REASON
    assert set(v.CLOSE_REASONS) == set(v.CLOSE_CODE_OF_REASON)
    assert v.CLOSE_CODE_OF_REASON["shutdown"] == v.CloseCode.GOING_AWAY == 1001
    assert v.CLOSE_CODE_OF_REASON["server_error"] == 1011
    assert all(type(c) is int for c in v.CLOSE_CODE_OF_REASON.values())  # plain ints for the transports
