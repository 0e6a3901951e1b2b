"""Parity case b: offline log-mel -> Whisper (1 s block-causal) -> projector -> pooling."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.parity


def test_case_b_offline_audio_path(parity_model, goldens, master_audio, tol, assert_close):
    from duplexkit.models.minicpmo45.processor import audio_embed_count, log_mel_offline

    th = parity_model.thinker
    a = master_audio[:32000]
    assert np.array_equal(a, goldens["input_audio_2s"])
    mel = log_mel_offline(a)
    assert_close(mel, goldens["b_mel"], tol["mel"]["atol"], 0, "b_mel")
    t = tol["hidden_states_and_embeddings"]
    with torch.inference_mode():
        m = torch.from_numpy(mel)
        conv = th.audio.conv_and_positions(m)
        assert_close(conv.numpy(), goldens["b_whisper_conv_out_plus_pos"], t["atol"], t["rtol"], "conv_out_plus_pos")
        last = th.audio.encode_offline(m)
        assert_close(last.numpy(), goldens["b_whisper_last_hidden"], t["atol"], t["rtol"], "whisper_last_hidden")
        proj = th.m.audio_projection_layer(last)
        assert_close(proj.numpy(), goldens["b_projected"], t["atol"], t["rtol"], "projected")
        emb = th.audio_embeds_offline(a)
        assert emb.shape[0] == audio_embed_count(32000) == 20
        assert_close(emb.numpy(), goldens["b_audio_embeds"], t["atol"], t["rtol"], "audio_embeds")
        ctrl = th.audio_embeds_offline(a, block_mask=False)
        assert_close(ctrl.numpy(), goldens["b_audio_embeds_no_chunk_mask"], t["atol"], t["rtol"], "no_chunk_mask")
        # the control really differs: the block mask matters
        assert np.abs(ctrl.numpy() - emb.numpy()).max() > 1e-3
