"""The batch-shaped stage functions the runtime drives (torch-free interface).

The runtime (:mod:`duplexkit.engine.runtime`) knows nothing about a model: it schedules work
items through three :class:`StageModel` entry points, each taking a *list* of items (one per
stream, at most ``max_num_seqs``) and returning a list of results of the same length and order:

* :meth:`StageModel.thinker_step`  ``list[ThinkerWork]  -> list[ThinkerOut | BaseException]``
* :meth:`StageModel.talker_step`   ``list[TalkerWork]   -> list[TalkerOut  | BaseException]``
* :meth:`StageModel.code2wav_step` ``list[VocoderWork]  -> list[VocoderOut | BaseException]``

An exception *returned* in a result slot fails only that item's stream; an exception *raised*
by the call fails every stream of that batch (their state may be half-updated). Per-stream state
handles (``handle``/``turn``) are opaque to the runtime and are only ever touched from the
stage's own worker thread. :class:`~duplexkit.engine.minicpmo45.MiniCPMO45Stages` implements this
over the MiniCPM-o 4.5 port; tests may implement it with plain Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, runtime_checkable

import numpy as np

from duplexkit.errors import InjectedFault

from .api import ReferenceVoice, StreamConfig

__all__ = [
    "InjectedFault",
    "ThinkerWork",
    "ThinkerOut",
    "TalkerWork",
    "TalkerOut",
    "VocoderWork",
    "VocoderOut",
    "StageModel",
    "FaultHook",
]


@dataclass
class ThinkerWork:
    """One unit for one stream.

    Attributes:
        handle: the stream's thinker state (from :meth:`StageModel.thinker_open`).
        audio: float32 [16560] (unit 0) or [16000], 16 kHz mono.
        force_listen / force_speak: docs/model.md §5.3 / §5.4.
        frame: optional uint8 RGB [H, W, 3].
        unit_index: the stream's unit counter (for messages).
    """

    handle: Any
    audio: np.ndarray
    force_listen: bool = False
    force_speak: bool = False
    frame: Optional[np.ndarray] = None
    unit_index: int = 0


@dataclass
class ThinkerOut:
    """Result of one unit.

    Attributes:
        decision: ``listen`` | ``speak``.
        text: the unit's spoken text (empty for listen).
        n_tokens: LLM tokens this unit accounts for.
        turn_start / end_of_turn: the unit opens / closes (``<|turn_eos|>``) a model turn.
        talker_input: opaque payload for the talker (token ids + hidden rows), None for listen.
        timings: ``prefill_ms``, ``decode_ms``, ``decode_steps``.
    """

    decision: str
    text: str = ""
    n_tokens: int = 0
    turn_start: bool = False
    end_of_turn: bool = False
    talker_input: Any = None
    timings: dict = field(default_factory=dict)


@dataclass
class TalkerWork:
    """One speaking unit for the talker. ``turn`` is the stream's talker turn state."""

    turn: Any
    talker_input: Any
    turn_start: bool
    turn_end: bool


@dataclass
class TalkerOut:
    """Codec tokens of one unit: int64 [<=25] (docs/model.md §6), and the talker's step count."""

    codes: np.ndarray
    steps: int = 0


@dataclass
class VocoderWork:
    """Codes to push into one stream's Code2Wav state; ``last`` = terminal flush of the turn."""

    handle: Any
    codes: np.ndarray
    last: bool


@dataclass
class VocoderOut:
    """float32 24 kHz audio produced by the push (may be empty, docs/model.md §7.1)."""

    audio: np.ndarray


@runtime_checkable
class StageModel(Protocol):
    """What the runtime needs from a model. All methods run on the owning stage's worker thread.

    One name per operation on a stream's state in every stage: ``<stage>_open``, ``<stage>_step``
    (a batch of units), ``<stage>_end_turn``, ``<stage>_close`` (plus ``thinker_update``). The
    talker's state is one turn: ``talker_open`` starts it at the turn's first speaking unit and
    ``talker_close`` ends it, so it has no ``talker_end_turn``."""

    model_id: str
    random_weights: bool

    # thinker
    def thinker_open(self, config: StreamConfig) -> Any: ...
    def thinker_update(self, handle: Any, old: StreamConfig, new: StreamConfig) -> Any: ...
    def thinker_step(self, items: list) -> list: ...
    def thinker_end_turn(self, handle: Any) -> None: ...
    # optional: forced speech (SpeakText). Queue ``text`` (non-empty str) to be spoken from the
    # stream's next unit at ``tokens_per_unit`` (>= 1) tokens a unit; raise to refuse it (the runtime
    # then answers with a non-fatal EngineFailure). A model without it refuses every SpeakText.
    # def thinker_speak_text(self, handle: Any, text: str, tokens_per_unit: int) -> None: ...
    def thinker_close(self, handle: Any) -> None: ...

    # talker
    def talker_open(self, seed: Optional[int]) -> Any: ...
    def talker_step(self, items: list) -> list: ...
    def talker_close(self, turn: Any) -> None: ...

    # code2wav
    def code2wav_open(self, ref_voice: Optional[ReferenceVoice]) -> Any: ...
    def code2wav_step(self, items: list) -> list: ...
    def code2wav_end_turn(self, handle: Any) -> None: ...
    def code2wav_close(self, handle: Any) -> None: ...


@runtime_checkable
class FaultHook(Protocol):
    """A test's fault plan, installed on a runtime (``StageRuntime.fault_hook``; None in production).

    Before each batch call the runtime asks the hook once per stream of the batch; an exception it
    returns stands in for that stream's result, exactly as if the model had returned it in the
    stream's result slot. The hook owns its state: nothing of it lives in the runtime's stream
    records. :class:`duplexkit.testing.faults.StageFaults` is the one the tests use."""

    def take(self, stage: str, stream_id: str) -> Optional[BaseException]:
        """The exception for ``stream_id``'s next work item at ``stage`` (consumed), or None."""
        ...

