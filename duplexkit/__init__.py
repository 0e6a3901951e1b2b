"""duplexkit: a realtime full-duplex voice-agent SDK for omni models (MiniCPM-o 4.5 first).

Layers (docs/architecture.md): ``duplexkit.audio`` (codecs, resampling, framing, VAD, playback, devices),
``duplexkit.protocol`` (wire events), ``duplexkit.session`` (the sans-I/O Session),
``duplexkit.engine`` (three-stage runtime), ``duplexkit.models.minicpmo45`` (the model port),
``duplexkit.clients`` (InlineDuplexClient, DuplexClient).
"""

__version__ = "0.1.0"

from pathlib import Path as _Path

ASSETS_DIR = _Path(__file__).resolve().parent / "assets"
"""Bundled speech WAVs (16 kHz mono pcm16, espeak-ng): ``question_16k.wav``, ``interrupt_16k.wav``,
``ref_voice_16k.wav`` — used by ``duplexkit demo`` and the examples."""
