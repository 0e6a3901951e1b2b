"""Duplex units of real speech on the vLLM thinker against the native thinker (tiny checkpoint, CPU).

The vLLM side (duplexkit's model plugin taking the unit's audio embeddings, the duplex decision
rule as a logits processor, docs/vllm.md) runs in the separate vLLM venv through
tests/engine/_vllm_duplex_runner.py, one engine for the whole module; the native side runs here.
Skipped, with the reason, where that venv is missing or cannot import vllm
(``DUPLEXKIT_VLLM_PYTHON``, as tests/engine/test_vllm_thinker.py).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from .test_vllm_thinker import ROOT, _need_vllm

AUDIO = ROOT / "tests" / "fixtures" / "audio"

# One stream of 12 units over two utterances: unit 0 forced listen (force_listen_count 1), video
# frames riding units 4 and 10 (image rows as a second modality), a forced speak, a barge-in while unit 6 runs (its result is dropped, the turn ends), a forced
# listen that meets a pending forced speak, then a second stream with a reference voice and a
# seed text in its prefix (two audio items in one vLLM chunk) and short speaking units
# (``min_unit_tokens`` 2 masks the terminators, ``max_unit_tokens`` 4 moves the step cut); a third
# stream samples (temperature 0.7, seed 1234: the processor draws from the stream's generator in
# the native order, so the CPU gives the native tokens). Streams 2 and 3 run at the same time on
# the vLLM side (batched steps; hidden rows split by request). A fourth stream has a small sliding
# window (200 -> 140 positions): native and vLLM slide at the same unit and drop the same units; the
# vLLM side re-prefills the kept ones (its tokens may differ from there on, the native re-rotates).
_FLAGS = {2: "speak", 6: "barge_in", 8: "speak", 9: "listen"}


def _units(n: int, keys: list, frames: dict = None) -> list:
    return [{"audio": keys[i], "force_listen": _FLAGS.get(i) == "listen", "force_speak": _FLAGS.get(i) == "speak",
             "barge_in": _FLAGS.get(i) == "barge_in", "frame": (frames or {}).get(i)} for i in range(n)]


def _slices(wav: np.ndarray, n: int) -> list:
    """Unit 0: 16560 samples (left-padded when short), then 16000 per unit (docs/model.md §3)."""
    out, pos = [], 0
    for i in range(n):
        size = 16560 if i == 0 else 16000
        a = wav[pos:pos + size]
        out.append(np.pad(a, (size - a.size, 0)).astype(np.float32))
        pos += size
    return out


def _native(th, stream: dict, audio: dict) -> list:
    import torch

    from duplexkit.models.minicpmo45.duplex import DuplexPolicy, UnitInput, run_unit

    ref = audio[stream["ref_audio"]] if stream.get("ref_audio") else None
    pol = DuplexPolicy(**{"temperature": 0.0, "force_listen_count": stream["force_listen_count"], **stream.get("policy", {})})
    st = th.new_stream(ref_audio=ref, seed_text=stream.get("seed_text"), policy=pol, seed=stream.get("seed"))
    res, epoch = [], 0
    with torch.inference_mode():
        for u in stream["units"]:
            r = run_unit(th, UnitInput(stream=st, audio=audio[u["audio"]], force_listen=u["force_listen"],
                                       force_speak=u["force_speak"], frame=audio[u["frame"]] if u.get("frame") else None))
            res.append((r, epoch, bool(u["barge_in"])))
            if u["barge_in"]:  # the runtime drops the unit (stale epoch) and ends the turn
                epoch += 1
                th.end_turn(st)
    th.close(st)
    return res


def _native_window_trace(th, stream: dict, audio: dict) -> list:
    """(window slides, positions dropped) after each unit of a native stream."""
    import torch

    from duplexkit.models.minicpmo45.duplex import DuplexPolicy, UnitInput, run_unit

    st = th.new_stream(policy=DuplexPolicy(**{"temperature": 0.0, "force_listen_count": stream["force_listen_count"],
                                            **stream.get("policy", {})}))
    out = []
    with torch.inference_mode():
        for u in stream["units"]:
            run_unit(th, UnitInput(stream=st, audio=audio[u["audio"]], force_listen=u["force_listen"],
                                   force_speak=u["force_speak"]))
            out.append((st.window_slides, st.window_dropped))
    th.close(st)
    return out


@pytest.mark.timeout(900)
def test_vllm_duplex_units_match_native_over_real_speech_with_a_barge_in(tmp_path):
    py = _need_vllm()
    pytest.importorskip("torch")
    pytest.importorskip("stepaudio2")  # the tiny checkpoint builder
    from duplexkit.audio import read_wav
    from duplexkit.engine.vllm_thinker import export_thinker_llm
    from duplexkit.models.minicpmo45 import load
    from duplexkit.models.minicpmo45.tiny import tiny_checkpoint

    ckpt = tiny_checkpoint()
    th = load(ckpt, devices="cpu", with_code2wav=False, with_talker=False, progress=False).thinker
    q, _ = read_wav(AUDIO / "question_16k.wav", 16000)
    i, _ = read_wav(AUDIO / "interrupt_16k.wav", 16000)
    ref, _ = read_wav(AUDIO / "ref_voice_16k.wav", 16000)
    pieces = _slices(np.concatenate([q, i]), 12)
    audio = {f"a{k}": a for k, a in enumerate(pieces)}
    audio["ref"] = ref[:24000].astype(np.float32)  # 1.5 s: 15 reference-voice embeddings
    yy, xx = np.mgrid[0:240, 0:320]  # two video frames (gradients), 64 image rows each
    audio["f0"] = np.stack([xx % 256, yy % 256, (xx + yy) % 256], -1).astype(np.uint8)
    audio["f1"] = np.stack([(3 * yy) % 256, xx % 256, (xx * yy) % 256], -1).astype(np.uint8)
    keys = [f"a{k}" for k in range(12)]
    streams = [{"force_listen_count": 1, "ref_audio": None, "seed_text": None,
                "units": _units(12, keys, {4: "f0", 10: "f1"})},
               {"force_listen_count": 0, "ref_audio": "ref", "seed_text": "Hello.", "units": _units(4, keys[3:7]),
                "policy": {"min_unit_tokens": 2, "max_unit_tokens": 4}},
               {"force_listen_count": 0, "ref_audio": None, "seed_text": None, "units": _units(4, keys[6:10]),
                "policy": {"temperature": 0.7}, "seed": 1234},
               {"force_listen_count": 0, "ref_audio": None, "seed_text": None, "units": _units(12, keys),
                "policy": {"window_high": 200, "window_low": 140}}]
    np.savez(tmp_path / "audio.npz", **audio)
    spec = {"checkpoint": str(ckpt), "model": str(export_thinker_llm(ckpt, tmp_path / "llm", audio_token_id=th.special.unk,
                                                                     image_start_id=th.special.image)),
            "audio": str(tmp_path / "audio.npz"), "max_model_len": 1024, "streams": streams}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    r = subprocess.run([py, str(Path(__file__).with_name("_vllm_duplex_runner.py")), str(tmp_path / "spec.json"),
                        str(tmp_path / "out.npz")], env=env, capture_output=True, text=True, timeout=880)
    assert r.returncode == 0, r.stderr[-4000:]
    got = np.load(tmp_path / "out.npz")

    decisions, native = [], [_native(th, s, audio) for s in streams]
    greedy = _native(th, dict(streams[2], policy={}, seed=None), audio)  # the sampled stream really samples
    assert [list(w.generated_ids) for w, _, _ in greedy] != [list(w.generated_ids) for w, _, _ in native[2]]
    # the windowed stream: equal up to its first slide, which both sides make at the same unit
    win = native[3]
    slides = [int(got[f"s3u{u}_meta"][5]) for u in range(12)]
    first = slides.index(1)
    assert first >= 2 and slides[-1] >= 2  # it slid, more than once, and kept going
    assert max(int(got[f"s3u{u}_meta"][7]) for u in range(12)) <= 200  # never past window_high
    for ui in range(first):
        w = win[ui][0]
        assert got[f"s3u{ui}_tokens"].tolist() == list(w.generated_ids)
        np.testing.assert_allclose(got[f"s3u{ui}_hidden"], w.hidden.float().numpy(), rtol=0, atol=1e-4)
    st_native = _native_window_trace(th, streams[3], audio)
    assert st_native[first - 1][0] == 0 and st_native[first][0] == 1  # the native window slides at the same unit
    assert int(got[f"s3u{first}_meta"][6]) == st_native[first][1]  # ... dropping the same positions
    for si, s in enumerate(streams[:3]):
        for ui, (w, epoch, barged) in enumerate(native[si]):
            k = f"s{si}u{ui}"
            assert got[k + "_tokens"].tolist() == list(w.generated_ids), k
            assert got[k + "_rec"].tolist() == w.token_ids.tolist(), k
            speak, turn_start, end_of_turn, g_epoch, dropped = got[k + "_meta"].tolist()[:5]
            assert (bool(speak), bool(turn_start), bool(end_of_turn)) == (w.decision == "speak", w.turn_start, w.end_of_turn), k
            assert (g_epoch, bool(dropped)) == (epoch, barged), k
            assert got[k + "_hidden"].shape == tuple(w.hidden.shape), k
            np.testing.assert_allclose(got[k + "_hidden"], w.hidden.float().numpy(), rtol=0, atol=1e-4, err_msg=k)
            decisions.append((w.decision, w.n_tokens))
    # the run is not trivial: listens and speaking units with talker tokens both occur
    assert any(d == "listen" for d, _ in decisions) and any(d == "speak" and n > 1 for d, n in decisions), decisions
    assert [n for _, n in decisions[-8:-4]] == [3, 3, 3, 3]  # max_unit_tokens 4: 4 decided, the first not recorded


@pytest.mark.timeout(900)
def test_duplex_engine_with_a_vllm_thinker_matches_the_native_engine(tmp_path):
    """``DuplexEngine.from_pretrained`` with ``backend: vllm`` (tests/engine/_vllm_engine_scenario.py, in
    the vLLM venv) against the native engine here: two streams at once (greedy and seeded sampling),
    forced listen and speak units, a barge-in (CancelEpoch), then a chat request."""
    py = _need_vllm()
    pytest.importorskip("torch")
    pytest.importorskip("stepaudio2")  # the tiny checkpoint builder
    import asyncio

    from duplexkit.audio import read_wav
    from duplexkit.engine import DuplexEngine
    from duplexkit.engine.engine import tiny_checkpoint_dir

    from ._vllm_engine_scenario import run_scenario

    ckpt = tiny_checkpoint_dir(0)
    q, _ = read_wav(AUDIO / "question_16k.wav", 16000)
    i, _ = read_wav(AUDIO / "interrupt_16k.wav", 16000)
    pieces = _slices(np.concatenate([q, i]), 10)
    np.savez(tmp_path / "audio.npz", **{f"a{k}": a for k, a in enumerate(pieces)})
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    r = subprocess.run([py, str(Path(__file__).with_name("_vllm_engine_scenario.py")), str(ckpt),
                        str(tmp_path / "audio.npz"), str(tmp_path / "out.json")],
                       env=env, capture_output=True, text=True, timeout=880)
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads((tmp_path / "out.json").read_text())

    async def native():
        eng = DuplexEngine.from_pretrained(ckpt, layout="cpu", progress=False, with_code2wav=False)
        try:
            return await run_scenario(eng, pieces)
        finally:
            await eng.aclose()

    want = json.loads(json.dumps(asyncio.run(native())))
    assert got == want
    a = want["a"]["decisions"]
    assert a[0][2] == "listen" and all(d[2] == "speak" for d in a[1:])  # forced listen, then speaking units
    assert [d[1] for d in a] == [0] * 4 + [1] * 4 and a[4][3]  # the barge-in ended the turn: unit 4 reopens it
    assert len(want["b"]["decisions"]) == 4 and want["chat"]["text"]["completion_tokens"] > 0
    assert want["chat"]["audio"]["prompt_tokens"] > want["chat"]["text"]["prompt_tokens"] + 25  # 30 audio rows
