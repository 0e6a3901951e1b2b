"""The examples and the ``duplexkit`` CLI, run as real subprocesses against a real
``duplexkit serve scripted`` process (fast; the tiny-engine paths are covered by test_tiny_e2e)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from _serverproc import REPO, ServerProc
from _timing import bound

from duplexkit.audio import read_wav

pytestmark = pytest.mark.e2e

PY = sys.executable


def run(*args: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*args], cwd=str(REPO), capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_realtime_wav_demo_example(scripted_server, tmp_path):
    out = tmp_path / "answer.wav"
    r = run(PY, "examples/realtime_wav_demo.py", "--url", scripted_server.ws_url, "--output", str(out),
            "--no-realtime")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "status=completed" in r.stdout and "Hello there, this is a scripted" in r.stdout
    audio, rate = read_wav(out)
    assert rate == 24000 and len(audio) == 72000


def test_barge_in_example(scripted_server, tmp_path):
    r = run(PY, "examples/barge_in_client.py", "--url", scripted_server.ws_url, "--out-dir", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    first, second = summary["responses"]
    assert first["status"] == "cancelled" and second["status"] == "completed"
    assert second["epoch"] == first["epoch"] + 1
    assert summary["late_events_of_cancelled_response"] is False
    assert (tmp_path / "response_1_cancelled.wav").exists() and (tmp_path / "response_2_completed.wav").exists()
    assert len(read_wav(tmp_path / "response_2_completed.wav")[0]) == 72000


def test_barge_in_example_accepts_an_incomplete_second_answer(tmp_path):
    """Like `serve tiny`: turns never end (units_per_turn=null), so the token cap ends the second
    answer `incomplete`; the example still succeeds and names the file by that status."""
    from _serverproc import ServerProc

    with ServerProc("scripted", "--answer-policy", "on_request", "--scripted", "units_per_turn=null",
                    "--max-output-tokens", "8") as srv:
        r = run(PY, "examples/barge_in_client.py", "--url", srv.ws_url, "--out-dir", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    first, second = summary["responses"]
    assert first["status"] == "cancelled" and second["status"] == "incomplete"
    assert second["status_details"]["reason"] == "max_output_tokens" and summary["ok"] is True
    assert (tmp_path / "response_2_incomplete.wav").exists() and not (tmp_path / "response_2_completed.wav").exists()
    assert len(read_wav(tmp_path / "response_2_incomplete.wav")[0]) == second["audio_ms"] * 24
    assert "ended incomplete (max_output_tokens)" in r.stdout and "random weights never" in r.stdout


@pytest.mark.parametrize("stream", [False, True])
def test_chat_completions_example(scripted_server, tmp_path, stream):
    out = tmp_path / "chat.wav"
    r = run(PY, "examples/chat_completions_client.py", "--url", scripted_server.url, "--output", str(out),
            *(["--stream"] if stream else []))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "This is a scripted chat reply." in r.stdout
    assert len(read_wav(out)[0]) == 6 * 9600  # 0.4 s of tone per word


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl not installed")
def test_curl_example(scripted_server, tmp_path):
    out = tmp_path / "curl.wav"
    r = run("bash", "examples/curl_chat.sh", scripted_server.url, "hello", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert '"status":"ok"' in r.stdout and "text: This is a scripted chat reply." in r.stdout
    assert "data: [DONE]" in r.stdout
    stream = r.stdout.split("== chat (stream, text only)", 1)[1]
    assert '"content":' in stream and '"audio"' not in stream, stream[:2000]  # text only: no base64 audio
    assert read_wav(out)[1] == 24000


def test_openai_sdk_example(scripted_server, tmp_path):
    pytest.importorskip("openai")
    out = tmp_path / "sdk.wav"
    r = run(PY, "examples/openai_sdk_realtime.py", "--url", scripted_server.url, "--model", "scripted",
            "--output", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert ": completed" in r.stdout
    assert len(read_wav(out)[0]) == 72000


def test_openai_sdk_tools_example(scripted_server, tmp_path):
    # the tool loop of docs/tools.md with the unmodified OpenAI SDK: the call, the local function's
    # output, the spoken answer (the scripted decider's answer text), written as a 24 kHz WAV
    pytest.importorskip("openai")
    out = tmp_path / "tool_answer.wav"
    r = run(PY, "examples/openai_sdk_tools.py", "--url", scripted_server.url, "--model", "scripted",
            "--output", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "get_weather(" in r.stdout and "(tool)" in r.stdout and "completed (client)" in r.stdout
    pcm, rate = read_wav(out)
    assert rate == 24000 and len(pcm) >= 24000 and float(abs(pcm).max()) > 0.01


def test_twilio_fake_call_example(scripted_server, tmp_path):
    # a simulated phone call through /v1/telephony/twilio: the reply is heard and timed, and the same
    # audio over the realtime WebSocket is timed in the same run (docs/telephony.md)
    out = tmp_path / "call.wav"
    r = run(PY, "examples/twilio/fake_call.py", "--url", scripted_server.ws_url, "--compare-realtime",
            "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    pcm, rate = read_wav(out)
    assert rate == 8000 and float(abs(pcm).max()) > 0.01


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once closed


def test_voice_notes_agent_cannot_connect_is_one_line():
    port = _free_port()
    r = run(PY, "examples/voice_notes_agent.py", "--url", f"ws://127.0.0.1:{port}")
    assert r.returncode == 3, r.stdout + r.stderr  # as the other examples and the CLI (EXIT_CONNECTION)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: connection_failed: cannot connect to ws://127.0.0.1:{port}"), \
        r.stderr


@pytest.mark.parametrize("argv", [
    ["examples/webrtc_client.py", "--url", "http://127.0.0.1:{port}"],
    ["examples/twilio/fake_call.py", "--url", "ws://127.0.0.1:{port}"],
])
def test_call_examples_cannot_connect_is_one_line(argv):
    if "webrtc" in argv[0]:
        pytest.importorskip("aiortc")
    port = _free_port()
    r = run(PY, *[a.format(port=port) for a in argv])
    assert r.returncode == 3, r.stdout + r.stderr  # as the other examples and the CLI (EXIT_CONNECTION)
    assert r.stdout == "", r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot connect to {argv[2].format(port=port)}: "), \
        r.stderr


def test_fake_call_refused_token_is_one_line():
    with ServerProc("scripted", "--api-key", "k1") as srv:
        r = run(PY, "examples/twilio/fake_call.py", "--url", srv.ws_url, "--token", "wrong")
    assert r.returncode == 3, r.stdout + r.stderr
    assert r.stderr.strip() == "error: the server refused the connection: HTTP 403 (a wrong or missing --token?)", \
        r.stderr


def _health(srv) -> dict:
    import httpx

    return httpx.get(srv.url + "/health", timeout=bound(10)).json()


@pytest.mark.parametrize("example", ["webrtc_client.py", "twilio/fake_call.py"])
def test_call_examples_stop_mid_call_on_ctrl_c(scripted_server, tmp_path, example):
    """Ctrl+C once the server holds the example's call (a WebRTC call, a simulated phone call):
    ``interrupted`` and status 130, no traceback, and the call is hung up (its session slot frees)."""
    import signal
    import time

    if example == "webrtc_client.py":
        pytest.importorskip("aiortc")
    url = scripted_server.url if example == "webrtc_client.py" else scripted_server.ws_url
    opened = _health(scripted_server)["sessions_opened"]
    proc = subprocess.Popen([PY, f"examples/{example}", "--url", url, "--out", str(tmp_path / "a.wav")],
                            cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + bound(60)
        while not ((h := _health(scripted_server))["sessions_opened"] > opened and h["sessions_active"] >= 1):
            assert proc.poll() is None and time.monotonic() < deadline, f"no call seen: {h}"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=bound(30))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, out + err
    assert err.strip() == "interrupted", err
    deadline = time.monotonic() + bound(30)
    while _health(scripted_server)["sessions_active"]:
        assert time.monotonic() < deadline, "the call was not hung up"
        time.sleep(0.05)


@pytest.mark.parametrize("argv", [
    ["examples/webrtc_client.py", "--url", "http://{addr}", "--out", "{tmp}/w.wav"],
    ["examples/twilio/fake_call.py", "--url", "ws://{addr}", "--out", "{tmp}/f.wav"],
    ["examples/realtime_wav_demo.py", "--url", "ws://{addr}", "--output", "{tmp}/r.wav"],
    ["examples/voice_notes_agent.py", "--url", "ws://{addr}", "--notes", "{tmp}/n.json"],
    ["examples/openai_sdk_tools.py", "--url", "http://{addr}", "--output", "{tmp}/t.wav"],
    ["examples/openai_sdk_realtime.py", "--url", "http://{addr}", "--output", "{tmp}/s.wav"],
    ["examples/barge_in_client.py", "--url", "ws://{addr}", "--out-dir", "{tmp}/b"],
    ["examples/chat_completions_client.py", "--url", "http://{addr}", "--output", "{tmp}/c.wav"],
])
def test_examples_stop_on_ctrl_c_with_one_line_and_130(tmp_path, argv):
    """Ctrl+C while the example waits on a server that never answers (a socket that accepts and stays
    silent): ``interrupted`` and status 130, as the CLI, not a KeyboardInterrupt traceback."""
    import signal
    import socket

    if "openai_sdk" in argv[0]:
        pytest.importorskip("openai")
    if "webrtc" in argv[0]:
        pytest.importorskip("aiortc")
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        silent.settimeout(120)
        addr = "127.0.0.1:%d" % silent.getsockname()[1]
        argv = [a.format(addr=addr, tmp=tmp_path) for a in argv]
        proc = subprocess.Popen([PY, *argv], cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            conn, _ = silent.accept()  # the example is past its imports, inside its main
            with conn:
                proc.send_signal(signal.SIGINT)
                out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 130, out + err
    assert err.strip() == "interrupted", err


def test_gradio_example_without_a_server_is_one_line():
    pytest.importorskip("gradio")
    port = _free_port()
    r = run(PY, "examples/gradio_demo.py", "--url", f"ws://127.0.0.1:{port}", "--port", str(_free_port()))
    assert r.returncode == 3, r.stdout + r.stderr  # said at start, not at the first question
    assert r.stderr.strip().splitlines() == [f"error: cannot connect to ws://127.0.0.1:{port}: no duplexkit "
                                             f"server answers at http://127.0.0.1:{port}/health"], r.stderr


def test_gradio_example_stops_on_ctrl_c(scripted_server):
    """Ctrl+C while the UI serves: ``interrupted`` and 130, as the other examples (not Gradio's own
    "Keyboard interruption ..." line and status 0)."""
    import signal

    pytest.importorskip("gradio")
    proc = subprocess.Popen([PY, "examples/gradio_demo.py", "--url", scripted_server.ws_url, "--port",
                             str(_free_port())], cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1", "GRADIO_ANALYTICS_ENABLED": "False"})
    try:
        first = proc.stdout.readline()  # "* Running on local URL: ..." once the UI serves
        assert "Running on" in first, first + proc.stderr.read()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=bound(30))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, out + err
    assert err.strip() == "interrupted" and "Keyboard interruption" not in out, out + err


def test_gradio_example_is_import_guarded():
    r = run(PY, "-c", "import sys; sys.path.insert(0, 'examples'); import gradio_demo; print('ok')")
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


@pytest.mark.parametrize("cmd", [[], ["serve"], ["demo"], ["mic"], ["chat"], ["bench"]])
def test_cli_help(cmd):
    r = run(PY, "-m", "duplexkit.cli", *cmd, "--help", timeout=60)
    assert r.returncode == 0, r.stderr
    assert "usage: duplexkit" in r.stdout


def test_cli_import_is_light():
    r = run(PY, "-c", "import sys, duplexkit.cli as c; c.build_parser(); "
                      "assert 'torch' not in sys.modules and 'duplexkit_server' not in sys.modules")
    assert r.returncode == 0, r.stderr


def test_cli_demo_scripted(tmp_path):
    out = tmp_path / "demo.wav"
    r = run(PY, "-m", "duplexkit.cli", "demo", "scripted", "--output", str(out), "--answer-policy", "on_request")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "status=completed" in r.stdout and "timings (wall clock" in r.stdout and "TTFP" in r.stdout
    assert len(read_wav(out)[0]) == 72000
    serve, page, mic = _what_next(r.stdout)
    cmd = mic.split()[0]  # the duplexkit command as the user can type it here
    assert shutil.which(cmd) or (REPO / cmd).is_file(), cmd
    assert serve == f"{cmd} serve scripted"
    assert page.startswith("http://127.0.0.1:8000/ ")
    assert mic == f"{cmd} mic --url 'ws://127.0.0.1:8000/v1/realtime?duplex=1'"


def _what_next(stdout: str) -> list[str]:
    """The values of the demo's last lines: serve it, open the page, talk from a terminal."""
    lines = stdout.strip().splitlines()
    assert lines[-4] == "what next:", lines[-6:]
    labels = ("serve it:", "open the page:", "talk from a terminal:")
    assert [ln.split(":")[0].strip() + ":" for ln in lines[-3:]] == list(labels), lines[-3:]
    return [ln.strip()[len(lab):].strip() for ln, lab in zip(lines[-3:], labels)]


def test_cli_demo_against_server(scripted_server, tmp_path):
    out = tmp_path / "demo.wav"
    r = run(PY, "-m", "duplexkit.cli", "demo", "--url", scripted_server.ws_url, "--output", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "status=completed" in r.stdout
    serve, page, mic = _what_next(r.stdout)  # the running server's address, not the default port
    assert serve == f"already running at {scripted_server.url}"
    assert page.startswith(scripted_server.url + "/ ")
    assert mic.endswith(f" mic --url '{scripted_server.ws_url}/v1/realtime?duplex=1'")


@pytest.mark.parametrize("keep_samples", [32_000, 50_000])  # ends mid-speech / holds an inner pause
def test_cli_demo_with_a_trimmed_recording_against_server(scripted_server, tmp_path, keep_samples):
    """A user's own tightly trimmed WAV: speech runs to the end of the file (the VAD is still in the
    turn when the demo commits) or pauses inside it (the VAD would commit part of it first). Both
    used to fail: a 10-minute wait for `committed`, or "input too short"."""
    from duplexkit.audio import write_wav

    audio, _ = read_wav(REPO / "tests/fixtures/audio/question_16k.wav", 16_000)
    clip = tmp_path / "mine.wav"
    write_wav(clip, audio[:keep_samples], 16_000)
    r = run(PY, "-m", "duplexkit.cli", "demo", "--url", scripted_server.ws_url, "--input", str(clip),
            "--timeout", "30")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "status=completed" in r.stdout


def test_a_commit_while_the_user_still_speaks_is_answered(scripted_server):
    """The client library, server VAD on: a commit sent while the VAD is inside the user's turn gets
    its `committed` (the server keeps the turn's item id, which speech_started announced)."""
    import asyncio

    from duplexkit.clients import DuplexClient

    audio, _ = read_wav(REPO / "tests/fixtures/audio/question_16k.wav", 16_000)

    async def main():
        # the server handles events in order: its VAD has announced the turn (speech_started) before
        # the commit arrives, and the speech runs on to the end of what was sent
        async with DuplexClient(scripted_server.ws_url, request_timeout_s=30) as c:
            for i in range(0, 32_000, 1600):
                await c.send_audio(audio[i:i + 1600], rate=16_000)
            return await c.commit()

    ev = asyncio.run(main())
    assert ev.type == "input_audio_buffer.committed" and ev.item_id


@pytest.mark.parametrize("stream", [False, True])
def test_cli_chat_against_server(scripted_server, tmp_path, stream):
    out = tmp_path / "c.wav"
    r = run(PY, "-m", "duplexkit.cli", "chat", "--url", scripted_server.url, "--text", "hi", "--output", str(out),
            *(["--stream"] if stream else []))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "This is a scripted chat reply." in r.stdout
    assert read_wav(out)[1] == 24000


def test_cli_chat_inline_scripted(tmp_path):
    out = tmp_path / "c.wav"
    r = run(PY, "-m", "duplexkit.cli", "chat", "scripted", "--text", "hi", "--output", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "This is a scripted chat reply." in r.stdout


def test_cli_serve_rejects_a_missing_checkpoint(tmp_path):
    r = run(PY, "-m", "duplexkit.cli", "serve", str(tmp_path / "nope"), "--port", "0", timeout=60)
    assert r.returncode == 2 and "checkpoint directory not found" in r.stderr


def test_cli_serve_exits_when_the_engine_fails_to_load():
    # a scripted option that does not exist: loading fails inside the server, which stops with 4
    r = run(PY, "-m", "duplexkit.cli", "serve", "scripted", "--port", "0", "--scripted", "no_such_option=1")
    assert r.returncode == 4, r.stdout + r.stderr
    assert "error: engine failed to load: unknown ScriptConfig field 'no_such_option'" in r.stderr
    assert "Traceback" not in r.stdout + r.stderr


def test_gradio_example_caps_a_random_weight_engine_in_process():
    # the tiny cap (as `serve tiny` applies) ends a random-weight answer; a real engine is not capped
    r = run(PY, "-c", "import sys, asyncio; sys.path.insert(0, 'examples'); import gradio_demo\n"
                      "from duplexkit.testing import ScriptedEngine\n"
                      "for rw in (True, False):\n"
                      "    e = ScriptedEngine(random_weights=rw, units_per_turn=4, tokens_per_unit=20)\n"
                      "    print(asyncio.run(gradio_demo.answer('duplexkit/assets/question_16k.wav', None, e))[0].split()[0])")
    assert r.returncode == 0, r.stderr
    # 40 tokens at 20 per unit: the capped answer ends after 2 of its 4 units
    assert r.stdout.split() == ["[incomplete]", "[completed]"], r.stdout
