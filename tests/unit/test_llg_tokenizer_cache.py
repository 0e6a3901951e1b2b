"""The tool decider's llguidance tokenizer: built once per tokenizer, and a failed build (llguidance
< 1.7 refuses the list of chat stop ids) is remembered, so each later turn fails at once instead of
paying the ~1 s build again (seen on the GPU: 16 sessions' decisions queued behind repeated builds)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

llguidance_hf = pytest.importorskip("llguidance.hf")

from duplexkit.models.minicpmo45.tools import llg_tokenizer  # noqa: E402


def _thinker():
    return SimpleNamespace(tokenizer=SimpleNamespace(), config=SimpleNamespace(vocab_size=100),
                           special=SimpleNamespace(eos_ids=(7, 8)))


def test_a_failed_build_is_not_retried(monkeypatch):
    calls = []

    def refuse(tok, n_vocab=None, eos_token=None, slices=None):
        calls.append(eos_token)
        raise TypeError("argument 'eos_token': 'list' object cannot be interpreted as an integer")

    monkeypatch.setattr(llguidance_hf, "from_tokenizer", refuse)
    th = _thinker()
    for _ in range(3):
        with pytest.raises(TypeError, match="eos_token"):
            llg_tokenizer(th)
    assert calls == [[7, 8]]  # both stop ids passed, and one build only


def test_a_good_build_is_cached(monkeypatch):
    built = []
    monkeypatch.setattr(llguidance_hf, "from_tokenizer", lambda tok, **kw: built.append(kw) or object())
    th = _thinker()
    first = llg_tokenizer(th)
    assert llg_tokenizer(th) is first and len(built) == 1
    th.config.vocab_size = 200  # another vocabulary size builds again
    assert llg_tokenizer(th) is not first and len(built) == 2


class _LLTok:
    def decode_bytes(self, ids):
        return b"x" * (ids[0] % 3)


def test_the_engine_builds_the_tables_at_load_so_the_first_tool_turn_does_not(monkeypatch):
    from duplexkit.engine.minicpmo45 import MiniCPMO45Stages

    built = []
    monkeypatch.setattr(llguidance_hf, "from_tokenizer", lambda tok, **kw: built.append(kw) or _LLTok())
    th = _thinker()
    stages = MiniCPMO45Stages(SimpleNamespace(thinker=th))
    ms = stages.tools_warmup()
    assert ms is not None and ms >= 0
    assert len(built) == 1 and built[0]["eos_token"] == [7, 8]
    assert list(th.tokenizer._duplexkit_llg_lens[:4]) == [0, 1, 2, 0]  # the byte lengths, one per token
    llg_tokenizer(th)  # a tool turn now finds both tables
    assert len(built) == 1


def test_a_build_that_fails_at_load_is_a_warning_naming_the_fix(monkeypatch, caplog):
    from duplexkit.engine.minicpmo45 import MiniCPMO45Stages

    def refuse(tok, **kw):
        raise TypeError("argument 'eos_token': 'list' object cannot be interpreted as an integer")

    monkeypatch.setattr(llguidance_hf, "from_tokenizer", refuse)
    th = _thinker()
    with caplog.at_level("WARNING", logger="duplexkit.engine.minicpmo45"):
        assert MiniCPMO45Stages(SimpleNamespace(thinker=th)).tools_warmup() is None
    assert "llguidance >= 1.7" in caplog.text and "eos_token" in caplog.text
    with pytest.raises(TypeError):  # remembered: the first tool turn fails at once, no second build
        llg_tokenizer(th)


def test_nothing_to_warm_without_a_tokenizer():
    from duplexkit.engine.minicpmo45 import MiniCPMO45Stages

    assert MiniCPMO45Stages(SimpleNamespace(thinker=SimpleNamespace(tokenizer=None))).tools_warmup() is None
