"""The CLI's option validation (the wire's limits) and its one-line error reports, in-process."""

from __future__ import annotations

import wave
from pathlib import Path

import pytest

from duplexkit import cli
from duplexkit.clients import DuplexClient, DuplexError, InlineDuplexClient
from duplexkit.testing import ScriptedEngine


def parse(*argv: str):
    return cli.build_parser().parse_args(list(argv))


@pytest.mark.parametrize("argv", [
    ("demo", "--max-output-tokens", "0"),
    ("demo", "--max-output-tokens", "8193"),
    ("demo", "--max-output-tokens", "lots"),
    ("demo", "--pace", "-0.5"),
    ("demo", "--pace", "nan"),
    ("demo", "--timeout", "0"),
    ("serve", "scripted", "--max-sessions", "0"),
    ("serve", "scripted", "--port", "-1"),
    ("serve", "scripted", "--port", "65536"),
    ("serve", "scripted", "--default-input-rate", "4000"),
    ("chat", "--max-tokens", "0"),
])
def test_out_of_range_options_are_argparse_errors(argv, capsys):
    with pytest.raises(SystemExit) as ei:
        parse(*argv)
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: duplexkit ") and "argument " + argv[-2] in err and "Traceback" not in err
    assert err.count("\n") == 1  # one line, no usage block


def test_valid_option_values_parse():
    a = parse("demo", "--max-output-tokens", "inf", "--pace", "0")
    assert a.max_output_tokens == "inf" and a.pace == 0.0
    assert parse("demo", "--max-output-tokens", "8192").max_output_tokens == 8192
    a = parse("serve", "scripted", "--max-sessions", "1", "--port", "0")
    assert a.max_sessions == 1 and a.port == 0
    assert parse("serve", "scripted", "--port", "65535").port == 65535


def _wav(path: Path, seconds: float) -> Path:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16_000)
        w.writeframes(b"\x10\x00" * int(16_000 * seconds))
    return path


def _file(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("make, needle", [
    (lambda d: _file(d / "empty.wav", b""), "bad audio"),
    (lambda d: _file(d / "bad.wav", b"RIFF\x00\x01garbage" * 20), "bad audio"),
    (lambda d: _wav(d / "short.wav", 0.05), "input too short: need at least 100 ms of audio"),
    (lambda d: d / "missing.wav", "not found"),
])
def test_demo_bad_input_is_one_error_line_with_status_2(tmp_path, capsys, make, needle, monkeypatch):
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
    path = make(tmp_path)
    rc = cli.main(["demo", "scripted", "-i", str(path), "-o", str(tmp_path / "out.wav")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == cli.EXIT_BAD_INPUT
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err
    assert not (tmp_path / "out.wav").exists()


def test_debug_env_shows_the_traceback(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(cli.DEBUG_ENV, "1")
    (tmp_path / "empty.wav").write_bytes(b"")
    rc = cli.main(["demo", "scripted", "-i", str(tmp_path / "empty.wav")])
    err = capsys.readouterr().err
    assert rc == cli.EXIT_BAD_INPUT
    assert "Traceback (most recent call last)" in err and err.strip().splitlines()[-1].startswith("error: bad audio")


@pytest.mark.parametrize("argv, code, needle", [
    (["serve", "tiny", "--layout", "7gpu"], cli.EXIT_BAD_INPUT, "bad layout: unknown layout '7gpu'"),
    (["serve", "{empty}"], cli.EXIT_BAD_INPUT, "not a MiniCPM-o 4.5 checkpoint directory"),
    (["serve", "{missing}"], cli.EXIT_BAD_INPUT, "checkpoint directory not found"),
    (["chat", "tiny", "--layout", "7gpu", "-t", "hi"], cli.EXIT_BAD_INPUT, "bad layout"),
])
def test_serve_and_chat_checks_fail_before_loading(tmp_path, capsys, argv, code, needle, monkeypatch):
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
    (tmp_path / "empty").mkdir()
    argv = [a.format(empty=tmp_path / "empty", missing=tmp_path / "missing") for a in argv]
    assert cli.main(argv) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err


async def test_error_lines_for_real_client_errors():
    # input_audio_buffer_empty from a real Session: "input too short"
    async with InlineDuplexClient(ScriptedEngine()) as c:
        with pytest.raises(DuplexError) as ei:
            await c.commit()
    assert cli._error_line(ei.value) == ("input too short: need at least 100 ms of audio", cli.EXIT_BAD_INPUT)
    # a refused connection: status 3, no traceback
    c = DuplexClient("ws://127.0.0.1:1", open_timeout_s=2)
    with pytest.raises(DuplexError) as ei:
        await c.connect()
    msg, code = cli._error_line(ei.value)
    assert code == cli.EXIT_CONNECTION and "cannot connect" in msg
    # a rejected initial update: status 1 with the code
    with pytest.raises(DuplexError) as ei:
        async with InlineDuplexClient(ScriptedEngine(), session={"temperature": 9}):
            pass
    msg, code = cli._error_line(ei.value)
    assert code == cli.EXIT_FAILURE and "bad_event" in msg


def test_chat_connection_refused_is_one_line(capsys, monkeypatch):
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
    rc = cli.main(["chat", "--url", "http://127.0.0.1:1", "-t", "hi", "--timeout", "5"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == cli.EXIT_CONNECTION
    assert len(err) == 1 and err[0].startswith("error: cannot connect to http://127.0.0.1:1/v1/chat/completions")
    assert "; is a server running there? start one with: " in err[0]  # the duplexkit command as typed
    assert err[0].endswith("duplexkit serve tiny (or check --url)"), err


def test_demo_refused_url_is_one_line(capsys, monkeypatch):
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
    rc = cli.main(["demo", "--url", "ws://127.0.0.1:1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == cli.EXIT_CONNECTION and len(err) == 1 and err[0].startswith("error: cannot connect"), err
    assert "; is a server running there? start one with: " in err[0]  # the duplexkit command as typed
    assert err[0].endswith("duplexkit serve tiny (or check --url)"), err


def test_chat_unauthorized_hints_the_api_key_as_demo_does():
    from duplexkit.cli.chat import _http_error

    e = _http_error(401, '{"error": {"code": "unauthorized", "message": "missing or invalid API key"}}')
    assert e.exit_status == cli.EXIT_CONNECTION
    assert str(e) == ("the server refused the API key (pass --api-key KEY) "
                      "(HTTP 401: unauthorized: missing or invalid API key)")



# ---------------------------------------------------------------------------- mic --echo


def test_mic_echo_flag_parses_with_auto_default():
    p = cli.build_parser()
    assert p.parse_args(["mic"]).echo == "auto"
    for choice in ("off", "gate", "aec", "auto"):
        assert p.parse_args(["mic", "--echo", choice]).echo == choice
    with pytest.raises(SystemExit):
        p.parse_args(["mic", "--echo", "loud"])


def test_mic_echo_choice_resolves_to_a_client_option(monkeypatch):
    from duplexkit.audio import echo as echo_mod

    assert cli._echo_config("off") is None  # no echo= kwarg is passed to the client
    assert cli._echo_config("gate").mode == "gate"
    monkeypatch.setattr(echo_mod, "aec_available", lambda: False)
    assert cli._echo_config("auto").mode == "gate"
    with pytest.raises(cli.CliError, match=r"duplexkit\[echo\]"):
        cli._echo_config("aec")
    monkeypatch.setattr(echo_mod, "aec_available", lambda: True)
    assert cli._echo_config("auto").mode == "aec"
    assert cli._echo_config("aec").mode == "aec"
