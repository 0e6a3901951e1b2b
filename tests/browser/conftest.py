"""Fixtures for the real-browser tests: headless Debian ``chromium`` driven by Playwright for
Python, a fake microphone fed from a speech WAV, and real ``duplexkit serve`` processes.

The fake microphone is Chromium's own (``--use-fake-device-for-media-stream`` with
``--use-file-for-fake-audio-capture=<wav>%noloop``): it plays the file once in real time, then
silence. Microphone permission is granted per browser context, so one browser serves both the
granted and the denied case (``--deny-permission-prompts`` turns an ungranted request into a
``NotAllowedError``).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))

from _serverproc import ServerProc  # noqa: E402,F401  (re-exported for the tests)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "audio"
RATE = 16_000

# Recording played by the fake microphone: a question, a pause long enough for the answer to start
# playing, an interruption spoken over the answer, then silence for the second answer to play out.
# Seconds; the fixtures' speech onsets/offsets are in tests/fixtures/audio/README.md.
GAP_BEFORE_INTERRUPT_S = 2.5
TAIL_SILENCE_S = 14.0

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _speech_recording(path: Path, with_interrupt: bool) -> Path:
    q, rq = sf.read(FIXTURES / "question_16k.wav", dtype="int16")
    parts = [q]
    if with_interrupt:
        i, ri = sf.read(FIXTURES / "interrupt_16k.wav", dtype="int16")
        assert rq == ri == RATE
        parts += [np.zeros(int(GAP_BEFORE_INTERRUPT_S * RATE), np.int16), i]
    parts.append(np.zeros(int(TAIL_SILENCE_S * RATE), np.int16))
    sf.write(path, np.concatenate(parts), RATE, subtype="PCM_16")  # Chromium reads 16-bit PCM WAV
    return path


@pytest.fixture(scope="session")
def chromium_path() -> str:
    if CHROMIUM is None:
        pytest.skip("Debian `chromium` is not installed (scripts/setup_test.sh browser installs it): "
                    "browser tests need it")
    return CHROMIUM


def launch(pw, chromium: str, wav: Path):
    """Headless Chromium with a fake microphone playing ``wav`` once."""
    return pw.chromium.launch(executable_path=chromium, headless=True, args=[
        "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={wav}%noloop",
        "--deny-permission-prompts",
        "--autoplay-policy=no-user-gesture-required",
        "--no-sandbox",  # CI runs as root
        "--disable-gpu",
        "--renderer-process-limit=2",
    ])


@pytest.fixture(scope="module")
def playwright_instance(chromium_path):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        yield pw


@pytest.fixture(scope="module")
def browser(playwright_instance, chromium_path, tmp_path_factory):
    """One headless Chromium per module; its fake mic says a question, then an interruption."""
    wav = _speech_recording(tmp_path_factory.mktemp("mic") / "mic.wav", with_interrupt=True)
    b = launch(playwright_instance, chromium_path, wav)
    yield b
    b.close()


@pytest.fixture(scope="module")
def question_browser(playwright_instance, chromium_path, tmp_path_factory):
    """Headless Chromium whose fake mic says one question, then stays silent."""
    wav = _speech_recording(tmp_path_factory.mktemp("mic") / "question.wav", with_interrupt=False)
    b = launch(playwright_instance, chromium_path, wav)
    yield b
    b.close()
