"""HiFT for several streams in one call, each row with its own source-excitation noise.

The package's ``HiFTGenerator.forward`` draws its NSF noise from the global generator (``SineGen2``:
``torch.rand(B, 9)`` initial harmonic phases, then ``torch.randn_like(sine_waves)`` [B, L, 9]; the
``SourceModuleHnNSF2`` noise branch draws a third tensor that HiFT discards). The per-stream path
(:meth:`~.code2wav.Code2Wav._finish`) seeds the global generator with the stream's (seed, chunk) seed
before each call. :func:`hift_rows` runs the same arithmetic on a batch of B mel rows of equal length,
drawing row ``i``'s two tensors from a private generator seeded with row ``i``'s seed, in the same
order and shapes as a single-row call: so row ``i`` gets exactly the noise its own call would get
(the discarded third draw changes nothing that is returned, so it is skipped).

Everything else is the package's module (f0 predictor, ``m_source.l_linear``, ``decode``); the
source-signal arithmetic is rewritten here only to take the noise as input, keeping the package's
operation order (so on CPU float32 a batch of one equals the package's call bit for bit; larger
batches agree within float rounding of batched convolutions, see tests/model/test_code2wav_batch.py).

Private generators also keep HiFT off the default CUDA generator, which a CUDA-graph capture on
another thread registers process-wide (benchmarks/results/2026-11-30-gpu-engine-h200.md, run 6).
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import numpy as np

__all__ = ["hift_rows", "RowNoise"]


class RowNoise:
    """Per-row NSF noise drawn from one private generator per device, reseeded per row.

    ``draw(seeds, length)`` returns (rand_ini float32 [B, H], noise float32 [B, length, H], a transposed view) with H the
    harmonic count + 1 (9 for the released HiFT) and row ``i`` drawn as ``torch.rand(1, H)`` then
    ``normal_`` of a [1, length, H] view of a [1, H, length] tensor after ``manual_seed(seeds[i])``, i.e. what the package draws for a
    single-row call after ``torch.manual_seed(seeds[i])``.
    """

    def __init__(self, device, harmonics: int) -> None:
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.dim = int(harmonics)
        self._gen = torch.Generator(device=self.device)

    def draw(self, seeds: Sequence[int], length: int) -> Tuple["object", "object"]:
        torch = self.torch
        B = len(seeds)
        rand_ini = torch.empty(B, self.dim, device=self.device)
        # the package's ``randn_like(sine_waves)`` keeps sine_waves' strides (a transposed [B, H, L]
        # tensor) and the normal fill depends on the layout (the CPU kernel takes a different path for
        # non-contiguous tensors): fill a view of the same layout
        noise = torch.empty(B, self.dim, int(length), device=self.device).transpose(1, 2)
        g = self._gen
        for i, s in enumerate(seeds):
            g.manual_seed(int(s))
            torch.rand(1, self.dim, generator=g, device=self.device, out=rand_ini[i:i + 1])
            noise[i:i + 1].normal_(generator=g)
        return rand_ini, noise


_HARMONICS: Dict[Tuple[int, str], object] = {}


def _harmonic_table(sine_gen, device):
    """[1, 1, H] multipliers 1..H (the package builds it on the CPU every call; cached here)."""
    import torch

    key = (int(sine_gen.harmonic_num), str(device))
    t = _HARMONICS.get(key)
    if t is None:
        t = torch.tensor([[list(range(1, sine_gen.harmonic_num + 2))]], dtype=torch.float32, device=device)
        _HARMONICS[key] = t
    return t


def _source(hift, f0_up, rand_ini, noise_raw):
    """``SourceModuleHnNSF2`` harmonic branch on [B, L, 1] upsampled f0 with given noise (same op order
    as ``SineGen2.forward`` / ``_f02sine`` without ``flag_for_pulse``). Returns [B, L, 1]."""
    import torch

    m = hift.m_source
    sg = m.l_sin_gen
    fn = torch.multiply(f0_up, _harmonic_table(sg, f0_up.device))
    rad_values = (fn / sg.sampling_rate) % 1
    rand_ini = rand_ini.clone()
    rand_ini[:, 0] = 0
    rad_values[:, 0, :] = rad_values[:, 0, :] + rand_ini
    rad_values = torch.nn.functional.interpolate(rad_values.transpose(1, 2), scale_factor=1 / sg.upsample_scale,
                                                 mode="linear").transpose(1, 2)
    phase = torch.cumsum(rad_values, dim=1) * 2 * np.pi
    phase = torch.nn.functional.interpolate(phase.transpose(1, 2) * sg.upsample_scale,
                                            scale_factor=sg.upsample_scale, mode="linear").transpose(1, 2)
    sine_waves = torch.sin(phase) * sg.sine_amp
    uv = (f0_up > sg.voiced_threshold).type(torch.float32)
    noise_amp = uv * sg.noise_std + (1 - uv) * sg.sine_amp / 3
    noise = noise_amp * noise_raw
    sine_waves = sine_waves * uv + noise
    return m.l_tanh(m.l_linear(sine_waves))


def hift_rows(hift, mel, src_cache, seeds: Sequence[int], noise: RowNoise):
    """``HiFTGenerator.forward`` for B rows with per-row noise.

    Args:
        hift: the package's ``HiFTGenerator`` (eval, float32).
        mel: float32 [B, 80, T] mel rows of one length.
        src_cache: float32 [B, 1, S] source-signal cache written over the first S samples (S may be 0)
            or None.
        seeds: B ints: row ``i``'s noise is what ``torch.manual_seed(seeds[i])`` gives a single-row call.
        noise: a :class:`RowNoise` on the mel's device.

    Returns:
        (speech float32 [B, 480 T], source float32 [B, 1, 480 T]).
    """
    import torch

    if mel.shape[0] != len(seeds):
        raise ValueError(f"{mel.shape[0]} mel rows but {len(seeds)} seeds")
    with torch.inference_mode():
        f0 = hift.f0_predictor(mel)
        s = hift.f0_upsamp(f0[:, None]).transpose(1, 2)  # [B, L, 1]
        rand_ini, raw = noise.draw(seeds, s.shape[1])
        s = _source(hift, s, rand_ini, raw).transpose(1, 2)  # [B, 1, L]
        if src_cache is not None and src_cache.shape[2] != 0:
            s[:, :, :src_cache.shape[2]] = src_cache
        speech = hift.decode(x=mel, s=s)
    return speech, s


def group_rows(keys: List[tuple]) -> List[List[int]]:
    """Indices grouped by equal key, in first-seen order."""
    groups: Dict[tuple, List[int]] = {}
    for i, k in enumerate(keys):
        groups.setdefault(k, []).append(i)
    return list(groups.values())
