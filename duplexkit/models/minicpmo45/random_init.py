"""Real-size MiniCPM-o 4.5 with random weights, built directly on the target device.

For load tests and benchmarks where no checkpoint is available (``benchmarks/gpu_engine.py``):
every module is constructed on the ``meta`` device, cast to the target dtype there, then
materialised with ``to_empty`` on the target device and filled with random values in place, so
the ~18.7 GB of bf16 weights (docs/model.md §1.1) never exist as a CPU copy.

* sizes: :func:`real_config_dict` — docs/model.md §1.1 (Qwen3 8.19 B: vocab 151,748, hidden 4096, 36
  layers, 32 q / 8 KV heads, head_dim 128, FFN 12,288; SigLIP 27 layers; Whisper-medium encoder;
  talker Llama 768 x 20 layers, 12 heads, FFN 3072, emb_text 152,064 rows, audio_bos 151687 /
  text_eos 151692 from ``tts_config``);
* token2wav: the released flow geometry (docs/model.md §7.2: conformer 6 + 4 up-blocks 512 wide, FFN
  2048, DiT depth 16, 8 x 64 heads, hidden 512, 10 Euler steps) and HiFT at the package's default
  widths (base 512, F0 predictor 512), with the stand-in prompt features of the tiny layout
  (no ONNX encoders, :class:`~.code2wav.StandinPromptEncoder`);
* tokenizer: the tiny builder's own BPE + every special token (ids resolved by string; the LLM
  vocabulary stays 151,748, so sampled ids above the tokenizer's range decode to nothing);
* values: N(0, 0.02) for weights, 1 + 0.02·z for norm gains (the tiny builder's rule);
  ``MiniCPMO45.random_weights`` is True. Outputs are meaningless: decisions must be forced
  (``DuplexPolicy.min_unit_tokens`` / ``max_unit_tokens`` + ``force_speak``).

``size="tiny"`` builds the tiny configuration the same way (for debugging the benchmark on a CPU).
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path
from typing import Optional, Union

import torch
from torch import nn

from .meta import meta_device
from .loader import MiniCPMO45

__all__ = ["real_config_dict", "build_random_model", "build_random_talker", "REAL_TTS", "REAL_FLOW"]

REAL_TTS = dict(llm_dim=4096, hidden_size=768, intermediate_size=3072, num_attention_heads=12,
                num_key_value_heads=12, num_hidden_layers=20, max_position_embeddings=4096,
                num_audio_tokens=6562, num_text_tokens=152064, audio_bos_token_id=151687, text_eos_token_id=151692)
"""Talker sizes and ids (docs/model.md §1.1, §6; real sizes)."""

REAL_FLOW = dict(enc=6, up=4, dit=16, ffn=2048)
"""Flow geometry of the released token2wav (docs/model.md §7.2)."""


def real_config_dict(vocab_size: int = 151748, eos_ids=(151645, 151643), pad_id: int = 151643) -> dict:
    """config.json of the real model (docs/model.md §1.1) in the layout :class:`MiniCPMOConfig` reads."""
    from .tiny import tiny_config_dict

    d = tiny_config_dict(vocab_size, list(eos_ids), pad_id, REAL_TTS["audio_bos_token_id"], REAL_TTS["text_eos_token_id"])
    d.update(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
             num_key_value_heads=8, head_dim=128, torch_dtype="bfloat16")
    d["vision_config"].update(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16)
    d["audio_config"].update(d_model=1024, encoder_layers=24, encoder_attention_heads=16, encoder_ffn_dim=4096,
                             decoder_layers=24, decoder_attention_heads=16, decoder_ffn_dim=4096)
    d["tts_config"].update({k: v for k, v in REAL_TTS.items()})
    return d


def _is_gain(name: str, p: torch.Tensor) -> bool:
    if name.endswith("parametrizations.weight.original0"):
        return True
    parts = name.split(".")
    return p.ndim == 1 and parts[-1] == "weight" and len(parts) > 1 and ("norm" in parts[-2] or parts[-2].startswith("ln_"))


def _materialise(module: nn.Module, device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> nn.Module:
    """meta module -> random values on ``device`` in ``dtype``; rotary (and any other computed)
    buffers are rebuilt on the CPU first and kept in float32."""
    for name, mod in list(module.named_modules()):
        if any(b is not None and b.is_meta for b in mod._buffers.values()):
            if "Rotary" not in type(mod).__name__:
                raise RuntimeError(f"module {name} ({type(mod).__name__}) has meta buffers that cannot be rebuilt")
            parent_name, _, attr = name.rpartition(".")
            parent = module.get_submodule(parent_name) if parent_name else module
            with torch.device("cpu"):
                setattr(parent, attr, type(mod)(config=mod.config))
    saved = {}
    for mname, mod in module.named_modules():
        for bname, b in mod._buffers.items():
            if b is not None and not b.is_meta:
                saved[(mname, bname)] = b.detach().clone()
    module.to(dtype=dtype)
    module.to_empty(device=device)
    for (mname, bname), b in saved.items():
        mod = module.get_submodule(mname) if mname else module
        mod._buffers[bname] = b.to(device)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.normal_(0.0, 0.02, generator=gen)
            if _is_gain(name, p):
                p.add_(1.0)
    return module.eval().requires_grad_(False)


def _tokenizer(tmp: Path, tokenizer_dir: Optional[Union[str, Path]] = None):
    from .tiny import _write_tokenizer
    from .tokenizer import SpecialTokens, load_tokenizer

    if tokenizer_dir is not None:
        tok = load_tokenizer(Path(tokenizer_dir))
    else:
        _write_tokenizer(tmp)
        tok = load_tokenizer(tmp)
    return tok, SpecialTokens.resolve(tok)


def _random_code2wav(tmp: Path, device: torch.device, gen: torch.Generator, real: bool, batched: bool = True,
                     dtype: Optional[torch.dtype] = None):
    """A random-weight Code2Wav (real or tiny flow geometry, the package's HiFT). The flow's weights
    are drawn in float32 and then cast to ``dtype`` (float32 default, or float16: the same model in the
    reference's half-precision mode), so runs that differ only in ``dtype`` compare like for like."""
    import numpy as np

    from . import code2wav as c2w

    torch_ = c2w._torch()
    geo = REAL_FLOW if real else dict(enc=1, up=1, dit=2, ffn=256)
    d = tmp / "token2wav"
    d.mkdir(parents=True, exist_ok=True)
    (d / "flow.yaml").write_text(c2w._TINY_FLOW_YAML.format(seed=0, mlp_ratio=float(geo["ffn"]) / 512.0, **geo))
    flow = c2w._load_flow_yaml(d / "flow.yaml", device, torch_.float32)
    with torch_.no_grad():
        for name, p in sorted(flow.named_parameters()):
            if p.ndim == 1 and name.endswith("weight"):
                p.fill_(1.0)
            elif name.endswith("bias") or p.ndim == 1:
                p.normal_(0.0, 0.01, generator=gen)
            else:
                p.normal_(0.0, 1.0 / float(np.sqrt(int(np.prod(p.shape[1:])))), generator=gen)
    dtype = dtype or torch_.float32
    flow = flow.to(dtype)
    from stepaudio2.flashcosyvoice.modules.hifigan import ConvRNNF0Predictor, HiFTGenerator

    width = 512 if real else 64
    with torch_.random.fork_rng(devices=[]):
        torch_.manual_seed(1)
        hift = HiFTGenerator(base_channels=width, f0_predictor=ConvRNNF0Predictor(cond_channels=width))
    hift = hift.to(device=device, dtype=torch_.float32).eval()
    voice = c2w._read_audio_16k(Path(__file__).resolve().parents[2] / "assets" / "ref_voice_16k.wav")
    if batched:
        from .fast_code2wav import BatchedCode2Wav as cls
    else:
        cls = c2w.Code2Wav
    return cls(flow, hift, prompt_encoder=c2w.StandinPromptEncoder(), device=device, dtype=dtype,
                        default_voice=voice, layout="tiny")


def build_random_model(size: str = "real", *, dtype: torch.dtype = torch.bfloat16,
                       device: Union[str, torch.device] = "cuda", seed: int = 0, with_code2wav: bool = True,
                       fast: Optional[bool] = None, thinker_max_len: int = 8192, kv_slots: int = 4,
                       code2wav_dtype: Optional[torch.dtype] = None,
                       tokenizer_dir: Optional[Union[str, Path]] = None,
                       quantization: Optional[str] = None,
                       fast_options: Optional[dict] = None) -> MiniCPMO45:
    """Build MiniCPM-o 4.5 with random weights directly on ``device`` (see module doc).

    Args:
        size: ``"real"`` (docs/model.md §1.1) or ``"tiny"`` (docs/model.md §9 sizes).
        dtype: thinker / talker dtype.
        code2wav_dtype: the Code2Wav flow's dtype, float32 (default, the bundled layouts' choice) or
            float16 (the reference's ``Token2wav(float16=True)``); HiFT runs in float32 either way.
        fast: use the batched fast paths (:class:`~.fast_thinker.FastThinker`,
            :class:`~.fast_talker.FastTalker`, :class:`~.fast_code2wav.BatchedCode2Wav`); default: on CUDA.
        thinker_max_len / kv_slots: static KV positions per stream and initial slots (fast path).
        tokenizer_dir: a checkpoint's tokenizer files (``tokenizer_config.json`` + ``vocab.json`` /
            ``merges.txt`` or ``tokenizer.json``), e.g. the real MiniCPM-o 4.5 tokenizer, so that text
            costs as many tokens as with the released model (tool-call benchmarks); ``size`` must be
            ``"real"``. None: the tiny builder's small BPE.
        quantization: ``none`` (default), ``int8`` or ``fp8`` for the thinker's and talker's decoder
            linears (:mod:`.quantization`): the random bf16 weights are drawn first, then quantized
            (so runs that differ only here compare like for like); the reports are in
            ``MiniCPMO45.quantization``.
        fast_options: the fast paths' keyword arguments per stage, as ``loader.load`` takes them (a
            memory plan's, ``duplexkit.engine.memory_plan.fast_options``); the thinker's override
            ``thinker_max_len`` / ``kv_slots``.
    Returns:
        :class:`MiniCPMO45` with ``random_weights=True`` (``model_dir`` None).
    Raises:
        QuantizationError: an unknown or unavailable quantization mode (:func:`.quantization.check_mode`).
    """
    from .quantization import check_mode, quantize_talker, quantize_thinker

    from .config import MiniCPMOConfig
    from .loader import _build_on_meta
    from .thinker import Thinker

    if size not in ("real", "tiny"):
        raise ValueError("size must be 'real' or 'tiny'")
    dev = torch.device(device)
    qmode = check_mode(quantization, dev)
    gen = torch.Generator(device=dev)
    gen.manual_seed(int(seed))
    reports = {}
    with tempfile.TemporaryDirectory(prefix="duplexkit-random-") as td:
        tmp = Path(td)
        if tokenizer_dir is not None and size != "real":
            raise ValueError("tokenizer_dir needs size 'real' (the tiny vocabulary is sized to the tiny tokenizer)")
        tok, special = _tokenizer(tmp, tokenizer_dir)
        if size == "real":
            cfg_d = real_config_dict(eos_ids=(special.im_end,), pad_id=tok.convert_tokens_to_ids("<|endoftext|>"))
        else:
            from .tiny import tiny_config_dict

            n = ((len(tok) + 63) // 64) * 64
            cfg_d = tiny_config_dict(n, [special.im_end], tok.convert_tokens_to_ids("<|endoftext|>"),
                                     tok.convert_tokens_to_ids("<focus>"), tok.convert_tokens_to_ids("</perception>"))
        cfg = MiniCPMOConfig.from_dict(copy.deepcopy(cfg_d))
        mods = _materialise(_build_on_meta(cfg), dev, dtype, gen)
        if qmode != "none":
            reports["thinker"] = quantize_thinker(mods, qmode)
        if fast is None:
            fast = dev.type == "cuda"
        if fast:
            from .fast_kv import pin_sdpa_backend
            from .fast_thinker import FastThinker

            pin_sdpa_backend()
            th_kw = {"max_len": thinker_max_len, "slots": kv_slots, **(fast_options or {}).get("thinker", {})}
            thinker = FastThinker(mods, cfg, tok, special, device=dev, dtype=dtype, **th_kw)
        else:
            thinker = Thinker(mods, cfg, tok, special, device=dev, dtype=dtype)
        tk = _random_talker(cfg, dev, dtype, gen)
        if qmode != "none":
            reports["talker"] = quantize_talker(tk, qmode)
        talker = tk
        if fast:
            from .fast_talker import FastTalker

            talker = FastTalker(tk, **{"slots": kv_slots, **(fast_options or {}).get("talker", {})})
        code2wav = _random_code2wav(tmp, dev, gen, size == "real", batched=bool(fast),
                                    dtype=code2wav_dtype) if with_code2wav else None
        rows = (fast_options or {}).get("code2wav", {}).get("graph_rows")
        if rows is not None and code2wav is not None and hasattr(code2wav, "set_graph_rows"):
            code2wav.set_graph_rows(rows)
    return MiniCPMO45(config=cfg, tokenizer=tok, special=special, thinker=thinker, talker=talker, code2wav=code2wav,
                      random_weights=True, model_dir=None, devices={s: str(dev) for s in ("thinker", "talker", "code2wav")},
                      dtype=dtype, quantization=reports)


def _random_talker(cfg, dev: torch.device, dtype: torch.dtype, gen: torch.Generator):
    from .talker import Talker, TalkerConfig

    tc = TalkerConfig.from_tts_config(cfg.tts_config.raw or {})
    with meta_device():
        tk = Talker(tc)
    tk = _materialise(tk, dev, dtype, gen)
    tk._folded_head = None
    return tk


def build_random_talker(size: str = "real", *, dtype: torch.dtype = torch.bfloat16,
                        device: Union[str, torch.device] = "cuda", seed: int = 0):
    """The talker alone (:class:`~.talker.Talker`, real or tiny sizes) with random weights on
    ``device``, as :func:`build_random_model` builds it (the talker benchmarks: no thinker weights).

    Raises:
        ValueError: ``size`` is not ``"real"`` or ``"tiny"``.
    """
    from .config import MiniCPMOConfig

    if size == "real":
        cfg_d = real_config_dict()
    elif size == "tiny":
        from .tiny import tiny_config_dict

        cfg_d = tiny_config_dict(1024, [2], 1, 3, 4)
    else:
        raise ValueError("size must be 'real' or 'tiny'")
    dev = torch.device(device)
    gen = torch.Generator(device=dev)
    gen.manual_seed(int(seed))
    return _random_talker(MiniCPMOConfig.from_dict(cfg_d), dev, dtype, gen)
