"""The model's audio units and rates (docs/model.md §3.1, §7.2): plain numbers, no imports.

Their own module at the bottom of the package so that every room that needs them (the model port,
the engine contract, the audio framer) imports them downwards; :mod:`duplexkit.engine.api`
re-exports them as part of the Session <-> engine contract.
"""

__all__ = ["INPUT_SAMPLE_RATE", "OUTPUT_SAMPLE_RATE", "FIRST_UNIT_SAMPLES", "FIRST_UNIT_CONSUME", "UNIT_SAMPLES",
           "CODES_PER_CHUNK", "SAMPLES_PER_CODE", "SILENCE_CODE"]

INPUT_SAMPLE_RATE = 16_000
"""Model input rate in Hz (docs/model.md §3.1: Whisper features at 16 kHz)."""

OUTPUT_SAMPLE_RATE = 24_000
"""Model output rate in Hz (docs/model.md §7.2: HiFT, 960 samples per codec token at 25 Hz)."""

FIRST_UNIT_SAMPLES = 16_560
"""Samples unit 0 reads at 16 kHz (1035 ms; docs/model.md §3.1, parity case f). The one home of this
number: the framer, the processor and the runtime import it from here (the framer and the
runtime through :mod:`duplexkit.engine.api`, which re-exports it)."""

FIRST_UNIT_CONSUME = 16_480
"""Samples unit 0 consumes (103 hops of 160; docs/model.md §3.1, parity case f): unit 1 re-reads the
last 80 samples of unit 0's window."""

UNIT_SAMPLES = 16_000
"""Samples every unit k >= 1 reads and consumes at 16 kHz (1 s; docs/model.md §3.1)."""

CODES_PER_CHUNK = 25
"""New codec tokens per Code2Wav call, and the codes one duplex unit yields: the talker's 26-step
budget with its last sample dropped (docs/model.md §6 and §7.1). 25 codes are 1 s of speech."""

SAMPLES_PER_CODE = 960
"""Output samples per codec token at :data:`OUTPUT_SAMPLE_RATE`: 25 Hz codes -> 50 Hz mel (x2) ->
HiFT 480 samples per frame (docs/model.md §7.2); ``CODES_PER_CHUNK * SAMPLES_PER_CODE`` = 24,000."""

SILENCE_CODE = 4218
"""The S3 codec's silence token: pads Code2Wav input and, as 3 x 4218, is the first carry of every
turn (docs/model.md §2 and §7.1)."""
