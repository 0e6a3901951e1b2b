"""The built-in duplex engine: :class:`DuplexEngine` (implements :class:`duplexkit.engine.api.Engine`).

Construction::

    engine = DuplexEngine.from_pretrained("tiny", layout="cpu")        # tiny random weights (cached)
    engine = DuplexEngine.from_pretrained("/ckpt/MiniCPM-o-4_5", layout="1gpu")
    engine = DuplexEngine(model, layout)                               # an in-memory MiniCPMO45

Streams (:meth:`open_stream`) run through the three stage workers of
:class:`~duplexkit.engine.runtime.StageRuntime`; turn-based chat (:meth:`generate`,
:meth:`generate_stream`) runs as jobs on the same workers (thinker chat pass, then the offline
talker, then one vocoder stream), so torch work never runs on the event loop.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path
from typing import Any, AsyncIterator, Optional, Union

import numpy as np

from .api import (CODES_PER_CHUNK, AppendUnit, AudioChunk, ChatDelta, ChatRequest, ChatResult, EngineFailure, StreamConfig,
                  TurnEnd)
from .layout import Layout, LayoutError, LayoutNotSupportedError, check_supported, load_layout
from .runtime import FIRST_UNIT_SAMPLES, RuntimeStream, StageRuntime
from .stages import StageModel, VocoderWork

__all__ = ["DuplexEngine", "tiny_checkpoint_dir", "default_layout_name", "chat_code_budget",
           "CHAT_CODES_BASE", "CHAT_CODES_PER_TEXT_TOKEN"]


CHAT_CODES_BASE = 2 * CODES_PER_CHUNK
"""Codec tokens every turn-based audio reply may use whatever its length: 2 s (25 codes = 1 s,
docs/model.md §7.1). See :func:`chat_code_budget`."""

CHAT_CODES_PER_TEXT_TOKEN = CODES_PER_CHUNK
"""Codec tokens allowed per reply text token: 1 s of speech per token (one chunk of 25 codes). Real speech runs at about
2.5-4 text tokens per second, so this is more than 2x any real speech rate and never cuts a real
model's answer. It is 2.5x more generous than vLLM-Omni's ``text_len * 10`` cap, which docs/model.md §11
reports truncating speech. It exists because a talker that never samples EOS (random weights:
``tiny``) would otherwise run to ``chat_max_codes`` (82 s of noise for a 64-token reply)."""


CHAT_SLICE_MS = 20.0
"""Longest stretch (ms, at least one token) of a turn-based reply (chat completions, the tool decider,
the recogniser) on the thinker's stage thread before the duplex units' next step may run: a reply is
generated in slices between unit steps, so it delays the live sessions' units by at most about one
slice per step instead of its whole length (``DuplexEngine.chat_slice_ms``)."""


def chat_code_budget(n_text_tokens: int, chat_max_codes: int) -> int:
    """The codec-token cap of one turn-based audio reply: ``min(chat_max_codes, CHAT_CODES_BASE +
    CHAT_CODES_PER_TEXT_TOKEN * n_text_tokens)`` (25 codes = 1 s of 24 kHz audio).

    Args:
        n_text_tokens: text tokens of the reply (the thinker's completion tokens), >= 0.
        chat_max_codes: the engine's absolute cap (default 2048, docs/model.md §6).
    Returns:
        The cap in codec tokens, >= 1.
    """
    return max(1, min(int(chat_max_codes), CHAT_CODES_BASE + CHAT_CODES_PER_TEXT_TOKEN * max(0, int(n_text_tokens))))


def default_layout_name() -> str:
    """``1gpu`` when CUDA is available, else ``cpu``."""
    try:
        import torch

        return "1gpu" if torch.cuda.is_available() else "cpu"
    except ImportError:  # pragma: no cover - engine extra missing
        return "cpu"


def tiny_checkpoint_dir(seed: int = 0, cache_dir: Optional[Union[str, Path]] = None) -> Path:
    """Build (once) and return the tiny random-weight checkpoint directory.

    Delegates to ``duplexkit.models.minicpmo45.tiny_checkpoint`` (cached under ``cache_dir`` or
    ``$DUPLEXKIT_CACHE`` or ``~/.cache/duplexkit``, versioned, safe against concurrent builders),
    which writes it with ``build_tiny_checkpoint``.
    """
    from duplexkit.models.minicpmo45 import tiny_checkpoint

    return Path(tiny_checkpoint(seed, cache_dir=cache_dir))


def _plan_options(plan) -> dict:
    from .memory_plan import fast_options

    return fast_options(plan)


def _torch_dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


class DuplexEngine:
    """Many duplex streams over one MiniCPM-o 4.5 model (docs/architecture.md, "The runtime").

    Args:
        model: a loaded ``duplexkit.models.minicpmo45.MiniCPMO45``, or any
            :class:`~duplexkit.engine.stages.StageModel` (used as is).
        layout: a :class:`~duplexkit.engine.layout.Layout`, a bundled layout name or a YAML
            path (default: ``1gpu`` with CUDA, else ``cpu``). Only ``max_num_seqs`` and the memory
            budgets are applied here; devices and dtypes are applied when loading
            (:meth:`from_pretrained`).
        model_id: the id reported to clients (default ``"minicpm-o-4.5"``).
        chat_max_codes: cap on codec tokens of one turn-based audio reply (default 2048, the
            reference offline cap, docs/model.md §6; 25 codes = 1 s). Also settable as an attribute.
            Each reply is further bounded by its text length: at most ``CHAT_CODES_BASE +
            CHAT_CODES_PER_TEXT_TOKEN * completion_tokens`` codes (2 s + 1 s per text token, see
            :func:`chat_code_budget`), so a talker that never samples EOS (random weights) stops
            in proportion to the reply instead of running to this cap.
        max_streams: the most streams open at once (a memory plan's stream slots); :meth:`open_stream`
            beyond it raises :class:`~duplexkit.errors.EngineCapacityError`. None: no cap.

    Raises:
        LayoutError / LayoutNotSupportedError: invalid layout, a ``vllm`` thinker backend without an
            importable vllm, or CUDA devices that are not there.
    """

    def __init__(self, model: Any, layout: Union[Layout, str, Path, None] = None, *,
                 model_id: str = "minicpm-o-4.5", chat_max_codes: int = 2048,
                 max_streams: Optional[int] = None) -> None:
        if int(chat_max_codes) < 1:
            raise ValueError("chat_max_codes must be >= 1")
        if max_streams is not None and int(max_streams) < 1:
            raise ValueError("max_streams must be >= 1")
        self.max_streams = None if max_streams is None else int(max_streams)
        #: the memory plan the engine was built to (:meth:`from_pretrained` ``memory_gib``), else None
        self.memory_plan = None
        self.chat_max_codes = int(chat_max_codes)
        self.chat_slice_ms = CHAT_SLICE_MS
        self.layout = load_layout(layout or default_layout_name())
        self._check_devices(self.layout)
        if isinstance(model, StageModel) and not hasattr(model, "thinker"):
            self.stages = model
            self.model = getattr(model, "model", None)
        else:
            from .minicpmo45 import MiniCPMO45Stages

            self.model = model
            self.stages = MiniCPMO45Stages(model, model_id=model_id)
        self.model_id = getattr(self.stages, "model_id", model_id)
        self.random_weights = bool(getattr(self.stages, "random_weights", False))
        self.random_weights_noticed = False  # set by from_pretrained once it printed RANDOM_WEIGHTS_NOTICE
        m = self.model
        self.supports_audio = bool(getattr(self.stages, "supports_audio",
                                           m is None or getattr(m, "code2wav", None) is not None))
        """False when the model has no vocoder (a checkpoint without ``assets/token2wav``): sessions
        and chat requests then answer in text only."""
        self._runtime = StageRuntime(self.stages, self.layout)
        self._closed = False

    def _off_stage_threads(self, method: str) -> None:
        """Raise RuntimeError when called on a stage worker thread: a job run there would wait for itself."""
        if threading.current_thread() in self._runtime._threads:
            raise RuntimeError(f"DuplexEngine.{method}() called on a stage worker thread: it would wait for itself")

    def warmup(self, max_kv_len: int = 512, code2wav_sizes: Optional[tuple] = None) -> int:
        """Capture the GPU fast paths' CUDA graphs for every batch size a stage can form
        (1..``max_num_seqs`` of its layout), so no capture happens while streams are live, and tune
        the vocoder's convolutions for the batch buckets it will meet.

        Each stage's warm-up runs **on that stage's worker thread**, one stage after the other:
        PyTorch keeps cuDNN's autotuned convolution plans per thread (``thread_local`` benchmark
        cache in ATen's cuDNN v8 convolution), so plans tuned on the caller's thread were tuned again
        by the Code2Wav thread at its first chunks of each batch size, mid-conversation (measured on
        the H200: 8 new streams waited 2.4-2.8 s for their first audio, benchmarks/results/2026-12-02-cudnn-per-thread-h200.md).

        Args:
            max_kv_len: thinker/talker KV positions the captured graphs cover.
            code2wav_sizes: vocoder batch sizes to warm (default: the vocoder's
                ``warmup_sizes(max_num_seqs)``, i.e. every HiFT row bucket a batch of up to
                ``max_num_seqs`` streams is padded to).

        Each warm-up runs under the stage model's ``stage_scope(stage)`` when it has one, so with
        ``DUPLEXKIT_THINKER_STREAM=1`` the thinker's graphs are captured from the thinker's own CUDA
        stream (:mod:`duplexkit.engine.thinker_stream`).

        A no-op for stages without a ``warmup`` method (the CPU reference path, custom stage
        models). Returns the number of graphs captured. Called by :meth:`from_pretrained` when a
        stage runs on CUDA; ``benchmarks/gpu_engine.py`` measured ~18 s for 39 graphs on an H200.

        Raises:
            RuntimeError: called on one of the engine's stage threads (it would wait for itself), or
                the engine is closed.
        """
        self._off_stage_threads("warmup")
        m = self.model
        if m is None:
            return 0
        jobs = []
        for stage, obj in (("thinker", getattr(m, "thinker", None)), ("talker", getattr(m, "talker", None))):
            if obj is not None and hasattr(obj, "warmup"):
                sizes = list(range(1, self.layout.stages[stage].max_num_seqs + 1))
                jobs.append((stage, lambda obj=obj, sizes=sizes: obj.warmup(sizes, max_kv_len)))
        c2w = getattr(m, "code2wav", None)
        if c2w is not None and hasattr(c2w, "warmup"):
            sizes = code2wav_sizes
            if sizes is None:
                cap = self.layout.code2wav.max_num_seqs
                sizes = c2w.warmup_sizes(cap) if hasattr(c2w, "warmup_sizes") else (1,)
            jobs.append(("code2wav", lambda sizes=tuple(sizes): c2w.warmup(sizes)))
        scope = getattr(self.stages, "stage_scope", None)  # the thinker's own CUDA stream, when it has one

        def in_scope(stage: str, fn):
            if scope is None:
                return fn

            def run():
                with scope(stage):
                    return fn()

            return run

        n = 0
        for stage, fn in jobs:
            n += int(self._runtime.run_job(stage, in_scope(stage, fn)).result())
        return n

    def warmup_tools(self) -> Optional[float]:
        """Build the thinker's constrained-decoding tables for tool calls now, on the thinker's
        thread, instead of at the first turn that offers tools: the llguidance tokenizer and the
        per-token byte lengths (~1 s of CPU for the real 151,748-token vocabulary; ms for the tiny
        one). A turn that paid this inside the tool decider's budget (3 s) could miss it under load.

        Returns the time taken in ms, or None when there is nothing to warm (the stage model has no
        ``tools_warmup``, or llguidance is not installed: the ``agent`` extra). A build that fails
        (e.g. llguidance < 1.7, which refuses the list of chat stop ids) is logged as a warning
        here, at load, and remembered: every tool decision then fails at once with the same reason.

        Raises:
            RuntimeError: called on one of the engine's stage threads, or the engine is closed.
        """
        self._off_stage_threads("warmup_tools")
        fn = getattr(self.stages, "tools_warmup", None)
        if fn is None:
            return None
        return self._runtime.run_job("thinker", fn).result()

    def warmup_turn(self, timeout_s: float = 120.0) -> Optional[float]:
        """Run one throw-away turn through the three stages: a stream is opened, one all-zero unit
        0 (float32 [16560], 16 kHz) is appended with ``force_speak``, and the stream is closed at its
        first audio chunk (or at the turn's end / a failure when nothing is voiced).

        This pays the one-time lazy initialisation that graph capture does not reach (the audio
        encoder's first eager call, kernel autotuning of the vocoder's convolutions, allocator
        growth): measured on the H200, a process's first response took 1.7-2.3 s against 0.4 s
        afterwards (benchmarks/results/2026-12-01-e2e-latency-h200.md). Runs on its own event loop in a helper thread,
        so it may be called with or without a running loop. Returns the time to the first audio
        chunk in ms (None when the turn produced no audio).

        Raises:
            TimeoutError: no first audio / turn end within ``timeout_s``.
        """
        result: dict = {}

        async def turn() -> None:
            stream = await self.open_stream("__warmup__", StreamConfig())
            t0 = time.perf_counter()
            stream.submit(AppendUnit("__warmup__", stream.epoch, unit_index=0,
                                     audio=np.zeros(FIRST_UNIT_SAMPLES, np.float32), force_speak=True))

            async def first_audio() -> None:
                async for out in stream.outputs():
                    if isinstance(out, AudioChunk):
                        result["ms"] = (time.perf_counter() - t0) * 1000
                        return
                    if isinstance(out, (TurnEnd, EngineFailure)):
                        return

            try:
                await asyncio.wait_for(first_audio(), timeout_s)
            finally:
                await stream.aclose()

        err: list = []

        def run() -> None:
            try:
                asyncio.run(turn())
            except BaseException as exc:  # re-raised in the caller's thread
                err.append(exc)

        th = threading.Thread(target=run, name="duplexkit-warmup-turn", daemon=True)
        th.start()
        th.join()
        if err:
            raise err[0]
        return result.get("ms")

    @staticmethod
    def _check_devices(layout: Layout) -> None:
        uses_cuda = any(d != "cpu" for s in layout.stages.values() for d in s.devices)
        n = 0
        if uses_cuda or layout.thinker.tensor_parallel_size > 1:
            try:
                import torch

                n = torch.cuda.device_count()
            except ImportError:  # pragma: no cover
                n = 0
        check_supported(layout, cuda_devices=n)
        if uses_cuda:
            import torch

            budget: dict = {}
            for s in layout.stages.values():
                for d in s.devices:
                    if d != "cpu" and s.memory_fraction is not None:
                        idx = int(d.split(":")[1]) if ":" in d else 0
                        budget[idx] = budget.get(idx, 0.0) + s.memory_fraction
            for idx, frac in budget.items():
                torch.cuda.set_per_process_memory_fraction(min(1.0, frac), idx)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, path: Union[str, Path] = "tiny", layout: Union[Layout, str, Path, None] = None, *,
                        dtype: Optional[str] = None, progress: bool = True, seed: int = 0,
                        cache_dir: Optional[Union[str, Path]] = None, with_code2wav: bool = True,
                        model_id: str = "minicpm-o-4.5", quantization: Optional[str] = None,
                        memory_gib: Optional[float] = None, thinker_positions: Optional[int] = None,
                        streams: Optional[int] = None) -> "DuplexEngine":
        """Load a checkpoint directory (or ``"tiny"``) onto the layout's devices.

        Args:
            path: a MiniCPM-o 4.5 checkpoint directory, or ``"tiny"`` (random weights, built once
                by ``build_tiny_checkpoint`` and cached, see :func:`tiny_checkpoint_dir`).
            layout: layout (see the class); validated before any weight is read.
            dtype: override of the thinker's layout dtype (``float32`` | ``bfloat16`` | ``float16``).
            seed: weight seed of the tiny checkpoint.
            progress: print load progress to stderr, and the one-line random-weights notice
                (:data:`~duplexkit.engine.checks.RANDOM_WEIGHTS_NOTICE`) when the weights are random.
            quantization: ``none`` (default), ``int8`` or ``fp8``: quantized weights for the
                thinker's and talker's decoder linears (docs/model.md "Quantized weights"; the
                weight bytes before / after are printed with ``progress`` and kept in
                ``engine.model.quantization``). Not with a ``backend: vllm`` thinker.
            memory_gib: a device memory budget in GiB (:mod:`~duplexkit.engine.memory_plan`): the
                plan's stream slots become every stage's ``max_num_seqs`` and the engine's
                ``max_streams``, the fast paths' KV pools are sized (and the thinker's capped) to them,
                the thinker's KV positions and Code2Wav's graph rows are the plan's, and on CUDA the
                process's allocator is capped at the budget less the CUDA context. ``engine.memory_plan``
                holds the plan. None: the layout's sizes, pools growing on demand.
            thinker_positions: thinker KV positions per stream the plan starts from (default
                :data:`~duplexkit.engine.memory_plan.DEFAULT_THINKER_POSITIONS`; shrunk when needed).
            streams: the stream count the plan must hold (None: as many as fit).

        A layout whose thinker has ``backend: vllm`` gets its thinker's language model on an
        in-process vLLM engine (:class:`~duplexkit.engine.vllm_stages.VllmStages`, docs/vllm.md);
        this process must then import vllm.

        Raises:
            LayoutError, LayoutNotSupportedError (also: ``quantization`` with a vLLM thinker);
            ``CheckpointError`` / ``QuantizationError`` from the loader;
            :class:`~duplexkit.engine.memory_plan.MemoryBudgetError` (a ``LayoutError``) when
            ``memory_gib`` cannot hold the weights, one stream or ``streams``.
        """
        lay = load_layout(layout or default_layout_name())
        from duplexkit.models.minicpmo45 import load

        ckpt = tiny_checkpoint_dir(seed, cache_dir) if str(path) == "tiny" else Path(path)
        mplan = None
        if memory_gib is not None:
            mplan, lay = cls._memory_plan(ckpt, lay, memory_gib, dtype=dtype, quantization=quantization,
                                          thinker_positions=thinker_positions, streams=streams)
        cls._check_devices(lay)
        if mplan is not None:
            from .memory_plan import apply_memory_cap

            apply_memory_cap(mplan, lay.thinker.device)
            if progress:
                print(mplan.table(), file=sys.stderr, flush=True)
        plan = None
        if lay.thinker.backend == "vllm":
            from .placement import plan_placement

            plan = plan_placement(lay, ckpt)  # head count vs tensor_parallel_size, before any weight is read
        dname = dtype or lay.thinker.dtype
        if dname not in ("float32", "bfloat16", "float16"):
            raise LayoutError(f"dtype must be float32, bfloat16 or float16, got {dname!r}")
        talker_dtype = dtype or lay.talker.dtype
        if plan is not None and quantization not in (None, "", "none"):
            raise LayoutError("quantization applies to the native thinker; a backend: vllm layout takes vLLM's "
                              "own quantization options (docs/vllm.md)")
        model = load(ckpt, quantization=quantization, dtype={"thinker": _torch_dtype(dname), "talker": _torch_dtype(talker_dtype),
                                  "code2wav": _torch_dtype(lay.code2wav.dtype)},
                     devices=lay.devices(), with_code2wav=with_code2wav,
                     progress=progress, fast={"thinker": False} if plan is not None else None,
                     fast_options=None if mplan is None else _plan_options(mplan))
        if plan is not None:  # the thinker's language model on vLLM, the rest native (docs/vllm.md)
            from .vllm_stages import VllmStages

            args = dict(plan.stages["thinker"].engine_args, dtype=dname)
            stages = VllmStages(model, ckpt, args, on_cpu=plan.stages["thinker"].devices == ("cpu",), model_id=model_id)
            try:
                return cls(stages, lay, model_id=model_id)
            except BaseException:
                stages.close()
                raise
        engine = cls(model, lay, model_id=model_id, max_streams=None if mplan is None else mplan.streams)
        if mplan is not None:
            from .memory_plan import apply_plan_to_model

            engine.memory_plan = mplan
            apply_plan_to_model(model, mplan)
        engine.warmup_tools()
        if any(d.startswith("cuda") for d in lay.devices().values()):
            t0 = time.perf_counter()
            n = engine.warmup()
            if progress and n:
                print(f"[duplexkit] captured {n} CUDA graphs in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            engine.warmup_turn()
            if progress:
                print(f"[duplexkit] warm-up turn through the three stages in {time.perf_counter() - t0:.1f} s",
                      file=sys.stderr, flush=True)
        if progress and engine.random_weights:
            from .checks import RANDOM_WEIGHTS_NOTICE

            print(RANDOM_WEIGHTS_NOTICE, file=sys.stderr, flush=True)
            engine.random_weights_noticed = True  # the CLI does not repeat it
        return engine

    @staticmethod
    def _memory_plan(ckpt: Path, lay: Layout, memory_gib: float, *, dtype: Optional[str], quantization: Optional[str],
                     thinker_positions: Optional[int], streams: Optional[int]):
        """(plan, layout sized to it) for :meth:`from_pretrained`'s ``memory_gib`` (no weights read)."""
        from .memory_plan import DEFAULT_THINKER_POSITIONS, layout_for_plan, model_sizes_for, plan_memory

        sizes = model_sizes_for(str(ckpt))
        on_cuda = lay.code2wav.device.startswith("cuda")
        plan = plan_memory(sizes, float(memory_gib), dtype=dtype or lay.thinker.dtype, quantization=quantization or "none",
                           streams=streams, thinker_positions=thinker_positions or DEFAULT_THINKER_POSITIONS,
                           att_cache_bytes=2 if (on_cuda or lay.code2wav.dtype == "float16") else 4)
        return plan, layout_for_plan(lay, plan)

    def kv_usage(self) -> dict:
        """KV-cache occupancy of the stages that keep a static pool (the GPU fast paths'
        ``fast_kv.KVPool``), for metrics: ``{stage: {"slots_used", "slots_total", "bytes",
        "positions_per_slot"}}`` with ``stage`` in ``thinker``, ``talker`` and ``thinker_audio``
        (the fast thinker's Whisper streaming-cache pool, ``FastThinker.whisper_pool``: 1504
        positions, 147.8 MB per slot in bf16 on the real model). ``bytes`` is the K and V
        storage allocated for the pool (it grows by whole slots, never shrinks). Stages without a
        pool (the CPU reference path) are left out, so the CPU engine returns ``{}``. Read without
        the stage threads' lock: a consistent snapshot of each pool, not across pools.
        """
        out: dict = {}
        m = self.model
        for stage, owner, attr in (("thinker", "thinker", "pool"), ("talker", "talker", "pool"),
                                   ("thinker_audio", "thinker", "whisper_pool")):
            pool = getattr(getattr(m, owner, None), attr, None)
            if pool is None or not hasattr(pool, "n_slots"):
                continue
            total = int(pool.n_slots)
            out[stage] = {"slots_used": total - len(pool.free), "slots_total": total, "bytes": int(pool.nbytes()),
                          "positions_per_slot": int(pool.max_len)}
        return out

    # ------------------------------------------------------------------ Engine interface
    @property
    def num_streams(self) -> int:
        """Streams currently open."""
        return self._runtime.num_streams

    async def open_stream(self, stream_id: str, config: StreamConfig) -> RuntimeStream:
        """Open a duplex stream (see :class:`~duplexkit.engine.runtime.RuntimeStream`); waits until
        its session prefix is prefilled. Open failures arrive as a fatal ``EngineFailure`` output.

        Raises:
            EngineCapacityError: ``max_streams`` streams are open (the memory plan's slots)."""
        if self.max_streams is not None and self._runtime.num_streams >= self.max_streams:
            from duplexkit.errors import EngineCapacityError

            raise EngineCapacityError(f"all {self.max_streams} stream slots of the engine are taken (its memory plan"
                                      f"{'' if self.memory_plan is None else f' for {self.memory_plan.budget_gib:g} GiB'}"
                                      "); close a stream first")
        return await self._runtime.open_stream(stream_id, config)

    async def _job(self, stage: str, fn) -> Any:
        return await asyncio.wrap_future(self._runtime.run_job(stage, fn))

    async def generate_stream(self, request: ChatRequest) -> AsyncIterator[ChatDelta]:
        """Turn-based generation, streamed: text deltas as the thinker generates them, then (with
        ``output_audio``) float32 24 kHz audio deltas, one per vocoder chunk (docs/model.md §7.3: about
        0.84 s first, then 1 s). The audio needs the whole reply text first (the offline talker is
        conditioned on the finished span, docs/model.md §6). Use :meth:`generate` for usage counts and
        the finish reason."""
        async for item in self._generate_iter(request):
            if isinstance(item, ChatDelta):
                yield item
            else:  # the thinker result: close the stream with the finish reason, token usage and calls
                yield ChatDelta(finish_reason=item.finish_reason, usage={
                    "prompt_tokens": int(item.prompt_tokens), "completion_tokens": int(item.completion_tokens),
                    "total_tokens": int(item.prompt_tokens) + int(item.completion_tokens)},
                    tool_calls=tuple(getattr(item, "tool_calls", ())))

    async def generate(self, request: ChatRequest) -> ChatResult:
        """Turn-based generation (chat completions): text and, with ``output_audio``, the whole
        float32 24 kHz waveform (``None`` without audio).

        Raises:
            ValueError / model errors for bad requests (e.g. empty messages).
        """
        text, chunks, meta = "", [], None
        async for item in self._generate_iter(request):
            if isinstance(item, ChatDelta):
                text += item.text
                if item.audio is not None:
                    chunks.append(item.audio)
            else:
                meta = item
        audio = None
        if request.output_audio:
            audio = np.concatenate(chunks).astype(np.float32) if chunks else np.zeros(0, np.float32)
        return ChatResult(text=text, audio=audio, finish_reason=meta.finish_reason,
                          prompt_tokens=meta.prompt_tokens, completion_tokens=meta.completion_tokens,
                          tool_calls=tuple(getattr(meta, "tool_calls", ())))

    async def _chat_thinker(self, request: ChatRequest, on_text) -> Any:
        """The thinker's text pass of a reply: in slices of :data:`CHAT_SLICE_MS` between the unit
        steps (a stage model whose ``chat_thinker_steps`` is not ``None``), else in one job."""
        st = self.stages
        if getattr(st, "chat_thinker_steps", None) is None:
            return await self._job("thinker", lambda: st.chat_thinker(request, on_text))
        steps = st.chat_thinker_steps(request, on_text)
        budget_s = max(0.0, float(self.chat_slice_ms)) / 1000.0
        finished = False
        try:
            while True:
                done, out = await self._job("thinker", lambda: st.chat_thinker_slice(steps, budget_s))
                if done:
                    finished = True
                    return out
        finally:
            if not finished and not self._closed:  # abandoned (cancelled, or a step raised): free its KV there
                try:
                    self._runtime.run_job("thinker", steps.close)
                except RuntimeError:  # the engine closed meanwhile
                    pass

    async def _generate_iter(self, request: ChatRequest):
        if not isinstance(request, ChatRequest):
            raise TypeError("generate() takes a ChatRequest")
        if not request.messages:
            raise ValueError("ChatRequest.messages is empty")
        if self._closed:
            raise RuntimeError("engine is closed")
        st = self.stages
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue = asyncio.Queue()

        def on_text(delta: str) -> None:  # thinker thread -> event loop
            loop.call_soon_threadsafe(pieces.put_nowait, delta)

        fut = asyncio.ensure_future(self._chat_thinker(request, on_text))
        sent = ""
        try:
            while True:
                get = asyncio.ensure_future(pieces.get())
                done, _ = await asyncio.wait({get, fut}, return_when=asyncio.FIRST_COMPLETED)
                if get in done:
                    sent += get.result()
                    yield ChatDelta(text=get.result())
                    continue
                get.cancel()
                break
        finally:
            if not fut.done():  # the caller stopped early: stop generating (its slices end)
                fut.cancel()
        thought = fut.result()
        while not pieces.empty():  # deltas queued before the result landed
            d = pieces.get_nowait()
            sent += d
            yield ChatDelta(text=d)
        if thought.text.startswith(sent) and len(thought.text) > len(sent):
            yield ChatDelta(text=thought.text[len(sent):])
        if request.output_audio and not getattr(thought, "tool_calls", ()):  # a call is not spoken
            budget = chat_code_budget(thought.completion_tokens, self.chat_max_codes)
            codes = await self._job("talker", lambda: st.chat_talker(thought.talker_input, request.seed, budget))
            handle = await self._job("code2wav", lambda: st.code2wav_open(request.ref_voice))
            try:
                blocks = [codes[i:i + CODES_PER_CHUNK] for i in range(0, len(codes), CODES_PER_CHUNK)] or [codes]
                for k, block in enumerate(blocks):
                    last = k == len(blocks) - 1
                    (res,) = await self._job("code2wav", lambda b=block, l=last: st.code2wav_step(
                        [VocoderWork(handle=handle, codes=np.asarray(b, np.int64), last=l)]))
                    if isinstance(res, BaseException):
                        raise res
                    if res.audio.size:
                        yield ChatDelta(audio=res.audio)
            finally:
                await self._job("code2wav", lambda: st.code2wav_close(handle))
        yield thought

    async def aclose(self) -> None:
        """Close every stream, stop the stage workers."""
        if self._closed:
            return
        self._closed = True
        await self._runtime.aclose()
        close = getattr(self.stages, "close", None)
        if close is not None:  # a stage model holding an engine of its own (vllm_stages.VllmStages)
            close()

    async def __aenter__(self) -> "DuplexEngine":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
