"""The REAL tiny engine (random weights, torch, the three-stage runtime) behind
``duplexkit serve tiny --engine-process``: the model lives in the engine process only (the server
process never maps libtorch), and a realtime session with speech gets 24 kHz audio back through the
pipe. Slow and memory heavy (one torch model): one test; run under the torch flock."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from duplexkit.audio import read_wav
from duplexkit.clients import DuplexClient

from _serverproc import ServerProc
from test_engine_process import _engine_child

pytestmark = [pytest.mark.e2e, pytest.mark.engine]
pytest.importorskip("torch")


def _maps_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


async def test_tiny_session_with_speech_through_the_engine_process(question_wav):
    with ServerProc("tiny", "--engine-process", "--max-output-tokens", "40", "--layout", "cpu",
                    ready_timeout_s=600) as srv:
        assert httpx.get(srv.url + "/health").json()["random_weights"] is True
        child = _engine_child(srv.proc.pid)
        assert _maps_torch(child) and not _maps_torch(srv.proc.pid)
        async with DuplexClient(srv.ws_url, request_timeout_s=120) as c:
            audio = read_wav(question_wav, 16_000)[0]
            for i in range(0, len(audio), 3200):
                await c.send_audio(audio[i:i + 3200], rate=16_000)
            await c.commit()
            h = await c.create_response()
            await h.wait(300)
        assert h.status in ("completed", "incomplete"), h.status_details  # the token cap ends random weights
        assert h.chunk_sizes and h.chunk_sizes[0] == 20160  # the first vocoder chunk: 840 ms at 24 kHz
        assert all(n == 24000 for n in h.chunk_sizes[1:-1])
        assert h.audio_samples == sum(h.chunk_sizes) and h.transcript
        deltas = [e for e in h.events if e.type == "response.output_audio.delta"]
        assert deltas and all(e.sample_rate_hz == 24000 and e.format == "pcm16" for e in deltas)
    assert srv.proc.returncode == 0 and not Path(f"/proc/{child}").exists()
