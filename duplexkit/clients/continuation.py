"""Cross-replica continuation (docs/clients.md, "Continuing elsewhere"): a lossy,
honest hand-over of a conversation to a new session on another server.

A session's model state (the KV cache of every unit heard and spoken) lives in one server process
and dies with it. What a client *can* carry to a new session is what it knows:

* the instructions, the voice name and the reference voice it sent (a WAV data URL);
* the transcript of the conversation **as the user heard it**: user turns (the model's own user
  transcripts when the server sent them, else a placeholder saying the user spoke), and for each
  assistant response only the part of its transcript whose audio was played (cut at the
  ``audio_text_marks`` mark within ``played_ms``, the same cut the server makes for a truncate;
  :func:`~duplexkit.clients.records.played_transcript`).

The new session gets them as its first ``session.update`` (instructions, voice, ``ref_audio``,
output modalities) and one ``system`` text item with the ordered transcript (MiniCPM-o's duplex
prompt takes text history only as system or user text before the first unit; docs/protocol.md §4).
The new model therefore sees *text* history only: no audio, no prosody, no KV; answers may differ
from what the lost session would have said.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from .records import played_transcript

__all__ = ["ContinuationSeed", "ConversationLog", "TRANSCRIPT_HEADER"]

TRANSCRIPT_HEADER = ("The conversation so far (continued from an earlier session that ended; this is a text "
                     "transcript of what was said and heard, not the audio):")
"""First line of the transcript item a :class:`ContinuationSeed` creates."""

USER_SPOKE = "[the user spoke; no transcript]"


@dataclass
class ContinuationSeed:
    """What a new session can be seeded with (JSON-serialisable: :meth:`to_json`/:meth:`from_json`).

    Attributes:
        source_session_id: the session it was taken from.
        instructions: the session's instructions (None: the server default).
        voice: the session's voice name (``"default"`` or a server voice-table name).
        ref_audio: the reference voice the client sent, a ``data:audio/wav;base64,...`` URL (None
            when it sent none); the voice of the new session is then the same clip.
        output_modalities: e.g. ``["audio", "text"]``.
        turns: ``[{"role": "user"|"assistant", "text": str}]`` in conversation order; assistant
            texts are the *played* part of each response.
    """

    source_session_id: Optional[str] = None
    instructions: Optional[str] = None
    voice: Optional[str] = None
    ref_audio: Optional[str] = None
    output_modalities: Optional[list] = None
    turns: list = field(default_factory=list)

    def session_update(self) -> dict:
        """The fields of the new session's first ``session.update``."""
        out: dict[str, Any] = {}
        if self.instructions is not None:
            out["instructions"] = self.instructions
        if self.voice is not None:
            out["voice"] = self.voice
        if self.ref_audio is not None:
            out["ref_audio"] = self.ref_audio
        if self.output_modalities:
            out["output_modalities"] = list(self.output_modalities)
        return out

    def transcript_text(self) -> str:
        """The transcript as one text: a header, then ``User: ...`` / ``Assistant: ...`` lines."""
        lines = [TRANSCRIPT_HEADER]
        for t in self.turns:
            lines.append(f"{'User' if t['role'] == 'user' else 'Assistant'}: {t['text']}")
        return "\n".join(lines)

    def items(self) -> list[dict]:
        """The ``conversation.item.create`` items (``item`` objects) for the new session: one
        ``system`` text item with :meth:`transcript_text`, or none when nothing was said."""
        if not self.turns:
            return []
        return [{"type": "message", "role": "system",
                 "content": [{"type": "input_text", "text": self.transcript_text()}]}]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "ContinuationSeed":
        """Raises ValueError for text that is not a seed."""
        data = json.loads(text)
        if not isinstance(data, dict) or not isinstance(data.get("turns", []), list):
            raise ValueError("not a ContinuationSeed")
        return cls(**{k: data.get(k) for k in ("source_session_id", "instructions", "voice", "ref_audio",
                                               "output_modalities")}, turns=list(data.get("turns") or []))


class ConversationLog:
    """The order of the conversation as the client saw it: user items (with their transcripts
    when the server sends any) and responses (by id), each once even when events are replayed."""

    def __init__(self) -> None:
        self._entries: dict[str, dict] = {}  # key -> {"role", "text"|None, "response_id"}

    def observe(self, ev: Any) -> None:
        """Feed one typed server event (any; the relevant ones are used)."""
        t = getattr(ev, "type", "")
        if t in ("conversation.item.added", "conversation.item.done"):
            item = ev.item
            if item.role == "user" and item.id:
                e = self._entries.setdefault("item:" + item.id, {"role": "user", "text": None})
                text = "".join((getattr(c, "text", None) or getattr(c, "transcript", None) or "")
                               for c in (item.content or []))
                if text:
                    e["text"] = text
        elif t == "conversation.item.input_audio_transcription.completed":
            e = self._entries.setdefault("item:" + ev.item_id, {"role": "user", "text": None})
            e["text"] = ev.transcript
        elif t == "response.created":
            rid = getattr(ev.response, "id", None)
            if rid:
                self._entries.setdefault("resp:" + rid, {"role": "assistant", "response_id": rid})

    def turns(self, responses: dict) -> list[dict]:
        """``[{"role", "text"}]`` in conversation order. ``responses``: response id ->
        :class:`~duplexkit.clients.records.ResponseRecord`. Every user item is kept (its transcript,
        or :data:`USER_SPOKE`); an assistant response is kept with the part of its transcript that
        was played, and left out when none of it was (or it was forgotten)."""
        out = []
        for e in self._entries.values():
            if e["role"] == "user":
                out.append({"role": "user", "text": e.get("text") or USER_SPOKE})
                continue
            rec = responses.get(e["response_id"])
            text = played_transcript(rec) if rec is not None else ""
            if text:
                out.append({"role": "assistant", "text": text})
        return out
