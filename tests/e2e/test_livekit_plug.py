"""``duplexkit.integrations.livekit.RealtimeModel`` inside a real LiveKit ``AgentSession``
(docs/integrations.md, "LiveKit Agents"), inline (``InlineDuplexClient`` over a ``ScriptedEngine``, no
server) and remote (``DuplexClient`` to ``serve scripted``).

LiveKit lives in its own venv (scripts/setup_frameworks.sh installs livekit-agents 1.8.9 and this
checkout of duplexkit there, editable, without torch), so the session runs in
tests/e2e/_livekit_plug_agent.py with that venv's python (``DUPLEXKIT_FRAMEWORKS_PYTHON``, default
``.venv-frameworks/bin/python``) and writes a JSON report checked here; skipped, with the reason,
where the venv or the plugin's imports are missing.

The report's session, on real speech (tests/fixtures/audio): the user asks ``question_16k.wav``;
duplexkit's server VAD ends the turn, the user transcript reaches LiveKit, the scripted decider calls
``get_weather`` (a ``@function_tool``) with ``{"city": "Paris"}``, LiveKit runs it and sends the output
back through ``update_chat_ctx``, and the answer (the scripted chat reply) plays as 24 kHz audio. Then
``generate_reply()`` starts an 8-unit answer and, 1 s into its playout, the user speaks
``interrupt_16k.wav`` over it: duplexkit's barge-in becomes LiveKit's ``input_speech_started``, LiveKit
clears its playout there and truncates the message, and duplexkit is told what was heard.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from _serverproc import REPO, ServerProc
from _timing import bound

jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.e2e

FIXTURES = REPO / "tests" / "fixtures" / "audio"
QUESTION = FIXTURES / "question_16k.wav"
INTERRUPT = FIXTURES / "interrupt_16k.wav"
INTERRUPT_ONSET_S = 0.30  # tests/fixtures/audio/README.md
SCRIPTED_ANSWER = "This is a scripted chat reply."  # ScriptConfig.chat_text: the decider's answer
SCRIPTED_ARGS = {"city": "Paris"}
UNITS_PER_TURN = 8  # the long reply: 8 s of audio unless interrupted


def _frameworks_python() -> str:
    py = os.environ.get("DUPLEXKIT_FRAMEWORKS_PYTHON") or str(REPO / ".venv-frameworks" / "bin" / "python")
    if not Path(py).is_file():
        pytest.skip(f"no frameworks venv at {py} (run scripts/setup_frameworks.sh or set DUPLEXKIT_FRAMEWORKS_PYTHON)")
    r = subprocess.run([py, "-c", "from duplexkit.integrations.livekit import RealtimeModel; "
                                  "from livekit.agents import AgentSession; RealtimeModel(engine=object())"],
                       capture_output=True, text=True, timeout=bound(120))
    if r.returncode != 0:
        pytest.skip(f"the LiveKit plugin does not import in {py}: {r.stderr.strip().splitlines()[-1:]}")
    return py


def _run(py: str, tmp_path: Path, *mode: str, server: ServerProc | None = None) -> dict:
    out = tmp_path / "report.json"
    cmd = [py, str(Path(__file__).with_name("_livekit_plug_agent.py")), *mode, "--wav", str(QUESTION),
           "--interrupt", str(INTERRUPT), "--units-per-turn", str(UNITS_PER_TURN), "--out", str(out),
           "--timeout", str(bound(60))]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=bound(300), cwd=str(REPO))
    assert r.returncode == 0, r.stderr[-6000:]
    rep = json.loads(out.read_text())
    assert not rep["failure"], (f"{rep['failure']}\n{json.dumps(rep, indent=1)[-5000:]}\n--- agent log\n"
                                f"{r.stderr[-4000:]}" + (f"\n--- server log\n{server.output()[-3000:]}" if server else ""))
    rep["stderr"] = r.stderr
    return rep


def _check(rep: dict) -> None:
    assert rep["errors"] == [], rep["errors"]
    # the user transcript of the question reached LiveKit (duplexkit's transcriber; the scripted
    # engine's ASR answers its chat text), final, and LiveKit added the user message with it
    finals = [t for t in rep["transcripts"] if t["is_final"]]
    assert finals and finals[0]["transcript"] == SCRIPTED_ANSWER, rep["transcripts"]
    assert rep["t_question"] < finals[0]["t"] < rep["t_question_end"] + bound(5)
    users = [i for i in rep["items"] if i["type"] == "message" and i["role"] == "user"]
    assert users and users[0]["content"] == [SCRIPTED_ANSWER]
    # the @function_tool ran once through LiveKit's function-call path, with schema-valid arguments
    assert [c["city"] for c in rep["calls"]] == ["Paris"]
    (executed,) = rep["tools_executed"]
    (call,) = executed["calls"]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == SCRIPTED_ARGS
    jsonschema.validate(json.loads(call["arguments"]), rep["parameters"])
    (output,) = executed["outputs"]
    assert output["call_id"] == call["call_id"] and not output["is_error"] and "Paris" in output["output"]
    # its result was used: it is in duplexkit's conversation, and the answer built from it came after
    hist_types = [h["type"] for h in rep["history"]]
    assert hist_types.index("function_call") < hist_types.index("function_call_output")
    answers = [i for i in rep["items"] if i["type"] == "message" and i["role"] == "assistant"
               and i["content"] == [SCRIPTED_ANSWER]]
    assert len(answers) == 1 and not answers[0]["interrupted"] and answers[0]["t"] > executed["t"]
    # ... spoken: a playout segment of 24 kHz audio, played to its end
    assert all(s["rates"] == [24000] for s in rep["segments"]), rep["segments"]
    answer_seg = rep["segments"][rep["long_reply_segment"] - 1]
    assert answer_seg["samples"] > 0 and not answer_seg["interrupted"]
    assert answer_seg["position_s"] == pytest.approx(answer_seg["pushed_s"], abs=0.01)
    # barge-in: duplexkit's VAD saw the interrupting speech, LiveKit stopped the long reply's playout
    # at once and before its end, and marked the message interrupted
    long_seg = rep["segments"][rep["long_reply_segment"]]
    onset = rep["t_barge_in"] + INTERRUPT_ONSET_S
    started = [t for t in rep["speech_started"] if t > rep["t_barge_in"]]
    assert started, rep["speech_started"]
    assert long_seg["t_cleared"] is not None, long_seg
    assert 0 <= long_seg["t_cleared"] - started[0] <= bound(0.3), (started, long_seg)
    assert long_seg["t_cleared"] - onset <= bound(1.5), (onset, long_seg)
    assert long_seg["position_s"] < UNITS_PER_TURN - 1, long_seg
    interrupted = [i for i in rep["items"] if i["type"] == "message" and i["role"] == "assistant" and i["interrupted"]]
    assert len(interrupted) == 1 and interrupted[0]["t"] >= started[0]
    # ... and duplexkit was told what was heard: a final ack at LiveKit's playout position
    (final,) = [a for a in rep["acks"] if a["truncate"]]
    assert final["played_ms"] == pytest.approx(long_seg["position_s"] * 1000, abs=5)
    assert final["response_id"] == rep["generations"][-1]["response_id"]
    assert rep["generations"][-1]["user_initiated"]


def test_livekit_plug_inline_scripted_engine(tmp_path):
    py = _frameworks_python()
    rep = _run(py, tmp_path, "--inline")
    assert "ScriptedEngine" in rep["stderr"]  # the example says what it runs on
    _check(rep)


def test_livekit_plug_remote_serve_scripted(tmp_path):
    py = _frameworks_python()
    with ServerProc("scripted", "--scripted", f"units_per_turn={UNITS_PER_TURN}",
                    "--scripted", f"tool_script=[[\"get_weather\", {json.dumps(SCRIPTED_ARGS)}]]") as server:
        rep = _run(py, tmp_path, "--url", server.url, server=server)
    _check(rep)


def test_livekit_agent_example_runs_without_a_livekit_server(tmp_path):
    """examples/livekit_agent.py: inline scripted engine, WAV in, WAV out; it says the engine is scripted."""
    py = _frameworks_python()
    out = tmp_path / "answer.wav"
    r = subprocess.run([py, str(REPO / "examples" / "livekit_agent.py"), "--output", str(out),
                        "--idle-s", "1.5", "--timeout", str(bound(60))],
                       capture_output=True, text=True, timeout=bound(180), cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "SCRIPTED engine" in r.stderr
    assert "[tool] get_weather(city='Paris')" in r.stdout
    assert f"[agent] {SCRIPTED_ANSWER}" in r.stdout
    import wave

    with wave.open(str(out), "rb") as w:
        assert w.getframerate() == 24000 and w.getnframes() > 24000


def test_livekit_agent_example_against_a_keyed_server(tmp_path):
    """examples/livekit_agent.py --url as documented: with the key it answers (the scripted server gets
    tool_choice required); without it, it says the session did not open and exits 1, promptly."""
    py = _frameworks_python()
    with ServerProc("scripted", "--api-key", "k1") as server:
        ex = [py, str(REPO / "examples" / "livekit_agent.py"), "--url", server.ws_url, "--idle-s", "1.5",
              "--output", str(tmp_path / "a.wav"), "--timeout", str(bound(30))]
        r = subprocess.run(ex + ["--api-key", "k1"], capture_output=True, text=True, timeout=bound(120),
                           cwd=str(tmp_path))
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert "[tool] get_weather(" in r.stdout and f"[agent] {SCRIPTED_ANSWER}" in r.stdout
        r = subprocess.run(ex, capture_output=True, text=True, timeout=bound(120), cwd=str(tmp_path),
                           env={**os.environ, "DUPLEXKIT_API_KEY": ""})
        assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
        assert "unauthorized" in r.stderr


def test_without_livekit_agents_the_module_imports_and_says_what_to_install():
    """In duplexkit's own venv (no livekit-agents) the module imports (tests/unit/test_errors.py walks
    every module) and making a model raises the typed OptionalDependencyError."""
    try:
        import livekit.agents  # noqa: F401
    except ModuleNotFoundError:
        pass
    else:
        pytest.skip("livekit-agents is installed in this venv")
    from duplexkit.errors import DuplexkitError, OptionalDependencyError
    from duplexkit.integrations import livekit as plug

    assert issubclass(plug.DuplexRealtimeError, DuplexkitError)
    with pytest.raises(OptionalDependencyError, match=r"duplexkit\[livekit\]"):
        plug.RealtimeModel(url="ws://127.0.0.1:1")


def test_livekit_agent_example_stops_on_ctrl_c(tmp_path):
    """Ctrl+C mid-conversation (once the tool was called): ``interrupted`` as the last line and status
    130, as the CLI and the other examples; no traceback, and no ``wrote`` line."""
    import signal

    from _liveproc import LiveProc, command_env

    py = _frameworks_python()
    run = LiveProc([py, str(REPO / "examples" / "livekit_agent.py"), "--output", str(tmp_path / "a.wav"),
                    "--timeout", str(bound(60))], command_env(), what="livekit_agent.py")
    try:
        run.wait_line("[tool] get_weather(")
        run.proc.send_signal(signal.SIGINT)
        rc = run.proc.wait(timeout=bound(30))
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()
    run.join_reader(10)
    text = run.text()
    assert rc == 130, text
    assert text.strip().splitlines()[-1] == "interrupted", text
    assert "Traceback" not in text and "wrote " not in text, text


def test_livekit_agent_example_without_a_server_is_one_line(tmp_path):
    import socket

    py = _frameworks_python()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens once closed
    r = subprocess.run([py, str(REPO / "examples" / "livekit_agent.py"), "--url", f"ws://127.0.0.1:{port}",
                        "--output", str(tmp_path / "a.wav")], capture_output=True, text=True, timeout=bound(120),
                       cwd=str(tmp_path))
    assert r.returncode == 3, r.stdout + r.stderr  # as the CLI and the other examples
    assert r.stderr.strip().splitlines() == [f"error: cannot connect to ws://127.0.0.1:{port}: no duplexkit "
                                             f"server answers at http://127.0.0.1:{port}/health"], r.stderr
