"""Call a duplexkit server over WebRTC from Python (aiortc): say a WAV, record the spoken answer.

The server side is ``POST /v1/realtime/calls`` (docs/webrtc.md). This client does what a browser
does: an Opus microphone track (here fed from a WAV, paced in real time, silence in between), the
``oai-events`` data channel for JSON events, and the answer played from the remote audio track.
It is also the client of ``benchmarks/webrtc_latency.py`` and ``tests/e2e/test_webrtc.py``.

Needs ``pip install 'duplexkit[webrtc]'`` (aiortc) and a running server::

    duplexkit serve scripted --port 8000
    python examples/webrtc_client.py --url http://127.0.0.1:8000 \\
        --wav tests/fixtures/audio/question_16k.wav --out answer.wav
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from duplexkit.audio.resample import resample  # noqa: E402

RTC_RATE = 48_000  # Hz, aiortc's audio clock
FRAME = 960  # samples of one 20 ms frame at 48 kHz


class CallRefused(Exception):
    """The server did not answer the offer with 201 (``status`` and ``body`` say why)."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status, self.body = status, body


def _mic_track():
    from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
    from av import AudioFrame

    class WavMic(MediaStreamTrack):
        """A microphone track: queued clips (float32, 48 kHz) in real time, silence otherwise.

        ``say`` returns a future that resolves to the wall-clock time (``time.monotonic()``) at which
        the clip's last sample was handed to the encoder."""

        kind = "audio"

        def __init__(self) -> None:
            super().__init__()
            self._clips: list[list] = []  # [float32 array, offset, future]
            self._t0: Optional[float] = None
            self._pts = 0

        def say(self, x48: np.ndarray, started: Optional[asyncio.Future] = None) -> asyncio.Future:
            fut = asyncio.get_running_loop().create_future()
            self._clips.append([np.asarray(x48, np.float32), 0, fut, started])
            return fut

        async def recv(self):
            if self.readyState != "live":
                raise MediaStreamError
            now = time.monotonic()
            if self._t0 is None:
                self._t0 = now
            else:
                self._pts += FRAME
                wait = self._t0 + self._pts / RTC_RATE - now
                if wait > 0:
                    await asyncio.sleep(wait)
            out = np.zeros(FRAME, np.float32)
            filled = 0
            while filled < FRAME and self._clips:
                clip = self._clips[0]
                if clip[1] == 0 and clip[3] is not None and not clip[3].done():
                    clip[3].set_result(time.monotonic())  # its first frame goes out now
                k = min(FRAME - filled, clip[0].size - clip[1])
                out[filled:filled + k] = clip[0][clip[1]:clip[1] + k]
                clip[1] += k
                filled += k
                if clip[1] >= clip[0].size:
                    self._clips.pop(0)
                    if not clip[2].done():
                        clip[2].set_result(time.monotonic())
            pcm = np.clip(np.round(out * 32767), -32768, 32767).astype(np.int16)
            frame = AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
            frame.sample_rate, frame.pts, frame.time_base = RTC_RATE, self._pts, Fraction(1, RTC_RATE)
            return frame

    return WavMic()


class RtcCall:
    """One WebRTC call to ``url`` (``http://host:port``).

    Attributes:
        events: ``(t, event dict)`` for each server event received on the data channel, in order
            (``t`` = ``time.monotonic()`` at arrival).
        frames: ``(t, rms)`` of each 20 ms frame received on the remote audio track (rms of the
            mono float32 signal, 0..1).
        audio: the received answer audio, mono float32 chunks at 48 kHz (``answer_audio()`` joins them).
        call_id: the id from the ``Location`` header.
    """

    def __init__(self, url: str, *, key: Optional[str] = None, duplex: bool = False,
                 session: Optional[dict] = None, form: bool = False) -> None:
        self.url, self.key, self.duplex, self.session, self.form = url.rstrip("/"), key, duplex, session, form
        self._first: list = []  # clips queued before connect(): the track's first frames
        self.events: list[tuple[float, dict]] = []
        self.frames: list[tuple[float, float]] = []
        self.audio: list[np.ndarray] = []
        self.call_id: Optional[str] = None
        self.pc = None
        self.channel = None
        self.mic = None
        self._changed: Optional[asyncio.Event] = None
        self._tasks: list[asyncio.Task] = []

    async def connect(self, timeout: float = 30.0) -> "RtcCall":
        """Offer, POST, answer; returns once the data channel is open. Raises :class:`CallRefused`."""
        import httpx
        from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription

        self._changed = asyncio.Event()
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        self.mic = _mic_track()
        for x48, started, done in self._first:
            done_fut = self.mic.say(x48, started)
            done_fut.add_done_callback(lambda f, d=done: d.done() or d.set_result(f.result()))
        self.pc.addTrack(self.mic)
        self.channel = self.pc.createDataChannel("oai-events")
        opened = asyncio.get_running_loop().create_future()
        self.channel.on("open", lambda: opened.done() or opened.set_result(True))

        @self.channel.on("message")
        def on_message(msg) -> None:
            self.events.append((time.monotonic(), json.loads(msg)))
            self._changed.set()

        @self.pc.on("track")
        def on_track(track) -> None:
            if track.kind == "audio":
                self._tasks.append(asyncio.get_running_loop().create_task(self._play(track)))

        await self.pc.setLocalDescription(await self.pc.createOffer())
        headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        params = {"duplex": "1"} if self.duplex else {}
        offer = self.pc.localDescription.sdp
        async with httpx.AsyncClient(timeout=timeout) as http:
            if self.form or self.session is not None:
                files = {"sdp": (None, offer)}
                if self.session is not None:
                    files["session"] = (None, json.dumps(self.session))
                r = await http.post(self.url + "/v1/realtime/calls", params=params, headers=headers, files=files)
            else:
                r = await http.post(self.url + "/v1/realtime/calls", params=params, content=offer,
                                    headers={**headers, "Content-Type": "application/sdp"})
        if r.status_code != 201:
            await self.pc.close()
            raise CallRefused(r.status_code, r.text)
        self.call_id = r.headers.get("location", "").rsplit("/", 1)[-1] or None
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=r.text, type="answer"))
        await asyncio.wait_for(opened, timeout)
        return self

    async def _play(self, track) -> None:
        from aiortc.mediastreams import MediaStreamError

        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            a = frame.to_ndarray().astype(np.float32).reshape(-1, len(frame.layout.channels)).mean(axis=1) / 32768.0
            if frame.sample_rate != RTC_RATE:
                a = resample(a, frame.sample_rate, RTC_RATE)
            self.audio.append(a)
            self.frames.append((time.monotonic(), float(np.sqrt(np.mean(a * a))) if a.size else 0.0))
            self._changed.set()

    def say(self, audio: np.ndarray, rate: int, started: Optional[asyncio.Future] = None) -> asyncio.Future:
        """Speak ``audio`` (mono float32 at ``rate`` Hz) into the microphone track; the future gives
        the ``time.monotonic()`` at which its last sample was sent (``started``, when given, gets the
        time its first frame was sent). Before :meth:`connect` the clip becomes the track's first
        audio (the session's input then starts with it)."""
        x48 = resample(np.asarray(audio, np.float32), rate, RTC_RATE)
        if self.mic is None:
            done = asyncio.get_running_loop().create_future()
            self._first.append((x48, started, done))
            return done
        return self.mic.say(x48, started)

    def send(self, event: dict) -> None:
        """Send a client event on the data channel."""
        self.channel.send(json.dumps(event))

    def types(self) -> list[str]:
        return [e["type"] for _, e in self.events]

    async def wait_for(self, pred: Callable[["RtcCall"], Any], timeout: float, what: str = "condition") -> Any:
        """Wait until ``pred(self)`` is truthy (re-checked on each event and audio frame); returns it."""
        deadline = time.monotonic() + timeout
        while True:
            v = pred(self)
            if v:
                return v
            left = deadline - time.monotonic()
            if left <= 0:
                raise asyncio.TimeoutError(f"{what} not seen within {timeout:g} s; events: {self.types()[-30:]}")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), min(left, 0.5))
            except asyncio.TimeoutError:
                pass

    def event(self, type_: str, after: float = 0.0, **match) -> Optional[tuple[float, dict]]:
        """The first ``(t, event)`` of ``type_`` at or after ``after`` whose top-level fields match."""
        for t, e in self.events:
            if t >= after and e.get("type") == type_ and all(e.get(k) == v for k, v in match.items()):
                return t, e
        return None

    def first_sound(self, after: float, threshold: float = 0.02) -> Optional[float]:
        """The arrival time of the first received frame after ``after`` with rms above ``threshold``."""
        return next((t for t, rms in self.frames if t >= after and rms > threshold), None)

    def answer_audio(self) -> np.ndarray:
        return np.concatenate(self.audio) if self.audio else np.zeros(0, np.float32)

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        if self.pc is not None:
            await self.pc.close()


async def _main(args) -> int:
    from duplexkit.audio import read_wav, write_wav

    x, _ = read_wav(args.wav, 16_000)
    call = RtcCall(args.url, key=args.key, duplex=args.duplex)
    try:  # closed however it ends (Ctrl+C included): the peer connection's tasks end with it
        await call.connect(args.timeout)
        print(f"call {call.call_id}: connected")
        t_end = await call.say(x, 16_000)
        print(f"said {x.size / 16_000:.2f} s of {args.wav}")
        try:
            await call.wait_for(lambda c: c.event("output_audio_buffer.stopped", t_end), args.timeout, "the answer")
        except asyncio.TimeoutError as exc:
            print(exc)
        first = call.first_sound(t_end)
        print("events:", ", ".join(call.types()))
        if first is not None:
            print(f"first answer audio {1000 * (first - t_end):.0f} ms after the end of the WAV")
        if args.out:
            write_wav(args.out, call.answer_audio(), RTC_RATE)
            print(f"answer audio (48 kHz) written to {args.out}")
    finally:
        await call.close()
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--key", default=None, help="API key (Bearer)")
    ap.add_argument("--wav", default=str(REPO / "tests" / "fixtures" / "audio" / "question_16k.wav"))
    ap.add_argument("--out", default=None, help="write the received audio here (WAV, 48 kHz)")
    ap.add_argument("--duplex", action="store_true", help="the duplex profile (?duplex=1)")
    ap.add_argument("--timeout", type=float, default=30.0,
                    help="seconds for the call to open, and then for the answer")
    args = ap.parse_args(argv)
    import httpx

    try:
        return asyncio.run(_main(args))
    except ImportError as exc:  # aiortc / av missing
        print(f"error: this example needs aiortc: pip install 'duplexkit[webrtc]' ({exc})", file=sys.stderr)
        return 1
    except CallRefused as exc:  # the server answered the offer with an error (e.g. 401 without a valid key)
        print(f"error: the server refused the call: {' '.join(str(exc).split())}", file=sys.stderr)
        return 3
    except (httpx.HTTPError, OSError, asyncio.TimeoutError) as exc:  # refused, unknown host, or no call opened
        why = str(exc) or f"the call did not open within {args.timeout:g} s"
        print(f"error: cannot connect to {args.url}: {why}", file=sys.stderr)
        return 3  # as the CLI and the other examples
    except KeyboardInterrupt:  # Ctrl+C: one line and the status a shell shows for SIGINT, as the CLI
        print("interrupted", file=sys.stderr)
        return 130

if __name__ == "__main__":
    raise SystemExit(main())
