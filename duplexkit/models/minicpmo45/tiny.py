"""Tiny random-weight MiniCPM-o 4.5 checkpoints in the real directory layout, for tests and demos.

:func:`build_tiny_checkpoint` writes, in a few seconds on a CPU:

* ``config.json`` — the real layout (docs/model.md §9 constraints: hidden 128 = 1 resampler head,
  ``query_num`` 64, ``encoder_ffn_dim = 4·d_model``, 80 mels, talker ``llm_dim`` = hidden);
* its **own** tokenizer (``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``):
  a small byte-level BPE trained with the ``tokenizers`` library on the English text bundled below,
  plus every special-token string of docs/model.md §2 and ``<unk>``; ids therefore differ from the real
  tokenizer, which is fine because duplexkit resolves special tokens by string;
* ``model.safetensors`` — random weights for every key the loader expects (incl. the ignored
  ``tts.model.embed_tokens`` / ``tts.projector_spk.*``), ``generation_config.json``,
  ``preprocessor_config.json``;
* ``assets/token2wav`` from ``code2wav.write_tiny_token2wav`` when that function exists;
* the marker ``duplexkit_random_weights.json`` (``MiniCPMO45.random_weights`` is then True).

:func:`tiny_checkpoint` caches the result under ``~/.cache/duplexkit/tiny-<version>-<seed>``
(``DUPLEXKIT_CACHE`` overrides the root).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Union

import numpy as np

from .loader import IGNORED_KEY_PREFIXES, RANDOM_WEIGHTS_MARKER
from .meta import meta_device
from .tokenizer import SPECIAL_TOKEN_STRINGS

__all__ = ["TINY_VERSION", "build_tiny_checkpoint", "tiny_checkpoint", "tiny_config_dict"]

TINY_VERSION = "2"
"""Bumped whenever the builder's output changes (part of the cache directory name)."""

# Special strings in id order after the BPE vocabulary. docs/model.md §2 lists them; the reserved ones
# keep the talker's audio_bos/text_eos rows (<focus>, </perception>) meaningful like the real model.
_ADDED_SPECIAL = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<think>", "</think>",
    "<image>", "</image>", "<slice>", "</slice>", "<image_id>", "</image_id>",
    "<unit>", "</unit>",
    "<focus>", "</perception>",
    "<|audio_start|>", "<|audio|>", "<|audio_end|>",
    "<|spk_bos|>", "<|spk|>", "<|spk_eos|>",
    "<|tts_bos|>", "<|tts_eos|>",
    "<|listen|>", "<|speak|>", "<|interrupt|>", "<|vad_start|>", "<|vad_end|>",
    "<|turn_eos|>", "<|chunk_eos|>", "<|chunk_tts_eos|>", "<|tts_pad|>",
    "<reserved_53>",
    "<unk>",
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
]
# Not special in the released tokenizer either (they stay in decoded text).
_NOT_SPECIAL = {"<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"}
# Added tokens the released bad_token_ids leave out besides _DUPLEX_ALLOWED (every id there is < 151643,
# no added token): the tool-call markup.
_NOT_BAD = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"}
# Tokens allowed in duplex decoding; every other added token goes to bad_token_ids.
_DUPLEX_ALLOWED = {"<|listen|>", "<|speak|>", "<|tts_bos|>", "<|tts_eos|>", "<|turn_eos|>", "<|chunk_eos|>",
                   "<|chunk_tts_eos|>", "<|tts_pad|>", "<|im_end|>"}

# A small English corpus written for this builder (its only use is training the tiny BPE).
_CORPUS = """
Hello! How are you today? I am fine, thank you. What would you like to talk about?
The weather is nice this morning, with a light wind and a few clouds over the hills.
Could you tell me the time? It is a quarter past nine, and the train leaves at ten.
I would like a cup of tea with milk, please. Of course, here you are.
We walked along the river and watched the boats go by while the sun went down.
Please speak a little slower, I did not hear the last part of what you said.
The quick brown fox jumps over the lazy dog. A bright yellow bird sings in the tree.
Numbers: one, two, three, four, five, six, seven, eight, nine, ten. 0 1 2 3 4 5 6 7 8 9.
My name is Sam and I live in a small town near the sea. I like music, books and long walks.
Can you help me find the station? Go straight ahead, then turn left at the second street.
Thank you for calling. Your order has been shipped and should arrive on Friday.
Let us begin the meeting. First, we review the plan; then, we decide who does what.
She asked a question, he gave an answer, and everyone in the room started to laugh.
Streaming voice agents listen and speak at the same time, one second at a time.
Good night, sleep well, and see you tomorrow morning!
"""

# The chat template: ChatML with the generation-prompt switches of docs/model.md §4 and the function-calling
# conventions of the released (Qwen3) template, written for this builder: with ``tools`` a system turn
# lists each tool as one JSON line inside <tools></tools> (after the first system message's text, which
# it replaces) and asks for calls as <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>;
# assistant ``tool_calls`` are written back in that form; ``tool`` messages become one user turn of
# <tool_response> blocks.
_CHAT_TEMPLATE = (
    "{%- set msgs = messages %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}"
    "{%- set msgs = messages[1:] %}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'"
    " + 'Function signatures, one JSON object a line, inside <tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nWrite each call as a JSON object with the function name and arguments inside '"
    " + '<tool_call></tool_call> tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": '"
    " + '<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in msgs %}"
    "{%- if message['role'] == 'tool' %}"
    "{%- if loop.first or msgs[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or msgs[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
    "{%- if message['role'] == 'assistant' and message['tool_calls'] %}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set fn = call['function'] if call['function'] is defined else call %}"
    "{%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' }}"
    "{%- if fn['arguments'] is string %}{{- fn['arguments'] }}{%- else %}{{- fn['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- if use_tts_template is defined and use_tts_template is true %}{{- '<|tts_bos|>' }}{%- endif %}"
    "{%- endif %}"
)


def _train_tokenizer(vocab_size: int = 640):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    lines = [ln for ln in _CORPUS.strip().splitlines() if ln.strip()]
    tok.train_from_iterator(lines * 4, trainer=trainer)
    return tok


def _write_tokenizer(out: Path) -> Dict[str, int]:
    from tokenizers import AddedToken

    tok = _train_tokenizer()
    for s in _ADDED_SPECIAL:
        if s in _NOT_SPECIAL:
            tok.add_tokens([AddedToken(s, special=False, normalized=False)])
        else:
            tok.add_special_tokens([AddedToken(s, special=True, normalized=False)])
    tok.save(str(out / "tokenizer.json"))
    ids = {s: tok.token_to_id(s) for s in _ADDED_SPECIAL}
    decoder = {
        str(ids[s]): {"content": s, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": s not in _NOT_SPECIAL}
        for s in _ADDED_SPECIAL
    }
    bad = sorted(ids[s] for s in _ADDED_SPECIAL if s not in _DUPLEX_ALLOWED and s not in _NOT_BAD)
    tcfg = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "unk_token": "<unk>",
        "pad_token": "<|endoftext|>",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 40960,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "chat_template": _CHAT_TEMPLATE,
        "bad_token_ids": bad,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=1, ensure_ascii=False), encoding="utf-8")
    smap = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<unk>", "pad_token": "<|endoftext|>",
            "additional_special_tokens": [s for s in _ADDED_SPECIAL if s not in _NOT_SPECIAL]}
    (out / "special_tokens_map.json").write_text(json.dumps(smap, indent=1), encoding="utf-8")
    ids["__len__"] = tok.get_vocab_size()
    return ids


def tiny_config_dict(vocab_size: int, eos_ids: List[int], pad_id: int, audio_bos: int, text_eos: int) -> dict:
    """config.json of the tiny model (real layout; sizes per docs/model.md §9)."""
    num_text = ((vocab_size + 127) // 128) * 128
    return {
        "architectures": ["MiniCPMO"],
        "model_type": "minicpmo",
        "version": "4.5",
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "bos_token_id": pad_id,
        "eos_token_id": eos_ids,
        "pad_token_id": pad_id,
        "query_num": 64,
        "image_size": 448,
        "patch_size": 14,
        "drop_vision_last_layer": False,
        "audio_pool_step": 5,
        "audio_chunk_length": 1.0,
        "stream_input": True,
        "use_image_id": True,
        "slice_mode": True,
        "slice_config": {"max_slice_nums": 1, "model_type": "minicpmv", "patch_size": 14, "scale_resolution": 448},
        "init_vision": True,
        "init_audio": True,
        "init_tts": True,
        "torch_dtype": "float32",
        "vision_config": {
            "model_type": "siglip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_channels": 3,
            "image_size": 980,
            "patch_size": 14,
            "layer_norm_eps": 1e-6,
            "hidden_act": "gelu_pytorch_tanh",
            "attention_dropout": 0.0,
        },
        "audio_config": {
            "model_type": "whisper",
            "d_model": 64,
            "encoder_layers": 1,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 256,
            "decoder_layers": 1,
            "decoder_attention_heads": 2,
            "decoder_ffn_dim": 256,
            "num_mel_bins": 80,
            "max_source_positions": 1500,
            "activation_function": "gelu",
            "scale_embedding": False,
            "pad_token_id": 50257,
            "bos_token_id": 50257,
            "eos_token_id": 50257,
        },
        "tts_config": {
            "model_type": "minicpmtts",
            "backbone_model": "llama",
            "llm_dim": 128,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "num_hidden_layers": 1,
            "max_position_embeddings": 4096,
            "num_audio_tokens": 6562,
            "num_text_tokens": num_text,
            "num_vq": 1,
            "audio_bos_token_id": audio_bos,
            "text_eos_token_id": text_eos,
            "hidden_act": "silu",
            "condition_type": "hidden_text_merge",
            "normalize_projected_hidden": True,
            "projector_type": "mlp",
            "attention_type": "full_attention",
        },
    }


def _is_gain(key: str, shape) -> bool:
    if key.endswith("parametrizations.weight.original0"):
        return True
    parts = key.split(".")
    return len(shape) == 1 and parts[-1] == "weight" and ("norm" in parts[-2] or parts[-2].startswith("ln_"))


def _expected_shapes(cfg) -> Dict[str, tuple]:
    import torch

    from .loader import _talker_expected
    from .thinker import ThinkerModules

    with meta_device():
        mods = ThinkerModules(cfg)
    shapes = {k: tuple(v.shape) for k, v in mods.state_dict().items()}
    shapes.update(_talker_expected(cfg))
    t = cfg.tts_config
    shapes["tts.model.embed_tokens.weight"] = (32000, t.hidden_size)
    shapes["tts.projector_spk.linear1.weight"] = (t.hidden_size, t.llm_dim)
    shapes["tts.projector_spk.linear1.bias"] = (t.hidden_size,)
    shapes["tts.projector_spk.linear2.weight"] = (t.hidden_size, t.hidden_size)
    shapes["tts.projector_spk.linear2.bias"] = (t.hidden_size,)
    return shapes


def build_tiny_checkpoint(out_dir: Union[str, Path], *, seed: int = 0) -> Path:
    """Write a tiny random-weight checkpoint into ``out_dir`` (created; existing files overwritten).

    Returns the directory. Weights: N(0, 0.02) per tensor (gains 1 + 0.02·z), from a numpy PCG64
    generator seeded with ``seed`` and the key, so the same seed gives the same weights.
    """
    from safetensors.numpy import save_file

    from .config import MiniCPMOConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ids = _write_tokenizer(out)
    n_tok = ids.pop("__len__")
    vocab = ((n_tok + 63) // 64) * 64
    cfg_d = tiny_config_dict(vocab, [ids["<|im_end|>"], ids["<|endoftext|>"]], ids["<|endoftext|>"],
                             ids["<focus>"], ids["</perception>"])
    (out / "config.json").write_text(json.dumps(cfg_d, indent=2), encoding="utf-8")
    cfg = MiniCPMOConfig.from_dict(cfg_d)
    tensors = {}
    for key, shape in sorted(_expected_shapes(cfg).items()):
        h = int.from_bytes(hashlib.sha256(f"{seed}:{key}".encode()).digest()[:8], "little")
        z = np.random.default_rng(h).standard_normal(int(np.prod(shape)) if shape else 1)
        v = 1.0 + 0.02 * z if _is_gain(key, shape) else 0.02 * z
        tensors[key] = v.astype(np.float32).reshape(shape)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": ids["<|endoftext|>"], "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"], "do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
    }, indent=2), encoding="utf-8")
    (out / "preprocessor_config.json").write_text(json.dumps({
        "max_slice_nums": 1, "scale_resolution": 448, "patch_size": 14, "use_image_id": True,
        "image_feature_size": 64, "im_start": "<image>", "im_end": "</image>", "slice_start": "<slice>",
        "slice_end": "</slice>", "unk": "<unk>", "im_id_start": "<image_id>", "im_id_end": "</image_id>",
        "slice_mode": True, "audio_pool_step": 5, "norm_mean": [0.5, 0.5, 0.5], "norm_std": [0.5, 0.5, 0.5],
        "version": 4.5,
    }, indent=2), encoding="utf-8")
    try:
        from . import code2wav as _c2w

        writer = getattr(_c2w, "write_tiny_token2wav", None)
    except ImportError:
        writer = None
    t2w = False
    if writer is not None:
        (out / "assets").mkdir(exist_ok=True)
        writer(out / "assets", seed)
        t2w = (out / "assets" / "token2wav").is_dir()
    (out / RANDOM_WEIGHTS_MARKER).write_text(json.dumps({
        "builder": "duplexkit.models.minicpmo45.tiny", "version": TINY_VERSION, "seed": seed,
        "random_weights": True, "token2wav": t2w,
        "note": "random weights: outputs are meaningless, for tests and demos only",
    }, indent=2), encoding="utf-8")
    return out


def tiny_checkpoint(seed: int = 0, *, cache_dir: Optional[Union[str, Path]] = None, rebuild: bool = False) -> Path:
    """The cached tiny checkpoint for ``seed`` (built on first use; concurrent builders are safe)."""
    root = Path(cache_dir or os.environ.get("DUPLEXKIT_CACHE") or Path.home() / ".cache" / "duplexkit")
    target = root / f"tiny-{TINY_VERSION}-{seed}"
    if (target / RANDOM_WEIGHTS_MARKER).is_file() and not rebuild:
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tiny-{seed}-", dir=root))
    try:
        build_tiny_checkpoint(tmp, seed=seed)
        if target.exists():
            if not rebuild and (target / RANDOM_WEIGHTS_MARKER).is_file():
                return target
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / RANDOM_WEIGHTS_MARKER).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
