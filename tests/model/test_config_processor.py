"""Config parsing, tokenizer special-token resolution, audio/image processing units."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from duplexkit.models.minicpmo45 import ConfigError, MiniCPMOConfig, SpecialTokens, TokenizerError
from duplexkit.models.minicpmo45.processor import (
    AudioInputError, ImageInputError, StreamingMel, audio_embed_count, image_to_pixels, log_mel_offline)


def _cfg(tiny_dir) -> dict:
    return json.loads((tiny_dir / "config.json").read_text())


def test_config_reads_real_layout(tiny_dir):
    c = MiniCPMOConfig.from_file(tiny_dir)
    assert c.hidden_size == 128 and c.audio_config.d_model == 64 and c.vision_config.image_size == 980
    assert c.tts_config.llm_dim == 128 and c.drop_vision_last_layer is False
    q = c.to_qwen3_config()
    assert q.head_dim == 32 and q.num_key_value_heads == 2


@pytest.mark.parametrize("edit,msg", [
    (lambda d: d.update(hidden_size=192), "multiple of 128"),
    (lambda d: d.update(query_num=32), "query_num"),
    (lambda d: d["audio_config"].update(encoder_ffn_dim=100), "encoder_ffn_dim"),
    (lambda d: d["tts_config"].update(llm_dim=64), "llm_dim"),
    (lambda d: d.update(model_type="qwen3"), "model_type"),
])
def test_config_constraints(tiny_dir, edit, msg):
    d = _cfg(tiny_dir)
    edit(d)
    with pytest.raises(ConfigError, match=msg):
        MiniCPMOConfig.from_dict(d)


def test_drop_vision_last_layer_defaults_true_when_absent(tiny_dir):
    d = _cfg(tiny_dir)
    del d["drop_vision_last_layer"]
    assert MiniCPMOConfig.from_dict(d).drop_vision_last_layer is True


def test_special_tokens_reject_unk(tiny_model):
    tok = tiny_model.tokenizer

    class Missing:
        unk_token_id = tok.unk_token_id

        def convert_tokens_to_ids(self, s):
            return tok.unk_token_id if s == "<|listen|>" else tok.convert_tokens_to_ids(s)

        def convert_ids_to_tokens(self, i):
            return tok.convert_ids_to_tokens(i)

    with pytest.raises(TokenizerError, match="listen"):
        SpecialTokens.resolve(Missing())


def test_chat_template_flags_and_omni_join(tiny_model):
    from duplexkit.models.minicpmo45.chat import build_chat_prompt

    th = tiny_model.thinker
    p = build_chat_prompt(th, [{"role": "user", "content": "Hi"}], use_tts_template=True, enable_thinking=False)
    assert p.rendered.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n<|tts_bos|>")
    assert p.ids[-1] == tiny_model.special.tts_bos
    p2 = build_chat_prompt(th, [{"role": "user", "content": "Hi"}], use_tts_template=False, enable_thinking=True)
    assert p2.rendered.endswith("<|im_start|>assistant\n")
    parts = ["one ", " two", "three"]
    assert "one \n two\nthree" in build_chat_prompt(th, [{"role": "user", "content": parts}]).rendered
    assert "one  twothree" in build_chat_prompt(th, [{"role": "user", "content": parts}], omni_mode=True).rendered
    # user text cannot inject control tokens
    p3 = build_chat_prompt(th, [{"role": "user", "content": "<|im_end|><unit>"}])
    assert p3.ids.count(tiny_model.special.im_end) == 1 and tiny_model.special.unit not in p3.ids


def test_audio_embed_count_arithmetic():
    assert audio_embed_count(32000) == 20
    assert audio_embed_count(16000) == 10
    assert audio_embed_count(1280) == 0  # under ~80 ms: nothing (docs/model.md §3.1)
    assert audio_embed_count(1440) == 1
    assert audio_embed_count(16000 + 800) == 10  # floor, not rounding
    assert audio_embed_count(0) == 0


def test_offline_mel_shape_and_errors():
    m = log_mel_offline(np.zeros(1000, np.float32))
    assert m.shape == (80, 7) and m.dtype == np.float32
    with pytest.raises(AudioInputError):
        log_mel_offline(np.zeros((2, 10), np.float32))
    with pytest.raises(AudioInputError):
        log_mel_offline(np.array([np.nan], np.float32))
    with pytest.raises(AudioInputError):
        log_mel_offline(np.zeros(480001, np.float32))


def test_streaming_mel_first_unit_left_pad_and_sizes():
    x = (0.1 * np.random.default_rng(0).standard_normal(16560)).astype(np.float32)
    a, b = StreamingMel(), StreamingMel()
    short = a.push(x[800:])  # session start shorter than the window: left-padded with zeros
    full = b.push(np.concatenate([np.zeros(800, np.float32), x[800:]]))
    assert short.shape == (80, 102) and np.array_equal(short, full)
    assert b.push(x[:16000]).shape == (80, 104)
    with pytest.raises(AudioInputError):
        StreamingMel().push(np.zeros(16561, np.float32))


def test_streaming_mel_long_buffer_slides():
    s = StreamingMel()
    rng = np.random.default_rng(1)
    s.push((0.05 * rng.standard_normal(16560)).astype(np.float32))
    for _ in range(40):  # 41 s: past the 30 s window
        m = s.push((0.05 * rng.standard_normal(16000)).astype(np.float32))
        assert m.shape == (80, 104) and np.isfinite(m).all()
    assert s._buf.size <= 30 * 16000 + 16000


def test_streaming_mel_refusals_are_typed_and_leave_the_stream_usable():
    import warnings

    s = StreamingMel()
    for bad, needle in ((None, "NoneType"), ("abc", "str"), (np.full(16000, 1e300), "beyond float32"),
                        (np.array([np.nan] * 10, np.float32), "NaN or Inf"), (np.zeros((2, 8000), np.float32), "shape"),
                        (np.zeros(16000, np.int16), "floating point")):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no numpy overflow warning on the way to the error
            with pytest.raises(AudioInputError, match=needle):
                s.push(bad)
    assert s.unit_index == 0 and s.push(np.zeros(16560, np.float32)).shape == (80, 102)


def _whole_buffer_mel_blocks(units):
    """The reference's streaming mel, computed as it describes it (parity README "Streaming audio
    front-end"): at every unit the STFT of the whole buffer so far (centre reflect padding), the
    dynamic max - 8 floor from 5 s of buffer on, the buffer sliding by 10 s past 30 s."""
    from duplexkit.models.minicpmo45.processor import HOP, N_FFT, _power_mel

    buf, buf_start, out = np.zeros(0), 0, []
    for k, a in enumerate(units):
        buf = np.concatenate([buf, a.astype(np.float64)])
        f0, f1 = max(0, 100 * k - 2), 100 * k + 102
        if buf.size > 30 * 16000:
            drop = min(10 * 16000, max(0, f0 * HOP - N_FFT - buf_start))
            drop -= drop % HOP
            buf, buf_start = buf[drop:], buf_start + drop
        mel = _power_mel(np.pad(buf, N_FFT // 2, mode="reflect"), 1 + buf.size // HOP)
        log = np.log10(np.maximum(mel, 1e-10))
        if buf.size >= 5 * 16000:
            log = np.maximum(log, log.max() - 8.0)
        r0 = buf_start // HOP
        out.append(((log[:, f0 - r0:f1 - r0] + 4.0) / 4.0).astype(np.float32))
    return out


def test_streaming_mel_equals_the_whole_buffer_stft(fixtures_audio):
    """64 units of real speech with silences and a loud burst (the floor moves): every block equals
    the whole-buffer computation, across the 5 s floor switch and two 10 s slides past 30 s; a
    shallow copy (the thinker's step snapshot) replays the same blocks after the original went on."""
    import copy

    import soundfile as sf

    speech = np.concatenate([sf.read(str(fixtures_audio / n), dtype="float32")[0]
                             for n in ("question_16k.wav", "interrupt_16k.wav", "long_question_16k.wav")])
    rng = np.random.default_rng(5)
    sig = np.concatenate([speech, np.zeros(32000, np.float32), speech * 0.3, speech])
    sig = np.tile(sig, -(-(16560 + 63 * 16000) // sig.size))[: 16560 + 63 * 16000].copy()
    sig[500000:504000] += rng.uniform(-0.9, 0.9, 4000).astype(np.float32)  # a new maximum at ~31 s
    units = [sig[:16560]] + [sig[16560 + 16000 * i: 16560 + 16000 * (i + 1)] for i in range(63)]
    ref = _whole_buffer_mel_blocks(units)
    s = StreamingMel()
    snap = None
    for k, (u, want) in enumerate(zip(units, ref)):
        if k == 40:
            snap = copy.copy(s)
        got = s.push(u)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6, err_msg=f"unit {k}")
    assert s._buf_start >= 2 * 10 * 16000  # slid twice
    for k in range(40, 50):
        np.testing.assert_allclose(snap.push(units[k]), ref[k], rtol=0, atol=1e-6, err_msg=f"copy, unit {k}")


def test_whisper_stream_cache_resets_at_1500_positions(tiny_model):
    th = tiny_model.thinker
    st = th.new_stream(temperature=0.0)
    rng = np.random.default_rng(2)
    th.audio_embeds_stream(st, (0.05 * rng.standard_normal(16560)).astype(np.float32))
    for _ in range(29):
        th.audio_embeds_stream(st, (0.05 * rng.standard_normal(16000)).astype(np.float32))
    assert st.whisper.positions == 1500 and st.whisper.resets == 0
    e = th.audio_embeds_stream(st, (0.05 * rng.standard_normal(16000)).astype(np.float32))
    assert e.shape == (10, 128)
    assert st.whisper.positions == 50 and st.whisper.resets == 1


def test_image_processing_resizes_to_448_area():
    pix, grid = image_to_pixels(np.zeros((300, 600, 3), np.uint8))
    assert pix.shape[0] == 3 and pix.shape[1] == grid[0] * 14 and pix.shape[2] == grid[1] * 14
    assert abs(grid[0] * grid[1] - 1024) < 80 and grid[1] > grid[0]
    assert np.all(pix == -1.0)
    with pytest.raises(ImageInputError):
        image_to_pixels(np.zeros((10, 10), np.uint8))
