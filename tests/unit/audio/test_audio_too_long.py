"""Audio that decodes but is over a length limit says so: ``audio too long: 3.5 s, at most 1 s``, not
``undecodable audio``, with the documented code unchanged (``bad_audio`` for chat input,
``ref_audio_invalid`` for a reference voice; docs/protocol.md §9)."""

from __future__ import annotations

import base64
import io

import pytest
import soundfile as sf

from duplexkit.audio import AudioFormatError, read_wav
from duplexkit.errors import AudioTooLongError


def test_read_wav_over_max_s_is_too_long_not_undecodable(fixtures_dir):
    raw = (fixtures_dir / "question_16k.wav").read_bytes()  # 3.54 s of speech
    with pytest.raises(AudioTooLongError) as ei:
        read_wav(raw, 16000, max_s=1)
    err = ei.value
    assert isinstance(err, AudioFormatError) and err.code == "bad_audio"
    assert err.max_s == 1 and err.duration_s == pytest.approx(3.54, abs=0.01)
    assert str(err) == "audio too long: 3.5 s, at most 1 s"
    audio, sr = read_wav(raw, 16000, max_s=4)  # under the limit: decodes
    assert sr == 16000 and len(audio) == pytest.approx(3.54 * 16000, abs=200)


def test_broken_audio_is_still_undecodable():
    with pytest.raises(AudioFormatError) as ei:
        read_wav(b"RIFF\x00\x00not a wav at all", 16000, max_s=1)
    assert not isinstance(ei.value, AudioTooLongError) and "libsndfile" in str(ei.value)


def test_chat_input_too_long_message_and_code(fixtures_dir):
    from server.chat import ChatRequestError, _decode_audio

    raw = (fixtures_dir / "question_16k.wav").read_bytes()
    with pytest.raises(ChatRequestError) as ei:
        _decode_audio(raw, "messages[0].content[0].input_audio", max_s=1)
    assert ei.value.code == "bad_audio"
    assert str(ei.value) == "audio too long: 3.5 s, at most 1 s"
    with pytest.raises(ChatRequestError) as ei:
        _decode_audio(b"garbage", "p", max_s=1)
    assert str(ei.value).startswith("undecodable audio: ")


def test_ref_voice_too_long_names_the_allowed_range(fixtures_dir):
    from duplexkit.session.voice import REF_AUDIO_MIN_S, load_ref_audio

    class Refused(Exception):
        def __init__(self, code, message, param):
            super().__init__(message)
            self.code = code

    raw = (fixtures_dir / "ref_voice_16k.wav").read_bytes()
    url = "data:audio/wav;base64," + base64.b64encode(raw).decode()
    dur = sf.info(io.BytesIO(raw)).duration
    assert dur > 1
    with pytest.raises(Refused) as ei:
        load_ref_audio(url, None, 1, Refused)
    assert ei.value.code == "ref_audio_invalid"
    assert str(ei.value) == f"ref_audio must last {REF_AUDIO_MIN_S}..1 s, got {dur:.2f} s"
    assert len(load_ref_audio(url, None, 30, Refused).audio) % 1600 == 0  # within the limit: accepted
