"""Bounded fuzz of the server's WebSocket and HTTP surfaces.

Against one real ``duplexkit serve scripted`` process: random and hypothesis-generated frames and
chat bodies — junk JSON, deep nesting, wrong types, real event types with mutated fields, binary
frames, huge numbers, odd Unicode. Over more than 20,000 events: no 5xx, no ``server_error``, no
closed session, no traceback in the server log; every frame that is answered with an error gets a
§9 code, every HTTP 4xx has an OpenAI error body. Sizes are counted, not timed (CI-friendly: about
half a minute on a quiet machine)."""

from __future__ import annotations

import base64
import json
import random

import httpx
import pytest
from _serverproc import ServerProc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.sync.client import connect

from duplexkit.errors import OPENAI_ERROR_CODES, OPENAI_ERROR_CODES_BY_EVENT, ErrorCode
from _timing import bound

pytestmark = pytest.mark.e2e

#: every code the server may send: duplexkit's, and OpenAI's names for them (the compat profile, which
#: this test's /v1/realtime connection gets: docs/protocol.md §9)
CODES = {c.value for c in ErrorCode} | set(OPENAI_ERROR_CODES.values()) | set(OPENAI_ERROR_CODES_BY_EVENT.values())
EVENT_TYPES = ["session.update", "input_audio_buffer.append", "input_audio_buffer.commit", "input_audio_buffer.clear",
               "response.create", "response.cancel", "conversation.item.create", "conversation.item.delete",
               "conversation.item.retrieve", "conversation.item.truncate", "playback.ack", "session.heartbeat",
               "response.speak", "response.listen", "transcription_session.update", "nope"]
N_RANDOM_FRAMES = 12_000
N_HYPOTHESIS_FRAMES = 3_000
N_HTTP = 2_500

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70) | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=12), kids, max_size=4),
    max_leaves=12)


@pytest.fixture(scope="module")
def srv():
    with ServerProc("scripted", "--answer-policy", "on_request", "--max-sessions", "4",
                    "--max-sessions-per-client", "0", "--max-event-bytes", "200000") as s:
        yield s
        log = s.output()
    assert "Traceback" not in log and " ERROR " not in log


def _mutate(rng: random.Random) -> "str | bytes":
    """One hostile frame."""
    kind = rng.random()
    if kind < 0.05:
        return bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64)))  # binary frame
    if kind < 0.10:
        return "[" * rng.randint(1, 50_000) + "]" * rng.randint(0, 50_000)
    if kind < 0.15:
        return "".join(chr(rng.randint(0, 0x2FFF)) for _ in range(rng.randint(0, 40)))
    ev: dict = {"type": rng.choice(EVENT_TYPES)}
    if rng.random() < 0.5:
        ev["event_id"] = rng.choice(["e1", "", "x" * 600, 5, None])
    fields = {"session": [{}, {"modalities": [[1], {}]}, {"turn_detection": {"type": "semantic_vad"}},
                          {"input_audio_format": "pcm99"}, {"instructions": "x" * 20_000}, {"temperature": 1e309},
                          {"ref_audio": "data:audio/wav;base64,AAAA"}, {"ref_audio": "file:///etc/passwd"},
                          {"voice": ["a"]}, None, "str"],
              "audio": ["", "%%%", base64.b64encode(b"\x00\x01" * rng.randint(1, 800)).decode(), 5, None],
              "item": [{}, {"type": "message", "role": "assistant", "content": []},
                       {"type": "message", "role": "user", "content": [{"type": "input_audio", "audio": "AAAA"}]},
                       {"type": "message", "role": "user", "content": [{"type": "input_text", "text": 3}]}],
              "item_id": ["item_x", "", 7, None], "response_id": ["resp_x", None, []],
              "played_ms": [-1, 10**20, "5", 1.5, 0], "content_index": [0, 1, -5], "audio_end_ms": [0, -1, "a"],
              "response": [{}, {"modalities": ["video"]}, {"max_output_tokens": 0}, {"conversation": "none"}, 7]}
    for _ in range(rng.randint(0, 3)):
        k = rng.choice(list(fields))
        ev[k] = rng.choice(fields[k])
    return json.dumps(ev)


def _check_event(ev: dict, seen: list) -> None:
    if ev.get("type") == "error":
        code = ev["error"]["code"]
        assert code != "server_error", ev
        assert code in CODES, ev
    seen.append(ev.get("type"))


def test_random_websocket_frames(srv):
    rng = random.Random(13)
    seen: list = []
    with connect(srv.ws_url + "/v1/realtime", max_size=None, open_timeout=bound(30)) as ws:
        for i in range(N_RANDOM_FRAMES):
            ws.send(_mutate(rng))
            if i % 200 == 199:  # pipelined: a heartbeat every 200 frames proves the session is alive
                ws.send(json.dumps({"type": "session.heartbeat", "event_id": f"hb{i}"}))
                while True:
                    ev = json.loads(ws.recv(timeout=bound(120)))
                    _check_event(ev, seen)
                    if ev["type"] == "session.heartbeat_ack":
                        break
    assert seen.count("error") > N_RANDOM_FRAMES // 20 and seen.count("session.heartbeat_ack") == N_RANDOM_FRAMES // 200


def test_hypothesis_websocket_frames(srv):
    seen: list = []
    ws = connect(srv.ws_url + "/v1/realtime?autostart=0", max_size=None, open_timeout=bound(30))
    count = [0]

    @settings(max_examples=N_HYPOTHESIS_FRAMES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.one_of(json_values.map(json.dumps),
                     st.builds(lambda t, extra: json.dumps({"type": t, **extra}), st.sampled_from(EVENT_TYPES),
                               st.dictionaries(st.sampled_from(["session", "audio", "item", "response", "event_id",
                                                                "played_ms", "item_id"]), json_values, max_size=3))))
    def one(frame: str) -> None:
        count[0] += 1
        ws.send(frame)
        ws.send(json.dumps({"type": "session.heartbeat", "event_id": "hb"}))
        while True:
            ev = json.loads(ws.recv(timeout=bound(120)))
            _check_event(ev, seen)
            if ev["type"] == "session.heartbeat_ack":
                return

    try:
        one()
    finally:
        ws.close()
    assert count[0] >= N_HYPOTHESIS_FRAMES * 0.9 and "session.created" in seen


def test_hypothesis_chat_bodies(srv):
    client = httpx.Client(base_url=srv.url, timeout=bound(60))
    statuses: dict = {}

    part = st.one_of(json_values, st.fixed_dictionaries({"type": st.sampled_from(
        ["text", "input_audio", "audio_url", "image_url", "video_url"])}, optional={
        "text": json_values, "input_audio": json_values, "audio_url": json_values | st.text(max_size=30),
        "image_url": json_values | st.text(max_size=30)}))
    message = st.fixed_dictionaries({}, optional={"role": st.sampled_from(["user", "system", "assistant", "tool"])
                                                  | json_values, "content": st.text(max_size=10)
                                                  | st.lists(part, max_size=3) | json_values})
    body = st.fixed_dictionaries({}, optional={
        "messages": st.lists(message, max_size=3) | json_values, "model": json_values,
        "modalities": json_values | st.lists(st.sampled_from(["text", "audio", "x"]) | json_values, max_size=3),
        "audio": json_values, "max_tokens": json_values, "temperature": json_values, "seed": json_values,
        "n": json_values, "stream": st.just(False) | json_values, "stream_options": json_values,
        "chat_template_kwargs": json_values, "tools": json_values})

    @settings(max_examples=N_HTTP, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(body)
    def one(b) -> None:
        r = client.post("/v1/chat/completions", content=json.dumps(b).encode(),
                        headers={"Content-Type": "application/json"})
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert r.status_code < 500, (b, r.text)
        if r.status_code >= 400:
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and isinstance(err["message"], str), (b, r.text)

    try:
        one()
    finally:
        client.close()
    assert statuses.get(400, 0) > N_HTTP // 2, statuses
