"""Audio input path cost per 20 ms chunk: decode + resample + VAD, against a plain numpy copy.

Usage: python benchmarks/audio.py [--seconds 20] [--fixture tests/fixtures/audio/question_16k.wav]

Feeds real speech (the fixture WAV, or a synthetic signal when absent) as 20 ms appends of each
input format and prints microseconds per chunk for every stage and the ratio of the full path to
``np.frombuffer(chunk, np.uint8).copy()`` of the same bytes.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from duplexkit.audio import (  # noqa: E402
    InputFormat,
    StreamDecoder,
    StreamingVAD,
    StreamResampler,
    UnitFramer,
    VadConfig,
    float32_to_pcm16,
    read_wav,
)
from duplexkit.audio.codecs import float32_to_alaw, float32_to_f32le, float32_to_ulaw  # noqa: E402

ENCODERS = {"pcm16": float32_to_pcm16, "pcm_f32le": float32_to_f32le, "g711_ulaw": float32_to_ulaw,
            "g711_alaw": float32_to_alaw}


def _source(path: Path, seconds: float) -> np.ndarray:
    if path.exists():
        x, _ = read_wav(path, 48000)
    else:
        t = np.arange(int(48000 * 3)) / 48000
        x = (0.3 * np.sin(2 * np.pi * 220 * t) * (np.sin(2 * np.pi * 2 * t) > 0)).astype(np.float32)
    reps = int(np.ceil(seconds * 48000 / x.size))
    return np.tile(x, reps)[: int(seconds * 48000)]


def _per_chunk_us(fn, chunks, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(chunks)
        best = min(best, time.perf_counter() - t0)
    return best / len(chunks) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--fixture", type=Path, default=ROOT / "tests/fixtures/audio/question_16k.wav")
    args = ap.parse_args()
    src48 = _source(args.fixture, args.seconds)
    cases = [("pcm16", 24000), ("pcm16", 16000), ("pcm16", 48000), ("pcm_f32le", 24000),
             ("g711_ulaw", 8000), ("g711_alaw", 8000)]
    rows = []
    for enc, rate in cases:
        fmt = InputFormat(enc, rate)
        x = StreamResampler(48000, rate).process(src48) if rate != 48000 else src48
        data = ENCODERS[enc](x)
        cb = fmt.frame_bytes * rate // 50  # 20 ms
        chunks = [data[i : i + cb] for i in range(0, len(data) - cb + 1, cb)]

        def copy_only(cs):
            for c in cs:
                np.frombuffer(c, np.uint8).copy()

        def decode_only(cs):
            d = StreamDecoder(fmt)
            for c in cs:
                d.decode(c)

        def decode_resample(cs):
            d, r = StreamDecoder(fmt), StreamResampler(rate, 16000)
            for c in cs:
                r.process(d.decode(c))

        def full(cs):
            d, r, v = StreamDecoder(fmt), StreamResampler(rate, 16000), StreamingVAD(VadConfig())
            for c in cs:
                v.process(r.process(d.decode(c)))

        def full_framer(cs):
            d, r, v, f = StreamDecoder(fmt), StreamResampler(rate, 16000), StreamingVAD(VadConfig()), UnitFramer()
            for c in cs:
                y = r.process(d.decode(c))
                v.process(y)
                f.push(y)

        us = [_per_chunk_us(fn, chunks) for fn in (copy_only, decode_only, decode_resample, full, full_framer)]
        rows.append((f"{enc} {rate // 1000 if rate % 1000 == 0 else rate / 1000} kHz", len(chunks), *us))

    hdr = ("input (20 ms chunks)", "chunks", "copy us", "decode us", "+resample us", "+VAD us", "+framer us",
           "full/copy", "RT share")
    print(f"{hdr[0]:<22}{hdr[1]:>7}{hdr[2]:>9}{hdr[3]:>11}{hdr[4]:>14}{hdr[5]:>9}{hdr[6]:>12}{hdr[7]:>11}{hdr[8]:>10}")
    for name, n, c, d, dr, f, ff in rows:
        print(f"{name:<22}{n:>7}{c:>9.1f}{d:>11.1f}{dr:>14.1f}{f:>9.1f}{ff:>12.1f}{f / c:>10.0f}x{f / 20000:>10.2%}")
    print("\nRT share = decode+resample+VAD time per chunk / 20 ms of audio (one core).")


if __name__ == "__main__":
    main()
