"""Load a MiniCPM-o 4.5 checkpoint directory into duplexkit's own modules (docs/model.md §1.2).

* weights: ``model.safetensors.index.json`` (keys routed via ``weight_map``) or a single
  ``model.safetensors``;
* strict key check over every stage with a readable report of missing, unexpected and mis-shaped
  tensors (:class:`CheckpointError`); ``tts.model.embed_tokens.*`` and ``tts.projector_spk.*`` are
  accepted and ignored; the ``vpm.encoder.layers.N`` count must match ``drop_vision_last_layer``;
* ``assets/token2wav``: the 5-file layout is accepted, the 7-file minicpmo-utils 1.0.7 layout
  (``hift_original.pt`` / ``config.yaml``) is rejected (docs/model.md §1.2 "The 7-file trap");
* dtype float32 / bfloat16 / float16; one device per stage (thinker / talker / code2wav);
* quantized weights: ``quantization`` ``int8`` / ``fp8`` for the thinker's and talker's decoder
  linears (:mod:`.quantization`); AutoAWQ 4-bit "gemm" checkpoints (``quantization_config`` with
  ``quant_method: awq`` in ``config.json``, ``<linear>.qweight`` / ``.qzeros`` / ``.scales``
  tensors in place of ``<linear>.weight``) are dequantized at load to the stage dtype, then
  quantized as asked.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import torch
from torch import nn

from duplexkit.errors import DuplexkitError

from .meta import meta_device
from .config import ConfigError, MiniCPMOConfig
from .tokenizer import SpecialTokens, TokenizerError, load_tokenizer

__all__ = ["CheckpointError", "MiniCPMO45", "load", "RANDOM_WEIGHTS_MARKER", "read_weight_index", "check_token2wav_layout"]

RANDOM_WEIGHTS_MARKER = "duplexkit_random_weights.json"
"""File written by :func:`build_tiny_checkpoint`; its presence sets ``MiniCPMO45.random_weights``."""

IGNORED_KEY_PREFIXES = ("tts.model.embed_tokens.", "tts.projector_spk.")
"""Present in the checkpoint but unused (docs/model.md §1.1)."""

TOKEN2WAV_FILES_5 = ("speech_tokenizer_v2_25hz.onnx", "campplus.onnx", "flow.yaml", "flow.pt", "hift.pt")
TOKEN2WAV_MARKERS_7 = ("hift_original.pt", "config.yaml")

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


class CheckpointError(DuplexkitError, RuntimeError):
    """The checkpoint directory is unusable. ``report`` holds the readable key report (may be empty).

    Attributes:
        missing / unexpected / mismatched: lists of keys (mismatched as "key: got (..) expected (..)").
    """

    def __init__(self, message: str, *, missing=(), unexpected=(), mismatched=()):
        self.missing = list(missing)
        self.unexpected = list(unexpected)
        self.mismatched = list(mismatched)
        self.report = format_key_report(self.missing, self.unexpected, self.mismatched)
        super().__init__(message + (("\n" + self.report) if self.report else ""))


def format_key_report(missing, unexpected, mismatched, limit: int = 40) -> str:
    lines = []
    for title, items in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", mismatched)):
        if not items:
            continue
        lines.append(f"{len(items)} {title} tensor(s):")
        for k in items[:limit]:
            lines.append(f"  - {k}")
        if len(items) > limit:
            lines.append(f"  ... and {len(items) - limit} more")
    return "\n".join(lines)


@dataclass
class MiniCPMO45:
    """A loaded model (docs/model.md).

    Attributes:
        config: :class:`MiniCPMOConfig`; tokenizer: the checkpoint's tokenizer; special:
        :class:`SpecialTokens`; thinker: :class:`~.thinker.Thinker`; talker: D's ``Talker`` or None;
        code2wav: D's ``Code2Wav`` or None; random_weights: the tiny builder's marker is present;
        model_dir: the checkpoint directory; generation_config / preprocessor_config: dicts ({} if absent).
    """

    config: MiniCPMOConfig
    tokenizer: Any
    special: SpecialTokens
    thinker: Any
    talker: Any = None
    code2wav: Any = None
    random_weights: bool = False
    model_dir: Optional[Path] = None
    generation_config: Dict[str, Any] = field(default_factory=dict)
    preprocessor_config: Dict[str, Any] = field(default_factory=dict)
    devices: Dict[str, str] = field(default_factory=dict)
    dtype: torch.dtype = torch.float32
    quantization: Dict[str, Any] = field(default_factory=dict)
    """Per stage (``thinker`` / ``talker``) the :class:`~.quantization.QuantReport` of the weights'
    quantization (mode, layers, weight bytes before / after); empty when nothing was quantized."""


# ------------------------------------------------------------------------------------------------
# weights


def read_weight_index(model_dir: Path) -> Dict[str, Path]:
    """key -> safetensors file, from the index ``weight_map`` or the single ``model.safetensors``."""
    idx = model_dir / "model.safetensors.index.json"
    if idx.is_file():
        try:
            wm = json.loads(idx.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{idx}: unreadable index ({e})") from e
        out = {}
        missing_files = set()
        for k, fn in wm.items():
            p = model_dir / fn
            if not p.is_file():
                missing_files.add(fn)
            out[k] = p
        if missing_files:
            raise CheckpointError(f"{model_dir}: shard file(s) named in the index are missing: {sorted(missing_files)}")
        return out
    single = model_dir / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt", device="cpu") as f:
            return {k: single for k in f.keys()}
    raise CheckpointError(f"{model_dir}: no model.safetensors and no model.safetensors.index.json")


def _shapes(index: Dict[str, Path]) -> Dict[str, tuple]:
    from safetensors import safe_open

    by_file: Dict[Path, List[str]] = {}
    for k, p in index.items():
        by_file.setdefault(p, []).append(k)
    shapes = {}
    for p, keys in by_file.items():
        with safe_open(str(p), framework="pt", device="cpu") as f:
            for k in keys:
                shapes[k] = tuple(f.get_slice(k).get_shape())
    return shapes


def _is_tty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # None, a closed or a fake stream
        return False


def _read_tensors(index: Dict[str, Path], keys, dtype: torch.dtype, device,
                  progress: Optional[str] = None) -> Dict[str, torch.Tensor]:
    """Read ``keys`` from their shards, cast floating tensors to ``dtype`` and move them to
    ``device``. With ``progress`` (a label), a tqdm bar counts the tensors read on stderr, only
    when stderr is a terminal: in a log file or a pipe a bar's carriage returns would glue
    ``thinker weights:   0%|…`` to the next log line."""
    from safetensors import safe_open

    by_file: Dict[Path, List[str]] = {}
    for k in keys:
        by_file.setdefault(index[k], []).append(k)
    bar = None
    if progress:
        try:
            from tqdm.auto import tqdm
        except ImportError:  # tqdm is in the engine extra; without it, no bar
            tqdm = None
        if tqdm is not None and _is_tty(sys.stderr):
            bar = tqdm(total=len(keys), desc=progress, unit="tensor", leave=False, file=sys.stderr)
    out = {}
    try:
        for p, ks in by_file.items():
            with safe_open(str(p), framework="pt", device="cpu") as f:
                for k in ks:
                    t = f.get_tensor(k)
                    if bar is not None:
                        bar.update(1)
                    if t.is_floating_point():
                        t = t.to(dtype)
                    out[k] = t.to(device)
    finally:
        if bar is not None:
            bar.close()
    return out


def _build_on_meta(cfg: MiniCPMOConfig):
    """Build :class:`ThinkerModules` without allocating parameters (meta device), then rebuild the
    rotary-embedding modules (their ``inv_freq`` buffers are computed, not loaded) on the CPU."""
    from .thinker import ThinkerModules

    with meta_device():
        mods = ThinkerModules(cfg)
    for name, mod in list(mods.named_modules()):
        if any(b is not None and b.is_meta for b in mod._buffers.values()):
            if "Rotary" not in type(mod).__name__:
                raise CheckpointError(f"internal: module {name} ({type(mod).__name__}) has uninitialised buffers")
            parent_name, _, attr = name.rpartition(".")
            parent = mods.get_submodule(parent_name) if parent_name else mods
            with torch.device("cpu"):
                setattr(parent, attr, type(mod)(config=mod.config))
    return mods


def check_token2wav_layout(model_dir: Path) -> Optional[Path]:
    """Return ``assets/token2wav`` if present (5-file layout); None if absent.

    Raises:
        CheckpointError: the 7-file minicpmo-utils 1.0.7 layout (docs/model.md §1.2).
    """
    d = model_dir / "assets" / "token2wav"
    if not d.is_dir():
        return None
    seven = [m for m in TOKEN2WAV_MARKERS_7 if (d / m).exists()]
    if seven:
        raise CheckpointError(
            f"{d}: 7-file token2wav layout (minicpmo-utils 1.0.7: {', '.join(seven)} present) is not supported; "
            "use the released 5-file layout (speech_tokenizer_v2_25hz.onnx, campplus.onnx, flow.yaml, flow.pt, hift.pt)"
        )
    return d


def _devices(devices: Union[str, Dict[str, str], None]) -> Dict[str, str]:
    if devices is None:
        devices = "cpu"
    if isinstance(devices, str):
        return {"thinker": devices, "talker": devices, "code2wav": devices}
    out = {"thinker": "cpu", "talker": None, "code2wav": None}
    bad = set(devices) - set(out)
    if bad:
        raise ValueError(f"unknown stage(s) in devices: {sorted(bad)} (use thinker/talker/code2wav)")
    out.update(devices)
    out["talker"] = out["talker"] or out["thinker"]
    out["code2wav"] = out["code2wav"] or out["talker"]
    return out


def _dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"unsupported dtype {dtype}")
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise ValueError(f"unsupported dtype {dtype!r} (float32, bfloat16, float16)")


def _talker_expected(cfg: MiniCPMOConfig) -> Dict[str, tuple]:
    try:
        from .talker import Talker, TalkerConfig
    except ImportError:  # talker not available: accept tts.* keys unchecked
        return {}
    tc = TalkerConfig.from_tts_config(cfg.tts_config.raw or {})
    with meta_device():
        probe = Talker(tc)
    return {"tts." + k: tuple(v.shape) for k, v in probe.state_dict().items()
            if not ("tts." + k).startswith(IGNORED_KEY_PREFIXES)}


def load(
    path: Union[str, Path],
    *,
    dtype: Union[torch.dtype, str, Dict[str, Union[torch.dtype, str]]] = torch.float32,
    devices: Union[Dict[str, str], str] = "cpu",
    with_code2wav: bool = True,
    progress: bool = True,
    with_talker: bool = True,
    fast: Union[bool, Dict[str, bool], None] = None,
    quantization: Union[str, Dict[str, str], None] = None,
    fast_options: Optional[Dict[str, dict]] = None,
) -> MiniCPMO45:
    """Load a checkpoint directory (see module doc).

    Args:
        path: directory with config.json, tokenizer files and safetensors.
        dtype: parameter dtype (float32, bfloat16, float16), one for the thinker and talker, or per
            stage ``{"thinker": .., "talker": .., "code2wav": ..}`` (missing stages use float32).
            Code2Wav's flow runs in float32 (default) or float16 (the reference's
            ``Token2wav(float16=True)``: half weights under autocast); HiFT always runs in float32
            (docs/model.md §7.5). A single dtype applies to the thinker and talker only.
        devices: one device for all stages, or {"thinker": .., "talker": .., "code2wav": ..}.
        with_code2wav: build Code2Wav when ``assets/token2wav`` exists.
        progress: print short progress lines.
        with_talker: build the talker (``tts.*``); its keys are checked either way.
        fast: use the batched GPU paths per stage (``FastThinker``: static KV slots, batched decode,
            CUDA graphs; ``FastTalker``; ``BatchedCode2Wav``) and pin SDPA off cuDNN. Default: for
            the stages placed on a CUDA device. A dict sets it per stage (``{"thinker": False}``:
            the vLLM thinker backend keeps the plain thinker; stages not named keep the default).
            The CPU path stays the reference-checked one.
        quantization: ``none`` (default), ``int8`` or ``fp8`` for the thinker's and talker's
            decoder linears (:mod:`.quantization`; memory and measured quality in docs/model.md
            "Quantized weights"), or per stage ``{"thinker": .., "talker": ..}``. Weights are read
            in ``dtype`` on the stage's device, then quantized layer by layer (the peak is the
            unquantized stage plus one layer).
        fast_options: keyword arguments of the fast paths per stage, e.g. a memory plan's
            (:mod:`duplexkit.engine.memory_plan`) ``{"thinker": {"max_len": 2048, "slots": 4,
            "max_slots": 4}, "talker": {"slots": 4, "grow_by": 1}, "code2wav": {"graph_rows": 4}}``
            (:class:`~.fast_thinker.FastThinker`, :class:`~.fast_talker.FastTalker`,
            :meth:`~.fast_code2wav.BatchedCode2Wav.set_graph_rows`); ignored for stages not on a fast path.
    Raises:
        CheckpointError: missing directory/files, key report mismatch, 7-file token2wav layout,
            bad config or tokenizer (wrapped).
        ValueError: an unsupported dtype (Code2Wav: other than float32 / float16).
        QuantizationError: an unknown quantization mode, ``fp8`` on a CUDA device below compute
            capability 8.9, or a ``quantization_config`` other than AutoAWQ 4-bit "gemm".
    """
    from .quantization import parse_mode
    from .thinker import Thinker

    q_modes = _quant_modes(quantization, parse_mode)

    d = Path(path).expanduser()
    if not d.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {d}")
    if isinstance(dtype, dict):
        bad = set(dtype) - {"thinker", "talker", "code2wav"}
        if bad:
            raise ValueError(f"unknown stage(s) in dtype: {sorted(bad)} (use thinker/talker/code2wav)")
        dt = _dtype(dtype.get("thinker", torch.float32))
        dt_talker = _dtype(dtype.get("talker", torch.float32))
        dt_c2w = _dtype(dtype.get("code2wav", torch.float32))
    else:
        dt = dt_talker = _dtype(dtype)
        dt_c2w = torch.float32
    if dt_c2w not in (torch.float32, torch.float16):
        raise ValueError(f"code2wav dtype must be float32 or float16 (the reference Token2wav's two modes), got {dt_c2w}")
    devs = _devices(devices)
    try:
        cfg = MiniCPMOConfig.from_file(d)
    except ConfigError as e:
        raise CheckpointError(f"bad config.json: {e}") from e
    try:
        tok = load_tokenizer(d)
        special = SpecialTokens.resolve(tok)
    except TokenizerError as e:
        raise CheckpointError(f"bad tokenizer: {e}") from e
    if len(tok) > cfg.vocab_size:
        raise CheckpointError(f"tokenizer has {len(tok)} tokens but vocab_size is {cfg.vocab_size}")
    t2w_dir = check_token2wav_layout(d)

    index = read_weight_index(d)
    shapes = _shapes(index)

    mods = _build_on_meta(cfg)
    expected = {k: tuple(v.shape) for k, v in mods.state_dict().items()}
    if cfg.init_tts:
        expected.update(_talker_expected(cfg))
    awq = _awq_linears(cfg, shapes, expected)
    if awq:  # AutoAWQ layers: their three tensors stand for "<prefix>.weight"
        for prefix in awq["prefixes"]:
            shapes[prefix + ".weight"] = expected[prefix + ".weight"]
            for suffix in (".qweight", ".qzeros", ".scales"):
                shapes.pop(prefix + suffix)
    # vision layer count (docs/model.md §1.1, §11)
    if cfg.init_vision:
        pat = re.compile(r"^vpm\.encoder\.layers\.(\d+)\.")
        n_ckpt = len({m.group(1) for k in shapes if (m := pat.match(k))})
        if n_ckpt != cfg.vision_layers_used:
            raise CheckpointError(
                f"checkpoint has {n_ckpt} vpm.encoder.layers but config builds {cfg.vision_layers_used} "
                f"(vision_config.num_hidden_layers={cfg.vision_config.num_hidden_layers}, "
                f"drop_vision_last_layer={cfg.drop_vision_last_layer})"
            )
    tts_unchecked = cfg.init_tts and not any(k.startswith("tts.") for k in expected)
    missing = sorted(k for k in expected if k not in shapes)
    unexpected = sorted(
        k for k in shapes
        if k not in expected and not k.startswith(IGNORED_KEY_PREFIXES) and not (tts_unchecked and k.startswith("tts."))
    )
    mism = sorted(f"{k}: got {shapes[k]}, expected {expected[k]}" for k in expected if k in shapes and shapes[k] != expected[k])
    if missing or unexpected or mism:
        raise CheckpointError(f"{d}: state dict does not match config.json", missing=missing, unexpected=unexpected, mismatched=mism)

    if progress:
        print(f"[duplexkit] loading thinker ({len(mods.state_dict())} tensors, {dt}) on {devs['thinker']}", file=sys.stderr, flush=True)
    tensors = _read_weights(index, list(mods.state_dict().keys()), dt, devs["thinker"], awq,
                            progress="thinker weights" if progress else None)
    mods.load_state_dict(tensors, strict=True, assign=True)
    del tensors
    for mod in mods.modules():  # non-persistent buffers (rotary inv_freq) stay float32, just move them
        for bn, buf in list(mod._buffers.items()):
            if buf is not None:
                mod._buffers[bn] = buf.to(devs["thinker"])
    mods.eval().requires_grad_(False)
    reports: Dict[str, Any] = {}
    if q_modes["thinker"] != "none":
        from .quantization import quantize_thinker

        reports["thinker"] = quantize_thinker(mods, q_modes["thinker"])
        if progress:
            print(f"[duplexkit] {reports['thinker'].line('thinker')}", file=sys.stderr, flush=True)
    thinker = Thinker(mods, cfg, tok, special, device=devs["thinker"], dtype=dt)
    if isinstance(fast, dict):
        fast_on = lambda stage: bool(fast.get(stage, str(devs[stage]).startswith("cuda")))  # noqa: E731
    else:
        fast_on = (lambda stage: str(devs[stage]).startswith("cuda")) if fast is None else (lambda stage: bool(fast))
    if fast_on("thinker"):
        from .fast_kv import pin_sdpa_backend
        from .fast_thinker import FastThinker

        pin_sdpa_backend()
        thinker = FastThinker.from_thinker(thinker, **(fast_options or {}).get("thinker", {}))

    talker = None
    if cfg.init_tts and with_talker:
        from .talker import Talker

        tts_keys = [k for k in shapes if k.startswith("tts.") and not k.startswith(IGNORED_KEY_PREFIXES)]
        if progress:
            print(f"[duplexkit] loading talker ({len(tts_keys)} tensors, {dt_talker}) on {devs['talker']}", file=sys.stderr, flush=True)
        sd = _read_weights(index, tts_keys, torch.float32, "cpu", awq, progress="talker weights" if progress else None)
        talker = Talker.from_state_dict(cfg.tts_config.raw or {}, sd, dtype=dt_talker, device=devs["talker"])
        del sd
        if q_modes["talker"] != "none":
            from .quantization import quantize_talker

            reports["talker"] = quantize_talker(talker, q_modes["talker"])
            if progress:
                print(f"[duplexkit] {reports['talker'].line('talker')}", file=sys.stderr, flush=True)
        if fast_on("talker"):
            from .fast_talker import FastTalker

            talker = FastTalker(talker, **(fast_options or {}).get("talker", {}))

    if reports:
        from .quantization import slow_kernel_warning

        if (warn := slow_kernel_warning(reports)) is not None:
            logging.getLogger("duplexkit.quantization").warning("%s", warn)

    code2wav = None
    if with_code2wav and t2w_dir is not None:
        from . import code2wav as c2w_mod

        if progress:
            print(f"[duplexkit] loading code2wav from {t2w_dir} on {devs['code2wav']} (flow {dt_c2w})", file=sys.stderr, flush=True)
        Code2Wav = getattr(c2w_mod, "Code2Wav")
        if fast_on("code2wav"):
            from .fast_code2wav import BatchedCode2Wav as Code2Wav
        builder = getattr(Code2Wav, "from_dir", None) or getattr(Code2Wav, "from_pretrained", None)
        if builder is None:
            raise CheckpointError("code2wav module has no Code2Wav.from_dir")
        layout_err = getattr(c2w_mod, "Code2WavLayoutError", None)
        try:
            code2wav = builder(t2w_dir, device=devs["code2wav"], dtype=dt_c2w)
        except Exception as e:  # noqa: BLE001 - only layout errors are re-typed
            if layout_err is not None and isinstance(e, layout_err):
                raise CheckpointError(f"{t2w_dir}: {e}") from e
            raise
        rows = (fast_options or {}).get("code2wav", {}).get("graph_rows")
        if rows is not None and hasattr(code2wav, "set_graph_rows"):
            code2wav.set_graph_rows(rows)

    def _json(name):
        p = d / name
        if p.is_file():
            try:
                return json.loads(p.read_text(encoding="utf-8"))
            except json.JSONDecodeError:
                return {}
        return {}

    return MiniCPMO45(
        config=cfg,
        tokenizer=tok,
        special=special,
        thinker=thinker,
        talker=talker,
        code2wav=code2wav,
        random_weights=(d / RANDOM_WEIGHTS_MARKER).is_file(),
        model_dir=d,
        generation_config=_json("generation_config.json"),
        preprocessor_config=_json("preprocessor_config.json"),
        devices=devs,
        dtype=dt,
        quantization=reports,
    )


def _quant_modes(quantization, parse_mode) -> Dict[str, str]:
    """``quantization`` argument of :func:`load` -> ``{"thinker": mode, "talker": mode}``."""
    if isinstance(quantization, dict):
        bad = set(quantization) - {"thinker", "talker"}
        if bad:
            raise ValueError(f"unknown stage(s) in quantization: {sorted(bad)} (use thinker/talker)")
        return {s: parse_mode(quantization.get(s)) for s in ("thinker", "talker")}
    m = parse_mode(quantization)
    return {"thinker": m, "talker": m}


def _awq_linears(cfg: MiniCPMOConfig, shapes: Dict[str, tuple], expected: Dict[str, tuple]) -> Optional[dict]:
    """The AutoAWQ layers of the checkpoint (module doc): ``{"group_size", "prefixes"}``, or None
    when ``config.json`` has no ``quantization_config``.

    Raises:
        CheckpointError: an AWQ layer that is not a linear of the model, a missing companion tensor,
            or tensors whose shapes do not fit the linear (the report lists them); the
            ``quantization_config`` is not AutoAWQ 4-bit "gemm" (wrapped QuantizationError).
    """
    from .quantization import QuantizationError, awq_config, awq_expected_shapes, awq_linear_prefixes

    try:
        qc = awq_config(cfg.raw)
    except QuantizationError as e:
        raise CheckpointError(f"config.json: {e}") from e
    if qc is None:
        return None
    g = qc["group_size"]
    prefixes = awq_linear_prefixes(shapes)
    unexpected, missing, mism = [], [], []
    for p in prefixes:
        wk = p + ".weight"
        if wk not in expected or len(expected[wk]) != 2:
            unexpected.append(p + ".qweight")
            continue
        for k, shp in awq_expected_shapes(p, expected[wk], g).items():
            if k not in shapes:
                missing.append(k)
            elif shapes[k] != shp:
                mism.append(f"{k}: got {shapes[k]}, expected {shp}")
    if unexpected or missing or mism:
        raise CheckpointError(f"AWQ tensors (group_size {g}) do not match the model", missing=missing,
                              unexpected=unexpected, mismatched=mism)
    return {"group_size": g, "prefixes": prefixes}


def _read_weights(index: Dict[str, Path], keys, dtype: torch.dtype, device, awq: Optional[dict],
                  progress: Optional[str] = None) -> Dict[str, torch.Tensor]:
    """:func:`_read_tensors`, with each AutoAWQ layer's ``<prefix>.weight`` dequantized from its
    ``qweight`` / ``qzeros`` / ``scales`` (:func:`.quantization.awq_dequantize`) into ``dtype``."""
    prefixes = set(awq["prefixes"]) if awq else set()
    plain = [k for k in keys if not (k.endswith(".weight") and k[: -len(".weight")] in prefixes)]
    out = _read_tensors(index, plain, dtype, device, progress=progress)
    if prefixes:
        from .quantization import awq_dequantize

        wanted = [k[: -len(".weight")] for k in keys if k not in plain]
        for p in wanted:
            raw = _read_tensors(index, [p + ".qweight", p + ".qzeros", p + ".scales"], torch.float32, "cpu")
            w = awq_dequantize(raw[p + ".qweight"], raw[p + ".qzeros"], raw[p + ".scales"], awq["group_size"], dtype)
            out[p + ".weight"] = w.to(device)
    return out
