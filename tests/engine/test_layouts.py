"""Layout files: the bundled ones load, invalid ones fail with a typed error naming the field."""

from __future__ import annotations

import pytest

from duplexkit.engine import LayoutError, LayoutNotSupportedError, available_layouts, load_layout
from duplexkit.engine.layout import Layout, check_supported


def test_bundled_layouts_load():
    assert {"cpu", "1gpu", "2gpu", "3gpu", "8x4090"} <= set(available_layouts())
    cpu = load_layout("cpu")
    assert cpu.devices() == {"thinker": "cpu", "talker": "cpu", "code2wav": "cpu"}
    one = load_layout("1gpu")
    assert {s.device for s in one.stages.values()} == {"cuda:0"}
    assert [one.stages[s].memory_fraction for s in ("thinker", "talker", "code2wav")] == [0.55, 0.15, 0.15]
    assert all(s.max_num_seqs == 16 for s in one.stages.values())  # measured at 16 on an H200 (benchmarks/results/2026-11-30-gpu-engine-h200.md)
    two = load_layout("2gpu")
    assert two.thinker.device == "cuda:0" and two.talker.device == two.code2wav.device == "cuda:1"
    three = load_layout("3gpu")
    assert [three.stages[s].device for s in ("thinker", "talker", "code2wav")] == ["cuda:0", "cuda:1", "cuda:2"]
    big = load_layout("8x4090")
    assert big.thinker.tensor_parallel_size == 4 and big.thinker.devices == ("cuda:0", "cuda:1", "cuda:2", "cuda:3")
    assert big.talker.device == "cuda:4" and big.code2wav.device == "cuda:5"


def test_tensor_parallel_layouts_use_the_vllm_backend():
    big = load_layout("8x4090")
    assert big.thinker.backend == "vllm" and big.talker.backend == big.code2wav.backend == "native"
    tp2 = load_layout("2gpu-tp")
    assert tp2.thinker.backend == "vllm" and tp2.thinker.devices == ("cuda:0", "cuda:1")
    assert tp2.thinker.tensor_parallel_size == 2 and tp2.talker.device == tp2.code2wav.device == "cuda:1"
    # every other bundled layout keeps the native thinker (the default)
    for name in ("cpu", "1gpu", "2gpu", "3gpu"):
        assert load_layout(name).thinker.backend == "native"
    # with vllm importable, the 8x4090 layout is supported on 8 GPUs (and on 6: GPUs 6-7 are unused)
    check_supported(big, cuda_devices=8, vllm_reason=None)
    check_supported(big, cuda_devices=6, vllm_reason=None)
    check_supported(tp2, cuda_devices=2, vllm_reason=None)


def test_supported_names_the_missing_device_or_vllm():
    with pytest.raises(LayoutNotSupportedError, match=r"stages.talker wants cuda:1 but 1 CUDA device"):
        check_supported(load_layout("3gpu"), cuda_devices=1)
    with pytest.raises(LayoutNotSupportedError, match=r"stages.code2wav wants cuda:5 but 5 CUDA device"):
        check_supported(load_layout("8x4090"), cuda_devices=5, vllm_reason=None)
    with pytest.raises(LayoutNotSupportedError, match="backend is 'vllm' but vllm cannot be imported: no wheel"):
        check_supported(load_layout("8x4090"), cuda_devices=8, vllm_reason="no wheel")
    check_supported(load_layout("cpu"), cuda_devices=0)


def test_engine_refuses_an_unusable_vllm_layout_before_loading_weights():
    from duplexkit.engine import DuplexEngine
    from duplexkit.engine.layout import vllm_importable

    # without vllm: the import is named; with vllm but no 8 GPUs here: the missing device is named
    match = "vllm cannot be imported" if vllm_importable() else "CUDA device"
    with pytest.raises(LayoutNotSupportedError, match=match):
        DuplexEngine.from_pretrained("/nonexistent/checkpoint", layout="8x4090")


def _stages(**over):
    base = {s: {"device": "cpu", "dtype": "float32", "max_num_seqs": 2} for s in ("thinker", "talker", "code2wav")}
    for k, v in over.items():
        stage, field = k.split("__")
        base[stage][field] = v
    return {"name": "x", "stages": base}


@pytest.mark.parametrize("data, match", [
    (_stages(thinker__device="gpu0"), "device"),
    (_stages(talker__dtype="int8"), "dtype"),
    (_stages(code2wav__max_num_seqs=0), "max_num_seqs"),
    (_stages(thinker__memory_fraction=1.5), "memory_fraction"),
    (_stages(talker__tensor_parallel_size=2), "only the thinker"),
    (_stages(thinker__backend="sglang"), "backend must be one of"),
    (_stages(talker__backend="vllm"), "only the thinker has a vllm backend"),
    (_stages(thinker__device=["cuda:0", "cuda:1"], thinker__tensor_parallel_size=2),
     "tensor_parallel_size 2 needs 'backend: vllm'"),
    (_stages(thinker__device=["cuda:0", "cuda:1"], thinker__tensor_parallel_size=3, thinker__backend="vllm"),
     "tensor_parallel_size 3 needs 3 devices"),
    (_stages(thinker__device=["cuda", "cuda:0"], thinker__tensor_parallel_size=2, thinker__backend="vllm"),
     "lists a device twice"),
    (_stages(thinker__device=["cuda:2", "cuda:3"], thinker__tensor_parallel_size=2, thinker__backend="vllm",
             thinker__memory_fraction=0.5), r"must be \['cuda:0', 'cuda:1'\] in that order"),
    (_stages(thinker__device=["cuda:1", "cuda:0"], thinker__tensor_parallel_size=2, thinker__backend="vllm",
             thinker__memory_fraction=0.5), "in that order"),
    (_stages(thinker__device="cuda:0", thinker__backend="vllm"), "needs memory_fraction"),
    (_stages(thinker__bogus=1), "unknown keys"),
    (_stages(thinker__batch_window_ms=-1), "batch_window_ms must be a finite number"),
    (_stages(talker__batch_window_ms="8"), "batch_window_ms must be a finite number"),
    (_stages(thinker__batch_window_ms=float("nan")), "batch_window_ms must be a finite number"),
    (_stages(code2wav__batch_window_ms=float("inf")), "batch_window_ms must be a finite number"),
    (_stages(thinker__batch_window_ms=True), "batch_window_ms must be a finite number"),
    (_stages(thinker__batch_window_ms=None), "batch_window_ms must be a finite number"),
    ({"name": "x", "stages": {"thinker": {"device": "cpu"}}}, "missing"),
    ({"stages": {}}, "name"),
    ("not a mapping", "mapping"),
])
def test_invalid_layouts(data, match):
    with pytest.raises(LayoutError, match=match):
        Layout.from_dict(data)


def test_batch_window_defaults_to_the_thinker_only_and_keeps_explicit_values(tmp_path):
    omitted = Layout.from_dict(_stages())
    assert [omitted.stages[s].batch_window_ms for s in ("thinker", "talker", "code2wav")] == [8.0, 0.0, 0.0]
    for name in available_layouts():  # the bundled layouts leave it to the default
        assert load_layout(name).thinker.batch_window_ms == 8.0
    given = Layout.from_dict(_stages(thinker__batch_window_ms=0, talker__batch_window_ms=2.5,
                                     code2wav__batch_window_ms=4))
    assert [given.stages[s].batch_window_ms for s in ("thinker", "talker", "code2wav")] == [0.0, 2.5, 4.0]
    assert isinstance(given.code2wav.batch_window_ms, float)
    p = tmp_path / "w.yaml"
    p.write_text("name: w\nstages:\n  thinker: {device: cpu, batch_window_ms: 20}\n"
                 "  talker: {device: cpu}\n  code2wav: {device: cpu}\n")
    assert load_layout(p).thinker.batch_window_ms == 20.0 and load_layout(p).talker.batch_window_ms == 0.0
    p.write_text(p.read_text().replace("20", ".nan"))  # YAML's NaN
    with pytest.raises(LayoutError, match="batch_window_ms"):
        load_layout(p)


def test_memory_budget_over_one_device(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("name: bad\nstages:\n" + "".join(
        f"  {s}: {{device: 'cuda:0', memory_fraction: 0.5}}\n" for s in ("thinker", "talker", "code2wav")))
    with pytest.raises(LayoutError, match="adds up to more than 1.0"):
        load_layout(p)


def test_unknown_name_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(LayoutError, match="unknown layout"):
        load_layout("nope")
    with pytest.raises(LayoutError, match="not found"):
        load_layout(tmp_path / "missing.yaml")
    p = tmp_path / "broken.yaml"
    p.write_text("name: [unclosed\n")
    with pytest.raises(LayoutError, match="cannot read"):
        load_layout(p)


def test_engine_plans_a_vllm_thinker_then_loads_the_checkpoint(tmp_path, monkeypatch):
    import json

    from duplexkit.engine import DuplexEngine
    from duplexkit.engine import layout as layout_mod

    monkeypatch.setattr(layout_mod, "vllm_importable", lambda: None)  # as if vllm were installed
    lay = Layout.from_dict({"name": "cpu-vllm", "stages": {
        "thinker": {"device": "cpu", "backend": "vllm"}, "talker": {"device": "cpu"}, "code2wav": {"device": "cpu"}}})
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    from duplexkit.models.minicpmo45.tiny import tiny_config_dict

    (ckpt / "config.json").write_text(json.dumps(tiny_config_dict(vocab_size=640, eos_ids=[1], pad_id=0,
                                                                  audio_bos=2, text_eos=3)))
    # the plan passes (2 KV heads, TP 1); the loader then finds no weights, before any vLLM engine
    # starts (the vLLM thinker itself: tests/engine/test_vllm_duplex.py)
    from duplexkit.models.minicpmo45.loader import CheckpointError

    with pytest.raises(CheckpointError):
        DuplexEngine.from_pretrained(ckpt, layout=lay)
