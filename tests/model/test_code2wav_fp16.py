"""Code2Wav with a float16 flow: the reference ``Token2wav(float16=True)`` mode (half weights under
autocast, HiFT in float32), on the tiny random-weight flow (docs/model.md §7.5).

The same random flow is built twice, in float32 and cast to float16, so the two runs differ only in
the flow's precision. Checks: the float16 run stays close to the float32 one over a multi-stream
scenario (SNR), the batched path equals the per-stream path in float16 too, the dtypes are where the
reference puts them, and unsupported dtypes are refused with a clear error (loader, layout).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
torch = pytest.importorskip("torch")
pytest.importorskip("stepaudio2")

# measured on the tiny flow, CPU: float16 against float32 51.3-51.5 dB (benchmarks/code2wav_batch.py
# --dtype float16 --compare-to); 30 dB leaves room for other BLAS builds and still fails on a
# flow that is not run in half precision consistently (garbage or a dtype mix-up is < 10 dB)
MIN_SNR_DB = 30.0
# batched against per-stream, both float16: rows of batched half GEMMs round differently
ATOL_FP16 = 5e-3


def _c2w(dev: torch.device, dtype):
    from duplexkit.models.minicpmo45.random_init import _random_code2wav

    gen = torch.Generator(device=dev).manual_seed(0)
    return _random_code2wav(Path(tempfile.mkdtemp()), dev, gen, real=False, batched=True, dtype=dtype)


@pytest.fixture(scope="module", params=["cpu", "cuda"])
def pair(request):
    """(float32 Code2Wav, float16 Code2Wav) on the same random weights."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    dev = torch.device(request.param)
    return _c2w(dev, torch.float32), _c2w(dev, torch.float16)


@pytest.fixture(scope="module")
def fp16_batched(pair):
    """The float16 flow's batched run of the scenario (deterministic: fresh seeded streams), shared by the
    two tests that compare it (with float32, with the per-stream path)."""
    return _run(pair[1], batched=True)


def _scenario():
    """Rounds of 3 streams: (codes, last) or None. Stream 1 starts late, stream 2 ends a turn and
    starts another; every stream ends with a terminal flush."""
    rng = np.random.default_rng(11)
    c = lambda n: rng.integers(0, 6561, n)  # noqa: E731
    return [
        [(c(25), False), None, (c(25), False)],
        [(c(25), False), (c(25), False), (c(9), True)],
        [(c(25), False), (c(25), False), (c(25), False)],
        [(c(12), True), (c(5), True), (c(30), True)],
    ]


def _run(c2w, batched: bool):
    sts = [c2w.new_stream(None, seed=k) for k in range(3)]
    outs = []
    for rnd in _scenario():
        items = [SimpleNamespace(handle=sts[k], codes=w[0], last=w[1]) for k, w in enumerate(rnd) if w is not None]
        if batched:
            res = c2w.push_batch(items)
        else:
            res = [c2w.push(w.handle, w.codes, last=w.last) for w in items]
        for r in res:
            assert not isinstance(r, BaseException), r
        outs.append([np.asarray(r) for r in res])
    for st in sts:
        c2w.close(st)
    return outs


def _snr_db(x: np.ndarray, ref: np.ndarray) -> float:
    err = np.sum((x.astype(np.float64) - ref) ** 2)
    return float("inf") if err == 0 else float(10 * np.log10(np.sum(ref.astype(np.float64) ** 2) / err))


def test_float16_flow_is_the_reference_half_mode(pair):
    _, c16 = pair
    assert c16.dtype == torch.float16
    assert all(p.dtype == torch.float16 for p in c16.flow.parameters())
    assert all(p.dtype == torch.float32 for p in c16.hift.parameters())  # HiFT stays float32
    assert c16.flow.decoder.rand_noise.dtype == torch.float16  # the package's buffer, as flow.half() leaves it
    # the flow's matmuls run in float16 under autocast; outside the context, nothing is autocast
    with c16.flow_autocast():
        assert torch.is_autocast_enabled(c16.device.type)
        y = torch.nn.functional.linear(torch.ones(2, 4, device=c16.device), torch.ones(3, 4, device=c16.device))
        assert y.dtype == torch.float16
    assert not torch.is_autocast_enabled(c16.device.type)
    st = c16.new_stream(None, seed=0)
    out = c16.push(st, np.arange(25) * 7 % 6561)
    assert out.dtype == np.float32 and out.shape == (20160,) and np.isfinite(out).all()
    c16.close(st)


def test_float16_flow_stays_close_to_float32(pair, fp16_batched):
    c32, _ = pair
    ref, got = _run(c32, batched=True), fp16_batched
    x = np.concatenate([a for rnd in got for a in rnd])
    y = np.concatenate([a for rnd in ref for a in rnd])
    assert x.shape == y.shape and np.abs(y).max() > 1e-3  # real audio, not silence
    snr = _snr_db(x, y)
    assert snr >= MIN_SNR_DB, f"float16 flow vs float32: {snr:.1f} dB"
    assert snr < 200, "the float16 run matched float32 bit for bit: the flow did not run in half precision"


def test_float16_batched_equals_per_stream(pair, fp16_batched):
    _, c16 = pair
    ref, got = _run(c16, batched=False), fp16_batched
    for r, (a, b) in enumerate(zip(ref, got)):
        for k, (x, y) in enumerate(zip(a, b)):
            assert x.shape == y.shape, (r, k)
            np.testing.assert_allclose(y, x, atol=ATOL_FP16, rtol=0, err_msg=f"round {r} item {k}")


def test_unsupported_code2wav_dtypes_are_refused(tmp_path):
    with pytest.raises(ValueError, match="float32 or float16"):
        _c2w(torch.device("cpu"), torch.bfloat16)

    from duplexkit.engine.layout import Layout, LayoutError

    def layout(dt: str):
        return {"name": "t", "stages": {
            "thinker": {"device": "cpu", "dtype": "float32"},
            "talker": {"device": "cpu", "dtype": "float32"},
            "code2wav": {"device": "cpu", "dtype": dt}}}

    assert Layout.from_dict(layout("float16")).code2wav.dtype == "float16"
    for bad in ("bfloat16", "fp16"):  # the message names what the vocoder takes, not every stage's dtypes
        with pytest.raises(LayoutError, match="float32 or float16"):
            Layout.from_dict(layout(bad))


def test_loader_builds_the_float16_flow(tiny_dir):
    from duplexkit.models.minicpmo45.loader import load

    if not (tiny_dir / "assets" / "token2wav").is_dir():
        pytest.skip("the tiny checkpoint has no token2wav assets")
    m = load(tiny_dir, progress=False, with_talker=False, dtype={"thinker": "float32", "code2wav": "float16"})
    assert m.code2wav.dtype == torch.float16
    assert next(m.code2wav.flow.parameters()).dtype == torch.float16
    with pytest.raises(ValueError, match="float32 or float16"):
        load(tiny_dir, progress=False, with_talker=False, dtype={"code2wav": "bfloat16"})
