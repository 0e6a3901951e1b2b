"""docs/protocol.md §7.2: if the VAD cannot load, the default turn detection becomes null and an
explicit ``server_vad`` gets ``unsupported_turn_detection`` (the session stays usable)."""

from __future__ import annotations

import sys

from duplexkit.session import Session, SessionConfig


def _events(s: Session) -> list[dict]:
    return [o for o in s.drain() if isinstance(o, dict)]


def test_missing_webrtcvad_makes_turn_detection_null(monkeypatch):
    monkeypatch.setitem(sys.modules, "webrtcvad", None)  # import webrtcvad -> ImportError
    s = Session(SessionConfig(profile="duplex"))
    s.start(0)
    created = _events(s)[0]
    assert created["type"] == "session.created"
    assert created["session"]["audio"]["input"]["turn_detection"] is None
    s.receive_client_event({"type": "session.update", "event_id": "e1",
                            "session": {"turn_detection": {"type": "server_vad"}}}, 10)
    err = _events(s)[-1]
    assert err["type"] == "error" and err["error"]["code"] == "unsupported_turn_detection"
    assert err["error"]["event_id"] == "e1"
    s.receive_client_event({"type": "session.heartbeat"}, 20)
    assert _events(s)[-1]["type"] == "session.heartbeat_ack"


def test_vad_available_flag_off_behaves_the_same():
    s = Session(SessionConfig(profile="compat", vad_available=False))
    s.start(0)
    assert _events(s)[0]["session"]["audio"]["input"]["turn_detection"] is None


def test_extra_body_seed_reaches_the_engine_and_is_echoed():
    from duplexkit.engine.api import OpenStream, UpdateStream

    s = Session(SessionConfig(profile="duplex", seed=7))
    s.start(0)
    out = s.drain()
    opened = [o for o in out if isinstance(o, OpenStream)][0]
    assert opened.config.seed == 7
    s.receive_client_event({"type": "session.update", "session": {"extra_body": {"seed": 42}}}, 5)
    out = s.drain()
    upd = [o for o in out if isinstance(o, UpdateStream)]
    ev = [o for o in out if isinstance(o, dict)][-1]
    assert ev["type"] == "session.updated" and ev["session"]["extra_body"]["seed"] == 42
    assert upd and upd[-1].config.seed == 42
    s.receive_client_event({"type": "session.update", "event_id": "bad",
                            "session": {"extra_body": {"seed": -1}}}, 6)
    err = [o for o in s.drain() if isinstance(o, dict)][-1]
    assert err["error"]["code"] == "bad_event" and err["error"]["event_id"] == "bad"


def test_without_a_vocoder_sessions_are_text_only():
    """A checkpoint without assets/token2wav: sessions default to text and asking for audio is a
    bad_event saying why; the session lives on."""
    s = Session(SessionConfig(profile="duplex", audio_output_available=False))
    s.start(0)
    created = _events(s)[0]
    assert created["session"]["output_modalities"] == ["text"]
    s.receive_client_event({"type": "session.update", "event_id": "u1",
                            "session": {"output_modalities": ["audio", "text"]}}, 5)
    err = _events(s)[-1]
    assert err["error"]["code"] == "bad_event" and "assets/token2wav" in err["error"]["message"]
    assert err["error"]["event_id"] == "u1"
    s.receive_client_event({"type": "response.create", "event_id": "r1",
                            "response": {"output_modalities": ["audio"]}}, 6)
    err = _events(s)[-1]
    assert err["error"]["code"] == "bad_event" and err["error"]["event_id"] == "r1"
    s.receive_client_event({"type": "response.create", "event_id": "r2"}, 7)
    ev = _events(s)
    assert ev[0]["type"] == "response.created" and ev[0]["response"]["output_modalities"] == ["text"]
