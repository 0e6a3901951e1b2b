"""The MiniCPM-o 4.5 thinker: Qwen3 LLM + Whisper (``apm``) + SigLIP (``vpm``) + resampler + audio
projector, with per-stream KV caches for the duplex loop and a turn-based ``chat()``.

State-dict prefixes (docs/model.md §1.1): ``llm.`` (transformers ``Qwen3ForCausalLM``), ``apm.``
(transformers ``WhisperEncoder`` tree), ``vpm.``, ``resampler.``, ``audio_projection_layer.``.

Hidden states are always the LLM's final-norm last-layer output (what ``lm_head`` consumes).

Stream state (:class:`ThinkerStream`) holds the LLM KV (a transformers ``DynamicCache`` now; only
``get_seq_length`` and being passed as ``past_key_values`` are relied upon, so a static/batched
cache can replace it), the Whisper streaming cache, the streaming mel buffer, the turn state, the
repetition history and the pending ``terminator, </unit>`` ids fed at the next prefill.

Long sessions (docs/model.md §10/§11): before each unit's prefill the reference "basic" sliding window
(``DuplexPolicy.window_high`` / ``window_low``, default 4000 → 3500) drops the oldest whole units
after the session prefix and re-rotates the kept keys so positions stay contiguous
(:meth:`Thinker.slide_window`; the sliding window edits ``DynamicCache`` layers directly). The
Whisper streaming cache resets itself at 1500 positions (:mod:`.audio_encoder`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .audio_encoder import AudioEncoder, AudioProjector, WhisperStreamCache
from .chat import chat_generate, chat_steps
from .chat_types import ChatThinkerResult
from .config import MiniCPMOConfig
from .duplex import DuplexPolicy, UnitInput, UnitResult, run_unit
from .processor import SAMPLE_RATE, StreamingMel, audio_embed_count, image_to_pixels, log_mel_offline
from .sampling import device_tensor
from .tokenizer import SpecialTokens, encode_control, encode_text
from .vision import Resampler, VisionTower

__all__ = ["ThinkerModules", "Thinker", "ThinkerStream", "DEFAULT_INSTRUCTIONS", "rerotate_keys"]

DEFAULT_INSTRUCTIONS = "Streaming Omni Conversation."
"""Default duplex system text (docs/model.md §5.1)."""

_stream_ids = itertools.count()


def _cache_kw() -> str:
    """Name of the KV-cache argument of ``Qwen3Model.forward`` (``cache`` in transformers ≥ 5.x,
    ``past_key_values`` before)."""
    import inspect

    from transformers import Qwen3Model

    params = inspect.signature(Qwen3Model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


_CACHE_KW = _cache_kw()


def rerotate_keys(keys: torch.Tensor, delta: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Move RoPE-rotated keys by ``delta`` positions (the sliding window, docs/model.md §10/§11).

    RoPE rotates each pair ``(i, i + D/2)`` by ``pos · inv_freq[i]`` (transformers' ``rotate_half``
    layout), so a key at position p becomes the key at p + delta by one more rotation of
    ``delta · inv_freq`` (exact up to rounding; computed in float64/float32, returned in the
    keys' dtype). Any ``attention_scaling`` factor already in the keys is kept.

    Args:
        keys: [..., T, D] cached (post-RoPE) keys.
        delta: position shift (negative when positions are dropped before the keys).
        inv_freq: [D/2] the model's rotary inverse frequencies (``rotary_emb.inv_freq``).
    Returns:
        [..., T, D] re-rotated keys.
    """
    if delta == 0 or keys.numel() == 0:
        return keys
    ang = inv_freq.detach().to(device=keys.device, dtype=torch.float64) * float(delta)
    ang = torch.cat([ang, ang])
    cos = torch.cos(ang).to(torch.float32)
    sin = torch.sin(ang).to(torch.float32)
    x = keys.float()
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rot * sin).to(keys.dtype)


class ThinkerModules(nn.Module):
    """The thinker's parameters under the checkpoint's key prefixes."""

    def __init__(self, cfg: MiniCPMOConfig) -> None:
        super().__init__()
        from transformers import Qwen3ForCausalLM

        self.llm = Qwen3ForCausalLM(cfg.to_qwen3_config())
        if cfg.init_vision:
            self.vpm = VisionTower(cfg)
            self.resampler = Resampler(cfg.query_num, cfg.hidden_size, cfg.vision_config.hidden_size)
        if cfg.init_audio:
            self.apm = AudioEncoder.build(cfg.audio_config)
            self.audio_projection_layer = AudioProjector(cfg.audio_config.encoder_ffn_dim // 4, cfg.hidden_size)


@dataclass
class ThinkerStream:
    """Per-stream duplex state (see module doc). Create with :meth:`Thinker.new_stream`."""

    stream_id: str
    policy: DuplexPolicy
    kv: object
    generator: Optional[torch.Generator]
    whisper: WhisperStreamCache = field(default_factory=WhisperStreamCache)
    mel: StreamingMel = field(default_factory=StreamingMel)
    pending_ids: List[int] = field(default_factory=list)
    history: List[int] = field(default_factory=list)
    turn_ended: bool = True
    force_speak_pending: bool = False
    units_done: int = 0
    prefix_len: int = 0
    closed: bool = False
    last_prefill_logits: Optional[torch.Tensor] = None
    last_audio_embeds: Optional[torch.Tensor] = None
    last_mel: Optional[np.ndarray] = None
    unit_starts: List[int] = field(default_factory=list)
    """KV positions of the ``<unit>`` token of each unit still in the cache (sliding window)."""
    window_slides: int = 0
    """Times the sliding window dropped units (:meth:`Thinker.slide_window`)."""
    window_dropped: int = 0
    """Positions dropped by the sliding window so far (pending ids of a dropped unit included)."""
    forced: List[Tuple[Tuple[int, ...], int]] = field(default_factory=list)
    """Forced speech not yet spoken (:meth:`Thinker.speak_text`): ``(text ids left, tokens per unit)``
    per queued text, oldest first; replaced, never changed in place (:func:`.duplex.finish_row`)."""

    @property
    def position(self) -> int:
        """Sequence length including the pending terminator/``</unit>`` ids."""
        return (self.kv.get_seq_length() if self.kv is not None else 0) + len(self.pending_ids)

    @property
    def turn_open(self) -> bool:
        return not self.turn_ended


class Thinker:
    """Runtime wrapper around :class:`ThinkerModules` (docs/model.md, "Components")."""

    def __init__(self, modules: ThinkerModules, config: MiniCPMOConfig, tokenizer, special: SpecialTokens, device="cpu", dtype=torch.float32):
        self.m = modules
        self.config = config
        self.tokenizer = tokenizer
        self.special = special
        self.device = torch.device(device)
        self.dtype = dtype
        self.hidden_size = config.hidden_size
        self.audio = AudioEncoder(modules.apm) if hasattr(modules, "apm") else None
        bad = list(getattr(tokenizer, "bad_token_ids", []) or [])
        forb = sorted(set([special.tts_pad] + bad + [special.chunk_eos]))
        self.forbidden_ids = [i for i in forb if 0 <= i < config.vocab_size]
        self._forbidden_t = {}
        self.continue_mask_ids = sorted(set(special.terminators) | {special.turn_eos})
        self._continue_t = {}
        self.policy_defaults: dict = {}
        """Extra :class:`DuplexPolicy` fields applied to every stream opened later without an
        explicit ``policy`` (an engine-wide option, e.g. ``{"min_unit_tokens": 5,
        "max_unit_tokens": 5}`` for fixed-size speaking units in load tests)."""

    # ------------------------------------------------------------------------------ basics
    def forbidden_ids_tensor(self, device) -> torch.Tensor:
        key = str(device)
        t = self._forbidden_t.get(key)
        if t is None:
            t = torch.tensor(self.forbidden_ids, dtype=torch.long, device=device)
            self._forbidden_t[key] = t
        return t

    def continue_mask_ids_tensor(self, device) -> torch.Tensor:
        """Ids masked while ``DuplexPolicy.min_unit_tokens`` is not reached (terminators + turn_eos)."""
        key = str(device)
        t = self._continue_t.get(key)
        if t is None:
            t = torch.tensor(self.continue_mask_ids, dtype=torch.long, device=device)
            self._continue_t[key] = t
        return t

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache()

    def _stream_cache(self):
        """The KV of a new duplex stream (a ``DynamicCache`` here; the fast thinker uses a static slot)."""
        return self.new_cache()

    def embed_ids(self, ids: Sequence[int]) -> torch.Tensor:
        """int ids -> LLM input embeddings [T, H] (model dtype)."""
        t = device_tensor(list(ids), self.device, torch.long)  # pinned, no host sync on CUDA
        return self.m.llm.model.embed_tokens(t)

    def forward_embeds(self, embeds: torch.Tensor, kv) -> torch.Tensor:
        """Run [T, H] embeddings on top of ``kv`` (updated in place) -> final-norm hidden [T, H]."""
        kw = {_CACHE_KW: kv}
        out = self.m.llm.model(inputs_embeds=embeds.unsqueeze(0), use_cache=True, **kw)
        return out.last_hidden_state[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """final-norm hidden [..., H] -> float32 logits [..., V]."""
        return self.m.llm.lm_head(hidden).float()

    # ------------------------------------------------------------------------------ audio
    @torch.inference_mode()
    def audio_embeds_offline(self, audio: np.ndarray, block_mask: bool = True) -> torch.Tensor:
        """Offline audio embeddings (chat()/prepare(); parity case b). float32 16 kHz [N] -> [n, H].

        Audio longer than 30 s is encoded in 30 s pieces (docs/model.md §3.1) and concatenated; n is
        the sum of :func:`audio_embed_count` over the pieces (0 for under ~80 ms).
        """
        if self.audio is None:
            raise ValueError("this checkpoint has no audio encoder (init_audio false)")
        a = np.asarray(audio, dtype=np.float32)
        outs = []
        step = 30 * SAMPLE_RATE
        for s in range(0, max(1, a.size), step):
            piece = a[s : s + step]
            n = audio_embed_count(piece.size, self.config.audio_pool_step)
            if n == 0:
                continue
            mel = torch.from_numpy(log_mel_offline(piece)).to(self.device, self.dtype)
            h = self.audio.encode_offline(mel, block_mask=block_mask)
            outs.append(self._project_pool(h)[:n])
        if not outs:
            return torch.zeros(0, self.hidden_size, dtype=self.dtype, device=self.device)
        return torch.cat(outs)

    def _project_pool(self, h: torch.Tensor) -> torch.Tensor:
        p = self.m.audio_projection_layer(h)  # [T, H]
        k = self.config.audio_pool_step
        return F.avg_pool1d(p.t().unsqueeze(0), kernel_size=k, stride=k)[0].t()

    @torch.inference_mode()
    def audio_embeds_stream(self, st: ThinkerStream, audio: np.ndarray) -> torch.Tensor:
        """Streaming audio embeddings of one unit (parity case f) -> [10, H]; updates the stream."""
        if self.audio is None:
            raise ValueError("this checkpoint has no audio encoder (init_audio false)")
        first = st.mel.unit_index == 0
        mel = st.mel.push(audio)
        st.last_mel = mel
        h = self.audio.encode_stream(torch.from_numpy(mel).to(self.device, self.dtype), st.whisper, first)
        return self._project_pool(h)

    # ------------------------------------------------------------------------------ vision
    @torch.inference_mode()
    def image_embeds(self, image) -> torch.Tensor:
        """One image (RGB uint8 [H, W, 3] or PIL) as a single 448 px slice -> [64, H] (parity case c)."""
        if not hasattr(self.m, "vpm"):
            raise ValueError("this checkpoint has no vision tower (init_vision false)")
        pixels, grid = image_to_pixels(image, self.config.slice_config.get("scale_resolution", 448), self.config.patch_size)
        return self.image_embeds_from_pixels(torch.from_numpy(pixels), grid)

    def image_embeds_from_pixels(self, pixels: torch.Tensor, grid: Tuple[int, int]) -> torch.Tensor:
        x = self.m.vpm(pixels.to(self.device, self.dtype), grid)
        return self.m.resampler(x, grid)

    def image_placeholder_ids(self, index: Optional[int]) -> Tuple[List[int], int]:
        """``[<image_id>k</image_id>]<image>`` + 64 unk + ``</image>`` ids and the offset of the first unk."""
        sp = self.special
        ids: List[int] = []
        if index is not None and self.config.use_image_id:
            ids += [sp.image_id] + encode_text(self.tokenizer, str(index)) + [sp.image_id_end]
        ids.append(sp.image)
        off = len(ids)
        ids += [sp.unk] * self.config.query_num + [sp.image_end]
        return ids, off

    # ------------------------------------------------------------------------------ duplex
    @torch.inference_mode()
    def stream_policy(self, temperature: float = 0.7, force_listen_count: int = 0,
                      policy: Optional[DuplexPolicy] = None) -> DuplexPolicy:
        """``policy`` when given, else a :class:`DuplexPolicy` of ``temperature`` (0-2; 0 = greedy)
        and ``force_listen_count`` (>= 0) over the engine-wide :attr:`policy_defaults`.

        Raises:
            ValueError: ``temperature`` outside [0, 2] or a negative ``force_listen_count``.
        """
        if policy is not None:
            return policy
        if not 0.0 <= float(temperature) <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {temperature}")
        if force_listen_count < 0:
            raise ValueError("force_listen_count must be >= 0")
        return DuplexPolicy(temperature=float(temperature), force_listen_count=int(force_listen_count),
                            **self.policy_defaults)

    def new_stream(
        self,
        instructions: Optional[str] = None,
        ref_audio: Optional[np.ndarray] = None,
        seed_text: Optional[str] = None,
        temperature: float = 0.7,
        seed: Optional[int] = None,
        force_listen_count: int = 0,
        policy: Optional[DuplexPolicy] = None,
    ) -> ThinkerStream:
        """Open a duplex stream and prefill the session prefix (docs/model.md §5.1).

        Prefix: ``<|im_start|>system\\n{instructions}\\n<|audio_start|>`` + ref-audio embeddings
        (offline path, 10/s) + ``<|audio_end|><|im_end|>``; without ``ref_audio``:
        ``<|im_start|>system\\n{instructions}<|im_end|>``. ``seed_text`` appends a user turn
        ``<|im_start|>user\\n{seed_text}<|im_end|>``. Instructions and seed text are encoded as
        plain text (special-token strings inside them stay text).

        Args:
            ref_audio: float32 [N] 16 kHz mono, or None.
            temperature: 0.0 = greedy.
            seed: RNG seed for sampling (None = nondeterministic).
            policy: full policy override (its temperature/force_listen_count win).
        Raises:
            ValueError: bad argument values.
        """
        policy = self.stream_policy(temperature, force_listen_count, policy)
        gen = None
        if policy.temperature > 0:
            gen = torch.Generator()
            if seed is not None:
                gen.manual_seed(int(seed))
            else:
                gen.seed()
        st = ThinkerStream(stream_id=f"ts{next(_stream_ids)}", policy=policy, kv=self._stream_cache(), generator=gen)
        pieces = self.session_prefix(instructions, ref_audio, seed_text)
        # inference mode, as every unit and chat pass: the CUDA-graph input buffers of the fast thinker are
        # inference tensors (captured under it), and an in-place copy into one outside it is refused
        with torch.inference_mode():
            self.forward_embeds(torch.cat([self.embed_ids(p) if isinstance(p, list) else p for p in pieces]), st.kv)
        st.prefix_len = st.kv.get_seq_length()
        if policy.window_low is not None and st.prefix_len >= policy.window_low:
            self.close(st)
            raise ValueError(f"session prefix of {st.prefix_len} positions does not fit the sliding window "
                             f"(window_low {policy.window_low}); shorten the instructions / reference voice "
                             "or raise the window")
        return st

    @torch.inference_mode()
    def session_prefix(self, instructions: Optional[str] = None, ref_audio: Optional[np.ndarray] = None,
                       seed_text: Optional[str] = None) -> List[object]:
        """The session prefix of :meth:`new_stream` as pieces in order: token-id lists (``List[int]``)
        and audio-embedding tensors ([n, H], model dtype; the reference voice, offline path).
        Also used by the vLLM thinker (:mod:`duplexkit.engine.vllm_duplex`)."""
        sp = self.special
        text = DEFAULT_INSTRUCTIONS if instructions is None else str(instructions)
        pieces: List[object] = []
        if ref_audio is not None and len(ref_audio) > 0:
            pieces.append([sp.im_start] + encode_control(self.tokenizer, "system\n") + encode_text(self.tokenizer, text + "\n")
                          + [sp.audio_start])
            pieces.append(self.audio_embeds_offline(np.asarray(ref_audio, np.float32)).to(self.dtype))
            pieces.append([sp.audio_end, sp.im_end])
        else:
            pieces.append([sp.im_start] + encode_control(self.tokenizer, "system\n") + encode_text(self.tokenizer, text) + [sp.im_end])
        if seed_text:
            pieces.append([sp.im_start] + encode_control(self.tokenizer, "user\n") + encode_text(self.tokenizer, str(seed_text))
                          + [sp.im_end])
        return pieces

    def prefill_unit(self, st: ThinkerStream, audio: np.ndarray, frame: Optional[np.ndarray]) -> torch.Tensor:
        """Feed pending ids + ``<unit>`` [+ image] + 10 audio embeddings; return float32 logits [V].

        First applies the sliding window (:meth:`slide_window`) for this unit's largest size.
        """
        sp = self.special
        aud = self.audio_embeds_stream(st, audio).to(self.dtype)
        st.last_audio_embeds = aud
        upcoming = 1 + aud.shape[0] + (self.config.query_num + 2 if frame is not None else 0) + st.policy.unit_limit() - 1
        self.slide_window(st, upcoming)
        st.unit_starts.append(st.kv.get_seq_length() + len(st.pending_ids))
        pieces = [self.embed_ids(st.pending_ids + [sp.unit])]
        if frame is not None:
            img = self.image_embeds(frame).to(self.dtype)
            pieces += [self.embed_ids([sp.image]), img, self.embed_ids([sp.image_end])]
        pieces.append(aud)
        h = self.forward_embeds(torch.cat(pieces), st.kv)
        st.pending_ids = []
        logits = self.logits(h[-1])
        st.last_prefill_logits = logits
        return logits

    # ------------------------------------------------------------------------------ sliding window
    def window_plan(self, st: ThinkerStream, upcoming: int) -> Optional[Tuple[int, int, bool]]:
        """Plan the sliding window (reference "basic" window, docs/model.md §10/§11) before a unit.

        Args:
            upcoming: the largest number of KV positions the next unit can add besides the pending
                ids (``<unit>`` + image block + audio embeddings + ``unit_limit() − 1`` fed tokens).
        Returns:
            None when ``kv + pending + upcoming <= window_high`` (or the window is off); else
            ``(lo, cut, drop_pending)``: drop KV positions ``[lo, cut)`` with ``lo = prefix_len``
            and ``cut`` the ``<unit>`` position of the oldest unit kept (or the cache end, then the
            pending terminator/``</unit>`` of the last unit go too), the smallest such cut leaving at
            most ``min(window_low, window_high − upcoming)`` positions. Whole units only: a unit's
            image block, text and terminator leave together.
        Raises:
            ValueError: the session prefix plus one unit does not fit under ``window_high``.
        """
        pol = st.policy
        if pol.window_high is None or st.kv is None:
            return None
        kv_len = st.kv.get_seq_length()
        pend = len(st.pending_ids)
        if kv_len + pend + upcoming <= pol.window_high:
            return None
        p = st.prefix_len
        target = min(pol.window_low, pol.window_high - upcoming)
        for cut in [s for s in st.unit_starts if p < s < kv_len] + [kv_len]:
            keep = kv_len - cut + (pend if cut < kv_len else 0)
            if p + keep <= target:
                return p, cut, cut >= kv_len
        raise ValueError(f"sliding window too small: session prefix {p} + a unit of up to {upcoming} positions "
                         f"exceeds window_high {pol.window_high}")

    def slide_window(self, st: ThinkerStream, upcoming: int) -> int:
        """Apply :meth:`window_plan`; returns the number of positions dropped (0 = no slide).

        Positions (the reference's choice): the kept keys are re-rotated by ``−(cut − lo)`` RoPE
        steps (:func:`rerotate_keys`), so the cache stays contiguous, its length equals the next
        position and positions never exceed ``window_high``; values and the prefix are untouched
        (the prefix stays byte-identical). Attention inside the kept tail keeps its relative
        positions; the tail's states were computed with the dropped units in context (as in the
        reference, nothing is recomputed).
        """
        plan = self.window_plan(st, upcoming)
        if plan is None:
            return 0
        lo, cut, drop_pending = plan
        n = cut - lo
        self._drop_kv_range(st.kv, lo, cut)
        dropped = n + (len(st.pending_ids) if drop_pending else 0)
        if drop_pending:
            st.pending_ids = []
        st.unit_starts = [s - n for s in st.unit_starts if s >= cut]
        st.window_slides += 1
        st.window_dropped += dropped
        return dropped

    def _drop_kv_range(self, kv, lo: int, hi: int) -> None:
        """Remove KV positions ``[lo, hi)`` of a ``DynamicCache`` in place, re-rotating the keys after
        ``hi`` by ``−(hi − lo)`` positions. Raises ``TypeError`` for other cache types."""
        layers = getattr(kv, "layers", None)
        if layers is None:
            raise TypeError(f"the sliding window needs a transformers DynamicCache, got {type(kv).__name__}")
        inv_freq = self.m.llm.model.rotary_emb.inv_freq
        for layer in layers:
            k, v = layer.keys, layer.values
            if k is None or k.numel() == 0:
                continue
            layer.keys = torch.cat([k[..., :lo, :], rerotate_keys(k[..., hi:, :], lo - hi, inv_freq)], dim=-2)
            layer.values = torch.cat([v[..., :lo, :], v[..., hi:, :]], dim=-2)

    def feed_token(self, st: ThinkerStream, tok: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Feed one decided token -> (final-norm hidden [H] at its input position, float32 logits [V])."""
        h = self.forward_embeds(self.embed_ids([tok]), st.kv)[-1]
        return h, self.logits(h)

    def step_units(self, items: List[UnitInput]) -> List[UnitResult]:
        """Run one unit for each item (each a different stream; loops per stream for now)."""
        seen = set()
        for it in items:
            if id(it.stream) in seen:
                raise ValueError("step_units got the same stream twice in one batch")
            seen.add(id(it.stream))
        return [run_unit(self, it) for it in items]

    def speak_text(self, st: ThinkerStream, text: str, tokens_per_unit: int = 6) -> int:
        """Queue forced speech (``engine.api.SpeakText``, docs/model.md "Forced speech"): from the stream's
        next unit on, each unit speaks the next at most ``tokens_per_unit`` tokens of ``text`` (encoded as
        plain text, :func:`.tokenizer.encode_text`), then ``<|turn_eos|>`` ends the turn
        (:func:`.duplex.forced_plan`). A second text is spoken after the first, in a turn of its own.

        Returns the number of text tokens queued. Nothing changes when it raises.

        Raises:
            ValueError: a closed stream, ``text`` that is not a non-empty string (or encodes to no
                token), ``tokens_per_unit`` < 1, or a policy whose units cannot hold ``<|speak|>`` and
                a text token before the cut (``unit_limit() < 3``).
        """
        if st.closed:
            raise ValueError(f"stream {st.stream_id} is closed")
        if not isinstance(text, str) or not text:
            raise ValueError("forced speech needs a non-empty text")
        if int(tokens_per_unit) < 1:
            raise ValueError(f"tokens_per_unit must be >= 1, got {tokens_per_unit}")
        if st.policy.unit_limit() < 3:
            raise ValueError(f"units of {st.policy.unit_limit()} steps cannot hold forced speech "
                             "(<|speak|>, a text token and the cut need 3)")
        ids = tuple(int(i) for i in encode_text(self.tokenizer, text))
        if not ids:
            raise ValueError(f"text {text!r} encodes to no token")
        st.forced = list(st.forced) + [(ids, int(tokens_per_unit))]
        return len(ids)

    def end_turn(self, st: ThinkerStream) -> None:
        """Close the open model turn after a cancel (turn state "ended"; a pending force_speak and the
        forced speech not yet spoken are dropped).

        The KV stays consistent: every unit already ends with its terminator and ``</unit>``.
        """
        st.turn_ended = True
        st.force_speak_pending = False
        st.forced = []

    def close(self, st: ThinkerStream) -> None:
        """Free the stream's KV and caches; later use raises ``ValueError``."""
        st.closed = True
        st.kv = None
        st.whisper.clear()
        st.mel.reset()
        st.pending_ids = []
        st.history = []
        st.unit_starts = []
        st.forced = []

    # ------------------------------------------------------------------------------ chat
    def chat(self, messages, *, use_tts_template: Optional[bool] = None, enable_thinking: bool = False, max_tokens: int = 512,
             temperature: float = 0.7, seed: Optional[int] = None, **kw) -> ChatThinkerResult:
        """Turn-based generation (docs/model.md §4); see :func:`duplexkit.models.minicpmo45.chat.chat_generate`."""
        return chat_generate(self, messages, use_tts_template=use_tts_template, enable_thinking=enable_thinking,
                             max_tokens=max_tokens, temperature=temperature, seed=seed, **kw)

    def chat_steps(self, messages, **kw):
        """:meth:`chat` one step at a time: a generator yielding after the prefill and after each
        token, returning the :class:`ChatThinkerResult` (:func:`duplexkit.models.minicpmo45.chat.chat_steps`)."""
        return chat_steps(self, messages, **kw)
