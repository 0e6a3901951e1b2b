"""Session scenarios as tables of (events in -> events out) (docs/protocol.md §3, §4, §7, §9).

Each scenario is a list of steps; each step feeds the Session one input (a client event, scripted
engine outputs, a clock tick, or real speech from tests/fixtures/audio appended in chunks) and
lists what must come out of that step: the server events in order (``error:<code>`` for errors,
``response.done:<status>/<reason>`` for terminal events) and the engine commands other than
``AppendUnit``. Every event stream is also checked by the §12 EventStreamChecker (in the Driver).

The last test checks that importing the Session pulls in no asyncio, socket, threading or torch
of its own (docs/architecture.md, "The sans-I/O Session": the Session is sans-I/O).
"""

from __future__ import annotations

import ast
import base64
import io
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import pytest
import soundfile as sf

from _driver import Driver, fixture_audio, pcm16_b64
from duplexkit.engine.api import AppendUnit, Decision

ROOT = Path(__file__).resolve().parents[3]

# ------------------------------------------------------------------------------------------------
# step vocabulary
# ------------------------------------------------------------------------------------------------


@dataclass
class Step:
    """One input and what must come out of it.

    ``out``: server events of this step, in order (see the module docstring for the notation).
    ``cmds``: names of the engine commands of this step other than ``AppendUnit``.
    ``check``: extra assertions, ``check(driver, new_outputs)``.
    """

    do: Callable[[Driver], list]
    out: list[str]
    cmds: list[str] = field(default_factory=list)
    check: Optional[Callable[[Driver, list], Any]] = None
    label: str = ""


def _resolve(d: Driver, v: Any) -> Any:
    if callable(v):
        return v(d)
    if isinstance(v, dict):
        return {k: _resolve(d, x) for k, x in v.items()}
    return v


def client(ev: dict, out: list[str], cmds=(), check=None) -> Step:
    """A client event; dict values may be ``lambda d: ...`` resolved when the step runs."""
    return Step(lambda d: d.send(_resolve(d, ev)), out, list(cmds), check, f"client {ev['type']}")


def engine_speak(texts=("Hello ", "world."), end=True, out=(), cmds=(), check=None) -> Step:
    """Scripted engine outputs of the current epoch: speak decision, per unit a TextDelta and an
    AudioChunk (0.84 s, then 1 s each), then TurnEnd when ``end``."""
    return Step(lambda d: d.speak(list(texts), end=end), list(out), list(cmds), check, f"engine speak {texts}")


def engine_listen(out=(), cmds=(), check=None) -> Step:
    """A listen decision for the last appended unit (current epoch)."""
    return Step(lambda d: d.engine(Decision(d.sid, d.s.epoch, d.last_unit(), decision="listen")), list(out),
                list(cmds), check, "engine listen")


def tick(dt_ms: int, out=(), cmds=(), check=None) -> Step:
    return Step(lambda d: d.tick(dt_ms), list(out), list(cmds), check, f"tick +{dt_ms} ms")


def speech(name: str, start_ms: int = 0, end_ms: Optional[int] = None, chunk_ms: int = 20, out=(), cmds=(),
           check=None) -> Step:
    """Real speech ``[start_ms, end_ms)`` of a fixture WAV, appended as pcm16 in ``chunk_ms`` chunks
    (the clock advances by ``chunk_ms`` per append)."""
    def do(d: Driver) -> list:
        x = fixture_audio(name)
        a, b = start_ms * 16, (len(x) if end_ms is None else end_ms * 16)
        return d.append(x[a:b], chunk_ms=chunk_ms)
    return Step(do, list(out), list(cmds), check, f"speech {name}[{start_ms}:{end_ms}] / {chunk_ms} ms")


def silence(ms: int, chunk_ms: int = 100, out=(), cmds=(), check=None) -> Step:
    return Step(lambda d: d.append(np.zeros(ms * 16, np.float32), chunk_ms=chunk_ms), list(out), list(cmds), check,
                f"silence {ms} ms")


def raw_appends(chunks: Callable[[], list[bytes]], out=(), cmds=(), check=None) -> Step:
    """Raw byte chunks, each base64-encoded as its own ``input_audio_buffer.append``. The samples
    the Session's decoder returns are recorded in ``driver._decoded``."""
    def do(d: Driver) -> list:
        dec = d.s.input._decoder
        d._decoded = []

        def recording(data, **kw):
            x = type(dec).decode(dec, data, **kw)
            d._decoded.append(x.copy())
            return x
        dec.decode = recording
        new = []
        for c in chunks():
            new += d.send({"type": "input_audio_buffer.append", "audio": base64.b64encode(c).decode()})
        return new
    return Step(do, list(out), list(cmds), check, "raw appends")


# references resolved at run time
def resp_id(n: int) -> Callable[[Driver], str]:
    """Id of the n-th ``response.created`` of the session (negative counts from the end)."""
    return lambda d: d.of("response.created")[n]["response"]["id"]


def assistant_item(n: int) -> Callable[[Driver], str]:
    """Item id of the n-th assistant ``conversation.item.added``."""
    return lambda d: [e for e in d.of("conversation.item.added") if e["item"]["role"] == "assistant"][n]["item"]["id"]


# ------------------------------------------------------------------------------------------------
# running a table
# ------------------------------------------------------------------------------------------------


def _summary(ev: dict) -> str:
    t = ev["type"]
    if t == "error":
        return f"error:{ev['error']['code']}"
    if t == "response.done":
        r = ev["response"]
        reason = (r.get("status_details") or {}).get("reason")
        return f"response.done:{r['status']}" + (f"/{reason}" if reason else "")
    return t


def run(steps: list[Step], **driver_kw) -> Driver:
    d = Driver(**driver_kw)
    for i, st in enumerate(steps):
        new = st.do(d)
        got = [_summary(o) for o in new if isinstance(o, dict)]
        # plain AppendUnits are input plumbing; a requested response's forced unit is a command
        cmds = ["AppendUnit(force_speak)" if isinstance(o, AppendUnit) else type(o).__name__ for o in new
                if not isinstance(o, dict) and not (isinstance(o, AppendUnit) and not o.force_speak)]
        assert got == st.out, f"step {i} ({st.label}): events {got} != {st.out}"
        assert cmds == st.cmds, f"step {i} ({st.label}): commands {cmds} != {st.cmds}"
        if st.check is not None:
            st.check(d, new)
    assert not d.closes and not d.s.closed  # no scenario closes the session
    return d


# ------------------------------------------------------------------------------------------------
# fixtures needed by the tables
# ------------------------------------------------------------------------------------------------

_CHUNK = 10  # ms per append in the barge-in timing scenario


def _vad_onset_chunks() -> int:
    """How many 10 ms appends of interrupt_16k.wav (after 1 s of silence) it takes the server VAD to
    emit ``speech_started`` (measured once on a fresh session, so the table can create the
    response 50 ms before that)."""
    d = Driver()
    d.append(np.zeros(16000, np.float32))
    x = fixture_audio("interrupt_16k.wav")
    n = 16 * _CHUNK
    for k in range(len(x) // n):
        if d.of("input_audio_buffer.speech_started", d.append(x[k * n:(k + 1) * n], chunk_ms=_CHUNK)):
            return k + 1
    raise AssertionError("the VAD never detected interrupt_16k.wav")


def _wav_data_url(x: np.ndarray) -> str:
    buf = io.BytesIO()
    sf.write(buf, x, 16000, format="WAV", subtype="PCM_16")
    return "data:audio/wav;base64," + base64.b64encode(buf.getvalue()).decode()


_REF = {}


def ref_url(seconds: float) -> Callable[[Driver], str]:
    def f(d: Driver) -> str:
        if seconds not in _REF:
            _REF[seconds] = _wav_data_url(fixture_audio("ref_voice_16k.wav")[: int(16000 * seconds)])
        return _REF[seconds]
    return f


_QUESTION_BYTES: dict = {}


def _question_pcm() -> bytes:
    if "b" not in _QUESTION_BYTES:
        _QUESTION_BYTES["b"] = (np.clip(fixture_audio("question_16k.wav"), -1, 1) * 32767).astype("<i2").tobytes()
    return _QUESTION_BYTES["b"]


def _odd_chunks() -> list[bytes]:
    """question_16k.wav twice as pcm16, cut into 3 201-byte appends (every other append leaves an odd byte)."""
    raw = _question_pcm() * 2
    return [raw[i:i + 3201] for i in range(0, len(raw), 3201)]


# ------------------------------------------------------------------------------------------------
# checks used by the tables
# ------------------------------------------------------------------------------------------------

ENVELOPE_3 = [  # a 3-unit spoken answer, opened by the model (trigger=model) or a pre-created response
    "conversation.item.added", "response.output_item.added", "response.content_part.added", "response.speak",
    *["response.output_audio.delta", "response.output_audio_transcript.delta"] * 3,
    "response.output_audio.done", "response.output_audio_transcript.done", "response.content_part.done",
    "response.output_item.done", "conversation.item.done", "response.done:completed",
]
OPEN_2 = [  # an answer still speaking after 2 units
    "conversation.item.added", "response.output_item.added", "response.content_part.added", "response.speak",
    *["response.output_audio.delta", "response.output_audio_transcript.delta"] * 2,
]
CANCEL_CLOSE = [  # closing an open envelope on cancel
    "response.output_audio.done", "response.output_audio_transcript.done", "response.content_part.done",
    "response.output_item.done", "conversation.item.done",
]
VAD_TURN = ["input_audio_buffer.speech_stopped", "input_audio_buffer.committed", "conversation.item.added",
            "conversation.item.done"]


def epoch_is(n: int):
    def check(d: Driver, new: list) -> None:
        assert d.s.epoch == n, (d.s.epoch, n)
    return check


def state_is(state: str, epoch: Optional[int] = None):
    def check(d: Driver, new: list) -> None:
        assert d.s.state == state, (d.s.state, state)
        if epoch is not None:
            assert d.s.epoch == epoch, (d.s.epoch, epoch)
    return check


def _done(new: list) -> dict:
    return [o for o in new if isinstance(o, dict) and o["type"] == "response.done"][0]["response"]


def _barge_in_before_audio(d: Driver, new: list) -> None:
    created = d.of("response.created")[-1]
    r = _done(new)
    assert r["output"] == [] and r["audio_duration_ms"] == 0 and r["committed_ms"] == 0
    assert r["id"] == created["response"]["id"] and d.s.epoch == 1 and d.s.active_response_id is None
    assert not any(it["role"] == "assistant" for it in d.s.history())  # no item: nothing to truncate


def _no_truncated_ever(d: Driver, new: list) -> None:
    assert not d.of("conversation.item.truncated")
    assert d.send({"type": "playback.ack", "response_id": resp_id(-1)(d), "played_ms": 0, "truncate": True}) == []


def _one_terminal_event(d: Driver, new: list) -> None:
    rid = resp_id(-1)(d)
    assert [e["response"]["id"] for e in d.of("response.done")].count(rid) == 1
    err = d.of("error", new)[0]["error"]
    assert err["code"] == "response_not_active" and "active" in err["message"]
    from duplexkit.clients.state import QUIET_ERRORS as _BENIGN_ERRORS
    assert "response_not_active" in _BENIGN_ERRORS  # duplexkit clients swallow it: no error reaches the app
    assert d.s.epoch == 1  # the losing cancel changed nothing


def _clamped_to_sent(d: Driver, new: list) -> None:
    iid = assistant_item(-1)(d)
    sent = d.of("response.done")[-1]["response"]["audio_duration_ms"]
    assert sent == (20160 + 24000 + 24000) * 1000 // 24000
    assert new[0]["audio_end_ms"] == sent and d.s.item_playback(iid) == (sent, sent, True)


def _unchanged_after_invalid(d: Driver, new: list) -> None:
    iid = assistant_item(-1)(d)
    assert new[0]["error"]["param"] == "audio_end_ms"
    sent, committed, final = d.s.item_playback(iid)
    assert committed == 0 and not final


def _history_snapshot(d: Driver, new: list) -> None:
    d._snap = [it for it in d.s.history() if it["role"] == "assistant"]


def _history_unchanged(d: Driver, new: list) -> None:
    assert [it for it in d.s.history() if it["role"] == "assistant"] == d._snap
    assert d.s.epoch == 0 and d.s.state == "idle"
    started = d.of("input_audio_buffer.speech_started", new)[0]
    committed = d.of("input_audio_buffer.committed", new)[0]
    assert started["item_id"] == committed["item_id"]
    assert d.s.history()[-1]["id"] == committed["item_id"] and d.s.history()[-1]["role"] == "user"


def _odd_bytes_carried(d: Driver, new: list) -> None:
    # every append decoded to exactly the samples of the whole byte stream: nothing rejected, no byte
    # lost. The server-VAD commit after the first question fell inside the stream; the odd byte
    # carried at that point was kept (docs/protocol.md §6.1 drops it only on a client commit or clear),
    # so the second question, appended after it, is still read on sample boundaries.
    from duplexkit.audio.codecs import pcm16_to_float32

    np.testing.assert_array_equal(np.concatenate(d._decoded), pcm16_to_float32(_question_pcm() * 2))
    assert d.s.input._decoder.carried_bytes == 0
    assert len(d.of("input_audio_buffer.committed")) == 2


def _superseded_ack_ignored(d: Driver, new: list) -> None:
    old, cur = assistant_item(0)(d), assistant_item(1)(d)
    assert d.s.item_playback(cur)[1] == 0  # the active response's cursor did not move
    assert d.s.item_playback(old)[1] <= d.s.item_playback(old)[0]  # clamped to what was sent, if anything


# ------------------------------------------------------------------------------------------------
# the tables
# ------------------------------------------------------------------------------------------------

SCENARIOS: dict[str, tuple[dict, Callable[[], list[Step]]]] = {}


def scenario(name: str, **driver_kw):
    def deco(fn):
        SCENARIOS[name] = (driver_kw, fn)
        return fn
    return deco


@scenario("barge_in_50ms_after_created_before_audio")
def _():
    k = _vad_onset_chunks()
    lead = 5  # 5 x 10 ms = 50 ms between response.created and speech_started
    assert k > lead
    return [
        silence(1000, out=[]),
        speech("interrupt_16k.wav", 0, (k - lead) * _CHUNK, chunk_ms=_CHUNK, out=[]),
        client({"type": "response.create"}, out=["response.created"], cmds=["AppendUnit(force_speak)"], check=state_is("requested", 0)),
        speech("interrupt_16k.wav", (k - lead) * _CHUNK, k * _CHUNK, chunk_ms=_CHUNK,
               out=["input_audio_buffer.speech_started", "response.done:cancelled/turn_detected"],
               cmds=["CancelEpoch"], check=_barge_in_before_audio),
        # late engine output of the cancelled epoch is dropped; a truncate-style ack changes nothing
        Step(lambda d: d.speak(["Too late."], epoch=0), [], check=_no_truncated_ever, label="stale epoch-0 speech"),
        speech("interrupt_16k.wav", k * _CHUNK, None, chunk_ms=100, out=VAD_TURN),
        silence(1000, out=[]),
    ]


@scenario("client_cancel_50ms_after_created_before_audio")
def _():
    return [
        silence(1200, out=[]),
        client({"type": "response.create"}, out=["response.created"], cmds=["AppendUnit(force_speak)"]),
        tick(50, out=[]),
        client({"type": "response.cancel"}, out=["response.done:cancelled/client_cancelled"], cmds=["CancelEpoch"],
               check=_barge_in_before_audio),
        client({"type": "conversation.item.truncate", "item_id": "item_never_sent", "content_index": 0,
                "audio_end_ms": 0}, out=["error:item_not_found"], check=_no_truncated_ever),
    ]


@scenario("cancel_twice")
def _():
    return [
        silence(1100, out=[]),
        engine_speak(["Once upon ", "a time "], end=False, out=["response.created", *OPEN_2]),
        client({"type": "response.cancel"}, out=[*CANCEL_CLOSE, "response.done:cancelled/client_cancelled"],
               cmds=["CancelEpoch"], check=epoch_is(1)),
        client({"type": "response.cancel"}, out=["error:response_not_active"], check=epoch_is(1)),
        client({"type": "response.cancel", "response_id": resp_id(-1)}, out=["error:response_not_active"],
               check=state_is("idle", 1)),
    ]


@scenario("cancel_right_after_done")
def _():
    return [
        silence(1100, out=[]),
        client({"type": "response.create"}, out=["response.created"], cmds=["AppendUnit(force_speak)"]),
        engine_speak(["One ", "two ", "three."], out=ENVELOPE_3[:-1] + ["response.done:completed"]),
        client({"type": "response.cancel", "response_id": resp_id(-1)}, out=["error:response_not_active"],
               check=state_is("idle", 0)),
        client({"type": "response.cancel"}, out=["error:response_not_active"], check=epoch_is(0)),
    ]


@scenario("client_cancel_races_server_vad_cancel")
def _():
    return [
        silence(1000, out=[]),
        engine_speak(["Once upon ", "a time "], end=False, out=["response.created", *OPEN_2]),
        speech("interrupt_16k.wav", 0, 1500,
               out=["input_audio_buffer.speech_started", *CANCEL_CLOSE, "response.done:cancelled/turn_detected"],
               cmds=["CancelEpoch"], check=epoch_is(1)),
        # the client saw its own barge-in and cancelled before the server's response.done reached it
        client({"type": "response.cancel", "response_id": resp_id(-1)}, out=["error:response_not_active"],
               check=_one_terminal_event),
        speech("interrupt_16k.wav", 1500, None, chunk_ms=100, out=VAD_TURN),
        silence(1000, out=[]),
    ]


@scenario("create_during_active_response")
def _():
    return [
        silence(1100, out=[]),
        client({"type": "response.create"}, out=["response.created"], cmds=["AppendUnit(force_speak)"]),
        client({"type": "response.create"}, out=["error:response_already_active"], check=state_is("requested", 0)),
        engine_speak(["One ", "two ", "three."], end=False, out=ENVELOPE_3[:4] + ENVELOPE_3[4:10]),
        client({"type": "response.create", "response": {"modalities": ["text"]}}, out=["error:response_already_active"],
               check=state_is("speaking", 0)),
    ]


@scenario("commit_on_empty_buffer")
def _():
    return [
        # manual turn-taking (no server VAD), so only the client's commits end user turns
        client({"type": "session.update", "session": {"turn_detection": None}}, out=["session.updated"]),
        client({"type": "input_audio_buffer.commit"}, out=["error:input_audio_buffer_empty"]),
        speech("question_16k.wav", 0, 60, out=[]),  # 60 ms: still under 100 ms
        client({"type": "input_audio_buffer.commit"}, out=["error:input_audio_buffer_empty"]),
        speech("question_16k.wav", 60, 1200, out=[]),
        client({"type": "input_audio_buffer.commit"},
               out=["input_audio_buffer.committed", "conversation.item.added", "conversation.item.done"]),
        client({"type": "input_audio_buffer.commit"}, out=["error:input_audio_buffer_empty"]),
        speech("question_16k.wav", 1200, 1400, out=[]),
        client({"type": "input_audio_buffer.clear"}, out=["input_audio_buffer.cleared"]),
        client({"type": "input_audio_buffer.commit"}, out=["error:input_audio_buffer_empty"]),
    ]


@scenario("truncate_too_large_and_fractional")
def _():
    return [
        silence(1100, out=[]),
        client({"type": "session.update", "session": {"extra_body": {"playback_commit_policy": "ack_only"}}},
               out=["session.updated"]),
        engine_speak(["One ", "two ", "three."], out=["response.created", *ENVELOPE_3]),
        client({"type": "conversation.item.truncate", "item_id": assistant_item(-1), "content_index": 0,
                "audio_end_ms": 850.5}, out=["error:invalid_truncate"], check=_unchanged_after_invalid),
        client({"type": "conversation.item.truncate", "item_id": assistant_item(-1), "content_index": 0,
                "audio_end_ms": 10**7}, out=["conversation.item.truncated"], check=_clamped_to_sent),
    ]


@scenario("ref_audio_change_after_audio_started")
def _():
    return [
        client({"type": "session.update", "session": {"ref_audio": ref_url(2.0)}}, out=["session.updated"],
               cmds=["UpdateStream"]),
        silence(1100, out=[]),
        engine_speak(["Once upon "], end=False, out=["response.created", *OPEN_2[:4], *OPEN_2[4:6]]),
        client({"type": "session.update", "session": {"ref_audio": ref_url(3.0)}},
               out=["error:ref_audio_update_unsupported"], check=state_is("speaking", 0)),
        client({"type": "session.update", "session": {"ref_audio": ref_url(2.0)}}, out=["session.updated"]),  # unchanged
        client({"type": "session.update", "session": {"voice": "someone_else"}},
               out=["error:ref_audio_update_unsupported"]),
    ]


@scenario("user_speech_while_assistant_silent")
def _():
    return [
        silence(1100, out=[]),
        engine_speak(["One ", "two ", "three."], out=["response.created", *ENVELOPE_3], check=_history_snapshot),
        speech("interrupt_16k.wav", out=["input_audio_buffer.speech_started", *VAD_TURN], check=_history_unchanged),
        silence(1000, out=[]),
        engine_listen(out=["response.listen"]),
    ]


@scenario("odd_length_base64_across_appends")
def _():
    return [
        raw_appends(_odd_chunks, out=["input_audio_buffer.speech_started", *VAD_TURN] * 2, check=_odd_bytes_carried),
    ]


@scenario("playback_ack_for_superseded_response")
def _():
    return [
        client({"type": "session.update", "session": {"extra_body": {"playback_commit_policy": "ack_only"}}},
               out=["session.updated"]),
        silence(1100, out=[]),
        engine_speak(["Once upon ", "a time "], end=False, out=["response.created", *OPEN_2]),
        client({"type": "response.cancel"}, out=[*CANCEL_CLOSE, "response.done:cancelled/client_cancelled"],
               cmds=["CancelEpoch"]),
        engine_speak(["New ", "answer "], end=False, out=["response.created", *OPEN_2]),
        client({"type": "playback.ack", "response_id": resp_id(0), "item_id": assistant_item(0), "played_ms": 10**6},
               out=[], check=_superseded_ack_ignored),
        client({"type": "playback.ack", "response_id": resp_id(0), "played_ms": 300, "truncate": True}, out=[]),
        client({"type": "playback.ack", "response_id": "resp_never_issued", "played_ms": 1},
               out=["error:item_not_found"]),
        engine_speak(["The end."], out=["response.output_audio.delta", "response.output_audio_transcript.delta",
                                         *CANCEL_CLOSE[:2], *CANCEL_CLOSE[2:], "response.done:completed"]),
    ]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario(name):
    driver_kw, build = SCENARIOS[name]
    run(build(), **driver_kw)


def test_scenario_tables_cover_the_issue_list():
    assert {
        "barge_in_50ms_after_created_before_audio", "cancel_twice", "cancel_right_after_done",
        "client_cancel_races_server_vad_cancel", "create_during_active_response", "commit_on_empty_buffer",
        "truncate_too_large_and_fractional", "ref_audio_change_after_audio_started",
        "user_speech_while_assistant_silent", "odd_length_base64_across_appends",
        "playback_ack_for_superseded_response",
    } <= set(SCENARIOS)


def test_a_wrong_expectation_fails():
    # the runner is not vacuous: a table with a wrong expected event fails
    with pytest.raises(AssertionError, match="events"):
        run([client({"type": "response.cancel"}, out=["response.done:cancelled/client_cancelled"])])
    with pytest.raises(AssertionError, match="commands"):
        run([client({"type": "response.create"}, out=["response.created"], cmds=[])])


# ------------------------------------------------------------------------------------------------
# sans-I/O: what importing the Session pulls in
# ------------------------------------------------------------------------------------------------

_FORBIDDEN = ("asyncio", "socket", "threading", "torch", "concurrent")

_PROBE = r"""
import sys, importlib.abc, json

first = {}

class Spy(importlib.abc.MetaPathFinder):
    # records which module's code first imports each watched module
    def find_spec(self, name, path=None, target=None):
        if name in WATCH and name not in first:
            f = sys._getframe(1)
            while f is not None and (f.f_globals.get("__name__", "").startswith(("importlib", "_frozen_importlib"))
                                     or f.f_code.co_filename.startswith("<frozen")):
                f = f.f_back
            first[name] = f.f_globals.get("__name__") if f is not None else None
        return None

WATCH = set(%r)
sys.meta_path.insert(0, Spy())
import duplexkit.session as S
s = S.Session(S.SessionConfig())
s.start(0)
s.receive_client_event({"type": "input_audio_buffer.append", "audio": "AAAA"}, 0)
s.drain()
print(json.dumps({"first": first, "loaded": sorted(m for m in sys.modules if m.split(".")[0] in WATCH),
                  "duplexkit": sorted(m for m in sys.modules if m.startswith("duplexkit"))}))
"""


def test_session_import_is_sans_io():
    import json

    r = subprocess.run([sys.executable, "-c", _PROBE % (list(_FORBIDDEN),)], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout.strip().splitlines()[-1])
    loaded = {m.split(".")[0] for m in info["loaded"]}
    # asyncio, torch and thread pools are not loaded at all
    assert not loaded & {"asyncio", "torch", "concurrent"}, info["loaded"]
    # socket and threading are only loaded by third-party/stdlib code (logging imports threading;
    # pydantic's plugin loader imports importlib.metadata -> email.utils, which imports socket),
    # never by a duplexkit module
    for mod, importer in info["first"].items():
        assert importer and not importer.startswith("duplexkit"), (mod, importer)
    # and no duplexkit module the Session loads imports any of them, even lazily in a function
    for name in info["duplexkit"]:
        spec_path = ROOT / (name.replace(".", "/") + ".py")
        if not spec_path.exists():
            spec_path = ROOT / name.replace(".", "/") / "__init__.py"
        tree = ast.parse(spec_path.read_text())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            bad = [n for n in names if n.split(".")[0] in _FORBIDDEN]
            assert not bad, f"{name} imports {bad}"
    assert "duplexkit.engine.runtime" not in info["duplexkit"] and "duplexkit.audio.devices" not in info["duplexkit"]
