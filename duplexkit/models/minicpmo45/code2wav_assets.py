"""Code2Wav assets: constants, errors, the token2wav folder layouts, flow / HiFT construction and the
tiny random-weight asset writer (docs/model.md §1.2, §7, §9).

Split out of :mod:`.code2wav` (which re-exports every public name here); see that module's docstring
for the scratch-buffer rule (:func:`_load_flow_yaml` builds the flow on the ``meta`` device).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Union

import numpy as np

from duplexkit.units import CODES_PER_CHUNK, OUTPUT_SAMPLE_RATE, SAMPLES_PER_CODE, SILENCE_CODE  # noqa: F401 (re-exported)
from duplexkit.errors import DuplexkitError

#: output sample rate (Hz; ``duplexkit.units.OUTPUT_SAMPLE_RATE``)
SAMPLE_RATE = OUTPUT_SAMPLE_RATE
#: prompt-audio sample rate of the S3 tokenizer / CAM++ branch (Hz)
PROMPT_RATE = 16_000
#: valid S3 codes are 0..NUM_CODES-1; 6561 (EOS) and anything else is refused
NUM_CODES = 6561
#: new codes per non-final synthesis call (``duplexkit.units.CODES_PER_CHUNK``; docs/model.md §7.1)
CHUNK_CODES = CODES_PER_CHUNK
#: pre-lookahead / carry codes (docs/model.md §7.1)
LOOKAHEAD_CODES = 3
#: HiFT cache: 8 mel frames -> 3840 source/speech samples withheld and cross-faded (docs/model.md §7.3)
MEL_CACHE_FRAMES = 8
HOLDBACK_SAMPLES = MEL_CACHE_FRAMES * 480
#: flow caches keep prompt frames + this many (Token2wav 0.1.1)
FLOW_CACHE_TAIL_FRAMES = 100
#: files of the 5-file layout (docs/model.md §1.2)
FILES_5 = ("speech_tokenizer_v2_25hz.onnx", "campplus.onnx", "flow.yaml", "flow.pt", "hift.pt")
ONNX_FILES = FILES_5[:2]
MODEL_FILES = FILES_5[2:]
#: files that only the minicpmo-utils 1.0.7 (7-file, CosyVoice3 vocoder) layout has
FILES_7_MARKERS = ("hift_original.pt", "config.yaml")
TINY_MARKER = "TINY_RANDOM_WEIGHTS"


class Code2WavError(DuplexkitError, RuntimeError):
    """Base class of Code2Wav errors."""


class Code2WavLayoutError(Code2WavError):
    """The token2wav asset folder is missing files or has an unsupported layout."""


class Code2WavInputError(Code2WavError, ValueError):
    """Bad codes (EOS 6561, audio_bos, negative, not 1-D integers) or bad reference audio."""


class ChunkBelowLookaheadError(Code2WavInputError):
    """A non-final synthesis call was asked for with fewer than 4 new codes (more than the 3-code
    lookahead are needed; docs/model.md §7.1, vO #7633)."""

    code = "chunk_below_lookahead_window"


class StreamClosedError(Code2WavError):
    """The stream was closed."""


# ----------------------------------------------------------------------------- layout
def find_token2wav_dir(path: Union[str, Path]) -> Path:
    """Resolve a checkpoint root, its ``assets/`` folder or ``assets/token2wav/`` to the token2wav folder."""
    p = Path(path)
    for cand in (p, p / "token2wav", p / "assets" / "token2wav"):
        if (cand / "flow.yaml").is_file() or any((cand / f).exists() for f in FILES_5 + FILES_7_MARKERS):
            return cand
    raise Code2WavLayoutError(f"no token2wav assets under {p} (looked for flow.yaml in {p}, {p}/token2wav, "
                              f"{p}/assets/token2wav)")


def detect_token2wav_layout(folder: Union[str, Path]) -> str:
    """Classify a token2wav folder.

    Returns:
        ``"5-file"`` (released layout: ONNX prompt encoders + flow + HiFT) or ``"tiny"`` (flow.yaml,
        flow.pt, hift.pt and the ``TINY_RANDOM_WEIGHTS`` marker, no ONNX).

    Raises:
        Code2WavLayoutError: the 7-file minicpmo-utils 1.0.7 layout (its ``hift.pt`` is a CosyVoice3
            vocoder, docs/model.md §1.2), or missing files.
    """
    d = Path(folder)
    present = {f for f in FILES_5 + FILES_7_MARKERS + (TINY_MARKER,) if (d / f).exists()}
    seven = [f for f in FILES_7_MARKERS if f in present]
    if seven:
        raise Code2WavLayoutError(
            f"{d} holds the 7-file token2wav layout of minicpmo-utils 1.0.7 ({', '.join(seven)} present): its "
            "hift.pt is a causal CosyVoice3 vocoder, not the HiFT of the released 5-file layout. Use the "
            "checkpoint's original assets/token2wav (speech_tokenizer_v2_25hz.onnx, campplus.onnx, flow.yaml, "
            "flow.pt, hift.pt).")
    missing_models = [f for f in MODEL_FILES if f not in present]
    if missing_models:
        raise Code2WavLayoutError(f"token2wav folder {d} lacks {missing_models} (5-file layout: {list(FILES_5)})")
    onnx = [f for f in ONNX_FILES if f in present]
    if len(onnx) == 2:
        return "5-file"
    if not onnx and TINY_MARKER in present:
        return "tiny"
    raise Code2WavLayoutError(
        f"token2wav folder {d} lacks the prompt encoders {[f for f in ONNX_FILES if f not in present]} "
        "(needed to compute reference-voice features; only a tiny random asset set marked "
        f"{TINY_MARKER} may omit both)")


# ----------------------------------------------------------------------------- torch helpers
def _torch():
    import torch

    return torch


def _cpu_disable_dynamo(device) -> None:
    """On CPU set ``TORCHDYNAMO_DISABLE=1`` (unless the caller chose) before stepaudio2 is imported:
    retracing of compiled paths dominates there (docs/model.md §7.5). GPU processes are left alone."""
    if getattr(device, "type", str(device)) == "cpu":
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def _register_cosyvoice2_aliases() -> None:
    """Make ``cosyvoice2.*`` (the module paths named in flow.yaml) resolve to stepaudio2's modules, the
    way the package itself does before it parses flow.yaml."""
    from stepaudio2 import token2wav as _t2w

    _t2w._setup_cosyvoice2_alias()


def _load_flow_yaml(path: Path, device, dtype):
    """Construct the flow from flow.yaml on the meta device and materialise it without the fixed
    multi-GB scratch buffers (see module docstring). Parameters are uninitialised until loaded."""
    torch = _torch()
    from hyperpyyaml import load_hyperpyyaml

    from .meta import meta_device

    _register_cosyvoice2_aliases()
    with meta_device(), open(path, "r") as f:
        cfg = load_hyperpyyaml(f)
    flow = cfg.get("flow") if isinstance(cfg, dict) else None
    from stepaudio2.cosyvoice2.flow.flow import CausalMaskedDiffWithXvec

    if not isinstance(flow, CausalMaskedDiffWithXvec):
        raise Code2WavLayoutError(f"{path} does not define `flow: !new:...CausalMaskedDiffWithXvec`")
    flow.to_empty(device=device)
    _rebuild_nonpersistent(flow, device)
    flow.to(dtype=dtype)
    return flow


def _rebuild_nonpersistent(flow, device) -> None:
    torch = _torch()
    from stepaudio2.cosyvoice2.transformer.embedding import EspnetRelPositionalEncoding

    for m in flow.modules():
        if isinstance(m, EspnetRelPositionalEncoding):
            n = m.pe.shape[1] // 2 + 1 if m.pe is not None else 5000
            m.pe = None
            m.extend_pe(torch.zeros(1, n, device=device))
    dec = flow.decoder
    # tiny placeholders; _FlowRunner sizes them before use
    dec.cnn_cache_buffer = torch.zeros(0, device=device)
    dec.att_cache_buffer = torch.zeros(0, device=device)
    dec.estimator.cnn_cache_buffer = torch.zeros(0, device=device)
    dec.estimator.att_cache_buffer = torch.zeros(0, device=device)
    dec.rand_noise = torch.zeros(0, device=device)
    leftovers = []
    for name, m in flow.named_modules():
        for k, v in list(vars(m).items()):
            if torch.is_tensor(v) and v.is_meta:
                leftovers.append(f"{name}.{k}")
        for k, v in list(m._buffers.items()) + list(m._parameters.items()):
            if v is not None and v.is_meta:
                leftovers.append(f"{name}.{k}")
    if leftovers:
        raise Code2WavLayoutError(f"flow tensors not materialised (unsupported stepaudio2 version?): {leftovers}")


def _build_hift(sd: dict, device, dtype):
    """HiFTGenerator whose widths are read from the tensors (the real hift.pt gives the package defaults,
    base 512 / F0 predictor 512; the tiny asset set uses smaller widths)."""
    torch = _torch()
    from stepaudio2.flashcosyvoice.modules.hifigan import ConvRNNF0Predictor, HiFTGenerator

    def width(prefix):
        for suffix in ("parametrizations.weight.original1", "weight_v", "weight"):
            if prefix + suffix in sd:
                return int(sd[prefix + suffix].shape[0])
        raise Code2WavLayoutError(f"hift.pt lacks {prefix}weight")

    base = width("conv_pre.")
    cond = width("f0_predictor.condnet.0.")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        hift = HiFTGenerator(base_channels=base, f0_predictor=ConvRNNF0Predictor(cond_channels=cond))
    try:
        hift.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        raise Code2WavLayoutError(f"hift.pt does not match HiFTGenerator(base_channels={base}): {e}") from e
    return hift.to(device=device, dtype=dtype).eval()



# ----------------------------------------------------------------------------- tiny assets
_TINY_FLOW_YAML = """\
# Tiny random-weight token2wav flow for duplexkit tests (write_tiny_token2wav, seed {seed}).
# Same classes and streaming geometry as the released flow.yaml (512 wide, 8 heads x 64, pre-lookahead 3,
# up-rate 2, 80-bin mel, 192-d x-vector, 6561 codes); depth shrunk: {enc} + {up} conformer blocks, DiT
# depth {dit}, FFN {ffn}.
flow: !new:cosyvoice2.flow.flow.CausalMaskedDiffWithXvec
    input_size: 512
    output_size: 80
    spk_embed_dim: 192
    output_type: mel
    vocab_size: 6561
    encoder: !new:cosyvoice2.transformer.upsample_encoder_v2.UpsampleConformerEncoderV2
        input_size: 512
        output_size: 512
        input_layer: linear
        pre_lookahead_len: 3
        num_blocks: {enc}
        num_up_blocks: {up}
        up_stride: 2
        up_scale_factor: 2
        attention_heads: 8
        pos_enc_layer_type: rel_pos_espnet
        selfattention_layer_type: rel_selfattn
        key_bias: true
        linear_units: {ffn}
        dropout_rate: 0.1
        positional_dropout_rate: 0.1
        attention_dropout_rate: 0.1
        normalize_before: true
    decoder: !new:cosyvoice2.flow.flow_matching.CausalConditionalCFM
        inference_cfg_rate: 0.7
        estimator: !new:cosyvoice2.flow.decoder_dit.DiT
            in_channels: 320
            out_channels: 80
            mlp_ratio: {mlp_ratio}
            depth: {dit}
            num_heads: 8
            head_dim: 64
            hidden_size: 512
"""


def write_tiny_token2wav(assets_dir: Union[str, Path], seed: int = 0, *, dit_depth: int = 2,
                         encoder_blocks: int = 1, up_blocks: int = 1, ffn: int = 256,
                         hift_channels: int = 64) -> Path:
    """Write a tiny random-weight token2wav asset set (flow.yaml, flow.pt, hift.pt, ``TINY_RANDOM_WEIGHTS``).

    Args:
        assets_dir: the checkpoint's ``assets/`` folder (files go to ``assets/token2wav/``) or the
            ``token2wav`` folder itself (a path whose name is ``token2wav``).
        seed: weight seed (deterministic output for a given seed).

    The streaming geometry stays the released one (512 wide, 8 heads x 64; docs/model.md §7.5, §9); only depth,
    FFN width and the HiFT widths shrink (about 15 M parameters). No ONNX prompt encoders are written:
    :class:`Code2Wav` uses the documented stand-in prompt features for such a folder.

    Returns:
        the token2wav folder.
    """
    torch = _torch()
    _cpu_disable_dynamo(torch.device("cpu"))
    from stepaudio2.flashcosyvoice.modules.hifigan import ConvRNNF0Predictor, HiFTGenerator

    d = Path(assets_dir)
    if d.name != "token2wav":
        d = d / "token2wav"
    d.mkdir(parents=True, exist_ok=True)
    yaml_text = _TINY_FLOW_YAML.format(seed=seed, enc=encoder_blocks, up=up_blocks, dit=dit_depth, ffn=ffn,
                                       mlp_ratio=float(ffn) / 512.0)
    (d / "flow.yaml").write_text(yaml_text)
    flow = _load_flow_yaml(d / "flow.yaml", torch.device("cpu"), torch.float32)
    g = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        for name, p in sorted(flow.named_parameters()):
            if p.ndim == 1 and name.endswith("weight"):
                p.fill_(1.0)  # LayerNorm gains
            elif name.endswith("bias") or p.ndim == 1:
                p.copy_(0.01 * torch.randn(p.shape, generator=g))
            else:
                fan_in = int(np.prod(p.shape[1:]))
                p.copy_(torch.randn(p.shape, generator=g) / np.sqrt(fan_in))
    sd = {k: v.detach().clone().contiguous() for k, v in flow.state_dict().items()}
    torch.save(sd, d / "flow.pt")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed) + 1)
        hift = HiFTGenerator(base_channels=hift_channels, f0_predictor=ConvRNNF0Predictor(cond_channels=hift_channels))
    torch.save({"generator." + k: v.detach().clone().contiguous() for k, v in hift.state_dict().items()},
               d / "hift.pt")
    (d / TINY_MARKER).write_text(
        "Random-weight token2wav asset set written by duplexkit.models.minicpmo45.code2wav.write_tiny_token2wav "
        f"(seed {seed}). It produces noise, not speech. No ONNX prompt encoders: Code2Wav derives stand-in "
        "prompt features from the reference audio (see the code2wav module docstring).\n")
    return d
