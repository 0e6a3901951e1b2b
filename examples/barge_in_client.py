"""Barge-in client: ask a question, interrupt the answer mid-way, get the interruption answered.

    duplexkit serve tiny --port 8000
    python examples/barge_in_client.py --url ws://127.0.0.1:8000 --out-dir barge_in_out

Flow (docs/protocol.md §7.3, client-forced barge-in):
1. stream the question, commit, ``response.create``;
2. once ``--interrupt-after-ms`` of the answer has arrived, the client "hears" the user: it cancels
   the response, flushes its player and acknowledges what was played (``playback.ack{truncate}``);
3. stream the interruption, commit, ``response.create``; wait for it to end.

Success (exit 0): response 1 ended ``cancelled``, response 2 ended neither ``cancelled`` nor
``failed`` and carried audio (``completed``, or ``incomplete`` when it hit the token cap), and no
event of the cancelled response arrived after its ``response.done``. With ``serve tiny`` response 2
ends ``incomplete``: random weights never emit the end-of-turn token, so the answer runs to the
server's per-response token cap (40 tokens for tiny).

Writes ``response_N_<status>.wav`` (24 kHz; e.g. ``response_1_cancelled.wav``,
``response_2_completed.wav`` or ``response_2_incomplete.wav``) per response and ``summary.json``
(ids, statuses, epochs, audio ms, transcripts, and whether any audio of the cancelled response
arrived after its ``response.done``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import numpy as np

from duplexkit.audio import read_wav, write_wav
from duplexkit.clients import DuplexClient, DuplexConnectionError, DuplexError, response_id_of
from duplexkit.preflight import RANDOM_WEIGHTS_NOTICE, remote_random_weights

from duplexkit import ASSETS_DIR as ASSETS


async def stream(client, audio: np.ndarray, chunk: int = 1600) -> None:
    for i in range(0, len(audio), chunk):
        await client.send_audio(audio[i:i + chunk], rate=16_000)


async def main(args: argparse.Namespace) -> int:
    question, _ = read_wav(args.question, 16_000)
    interruption, _ = read_wav(args.interrupt, 16_000)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    events: list = []
    if remote_random_weights(args.url):  # the server's /health says so
        print(RANDOM_WEIGHTS_NOTICE, file=sys.stderr)
    async with DuplexClient(args.url, api_key=args.api_key, session={"turn_detection": None},
                            request_timeout_s=args.timeout) as client:
        await stream(client, question)
        await client.commit()
        first = await client.create_response()
        async for _ in first.audio():
            if first.audio_ms >= args.interrupt_after_ms:
                break
        await client.barge_in()  # cancel + flush + playback.ack{truncate}
        await first.wait(args.timeout)
        samples_at_done = first.audio_samples
        await stream(client, interruption)
        await client.commit()
        second = await client.create_response()
        await second.wait(args.timeout)
        await asyncio.sleep(0.2)
        while True:
            try:
                events.append(await asyncio.wait_for(client.events().get(), 0.1))
            except (asyncio.TimeoutError, StopAsyncIteration):
                break
    late = False
    seen_done = False
    for ev in events:
        rid = response_id_of(ev)
        if seen_done and rid == first.id:
            late = True
        if ev.type == "response.done" and rid == first.id:
            seen_done = True
    summary = {"responses": [], "late_events_of_cancelled_response": late,
               "cancelled_audio_samples_at_done": samples_at_done}
    for n, h in enumerate((first, second), 1):
        path = out / f"response_{n}_{h.status}.wav"
        write_wav(path, h.audio_array(), 24_000)
        summary["responses"].append({"id": h.id, "status": h.status, "status_details": h.status_details,
                                     "epoch": h.epoch, "audio_ms": h.audio_ms, "chunks": h.chunk_sizes,
                                     "transcript": h.transcript, "wav": path.name})
        print(f"response {n}: {h.status:10s} epoch={h.epoch} audio={h.audio_ms} ms transcript={h.transcript!r}")
    answered = second.status not in ("cancelled", "failed") and second.audio_samples > 0
    if second.status == "incomplete":
        reason = (second.status_details or {}).get("reason", "max_output_tokens")
        print(f"note: response 2 ended incomplete ({reason}): the answer hit the per-response token cap "
              "before the model ended its turn. This is expected with `serve tiny`: random weights never "
              "emit the end-of-turn token.")
    summary["ok"] = ok = first.status == "cancelled" and answered and not late
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"wrote {out / 'summary.json'}")
    if not ok:
        why = []
        if first.status != "cancelled":
            why.append(f"response 1 ended {first.status}, not cancelled")
        if not answered:
            why.append(f"response 2 ended {second.status} with {second.audio_ms} ms of audio")
        if late:
            why.append("events of the cancelled response arrived after its response.done")
        print("FAILED: " + "; ".join(why), file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="ws://127.0.0.1:8000", help="server URL")
    p.add_argument("--api-key", default=None)
    p.add_argument("--question", default=str(ASSETS / "question_16k.wav"), help="first question WAV")
    p.add_argument("--interrupt", default=str(ASSETS / "interrupt_16k.wav"), help="interrupting WAV")
    p.add_argument("--interrupt-after-ms", type=int, default=500, help="interrupt once this much answer arrived")
    p.add_argument("--out-dir", default="barge_in_out", help="where to write WAVs and summary.json")
    p.add_argument("--timeout", type=float, default=600.0)
    try:
        sys.exit(asyncio.run(main(p.parse_args())))
    except DuplexError as exc:  # the server's (or the connection's) error, without a traceback
        print(f"error: {exc.code}: {exc.message}", file=sys.stderr)
        # 3: could not connect or the connection was refused/lost (as the CLI); 1: the server's error
        sys.exit(3 if isinstance(exc, DuplexConnectionError) else 1)
    except KeyboardInterrupt:  # Ctrl+C: one line and the status a shell shows for SIGINT, as the CLI
        print("interrupted", file=sys.stderr)
        sys.exit(130)
