"""duplexkit.errors: one exception hierarchy, docs/protocol.md §9 codes, messages that say what was expected.

Covers the input-handling rules of docs/protocol.md §6.1/§9: an odd trailing byte is carried and
out-of-range floats are clipped (neither is an error); NaN/inf, non-base64 data, zero-length
appends, wrong or unknown formats and rates raise typed errors carrying their §9 ``code``.
"""

from __future__ import annotations

import ast
import base64
import importlib
import inspect
import pkgutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import duplexkit
from duplexkit import errors as E
from duplexkit.audio import codecs
from duplexkit.audio.codecs import InputFormat, StreamDecoder, b64decode_audio
from duplexkit.errors import (
    AudioFormatError,
    DuplexkitError,
    ErrorCode,
    ERROR_TYPES,
    ProtocolError,
    TransitionError,
)

sys.path.insert(0, str(Path(__file__).resolve().parent / "session"))
from _driver import Driver, fixture_audio, pcm16_b64  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def _pcm16(x: np.ndarray) -> bytes:
    return (np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()


# ---------------------------------------------------------------------------------- the module


def test_errors_module_imports_nothing_from_duplexkit():
    tree = ast.parse((ROOT / "duplexkit" / "errors.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0 and not (node.module or "").startswith("duplexkit"), ast.dump(node)
        elif isinstance(node, ast.Import):
            assert not any(a.name.startswith("duplexkit") for a in node.names), ast.dump(node)
    code = "import sys, duplexkit.errors; print(sorted(m for m in sys.modules if m.startswith('duplexkit')))"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "['duplexkit', 'duplexkit.errors']"


def test_error_code_table_matches_protocol_section_9():
    assert {c.value for c in ErrorCode} == {
        "invalid_json", "unknown_event", "bad_event", "bad_audio", "event_too_large", "unsupported_audio_format",
        "unsupported_turn_detection", "input_audio_buffer_empty", "response_already_active", "response_not_active",
        "item_not_found", "invalid_truncate", "ref_audio_invalid", "ref_audio_update_unsupported",
        "session_capacity_exhausted", "input_backpressure", "unauthorized", "server_error",
        "input_rate_mismatch",  # duplexkit extension (a warning)
        "model_not_found",  # a refused model id
        # session.resume refusals (docs/protocol.md §1.6)
        "resume_not_found", "resume_expired", "resume_unauthorized", "resume_journal_overflow",
        # tools (docs/tools.md)
        "invalid_tools", "call_not_found", "call_already_answered", "call_cancelled",
    }
    assert set(ERROR_TYPES) == set(ErrorCode)
    assert {c for c, t in ERROR_TYPES.items() if t == "rate_limit_error"} == {
        ErrorCode.SESSION_CAPACITY_EXHAUSTED, ErrorCode.INPUT_BACKPRESSURE}
    assert ERROR_TYPES[ErrorCode.SERVER_ERROR] == "server_error"


def test_old_locations_re_export_the_same_classes():
    from duplexkit.audio import AudioFormatError as A2, DeviceError as D2
    from duplexkit.audio.devices import DeviceError as D3
    from duplexkit.clients import DuplexConnectionError, DuplexError, DuplexTimeout
    from duplexkit.engine import EngineInputError, LayoutError, LayoutNotSupportedError
    from duplexkit.engine.stages import InjectedFault
    from duplexkit.protocol import ErrorCode as C2, ProtocolError as P2, TransitionError as T2
    from duplexkit.protocol.conformance import ConformanceError
    from duplexkit.protocol.errors import ERROR_TYPES as ET2

    assert codecs.AudioFormatError is A2 is E.AudioFormatError
    assert D2 is D3 is E.DeviceError
    assert (P2, T2, C2, ET2) == (E.ProtocolError, E.TransitionError, E.ErrorCode, E.ERROR_TYPES)
    assert (DuplexError, DuplexConnectionError, DuplexTimeout) == (E.DuplexError, E.DuplexConnectionError, E.DuplexTimeout)
    assert (EngineInputError, LayoutError, LayoutNotSupportedError, InjectedFault, ConformanceError) == (
        E.EngineInputError, E.LayoutError, E.LayoutNotSupportedError, E.InjectedFault, E.ConformanceError)


def test_standard_library_bases_are_kept():
    assert issubclass(E.AudioFormatError, ValueError)
    assert issubclass(E.EngineInputError, ValueError)
    assert issubclass(E.LayoutError, ValueError) and issubclass(E.LayoutNotSupportedError, E.LayoutError)
    assert issubclass(E.DeviceError, RuntimeError) and issubclass(E.InjectedFault, RuntimeError)
    assert issubclass(E.ConformanceError, AssertionError)
    assert issubclass(E.DuplexConnectionError, ConnectionError) and issubclass(E.DuplexTimeout, TimeoutError)
    assert issubclass(E.TransitionError, E.ProtocolError)
    with pytest.raises(ValueError):  # existing `except ValueError` code still catches it
        InputFormat("pcm16", 4000)


def test_every_exception_has_a_code_and_message():
    cases = [
        (E.AudioFormatError("bad_audio", "expected x"), "bad_audio"),
        (E.ProtocolError(ErrorCode.BAD_EVENT, "expected y", param="p", event_id="e1"), "bad_event"),
        (E.TransitionError(ErrorCode.RESPONSE_NOT_ACTIVE, "idle", "cancel"), "response_not_active"),
        (E.EngineInputError("expected 16000 samples"), "server_error"),
        (E.InjectedFault("thinker"), "server_error"),
        (E.LayoutError("expected a mapping", source="x.yaml"), "server_error"),
        (E.DeviceError("expected a device"), "server_error"),
        (E.ConformanceError("seq gap"), "server_error"),
        (E.DuplexError("item_not_found", "no such item"), "item_not_found"),
        (E.DuplexConnectionError("closed", code="unauthorized", close_code=1008), "unauthorized"),
        (E.DuplexTimeout("waited 5 s"), "timeout"),
    ]
    for exc, code in cases:
        assert isinstance(exc, DuplexkitError)
        assert exc.code == code, exc
        assert exc.message and str(exc)
    pe = cases[1][0]
    assert pe.to_error_dict() == {"type": "invalid_request_error", "code": "bad_event", "message": "expected y",
                                  "param": "p", "event_id": "e1"}
    assert str(pe) == "bad_event: expected y"
    assert "cancel is not allowed in state 'idle'" in cases[2][0].message
    assert str(cases[5][0]) == "x.yaml: expected a mapping" and cases[5][0].source == "x.yaml"
    assert cases[9][0].close_code == 1008
    with pytest.raises(TypeError):
        E.AudioFormatError("bad_event", "not an audio code")
    with pytest.raises(ValueError):
        E.ProtocolError("no_such_code", "x")


def test_duplex_error_from_event():
    ev = {"type": "error", "error": {"type": "invalid_request_error", "code": "response_not_active",
                                     "message": "nothing to cancel", "event_id": "c7"}}
    e = E.DuplexError.from_event(ev)
    assert (e.code, e.message, e.event_id, e.event) == ("response_not_active", "nothing to cancel", "c7", ev)


# ---------------------------------------------------------------------------------- the hierarchy

# Exception classes of the model port (duplexkit/models/minicpmo45, owned by the model helpers) not
# yet rebased onto DuplexkitError. Each should become e.g. `class TalkerError(DuplexkitError, ValueError)`
# with `from duplexkit.errors import DuplexkitError`; then remove it here (the test fails until you do).
_PENDING_MODEL_PORT: set = set()  # every model-port exception now derives from DuplexkitError


def _all_modules() -> list:
    mods = []
    for pkg_name in ("duplexkit", "server"):
        pkg = importlib.import_module(pkg_name)
        mods.append(pkg)
        for info in pkgutil.walk_packages(pkg.__path__, pkg_name + "."):
            try:
                mods.append(importlib.import_module(info.name))
            except ModuleNotFoundError as exc:  # the vLLM model plugin imports vllm: its own venv only
                if (exc.name or "").split(".")[0] != "vllm":
                    raise
    return mods


def test_every_exception_class_derives_from_duplexkit_error(monkeypatch):
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    mods = _all_modules()
    names = {m.__name__ for m in mods}
    assert {"duplexkit.session", "duplexkit.engine.runtime", "duplexkit.clients.base", "server.chat"} <= names
    found, offenders = set(), set()
    for m in mods:
        for _, cls in inspect.getmembers(m, inspect.isclass):
            # a signal as an exception (SIGTERM raised like Ctrl+C's KeyboardInterrupt) is not an error:
            # deriving it from DuplexkitError (an Exception) would let `except Exception` swallow it
            if (issubclass(cls, BaseException) and cls.__module__ == m.__name__
                    and not issubclass(cls, (KeyboardInterrupt, SystemExit))):
                qual = f"{cls.__module__}.{cls.__qualname__}"
                found.add(qual)
                if not issubclass(cls, DuplexkitError):
                    offenders.add(qual)
    assert len(found) >= 15, found
    assert not offenders - _PENDING_MODEL_PORT, f"exception classes not deriving from DuplexkitError: {sorted(offenders - _PENDING_MODEL_PORT)}"
    stale = _PENDING_MODEL_PORT - offenders
    assert not stale, f"already migrated (or gone): remove from _PENDING_MODEL_PORT: {sorted(stale)}"


# ---------------------------------------------------------------------------------- audio decode layer


def test_odd_trailing_byte_is_carried_not_an_error():
    raw = _pcm16(np.linspace(-0.5, 0.5, 101, dtype=np.float32))
    dec = StreamDecoder(InputFormat("pcm16", 16000))
    a = dec.decode(raw[:51])
    assert a.shape == (25,) and dec.carried_bytes == 1
    b = dec.decode(raw[51:])
    assert b.shape == (76,) and dec.carried_bytes == 0
    np.testing.assert_array_equal(np.concatenate([a, b]), codecs.pcm16_to_float32(raw))
    dec4 = StreamDecoder(InputFormat("pcm_f32le", 16000))
    f = np.array([0.25, -0.5, 0.75], "<f4").tobytes()
    assert dec4.decode(f[:7]).tolist() == [0.25] and dec4.carried_bytes == 3
    assert dec4.decode(f[7:]).tolist() == [-0.5, 0.75]


def test_out_of_range_floats_are_clipped_not_an_error():
    x = np.array([-3.0, -1.0, 0.5, 1.0, 7.5], np.float32)
    assert codecs.f32le_to_float32(x.astype("<f4").tobytes()).tolist() == [-1.0, -1.0, 0.5, 1.0, 1.0]
    pcm = np.frombuffer(codecs.float32_to_pcm16(x), "<i2")
    assert pcm.tolist() == [-32767, -32767, 16384, 32767, 32767]


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_floats_are_bad_audio(bad):
    x = np.array([0.1, bad, 0.2], np.float32)
    for fn, arg in ((codecs.f32le_to_float32, x.astype("<f4").tobytes()), (codecs.float32_to_pcm16, x),
                    (codecs.float32_to_f32le, x), (codecs.float32_to_ulaw, x), (codecs.float32_to_alaw, x)):
        with pytest.raises(AudioFormatError) as ei:
            fn(arg)
        assert ei.value.code == "bad_audio" and "expected finite" in ei.value.message and "1 NaN/inf of 3" in str(ei.value)
    dec = StreamDecoder(InputFormat("pcm_f32le", 16000))
    dec.decode(np.float32(0.5).tobytes()[:2])
    with pytest.raises(AudioFormatError):
        dec.decode(np.float32(0.5).tobytes()[2:] + x.astype("<f4").tobytes())
    assert dec.carried_bytes == 2  # the bad chunk changed nothing


@pytest.mark.parametrize("s, got", [("abc$", "invalid base64"), ("QUJ", "invalid base64"), ("AAé=", "non-ASCII"),
                                    (123, "got int")])
def test_non_base64_is_bad_audio(s, got):
    with pytest.raises(AudioFormatError) as ei:
        b64decode_audio(s, what="pcm16 at 16000 Hz")
    assert ei.value.code == "bad_audio"
    assert ei.value.message.startswith("expected base64 pcm16 at 16000 Hz") and got in ei.value.message


def test_zero_length_is_bad_audio_at_the_decode_layer():
    assert b64decode_audio("") == b"" and b64decode_audio(" \n") == b""  # allowed unless asked
    with pytest.raises(AudioFormatError) as ei:
        b64decode_audio("", allow_empty=False, what="pcm16 at 24000 Hz")
    assert ei.value.code == "bad_audio"
    assert ei.value.message == "expected base64 pcm16 at 24000 Hz of at least one byte, got an empty string"
    dec = StreamDecoder(InputFormat("pcm16", 16000))
    dec.decode(b"\x01")
    assert dec.decode(b"").shape == (0,)
    with pytest.raises(AudioFormatError) as ei:
        dec.decode(b"", allow_empty=False)
    assert ei.value.code == "bad_audio" and "expected at least one byte of pcm16 at 16000 Hz audio" in ei.value.message
    assert dec.carried_bytes == 1


@pytest.mark.parametrize("enc, rate, channels, expected", [
    ("opus", 16000, 1, "expected one of ['pcm16', 'pcm_f32le', 'g711_ulaw', 'g711_alaw']"),
    ("pcm16", 4000, 1, "expected a pcm16 sample rate in 8000-48000 Hz, got 4000 Hz"),
    ("pcm_f32le", 96000, 1, "expected a pcm_f32le sample rate in 8000-48000 Hz, got 96000 Hz"),
    ("g711_ulaw", 16000, 1, "expected 8000 Hz for g711_ulaw, got 16000 Hz"),
    ("pcm16", 16000.0, 1, "expected an integer sample rate in Hz, got 16000.0"),
    ("pcm16", True, 1, "expected an integer sample rate in Hz, got True"),
    ("pcm16", 16000, 9, "expected an integer channel count in 1..8, got 9"),
])
def test_wrong_or_unknown_format_and_rate(enc, rate, channels, expected):
    with pytest.raises(AudioFormatError) as ei:
        InputFormat(enc, rate, channels)
    assert ei.value.code == "unsupported_audio_format" and expected in ei.value.message


def test_frame_and_byte_count_messages_say_what_was_expected():
    with pytest.raises(AudioFormatError, match=r"expected an even number of pcm16 bytes \(2 per sample\), got 3 bytes"):
        codecs.pcm16_to_float32(b"\x00\x01\x02")
    with pytest.raises(AudioFormatError, match=r"expected a multiple of 4 pcm_f32le bytes .* got 6 bytes"):
        codecs.f32le_to_float32(b"\x00" * 6)
    with pytest.raises(AudioFormatError, match=r"expected whole 4-byte frames of pcm16 at 16000 Hz, 2 channels, got 6"):
        codecs.decode_frames(b"\x00" * 6, InputFormat("pcm16", 16000, 2))


def test_wav_errors():
    from duplexkit.audio import read_wav, wav_bytes

    with pytest.raises(AudioFormatError) as ei:
        read_wav(b"RIFF not really a wav")
    assert ei.value.code == "bad_audio" and ei.value.message.startswith("expected an audio file libsndfile can read")
    with pytest.raises(AudioFormatError, match="expected finite float samples"):
        wav_bytes(np.array([0.0, np.nan], np.float32), 16000)


# ---------------------------------------------------------------------------------- the Session (wire)


def _err(new: list) -> dict:
    errs = [o["error"] for o in new if isinstance(o, dict) and o["type"] == "error"]
    assert len(errs) == 1, new
    return errs[0]


def test_session_zero_length_append_is_bad_audio_and_changes_nothing():
    d = Driver()
    x = fixture_audio("question_16k.wav")
    d.append(x[:8000])  # 0.5 s of real speech: framer holds a partial unit
    before = (d.s._framer.pending_samples, d.s._since_commit, d.s._decoder.carried_bytes, d.s.epoch, d.s.state)
    for empty in ("", "   "):
        new = d.send({"type": "input_audio_buffer.append", "audio": empty})
        e = _err(new)
        assert e["code"] == "bad_audio" and e["type"] == "invalid_request_error" and e["param"] == "audio"
        assert e["message"] == "expected base64 pcm16 at 16000 Hz of at least one byte, got an empty string"
        assert [o for o in new if not isinstance(o, dict)] == []  # no engine command
    assert (d.s._framer.pending_samples, d.s._since_commit, d.s._decoder.carried_bytes, d.s.epoch, d.s.state) == before
    # the session stays alive: more audio and a commit work
    d.append(x[8000:16000])
    assert d.types(d.send({"type": "input_audio_buffer.commit"}))[0] == "input_audio_buffer.committed"


def test_session_bad_base64_and_non_finite_floats_are_bad_audio():
    d = Driver()
    e = _err(d.send({"type": "input_audio_buffer.append", "audio": "!!!not base64"}))
    assert e["code"] == "bad_audio" and e["message"].startswith("expected base64 pcm16 at 16000 Hz, got invalid base64")
    d.send({"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/pcm_f32le", "rate": 16000}}}}})
    assert d.events[-1]["type"] == "session.updated"
    e = _err(d.send({"type": "input_audio_buffer.append",
                     "audio": _b64(np.array([0.1, np.inf], "<f4").tobytes())}))
    assert e["code"] == "bad_audio" and "expected finite pcm_f32le samples" in e["message"]
    # out-of-range floats are clipped, not rejected
    new = d.send({"type": "input_audio_buffer.append", "audio": _b64(np.full(16000, 4.0, "<f4").tobytes())})
    assert not d.of("error", new)
    d.send({"type": "input_audio_buffer.commit"})
    d.tick(50)  # the commit's unit goes out after COMMIT_MERGE_MS
    units = [c for c in d.cmds if type(c).__name__ == "AppendUnit"]
    assert len(units) == 1 and units[0].audio.max() == 1.0 and units[0].audio[:16000].min() == 1.0


def test_session_odd_length_append_is_carried():
    d = Driver()
    raw = _pcm16(fixture_audio("question_16k.wav")[:16560])
    assert not d.of("error", d.send({"type": "input_audio_buffer.append", "audio": _b64(raw[:1001])}))
    assert d.s._decoder.carried_bytes == 1
    assert not d.of("error", d.send({"type": "input_audio_buffer.append", "audio": _b64(raw[1001:])}))
    units = [c for c in d.cmds if type(c).__name__ == "AppendUnit"]
    assert len(units) == 1
    np.testing.assert_array_equal(units[0].audio, codecs.pcm16_to_float32(raw))


@pytest.mark.parametrize("fmt, code, expected", [
    ({"type": "audio/opus"}, "unsupported_audio_format", "expected an input format type of audio/pcm"),
    ("mp3", "unsupported_audio_format", "expected an input format of pcm16"),
    ({"type": "audio/pcm", "rate": 4000}, "unsupported_audio_format", "expected a pcm16 sample rate in 8000-48000 Hz"),
    ({"type": "audio/pcmu", "rate": 16000}, "unsupported_audio_format", "expected 8000 Hz for g711_ulaw"),
    ({"type": "audio/pcm", "rate": 16000.5}, "unsupported_audio_format", "expected an integer input rate in Hz"),
])
def test_session_wrong_format_or_rate(fmt, code, expected):
    d = Driver()
    key = {"input_audio_format": fmt} if isinstance(fmt, str) else {"audio": {"input": {"format": fmt}}}
    e = _err(d.send({"type": "session.update", "session": key}))
    assert e["code"] == code and expected in e["message"]
    assert d.s.settings.input_format == InputFormat("pcm16", 16000)  # all-or-nothing


def test_detach_traceback_breaks_the_cycle_and_keeps_the_place():
    """An exception handed back in a result list (the stage functions' way) keeps no frames: the
    catching frame's locals are freed without the cyclic collector, and the formatted exception
    still says where it was raised (a note), for its cause too."""
    import gc
    import traceback
    import weakref

    from duplexkit.errors import detach_traceback

    class Payload:
        pass

    refs = []

    def inner():
        p = Payload()
        refs.append(weakref.ref(p))
        try:
            raise KeyError("first")
        except KeyError as cause:
            raise RuntimeError("boom") from cause

    def stage():
        results = [None]
        local = Payload()
        refs.append(weakref.ref(local))
        try:
            inner()
        except RuntimeError as exc:
            results[0] = detach_traceback(exc)
        return results

    gc.disable()
    try:
        res = stage()
        assert all(r() is None for r in refs)
    finally:
        gc.enable()
    exc = res[0]
    assert exc.__traceback__ is None and exc.__cause__.__traceback__ is None
    text = "".join(traceback.format_exception(exc))
    assert "boom" in text and "first" in text and "raised at:" in text and "in inner" in text
    assert detach_traceback(exc) is exc and text == "".join(traceback.format_exception(exc))  # idempotent
