"""Transcribers: the text of a user turn's audio (``input_audio_transcription``, deciders that read text).

A transcriber answers the Session's :class:`~duplexkit.engine.api.TranscribeAudio` shell command with a
:class:`~duplexkit.engine.api.Transcription`. Two ship:

* :class:`EngineTranscriber` (``"minicpm-o"``, the default): the thinker's own speech recognition,
  asked in turn-based text mode through ``engine.generate``. Nothing more to load.
* :class:`FasterWhisperTranscriber` (``"faster-whisper"`` / ``"faster-whisper:<size>"``): Whisper
  through CTranslate2 (``pip install 'duplexkit[transcribe]'``). Its weights are downloaded by
  faster-whisper on first use, or read from a local directory given as ``model_size``.

Both never raise from :meth:`Transcriber.transcribe`: a failure is the transcription's ``error``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import math
import threading
import time
from typing import Any, Optional, Protocol, runtime_checkable

import numpy as np

from duplexkit.engine.api import INPUT_SAMPLE_RATE, ChatMessage, ChatRequest, TranscribeAudio, Transcription
from duplexkit.errors import OptionalDependencyError

__all__ = ["Transcriber", "EngineTranscriber", "FasterWhisperTranscriber", "make_transcriber", "ASR_PROMPTS"]

ASR_PROMPTS = {
    "en": "Please listen to the audio snippet carefully and transcribe the content.",
    "zh": "请仔细听这段音频片段，并将其内容逐字记录。",
}
"""The instruction :class:`EngineTranscriber` puts before the audio, by language.

These are the speech-recognition task prompts OpenBMB gives for MiniCPM-o 4.5 in the MiniCPM-o
README (section "Addressing Various Audio Understanding Tasks"): the English one for English speech
(and, per that README, Chinese speech rendered in English), the Chinese one for Chinese speech. The
README's example sends ``[prompt + "\\n", audio]`` as one user message; duplexkit's chat prompt joins
a message's parts with a newline, so the prompt here has none of its own."""


@runtime_checkable
class Transcriber(Protocol):
    """Turns a :class:`~duplexkit.engine.api.TranscribeAudio` into a :class:`~duplexkit.engine.api.Transcription`."""

    async def transcribe(self, cmd: TranscribeAudio) -> Transcription:
        """The transcript of ``cmd.audio``; never raises (a failure is ``Transcription.error``)."""
        ...


def _result(cmd: TranscribeAudio, t0: float, text: str = "", error: Optional[str] = None) -> Transcription:
    return Transcription(stream_id=cmd.stream_id, epoch=cmd.epoch, unit_index=-1, item_id=cmd.item_id,
                         text="" if error else text, error=error, elapsed_ms=(time.perf_counter() - t0) * 1000.0)


def _check_audio(audio: Any) -> Optional[str]:
    if not isinstance(audio, np.ndarray) or audio.ndim != 1 or audio.dtype.kind != "f":
        return "the audio must be a 1-D float array at 16 kHz"
    if audio.size == 0:
        return "the audio is empty"
    if not np.isfinite(audio).all():
        return "the audio holds NaN or infinite samples"
    return None


class EngineTranscriber:
    """Speech recognition by the engine's own thinker, in turn-based text mode.

    ``transcribe`` calls ``engine.generate(ChatRequest(messages=[ChatMessage("user", [prompt, audio])],
    temperature=0.0, max_tokens=n, use_tts_template=False))`` with ``prompt`` from :data:`ASR_PROMPTS`
    (Chinese for ``language="zh"``, English otherwise) and ``n = min(max_tokens, min_tokens +
    ceil(tokens_per_s * seconds of audio))``, so a reply that never ends is cut at a length no real
    transcript of that audio reaches. (The model port renders a prompt holding audio with its speech
    template either way, docs/model.md §4; ``use_tts_template=False`` keeps any other engine in text
    mode.) ``cmd.prompt`` is not used.

    Args:
        engine: any :class:`~duplexkit.engine.api.Engine`.
        tokens_per_s: LLM tokens allowed per second of audio (fast speech is 3-4 words/s, about
            5 tokens/s in English).
        min_tokens: tokens allowed on top.
        max_tokens: the cap for any length of audio.
    """

    def __init__(self, engine: Any, *, tokens_per_s: float = 8.0, min_tokens: int = 16, max_tokens: int = 512) -> None:
        self.engine = engine
        self.tokens_per_s = float(tokens_per_s)
        self.min_tokens = int(min_tokens)
        self.max_tokens = int(max_tokens)

    def token_budget(self, n_samples: int) -> int:
        """``max_tokens`` for ``n_samples`` of 16 kHz audio (see the class doc)."""
        seconds = n_samples / INPUT_SAMPLE_RATE
        return max(1, min(self.max_tokens, self.min_tokens + math.ceil(self.tokens_per_s * seconds)))

    def request(self, cmd: TranscribeAudio) -> ChatRequest:
        """The chat request :meth:`transcribe` sends for ``cmd``."""
        prompt = ASR_PROMPTS["zh"] if (cmd.language or "").lower().startswith("zh") else ASR_PROMPTS["en"]
        audio = np.ascontiguousarray(cmd.audio, dtype=np.float32)
        return ChatRequest(messages=[ChatMessage("user", [prompt, audio])], temperature=0.0,
                           max_tokens=self.token_budget(audio.size), use_tts_template=False)

    async def transcribe(self, cmd: TranscribeAudio) -> Transcription:
        """The transcript (never raises; bad audio or an engine failure is the ``error``)."""
        t0 = time.perf_counter()
        bad = _check_audio(cmd.audio)
        if bad:
            return _result(cmd, t0, error=bad)
        try:
            res = await self.engine.generate(self.request(cmd))
        except Exception as exc:  # reported in the transcription, the session goes on
            return _result(cmd, t0, error=f"the engine failed to transcribe: {type(exc).__name__}: {exc}")
        return _result(cmd, t0, text=(res.text or "").strip())


class FasterWhisperTranscriber:
    """Speech recognition with faster-whisper (``pip install 'duplexkit[transcribe]'``).

    The model is loaded on the first call (in a worker thread, once); each call runs
    ``WhisperModel.transcribe(audio, language=cmd.language, initial_prompt=cmd.prompt)`` in a worker
    thread and joins the segments' text.

    Args:
        model_size: a faster-whisper model name (``tiny``, ``base``, ``small``, ``medium``,
            ``large-v3``, ...; faster-whisper downloads it on first use) or a local model directory.
        device: ``cpu``, ``cuda`` or ``auto``.
        compute_type: CTranslate2 compute type (``int8``, ``int8_float16``, ``float16``, ``float32``).
        beam_size: beam width (1 = greedy).

    Raises:
        OptionalDependencyError: ``faster_whisper`` is not installed.
    """

    def __init__(self, model_size: str = "small", device: str = "cpu", compute_type: str = "int8", *,
                 beam_size: int = 1) -> None:
        if importlib.util.find_spec("faster_whisper") is None:
            raise OptionalDependencyError("faster_whisper", "transcribe", "FasterWhisperTranscriber")
        self.model_size = model_size
        self.device = device
        self.compute_type = compute_type
        self.beam_size = int(beam_size)
        self._model = None
        self._lock = threading.Lock()

    def _load(self) -> Any:
        with self._lock:
            if self._model is None:
                from faster_whisper import WhisperModel

                self._model = WhisperModel(self.model_size, device=self.device, compute_type=self.compute_type)
            return self._model

    def _run(self, cmd: TranscribeAudio) -> str:
        model = self._load()
        segments, _info = model.transcribe(np.ascontiguousarray(cmd.audio, dtype=np.float32),
                                           language=cmd.language or None, initial_prompt=cmd.prompt or None,
                                           beam_size=self.beam_size)
        return "".join(s.text for s in segments).strip()

    async def transcribe(self, cmd: TranscribeAudio) -> Transcription:
        """The transcript (never raises; a load or recognition failure is the ``error``)."""
        t0 = time.perf_counter()
        bad = _check_audio(cmd.audio)
        if bad:
            return _result(cmd, t0, error=bad)
        try:
            text = await asyncio.to_thread(self._run, cmd)
        except Exception as exc:  # reported in the transcription
            return _result(cmd, t0, error=f"faster-whisper failed: {type(exc).__name__}: {exc}")
        return _result(cmd, t0, text=text)


def make_transcriber(name: Optional[str], engine: Any) -> Transcriber:
    """The transcriber a name asks for.

    Args:
        name: None, ``"minicpm-o"`` or ``"default"`` → :class:`EngineTranscriber` on ``engine``;
            ``"faster-whisper"`` or ``"faster-whisper:<size>"`` → :class:`FasterWhisperTranscriber`
            (size ``small`` unless given).
        engine: the engine :class:`EngineTranscriber` uses.

    Raises:
        ValueError: any other name.
        OptionalDependencyError: faster-whisper asked for but not installed.
    """
    if name is None or name in ("minicpm-o", "default"):
        return EngineTranscriber(engine)
    if name == "faster-whisper" or name.startswith("faster-whisper:"):
        size = name.partition(":")[2] or "small"
        return FasterWhisperTranscriber(size)
    raise ValueError(f"unknown transcriber {name!r}: use 'minicpm-o' (the default) or 'faster-whisper[:SIZE]'")
