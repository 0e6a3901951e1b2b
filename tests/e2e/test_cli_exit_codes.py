"""The ``duplexkit`` exit-code table (docs/cli.md), each subcommand's path run as a real process:
pre-load checks before any heavy import or port bind, a port in use, an engine that fails to load,
``mic`` without a device, remote random-weights notices, the examples' error text."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
from _serverproc import REPO, ServerProc

from duplexkit import cli

pytestmark = pytest.mark.e2e

PY = sys.executable
# runs the CLI in-process and fails when torch or the server package was imported
LIGHT = ("import sys; from duplexkit import cli; rc = cli.main(sys.argv[1:]); "
         "heavy = [m for m in ('torch', 'duplexkit_server', 'stepaudio2') if m in sys.modules]; "
         "print('HEAVY', heavy) if heavy else None; sys.exit(rc)")


def run(*args: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    full = {**os.environ, **(env or {})}
    full.pop(cli.DEBUG_ENV, None)
    return subprocess.run([*args], cwd=str(REPO), capture_output=True, text=True, timeout=timeout, env=full)


def light(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return run(PY, "-c", LIGHT, *argv, env=env)


def one_error_line(r: subprocess.CompletedProcess) -> str:
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "HEAVY" not in r.stdout and "Traceback" not in r.stderr, r.stdout + r.stderr
    return lines[0]


def test_exit_code_table_is_documented():
    doc = (REPO / "docs" / "cli.md").read_text()
    for code, meaning in cli.EXIT_CODES.items():
        assert f"| {code} |" in doc, (code, meaning)


@pytest.fixture
def ckpts(tmp_path):
    """Broken checkpoint directories, each with one problem."""
    good_cfg = json.dumps({"model_type": "minicpmo", "version": "4.5"})
    d = {}
    d["missing"] = tmp_path / "missing"
    d["a_file"] = tmp_path / "README.md"
    d["a_file"].write_text("not a checkpoint")
    d["no_config"] = tmp_path / "no_config"
    d["no_config"].mkdir()
    d["bad_json"] = tmp_path / "bad_json"
    d["bad_json"].mkdir()
    (d["bad_json"] / "config.json").write_text("{not json")
    d["old_version"] = tmp_path / "old_version"
    d["old_version"].mkdir()
    (d["old_version"] / "config.json").write_text(json.dumps({"model_type": "minicpmo", "version": "2.6"}))
    d["no_weights"] = tmp_path / "no_weights"
    d["no_weights"].mkdir()
    (d["no_weights"] / "config.json").write_text(good_cfg)
    d["missing_shard"] = tmp_path / "missing_shard"
    d["missing_shard"].mkdir()
    (d["missing_shard"] / "config.json").write_text(good_cfg)
    (d["missing_shard"] / "model-00001-of-00002.safetensors").write_bytes(b"x")
    (d["missing_shard"] / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    return d


@pytest.mark.parametrize("cmd", [["serve"], ["demo"], ["mic"], ["chat", "-t", "hi"]])
@pytest.mark.parametrize("kind, needle", [
    ("missing", "checkpoint directory not found"),
    ("a_file", "expected a checkpoint directory, got a file"),
    ("no_config", "it has no config.json"),
    ("bad_json", "bad config.json"),
    ("old_version", "unsupported MiniCPM-o version '2.6'"),
    ("no_weights", "no model.safetensors"),
    ("missing_shard", "1 of 2 shard file(s) named in the index are missing"),
])
def test_bad_checkpoints_are_usage_errors_before_any_heavy_import(ckpts, cmd, kind, needle):
    argv = [cmd[0], str(ckpts[kind]), *cmd[1:]]
    if cmd[0] == "serve":
        argv += ["--port", "0"]
    r = light(*argv)
    assert r.returncode == cli.EXIT_USAGE, r.stdout + r.stderr
    assert needle in one_error_line(r)


@pytest.mark.parametrize("cmd", [["serve", "tiny", "--port", "0"], ["demo", "tiny"], ["chat", "tiny", "-t", "hi"],
                                 ["mic", "tiny"]])
def test_gpu_layout_without_a_visible_gpu_is_refused_at_once(cmd):
    r = light(*cmd, "--layout", "1gpu", env={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == cli.EXIT_USAGE, r.stdout + r.stderr
    line = one_error_line(r)
    assert "layout '1gpu' places stages on cuda:0 but this machine shows no CUDA device" in line
    assert "--layout cpu" in line


def test_serve_on_a_port_in_use_is_one_line_and_exit_3():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = light("serve", "tiny", "--port", str(port))
    assert r.returncode == cli.EXIT_CONNECTION, r.stdout + r.stderr
    line = one_error_line(r)  # no banner before it, no "model ready" after it
    assert line == (f"error: cannot listen on 127.0.0.1:{port}: the port is already in use "
                    "(another server? stop it or pass --port N)")
    assert r.stdout == ""


def test_serve_quantization_with_an_engine_plugin_is_a_usage_error():
    """``--quantization`` is refused for ``scripted`` (as ``--memory`` is), not silently ignored: one
    line, exit 2, before the port is bound or the server imported."""
    r = light("serve", "scripted", "--quantization", "int8", "--port", "0")
    assert r.returncode == cli.EXIT_USAGE, r.stdout + r.stderr
    assert one_error_line(r).startswith("error: --quantization quantizes a MiniCPM-o 4.5 model's weights")
    assert r.stdout == ""
    r = light("serve", "scripted", "--memory", "4", "--port", "0")
    assert r.returncode == cli.EXIT_USAGE, r.stdout + r.stderr
    assert one_error_line(r) == "error: --memory plans a MiniCPM-o 4.5 model (a checkpoint or 'tiny'), not the 'scripted' engine"


def test_serve_exits_4_when_the_engine_fails_to_load():
    r = run(PY, "-m", "duplexkit.cli", "serve", "scripted", "--port", "0", "--scripted", "no_such_option=1")
    assert r.returncode == cli.EXIT_LOAD, r.stdout + r.stderr
    assert "error: engine failed to load: unknown ScriptConfig field 'no_such_option'" in r.stderr
    assert "Traceback" not in r.stdout + r.stderr


def test_demo_input_that_is_a_directory_says_so(tmp_path):
    r = light("demo", "scripted", "--input", str(tmp_path))
    assert r.returncode == cli.EXIT_USAGE, r.stdout + r.stderr
    assert f"expected an audio file, got a directory: {tmp_path}" in one_error_line(r)


def test_demo_refuses_an_unwritable_output_before_loading():
    r = light("demo", "tiny", "--output", "/nonexistent-dir/answer.wav")
    assert r.returncode == cli.EXIT_USAGE, r.stdout + r.stderr
    assert "cannot write --output /nonexistent-dir/answer.wav" in one_error_line(r)


@pytest.mark.parametrize("cmd, option", [(["demo", "scripted"], "--output"), (["chat", "scripted", "-t", "hi"], "--output"),
                                         (["mic", "scripted"], "--save-output"), (["mic", "scripted"], "--summary")])
def test_an_output_that_is_a_directory_is_refused_before_running(tmp_path, cmd, option):
    r = light(*cmd, option, str(tmp_path), "--input-device", "no-such-microphone-xyz") if cmd[0] == "mic" \
        else light(*cmd, option, str(tmp_path))
    assert r.returncode == cli.EXIT_USAGE, r.stdout + r.stderr
    assert f"cannot write {option} {tmp_path}: it is a directory; pass a file path" in one_error_line(r)
    assert r.stdout == ""  # refused before the turn ran


@pytest.mark.parametrize("where", ["a_file", "under_a_file"])
def test_serve_refuses_a_record_path_that_is_not_a_directory(tmp_path, where):
    f = tmp_path / "passwd"
    f.write_text("root:x:0:0\n")
    path = f if where == "a_file" else f / "recordings"
    r = run(PY, "-c", LIGHT, "serve", "scripted", "--port", "0", "--record", str(path), timeout=60)
    assert r.returncode == cli.EXIT_USAGE, r.stdout + r.stderr
    line = one_error_line(r)  # no banner: refused before the port is bound
    assert line.startswith(f"error: cannot use --record {path}: ") and "pass a directory (created if missing)" in line


def test_serve_accepts_a_record_directory_that_does_not_exist_yet(tmp_path):
    from duplexkit.cli.common import check_output_dir

    check_output_dir(tmp_path / "new" / "recordings", "--record")  # created on first use
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("cmd", [["demo"], ["mic"], ["chat", "-t", "hi"]])
@pytest.mark.parametrize("extra, named", [(["scripted"], "MODEL 'scripted'"), (["/nonexistent"], "MODEL '/nonexistent'"),
                                          (["--layout", "cpu"], "--layout cpu")])
def test_a_model_named_with_url_is_a_usage_error(cmd, extra, named):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens: the refusal comes before any connection
    r = light(cmd[0], *extra, "--url", f"ws://127.0.0.1:{port}", *cmd[1:])
    assert r.returncode == cli.EXIT_USAGE, r.stdout + r.stderr
    assert one_error_line(r) == (f"error: duplexkit {cmd[0]}: {named} cannot be used with --url (the server's "
                                 "model answers); drop it, or drop --url to run the model in this process")


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_serve_stopped_while_the_model_loads_exits_0_at_once(sig):
    """Ctrl+C (or SIGTERM) while ``/health`` says ``loading`` is a clean stop (exit 0, one warning),
    not "engine failed to load" with exit 4, and does not wait for the load to finish."""
    import signal
    import time

    import httpx

    from _timing import bound

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != cli.DEBUG_ENV}
    proc = subprocess.Popen([PY, "-m", "duplexkit.cli", "serve", "tiny", "--port", str(port)], cwd=str(REPO),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + bound(120)
        status = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                status = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json().get("status")
            except httpx.HTTPError:
                status = None
            if status == "loading":
                break
            time.sleep(0.1)
        if status != "loading":
            pytest.skip(f"the tiny model loaded before the server could be interrupted (status {status})")
        proc.send_signal(getattr(signal, sig))
        out, err = proc.communicate(timeout=bound(30))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out + err
    assert "engine failed to load" not in err and "Traceback" not in err, err
    assert "engine loading interrupted" in err
    assert "model ready" not in err  # it did not wait for the load


def test_chat_exits_4_when_a_checkpoint_that_passes_the_checks_fails_to_load(tmp_path):
    # config.json and the weight file exist, so the pre-load checks pass; the loader then fails
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "minicpmo", "version": "4.5"}))
    (d / "model.safetensors").write_bytes(b"not a safetensors file")
    r = run(PY, "-m", "duplexkit.cli", "chat", str(d), "-t", "hi", "--layout", "cpu", timeout=300)
    assert r.returncode == cli.EXIT_LOAD, r.stdout + r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: engine failed to load: ")
    assert "Traceback" not in r.stderr


def test_mic_with_no_matching_device_explains_and_lists(tmp_path):
    r = light("mic", "scripted", "--input-device", "no-such-microphone-xyz")
    assert r.returncode == cli.EXIT_DEVICE, r.stdout + r.stderr
    assert "HEAVY" not in r.stdout and "Traceback" not in r.stderr
    err = r.stderr
    assert err.startswith("error: no input device matching --input-device 'no-such-microphone-xyz'")
    assert "PortAudio sees" in err and "Fix: on a headless machine" in err and "--url" in err
    assert "ready; speak" not in err and "Error querying device" not in err


def test_mic_with_no_device_at_all():
    # a headless machine (CI, containers): PortAudio lists nothing without an audio server
    env = {"PULSE_SERVER": "unix:/nonexistent"}
    probe = run(PY, "-c", "from duplexkit.audio import list_devices; print(len(list_devices()))", env=env)
    if probe.returncode != 0 or probe.stdout.strip() != "0":
        pytest.skip(f"this machine has audio devices ({probe.stdout.strip()} listed)")
    r = light("mic", env=env)
    assert r.returncode == cli.EXIT_DEVICE, r.stdout + r.stderr
    assert r.stderr.startswith("error: no audio input device, no audio output device.")
    assert "PortAudio sees no audio device at all." in r.stderr and "Fix:" in r.stderr
    assert "HEAVY" not in r.stdout and "ready; speak" not in r.stderr


def test_keyboard_interrupt_is_130(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_demo", interrupted)
    assert cli.main(["demo", "scripted"]) == cli.EXIT_INTERRUPTED == 130
    assert capsys.readouterr().err.strip() == "interrupted"


def test_unknown_benchmark_is_a_usage_error():
    r = light("bench", "no_such_benchmark")
    assert r.returncode == cli.EXIT_USAGE and "unknown benchmark 'no_such_benchmark'" in one_error_line(r)


def test_chat_help_has_a_description():
    r = run(PY, "-m", "duplexkit.cli", "chat", "--help")
    assert r.returncode == 0 and "Send one chat-completions request" in r.stdout


def test_chat_sends_max_tokens_only_when_given():
    p = cli.build_parser()
    assert "max_tokens" not in cli._chat_body(p.parse_args(["chat", "-t", "hi"]))
    assert cli._chat_body(p.parse_args(["chat", "-t", "hi", "--max-tokens", "5"]))["max_tokens"] == 5


def test_chat_without_max_tokens_keeps_the_server_cap():
    # the scripted chat reply has 6 words; a server capped at 3 tokens cuts it when the client sends none
    with ServerProc("scripted", "--max-output-tokens", "3") as srv:
        capped = run(PY, "-m", "duplexkit.cli", "chat", "--url", srv.url, "-t", "hi", "--no-audio")
        given = run(PY, "-m", "duplexkit.cli", "chat", "--url", srv.url, "-t", "hi", "--no-audio",
                    "--max-tokens", "64")
    assert capped.returncode == 0 and given.returncode == 0, capped.stderr + given.stderr
    assert capped.stdout.strip() and len(capped.stdout.split()) < len(given.stdout.split())
    assert "This is a scripted chat reply." in given.stdout


@pytest.fixture(scope="module")
def random_server():
    with ServerProc("scripted", "--scripted", "random_weights=true") as srv:
        yield srv


@pytest.mark.parametrize("argv", [
    ["-m", "duplexkit.cli", "demo", "--url", "{ws}", "-o", "{tmp}/d.wav"],
    ["-m", "duplexkit.cli", "chat", "--url", "{http}", "-t", "hi", "-o", "{tmp}/c.wav"],
    ["examples/realtime_wav_demo.py", "--url", "{ws}", "--output", "{tmp}/r.wav", "--no-realtime"],
    ["examples/chat_completions_client.py", "--url", "{http}", "--output", "{tmp}/e.wav"],
    ["examples/barge_in_client.py", "--url", "{ws}", "--out-dir", "{tmp}/b"],
    ["examples/openai_sdk_realtime.py", "--url", "{http}", "--model", "scripted", "--output", "{tmp}/s.wav"],
    ["bash", "examples/curl_chat.sh", "{http}", "hi", "{tmp}/curl.wav"],
])
def test_remote_clients_print_the_random_weights_notice(random_server, tmp_path, argv):
    if "openai_sdk_realtime.py" in argv[0]:
        pytest.importorskip("openai")
    if argv[0] == "bash" and shutil.which("curl") is None:
        pytest.skip("curl not installed")
    argv = [a.format(ws=random_server.ws_url, http=random_server.url, tmp=tmp_path) for a in argv]
    r = run(*argv) if argv[0] == "bash" else run(PY, *argv)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "RANDOM weights" in r.stderr


def test_remote_clients_stay_quiet_for_real_weights(scripted_server, tmp_path):
    r = run(PY, "-m", "duplexkit.cli", "demo", "--url", scripted_server.ws_url, "-o", str(tmp_path / "d.wav"))
    assert r.returncode == 0 and "RANDOM" not in r.stderr + r.stdout, r.stderr


def test_demo_timing_labels(scripted_server, tmp_path):
    remote = run(PY, "-m", "duplexkit.cli", "demo", "--url", scripted_server.ws_url, "-o", str(tmp_path / "d.wav"))
    inline = run(PY, "-m", "duplexkit.cli", "demo", "scripted", "-o", str(tmp_path / "i.wav"))
    for r in (remote, inline):
        assert r.returncode == 0, r.stderr
        assert "timings (wall clock on this machine):" in r.stdout
        assert "wall RTF (create -> done / audio)" in r.stdout and "RTF (compute" not in r.stdout
        assert "answer audio" in r.stdout
    assert "model load" not in remote.stdout and "load " not in remote.stdout  # nothing was loaded here
    assert "model load" in inline.stdout


def test_chat_example_prints_the_server_error(scripted_server, tmp_path):
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"RIFF\x00\x01garbage" * 20)
    r = run(PY, "examples/chat_completions_client.py", "--url", scripted_server.url, "--audio", str(bad))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "BytesIO" not in r.stderr
    assert r.stderr.startswith("error: HTTP 400: bad_audio: ") and "Format not recognised" in r.stderr, r.stderr


def test_cli_chat_prints_the_server_error(scripted_server, tmp_path):
    # the CLI checks a local WAV itself; a server-side refusal (an unknown model) arrives as its text
    r = run(PY, "-m", "duplexkit.cli", "chat", "--url", scripted_server.url, "-t", "hi", "--served-model", "nope")
    assert r.returncode == cli.EXIT_FAILURE, r.stdout + r.stderr
    assert one_error_line(r).startswith("error: the server answered HTTP 400: model_not_found")


def test_realtime_example_prints_the_server_error(scripted_server, tmp_path):
    # an input the server refuses (input under 100 ms -> input_audio_buffer_empty on commit)
    short = tmp_path / "short.wav"
    import numpy as np

    from duplexkit.audio import write_wav

    write_wav(short, np.zeros(800, np.float32), 16_000)
    r = run(PY, "examples/realtime_wav_demo.py", "--url", scripted_server.ws_url, "--input", str(short),
            "--output", str(tmp_path / "o.wav"), "--no-realtime")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: input_audio_buffer_empty: ")


def test_openai_sdk_example_prints_the_server_error(scripted_server, tmp_path):
    pytest.importorskip("openai")
    r = run(PY, "examples/openai_sdk_realtime.py", "--url", scripted_server.url, "--model", "nope",
            "--output", str(tmp_path / "s.wav"))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: model_not_found: model 'nope' is not served")


def test_openai_sdk_example_cannot_connect_is_one_line(tmp_path):
    pytest.importorskip("openai")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens once closed
    r = run(PY, "examples/openai_sdk_realtime.py", "--url", f"http://127.0.0.1:{port}", "--output", str(tmp_path / "s.wav"))
    assert r.returncode == cli.EXIT_CONNECTION, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(f"error: cannot connect to http://127.0.0.1:{port}")
