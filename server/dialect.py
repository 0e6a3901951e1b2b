"""Event-name dialects of the realtime WebSocket (docs/protocol.md §2.4, docs/server.md "Interop").

The Session always builds GA events (``openai.types.realtime``); this module rewrites them at the
serialisation edge for clients that speak OpenAI's beta realtime names (the OpenAI SDK's
``client.beta.realtime``, vLLM-Omni's demo scripts and browser UI).

Dialects:

* ``ga`` — events as built (the default).
* ``beta`` — the six GA-only ``response.*`` names are renamed to their beta names,
  ``conversation.item.added`` becomes ``conversation.item.created`` and ``conversation.item.done``
  (no beta counterpart) is not sent; ``session.created``/``session.updated`` also carry the beta
  session fields (``modalities``, ``input_audio_format``, ``output_audio_format``,
  ``turn_detection``, ``voice``) and, when the client connected with an OpenAI model id (mapped),
  that id as ``model``, so they validate as ``openai.types.beta.realtime`` events.
* ``both`` — every event as built, and after each of the six renamed ``response.*`` events a copy
  under its beta name with the SAME ``event_id`` and ``server_event_seq`` (a client that drops
  replayed sequence numbers, like vLLM-Omni's ``DuplexClient``, ignores the copy; one that reads only
  beta names sees only the copy).

The rule (:func:`pick_dialect`, :func:`dialect_of_first_update`): ``?dialect=ga|beta|both`` wins;
else the header ``OpenAI-Beta: realtime=v1`` (sent by the OpenAI SDK's beta client) means ``beta``;
else the first ``session.update`` decides: beta-shaped (no ``session.type`` and one of ``modalities``,
``input_audio_format``, ``output_audio_format``, which vLLM-Omni's clients send) gives ``both``,
anything else ``ga``. Events sent before that first update are GA.

Chat completions have two dialects of their own (:func:`pick_chat_dialect`), which decide what a
request that does not say which output modalities it wants gets:

* ``openai`` — text only, as OpenAI answers: audio comes only when asked for in OpenAI's shape
  (``modalities`` containing ``"audio"``, or an ``audio`` object).
* ``vllm_omni`` — text and speech (what vLLM-Omni serves MiniCPM-o with; its examples omit
  ``modalities`` and expect speech).

The rule: ``?dialect=openai|vllm_omni`` on the URL wins; else a ``model`` naming the Hugging Face
repo id (``openbmb/MiniCPM-o-4_5``, the served name of vLLM-Omni's MiniCPM-o deployments and the
default of its clients) means ``vllm_omni``; anything else (the OpenAI SDK's ``gpt-4o*``, the served
id, no model) means ``openai``.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from duplexkit.protocol.vocabulary import BETA_MIRRORED_EVENTS, GA_TO_BETA_EVENTS

__all__ = ["GA_TO_BETA", "DIALECTS", "CHAT_DIALECTS", "pick_dialect", "pick_chat_dialect",
           "dialect_of_first_update", "translate"]

DIALECTS = ("ga", "beta", "both")
CHAT_DIALECTS = ("openai", "vllm_omni")
#: model ids that select the ``vllm_omni`` chat dialect: the Hugging Face repo id of MiniCPM-o 4.5
VLLM_OMNI_MODEL_IDS = frozenset({"openbmb/MiniCPM-o-4_5"})

#: GA event type -> OpenAI beta realtime event type (openai.types.beta.realtime) of the events the
#: ``both`` dialect mirrors: the six ``response.*`` renames of the one table,
#: :data:`duplexkit.protocol.vocabulary.GA_TO_BETA_EVENTS` (which the ``beta`` dialect applies whole).
GA_TO_BETA = {g: GA_TO_BETA_EVENTS[g] for g in sorted(BETA_MIRRORED_EVENTS)}
_BETA_DROPPED = frozenset({"conversation.item.done"})
#: top-level session keys that mark a beta-shaped session.update (what beta clients and vLLM-Omni's
#: send; a flat ``turn_detection`` alone does not count: GA-minded scripts use it as a shorthand)
_BETA_SESSION_KEYS = ("modalities", "input_audio_format", "output_audio_format")


def pick_dialect(query_value: Optional[str], openai_beta_header: Optional[str]) -> Optional[str]:
    """The dialect fixed at the handshake, or None (decided by the first ``session.update``).

    Raises:
        ValueError: ``query_value`` is given but not one of :data:`DIALECTS`.
    """
    if query_value:
        v = query_value.strip().lower()
        if v not in DIALECTS:
            raise ValueError(f"dialect must be one of {', '.join(DIALECTS)}, got {query_value!r}")
        return v
    if openai_beta_header and "realtime=v1" in openai_beta_header.replace(" ", "").lower():
        return "beta"
    return None


def pick_chat_dialect(query_value: Optional[str], model: Optional[str]) -> str:
    """The chat-completions dialect of a request: ``openai`` or ``vllm_omni`` (module docstring).

    Raises:
        ValueError: ``query_value`` is given but not one of :data:`CHAT_DIALECTS` (``vllm-omni`` is
            read as ``vllm_omni``).
    """
    if query_value:
        v = query_value.strip().lower().replace("-", "_")
        if v not in CHAT_DIALECTS:
            raise ValueError(f"dialect must be one of {', '.join(CHAT_DIALECTS)} for chat completions, "
                             f"got {query_value[:64]!r}")
        return v
    return "vllm_omni" if model in VLLM_OMNI_MODEL_IDS else "openai"


def dialect_of_first_update(frame: Any) -> Optional[str]:
    """``both`` for a beta-shaped ``session.update`` frame, ``ga`` for any other parseable event,
    None when the frame is not a JSON object (the Session reports that)."""
    if isinstance(frame, (str, bytes, bytearray)):
        try:
            frame = json.loads(frame)
        except (ValueError, UnicodeDecodeError, RecursionError):  # the Session answers invalid_json
            return None
    if not isinstance(frame, dict):
        return None
    if frame.get("type") != "session.update":
        return "ga"
    session = frame.get("session")
    if isinstance(session, dict) and "type" not in session and any(k in session for k in _BETA_SESSION_KEYS):
        return "both"
    return "ga"


def _beta_session(session: dict, model: Optional[str]) -> dict:
    out = dict(session)
    if model:
        out["model"] = model
    audio = session.get("audio") or {}
    inp, outp = audio.get("input") or {}, audio.get("output") or {}
    out.setdefault("modalities", session.get("output_modalities"))
    out.setdefault("input_audio_format", "pcm16")
    out.setdefault("output_audio_format", "pcm16")
    out.setdefault("turn_detection", inp.get("turn_detection"))
    if isinstance(outp.get("voice"), str):
        out.setdefault("voice", outp["voice"])
    if "max_output_tokens" in session:
        out.setdefault("max_response_output_tokens", session["max_output_tokens"])
    return out


_BETA_PART_TYPES = {"output_audio": "audio", "output_text": "text"}


def _beta_parts(value: Any) -> Any:
    """GA content-part types -> beta ones (``output_audio`` -> ``audio``, ``output_text`` -> ``text``)."""
    if isinstance(value, list):
        return [_beta_parts(v) for v in value]
    if isinstance(value, dict):
        out = {k: _beta_parts(v) for k, v in value.items()}
        if out.get("type") in _BETA_PART_TYPES:
            out["type"] = _BETA_PART_TYPES[out["type"]]
        return out
    return value


def translate(event: dict, dialect: str, *, beta_model: Optional[str] = None) -> list[dict]:
    """The frames to send for one GA server event in ``dialect`` (zero, one or two dicts).

    ``beta_model``: the OpenAI model id the client connected with (mapped to the served model);
    the beta session object echoes it as ``model``, because the beta types only allow OpenAI ids there.
    """
    if dialect == "ga":
        return [event]
    t = event.get("type")
    if dialect == "both":
        beta = GA_TO_BETA.get(t)
        return [event, {**event, "type": beta}] if beta else [event]
    # beta
    if t in _BETA_DROPPED:
        return []
    if t in ("session.created", "session.updated") and isinstance(event.get("session"), dict):
        return [{**event, "session": _beta_session(event["session"], beta_model)}]
    out = {**event, "type": GA_TO_BETA_EVENTS.get(t) or t}
    for key in ("item", "part", "response"):
        if isinstance(out.get(key), dict):
            out[key] = _beta_parts(out[key])
    if out["type"] == "conversation.item.created":
        out.setdefault("previous_item_id", None)
    return [out]
