"""Placement plans built on the CPU, without GPUs, torch or vllm: devices per stage, vLLM engine
arguments of a tensor-parallel thinker, and the head-count check against a checkpoint config."""

from __future__ import annotations

import json
import sys

import pytest

from duplexkit.engine import LayoutNotSupportedError
from duplexkit.engine.placement import check_heads, plan_placement

# Qwen3-8B, the thinker of MiniCPM-o 4.5: 32 query heads, 8 key/value heads (docs/model.md §1)
QWEN3_8B = {"model_type": "minicpmo", "version": "4.5", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
            "num_hidden_layers": 36, "vocab_size": 151748}


def test_8x4090_plan_places_every_stage_without_gpus(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(QWEN3_8B))
    plan = plan_placement("8x4090", ckpt, cuda_devices=8)
    th, tk, cw = plan.stages["thinker"], plan.stages["talker"], plan.stages["code2wav"]
    assert (th.backend, th.tensor_parallel_size, th.devices) == ("vllm", 4, ("cuda:0", "cuda:1", "cuda:2", "cuda:3"))
    assert (tk.backend, tk.devices, cw.devices) == ("native", ("cuda:4",), ("cuda:5",))
    assert th.engine_args == {"model": str(ckpt), "tensor_parallel_size": 4, "dtype": "bfloat16", "max_num_seqs": 4,
                              "trust_remote_code": True, "max_model_len": 4096, "gpu_memory_utilization": 0.85,
                              "distributed_executor_backend": "mp"}
    assert tk.engine_args is None and cw.engine_args is None
    assert plan.heads == (32, 8)
    assert plan.devices_used() == [f"cuda:{i}" for i in range(6)]  # GPUs 6 and 7 stay free
    assert plan.by_device["cuda:2"] == (("thinker", 0.85),)
    assert "thinker  vllm    TP=4 cuda:0,cuda:1,cuda:2,cuda:3 bfloat16 0.85" in plan.describe()


def test_plan_imports_neither_torch_nor_vllm():
    import subprocess

    code = ("import sys, json; from duplexkit.engine.placement import plan_placement; "
            "p = plan_placement('8x4090', {'model_type': 'minicpmo', 'version': '4.5', 'hidden_size': 4096, 'num_attention_heads': 32, 'num_key_value_heads': 8}, "
            "cuda_devices=8); print(json.dumps(['torch' in sys.modules, 'vllm' in sys.modules, p.heads]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == [False, False, [32, 8]]


def test_2gpu_tp_plan_shares_gpu1_within_its_budget():
    plan = plan_placement("2gpu-tp", QWEN3_8B, cuda_devices=2)
    assert plan.by_device["cuda:1"] == (("thinker", 0.6), ("talker", 0.15), ("code2wav", 0.15))
    assert plan.stages["thinker"].engine_args["tensor_parallel_size"] == 2
    assert plan.stages["thinker"].engine_args["model"] is None  # no checkpoint path given


def test_tp_must_divide_the_checkpoint_heads(tmp_path):
    bad = dict(QWEN3_8B, num_attention_heads=28, num_key_value_heads=4)  # 28 % 8 != 0 for TP 8 below
    p = tmp_path / "tp3.yaml"
    p.write_text("name: tp3\nstages:\n"
                 "  thinker: {backend: vllm, device: [cuda:0, cuda:1, cuda:2], tensor_parallel_size: 3,"
                 " memory_fraction: 0.8}\n"
                 "  talker: {device: cuda:3}\n  code2wav: {device: cuda:3}\n")
    with pytest.raises(LayoutNotSupportedError, match="tensor_parallel_size 3 does not divide the checkpoint's "
                                                      "num_attention_heads 32"):
        plan_placement(p, QWEN3_8B)
    with pytest.raises(LayoutNotSupportedError, match="num_key_value_heads 3"):
        check_heads(2, 6, 3)
    check_heads(4, 28, 4)
    check_heads(8, 32, 4)  # fewer kv heads than ranks: replicated (8 % 4 == 0)
    with pytest.raises(LayoutNotSupportedError, match="does not divide"):
        check_heads(8, bad["num_attention_heads"], bad["num_key_value_heads"])


def test_tiny_checkpoint_heads_limit_tp(tmp_path):
    from duplexkit.models.minicpmo45.tiny import tiny_config_dict

    tiny = tiny_config_dict(vocab_size=640, eos_ids=[1], pad_id=0, audio_bos=2, text_eos=3)
    plan = plan_placement("2gpu-tp", tiny)
    assert plan.heads == (tiny["num_attention_heads"], tiny["num_key_value_heads"]) == (4, 2)
    with pytest.raises(LayoutNotSupportedError, match="does not divide"):
        plan_placement("8x4090", dict(tiny, num_attention_heads=6, num_key_value_heads=2))


def test_plan_names_an_out_of_range_device():
    with pytest.raises(LayoutNotSupportedError, match="stages.talker wants cuda:4 but 4 CUDA device"):
        plan_placement("8x4090", QWEN3_8B, cuda_devices=4)
    cpu = plan_placement("cpu", None, cuda_devices=0)
    assert cpu.devices_used() == ["cpu"] and cpu.heads is None
    assert all(p.backend == "native" and p.engine_args is None for p in cpu.stages.values())
