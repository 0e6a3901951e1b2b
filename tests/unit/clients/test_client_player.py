"""The clients with a player that implements exactly :class:`duplexkit.audio.Player` (no
``on_render``, no ``forget``, no ``start``/``stop``): it works with ``echo`` off; echo control, which
needs ``on_render`` (:class:`duplexkit.audio.RenderingPlayer`), is refused with a TypeError at
construction instead of an AttributeError in the middle of ``send_audio``."""

from __future__ import annotations

import asyncio
from typing import Callable, Optional

import numpy as np
import pytest

from duplexkit.audio import EchoConfig, ForgettingPlayer, PlaybackBuffer, Player, RenderingPlayer
from duplexkit.clients import DuplexClient, InlineDuplexClient
from duplexkit.clients import state as cs
from duplexkit.testing import ScriptedEngine


class MinimalPlayer:
    """Exactly the Player protocol; a PlaybackBuffer inside is the test's sound card (``_play``)."""

    def __init__(self) -> None:
        self._buf = PlaybackBuffer()
        self.sample_rate = self._buf.sample_rate

    def enqueue(self, response_id: str, pcm: np.ndarray) -> int:
        return self._buf.enqueue(response_id, pcm)

    def flush(self, response_id: Optional[str] = None) -> int:
        return self._buf.flush(response_id)

    def played_ms(self, response_id: str) -> int:
        return self._buf.played_ms(response_id)

    def queued_samples(self, response_id: Optional[str] = None) -> int:
        return self._buf.queued_samples(response_id)

    def on_drained(self, callback: Callable[[str], None]) -> None:
        self._buf.on_drained(callback)

    def _play(self, ms: int) -> None:
        self._buf.read(ms * self.sample_rate // 1000)


class RenderingMinimalPlayer(MinimalPlayer):
    def on_render(self, callback: Callable[[np.ndarray], None]) -> None:
        self._buf.on_render(callback)


def test_the_minimal_player_is_a_player_without_the_optional_capabilities():
    public = {n for n in dir(MinimalPlayer()) if not n.startswith("_")}
    assert public == {"sample_rate", "enqueue", "flush", "played_ms", "queued_samples", "on_drained"}
    assert isinstance(MinimalPlayer(), Player)
    assert not isinstance(MinimalPlayer(), RenderingPlayer) and not isinstance(MinimalPlayer(), ForgettingPlayer)
    assert isinstance(RenderingMinimalPlayer(), RenderingPlayer)


def inline(player, **kw) -> InlineDuplexClient:
    return InlineDuplexClient(ScriptedEngine(units_per_turn=3), answer_policy="on_request",
                              session={"turn_detection": None}, player=player, **kw)


async def _answer(c) -> object:
    await c.send_audio(np.zeros(16_000, np.float32))
    h = await c.create_response()
    await h.wait(10)
    return h


@pytest.mark.parametrize("echo", [None, "off", False])
async def test_a_minimal_player_plays_a_whole_answer_and_a_barged_in_one(echo):
    player = MinimalPlayer()
    async with inline(player, echo=echo) as c:
        h = await _answer(c)
        assert h.audio_ms == 3000 and h.audible and c.speaking
        player._play(3000)
        assert await h.wait_heard(5) == 3000
        await asyncio.sleep(0.05)  # on_drained comes back through the event loop
        assert h.heard_final and h.acked_ms == 3000  # reported fully heard by the player's clock
        h2 = await _answer(c)
        player._play(1200)
        assert await c.barge_in() is h2
        assert not c.speaking and h2.played_ms == 1200 and h2.acked_ms == 1200
        assert player.queued_samples() == 0


@pytest.mark.parametrize("echo", ["gate", "aec", "auto", True, EchoConfig(mode="gate")])
def test_echo_control_without_on_render_is_refused_at_construction(echo):
    for make in (lambda: inline(MinimalPlayer(), echo=echo),
                 lambda: DuplexClient("ws://127.0.0.1:9", player=MinimalPlayer(), echo=echo)):
        with pytest.raises(TypeError, match="on_render"):
            make()


async def test_echo_gate_with_a_player_that_reports_what_it_plays():
    player = RenderingMinimalPlayer()
    async with inline(player, echo="gate") as c:
        h = await _answer(c)
        assert c._echo is not None and c._echo.mode == "gate"
        player._play(500)  # the rendered blocks reach the echo control's reference
        await c.send_audio(np.zeros(1600, np.float32))
        assert c._echo.echo_active
        player._play(2500)
        assert await h.wait_heard(5) == 3000


def test_what_is_not_a_player_is_refused_naming_what_it_lacks():
    class NotAPlayer:
        def enqueue(self, response_id, pcm):
            return 0

    with pytest.raises(TypeError, match="flush.*on_drained|on_drained.*flush"):
        inline(NotAPlayer())
    with pytest.raises(TypeError, match="sample_rate"):
        cs.ClientState(NotAPlayer())


def test_old_responses_are_forgotten_without_a_forget_method():
    st = cs.ClientState(MinimalPlayer())
    for i in range(cs.MAX_KEPT_RESPONSES + 10):
        rid = f"resp_{i}"
        st.receive({"type": "response.created", "response": {"id": rid, "status": "in_progress"}})
        st.receive({"type": "response.done", "response": {"id": rid, "status": "completed"}})
    assert len(st.responses) <= cs.MAX_KEPT_RESPONSES
