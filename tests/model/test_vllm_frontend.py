"""The vLLM thinker's batched audio front end (``VllmDuplexThinker.embed_units`` / ``units``), on the
CPU without vLLM: the rows of several streams computed together by the native fast thinker must be
the rows each stream gets alone from the reference thinker, unit after unit (the caches advance the
same way); a closed stream fails alone, before any front-end work."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from duplexkit.engine.vllm_duplex import VllmDuplexThinker
from duplexkit.engine.vllm_thinker import VllmBackendError
from duplexkit.models.minicpmo45.duplex import DuplexPolicy

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "audio"


def _speech(name: str, n_units: int) -> list:
    import soundfile as sf

    a, sr = sf.read(str(FIXTURES / name), dtype="float32")
    assert sr == 16000
    a = np.tile(a, 1 + (16560 + 16000 * n_units) // a.size)
    out, p = [], 0
    for k in range(n_units):  # the framer's sizes: 16,560 samples, then 16,000 (docs/model.md §3.2)
        n = 16560 if k == 0 else 16000
        out.append(a[p:p + n])
        p += n
    return out


@pytest.fixture(scope="module")
def fast_thinker(tiny_model):
    from duplexkit.models.minicpmo45.fast_thinker import FastThinker

    return FastThinker.from_thinker(tiny_model.thinker, cuda_graphs=False, slots=4)


def test_embed_units_batched_matches_each_stream_alone(tiny_model, fast_thinker):
    names = ["question_16k.wav", "interrupt_16k.wav", "long_question_16k.wav"]
    audio = {n: _speech(n, 3) for n in names}
    pol = DuplexPolicy(temperature=0.0)
    batched = VllmDuplexThinker(fast_thinker, engine=None, max_model_len=4096)
    alone = VllmDuplexThinker(tiny_model.thinker, engine=None, max_model_len=4096)
    vb = [batched.new_stream(policy=pol, seed=0) for _ in names]
    va = [alone.new_stream(policy=pol, seed=0) for _ in names]
    for k in range(3):
        got = batched.embed_units(vb, [audio[n][k] for n in names])
        for i, n in enumerate(names):
            (ref,) = alone.embed_units([va[i]], [audio[n][k]])
            assert got[i].dtype == ref.dtype and got[i].shape == ref.shape
            np.testing.assert_allclose(got[i].numpy(), ref.numpy(), atol=1e-4, rtol=0, err_msg=f"{n} unit {k}")
    with pytest.raises(ValueError, match="twice"):
        batched.embed_units([vb[0], vb[0]], [audio[names[0]][0]] * 2)


def test_units_closed_stream_fails_alone_before_front_end(tiny_model):
    vt = VllmDuplexThinker(tiny_model.thinker, engine=None, max_model_len=4096)
    vs = vt.new_stream(policy=DuplexPolicy(temperature=0.0), seed=0)
    vs.session._closed = True  # as after close(), without an engine to drain
    (r,) = asyncio.run(vt.units([(vs, _speech("question_16k.wav", 1)[0], False, False, None)]))
    assert isinstance(r, VllmBackendError) and "closed" in str(r)
    assert vs.st.mel.unit_index == 0  # no front-end work was done for it
