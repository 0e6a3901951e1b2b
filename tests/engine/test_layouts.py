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
    assert all(s.max_num_seqs == 16 for s in one.stages.values())  # measured at 16 on an H200 (NOTES.md)
    two = load_layout("2gpu")
    assert two.thinker.device == "cuda:0" and two.talker.device == two.code2wav.device == "cuda:1"
    three = load_layout("3gpu")
    assert [three.stages[s].device for s in ("thinker", "talker", "code2wav")] == ["cuda:0", "cuda:1", "cuda:2"]
    big = load_layout("8x4090")
    assert big.thinker.tensor_parallel_size == 4 and big.thinker.devices == ("cuda:0", "cuda:1", "cuda:2", "cuda:3")
    assert big.talker.device == "cuda:4" and big.code2wav.device == "cuda:5"


def test_tensor_parallel_is_refused_with_a_clear_error():
    with pytest.raises(LayoutNotSupportedError, match="vLLM thinker backend"):
        check_supported(load_layout("8x4090"), cuda_devices=8)
    with pytest.raises(LayoutNotSupportedError, match="CUDA device"):
        check_supported(load_layout("3gpu"), cuda_devices=1)
    check_supported(load_layout("cpu"), cuda_devices=0)


def test_engine_refuses_tp_before_loading_weights():
    from duplexkit.engine import DuplexEngine

    with pytest.raises(LayoutNotSupportedError):
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
    (_stages(thinker__bogus=1), "unknown keys"),
    ({"name": "x", "stages": {"thinker": {"device": "cpu"}}}, "missing"),
    ({"stages": {}}, "name"),
    ("not a mapping", "mapping"),
])
def test_invalid_layouts(data, match):
    with pytest.raises(LayoutError, match=match):
        Layout.from_dict(data)


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
