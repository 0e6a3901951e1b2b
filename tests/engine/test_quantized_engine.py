"""``quantization`` through the engine builders: ``DuplexEngine.from_pretrained``, ``load_engine`` and
``duplexkit serve --quantization`` (the tiny checkpoint on the CPU)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
pytest.importorskip("torch")

from duplexkit import cli  # noqa: E402
from duplexkit.engine import DuplexEngine  # noqa: E402
from duplexkit.engine.api import ChatRequest  # noqa: E402

pytestmark = pytest.mark.engine


async def test_from_pretrained_quantizes_and_the_engine_answers():
    from duplexkit.models.minicpmo45.quantization import QuantLinear

    eng = DuplexEngine.from_pretrained("tiny", layout="cpu", progress=False, with_code2wav=False,
                                       quantization="int8")
    ref = DuplexEngine.from_pretrained("tiny", layout="cpu", progress=False, with_code2wav=False)
    try:
        rep = eng.model.quantization
        assert set(rep) == {"thinker", "talker"} and rep["thinker"].mode == "int8"
        assert rep["thinker"].bytes_after < rep["thinker"].bytes_before
        assert isinstance(eng.model.thinker.m.llm.model.layers[0].mlp.down_proj, QuantLinear)
        assert ref.model.quantization == {}
        req = ChatRequest(messages=[{"role": "user", "content": "Say something about cats."}], max_tokens=12,
                          temperature=0.0)
        got, want = await eng.generate(req), await ref.generate(req)
        assert got.text == want.text  # int8 on the tiny checkpoint keeps the greedy reply (tests/model)
    finally:
        await eng.aclose()
        await ref.aclose()


def test_load_engine_passes_the_mode_on(monkeypatch):
    from duplexkit.engine import loading

    seen = {}

    def fake(path, **kw):
        seen.update(kw, path=path)
        return object()

    monkeypatch.setattr(DuplexEngine, "from_pretrained", staticmethod(fake))
    loading.load_engine("tiny", layout="cpu", progress=False, quantization="fp8", checked=True)
    assert seen["quantization"] == "fp8" and seen["path"] == "tiny"
    seen.clear()
    loading.load_engine("tiny", layout="cpu", progress=False, checked=True)
    assert "quantization" not in seen  # none: the default path, unchanged


def test_bad_mode_fails_the_load_with_a_typed_error():
    from duplexkit.models.minicpmo45.quantization import QuantizationError

    with pytest.raises(QuantizationError, match="unknown quantization"):
        DuplexEngine.from_pretrained("tiny", layout="cpu", progress=False, with_code2wav=False, quantization="int3")


def test_serve_option():
    p = cli.build_parser()
    assert p.parse_args(["serve", "tiny"]).quantization == "none"
    assert p.parse_args(["serve", "tiny", "--quantization", "int8"]).quantization == "int8"
    with pytest.raises(SystemExit):
        p.parse_args(["serve", "tiny", "--quantization", "int4"])
