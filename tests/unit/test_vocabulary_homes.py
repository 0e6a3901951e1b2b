"""One home per fact: the model constants, the reference-voice trim and the ``serve`` settings.

* codes per chunk (25), the output rate (24,000 Hz) and the silence code (4218) are written once, in
  duplexkit/units.py (docs/model.md names their source; duplexkit/engine/api.py re-exports them), the
  silence slack (250 ms) once in duplexkit/engine/api.py, and all are imported everywhere else; the wire's own 24 kHz (OpenAI's ``audio/pcm``) once in the vocabulary;
* one function trims and bound-checks a reference voice, and its three callers agree;
* every ``duplexkit serve`` settings option is generated from its ``ServerSettings`` field.
"""

from __future__ import annotations

import ast
import base64
import dataclasses
import io
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted((ROOT / "duplexkit").rglob("*.py")) + sorted((ROOT / "server").rglob("*.py"))


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _int_literals(value: int) -> dict[str, int]:
    """file -> number of integer literals equal to ``value`` (docstrings and comments are not code)."""
    out: dict[str, int] = {}
    for path in SOURCES:
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Constant) and type(n.value) is int and n.value == value:
                out[_rel(path)] = out.get(_rel(path), 0) + 1
    return out


def _named_assignments(value: int, *words: str) -> list[str]:
    """``file:NAME`` of assignments ``NAME = value`` (or a field default) whose name has one of ``words``."""
    out = []
    for path in SOURCES:
        for n in ast.walk(ast.parse(path.read_text())):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else []
            val = getattr(n, "value", None)
            if isinstance(val, ast.Constant) and type(val.value) is int and val.value == value:
                for t in targets:
                    name = t.id if isinstance(t, ast.Name) else getattr(t, "attr", "")
                    if any(w in name.lower() for w in words):
                        out.append(f"{_rel(path)}:{name}")
    return out


def test_silence_code_has_one_home():
    assert _int_literals(4218) == {"duplexkit/units.py": 1}


def test_codes_per_chunk_has_one_home():
    assert _named_assignments(25, "chunk", "codes") == ["duplexkit/units.py:CODES_PER_CHUNK"]


def test_silence_slack_has_one_home():
    assert _int_literals(250) == {"duplexkit/engine/api.py": 1}
    from duplexkit.engine.api import SILENCE_SLACK_MS
    from duplexkit.session import SessionConfig
    from duplexkit.settings import ServerSettings

    assert SessionConfig().silence_slack_ms == ServerSettings().silence_slack_ms == SILENCE_SLACK_MS == 250


def test_output_rate_has_one_home_and_the_wire_rate_another():
    # COMMON_RATES in the arrival monitor is a list of rates clients use, not the output rate
    assert _int_literals(24_000) == {"duplexkit/units.py": 1, "duplexkit/protocol/vocabulary.py": 1,
                                     "duplexkit/audio/arrival.py": 1}
    from duplexkit.audio.playback import OUTPUT_RATE
    from duplexkit.clients.records import OUTPUT_RATE as CLIENT_RATE
    from duplexkit.engine.api import OUTPUT_SAMPLE_RATE
    from duplexkit.protocol.vocabulary import PCM_RATE
    from duplexkit.recording import ASSISTANT_RATE

    assert OUTPUT_RATE == CLIENT_RATE == ASSISTANT_RATE == OUTPUT_SAMPLE_RATE == PCM_RATE == 24_000


def test_the_model_port_reads_the_contract():
    from duplexkit.engine import api
    from duplexkit.models.minicpmo45 import code2wav_assets as assets

    assert (assets.CHUNK_CODES, assets.SILENCE_CODE, assets.SAMPLE_RATE, assets.SAMPLES_PER_CODE) == (
        api.CODES_PER_CHUNK, api.SILENCE_CODE, api.OUTPUT_SAMPLE_RATE, api.SAMPLES_PER_CODE)


# ------------------------------------------------------------------------------------------ voice


def test_reference_voice_trim_and_bounds():
    from duplexkit.engine.api import REF_TRIM_SAMPLES, reference_voice
    from duplexkit.errors import RefAudioLengthError

    rng = np.random.default_rng(0)
    clip = rng.uniform(-0.5, 0.5, 16_000 + 1234).astype(np.float32)
    v = reference_voice(clip, max_s=30)
    assert len(v.audio) == 16_000 and len(v.audio) % REF_TRIM_SAMPLES == 0  # 1.0771 s -> whole 100 ms
    assert np.array_equal(v.audio, clip[:16_000])
    assert len(reference_voice(clip[:8000], 30).audio) == 8000  # 0.5 s exactly: accepted
    assert len(reference_voice(clip[:16_000], 1.0).audio) == 16_000  # max_s exactly: accepted
    for short_or_long, max_s in ((clip[:7999], 30.0), (clip[:16_001], 1.0)):
        with pytest.raises(RefAudioLengthError) as ei:
            reference_voice(short_or_long, max_s)
        assert ei.value.code == "ref_audio_invalid" and isinstance(ei.value, ValueError)


def _wav(audio: np.ndarray) -> bytes:
    from duplexkit.audio import write_wav

    buf = io.BytesIO()
    write_wav(buf, audio, 16_000)
    return buf.getvalue()


def test_the_three_callers_agree(tmp_path):
    from duplexkit.audio import read_wav
    from duplexkit.errors import ProtocolError
    from duplexkit.session.voice import load_ref_audio
    from duplexkit_server.app import load_reference_voice
    from duplexkit_server.chat import ChatRequestError, _ref_voice

    def err(code, message, param):
        return ProtocolError(code, message, param)

    rng = np.random.default_rng(1)
    for n, ok in ((8000, True), (7999, False), (20_000 + 77, True), (16_000 * 3 + 5, False)):
        data = _wav(rng.uniform(-0.5, 0.5, n).astype(np.float32))
        (tmp_path / "v.wav").write_bytes(data)
        results = []
        for call in (lambda: load_ref_audio("data:audio/wav;base64," + base64.b64encode(data).decode(), None, 3.0, err),
                     lambda: load_reference_voice(tmp_path / "v.wav", 3.0),
                     lambda: _ref_voice(read_wav(io.BytesIO(data), 16_000)[0], 3.0, "ref_audio")):
            try:
                results.append(call().sha256)
            except (ProtocolError, ValueError, ChatRequestError) as exc:
                results.append(type(exc).__name__)
        if ok:
            assert len(set(results)) == 1 and len(results[0]) == 64, (n, results)
        else:
            assert results == ["ProtocolError", "ValueError", "ChatRequestError"], (n, results)


# --------------------------------------------------------------------------------------- settings


def test_every_settings_option_is_generated_from_its_field(capsys):
    from duplexkit import cli
    from duplexkit.settings import ServerSettings, cli_options

    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--help"])
    help_text = "".join(capsys.readouterr().out.split())  # argparse wraps lines, also inside flags
    opts = cli_options()
    assert len(opts) >= 40
    for name, _, opt in opts:
        flag = opt.flag or "--" + name.replace("_", "-")
        assert flag in help_text, flag
        assert "".join(opt.help.split()) in help_text, flag
    # no flag of a settings field is written in the serve command's source: they are generated
    # (other commands have options of the same name, e.g. the clients' --api-key)
    flags = {opt.flag or "--" + name.replace("_", "-") for name, _, opt in opts}
    init = (ROOT / "duplexkit" / "cli" / "__init__.py").read_text()
    serve_part = init.split('sub.add_parser("serve"', 1)[1].split("sub.add_parser(", 1)[0]
    for where, src in (("serve.py", (ROOT / "duplexkit" / "cli" / "serve.py").read_text()),
                       ("__init__.py (serve)", serve_part)):
        assert {f for f in flags if f'"{f}"' in src} == set(), where
    # parsed defaults make the field defaults
    from duplexkit.cli.serve import _settings_from_args

    args = cli.build_parser().parse_args(["serve", "scripted"])
    assert ServerSettings(**_settings_from_args(args)) == ServerSettings()


def test_settings_options_parse_into_the_settings(monkeypatch):
    monkeypatch.delenv("DUPLEXKIT_API_KEY", raising=False)
    from duplexkit import cli
    from duplexkit.cli.serve import _settings_from_args
    from duplexkit.settings import ServerSettings

    argv = ["serve", "scripted", "--api-key", "a", "--api-key", "b", "--max-sessions", "3", "--silence-slack-ms", "100",
            "--voice", "x=/tmp/a.wav", "--served-model-name", "m", "--no-session-resume", "--drain-s", "5m",
            "--record", "/tmp/rec", "--record-keep", "7d", "--tool-model", "http://h/v1", "--metrics", "off",
            "--max-ref-audio-s", "2.5", "--default-voice", "", "--telephony-webhook-timeout-s", "0.5"]
    s = ServerSettings(**_settings_from_args(cli.build_parser().parse_args(argv)))
    assert s.api_keys == ["a", "b"] and s.max_sessions == 3 and s.silence_slack_ms == 100
    assert s.voices == {"x": Path("/tmp/a.wav")} and s.model_id == "m" and s.session_resume is False
    assert s.drain_s == 300.0 and s.record_dir == Path("/tmp/rec") and s.record_keep == "7d"
    assert s.tool_model_url == "http://h/v1" and s.metrics == "off" and s.max_ref_audio_s == 2.5
    assert s.default_voice is None and s.telephony_webhook_timeout_s == 0.5


@pytest.mark.parametrize("argv, needle", [
    (["--max-sessions", "0"], "must be >= 1"),
    (["--silence-slack-ms", "3600001"], "must be 0..3600000"),
    (["--max-ref-audio-s", "0.4"], "must be >= 0.5"),
    (["--header-timeout-s", "0"], "must be > 0"),
    (["--metrics", "x"], "invalid choice"),
    (["--tool-model", "ftp://x"], "must be an http:// or https:// URL"),
    (["--record-keep", "zz"], "expected a recording retention"),
    (["--drain-s", "soon"], "expected seconds"),
])
def test_settings_bounds_are_checked_when_parsing(argv, needle, capsys):
    from duplexkit import cli

    with pytest.raises(SystemExit) as ei:
        cli.build_parser().parse_args(["serve", "scripted", *argv])
    assert ei.value.code == cli.EXIT_USAGE and needle in capsys.readouterr().err


def test_settings_fields_keep_their_defaults():
    """The option metadata changes no field: the dataclass still builds with keywords alone."""
    from duplexkit.settings import ServerSettings

    s = ServerSettings(max_sessions=2)
    assert dataclasses.replace(s, max_sessions=4).max_sessions == 4
    assert s.aliases == [] and s.voices == {} and s.max_event_bytes == 16 * 2**20 and s.record_policy == "all"


def test_settings_built_in_code_get_the_options_checks():
    """ServerSettings is a pydantic dataclass: field types are validated, and the bounds and choices an
    option declares hold for settings built in code, as on the command line."""
    import pydantic
    import pytest

    from duplexkit.settings import ServerSettings

    assert ServerSettings(max_sessions=3).max_sessions == 3
    for bad in ({"max_sessions": 0}, {"max_sessions": "many"}, {"openai_model_ids": "maybe"},
                {"record_max_mb": 0.0}):
        with pytest.raises(pydantic.ValidationError):
            ServerSettings(**bad)
