"""``duplexkit mic``: talk to the model through the microphone and speaker."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any, Optional
from .common import (
    CliError,
    EXIT_CONNECTION,
    EXIT_DEVICE,
    _check_model_arg,
    _eprint,
    _random_weights_notice,
    _remote_notice,
    _session_defaults,
    check_output_file,
    check_url_args,
    load_engine_async,
    run_async,
    session_end_line,
)


def _echo_config(choice: str):
    """``--echo`` -> the client's ``echo=`` option: an ``EchoConfig``, or None for ``off``.

    ``auto`` is ``aec`` when the AEC package (``duplexkit[echo]``) imports, else ``gate``.
    Raises CliError for ``aec`` without the package.
    """
    if choice == "off":
        return None
    from duplexkit.audio.echo import EchoConfig, aec_available

    if choice == "auto":
        choice = "aec" if aec_available() else "gate"
    elif choice == "aec" and not aec_available():
        raise CliError("--echo aec needs the AEC package: pip install 'duplexkit[echo]' (or use --echo gate)")
    return EchoConfig(mode=choice)


MIC_DEVICE_HELP = ("Fix: on a headless machine or in a container, start a PulseAudio server with virtual devices "
                   "(docs/troubleshooting.md, 'Audio devices'); or run `duplexkit mic --url ws://SERVER:PORT` on a "
                   "machine that has a microphone and speakers")
"""The fix printed after the device list; :func:`_device_fix` adds the device options when there is
a device to pick."""


def _device_fix(devices: list[dict]) -> str:
    """The ``Fix:`` line: with devices listed, also how to pick one of them."""
    if not devices:
        return MIC_DEVICE_HELP + "."
    return (MIC_DEVICE_HELP + "; or pick a device from the list above with --input-device / --output-device "
            "(its index or a part of its name).")


def _describe_devices(devices: list[dict]) -> str:
    if not devices:
        return "PortAudio sees no audio device at all."
    lines = [f"PortAudio sees {len(devices)} device(s):"]
    for d in devices:
        mark = (" (default input)" if d["is_default_input"] else "") + (" (default output)" if d["is_default_output"] else "")
        lines.append(f"  [{d['index']}] {d['name']} ({d['hostapi']}, {d['max_input_channels']} in / "
                     f"{d['max_output_channels']} out){mark}")
    return "\n".join(lines)


def _check_audio_devices(input_spec: Optional[str], output_spec: Optional[str]) -> None:
    """Before loading anything: is there an input and an output device (the named ones, or defaults)?

    Raises:
        CliError(EXIT_DEVICE) naming what is missing, the fix, and every device PortAudio lists;
        DeviceError (also exit 5) when sounddevice/PortAudio itself is missing.
    """
    from duplexkit.audio import list_devices

    devices = list_devices()
    problems = []
    for kind, spec, chan in (("input", input_spec, "max_input_channels"), ("output", output_spec, "max_output_channels")):
        usable = [d for d in devices if d[chan] > 0]
        if spec is None:
            if not any(d[f"is_default_{kind}"] for d in usable):
                problems.append(f"no default audio {kind} device" if usable else f"no audio {kind} device")
        elif spec.strip().isdigit():
            if not any(d["index"] == int(spec) for d in usable):
                problems.append(f"--{kind}-device {spec} is not an {kind} device")
        elif not any(spec.lower() in d["name"].lower() for d in usable):
            problems.append(f"no {kind} device matching --{kind}-device {spec!r}")
    if problems:
        raise CliError(f"{', '.join(problems)}.\n{_describe_devices(devices)}\n{_device_fix(devices)}", EXIT_DEVICE)


async def _mic_async(args) -> int:
    import signal

    import numpy as np

    from duplexkit.audio.playback import OUTPUT_RATE

    if not args.url:
        _check_model_arg(args.model, args.layout)  # before the device query and before loading the model
    for option, path in (("--save-output", args.save_output), ("--summary", args.summary)):
        if path:  # written at the end of the conversation: refused now, not then
            check_output_file(path, option)
    _check_audio_devices(args.input_device, args.output_device)

    from duplexkit.audio import MicStream, PlaybackBuffer, SpeakerStream
    from duplexkit.clients import DuplexClient, InlineDuplexClient

    player = PlaybackBuffer(OUTPUT_RATE)
    session: dict[str, Any] = {}
    if args.instructions:
        session["instructions"] = args.instructions
    if args.vad_responses:
        session["turn_detection"] = {"type": "server_vad", "create_response": True, "interrupt_response": True,
                                     "silence_duration_ms": args.silence_ms}
    common = dict(session=session, player=player, barge_in=not args.no_barge_in, input_rate=16_000,
                  request_timeout_s=60.0)
    echo = _echo_config(args.echo)
    if echo is not None:  # the client's echo option (EchoConfig); "off" leaves the client as it was
        common["echo"] = echo
    engine = None
    if args.url:
        _remote_notice(args.url)
        client = DuplexClient(args.url, api_key=args.api_key, **common)
    else:  # Ctrl+C or SIGTERM while loading interrupts the load (status 130 / 143)
        engine = await load_engine_async(args.model, layout=args.layout, seed=args.weights_seed, checked=True)
        _random_weights_notice(engine)
        client = InlineDuplexClient(engine, **common, **_session_defaults(args, args.model))
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # from here Ctrl+C / SIGTERM end the conversation (exit 0)
        loop.add_signal_handler(sig, stop.set)
    ready = [False]
    ended: Optional[str] = None  # why the session ended by itself, when it did

    mic_q: asyncio.Queue = asyncio.Queue()
    out_audio: list = []
    transcript_lines: list[str] = []
    heard = [0]
    tty = sys.stdout.isatty()
    level = [0.0]

    def on_block(block):  # called from the audio thread: hand the samples to the event loop
        loop.call_soon_threadsafe(mic_q.put_nowait, block.audio)

    speaker = SpeakerStream(player, rate=OUTPUT_RATE, device=_device(args.output_device))
    mic = MicStream(rate=16_000, block_ms=args.block_ms, device=_device(args.input_device), on_block=on_block)
    try:
        async with client:

            async def pump_mic():
                while True:
                    x = await mic_q.get()
                    level[0] = float(np.sqrt(np.mean(x * x))) if len(x) else 0.0
                    await client.send_audio(x, rate=16_000)

            async def show_events():
                current = ""
                async for ev in client.events():
                    t = ev.type
                    if t == "response.output_audio_transcript.delta" or t == "response.output_text.delta":
                        current += ev.delta or ""
                        if tty:
                            print(f"\rassistant: {current[-70:]}  [mic {20 * np.log10(level[0] + 1e-9):6.1f} dBFS]",
                                  end="", flush=True)
                    elif t == "response.done":
                        line = f"assistant ({ev.response.status}): {current}"
                        transcript_lines.append(line)
                        print(("\r" if tty else "") + line, flush=True)
                        current = ""
                    elif t == "input_audio_buffer.speech_started":
                        heard[0] += 1
                        print(("\n" if tty and current else "") + "[you are speaking]", flush=True)
                    elif t == "error":
                        print(f"[error] {ev.error.code}: {ev.error.message}", flush=True)

            async def collect_output():
                async for h in client.responses():
                    async def grab(h=h):
                        try:
                            async for pcm in h.audio():
                                out_audio.append(pcm)
                        except Exception:
                            pass
                    asyncio.ensure_future(grab())

            speaker.start()
            mic.start()
            tasks = [asyncio.ensure_future(pump_mic()), asyncio.ensure_future(show_events()),
                     asyncio.ensure_future(collect_output())]
            # "ready" only once the model is loaded, the session is open and the microphone records:
            # audio played from now on is heard. --duration counts from here.
            _eprint(f"session {client.session_id} ready; speak (Ctrl+C to quit)")
            ready[0] = True
            t_end = time.monotonic() + args.duration if args.duration else None
            try:
                while not stop.is_set() and (t_end is None or time.monotonic() < t_end):
                    try:
                        await asyncio.wait_for(stop.wait(), 0.1)
                    except asyncio.TimeoutError:
                        pass
                    if any(t.done() for t in tasks):
                        break
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            # neither Ctrl+C nor --duration: the session ended under us (the server closed it)
            ended = session_end_line(client) if client.closed else None
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        mic.stop()
        speaker.stop()
        if engine is not None:
            await engine.aclose()
        if ready[0]:
            _mic_outputs(args, out_audio, transcript_lines, client, heard[0], ended=ended)
    if ended is not None:
        raise CliError(ended, EXIT_CONNECTION)
    return 0


def _mic_outputs(args, out_audio: list, transcript_lines: list, client, heard: int,
                 ended: Optional[str] = None) -> None:
    """Write ``--save-output`` and ``--summary`` (also after Ctrl+C, and when the server ended the
    session: ``ended`` is then its line) and the closing lines on stderr.

    ``--save-output`` is always written once the session was ready: the assistant's audio (float32
    at 24 kHz, saved as 16-bit PCM), or, when it said nothing, a valid WAV of 0 samples, so that a
    script reading the file finds one either way; a line says which.
    """
    import numpy as np

    from duplexkit.audio.playback import OUTPUT_RATE

    if args.save_output:
        from duplexkit.audio import write_wav

        audio = np.concatenate(out_audio) if out_audio else np.zeros(0, np.float32)
        write_wav(args.save_output, audio, OUTPUT_RATE)
        if len(audio):
            _eprint(f"mic: wrote {len(audio) / OUTPUT_RATE:.2f} s of assistant audio to {args.save_output}")
        else:
            _eprint(f"mic: no assistant audio: wrote an empty WAV (0 s, 24 kHz) to {args.save_output}")
    if args.summary:
        Path(args.summary).write_text(json.dumps({
            "responses": transcript_lines, "output_samples": int(sum(len(a) for a in out_audio)),
            "speech_started": heard, "barge_ins": getattr(client, "barge_ins", 0)}, indent=2))
    # the input-device hint only fits a conversation that ran until the user stopped it
    hint = "" if heard or ended else " (nothing heard: check the input device and its level, see --input-device)"
    _eprint(f"mic: heard speech {heard} time(s), {len(transcript_lines)} response(s){hint}")


def _device(spec: Optional[str]):
    """A sounddevice device argument: an index when numeric, else a name substring (None = default)."""
    if spec is None:
        return None
    return int(spec) if spec.strip().isdigit() else spec


def cmd_mic(args) -> int:
    check_url_args(args, "mic")  # a MODEL or --layout would be ignored with --url
    # Ctrl+C / SIGTERM end the conversation with status 0 (signal handlers in _mic_async); DeviceError
    # and device checks -> 5, a server that cannot be reached -> 3: reported by main() (_error_line)
    return run_async(_mic_async(args))
