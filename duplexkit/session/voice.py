"""The reference voice of a ``session.update`` (docs/protocol.md §8): a data URL or an allowed path,
decoded to 16 kHz mono float32, length-checked and trimmed to whole 100 ms (:func:`load_ref_audio`),
and the voice fields applied to the new settings, fixed once audio output started
(:func:`apply_voice`). Plain functions: the voice in force is part of the settings value."""

from __future__ import annotations

import base64
import binascii
import re
from typing import Callable, Optional

from duplexkit.audio import AudioFormatError, read_wav
from duplexkit.engine.api import INPUT_SAMPLE_RATE, REF_AUDIO_MIN_S, REF_TRIM_SAMPLES, ReferenceVoice, reference_voice
from duplexkit.errors import AudioTooLongError, RefAudioLengthError
from duplexkit.protocol import ErrorCode


__all__ = ["REF_AUDIO_MIN_S", "REF_TRIM_SAMPLES", "load_ref_audio", "apply_voice"]  # the first two: duplexkit.engine.api

_SCHEME_RE = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.\-]*://")


def load_ref_audio(value: str, loader: Optional[Callable[[str], bytes]], max_s: float, err) -> ReferenceVoice:
    """Decode ``session.audio.output.ref_audio`` / ``extra_body.ref_audio`` into a :class:`ReferenceVoice`.

    Args:
        value: ``data:audio/wav;base64,...``, a ``file://`` URL or a plain path.
        loader: ``SessionConfig.ref_audio_loader`` (path -> WAV bytes; enforces ``--ref-audio-dir``);
            None = paths are refused.
        max_s: longest clip, seconds (``SessionLimits.max_ref_audio_s``).
        err: ``err(code, message, param) -> ProtocolError`` of the update being validated.

    Returns:
        float32 [n] at 16 kHz, n a multiple of :data:`REF_TRIM_SAMPLES` (1600), with its sha256.

    Raises:
        ProtocolError: ``ref_audio_invalid`` (bad data URL, remote URL, refused path, undecodable
            audio, shorter than :data:`REF_AUDIO_MIN_S` or longer than ``max_s``).
    """
    code = ErrorCode.REF_AUDIO_INVALID
    if value.startswith("data:"):
        head, sep, payload = value.partition(",")
        if not sep or ";base64" not in head:
            raise err(code, "ref_audio data URL must be 'data:audio/wav;base64,...'", "ref_audio")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise err(code, "ref_audio data URL is not valid base64", "ref_audio") from None
    elif _SCHEME_RE.match(value) and not value.startswith("file://"):
        raise err(code, "remote ref_audio URLs are refused; send a data URL", "ref_audio")
    else:
        path = value[len("file://"):] if value.startswith("file://") else value
        if loader is None:
            raise err(code, "ref_audio paths are not allowed on this server (no --ref-audio-dir)", "ref_audio")
        try:
            data = loader(path)
        except Exception as exc:  # the loader enforces the allow-list
            raise err(code, f"ref_audio path refused: {exc}", "ref_audio") from None
    try:
        audio, _ = read_wav(data, rate=INPUT_SAMPLE_RATE, max_s=max_s)
    except AudioTooLongError as exc:  # readable, only too long
        got = f"{exc.duration_s:.2f} s" if exc.duration_s is not None else f"over {max_s} s"
        raise err(code, f"ref_audio must last {REF_AUDIO_MIN_S}..{max_s} s, got {got}", "ref_audio") from None
    except (AudioFormatError, ValueError, RuntimeError) as exc:
        raise err(code, f"ref_audio is not decodable audio: {exc}", "ref_audio") from None
    try:
        return reference_voice(audio, max_s)
    except RefAudioLengthError as exc:
        raise err(code, f"ref_audio must last {REF_AUDIO_MIN_S}..{max_s} s, got {exc.duration_s:.2f} s", "ref_audio") from None


def apply_voice(s, p, given: set, cfg, current_ref: Optional[ReferenceVoice], audio_started: bool, err) -> None:
    """Apply the voice fields of a ``session.update`` to the new settings ``s`` (docs/protocol.md §8).

    Args:
        s: the settings being built (``voice``, ``ref_voice``, ``ref_from_client`` are set here).
        p: the update's ``SessionPatch``; ``given``: the fields it gave.
        cfg: the ``SessionConfig`` (voice table, default voice, ref_audio loader and limit).
        current_ref: the reference voice in force now.
        audio_started: audio output has started in this session.
        err: ``err(code, message, concept) -> ProtocolError`` of the update being validated.

    Raises:
        ProtocolError: ``ref_audio_invalid`` (see :func:`load_ref_audio`), or
            ``ref_audio_update_unsupported`` when the voice would change after audio output started.
    """
    changed = False
    if "voice" in given:
        s.voice = p.voice
        if not s.ref_from_client or "ref_audio" not in given:
            s.ref_voice = cfg.voices.get(p.voice, cfg.default_voice)
            s.ref_from_client = False
        changed = True
    if "ref_audio" in given:
        s.ref_voice = load_ref_audio(p.ref_audio, cfg.ref_audio_loader, cfg.limits.max_ref_audio_s, err)
        s.ref_from_client = True
        changed = True
    if changed and audio_started:
        old_sha = current_ref.sha256 if current_ref is not None else None
        new_sha = s.ref_voice.sha256 if s.ref_voice is not None else None
        if old_sha != new_sha:
            raise err(ErrorCode.REF_AUDIO_UPDATE_UNSUPPORTED, "the voice cannot change after audio output has started",
                      "ref_audio" if "ref_audio" in given else "voice")
