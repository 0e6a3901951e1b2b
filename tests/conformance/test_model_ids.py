"""Model ids (docs/server.md, "Model ids"): the served id, ``openbmb/MiniCPM-o-4_5`` and ``--alias``
ids are served and listed; OpenAI ids are mapped by default, or refused with ``model_not_found``
listing the served ids (``--openai-model-ids refuse``), never a bare ``bad_event``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest
import websockets
from _timing import bound

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))

from _serverproc import ServerProc  # noqa: E402


@pytest.fixture(scope="module")
def mapping_server():
    with ServerProc("scripted", "--alias", "my-omni") as srv:
        yield srv


@pytest.fixture(scope="module")
def refusing_server():
    with ServerProc("scripted", "--openai-model-ids", "refuse") as srv:
        yield srv


async def _created(url: str) -> dict:
    async with websockets.connect(url) as ws:
        return json.loads(await ws.recv())


def test_models_lists_served_alias_and_repo_ids(mapping_server):
    ids = [m["id"] for m in httpx.get(mapping_server.url + "/v1/models").json()["data"]]
    assert ids == ["scripted", "my-omni", "openbmb/MiniCPM-o-4_5"]


@pytest.mark.parametrize("model", ["scripted", "my-omni", "openbmb/MiniCPM-o-4_5", "gpt-realtime",
                                   "gpt-4o-realtime-preview-2024-12-17", "gpt-4o-mini-realtime-preview"])
async def test_realtime_accepts(mapping_server, model):
    ev = await _created(f"{mapping_server.ws_url}/v1/realtime?model={model}")
    assert ev["type"] == "session.created" and ev["session"]["model"] == "scripted"


def test_chat_accepts_openai_id(mapping_server):
    r = httpx.post(mapping_server.url + "/v1/chat/completions", timeout=bound(60), json={
        "model": "gpt-4o-audio-preview", "modalities": ["text"], "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200, r.text
    assert "model 'gpt-4o-audio-preview' is an OpenAI model id" in mapping_server.output()


@pytest.mark.parametrize("model", ["gpt-realtime", "llama-3-8b"])
async def test_refused_model_is_model_not_found_listing_served_ids(refusing_server, model):
    async with websockets.connect(f"{refusing_server.ws_url}/v1/realtime?model={model}") as ws:
        err = json.loads(await ws.recv())["error"]
        assert err["code"] == "model_not_found" and err["param"] == "model"
        assert "scripted" in err["message"] and "openbmb/MiniCPM-o-4_5" in err["message"]
        assert ("--openai-model-ids refuse" in err["message"]) == model.startswith("gpt-")
        with pytest.raises(websockets.ConnectionClosed) as ei:
            await ws.recv()
        assert ei.value.rcvd.code == 1008 and ei.value.rcvd.reason == "model_not_found"
    r = httpx.post(refusing_server.url + "/v1/chat/completions", timeout=bound(60), json={
        "model": model, "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_found"


async def test_duplexkit_client_raises_model_not_found(refusing_server):
    from duplexkit.clients import DuplexClient, DuplexConnectionError

    with pytest.raises(DuplexConnectionError) as ei:
        async with DuplexClient(refusing_server.ws_url, model="gpt-realtime"):
            pytest.fail("connected with a refused model")
    assert ei.value.code == "model_not_found" and "openbmb/MiniCPM-o-4_5" in str(ei.value)


def test_models_say_whether_weights_are_random(mapping_server):
    """Every entry carries ``random_weights`` (docs/protocol.md §10.2), false for a real-standing engine,
    true for a random-weight one; the ``openai`` package's ``Model`` still parses each entry."""
    openai_types = pytest.importorskip("openai.types")
    data = httpx.get(mapping_server.url + "/v1/models").json()["data"]
    assert [m["random_weights"] for m in data] == [False] * len(data)
    with ServerProc("scripted", "--scripted", "random_weights=true") as srv:
        data = httpx.get(srv.url + "/v1/models").json()["data"]
        assert "openbmb/MiniCPM-o-4_5" in [m["id"] for m in data]
        assert all(m["random_weights"] is True for m in data), data
        models = [openai_types.Model.model_validate(m) for m in data]
        assert models[0].id == "scripted" and models[0].random_weights is True
        one = httpx.get(srv.url + "/v1/models/openbmb/MiniCPM-o-4_5").json()
        assert one["random_weights"] is True
        assert openai_types.Model.model_validate(one).id == "openbmb/MiniCPM-o-4_5"
