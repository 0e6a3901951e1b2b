"""Voice notes agent: a full-duplex voice agent that acts, with two real tools over a local JSON file.

    python examples/voice_notes_agent.py                              # the tiny model in-process
    python examples/voice_notes_agent.py --url ws://127.0.0.1:8000    # any duplexkit server
    python examples/voice_notes_agent.py --inline /models/MiniCPM-o-4_5 --input my_question.wav

The agent has two tools, plain Python functions made tools with ``@tool``:

* ``add_note(text, tags)`` appends a note to ``--notes`` (a JSON file, written atomically);
* ``list_notes(query)`` returns the notes whose text or tags contain ``query``.

It streams a speech WAV into the session, commits the turn and prints what happens: the user's
transcript (the session's own speech recognition), each tool call the session issues with its
arguments, each result the client sends back, and the transcript of every spoken response (the
filler while the tool runs, then the answer). The client runs the tools itself
(``InlineDuplexClient(..., tools=[...])`` / ``DuplexClient(..., tools=[...])``, docs/clients.md "Tools").

With random weights (the default ``tiny`` checkpoint, or a server whose ``/health`` says
``random_weights``) every word is noise: the tool decider's constrained decoding still produces
schema-valid calls, but which tool it calls and with what arguments is random. So with random
weights ``--tool-choice`` defaults to ``required`` (a call every turn), otherwise to ``auto``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from duplexkit import ASSETS_DIR
from duplexkit.agent import tool
from duplexkit.audio import read_wav
from duplexkit.clients import (DuplexClient, DuplexConnectionError, DuplexError, InlineDuplexClient,
                               ToolCallFinished, ToolCallStarted)
from duplexkit.preflight import RANDOM_WEIGHTS_NOTICE, remote_random_weights

DEFAULT_WAV = ASSETS_DIR / "question_16k.wav"


# ------------------------------------------------------------------------------------------ the tools


class Notebook:
    """Notes in one JSON file: a list of ``{"id", "text", "tags", "created"}`` objects."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def load(self) -> list:
        if not self.path.exists():
            return []
        return json.loads(self.path.read_text(encoding="utf-8") or "[]")

    def save(self, notes: list) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".notes-", dir=self.path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(notes, f, ensure_ascii=False, indent=1)
        os.replace(tmp, self.path)  # a crash never leaves half a file

    def tools(self) -> list:
        book = self

        @tool(filler="Let me write that down.", cancellable=False)
        def add_note(text: str, tags: list[str] = []) -> dict:
            """Write a note down in the user's notebook.

            Args:
                text: the note, as the user said it.
                tags: a few words to file the note under.
            """
            notes = book.load()
            note = {"id": max((n["id"] for n in notes), default=0) + 1, "text": text, "tags": list(tags),
                    "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
            notes.append(note)
            book.save(notes)
            return {"saved": note, "total_notes": len(notes)}

        @tool(filler="Let me look.", late_result="drop")
        def list_notes(query: str = "") -> dict:
            """Find notes in the user's notebook.

            Args:
                query: words to look for in the notes' text and tags; empty lists every note.
            """
            q = query.lower().strip()
            hits = [n for n in book.load()
                    if not q or q in n["text"].lower() or any(q in t.lower() for t in n.get("tags", []))]
            return {"query": query, "notes": hits[-20:], "count": len(hits)}

        return [add_note, list_notes]


# ------------------------------------------------------------------------------------------ the session


async def run(args: argparse.Namespace) -> int:
    audio, _ = read_wav(args.input, 16_000)
    notebook = Notebook(args.notes)
    engine = None
    if args.url:
        random_weights = remote_random_weights(args.url)
    else:
        from duplexkit.engine import load_engine

        engine = load_engine(args.inline)
        random_weights = bool(getattr(engine, "random_weights", False))
    if random_weights:
        print(RANDOM_WEIGHTS_NOTICE, file=sys.stderr)
        print("NOTE: random weights also pick the tool and its arguments: expect odd notes in "
              f"{notebook.path}.", file=sys.stderr)
    choice = args.tool_choice or ("required" if random_weights else "auto")
    if choice not in ("auto", "required", "none"):
        choice = {"type": "function", "name": choice}
    session = {"turn_detection": None,  # the commit below ends the user's turn
               "instructions": "You keep the user's notes. Use the tools to add and find notes.",
               "audio": {"input": {"transcription": {"model": "minicpm-o"}}}}
    common = dict(tools=notebook.tools(), tool_choice=choice, session=session)
    if engine is not None:
        client = InlineDuplexClient(engine, answer_policy="on_request",
                                    max_output_tokens=40 if random_weights else 1024, **common)
    else:
        client = DuplexClient(args.url, api_key=args.api_key, **common)
    status = 1
    try:
        async with client:
            print(f"session {client.session_id}: tools {[t['name'] for t in client.session.get('tools', [])]}, "
                  f"tool_choice {json.dumps(client.session.get('tool_choice'))}")
            for i in range(0, len(audio), 1600):  # 100 ms appends
                await client.send_audio(audio[i:i + 1600], rate=16_000)
            await client.commit()
            status = await asyncio.wait_for(follow(client, args.answer_wait), args.timeout)
    finally:
        if engine is not None:
            await engine.aclose()
    print(f"notes file: {notebook.path} ({len(notebook.load())} notes)")
    return status


async def follow(client, answer_wait: float) -> int:
    """Print the turn as it happens; return 0 once the answer (after the tool results, or the
    model's own answer when no tool was called) is done."""
    finished = 0  # tool calls settled so far
    answer_id: Optional[str] = None
    events = client.events()
    waited_since = time.monotonic()
    while True:
        try:
            ev = await asyncio.wait_for(events.get(), 0.5)
        except asyncio.TimeoutError:
            # no tool call and no answer after answer_wait: ask for the answer ourselves
            if answer_id is None and not client.tool_calls and client.active_response is None \
                    and time.monotonic() - waited_since > answer_wait:
                handle = await client.create_response()
                answer_id = handle.id
            continue
        except StopAsyncIteration:
            return 1
        t = ev.type
        if t == "conversation.item.input_audio_transcription.completed":
            print(f"user said: {ev.transcript!r}")
        elif t == "conversation.item.input_audio_transcription.failed":
            print(f"user transcript failed: {ev.error.message}")
        elif isinstance(ev, ToolCallStarted):
            print(f"tool call: {ev.call.name}({ev.call.arguments})  [call_id {ev.call.call_id}]")
        elif isinstance(ev, ToolCallFinished):
            finished += 1
            c = ev.call
            what = c.output if c.output is not None else "(nothing sent)"
            print(f"tool result: {c.name} {c.status} in {c.elapsed_ms or 0:.0f} ms -> {what}")
        elif t == "response.created":
            trigger = ev.response.trigger
            print(f"response {ev.response.id} started (trigger {trigger})")
            waited_since = time.monotonic()
            if answer_id is None and trigger not in ("tool", "filler", "progress") and \
                    (finished or not client.tool_calls):
                answer_id = ev.response.id  # the answer: after the tool results, or the model's own
        elif t == "response.done":
            r = ev.response
            said = "".join(c.transcript or c.text or "" for o in (r.output or []) for c in (o.content or []))
            calls = [o.name for o in (r.output or []) if o.type == "function_call"]
            print(f"response {r.id} {r.status}" + (f": calls {calls}" if calls else "")
                  + (f": {said!r}" if said else ""))
            waited_since = time.monotonic()
            if r.id == answer_id and calls:
                answer_id = None  # our response.create was answered with calls: the answer follows their results
            elif r.id == answer_id:
                return 0 if r.status in ("completed", "incomplete") else 1
        elif t == "error":
            print(f"server error: {ev.error.code}: {ev.error.message}")
        elif t == "session.warning" and (ev.code or "").startswith("tool_"):
            # the tool flow gave up on something (docs/tools.md): say why no call or answer came
            print(f"tool warning: {ev.code}: {ev.message}")
            if ev.code == "tool_decision_timeout":
                print("  (the decider took longer than the tool gate's 3 s: on a slow CPU the tiny model often "
                      "does; the model answers without tools this turn)")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="a duplexkit server (ws://HOST:PORT) instead of a model in-process")
    p.add_argument("--api-key", default=None, help="API key for --url")
    p.add_argument("--inline", default="tiny", metavar="MODEL",
                   help="model run in-process when no --url is given: 'tiny' (random weights, the default), "
                        "'scripted' or a checkpoint directory")
    p.add_argument("--input", default=str(DEFAULT_WAV), help="the user's speech, a WAV file (any rate)")
    p.add_argument("--notes", default="voice_notes.json", type=Path, help="the notes file (JSON)")
    p.add_argument("--tool-choice", default=None, metavar="CHOICE",
                   help="auto, required, none or a tool name (default: required with random weights, else auto)")
    p.add_argument("--answer-wait", type=float, default=30.0,
                   help="seconds without a tool call or an answer before the client asks for the answer")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the whole turn")
    try:
        sys.exit(asyncio.run(run(p.parse_args())))
    except DuplexError as exc:  # the server's (or the connection's) error, without a traceback
        print(f"error: {exc.code}: {exc.message}", file=sys.stderr)
        # 3: could not connect or the connection was refused/lost (as the CLI); 1: the server's error
        sys.exit(3 if isinstance(exc, DuplexConnectionError) else 1)
    except KeyboardInterrupt:  # Ctrl+C: one line and the status a shell shows for SIGINT, as the CLI
        print("interrupted", file=sys.stderr)
        sys.exit(130)
