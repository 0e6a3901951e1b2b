"""``duplexkit.integrations.pipecat.DuplexkitLLMService`` in a real Pipecat pipeline, on real speech
(docs/integrations.md, "Pipecat").

Pipecat lives in its own venv (scripts/setup_frameworks.sh installs pipecat-ai 1.14.0 and this
checkout's duplexkit there, without torch), so each flow runs tests/e2e/_pipecat_plug_flows.py with
that venv's python (``DUPLEXKIT_FRAMEWORKS_PYTHON``, default ``.venv-frameworks/bin/python``; this
checkout first on ``PYTHONPATH``) and checks its JSON report; skipped, with the reason, where that
venv is missing. Each flow runs **inline** (the scripted engine in the Pipecat process) and
**remote** (``duplexkit serve scripted``, tests/e2e/_serverproc.py):

* tool: the user's question (question_16k.wav; at 48 kHz for the remote run, which the service
  resamples) ends a turn; the session's decider calls ``get_weather`` (scripted) and the handler
  registered with Pipecat's ``register_function`` runs with schema-valid arguments; its result is the
  call's ``function_call_output``, and the spoken answer follows it as 24 kHz ``TTSAudioRawFrame`` s
  with its transcript as ``TTSTextFrame`` s; the user's turn comes back as a ``TranscriptionFrame``.
* barge-in: the bot speaks first (``LLMRunFrame``: an 8 s answer) and the user talks over it
  (interrupt_16k.wav, in real time) after 2 s of it was played: the service broadcasts
  ``UserStartedSpeakingFrame`` and ``InterruptionFrame``, the output transport writes nothing of the
  answer after that, and the rest of the 8 s is never played.
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
ANSWER = "This is a scripted chat reply."  # ScriptConfig.chat_text: the decider's answer
ARGS = {"city": "Paris"}
TOOL_SCRIPT = json.dumps([["get_weather", ARGS]])
BYTES_PER_S = 24_000 * 2  # the bot's speech: 24 kHz pcm16 mono


def _python() -> str:
    py = os.environ.get("DUPLEXKIT_FRAMEWORKS_PYTHON") or str(REPO / ".venv-frameworks" / "bin" / "python")
    if not Path(py).is_file():
        pytest.skip(f"no frameworks venv at {py} (run scripts/setup_frameworks.sh or set DUPLEXKIT_FRAMEWORKS_PYTHON)")
    r = subprocess.run([py, "-c", "import pipecat.services.llm_service"], capture_output=True, text=True,
                       timeout=bound(120))
    if r.returncode != 0:
        pytest.skip(f"pipecat is not importable in {py}: {r.stderr.strip().splitlines()[-1:]}")
    return py


def _flow(tmp_path: Path, *args: str, server: ServerProc = None) -> dict:
    out = tmp_path / "report.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    cmd = [_python(), str(Path(__file__).with_name("_pipecat_plug_flows.py")), "--out", str(out),
           "--timeout", str(bound(60)), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=bound(240), cwd=str(REPO), env=env)
    assert r.returncode == 0, r.stderr[-6000:]
    rep = json.loads(out.read_text())
    server_log = server.output()[-3000:] if server is not None else ""
    assert not rep["timed_out"] and not rep["failure"], (
        f"{json.dumps({k: rep[k] for k in ('failure', 'events', 'down', 'up', 'responses')}, indent=1)[-6000:]}\n"
        f"--- pipeline log\n{r.stderr[-4000:]}\n--- server log\n{server_log}")
    return rep


def _check_tool_flow(rep: dict) -> None:
    # the handler registered with register_function ran once, with schema-valid arguments
    (call,) = rep["calls"]
    assert call["function_name"] == "get_weather" and call["arguments"] == ARGS
    jsonschema.validate(call["arguments"], rep["parameters"])
    # its result went back as the call's output (the client's record, the session's conversation)
    result = {"temperature_c": 21, "conditions": "sunny", "city": "Paris"}
    (rec,) = rep["tool_calls"]
    assert rec["call_id"] == call["tool_call_id"] and rec["status"] == "completed" and rec["sent"]
    assert json.loads(rec["output"]) == result
    (out,) = [i for i in rep["items"] if i["type"] == "function_call_output"]
    assert out["call_id"] == call["tool_call_id"] and json.loads(out["output"]) == result
    # Pipecat's own function-call frames flowed, with the result
    names = [e[2] for e in rep["down"]]
    assert "FunctionCallsStartedFrame" in names and "FunctionCallInProgressFrame" in names
    (res_frame,) = [e for e in rep["down"] if e[2] == "FunctionCallResultFrame"]
    assert res_frame[3] == call["tool_call_id"] and res_frame[4] == result
    # the answer came out as audio frames (24 kHz) with its transcript, after the output was added
    (answer,) = [r for r in rep["responses"].values() if r["text"].strip() == ANSWER]
    assert answer["audio_bytes"] >= BYTES_PER_S and answer["sample_rates"] == [24000] and answer["done"]
    assert answer["t_first"] > out["t"]
    # the user's turn: announced, and transcribed into a TranscriptionFrame (upstream, to the user aggregator)
    ups = [e[2] for e in rep["up"]]
    assert ups.index("UserStartedSpeakingFrame") < ups.index("UserStoppedSpeakingFrame") < ups.index("TranscriptionFrame")
    session_transcripts = [e[2] for e in rep["events"] if e[1] == "conversation.item.input_audio_transcription.completed"]
    assert session_transcripts and [t["text"] for t in rep["transcripts"] if t["dir"] == "up"] == session_transcripts
    assert all(t["text"].strip() for t in rep["transcripts"])
    # nothing failed, and Pipecat's context holds the call, its result and the spoken answer
    assert not [e for e in rep["up"] + rep["down"] if e[2] == "ErrorFrame"], rep["up"]
    assert "error" not in [e[1] for e in rep["events"]]
    ctx = rep["context"]
    assert [tc["id"] for m in ctx if m.get("tool_calls") for tc in m["tool_calls"]] == [call["tool_call_id"]]
    assert [json.loads(m["content"]) for m in ctx if m.get("role") == "tool"] == [result]
    assert {"role": "assistant", "content": ANSWER} in ctx
    assert {"role": "user", "content": session_transcripts[0]} in ctx


def _check_barge_in(rep: dict) -> None:
    (resp,) = rep["responses"].values()  # the bot's opening answer, interrupted
    down = rep["down"]
    names = [e[2] for e in down]
    i_user, i_int = names.index("UserStartedSpeakingFrame"), names.index("InterruptionFrame")
    assert i_user < i_int, down
    t_int = down[i_int][0]
    assert t_int > rep["marks"]["speech_start"]
    assert "InterruptionFrame" in [e[2] for e in rep["up"]]  # broadcast: upstream processors see it too
    # the response's frames were closed at the interruption; no audio frame of it came later
    assert names[i_int + 1:i_int + 3] == ["TTSStoppedFrame", "LLMFullResponseEndFrame"], down
    assert resp["t_last"] <= t_int
    # the transport wrote nothing of the bot's speech after the interruption (one 40 ms chunk may
    # have been in the sound card's hands), and far less than the 8 s answer
    tts_writes = [w for w in rep["speaker_writes"] if w[2] == "TTSAudioRawFrame"]
    assert tts_writes and max(w[0] for w in tts_writes) <= t_int + 0.1, (t_int, tts_writes[-3:])
    heard_s = rep["speaker_bytes"] / BYTES_PER_S
    assert 1.9 <= heard_s <= (t_int - tts_writes[0][0]) + 0.15, (heard_s, t_int, tts_writes[0])
    assert heard_s < 8 - 2 and resp["audio_bytes"] / BYTES_PER_S < 8 - 2
    # the session saw the same: the response was cancelled by the user's turn
    types = [e[1] for e in rep["events"]]
    assert types.index("input_audio_buffer.speech_started") < types.index("response.done")
    assert not [e for e in rep["up"] + down if e[2] == "ErrorFrame"], rep["up"]


def test_pipecat_plug_inline_tool_answer_and_transcript(tmp_path):
    rep = _flow(tmp_path, "--flow", "tool", "--engine", f"scripted:units_per_turn=3;tool_script={TOOL_SCRIPT}",
                "--wav", str(QUESTION), "--expect-answer", ANSWER)
    _check_tool_flow(rep)
    assert rep["input_rates"] == [16000]


def test_pipecat_plug_remote_tool_answer_and_transcript(tmp_path):
    with ServerProc("scripted", "--scripted", "units_per_turn=3", "--scripted", f"tool_script={TOOL_SCRIPT}") as srv:
        rep = _flow(tmp_path, "--flow", "tool", "--url", srv.url, "--wav", str(QUESTION), "--input-rate", "48000",
                    "--expect-answer", ANSWER, server=srv)
    _check_tool_flow(rep)
    assert rep["input_rates"] == [48000]


def test_pipecat_plug_inline_barge_in(tmp_path):
    rep = _flow(tmp_path, "--flow", "barge_in", "--engine", "scripted:units_per_turn=8", "--wav", str(INTERRUPT))
    _check_barge_in(rep)


def test_pipecat_plug_remote_barge_in(tmp_path):
    with ServerProc("scripted", "--scripted", "units_per_turn=8") as srv:
        rep = _flow(tmp_path, "--flow", "barge_in", "--url", srv.url, "--wav", str(INTERRUPT), server=srv)
    _check_barge_in(rep)


def test_pipecat_plug_inline_barge_in_cancels_a_running_tool(tmp_path):
    """The user talks again while the handler runs (stereo 16 kHz input, downmixed by the service):
    the call is cancelled in Pipecat (the handler gets CancelledError, FunctionCallCancelFrame) and
    in duplexkit (status cancelled, no function_call_output sent)."""
    rep = _flow(tmp_path, "--flow", "tool_cancel", "--engine", f"scripted:units_per_turn=3;tool_script={TOOL_SCRIPT}",
                "--wav", str(QUESTION), "--wav2", str(INTERRUPT), "--tool-delay-s", "30", "--input-channels", "2")
    (call,) = rep["calls"]
    assert call["arguments"] == ARGS and call["cancelled"]
    starts = [e[0] for e in rep["events"] if e[1] == "input_audio_buffer.speech_started"]
    assert len(starts) == 2 and starts[1] <= call["cancelled"] <= starts[1] + 0.5, (starts, call)
    (rec,) = rep["tool_calls"]
    assert rec["status"] == "cancelled" and not rec["sent"] and rec["output"] is None
    assert not [i for i in rep["items"] if i["type"] == "function_call_output"]
    assert [e[3] for e in rep["down"] if e[2] == "FunctionCallCancelFrame"] == [call["tool_call_id"]]
    assert not [e for e in rep["down"] if e[2] == "FunctionCallResultFrame"]
    assert not [e for e in rep["up"] + rep["down"] if e[2] == "ErrorFrame"], rep["up"]


_CONFIG_ERRORS = """
from duplexkit.errors import DuplexkitError
from duplexkit.integrations.pipecat import DuplexkitLLMService, PipecatPlugError
from duplexkit.testing import ScriptedEngine
cases = [dict(), dict(engine=ScriptedEngine(), url="ws://127.0.0.1:1"),
         dict(engine=ScriptedEngine(), tools=[{"type": "web_search"}]),
         dict(engine=ScriptedEngine(), tools=[{"type": "function", "name": "f", "parameters": {"type": 3}}])]
for kw in cases:
    try:
        DuplexkitLLMService(**kw)
    except PipecatPlugError as exc:
        assert isinstance(exc, DuplexkitError) and isinstance(exc, ValueError) and exc.code == "bad_config"
        print("refused:", exc)
    else:
        raise SystemExit(f"accepted {kw}")
svc = DuplexkitLLMService(engine=ScriptedEngine(), tools=[{"type": "function", "name": "f", "filler": ""}])
print("ok", [t.session_tool() for t in svc._tools])
"""


def test_pipecat_plug_refuses_bad_configuration():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    r = subprocess.run([_python(), "-c", _CONFIG_ERRORS], capture_output=True, text=True, timeout=bound(120),
                       cwd=str(REPO), env=env)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert r.stdout.count("refused:") == 4, r.stdout
    assert "ok [{'type': 'function', 'name': 'f', 'description': '', 'parameters': {'type': 'object', " \
           "'properties': {}}, 'filler': ''}]" in r.stdout, r.stdout


def test_pipecat_agent_example_runs_inline_scripted(tmp_path):
    """examples/pipecat_agent.py as documented: inline scripted engine, says so, runs the tool and
    writes the spoken filler and answer (1 s + 2 s of the scripted voice)."""
    out = tmp_path / "answer.wav"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    r = subprocess.run([_python(), str(REPO / "examples" / "pipecat_agent.py"), "--output", str(out),
                        "--listen-s", "4"], capture_output=True, text=True, timeout=bound(180), cwd=str(tmp_path),
                       env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    lines = r.stdout.splitlines()
    assert lines[0].startswith("NOTE: the SCRIPTED engine"), r.stdout
    assert "[tool] get_weather({'city': 'Paris'})" in lines and f"[bot] {ANSWER}" in lines, r.stdout
    import wave

    with wave.open(str(out), "rb") as w:
        assert w.getframerate() == 24_000 and abs(w.getnframes() / 24_000 - 3.0) < 0.05


def test_pipecat_agent_example_against_a_keyed_server(tmp_path):
    """examples/pipecat_agent.py --url as documented: with the key it answers (a scripted server gets
    tool_choice required); without it, it exits 1 and says no answer came."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    with ServerProc("scripted", "--api-key", "k1") as server:
        ex = [_python(), str(REPO / "examples" / "pipecat_agent.py"), "--url", server.ws_url,
              "--output", str(tmp_path / "a.wav"), "--listen-s", "4"]
        r = subprocess.run(ex + ["--api-key", "k1"], capture_output=True, text=True, timeout=bound(180),
                           cwd=str(tmp_path), env=env)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert f"[bot] {ANSWER}" in r.stdout.splitlines(), r.stdout
        r = subprocess.run(ex, capture_output=True, text=True, timeout=bound(180), cwd=str(tmp_path), env=env)
        assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
        assert "no answer came" in r.stderr


def test_pipecat_agent_example_stops_on_ctrl_c(tmp_path):
    """Ctrl+C mid-conversation (once the tool was called): the pipeline is cancelled, ``interrupted`` is
    the only line on stderr and the status 130, as the CLI and the other examples; no ``wrote`` line."""
    import signal

    from _liveproc import LiveProc, command_env

    env = command_env({"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))})
    run = LiveProc([_python(), str(REPO / "examples" / "pipecat_agent.py"), "--output", str(tmp_path / "a.wav"),
                    "--listen-s", "30"], env, what="pipecat_agent.py")
    try:
        run.wait_line("[tool] get_weather(")
        run.proc.send_signal(signal.SIGINT)
        rc = run.proc.wait(timeout=bound(30))
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()
    run.join_reader(10)
    lines = run.text().strip().splitlines()
    assert rc == 130, "\n".join(lines)
    assert lines[0].startswith("NOTE: the SCRIPTED engine") and lines[-1] == "interrupted", "\n".join(lines)
    # stdout and stderr together: the notice, what the conversation printed, then the one line
    assert all(ln.startswith(("NOTE:", "[tool]", "[user]", "[bot]", "[barge-in]")) for ln in lines[:-1]), \
        "\n".join(lines)


def test_pipecat_agent_example_without_a_server_is_one_line(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens once closed
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    r = subprocess.run([_python(), str(REPO / "examples" / "pipecat_agent.py"), "--url", f"ws://127.0.0.1:{port}",
                        "--output", str(tmp_path / "a.wav")], capture_output=True, text=True, timeout=bound(120),
                       cwd=str(tmp_path), env=env)
    assert r.returncode == 3, r.stdout + r.stderr  # as the CLI and the other examples
    assert r.stdout == "" and r.stderr.strip().splitlines() == [
        f"error: cannot connect to ws://127.0.0.1:{port}: no duplexkit server answers at "
        f"http://127.0.0.1:{port}/health"], r.stderr
