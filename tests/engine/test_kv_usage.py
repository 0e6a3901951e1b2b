"""``DuplexEngine.kv_usage`` over real ``fast_kv.KVPool`` objects (CPU tensors), and its series on
the server's ``/metrics`` (docs/deployment.md, "Metrics")."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")


def _pool(slots: int):
    from duplexkit.models.minicpmo45.fast_kv import KVPool

    return KVPool(2, 2, 8, 64, dtype=torch.float32, device="cpu", slots=slots, grow_by=2)


def test_kv_usage_counts_slots_and_bytes_and_reaches_metrics():
    from prometheus_client.parser import text_string_to_metric_families

    from duplexkit.engine import DuplexEngine
    from duplexkit_server import create_app

    thinker, talker = SimpleNamespace(pool=_pool(2)), SimpleNamespace(pool=_pool(1))
    eng = DuplexEngine(SimpleNamespace(thinker=thinker, talker=talker, code2wav=None), layout="cpu")
    try:
        assert eng.kv_usage()["thinker"] == {"slots_used": 0, "slots_total": 2, "positions_per_slot": 64,
                                             "bytes": 2 * 2 * 3 * 64 * 2 * 8 * 4}  # K+V, layers, slots+scratch
        a, b, c = (thinker.pool.alloc() for _ in range(3))  # the third grows the pool by 2 slots
        talker.pool.alloc()
        u = eng.kv_usage()
        assert (u["thinker"]["slots_used"], u["thinker"]["slots_total"]) == (3, 4)
        assert (u["talker"]["slots_used"], u["talker"]["slots_total"]) == (1, 1)
        assert u["thinker"]["bytes"] == thinker.pool.nbytes() > 0
        body, _ = create_app(eng).state.duplexkit.metrics.render()
        got = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(body.decode()) for s in f.samples}
        assert got[("duplexkit_kv_slots", (("kind", "used"), ("stage", "thinker")))] == 3
        assert got[("duplexkit_kv_slots", (("kind", "total"), ("stage", "thinker")))] == 4
        assert got[("duplexkit_kv_bytes", (("stage", "talker"),))] == talker.pool.nbytes()
        thinker.pool.release(b)
        assert eng.kv_usage()["thinker"]["slots_used"] == 2
    finally:
        asyncio.run(eng.aclose())


def test_kv_usage_is_empty_without_static_pools():
    from duplexkit.engine import DuplexEngine

    eng = DuplexEngine(SimpleNamespace(thinker=SimpleNamespace(), talker=None, code2wav=None), layout="cpu")
    try:
        assert eng.kv_usage() == {}
    finally:
        asyncio.run(eng.aclose())


def test_kv_usage_reports_the_fast_thinkers_whisper_pool():
    """The fast thinker's Whisper streaming-cache pool (``FastThinker.whisper_pool``) is reported as
    stage ``thinker_audio`` beside the thinker's KV, and reaches ``/metrics``."""
    from prometheus_client.parser import text_string_to_metric_families

    from duplexkit.engine import DuplexEngine
    from duplexkit_server import create_app

    audio = _pool(0)  # the scratch slot only until a stream's first audio unit
    thinker = SimpleNamespace(pool=_pool(2), whisper_pool=audio)
    eng = DuplexEngine(SimpleNamespace(thinker=thinker, talker=None, code2wav=None), layout="cpu")
    try:
        assert eng.kv_usage()["thinker_audio"] == {"slots_used": 0, "slots_total": 0, "positions_per_slot": 64,
                                                   "bytes": 2 * 2 * 1 * 64 * 2 * 8 * 4}
        audio.alloc()  # grows by 2
        u = eng.kv_usage()["thinker_audio"]
        assert (u["slots_used"], u["slots_total"], u["bytes"]) == (1, 2, audio.nbytes())
        body, _ = create_app(eng).state.duplexkit.metrics.render()
        got = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(body.decode()) for s in f.samples}
        assert got[("duplexkit_kv_bytes", (("stage", "thinker_audio"),))] == audio.nbytes()
        assert set(eng.kv_usage()) == {"thinker", "thinker_audio"}
    finally:
        asyncio.run(eng.aclose())
