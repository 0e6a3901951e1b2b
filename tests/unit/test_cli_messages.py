"""What a new user sees from the ``duplexkit`` command on a mistake: usage errors point at the help of
the subcommand concerned, bare ``duplexkit`` is a usage error (docs/cli.md, "Exit status"), and
``mic`` without a usable device lists what PortAudio found and the fix that applies."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from duplexkit import cli

REPO = Path(__file__).resolve().parents[2]


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    """``python -m duplexkit ARGV`` as a real process (argparse only: nothing heavy is imported)."""
    env = {k: v for k, v in os.environ.items() if k != cli.DEBUG_ENV}
    return subprocess.run([sys.executable, "-m", "duplexkit", *argv], cwd=str(REPO), capture_output=True,
                          text=True, timeout=120, env=env)


@pytest.mark.parametrize("argv, prog", [
    (("serve", "scripted", "--no-such-option"), "duplexkit serve"),
    (("serve", "--no-such-option", "scripted"), "duplexkit serve"),
    (("demo", "--bogus"), "duplexkit demo"),
    (("demo", "tiny", "extra-positional"), "duplexkit demo"),
    (("mic", "-z"), "duplexkit mic"),
    (("chat", "--max_tokens", "3"), "duplexkit chat"),
    (("bench", "--x"), "duplexkit bench"),
    (("--bogus",), "duplexkit"),
])
def test_unknown_argument_points_at_the_subcommand_help(argv, prog, capsys):
    with pytest.raises(SystemExit) as ei:
        cli.main(list(argv))
    assert ei.value.code == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line
    assert err.startswith(f"error: {prog}: unrecognized arguments: "), err
    assert err.rstrip().endswith(f"(see {prog} --help)"), err


def test_unknown_option_as_a_real_process():
    r = run_cli("serve", "scripted", "--prot", "8001")
    assert r.returncode == cli.EXIT_USAGE == 2, r.stdout + r.stderr
    assert r.stderr == "error: duplexkit serve: unrecognized arguments: --prot 8001 (see duplexkit serve --help)\n"
    assert r.stdout == ""


def test_bare_duplexkit_is_a_usage_error_with_the_command_list():
    r = run_cli()
    assert r.returncode == cli.EXIT_USAGE, r.stdout + r.stderr
    assert r.stdout == ""  # the help goes to stderr on this error path
    lines = r.stderr.rstrip("\n").splitlines()
    assert lines[0].startswith("usage: duplexkit ")
    for name in ("serve", "demo", "mic", "chat", "bench"):
        assert any(line.strip().startswith(name + " ") for line in lines), (name, r.stderr)
    assert sum(line.startswith("error: ") for line in lines) == 1
    assert lines[-1] == ("error: duplexkit: a command is required: serve, demo, mic, chat, bench, replay, "
                         "plan-memory (see duplexkit COMMAND --help)")


def test_help_is_not_an_error():
    r = run_cli("--help")
    assert r.returncode == cli.EXIT_OK and r.stdout.startswith("usage: duplexkit ") and r.stderr == ""


def test_bare_duplexkit_is_documented():
    doc = (REPO / "docs" / "cli.md").read_text()
    assert "a command is required" in doc and "see duplexkit serve --help" in doc


# ------------------------------------------------------------------------------- mic devices

def _dev(index, name, n_in, n_out, d_in=False, d_out=False):
    return {"index": index, "name": name, "hostapi": "ALSA", "max_input_channels": n_in,
            "max_output_channels": n_out, "default_samplerate": 48000.0,
            "is_default_input": d_in, "is_default_output": d_out}


def _device_error(monkeypatch, devices, *argv) -> str:
    import duplexkit.audio

    from duplexkit.cli import mic

    monkeypatch.setattr(duplexkit.audio, "list_devices", lambda kind=None: list(devices))
    with pytest.raises(cli.CliError) as ei:
        mic._check_audio_devices(*argv)
    assert ei.value.exit_status == cli.EXIT_DEVICE == 5
    return str(ei.value)


def test_mic_no_device_at_all_says_so_without_pointing_at_a_list(monkeypatch):
    msg = _device_error(monkeypatch, [], None, None)
    lines = msg.splitlines()
    assert lines[0] == "no audio input device, no audio output device."
    assert lines[1] == "PortAudio sees no audio device at all."
    assert lines[2].startswith("Fix: ") and "PulseAudio" in lines[2] and "--url ws://" in lines[2]
    assert "list above" not in msg and "--input-device" not in msg  # nothing was listed to pick from
    assert len(lines) == 3


def test_mic_missing_device_lists_every_device_and_how_to_pick(monkeypatch):
    devices = [_dev(0, "HDA Intel: ALC892 Analog", 2, 0, d_in=True), _dev(3, "HDMI 0", 0, 8)]
    msg = _device_error(monkeypatch, devices, None, "usb headset")
    lines = msg.splitlines()
    assert lines[0] == "no output device matching --output-device 'usb headset'."
    assert lines[1] == "PortAudio sees 2 device(s):"
    assert lines[2] == "  [0] HDA Intel: ALC892 Analog (ALSA, 2 in / 0 out) (default input)"
    assert lines[3] == "  [3] HDMI 0 (ALSA, 0 in / 8 out)"
    assert lines[4].startswith("Fix: ") and "from the list above with --input-device / --output-device" in lines[4]


def test_mic_devices_without_defaults(monkeypatch):
    msg = _device_error(monkeypatch, [_dev(1, "Loopback", 2, 2)], None, None)
    assert msg.splitlines()[0] == "no default audio input device, no default audio output device."
    assert "[1] Loopback" in msg and "list above" in msg


def test_mic_with_usable_devices_passes(monkeypatch):
    import duplexkit.audio

    from duplexkit.cli import mic

    monkeypatch.setattr(duplexkit.audio, "list_devices",
                        lambda kind=None: [_dev(0, "Mic", 1, 0, d_in=True), _dev(1, "Speakers", 0, 2, d_out=True)])
    mic._check_audio_devices(None, None)
    mic._check_audio_devices("0", "speak")


def test_readme_explains_status_incomplete_with_the_real_cap():
    readme = (REPO / "README.md").read_text()
    demo = readme.index("bash scripts/demo.sh")
    note = readme[demo:readme.index("bash scripts/test.sh")]  # next to the demo command, before the tests
    assert "status=incomplete" in note and "status=completed" in note
    assert f"{cli.TINY_MAX_OUTPUT_TOKENS}-token cap" in note


def _cli_with_closed_stdout(*argv: str, unbuffered: bool) -> subprocess.CompletedProcess:
    """``python -m duplexkit ARGV`` whose stdout is a pipe already closed by its reader (``| head``)."""
    env = {k: v for k, v in os.environ.items() if k != cli.DEBUG_ENV}
    env["PYTHONUNBUFFERED"] = "1" if unbuffered else ""
    r, w = os.pipe()
    os.close(r)
    try:
        return subprocess.run([sys.executable, "-m", "duplexkit", *argv], cwd=str(REPO), stdout=w,
                              stderr=subprocess.PIPE, text=True, timeout=120, env=env)
    finally:
        os.close(w)


@pytest.mark.parametrize("unbuffered", [True, False])
def test_closed_stdout_ends_quietly_with_sigpipe_status(unbuffered):
    # `bench` with no name prints the benchmark list on stdout: the write (unbuffered) or the final
    # flush (buffered) meets EPIPE
    r = _cli_with_closed_stdout("bench", unbuffered=unbuffered)
    assert r.returncode == cli.EXIT_BROKEN_PIPE == 141, r.stderr
    assert r.stderr == "", r.stderr  # no `error: BrokenPipeError`, no `Exception ignored`


def test_broken_pipe_not_on_stdout_is_still_an_error(monkeypatch, capsys):
    def boom(args):
        raise BrokenPipeError(32, "Broken pipe")  # e.g. the socket to the server

    monkeypatch.setattr(cli, "cmd_bench", boom)
    assert cli.main(["bench"]) == cli.EXIT_CONNECTION  # a network failure, reported
    assert "error: " in capsys.readouterr().err


def test_client_api_key_defaults_to_env(monkeypatch):
    monkeypatch.setenv(cli.API_KEY_ENV, "sk-from-env")
    for argv in (["demo"], ["mic"], ["chat"]):
        assert cli.build_parser().parse_args(argv).api_key == "sk-from-env", argv
        assert cli.build_parser().parse_args([*argv, "--api-key", "k2"]).api_key == "k2", argv
    monkeypatch.setenv(cli.API_KEY_ENV, "")
    assert cli.build_parser().parse_args(["chat"]).api_key is None
    monkeypatch.delenv(cli.API_KEY_ENV)
    assert cli.build_parser().parse_args(["demo"]).api_key is None
    helps = cli.build_parser().commands
    for name in ("demo", "mic", "chat"):
        assert "$DUPLEXKIT_API_KEY" in helps[name].format_help(), name


def test_chat_input_is_an_alias_of_audio():
    p = cli.build_parser()
    assert p.parse_args(["chat", "--input", "q.wav"]).audio == "q.wav"
    assert p.parse_args(["chat", "-i", "q.wav"]).audio == "q.wav"
    assert p.parse_args(["chat", "--audio", "q.wav"]).audio == "q.wav"
    assert "--input" in p.commands["chat"].format_help()
