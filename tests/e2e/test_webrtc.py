"""WebRTC calls (``POST /v1/realtime/calls``, server/webrtc.py, docs/webrtc.md), real peers.

An aiortc client (examples/webrtc_client.py) plays a browser: an Opus microphone track fed with
the speech fixtures in real time, the ``oai-events`` data channel, the answer from the remote track.
Against ``duplexkit serve scripted`` (a subprocess, one session slot):

* a spoken question is answered on the track with the scripted engine's 440 Hz tone; the data
  channel carries the realtime events (``session.created`` first, the response envelope, the
  WebRTC-only ``output_audio_buffer.started`` / ``.stopped``) with ``server_event_seq`` 1, 2, 3, ...
  and no ``response.output_audio.delta``; talking over the second answer cuts the track's audio at
  once (``output_audio_buffer.cleared``, the response ``cancelled``), and the call's end frees the
  slot (``/health`` ``sessions_open`` back to 0);
* OpenAI's multipart form (``sdp`` + ``session``) sets the session, a second call while the slot
  is held gets 503, ``/hangup`` ends the call;
* a bad offer is a 400 in the server's error shape; no key or a wrong key is a 401.

Sans-I/O parts (Capture, Playout, parse_offer) are checked without a peer at the end.
"""

from __future__ import annotations

import asyncio
import base64
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

pytest.importorskip("aiortc")

from duplexkit.audio import read_wav  # noqa: E402
from duplexkit.audio.codecs import float32_to_pcm16, pcm16_to_float32  # noqa: E402
from _serverproc import REPO, ServerProc  # noqa: E402
from _timing import bound  # noqa: E402

sys.path.insert(0, str(REPO / "examples"))
from webrtc_client import RTC_RATE, CallRefused, RtcCall  # noqa: E402

from duplexkit_server.webrtc import BadOffer, Capture, Playout, input_format, parse_offer  # noqa: E402

pytestmark = pytest.mark.e2e

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "audio"
KEY = "rtc-test-key"
UNITS_PER_TURN = 6  # 6 s answers: long enough to talk over
LOUD = 0.02  # rms of a received 20 ms frame that counts as sound (the tone is 0.2 peak: rms 0.14)


@pytest.fixture(scope="module")
def server():
    with ServerProc("scripted", "--api-key", KEY, "--max-sessions", "1", "--scripted",
                    f"units_per_turn={UNITS_PER_TURN}") as srv:
        yield srv


def health(srv) -> dict:
    return httpx.get(srv.url + "/health", timeout=bound(10)).json()


def wait_closed(srv, what: str) -> dict:
    """Wait for ``sessions_open`` and ``sessions_active`` to be 0."""
    deadline = time.monotonic() + bound(30)
    h = health(srv)
    while h["sessions_open"] or h["sessions_active"]:
        assert time.monotonic() < deadline, f"{what}: /health {h}\n{srv.output()[-3000:]}"
        time.sleep(0.1)
        h = health(srv)
    return h


def peak_hz(x: np.ndarray, rate: int) -> float:
    spec = np.abs(np.fft.rfft(x * np.hanning(x.size)))
    return float(np.argmax(spec) * rate / x.size)


def test_call_answers_on_the_track_events_on_the_channel_barge_in_and_end(server):
    q, _ = read_wav(FIX / "question_16k.wav", 16_000)
    interrupt, _ = read_wav(FIX / "interrupt_16k.wav", 16_000)

    async def go():
        call = await RtcCall(server.url, key=KEY).connect(timeout=bound(30))
        try:
            assert call.call_id and call.call_id.startswith("rtc_")
            h = health(server)
            assert h["sessions_open"] == 1 and h["sessions_active"] == 1, h
            # 1. a question -> the answer plays on the remote track
            t_q1 = time.monotonic()
            await call.say(q, 16_000)
            _, started = await call.wait_for(lambda c: c.event("output_audio_buffer.started"), bound(30),
                                             "output_audio_buffer.started")
            rid1 = started["response_id"]
            await call.wait_for(lambda c: c.event("output_audio_buffer.stopped", response_id=rid1), bound(30),
                                "the first answer played out")
            t_first = call.first_sound(t_q1, LOUD)
            assert t_first is not None, call.frames[-50:]
            heard = np.concatenate(call.audio)
            loud = [a for a in call.audio if a.size and np.sqrt(np.mean(a * a)) > LOUD]
            tone = np.concatenate(loud)
            assert tone.size >= int(0.8 * UNITS_PER_TURN * RTC_RATE), (tone.size, heard.size)  # ~6 s of it
            assert abs(peak_hz(tone[: RTC_RATE], RTC_RATE) - 440) < 10
            # 2. talk over the next answer: its track audio stops at once
            t_q2 = time.monotonic()
            call.say(q, 16_000)
            _, st2 = await call.wait_for(lambda c: c.event("output_audio_buffer.started", t_q2), bound(30),
                                         "the second answer")
            rid2 = st2["response_id"]
            await asyncio.sleep(1.5)  # some of it is heard
            call.say(interrupt, 16_000)
            t_clear, _ = await call.wait_for(lambda c: c.event("output_audio_buffer.cleared", response_id=rid2),
                                             bound(30), "output_audio_buffer.cleared")
            _, done2 = await call.wait_for(
                lambda c: next((x for x in c.events if x[1]["type"] == "response.done"
                                and x[1]["response"]["id"] == rid2), None), bound(30), "response.done of the 2nd")
            assert done2["response"]["status"] == "cancelled", done2
            # the track goes quiet at once: after the clear only what was already in flight or in the
            # client's jitter buffer (4 frames) is heard, counted in frames (not in time: a loaded
            # machine may deliver frames late, but not more of them)
            await asyncio.sleep(1.0)  # the user is still speaking: no next answer yet
            nxt = call.event("output_audio_buffer.started", t_clear)
            t_next = nxt[0] if nxt else float("inf")
            late = [round(t - t_clear, 3) for t, r in call.frames if t_clear < t < min(t_next, t_clear + 1.0) and r > LOUD]
            assert len(late) <= 10, late  # 200 ms at most
            played2 = sum(1 for t, r in call.frames if t > t_q2 and t < t_clear and r > LOUD) * 20
            assert 500 < played2 < (UNITS_PER_TURN - 2) * 1000, played2
            # 3. the channel carries the realtime events, renumbered, without audio deltas
            types = call.types()
            assert types[0] == "session.created", types[:5]
            assert "response.output_audio.delta" not in types
            for t in ("response.created", "response.output_audio_transcript.delta", "response.done",
                      "input_audio_buffer.speech_started", "input_audio_buffer.committed"):
                assert t in types, (t, types)
            seqs = [e["server_event_seq"] for _, e in call.events]
            assert seqs == list(range(1, len(seqs) + 1))
            assert all(e["event_id"].startswith("event_") for _, e in call.events)
            # a client event on the channel is answered there
            call.send({"type": "session.heartbeat", "event_id": "hb1"})
            await call.wait_for(lambda c: c.event("session.heartbeat_ack"), bound(10), "heartbeat_ack")
        finally:
            await call.close()
        # 4. the peer left: the session is closed and the slot free
        wait_closed(server, "after the call")

    asyncio.run(go())
    out = server.output()
    assert "webrtc call" in out and "barge-in: track audio cleared" in out, out[-3000:]


def test_form_with_session_capacity_and_hangup(server):
    wait_closed(server, "before")

    async def go():
        call = await RtcCall(server.url, key=KEY, session={"type": "realtime", "instructions": "Be brief."}
                             ).connect(timeout=bound(30))
        try:
            _, created = await call.wait_for(lambda c: c.event("session.created"), bound(10), "session.created")
            assert created["session"]["instructions"] == "Be brief."
            assert created["server_event_seq"] == 1
            # one slot: a second call is refused like a realtime session
            with pytest.raises(CallRefused) as ei:
                await RtcCall(server.url, key=KEY).connect(timeout=bound(30))
            assert ei.value.status == 503 and "session_capacity_exhausted" in ei.value.body
            async with httpx.AsyncClient(timeout=bound(30)) as http:
                r = await http.post(f"{server.url}/v1/realtime/calls/{call.call_id}/hangup",
                                    headers={"Authorization": f"Bearer {KEY}"})
                assert r.status_code == 200, r.text
                await call.wait_for(lambda c: c.event("session.closed"), bound(10), "session.closed")
                r = await http.post(f"{server.url}/v1/realtime/calls/{call.call_id}/hangup",
                                    headers={"Authorization": f"Bearer {KEY}"})
                assert r.status_code == 404 and r.json()["error"]["code"] == "call_not_found"
        finally:
            await call.close()
        wait_closed(server, "after the hangup")

    asyncio.run(go())


def test_client_output_audio_buffer_clear_empties_the_track(server):
    """OpenAI's WebRTC-only client event: ``output_audio_buffer.clear`` cancels the response and the
    track goes quiet at once (one ``output_audio_buffer.cleared``, from the session)."""
    wait_closed(server, "before")

    async def go():
        call = await RtcCall(server.url, key=KEY).connect(timeout=bound(30))
        try:
            await call.wait_for(lambda c: c.event("session.created"), bound(10), "session.created")
            call.send({"type": "response.create"})
            _, st = await call.wait_for(lambda c: c.event("output_audio_buffer.started"), bound(30), "the answer")
            await call.wait_for(lambda c: c.first_sound(0, LOUD), bound(10), "answer audio")
            await asyncio.sleep(0.5)
            call.send({"type": "output_audio_buffer.clear"})
            t_clear, ev = await call.wait_for(lambda c: c.event("output_audio_buffer.cleared"), bound(10), "cleared")
            assert ev["response_id"] == st["response_id"]
            _, done = await call.wait_for(lambda c: c.event("response.done"), bound(10), "response.done")
            assert done["response"]["status"] == "cancelled"
            await asyncio.sleep(1.0)
            late = [t for t, r in call.frames if t > t_clear and r > LOUD]
            assert len(late) <= 10, late
            assert call.types().count("output_audio_buffer.cleared") == 1
        finally:
            await call.close()
        wait_closed(server, "after the call")

    asyncio.run(go())


def test_the_openai_sdk_creates_a_call(server):
    """``OpenAI().realtime.calls.create(sdp=..., session=...)`` (the unmodified SDK: its multipart
    form) gets the SDP answer; the peer connection comes up and ``session.created`` shows the session."""
    openai = pytest.importorskip("openai")
    if not hasattr(openai.OpenAI(api_key="x").realtime, "calls"):
        pytest.skip("this openai version has no realtime.calls")
    from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
    from aiortc.mediastreams import AudioStreamTrack

    wait_closed(server, "before")

    async def go():
        pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        pc.addTrack(AudioStreamTrack())  # a silent microphone
        ch = pc.createDataChannel("oai-events")
        got: asyncio.Queue = asyncio.Queue()
        ch.on("message", lambda m: got.put_nowait(__import__("json").loads(m)))
        try:
            await pc.setLocalDescription(await pc.createOffer())
            client = openai.OpenAI(api_key=KEY, base_url=server.url + "/v1")
            answer = await asyncio.to_thread(client.realtime.calls.create, sdp=pc.localDescription.sdp,
                                             session={"type": "realtime", "model": "gpt-realtime",
                                                      "instructions": "Answer in one sentence."})
            assert answer.text.startswith("v=0")
            await pc.setRemoteDescription(RTCSessionDescription(sdp=answer.text, type="answer"))
            ev = await asyncio.wait_for(got.get(), bound(30))
            assert ev["type"] == "session.created" and ev["session"]["instructions"] == "Answer in one sentence."
        finally:
            await pc.close()
        wait_closed(server, "after the SDK's call")

    asyncio.run(go())


def test_latency_benchmark_runs_a_round_on_both_transports(server, tmp_path):
    """benchmarks/webrtc_latency.py against this server: one round each, its table and JSON."""
    import json
    import subprocess

    wait_closed(server, "before")
    out = tmp_path / "lat.json"
    r = subprocess.run([sys.executable, "benchmarks/webrtc_latency.py", "--url", server.url, "--key", KEY,
                        "--rounds", "1", "--out", str(out)], cwd=str(REPO), capture_output=True, text=True,
                       timeout=bound(180))
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    assert "webrtc adds" in r.stdout
    res = json.loads(out.read_text())
    assert len(res["websocket"]) == 1 and len(res["webrtc"]) == 1
    assert all(0 < v[0] < 10_000 for v in res.values()), res
    wait_closed(server, "after the benchmark")


@pytest.mark.parametrize("body, ctype, param", [
    (b"hello", "application/sdp", "sdp"),
    (b"v=0\r\no=- 1 1 IN IP4 0.0.0.0\r\ns=-\r\nt=0 0\r\nm=application 9 UDP/DTLS/SCTP webrtc-datachannel\r\n",
     "application/sdp", "sdp"),
    (b"v=0\r\nm=audio 9 UDP/TLS/RTP/SAVPF 111\r\na=rtpmap:111 opus/48000/2\r\n", "application/sdp", "sdp"),
    (b'{"sdp": 3}', "application/json", "sdp"),
])
def test_bad_offer_is_a_400_in_the_error_shape(server, body, ctype, param):
    r = httpx.post(server.url + "/v1/realtime/calls", content=body,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": ctype}, timeout=bound(30))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "bad_request" and err["param"] == param
    assert err["message"]
    h = wait_closed(server, "after a refused offer")
    assert h["sessions_active"] == 0


def test_bad_session_field_is_a_400(server):
    r = httpx.post(server.url + "/v1/realtime/calls", files={"sdp": (None, "v=0\r\nm=audio 9 x 0\r\n"),
                                                             "session": (None, "[1, 2]")},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=bound(30))
    assert r.status_code == 400 and r.json()["error"]["param"] == "session", r.text


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}])
def test_no_or_wrong_key_is_a_401(server, headers):
    r = httpx.post(server.url + "/v1/realtime/calls", content=b"v=0\r\n",
                   headers={**headers, "Content-Type": "application/sdp"}, timeout=bound(30))
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "unauthorized"


# ------------------------------------------------------------------------------- sans-I/O parts
def test_capture_resamples_48k_to_the_session_rate_in_100ms_appends():
    cap = Capture("pcm16", 16_000)
    t = np.arange(RTC_RATE) / RTC_RATE
    x = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    evs = []
    for i in range(0, x.size, 960):
        evs += cap.frame(x[i:i + 960], RTC_RATE)
    assert all(e["type"] == "input_audio_buffer.append" for e in evs)
    pcm = b"".join(base64.b64decode(e["audio"]) for e in evs)
    assert all(len(base64.b64decode(e["audio"])) == 3200 for e in evs)  # 100 ms of 16 kHz pcm16
    y = pcm16_to_float32(pcm)
    assert len(evs) >= 9 and abs(peak_hz(y, 16_000) - 440) < 12
    assert input_format({"audio": {"input": {"format": {"type": "audio/pcmu"}}}}) == ("g711_ulaw", 8000)
    assert input_format({"audio": {"input": {"format": {"type": "audio/pcm", "sample_rate_hz": 16000}}}}) == ("pcm16", 16000)


def test_playout_paces_acks_and_clears():
    p = Playout(ack_every_ms=200)
    tone = float32_to_pcm16((0.2 * np.sin(2 * np.pi * 440 * np.arange(24_000) / 24_000)).astype(np.float32))
    p.audio("resp_1", "item_1", tone)  # 1 s at 24 kHz
    p.audio_done("resp_1")
    frames, acks, server = [], [], []
    for _ in range(60):
        pcm, c, s = p.take()
        frames.append(pcm)
        acks += c
        server += s
    assert [e["type"] for e in server] == ["output_audio_buffer.started", "output_audio_buffer.stopped"]
    assert acks[-1]["played_ms"] == 1000 and all(a["item_id"] == "item_1" for a in acks)
    assert [a["played_ms"] for a in acks] == [200, 400, 600, 800, 1000]
    assert sum(int(np.any(f)) for f in frames) == 50  # 1 s = 50 frames of 20 ms, then silence
    # barge-in: queued audio is dropped at once and the item is finalised at what was played
    p.audio("resp_2", "item_2", tone)
    for _ in range(10):
        p.take()
    client, server = p.clear()
    assert client == [{"type": "playback.ack", "response_id": "resp_2", "played_ms": 200, "item_id": "item_2",
                       "truncate": True}]
    assert server == [{"type": "output_audio_buffer.cleared", "response_id": "resp_2"}]
    assert not np.any(p.take()[0]) and p.queued_ms() == 0
    p.audio("resp_2", "item_2", tone)  # late deltas of a cleared response are dropped
    assert p.queued_ms() == 0 and p.clear() == ([], [])


def test_parse_offer_shapes():
    sdp = "v=0\r\nm=audio 9 UDP/TLS/RTP/SAVPF 111\r\n"
    assert parse_offer("application/sdp", sdp.encode()) == (sdp, None)
    boundary = "XyZ"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"sdp\"\r\n\r\n{sdp}\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"session\"\r\n\r\n"
            "{\"instructions\": \"hi\"}\r\n--" + boundary + "--\r\n").encode()
    got_sdp, session = parse_offer(f"multipart/form-data; boundary={boundary}", body)
    assert got_sdp.startswith("v=0") and "m=audio" in got_sdp and session == {"instructions": "hi"}
    with pytest.raises(BadOffer):
        parse_offer("multipart/form-data; boundary=x", b"--x\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\n1\r\n--x--")
    with pytest.raises(BadOffer):
        parse_offer("application/sdp", b"\xff\xfe")


def test_shutdown_sends_session_closed_on_the_channel_and_ends_the_call():
    import signal

    with ServerProc("scripted") as srv:
        async def go():
            call = await RtcCall(srv.url).connect(timeout=bound(30))
            try:
                await call.wait_for(lambda c: c.event("session.created"), bound(10), "session.created")
                srv.proc.send_signal(signal.SIGINT)
                _, closed = await call.wait_for(lambda c: c.event("session.closed"), bound(30), "session.closed")
                assert closed["reason"] == "shutdown"
            finally:
                await call.close()

        asyncio.run(go())
        assert srv.proc.wait(bound(60)) is not None
        assert "ended (shutdown)" in srv.output(), srv.output()[-3000:]


def test_without_aiortc_the_route_answers_501_with_an_install_hint(monkeypatch):
    from fastapi.testclient import TestClient

    from duplexkit.testing import ScriptedEngine
    from duplexkit_server import create_app, webrtc

    monkeypatch.setattr(webrtc, "available", lambda: False)
    with TestClient(create_app(ScriptedEngine()), base_url="http://127.0.0.1") as c:
        r = c.post("/v1/realtime/calls", content=b"v=0\r\n", headers={"Content-Type": "application/sdp"})
    assert r.status_code == 501, r.text
    err = r.json()["error"]
    assert err["code"] == "webrtc_unavailable" and "pip install" in err["message"] and err["type"] == "server_error"
