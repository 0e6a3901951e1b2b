"""Checkpoint loading: strict key report, shards + index, dtypes, layout checks (tiny checkpoint)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from duplexkit.models.minicpmo45 import CheckpointError, UnitInput, load


def _copy(tiny_dir, dst):
    shutil.copytree(tiny_dir, dst, ignore=shutil.ignore_patterns("assets"))
    return dst


def _rewrite(d, fn):
    t = load_file(str(d / "model.safetensors"))
    fn(t)
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})


def test_missing_unexpected_misshaped_report(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path / "c")

    def edit(t):
        del t["llm.model.layers.1.mlp.up_proj.weight"]
        t["llm.model.extra.weight"] = np.zeros(3, np.float32)
        t["resampler.query"] = np.zeros((63, 128), np.float32)

    _rewrite(d, edit)
    with pytest.raises(CheckpointError) as ei:
        load(d, progress=False, with_code2wav=False)
    e = ei.value
    assert e.missing == ["llm.model.layers.1.mlp.up_proj.weight"]
    assert e.unexpected == ["llm.model.extra.weight"]
    assert e.mismatched == ["resampler.query: got (63, 128), expected (64, 128)"]
    for s in ("1 missing", "1 unexpected", "1 mis-shaped", "up_proj"):
        assert s in str(e)


def test_ignored_tts_keys_are_optional_and_tts_keys_checked(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path / "c")
    _rewrite(d, lambda t: [t.pop(k) for k in list(t) if k.startswith(("tts.model.embed_tokens", "tts.projector_spk"))])
    m = load(d, progress=False, with_code2wav=False)
    assert m.talker is not None
    _rewrite(d, lambda t: t.pop("tts.emb_text.weight"))
    with pytest.raises(CheckpointError, match="tts.emb_text.weight"):
        load(d, progress=False, with_code2wav=False)


def test_sharded_checkpoint_via_index(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path / "c")
    t = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    keys = sorted(t)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    wm = {}
    for fn, ks in shards.items():
        save_file({k: t[k] for k in ks}, str(d / fn), metadata={"format": "pt"})
        wm.update({k: fn for k in ks})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    a = load(d, progress=False, with_code2wav=False)
    b = load(tiny_dir, progress=False, with_code2wav=False)
    for (ka, va), (kb, vb) in zip(a.thinker.m.state_dict().items(), b.thinker.m.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)
    # a shard named in the index but absent
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing"):
        load(d, progress=False, with_code2wav=False)


def test_no_weights_and_bad_dir(tiny_dir, tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        load(tmp_path / "nope", progress=False)
    d = _copy(tiny_dir, tmp_path / "c")
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load(d, progress=False)


def test_vision_layer_count_must_match_drop_flag(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path / "c")
    cfg = json.loads((d / "config.json").read_text())
    cfg["vision_config"]["num_hidden_layers"] = 2
    cfg["drop_vision_last_layer"] = False
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="vpm.encoder.layers"):
        load(d, progress=False, with_code2wav=False)
    cfg["drop_vision_last_layer"] = True  # 2 layers, last dropped -> 1 built: matches the checkpoint
    (d / "config.json").write_text(json.dumps(cfg))
    m = load(d, progress=False, with_code2wav=False)
    assert len(m.thinker.m.vpm.encoder.layers) == 1


def test_seven_file_token2wav_layout_rejected(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path / "c")
    t2w = d / "assets" / "token2wav"
    t2w.mkdir(parents=True)
    for f in ("flow.yaml", "flow.pt", "hift.pt", "hift_original.pt", "config.yaml"):
        (t2w / f).write_bytes(b"x")
    with pytest.raises(CheckpointError, match="7-file"):
        load(d, progress=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, "float16"])
def test_half_dtypes(tiny_dir, dtype):
    m = load(tiny_dir, dtype=dtype, progress=False, with_code2wav=False)
    want = torch.bfloat16 if dtype is torch.bfloat16 else torch.float16
    assert m.thinker.m.llm.lm_head.weight.dtype == want
    assert m.thinker.m.llm.model.rotary_emb.inv_freq.dtype == torch.float32
    st = m.thinker.new_stream(temperature=0.0)
    r = m.thinker.step_units([UnitInput(stream=st, audio=np.zeros(16560, np.float32))])[0]
    assert r.hidden.dtype == torch.float32


def test_bad_dtype_and_devices(tiny_dir):
    with pytest.raises(ValueError):
        load(tiny_dir, dtype="int8", progress=False)
    with pytest.raises(ValueError):
        load(tiny_dir, devices={"vocoder": "cpu"}, progress=False)


def test_marker_sets_random_weights(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path / "c")
    (d / "duplexkit_random_weights.json").unlink()
    assert load(d, progress=False, with_code2wav=False).random_weights is False


def test_load_wires_all_three_stages_from_tiny(tiny_dir):
    """The tiny builder writes assets/token2wav ; load() wires the Talker and Code2Wav from it."""
    if not (tiny_dir / "assets" / "token2wav").is_dir():
        pytest.skip("code2wav.write_tiny_token2wav not available")
    m = load(tiny_dir, progress=False, devices={"thinker": "cpu", "talker": "cpu", "code2wav": "cpu"})
    assert m.talker is not None and m.code2wav is not None
    assert m.devices == {"thinker": "cpu", "talker": "cpu", "code2wav": "cpu"}
    assert m.model_dir == tiny_dir and m.generation_config["top_k"] == 20
    assert m.preprocessor_config["image_feature_size"] == 64


class _Stderr:
    """A stand-in for sys.stderr: a terminal or not, recording what is written."""

    def __init__(self, tty: bool):
        self.tty, self.text = tty, ""

    def isatty(self):
        return self.tty

    def write(self, s):
        self.text += s
        return len(s)

    def flush(self):
        pass


@pytest.mark.parametrize("tty", [False, True])
def test_weight_progress_bar_only_on_a_terminal(tmp_path, monkeypatch, tty):
    pytest.importorskip("tqdm")
    from duplexkit.models.minicpmo45 import loader

    path = tmp_path / "model.safetensors"
    save_file({"a": np.ones((2, 3), np.float32), "b": np.arange(4, dtype=np.int64)}, str(path))
    err = _Stderr(tty)
    monkeypatch.setattr(loader.sys, "stderr", err)
    out = loader._read_tensors({"a": path, "b": path}, ["a", "b"], torch.bfloat16, "cpu",
                               progress="thinker weights")
    assert out["a"].dtype == torch.bfloat16 and out["b"].tolist() == [0, 1, 2, 3]
    # a log file or a pipe gets no bar (its \r would glue "thinker weights: 0%|" to the next line)
    assert ("thinker weights" in err.text) == tty, err.text
