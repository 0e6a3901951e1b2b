"""MiniCPM-o 4.5 Code2Wav: streaming S3 codes -> 24 kHz waveform (docs/model.md §7).

A device-agnostic streaming wrapper over the ``stepaudio2-minicpmo`` 0.1.1 model classes
(``CausalMaskedDiffWithXvec`` + ``UpsampleConformerEncoderV2`` + ``CausalConditionalCFM`` + ``DiT`` and
``HiFTGenerator``). The package's ``Token2wav`` is not used (it hard-codes CUDA and single-stream state);
this module re-implements its streaming call sequence with per-stream state:

* **Chunk contract** (docs/model.md §7.1): each synthesis call takes 3 carried + 25 new codes; the flow
  renders the first 25 and uses the last 3 as lookahead, which open the next call. A turn's first carry
  is 3 x silence code 4218. :meth:`Code2Wav.push` buffers codes and synthesises whenever 25 new codes are
  pending, or on ``last=True``. ``push(..., flush=True)`` also renders a partial block early (the
  reference's turn-start flush); such a non-final call needs >= 4 new codes, else
  :class:`ChunkBelowLookaheadError` (``chunk_below_lookahead_window``). Codes outside 0..6560 (EOS 6561,
  ``audio_bos``) raise :class:`Code2WavInputError` and nothing is consumed.
* **Holdback** (§7.3): HiFT keeps 8 mel frames, 3840 source and 3840 speech samples; non-final chunks
  withhold 3840 samples and cross-fade them into the next chunk with a 7680-sample Hamming window. A first
  chunk from a full 25-code block yields 20,160 samples, later blocks 24,000 (960 samples per code).
* **Terminal flush** (``last=True``): synthesises carry + pending codes with the lookahead padded and
  releases the held tail: ``(3 + n) * 960 + 3840`` samples after an earlier chunk (``(3 + n) * 960`` when it
  is the turn's first call). Afterwards the stream is back at the prompt-only base cache, an empty HiFT
  cache and the 3 x 4218 carry (next turn).
* **Flow cache trim**: after every chunk the estimator and conformer attention caches are trimmed exactly
  as ``Token2wav.stream`` (0.1.1) does: ``[:prompt_frames] ++ [-100:]`` along time once they exceed
  ``prompt_frames + 100``. The conformer cache is oldest-first (prompt kept, newest 100 frames kept);
  the DiT cache is newest-first (the package concatenates new keys before the cache), so there the same
  slicing keeps the newest ``prompt_frames`` frames and the oldest 100. This is the package's behaviour,
  reproduced as is.

**Scratch buffers.** ``CausalConditionalCFM`` and ``DiT`` register fixed cache buffers at construction
(16 steps x 16 blocks x 2 CFG x 8 heads x 1000 frames x 128: 2.24 GB fp32), and their returned caches are
views of them. We construct the flow on the ``meta`` device (no allocation), materialise parameters with
``to_empty`` + strict ``load_state_dict``, rebuild the non-persistent tensors (relative position tables,
the CFM noise table), and register cache buffers sized to what is actually used: ``n_timesteps`` rows,
the DiT's real depth and a frame capacity of ``2 * prompt_tokens + 100 + 56`` (grown on demand, rounded
up to 64 frames; ``torch.empty``, so untouched pages cost nothing). Tiny flow: ~20 MB of buffers instead of
2.24 GB; real flow with a 6 s prompt: ~0.6 GB, which is also the size of one stream's estimator cache.
Returned caches are cloned into the stream (never kept as views), and every call on the shared modules is
serialised by a lock. The HiFT width is read from ``hift.pt`` (released file: the package defaults 512/512).
On CPU, ``TORCHDYNAMO_DISABLE=1`` is set (unless already set) before stepaudio2 is imported.

**Randomness.** The CFM noise table (``rand_noise``, drawn from the global RNG at construction in the
package) is drawn from a fixed seed (``noise_seed``, default 0); HiFT's NSF source noise is drawn under
``torch.random.fork_rng`` seeded from (stream seed, chunk index in the turn). Output is therefore a pure
function of (voice, codes, seed): the same codes after a turn reset give the same audio.

**Reference-voice prompt features** (§7.4), cached by the sha256 of the float32 16 kHz audio bytes:
* real assets (``speech_tokenizer_v2_25hz.onnx`` + ``campplus.onnx`` present): S3 prompt tokens from the
  ONNX tokenizer (through ``s3tokenizer``), a 192-d CAM++ x-vector from 80-bin Kaldi fbank (mean-normalised)
  through onnxruntime;
* tiny assets (written by :func:`write_tiny_token2wav`, marker file ``TINY_RANDOM_WEIGHTS``, no ONNX):
  a deterministic stand-in: ``P = len(audio) // 640`` prompt tokens (25 Hz) drawn from ``0..6560`` by a
  PCG64 generator seeded with the first 8 bytes of the audio's sha256; the x-vector is a fixed seeded
  (seed 0) random projection of the per-bin mean and standard deviation of the 80-bin fbank,
  L2-normalised;
* both: the 24 kHz 80-bin mel (n_fft 1920, hop 480, win 1920, fmax 8000, ``center=False``) is computed for
  real from the audio resampled 16 -> 24 kHz (soxr), then replicate-padded (or cut) to ``2 * P`` frames.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np

from .code2wav_assets import (  # noqa: F401 - re-exported (public names of this module)
    CHUNK_CODES, FILES_5, FILES_7_MARKERS, FLOW_CACHE_TAIL_FRAMES, HOLDBACK_SAMPLES, LOOKAHEAD_CODES,
    MEL_CACHE_FRAMES, MODEL_FILES, NUM_CODES, ONNX_FILES, PROMPT_RATE, SAMPLE_RATE, SAMPLES_PER_CODE,
    SILENCE_CODE, TINY_MARKER, ChunkBelowLookaheadError, Code2WavError, Code2WavInputError, Code2WavLayoutError,
    StreamClosedError, _TINY_FLOW_YAML, _build_hift, _cpu_disable_dynamo, _load_flow_yaml, _torch,
    detect_token2wav_layout,
    find_token2wav_dir, write_tiny_token2wav)
from .code2wav_prompt import (  # noqa: F401 - re-exported
    OnnxPromptEncoder, PromptFeatures, StandinPromptEncoder, _prompt_mel_24k, _read_audio_16k, audio_sha256)

__all__ = [
    "Code2Wav",
    "Code2WavStream",
    "PromptFeatures",
    "OnnxPromptEncoder",
    "StandinPromptEncoder",
    "audio_sha256",
    "Code2WavError",
    "Code2WavLayoutError",
    "Code2WavInputError",
    "ChunkBelowLookaheadError",
    "StreamClosedError",
    "detect_token2wav_layout",
    "find_token2wav_dir",
    "write_tiny_token2wav",
    "SAMPLE_RATE",
    "SILENCE_CODE",
    "SAMPLES_PER_CODE",
    "CHUNK_CODES",
    "LOOKAHEAD_CODES",
    "HOLDBACK_SAMPLES",
]


# ----------------------------------------------------------------------------- streams
@dataclass
class Code2WavStream:
    """Per-stream vocoder state (owned by one session; never shared).

    Attributes:
        prompt: the voice's :class:`PromptFeatures`.
        seed: seed of HiFT's source noise (with the chunk index).
        carry: int64 [3] codes that open the next synthesis call (3 x 4218 at turn start).
        pending: int64 [n] buffered new codes (< 25 after each push).
        chunks: synthesis calls in the current turn.
        samples_out: samples emitted in the current turn.
        closed: set by :meth:`Code2Wav.close`.
        own_att: the estimator attention-cache tensor the batched path
            (:class:`~.fast_code2wav.BatchedCode2Wav`) allocated for this stream, or None; its next
            chunk of the same cache shape is written into it in place, so a round does not hold a
            second copy per stream (~0.25 GB at real size with float16 caches, 0.5 GB in
            float32). Dropped by a turn reset.
    """

    prompt: PromptFeatures
    seed: int
    base_cache: dict
    flow_cache: dict = field(default_factory=dict)
    hift_cache: Optional[dict] = None
    carry: np.ndarray = field(default_factory=lambda: np.full(LOOKAHEAD_CODES, SILENCE_CODE, np.int64))
    pending: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    chunks: int = 0
    samples_out: int = 0
    closed: bool = False
    own_att: Any = None


class Code2Wav:
    """Streaming codes -> 24 kHz audio for many streams over one shared flow + HiFT.

    Build with :meth:`from_pretrained`. All public methods are thread-safe (calls on the shared modules
    are serialised).
    """

    def __init__(self, flow, hift, *, prompt_encoder, device="cpu", dtype=None, n_timesteps: int = 10,
                 noise_seed: int = 0, default_voice: Optional[np.ndarray] = None, layout: str = "5-file",
                 max_cached_voices: int = 16):
        torch = _torch()
        self.torch = torch
        self.device = torch.device(device)
        self.dtype = dtype or torch.float32
        if self.dtype not in (torch.float32, torch.float16):
            raise ValueError(f"code2wav dtype must be float32 or float16 (the reference Token2wav's two modes), "
                             f"got {self.dtype}")
        self.flow = flow.eval()
        self.hift = hift.eval()
        window = getattr(hift, "stft_window", None)
        if torch.is_tensor(window):
            # a plain attribute (not a buffer) that the package's ``_stft`` / ``_istft`` move with
            # ``.to(x.device)`` on every call: from the CPU that is a pageable copy that waits for every
            # kernel queued on the stream (twice per HiFT call, benchmarks/results/2026-11-30-gpu-engine-h200.md, step 8);
            # on the HiFT's device the call is a no-op
            hift.stft_window = window.to(self.device)
        self.n_timesteps = int(n_timesteps)
        self.layout = layout
        self._encoder = prompt_encoder
        self._default_voice = default_voice
        self._lock = threading.RLock()
        self._voices: "OrderedDict[str, tuple[PromptFeatures, dict]]" = OrderedDict()
        self._max_voices = max_cached_voices
        self.prompt_cache_misses = 0
        self.up_rate = int(flow.up_rate)
        self.pre_lookahead = int(flow.pre_lookahead_len)
        if self.pre_lookahead != LOOKAHEAD_CODES or self.up_rate != 2:
            raise Code2WavLayoutError(f"flow pre_lookahead_len={self.pre_lookahead}, up_rate={self.up_rate}; "
                                      "expected 3 and 2 (docs/model.md §7.2)")
        dec = flow.decoder
        est = dec.estimator
        self._depth = len(est.blocks)
        attn = est.blocks[0].attn
        self._heads = attn.num_heads
        self._head_dim = attn.head_dim
        self._conv_ch = est.blocks[0].conv.in_channels + est.blocks[0].conv.out_channels
        self._capacity = 0
        g = torch.Generator(device="cpu").manual_seed(int(noise_seed))
        dec.rand_noise = torch.randn((1, dec.out_channels, 50 * 600), generator=g).to(self.device, self.dtype)
        # HiFT always runs in float32 (its iSTFT); only the flow follows ``dtype``
        self.speech_window = torch.from_numpy(np.hamming(2 * HOLDBACK_SAMPLES)).to(self.device, torch.float32)

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(cls, path: Union[str, Path], *, device: str = "cpu", dtype=None, n_timesteps: int = 10,
                        noise_seed: int = 0, prompt_encoder: Any = None) -> "Code2Wav":
        """Load from ``assets/token2wav/`` (or the checkpoint root / ``assets/``).

        ``flow.yaml`` is parsed with hyperpyyaml, ``flow.pt`` loads strict, ``hift.pt`` loads strict after
        stripping ``generator.``. The default voice is ``assets/HT_ref_audio.wav`` when present, else
        duplexkit's bundled ``ref_voice_16k.wav``.

        Args:
            prompt_encoder: optional replacement of the prompt encoders: a callable
                ``(audio16 float32 [N], sha256 hex) -> (tokens int32 [1, P], spk float32 [1, 192])`` with a
                ``source`` attribute. Default: :class:`OnnxPromptEncoder` for the 5-file layout, the
                documented stand-in for the tiny layout.

        Raises:
            Code2WavLayoutError: missing files, the 7-file layout, or tensors that do not match.
        """
        torch = _torch()
        folder = find_token2wav_dir(path)
        layout = detect_token2wav_layout(folder)
        device_t = torch.device(device)
        _cpu_disable_dynamo(device_t)
        dtype = dtype or torch.float32
        flow = _load_flow_yaml(folder / "flow.yaml", device_t, dtype)
        sd = torch.load(folder / "flow.pt", map_location="cpu", weights_only=True)
        try:
            flow.load_state_dict(sd, strict=True)
        except RuntimeError as e:
            raise Code2WavLayoutError(f"flow.pt does not match flow.yaml: {e}") from e
        hsd = torch.load(folder / "hift.pt", map_location="cpu", weights_only=True)
        hsd = {k[len("generator."):] if k.startswith("generator.") else k: v for k, v in hsd.items()}
        hift = _build_hift(hsd, device_t, torch.float32)
        if prompt_encoder is not None:
            encoder = prompt_encoder
        elif layout == "5-file":
            encoder = OnnxPromptEncoder.from_folder(folder)
        else:
            encoder = StandinPromptEncoder()
        default_voice = None
        for cand in (folder.parent / "HT_ref_audio.wav", folder.parent / "system_ref_audio.wav",
                     Path(__file__).resolve().parents[2] / "assets" / "ref_voice_16k.wav"):
            if cand.is_file():
                default_voice = _read_audio_16k(cand)
                break
        return cls(flow, hift, prompt_encoder=encoder, device=device_t, dtype=dtype, n_timesteps=n_timesteps,
                   noise_seed=noise_seed, default_voice=default_voice, layout=layout)

    # ------------------------------------------------------------------ voices
    def prompt_features(self, audio16: Optional[np.ndarray] = None) -> PromptFeatures:
        """Prompt features of a 16 kHz float32 mono reference clip (``None`` = the default voice), cached by
        the sha256 of its bytes.

        Raises:
            Code2WavInputError: empty / non-finite / too short (< 3 prompt tokens = 120 ms) audio, or no
                default voice available.
        """
        return self._voice(audio16)[0]

    def _voice(self, audio16: Optional[np.ndarray]):
        torch = self.torch
        if audio16 is None:
            if self._default_voice is None:
                raise Code2WavInputError("no reference voice given and no default voice available")
            audio16 = self._default_voice
        a = np.asarray(audio16)
        if a.ndim != 1 or not np.issubdtype(a.dtype, np.floating):
            raise Code2WavInputError(f"reference audio must be 1-D float 16 kHz, got {a.dtype} {a.shape}")
        a = a.astype(np.float32)
        if not np.isfinite(a).all():
            raise Code2WavInputError("reference audio contains non-finite samples")
        if len(a) < 3 * 640:
            raise Code2WavInputError(f"reference audio too short ({len(a)} samples < 1920 = 3 prompt tokens)")
        key = audio_sha256(a)
        with self._lock:
            hit = self._voices.get(key)
            if hit is not None:
                self._voices.move_to_end(key)
                return hit
            self.prompt_cache_misses += 1
            tokens, spk = self._encoder(a, key)
            if tokens.shape[1] < 3:
                raise Code2WavInputError("reference audio yields fewer than 3 prompt tokens")
            mel = _prompt_mel_24k(a, tokens.shape[1] * self.up_rate)
            pf = PromptFeatures(tokens=tokens.to(self.device), mel=mel.to(self.device, self.dtype),
                                spk=spk.to(self.device, self.dtype), key=key, source=self._encoder.source)
            base = self._setup_cache(pf)
            self._voices[key] = (pf, base)
            while len(self._voices) > self._max_voices:
                self._voices.popitem(last=False)
            return pf, base

    def _setup_cache(self, pf: PromptFeatures) -> dict:
        torch = self.torch
        self._ensure_capacity(pf.mel.shape[1])
        pad = torch.full((1, LOOKAHEAD_CODES), SILENCE_CODE, dtype=pf.tokens.dtype, device=self.device)
        with torch.inference_mode(), self.flow_autocast():
            cache = self.flow.setup_cache(torch.cat([pf.tokens, pad], dim=1), pf.mel, pf.spk,
                                          n_timesteps=self.n_timesteps)
        return {k: v.clone() for k, v in cache.items()}

    # ------------------------------------------------------------------ streams
    def new_stream(self, ref_voice: Any = None, *, seed: int = 0) -> Code2WavStream:
        """Open a stream for a reference voice.

        Args:
            ref_voice: ``duplexkit.engine.api.ReferenceVoice`` (its ``.audio``), a float32 16 kHz array, or
                ``None`` for the default voice.
            seed: seed of the vocoder's source noise (output is deterministic per (voice, codes, seed)).
        """
        audio = getattr(ref_voice, "audio", ref_voice)
        pf, base = self._voice(audio)
        st = Code2WavStream(prompt=pf, seed=int(seed), base_cache=base)
        self.reset_turn(st)
        return st

    def reset_turn(self, stream: Code2WavStream) -> None:
        """Drop pending codes and restore the prompt-only base cache, an empty HiFT cache and the 3 x 4218
        carry (what a terminal flush does after emitting).

        The stream refers to its reference voice's base cache (shared by every stream of that voice)
        instead of copying it: the flow only reads its input cache (the package's
        ``inference_chunk`` and the batched graphs copy from it; a chunk's new cache is a new tensor
        set, or, in the batched path, the stream's own tensor of its previous chunk, never the
        base), so a listening stream costs no flow-cache memory. A copy was 378 MiB per stream
        at real size (benchmarks/results/2026-12-02-gpu-engine-48-64-streams-h200.md)."""
        self._check_open(stream)
        stream.flow_cache = dict(stream.base_cache)
        stream.own_att = None
        stream.hift_cache = None
        stream.carry = np.full(LOOKAHEAD_CODES, SILENCE_CODE, np.int64)
        stream.pending = np.zeros(0, np.int64)
        stream.chunks = 0
        stream.samples_out = 0

    def close(self, stream: Code2WavStream) -> None:
        """Free the stream's caches; later calls on it raise :class:`StreamClosedError`."""
        stream.flow_cache = {}
        stream.own_att = None
        stream.hift_cache = None
        stream.base_cache = {}
        stream.pending = np.zeros(0, np.int64)
        stream.closed = True

    def push(self, stream: Code2WavStream, codes: Any, last: bool = False, *, flush: bool = False) -> np.ndarray:
        """Add codes and return the audio that became ready.

        Args:
            stream: from :meth:`new_stream`.
            codes: int [n] S3 codes in ``0..6560`` (may be empty). EOS 6561 and any other id are refused.
            last: terminal flush: synthesise everything pending (lookahead padded), release the held tail,
                then reset the stream for the next turn.
            flush: after the full 25-code blocks, synthesise the remaining pending codes now (early flush,
                non-final); that remainder must be 0 or >= 4 codes. Without ``flush`` fewer than 25 pending
                codes are simply buffered, so a talker unit that returns only a few codes is never an error.

        Returns:
            float32 [m] mono 24 kHz audio (possibly empty): 20,160 samples for a turn's first full 25-code
            block, 24,000 per later block; the terminal flush returns ``(3 + n) * 960 (+ 3840 held)``.

        Raises:
            Code2WavInputError: codes out of range / wrong type (nothing is consumed).
            ChunkBelowLookaheadError: ``flush`` with a 1..3-code remainder (nothing is consumed).
            StreamClosedError: the stream was closed.
        """
        self._check_open(stream)
        new = _check_codes(codes)
        pending = np.concatenate([stream.pending, new])
        if last:
            n_blocks = max(0, (len(pending) - 1) // CHUNK_CODES)  # the final call takes 1..25 (or 0) codes
        else:
            n_blocks = len(pending) // CHUNK_CODES
        rest = len(pending) - n_blocks * CHUNK_CODES
        if flush and not last and 0 < rest < LOOKAHEAD_CODES + 1:
            raise ChunkBelowLookaheadError(
                f"a non-final chunk needs >= {LOOKAHEAD_CODES + 1} new codes (got {rest}); "
                "push more codes or send last=True")
        out = []
        with self._lock:
            for i in range(n_blocks):
                out.append(self._synth(stream, pending[i * CHUNK_CODES:(i + 1) * CHUNK_CODES], last=False))
            pending = pending[n_blocks * CHUNK_CODES:]
            if flush and not last and len(pending) > 0:
                out.append(self._synth(stream, pending, last=False))
                pending = pending[:0]
            stream.pending = pending
            if last:
                out.append(self._synth(stream, pending, last=True))
                self.reset_turn(stream)
        if not out:
            return np.zeros(0, np.float32)
        return np.concatenate(out).astype(np.float32, copy=False)

    # ------------------------------------------------------------------ internals
    def _check_open(self, stream: Code2WavStream) -> None:
        if not isinstance(stream, Code2WavStream):
            raise TypeError("expected a Code2WavStream")
        if stream.closed:
            raise StreamClosedError("code2wav stream is closed")

    def _ensure_capacity(self, prompt_frames: int) -> None:
        """Size the CFM/DiT cache buffers for ``prompt_frames`` + 100 kept + the largest chunk (56)."""
        torch = self.torch
        need = prompt_frames + FLOW_CACHE_TAIL_FRAMES + (CHUNK_CODES + LOOKAHEAD_CODES) * self.up_rate
        if need <= self._capacity:
            return
        cap = -(-need // 64) * 64
        dec = self.flow.decoder
        est = dec.estimator
        kw = dict(device=self.device, dtype=self.dtype)
        steps, depth, h, hd2 = self.n_timesteps, self._depth, self._heads, 2 * self._head_dim
        # torch.empty: the package writes [..., :L, :] before it returns (and reads) that slice, so pages
        # beyond the frames actually used are never touched
        dec.att_cache_buffer = torch.empty(steps, depth, 2, h, cap, hd2, **kw)
        dec.cnn_cache_buffer = torch.zeros(steps, depth, 2, self._conv_ch, 2, **kw)
        est.att_cache_buffer = torch.empty(depth, 2, h, cap, hd2, **kw)
        est.cnn_cache_buffer = torch.zeros(depth, 2, self._conv_ch, 2, **kw)
        self._capacity = cap

    def _synth(self, stream: Code2WavStream, new: np.ndarray, last: bool) -> np.ndarray:
        """One flow + HiFT call on ``carry ++ new`` (caller holds the lock)."""
        mel, cache, tokens = self._flow_one(stream, new, last)
        return self._finish(stream, mel, cache, tokens, last)

    def _flow_one(self, stream: Code2WavStream, new: np.ndarray, last: bool):
        """The flow for one stream: (mel [1, 80, T], new flow caches (cloned), tokens int64 [3 + n])."""
        torch = self.torch
        pf = stream.prompt
        self._ensure_capacity(pf.mel.shape[1])
        tokens = np.concatenate([stream.carry, new])
        tok = torch.from_numpy(tokens.astype(np.int64)).to(self.device)[None]
        with torch.inference_mode(), self.flow_autocast():
            mel, cache = self.flow.inference_chunk(token=tok, spk=pf.spk, cache=stream.flow_cache,
                                                   last_chunk=last, n_timesteps=self.n_timesteps)
            cache = {k: v.clone() for k, v in cache.items()}
        return mel, cache, tokens

    def flow_autocast(self):
        """The context the flow (encoder + CFM/DiT) runs in: for a float16 flow, ``torch.autocast`` to
        float16 over the half-precision weights, as the reference's ``Token2wav(float16=True)`` does
        (stepaudio2 0.1.1 ``token2wav.py``: ``flow.half()`` and ``torch.amp.autocast("cuda",
        dtype=torch.float16)`` around every flow call); nothing for float32. HiFT is never inside it
        (float32 in both of the reference's modes). ``cache_enabled=False``: no cached weight casts
        that a CUDA-graph capture could hold on to."""
        if self.dtype == self.torch.float32:
            return contextlib.nullcontext()
        return self.torch.autocast(self.device.type, dtype=self.dtype, cache_enabled=False)

    def _hift_guard(self, last: bool):
        """Context around the HiFT call (its NSF source draws random phase). Subclasses add locks or
        backend flags (``BatchedCode2Wav``)."""
        return contextlib.nullcontext()

    def _finish(self, stream: Code2WavStream, mel, cache: dict, tokens: np.ndarray, last: bool) -> np.ndarray:
        """Everything after the flow for one stream: flow-cache trim (prompt + last 100 frames, as
        Token2wav 0.1.1), the package's HiFT with its mel/source cache under the stream's (seed, chunk)
        global seed, the 3840-sample holdback and Hamming cross-fade, the 3-code carry (docs/model.md
        §7.3). Returns float32 24 kHz audio. (:mod:`.fast_code2wav` runs HiFT for many streams in one
        call with the same per-stream noise: :mod:`.code2wav_hift`.)"""
        torch = self.torch
        with torch.inference_mode():
            cache = self._trim_flow_cache(stream, cache)
            mel, src_cache = self._hift_input(stream, mel)
            devices = [self.device.index or 0] if self.device.type == "cuda" else []
            with self._hift_guard(last), torch.random.fork_rng(devices=devices):
                torch.manual_seed(self._hift_seed(stream))
                speech, source = self.hift(mel, src_cache)
            speech = self._crossfade_and_hold(stream, mel, speech, source, last)
        return self._commit_chunk(stream, cache, tokens, last, speech[0].float().cpu().numpy())

    # pieces of _finish, shared with the batched path (mel/speech/source may be B-row tensors there)
    def _trim_flow_cache(self, stream: Code2WavStream, cache: dict) -> dict:
        """Keep the prompt frames + the last 100 of the estimator and conformer caches (Token2wav 0.1.1)."""
        torch = self.torch
        keep = stream.prompt.mel.shape[1]
        att = cache["estimator_att_cache"]
        if att.shape[4] > keep + FLOW_CACHE_TAIL_FRAMES:
            cache["estimator_att_cache"] = torch.cat(
                [att[:, :, :, :, :keep], att[:, :, :, :, -FLOW_CACHE_TAIL_FRAMES:]], dim=4)
        catt = cache["conformer_att_cache"]
        if catt.shape[3] > keep + FLOW_CACHE_TAIL_FRAMES:
            cache["conformer_att_cache"] = torch.cat(
                [catt[:, :, :, :keep, :], catt[:, :, :, -FLOW_CACHE_TAIL_FRAMES:, :]], dim=3)
        return cache

    def _hift_input(self, stream: Code2WavStream, mel):
        """(mel float32 [1, 80, 8 + T] with the cached 8 frames prepended, source cache [1, 1, 3840 or 0])."""
        torch = self.torch
        mel = mel.float()
        hc = stream.hift_cache
        if hc is None:
            return mel, torch.zeros(1, 1, 0, device=self.device, dtype=torch.float32)
        return torch.cat([hc["mel"], mel], dim=2), hc["source"]

    @staticmethod
    def _hift_seed(stream: Code2WavStream) -> int:
        """Seed of the stream's HiFT noise for its current chunk (stream seed, chunk index in the turn)."""
        return (stream.seed * 1_000_003 + stream.chunks) % (2 ** 63)

    def _crossfade_and_hold(self, streams, mel, speech, source, last: bool):
        """Cross-fade the first 3840 samples with each row's held tail (rows that have a HiFT cache:
        all or none of them), store each row's new HiFT cache (8 mel frames, 3840 source and speech
        samples) and, unless ``last``, withhold the last 3840 samples. ``streams``: one stream or a
        list (one per row). Returns speech [B, n]."""
        streams = streams if isinstance(streams, list) else [streams]
        n = HOLDBACK_SAMPLES
        if streams[0].hift_cache is not None:
            torch = self.torch
            held = streams[0].hift_cache["speech"] if len(streams) == 1 else \
                torch.cat([st.hift_cache["speech"] for st in streams], dim=0)
            speech = speech.clone()
            speech[..., :n] = speech[..., :n] * self.speech_window[:n] + held[..., -n:] * self.speech_window[n:]
        tails = (mel[..., -MEL_CACHE_FRAMES:].clone(), source[:, :, -n:].clone(), speech[:, -n:].clone())
        for b, st in enumerate(streams):
            st.hift_cache = dict(mel=tails[0][b:b + 1], source=tails[1][b:b + 1], speech=tails[2][b:b + 1])
        return speech if last else speech[:, :-n]

    @staticmethod
    def _commit_chunk(stream: Code2WavStream, cache: dict, tokens: np.ndarray, last: bool, audio: np.ndarray):
        """Store the new flow cache and the 3-code carry, count the chunk; returns ``audio``."""
        stream.flow_cache = cache
        if not last:
            stream.carry = tokens[-LOOKAHEAD_CODES:].astype(np.int64)
        stream.chunks += 1
        stream.samples_out += len(audio)
        return audio


def _check_codes(codes: Any) -> np.ndarray:
    a = np.asarray(codes.cpu() if hasattr(codes, "cpu") else codes)
    if a.size == 0:
        return np.zeros(0, np.int64)
    if a.ndim != 1:
        raise Code2WavInputError(f"codes must be 1-D, got shape {a.shape}")
    if not np.issubdtype(a.dtype, np.integer):
        raise Code2WavInputError(f"codes must be integers, got {a.dtype}")
    bad = a[(a < 0) | (a >= NUM_CODES)]
    if bad.size:
        raise Code2WavInputError(
            f"codes must be S3 codes 0..{NUM_CODES - 1}; got {sorted(set(bad.tolist()))[:5]} (EOS 6561 and "
            "audio_bos are never passed to Code2Wav, docs/model.md §7.1)")
    return a.astype(np.int64)
