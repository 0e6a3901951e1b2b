"""Server-side configuration of a Session: :class:`SessionConfig`, :class:`SessionLimits`, the
:class:`CloseConnection` output and the unit constants."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Union

from duplexkit.engine.api import INPUT_SAMPLE_RATE, SILENCE_SLACK_MS, ReferenceVoice


@dataclass
class SessionLimits:
    """Per-session limits (docs/protocol.md §1.3, §1.5, §6.1, §8.2).

    Attributes:
        max_event_bytes: largest accepted client event, bytes (``--max-event-bytes``, 16 MiB).
        max_pending_input_s: input not yet consumed by the model before ``input_backpressure``, s.
        idle_timeout_s: close with reason ``timeout`` after this long without a client event, s.
        max_ref_audio_s: longest reference voice clip, s (``--max-ref-audio-s``).
        input_default_rate: Hz of a bare ``pcm16`` in the duplex profile (``--default-input-rate``).
    """

    max_event_bytes: int = 16 * 1024 * 1024
    max_pending_input_s: float = 10.0
    idle_timeout_s: float = 300.0
    max_ref_audio_s: float = 30.0
    input_default_rate: int = 16000


@dataclass
class SessionConfig:
    """Server-side configuration of a Session.

    Attributes:
        profile: ``"duplex"`` (extension events, ``ack_only``, model-native answering) or
            ``"compat"`` (OpenAI turn-based defaults, docs/protocol.md §1.2).
        model_id: echoed as ``session.model``.
        default_instructions: the server's default system prompt (None = the model default).
        answer_policy: ``"model"`` | ``"on_request"`` | None (profile default, §4.1).
        max_output_tokens: server default token cap per response (``--max-output-tokens``).
        default_voice: the default reference voice (None = the engine's bundled one).
        voices: voice table name -> ReferenceVoice.
        ref_audio_loader: callable(path) -> WAV bytes enforcing ``--ref-audio-dir``; None = paths refused.
        vad_available: False when the server VAD cannot run (turn detection defaults to null).
        temperature: default sampling temperature (0–2).
        silence_slack_ms: grace after a unit deadline before silence is fed (ms).
        audio_output_available: False when the engine has no vocoder (a checkpoint without
            ``assets/token2wav``): sessions default to ``["text"]`` and asking for audio is a
            ``bad_event`` that says why.
        seed: default sampling seed (None = nondeterministic); clients may set
            ``extra_body.seed`` (duplexkit extension) to make sampling repeatable on the same hardware.
        limits: :class:`SessionLimits`.
        supports_session_resume: advertised as ``capabilities.supports_session_resume`` (the
            shell that serves the session keeps a replay journal; docs/protocol.md §1.6).
        error_codes: the naming of ``error.code`` on the wire (docs/protocol.md §9): ``"openai"``
            (OpenAI's code wherever OpenAI has one, :data:`duplexkit.errors.OPENAI_ERROR_CODES`),
            ``"duplexkit"`` (the §9 codes as they are), or None (default): ``openai`` in the compat
            profile, ``duplexkit`` in the duplex profile.
    """

    profile: str = "duplex"
    model_id: str = "minicpm-o-4.5"
    default_instructions: Optional[str] = None
    answer_policy: Optional[str] = None
    max_output_tokens: Union[int, str] = 1024
    default_voice: Optional[ReferenceVoice] = None
    voices: dict = field(default_factory=dict)
    ref_audio_loader: Optional[Callable[[str], bytes]] = None
    vad_available: bool = True
    temperature: float = 0.7
    silence_slack_ms: int = SILENCE_SLACK_MS
    seed: Optional[int] = None
    audio_output_available: bool = True
    limits: SessionLimits = field(default_factory=SessionLimits)
    supports_session_resume: bool = False
    error_codes: Optional[str] = None

    def __post_init__(self) -> None:
        if self.profile not in ("duplex", "compat"):
            raise ValueError(f"profile must be 'duplex' or 'compat', got {self.profile!r}")
        if self.answer_policy not in (None, "model", "on_request"):
            raise ValueError(f"answer_policy must be None, 'model' or 'on_request', got {self.answer_policy!r}")
        if self.error_codes not in (None, "openai", "duplexkit"):
            raise ValueError(f"error_codes must be None, 'openai' or 'duplexkit', got {self.error_codes!r}")

    @property
    def wire_error_codes(self) -> str:
        """The effective :attr:`error_codes`: ``"openai"`` or ``"duplexkit"``."""
        if self.error_codes is not None:
            return self.error_codes
        return "duplexkit" if self.profile == "duplex" else "openai"


@dataclass(frozen=True)
class CloseConnection:
    """The socket must close with WebSocket ``code`` (docs/protocol.md §1.5) after sending what precedes."""

    code: int
    reason: str


UNIT_PERIOD_MS = 1000
"""One duplex unit = 1 s of input (docs/model.md §3.1, docs/protocol.md §5.1 ``chunk_period_ms``)."""


COMMIT_MERGE_MS = 20
"""How long a client ``input_audio_buffer.commit`` keeps its early-closed unit back (ms of the
Session clock) in case ``response.create`` follows: then that unit becomes the response's forced
unit instead of a listen unit followed by an all-zero forced one (docs/concepts.md "Early unit
close"). The close happens at the first ``tick`` at least this long after the commit, or at once on
any client event other than ``response.create`` / acks / heartbeats / ``conversation.item.retrieve``.
With the driver's 50 ms clock a lone commit's unit goes out 20-70 ms later."""

MIN_COMMIT_SAMPLES = INPUT_SAMPLE_RATE // 10
"""100 ms at 16 kHz: a commit needs at least this much input since the last commit/clear (§4)."""
