"""Parity cases f and f2: the duplex unit loop, greedy, audio only."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.parity

UNIT_RANGES = [(32000, 48560), (48560, 64560), (64560, 80560), (80560, 96560)]


@pytest.mark.parametrize("case,penalty,force_listen_count,prefix", [
    ("f_duplex", 1.05, 0, "f"),
    ("f2_duplex_force_listen", 1.0, 2, "f2"),
])
def test_duplex_units(parity_model, goldens, cases, master_audio, tol, assert_close, case, penalty, force_listen_count, prefix):
    from duplexkit.models.minicpmo45 import DuplexPolicy, UnitInput

    res = cases["cases"][case]["result"]
    th = parity_model.thinker
    hs = tol["hidden_states_and_embeddings"]
    lt = tol["llm_logits"]
    pol = DuplexPolicy(temperature=0.0, repetition_penalty=penalty, force_listen_count=force_listen_count)
    st = th.new_stream(instructions="Streaming Omni Conversation.", ref_audio=master_audio[:32000], policy=pol)
    assert st.position == res["cache_len_after_prepare"] == 30
    assert len(th.forbidden_ids) == res["forbidden_token_ids_count"]
    for k, (a, b) in enumerate(UNIT_RANGES):
        u = res["units"][k]
        r = th.step_units([UnitInput(stream=st, audio=master_audio[a:b])])[0]
        assert r.generated_ids == u["generated_ids_incl_unit_end"], f"unit {k}"
        assert r.token_ids.tolist() == u["tts_token_ids"]
        assert r.n_tokens == u["n_tokens"] == len(u["tts_token_ids"])
        assert (r.decision == "listen") == u["is_listen"]
        assert r.text == u["text"]
        assert r.end_of_turn == u["end_of_turn"]
        assert st.position == u["cache_len_after_unit"]
        assert st.last_mel.shape[1] == u["mel_frames"]
        if prefix == "f":
            assert_close(st.last_mel, goldens[f"f_u{k}_mel"], tol["mel"]["atol"], 0, f"u{k} mel")
            assert_close(st.last_audio_embeds.numpy(), goldens[f"f_u{k}_audio_embeds"], hs["atol"], hs["rtol"], f"u{k} audio")
        key = f"{prefix}_u{k}_pending_logits"
        if key in goldens:
            assert_close(r.pending_logits.numpy(), goldens[key], lt["atol"], lt["rtol"], key)
        key = f"{prefix}_u{k}_tts_hidden"
        if key in goldens:
            assert_close(r.hidden.numpy(), goldens[key], hs["atol"], hs["rtol"], key)
        else:
            assert r.hidden.shape == (0, 128)
    assert st.whisper.positions == 200


def test_ref_audio_embeds_equal_offline_path(parity_model, goldens, master_audio, tol, assert_close):
    hs = tol["hidden_states_and_embeddings"]
    e = parity_model.thinker.audio_embeds_offline(master_audio[:32000])
    assert_close(e.numpy(), goldens["f_ref_audio_embeds"], hs["atol"], hs["rtol"], "f_ref_audio_embeds")
