"""Over a real socket: a whole file sent at once (input ahead of real time), then
``response.create``: the answer's audio arrives at least as fast as real time when the engine computes a
unit in less than a unit period.

``duplexkit serve scripted`` with 0.3 s of simulated compute per unit and 10-unit answers (10 s of audio:
20 160 + 9 x 24 000 + the 3 840-sample flush). After the whole file the input is dry, so the answer is
carried by the Session's silence units; they used to come every 1.30 s (1 unit period + the 250 ms
``silence_slack_ms`` + a tick, again for every unit), so the answer arrived as 1 s of audio every 1.30 s
(2.9 s of gaps). Now they follow the unit schedule: after the first chunk, each chunk arrives before the
audio before it has played, give or take delivery jitter. The allowance (0.75 s, scaled by
DUPLEXKIT_TEST_TIME_SCALE) is well under the 2.4 s the old cadence lost over the same 8 units.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from duplexkit.audio import read_wav
from duplexkit.clients import DuplexClient

from _serverproc import ServerProc
from _timing import bound

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def paced_server():
    with ServerProc("scripted", "--answer-policy", "on_request", "--scripted", "units_per_turn=10",
                    "--scripted", "unit_delay_s=0.3") as srv:
        yield srv


async def test_a_whole_file_at_once_is_answered_at_least_in_real_time(paced_server, fixtures_audio):
    speech, _ = read_wav(fixtures_audio / "question_16k.wav", 16_000)
    async with DuplexClient(paced_server.ws_url, session={"turn_detection": None}) as c:
        await c.send_audio(speech, rate=16_000)  # 3.5 s in one append
        await c.commit()
        h = await c.create_response()
        chunks = []
        async for a in h.audio():
            chunks.append((time.monotonic(), len(a)))
        done = await h.wait(bound(60))
    assert done.response.status == "completed"
    sizes = [n for _, n in chunks]
    assert sum(sizes) == 240_000, sizes
    # the steady part, from chunk 1 (the 2nd unit) on: a player that starts it on arrival never waits, give or
    # take the allowance (chunk k is there before chunks 1..k-1 have played); the first chunk (840 ms, the
    # vocoder's held-back tail) and the first dry-spell grace are paid once, before it
    t = [tc for tc, _ in chunks]
    played = np.cumsum([0] + sizes[1:-1]) / 24_000  # audio of chunks 1..k-1 when chunk k arrives
    late = [t[k] - t[1] - played[k - 1] for k in range(1, len(t))]
    assert max(late) <= bound(0.75), (
        f"chunk {1 + int(np.argmax(late))} came {max(late):.2f} s after the audio before it had played; "
        f"gaps {np.round(np.diff(t), 2).tolist()}")
