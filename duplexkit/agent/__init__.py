"""duplexkit.agent: what a voice agent needs to act (function tools, tool deciders, transcribers).

* :mod:`.tools`: :class:`FunctionTool`, the :func:`tool` decorator and :func:`as_tool`: a Python
  function, its OpenAI function-tool schema (pydantic) and a validated, time-limited call.
* :mod:`.decider`: :class:`ToolDecider` and its two implementations, :class:`EngineToolDecider`
  (the engine's own text mode) and :class:`ChatEndpointToolDecider` (any OpenAI-compatible
  ``/chat/completions`` endpoint).
* :mod:`.transcribe`: :class:`Transcriber`, :class:`EngineTranscriber` (the thinker's own speech
  recognition), :class:`FasterWhisperTranscriber` and :func:`make_transcriber`.

This room imports only ``duplexkit.engine.api`` and ``duplexkit.errors`` (docs/architecture.md);
``httpx`` and ``faster_whisper`` are imported when the class that needs them is built.
"""

from duplexkit.agent.decider import ChatEndpointToolDecider, EngineToolDecider, ToolDecider, check_calls, text_messages
from duplexkit.agent.tools import DEFAULT_TIMEOUT_S, LATE_RESULTS, FunctionTool, as_tool, error_output, tool
from duplexkit.agent.transcribe import (
    ASR_PROMPTS,
    EngineTranscriber,
    FasterWhisperTranscriber,
    Transcriber,
    make_transcriber,
)
from duplexkit.errors import (
    OptionalDependencyError,
    ToolArgumentsError,
    ToolDefinitionError,
    ToolError,
    ToolOutputError,
    ToolTimeoutError,
)

__all__ = [
    "FunctionTool", "tool", "as_tool", "error_output", "DEFAULT_TIMEOUT_S", "LATE_RESULTS",
    "ToolDecider", "EngineToolDecider", "ChatEndpointToolDecider", "text_messages", "check_calls",
    "Transcriber", "EngineTranscriber", "FasterWhisperTranscriber", "make_transcriber", "ASR_PROMPTS",
    "ToolError", "ToolDefinitionError", "ToolArgumentsError", "ToolTimeoutError", "ToolOutputError",
    "OptionalDependencyError",
]
