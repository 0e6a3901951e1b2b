"""A small Gradio demo: record or upload a question, hear the spoken answer.

    pip install gradio            # optional dependency, not installed by duplexkit
    duplexkit serve tiny --port 8000
    python examples/gradio_demo.py --url ws://127.0.0.1:8000

Each submission opens a duplexkit session (``DuplexClient``), streams the clip, commits,
requests an answer and returns (transcript, 24 kHz audio). ``--inline MODEL`` runs the model
in-process instead of connecting to a server.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import numpy as np

from duplexkit.audio import read_wav
from duplexkit.audio.resample import resample
from duplexkit.clients import DuplexClient, InlineDuplexClient
from duplexkit.preflight import RANDOM_WEIGHTS_NOTICE, fetch_health, http_base_url

TINY_CAP = 40
"""Token cap per answer for a random-weight engine in-process, as ``duplexkit serve tiny`` applies:
random weights never end a turn, so without a cap an answer runs for minutes."""

try:
    import gradio as gr
except ImportError:  # pragma: no cover - optional dependency
    gr = None


async def answer(audio_in, url: str, engine=None) -> tuple[str, tuple[int, np.ndarray] | None]:
    """``audio_in``: Gradio's ``(rate, int16|float array)`` or a file path. Returns (transcript, (24000, audio))."""
    if audio_in is None:
        return "no audio", None
    if isinstance(audio_in, str):
        x, _ = read_wav(audio_in, 16_000)
    else:
        rate, data = audio_in
        data = np.asarray(data)
        if data.ndim == 2:
            data = data.mean(axis=1)
        x = data.astype(np.float32) / 32768.0 if data.dtype == np.int16 else data.astype(np.float32)
        x = resample(x, int(rate), 16_000) if rate != 16_000 else x
    if engine is not None:
        cap = {"max_output_tokens": TINY_CAP} if getattr(engine, "random_weights", False) else {}
        client = InlineDuplexClient(engine, answer_policy="on_request", **cap)
    else:
        client = DuplexClient(url)  # the server applies its own cap
    async with client:
        for i in range(0, len(x), 3200):
            await client.send_audio(x[i:i + 3200], rate=16_000)
        await client.commit()
        h = await client.create_response()
        await h.wait(600)
    return f"[{h.status}] {h.transcript}", (24_000, h.audio_array())


def build(url: str, engine=None, notice: str = ""):
    if gr is None:
        raise SystemExit("this demo needs gradio: pip install gradio")

    def run(audio_in):
        text, out = asyncio.run(answer(audio_in, url, engine))
        if out is not None:  # 16-bit samples, as Gradio plays them (it would convert float32 with a warning)
            out = (out[0], (np.clip(out[1], -1.0, 1.0) * 32767).astype(np.int16))
        return text, out

    return gr.Interface(fn=run, inputs=gr.Audio(sources=["microphone", "upload"], type="numpy"),
                        outputs=[gr.Textbox(label="transcript"), gr.Audio(label="answer", type="numpy")],
                        title="duplexkit", description="Ask a question; the model answers in speech." + notice)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="ws://127.0.0.1:8000")
    p.add_argument("--inline", default=None, metavar="MODEL", help="run MODEL in-process ('tiny' or a path)")
    p.add_argument("--port", type=int, default=7860)
    a = p.parse_args()
    if gr is None:  # said before a model loads or a server is asked
        sys.exit("error: this demo needs gradio: pip install gradio")
    demo = None
    try:
        eng = None
        if a.inline:
            from duplexkit.engine import load_engine

            eng = load_engine(a.inline)
            random_weights = bool(getattr(eng, "random_weights", False))  # in-process: the engine says so
        else:
            health = fetch_health(a.url)  # remote: the server's /health
            if health is None:  # said now, not at the first question
                print(f"error: cannot connect to {a.url}: no duplexkit server answers at "
                      f"{http_base_url(a.url)}/health", file=sys.stderr)
                sys.exit(3)  # as the CLI and the other examples
            random_weights = bool(health.get("random_weights"))
        if random_weights:
            print(RANDOM_WEIGHTS_NOTICE, file=sys.stderr)
        demo = build(a.url, eng, " " + RANDOM_WEIGHTS_NOTICE if random_weights else "")
        demo.launch(server_port=a.port, prevent_thread_lock=True)
        while True:  # serve until Ctrl+C (Gradio's own wait would end with its own line and status 0)
            time.sleep(3600)
    except KeyboardInterrupt:  # Ctrl+C: one line and the status a shell shows for SIGINT, as the CLI
        if demo is not None:
            demo.close(verbose=False)
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except OSError as exc:  # the --port is taken
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(3)
