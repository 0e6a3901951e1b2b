"""Reference-voice prompt features of the Code2Wav flow (docs/model.md §7.4): the released ONNX
encoders, the tiny asset set's deterministic stand-in, the 24 kHz prompt mel.

Split out of :mod:`.code2wav` (which re-exports the public names); the rules are in that module's
docstring ("Reference-voice prompt features").
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .code2wav_assets import (NUM_CODES, ONNX_FILES, PROMPT_RATE, SAMPLE_RATE, Code2WavInputError,
                              Code2WavLayoutError, _torch)


@dataclass(frozen=True)
class PromptFeatures:
    """Reference-voice prompt features of the flow (docs/model.md §7.4).

    Attributes:
        tokens: int32 [1, P] S3 prompt tokens (25 Hz).
        mel: float32 [1, 2P, 80] 24 kHz log-mel, replicate-padded to 2P frames.
        spk: float32 [1, 192] speaker x-vector.
        key: sha256 hex of the 16 kHz float32 audio bytes.
        source: ``"onnx"`` (real encoders), ``"standin"`` (tiny assets) or ``"injected"``.
    """

    tokens: Any
    mel: Any
    spk: Any
    key: str
    source: str

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[1])


def audio_sha256(audio: np.ndarray) -> str:
    """sha256 hex of ``float32`` mono audio bytes (same rule as ``ReferenceVoice.sha256``)."""
    return hashlib.sha256(np.ascontiguousarray(audio, dtype=np.float32).tobytes()).hexdigest()


def _prompt_mel_24k(audio16: np.ndarray, n_frames: int):
    torch = _torch()
    import soxr
    from stepaudio2.flashcosyvoice.utils.audio import mel_spectrogram

    a24 = soxr.resample(audio16.astype(np.float32), PROMPT_RATE, SAMPLE_RATE).astype(np.float32)
    mel = mel_spectrogram(torch.from_numpy(a24)[None])  # [1, 80, T]
    mel = mel.transpose(1, 2)  # [1, T, 80]
    if mel.shape[1] == 0:
        raise Code2WavInputError("reference audio too short for a prompt mel")
    if mel.shape[1] < n_frames:
        mel = torch.nn.functional.pad(mel, (0, 0, 0, n_frames - mel.shape[1]), mode="replicate")
    return mel[:, :n_frames].contiguous().float()


def _fbank(audio16: np.ndarray):
    torch = _torch()
    import torchaudio.compliance.kaldi as kaldi

    return kaldi.fbank(torch.from_numpy(audio16.astype(np.float32))[None], num_mel_bins=80, dither=0,
                       sample_frequency=PROMPT_RATE)


class StandinPromptEncoder:
    """Deterministic stand-in for the two ONNX prompt encoders of the tiny asset set (module docstring)."""

    source = "standin"

    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        self.proj = (rng.standard_normal((160, 192)) / np.sqrt(160)).astype(np.float32)

    def __call__(self, audio16: np.ndarray, key: str):
        torch = _torch()
        p = len(audio16) // 640
        rng = np.random.default_rng(int.from_bytes(bytes.fromhex(key)[:8], "little"))
        tokens = torch.from_numpy(rng.integers(0, NUM_CODES, size=(1, p)).astype(np.int32))
        fb = _fbank(audio16).numpy()
        stats = np.concatenate([fb.mean(0), fb.std(0)]).astype(np.float32)
        spk = stats @ self.proj
        spk = spk / max(float(np.linalg.norm(spk)), 1e-6)
        return tokens, torch.from_numpy(spk[None].astype(np.float32))


class OnnxPromptEncoder:
    """The released prompt encoders (docs/model.md §7.4): the S3 tokenizer v2 (``speech_tokenizer_v2_25hz.onnx``,
    converted to torch by ``s3tokenizer``; 128-bin log-mel at 16 kHz, 25 tokens/s) and CAM++
    (``campplus.onnx`` through onnxruntime on CPU: 80-bin Kaldi fbank at 16 kHz, dither 0, mean-normalised
    over time -> 192-d x-vector).

    Call: ``(audio16 float32 [N], key) -> (tokens int32 [1, P], spk float32 [1, 192])``.
    """

    source = "onnx"

    def __init__(self, tokenizer, campplus_session) -> None:
        self.tokenizer = tokenizer.eval()
        self.campplus = campplus_session

    @classmethod
    def from_folder(cls, folder: Path) -> "OnnxPromptEncoder":
        """Load both encoders from a 5-file token2wav folder.

        Raises:
            Code2WavLayoutError: a file is missing or cannot be loaded.
        """
        import onnxruntime
        import s3tokenizer

        for f in ONNX_FILES:
            if not (folder / f).is_file():
                raise Code2WavLayoutError(f"{folder / f} is missing (needed for reference-voice prompt features)")
        try:
            tok = s3tokenizer.load_model(str(folder / "speech_tokenizer_v2_25hz.onnx"))
        except Exception as e:  # noqa: BLE001 - third-party loaders raise many types
            raise Code2WavLayoutError(f"cannot load {folder / 'speech_tokenizer_v2_25hz.onnx'}: {e}") from e
        opt = onnxruntime.SessionOptions()
        opt.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
        opt.intra_op_num_threads = 1
        try:
            sess = onnxruntime.InferenceSession(str(folder / "campplus.onnx"), sess_options=opt,
                                                providers=["CPUExecutionProvider"])
        except Exception as e:  # noqa: BLE001
            raise Code2WavLayoutError(f"cannot load {folder / 'campplus.onnx'}: {e}") from e
        return cls(tok, sess)

    def __call__(self, audio16: np.ndarray, key: str):
        torch = _torch()
        import s3tokenizer

        with torch.inference_mode():
            mels = s3tokenizer.log_mel_spectrogram(torch.from_numpy(audio16.astype(np.float32)))
            mels, mel_lens = s3tokenizer.padding([mels])
            dev = next(self.tokenizer.parameters()).device
            tokens, tok_lens = self.tokenizer.quantize(mels.to(dev), mel_lens.to(dev))
        tokens = tokens[:, : int(tok_lens[0])].to(torch.int32).cpu()
        feat = _fbank(audio16)
        feat = feat - feat.mean(dim=0, keepdim=True)
        spk = self.campplus.run(None, {self.campplus.get_inputs()[0].name: feat[None].numpy()})[0]
        return tokens, torch.from_numpy(np.asarray(spk, dtype=np.float32).reshape(1, -1))


def _read_audio_16k(path: Path) -> np.ndarray:
    import soundfile as sf
    import soxr

    data, rate = sf.read(str(path), dtype="float32", always_2d=True)
    mono = data.mean(axis=1)
    if rate != PROMPT_RATE:
        mono = soxr.resample(mono, rate, PROMPT_RATE)
    return np.ascontiguousarray(mono, dtype=np.float32)
