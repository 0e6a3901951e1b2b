"""Parity cases c (SigLIP + resampler) and d (full multimodal prompt)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.parity


def test_case_c_image_path(parity_model, goldens, formula_image, tol, assert_close):
    from duplexkit.models.minicpmo45.processor import image_to_pixels
    from duplexkit.models.minicpmo45.vision import navit_position_ids

    th = parity_model.thinker
    pix, grid = image_to_pixels(formula_image)
    assert grid == (32, 32)
    assert_close(pix, goldens["c_pixel_values_chw"], 1e-6, 0, "pixel_values")
    assert navit_position_ids(32, 32).tolist() == goldens["c_vision_position_ids"].tolist()
    t = tol["hidden_states_and_embeddings"]
    with torch.inference_mode():
        v = th.m.vpm(torch.from_numpy(pix), grid)
        assert_close(v.numpy(), goldens["c_vpm_last_hidden"], t["atol"], t["rtol"], "vpm_last_hidden")
        e = th.image_embeds(formula_image)
    assert e.shape == (64, 128)
    assert_close(e.numpy(), goldens["c_image_embeds"], t["atol"], t["rtol"], "image_embeds")


def test_case_d_multimodal_prompt(parity_model, goldens, cases, formula_image, master_audio, tol, assert_close):
    from duplexkit.models.minicpmo45.chat import build_chat_prompt, prompt_embeds

    cd = cases["cases"]["d_multimodal_prompt"]
    th = parity_model.thinker
    msgs = [{"role": "system", "content": ["You are a helpful assistant."]},
            {"role": "user", "content": [formula_image, master_audio[:32000], "What do you see and hear?"]}]
    with torch.inference_mode():
        p = build_chat_prompt(th, msgs, enable_thinking=False)  # audio forces use_tts_template
        assert p.use_tts_template
        assert p.rendered == cd["rendered_prompt_before_placeholder_expansion"]
        assert p.ids == cd["input_ids"] == goldens["d_input_ids"].tolist()
        starts = sorted(s for s, _ in p.replacements)
        assert starts == [cd["image_bound"][0][0], cd["audio_bounds"][0][0]]
        emb = prompt_embeds(th, p)
        t = tol["hidden_states_and_embeddings"]
        assert_close(emb.numpy(), goldens["d_inputs_embeds"], t["atol"], t["rtol"], "d_inputs_embeds")
        h = th.forward_embeds(emb, th.new_cache())
        logits = th.logits(h[-1])
    assert_close(h[-8:].numpy(), goldens["d_hidden_last8"], t["atol"], t["rtol"], "d_hidden_last8")
    t = tol["llm_logits"]
    assert_close(logits.numpy(), goldens["d_logits_last"], t["atol"], t["rtol"], "d_logits_last")
    assert int(logits.argmax()) == cd["greedy_next_token"]
