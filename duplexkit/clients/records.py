"""What a client knows of one response: :class:`ResponseRecord` (docs/protocol.md §5.3), and the
played part of its transcript (:func:`played_transcript`)."""

from __future__ import annotations

from typing import Any, Optional

from duplexkit.engine.api import OUTPUT_SAMPLE_RATE

__all__ = ["ResponseRecord", "OUTPUT_RATE", "played_transcript"]

OUTPUT_RATE = OUTPUT_SAMPLE_RATE
"""Server output rate in Hz (docs/protocol.md §6.2: always 24 kHz mono pcm16)."""


# ------------------------------------------------------------------------------------------------


class ResponseRecord:
    """One response as the client sees it (docs/protocol.md §5.3).

    Attributes:
        id, item_id, epoch, trigger: identity (``trigger``: ``model``/``client``/``server_vad``).
        status: None while generating, then ``completed``/``cancelled``/``incomplete``/``failed``.
        status_details: the ``response.done`` details (e.g. ``{"reason": "turn_detected"}``).
        transcript / text: audio transcript / text-only output so far (the ``done`` value at the end).
        audio_samples: 24 kHz samples received; ``chunk_sizes`` samples per delta, in order.
        decision: ``"listen"`` when a requested response ended with a terminating ``response.listen``.
        final: the typed ``response.done`` event (None while generating).
        events: the typed events of this response (audio deltas keep their size, not their payload).
        acked_ms: the highest ``played_ms`` reported to the server; ``heard_final``: playback of it
            is settled (flushed and reported, or fully heard and reported).
        flushed: its unplayed audio was dropped (later deltas are not played).
    """

    def __init__(self, event: Any = None) -> None:
        r = getattr(event, "response", None)
        self.id: str = (getattr(r, "id", None) or "") if r is not None else ""
        self.epoch: Optional[int] = getattr(r, "epoch", None) if r is not None else None
        self.trigger: Optional[str] = getattr(r, "trigger", None) if r is not None else None
        self.item_id: Optional[str] = None
        self.status: Optional[str] = None
        self.status_details: Optional[dict] = None
        self.transcript = ""
        self.text = ""
        self.audio_samples = 0
        self.chunk_sizes: list[int] = []
        self.decision: Optional[str] = None
        self.final: Any = None
        self.events: list = []
        self.acked_ms = 0
        self.heard_final = False
        self.flushed = False
        self._player = None

    @property
    def generating(self) -> bool:
        """True until ``response.done`` (the server may still send audio)."""
        return self.status is None

    active = generating  # the name of earlier releases

    @property
    def audible(self) -> bool:
        """True while the player holds unplayed audio of this response."""
        p = self._player
        return bool(p is not None and not self.flushed and p.queued_samples(self.id) > 0)

    @property
    def audio_ms(self) -> int:
        """Received audio, integer ms (floored)."""
        return self.audio_samples * 1000 // OUTPUT_RATE

    @property
    def played_ms(self) -> int:
        """Audio of this response the player has played, integer ms (floored)."""
        p = self._player
        return int(p.played_ms(self.id)) if p is not None else 0

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(id={self.id!r}, status={self.status!r}, trigger={self.trigger!r}, "
                f"epoch={self.epoch}, audio_ms={self.audio_ms}, transcript={self.transcript!r})")




def played_transcript(rec: ResponseRecord, played_ms: Optional[int] = None) -> str:
    """The part of ``rec``'s transcript the user heard: cut at the last ``audio_text_marks`` mark
    whose ``audio_end_ms`` is within ``played_ms`` (default: ``rec.played_ms``), the same cut the
    server makes for a truncate (docs/protocol.md §7.5). A text-only response (no audio) is
    returned whole; a response with audio but no marks (other servers) is returned whole only
    when all of its audio played, else cut in proportion to the audio played."""
    played = rec.played_ms if played_ms is None else int(played_ms)
    if not rec.audio_samples:
        return rec.transcript or rec.text
    chars, marks = 0, False
    for ev in rec.events:
        md = getattr(ev, "metadata", None) if getattr(ev, "type", "") == "response.output_audio.delta" else None
        for m in (getattr(md, "audio_text_marks", None) or []):
            marks = True
            if m.audio_end_ms <= played:
                chars = max(chars, m.text_chars)
    if not marks:
        total = rec.audio_ms
        chars = len(rec.transcript) if played >= total else len(rec.transcript) * played // max(total, 1)
    return rec.transcript[:chars]
