"""Parity case a (text prompt through the Qwen3 LLM) and the reference tokenizer checks."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.parity


def test_tokenizer_matches_reference_ids(parity_model, parity_dir):
    tok = parity_model.tokenizer
    chk = json.loads((parity_dir / "tokenizer" / "tokenizer_checks.json").read_text(encoding="utf-8"))
    assert len(tok) == chk["vocab_size_with_added"]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (
        chk["bos_id"], chk["eos_id"], chk["pad_id"], chk["unk_id"])
    for s, ids in list(chk["strings"].items()) + list(chk["every_added_token_string"].items()):
        assert tok.encode(s, add_special_tokens=False) == ids, s
        assert tok.encode(s, add_special_tokens=True) == ids, s
        assert tok.decode(ids) == s
    sp = parity_model.special
    for name, want in chk["key_token_ids"].items():
        assert tok.convert_tokens_to_ids(name) == want
    assert (sp.unit, sp.unit_end, sp.listen, sp.speak, sp.tts_bos, sp.turn_eos, sp.chunk_eos, sp.unk) == (
        chk["key_token_ids"]["<unit>"], chk["key_token_ids"]["</unit>"], chk["key_token_ids"]["<|listen|>"],
        chk["key_token_ids"]["<|speak|>"], chk["key_token_ids"]["<|tts_bos|>"], chk["key_token_ids"]["<|turn_eos|>"],
        chk["key_token_ids"]["<|chunk_eos|>"], chk["key_token_ids"]["<unk>"])
    assert len(tok.bad_token_ids) == 6965


def test_case_a_prompt_ids_logits_hidden(parity_model, goldens, cases, tol, assert_close):
    from duplexkit.models.minicpmo45.chat import build_chat_prompt

    ca = cases["cases"]["a_text_prompt"]
    th = parity_model.thinker
    p = build_chat_prompt(th, ca["messages"], use_tts_template=True, enable_thinking=False)
    assert p.rendered == ca["rendered_prompt"]
    assert p.ids == ca["input_ids"] == goldens["a_input_ids"].tolist()
    with torch.inference_mode():
        h = th.forward_embeds(th.embed_ids(p.ids), th.new_cache())
        logits = th.logits(h[-1])
    t = tol["llm_logits"]
    assert_close(logits.numpy(), goldens["a_logits_last"], t["atol"], t["rtol"], "a_logits_last")
    t = tol["hidden_states_and_embeddings"]
    assert_close(h[-8:].numpy(), goldens["a_hidden_last8"], t["atol"], t["rtol"], "a_hidden_last8")


def test_case_a_greedy_chat(parity_model, goldens):
    r = parity_model.thinker.chat([{"role": "user", "content": "Briefly introduce yourself."}], use_tts_template=True,
                                  enable_thinking=False, max_tokens=6, temperature=0.0, repetition_penalty=1.0)
    assert r.token_ids.tolist() == goldens["a_greedy6"].tolist()
    assert r.finish_reason == "length"
    assert r.prompt_tokens == 18
    # the prompt ends with <|tts_bos|>: every generated token is in the spoken span
    assert r.tts_token_ids.tolist() == goldens["a_greedy6"].tolist()
    assert r.tts_hidden.shape == (6, 128) and r.tts_hidden.dtype == torch.float32


def test_case_e_llm_hidden_via_chat_rows(parity_model, goldens, tol, assert_close):
    """The hidden rows chat() hands to the talker are at each token's input position (parity e_llm_hidden)."""
    r = parity_model.thinker.chat([{"role": "user", "content": "Briefly introduce yourself."}], use_tts_template=True,
                                  max_tokens=6, temperature=0.0, repetition_penalty=1.0)
    t = tol["hidden_states_and_embeddings"]
    assert_close(r.tts_hidden.numpy(), goldens["e_llm_hidden"], t["atol"], t["rtol"], "e_llm_hidden")
