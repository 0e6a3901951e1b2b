"""Shared test paths and the wait-bound factor (tests/_timing.py). Subfolders keep their own fixtures in their own conftest.py files."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest


def _without_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return True
    return not torch.cuda.is_available()


# Without CUDA the Triton decode kernels are tested under Triton's interpreter
# (tests/model/test_triton_decode.py). Triton reads TRITON_INTERPRET when a kernel is decorated, and
# stepaudio2 imports triton (and decorates its own kernels) as soon as any test imports it, so the
# variable must be set before the first test module is imported, not in that test module.
if "TRITON_INTERPRET" not in os.environ and _without_cuda():
    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, str(Path(__file__).resolve().parent))

# A shell without job control (`bash -c 'scripts/test.sh' &`, some CI runners) starts background
# commands with SIGINT ignored, and an ignored signal stays ignored across exec: every command the
# tests start would then ignore the Ctrl+C they send it (duplexkit keeps an inherited SIG_IGN, as
# nohup'd programs should). The tests' own commands get SIGINT as from a terminal: a handler here
# (any, not SIG_IGN) makes their children start with SIGINT at its default.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

from _timing import ENV as TIME_SCALE_ENV, TIME_SCALE  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FIXTURES_AUDIO = REPO / "tests" / "fixtures" / "audio"


def pytest_report_header(config):
    """Name the factor every wait bound around real processes, sockets and devices is scaled by."""
    return f"wait bounds scaled by {TIME_SCALE:g} (${TIME_SCALE_ENV}; tests/_timing.py)"


@pytest.fixture(scope="session")
def fixtures_audio() -> Path:
    """Folder of real speech WAVs (16 kHz mono pcm16; onsets/offsets in its README.md)."""
    return FIXTURES_AUDIO



# --- the slow group ---------------------------------------------------------------------------------
# Tests marked `slow` here, by node-id pattern (fnmatch on the node id, relative to the repository
# root), with the reason. `scripts/test.sh` with no arguments runs `-m "not slow and not ray"` (the
# contributor's default); `scripts/test.sh --all` and `.ci/run` run everything. Marking by path keeps
# the test files untouched. Times are pytest --durations on 2 cores (docs/install.md, "Running the tests").
#: (node-id pattern, why it is slow)
SLOW: tuple[tuple[str, str], ...] = (
    ("tests/engine/test_vllm_*.py::*", "the vLLM thinker backend in its own venv (setup ~2.3 min once; 30-35 s a test)"),
    ("tests/e2e/test_framework_tools.py::*", "Pipecat / LiveKit Agents in their own venv (~16 s)"),
    ("tests/e2e/test_pipecat_plug.py::*", "duplexkit's Pipecat service in the frameworks venv (~60 s)"),
    ("tests/e2e/test_livekit_plug.py::*", "duplexkit's LiveKit plugin in the frameworks venv (~45 s)"),
    ("tests/browser/*", "headless Chromium (Debian chromium, installed on demand)"),
    ("tests/model/test_code2wav_fp16.py::*", "float16 and float32 Code2Wav flows side by side (20-30 s a test)"),
    ("tests/e2e/test_fuzz_server.py::*", "over 20,000 hostile frames and HTTP bodies (20-25 s a test)"),
    ("tests/e2e/test_benchmark_e2e_latency.py::*", "the end-to-end benchmark with a tiny torch engine (~24 s)"),
    ("tests/e2e/test_demo_long_input.py::*", "22 s and 12 s of input sent in real time (~20 s a test)"),
    ("tests/unit/test_benchmark_cli.py::test_gpu_engine_exits_non_zero_when_units_fail",
     "builds the tiny model and runs 14 units"),
    # the heaviest tiny-model tests; the lighter tests of the same files stay in the default
    ("tests/model/test_code2wav.py::test_interleaved_streams_do_not_cross_talk",
     "two voices, 12 pushes of the tiny flow (the longest Code2Wav test)"),
    ("tests/model/test_code2wav.py::test_streams_of_one_voice_share_its_base_cache_until_they_speak",
     "several streams of the tiny flow"),
    ("tests/model/test_code2wav.py::test_turn_reset_restores_state", "two full turns of the tiny flow"),
    ("tests/model/test_code2wav.py::test_prompt_features_cached_by_content_hash", "prompt features of fresh voices"),
    ("tests/model/test_code2wav_batch.py::test_batched_code2wav_equals_per_stream_path[[]*-whole[]]",
     "the whole-batch case; the pad and sub-batch cases of the same check stay in the default"),
    ("tests/model/test_code2wav_batch.py::test_turn_end_sub_batch_that_runs_out_of_memory_is_redone_in_halves*",
     "a turn-end batch redone in halves, twice over"),
    ("tests/e2e/test_client_parity.py::test_parity_tiny[[]seeded[]]",
     "seeded sampling on the tiny model over three transports; [greedy] stays in the default"),
    ("tests/e2e/test_voice_notes_example.py::test_voice_notes_agent_on_the_tiny_model_says_its_weights_are_random",
     "the voice-notes example on the tiny model"),
    ("tests/e2e/test_engine_process_tiny.py::*", "speech through the engine process on the tiny model"),
    ("tests/e2e/test_client_formats_and_echo.py::test_own_voice_through_the_speakers_neither_barges_in_nor_starts_a_turn[[]40[]]",
     "the same echo path as [80] (which stays in the default) at another speaker delay"),
    ("tests/e2e/test_client_formats_and_echo.py::test_own_voice_through_the_speakers_neither_barges_in_nor_starts_a_turn[[]120[]]",
     "the same echo path as [80] (which stays in the default) at another speaker delay"),
)


def slow_reason(nodeid: str) -> str | None:
    """The reason ``nodeid`` is in the slow group (:data:`SLOW`), or None."""
    from fnmatch import fnmatchcase

    return next((why for pattern, why in SLOW if fnmatchcase(nodeid, pattern)), None)


# --- parallel workers ---------------------------------------------------------------------------------
# `scripts/test.sh` runs the default selection and `--all` with two pytest-xdist workers
# (`-n 2 --dist loadgroup`): most of the suite waits on real processes, sockets and audio sent in real
# time, so two workers share 2 cores well. Each test file is one unit of work (its module fixtures, a
# server process for instance, are built once), except the in-process model and engine tests, which are
# one unit together: they share the test process's tiny engine and Code2Wav flow (~2.24 GB each,
# docs/model.md §7.5), so they run in one worker, one after the other, as they always have.
#: node-id prefixes of the tests that run together in one worker (the group's name: "engine")
ENGINE_GROUP = ("tests/model/", "tests/engine/")


def xdist_group(nodeid: str) -> str:
    """The pytest-xdist group of ``nodeid``: ``"engine"`` for :data:`ENGINE_GROUP`, else its file."""
    path = nodeid.split("::", 1)[0]
    return "engine" if path.startswith(ENGINE_GROUP) else path


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker, and before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """Mark the tests that :data:`SLOW` names `slow` (deselect them with ``-m "not slow"``), and put
    every test in its pytest-xdist group (:func:`xdist_group`; used with ``--dist loadgroup``)."""
    for item in items:
        why = slow_reason(item.nodeid)
        if why is not None:
            item.add_marker(pytest.mark.slow(reason=why))
        item.add_marker(pytest.mark.xdist_group(xdist_group(item.nodeid)))
