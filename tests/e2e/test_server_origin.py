"""Origin and Host policy of the bundled server (docs/server.md, "Security"), against real
``duplexkit serve scripted`` processes: a hostile page cannot open a session or POST to chat."""

from __future__ import annotations

import json

import httpx
import pytest
import websockets
from _serverproc import ServerProc
from _timing import bound

pytestmark = pytest.mark.e2e

ALLOWED = "https://app.example.com"
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def srv():
    with ServerProc("scripted", "--answer-policy", "on_request", "--allow-origin", ALLOWED) as s:
        yield s


async def _ws_status(url: str, **kw) -> object:
    """The session.created type on success (an error event: its type and code), or the HTTP status
    of a refused handshake."""
    try:
        async with websockets.connect(url, open_timeout=bound(20), **kw) as ws:
            first = json.loads(await ws.recv())
            return first["type"] if first["type"] != "error" else ("error", first["error"]["code"])
    except websockets.InvalidStatus as exc:
        return exc.response.status_code


async def test_cross_origin_websocket_refused(srv):
    url = srv.ws_url + "/v1/realtime"
    assert await _ws_status(url, origin="http://evil.example") == 403
    assert await _ws_status(url, origin="null") == 403
    assert await _ws_status(url, origin=f"http://localhost:{srv.port + 1}") == 403  # another local app
    # the refusal is an OpenAI error body, code unauthorized
    with pytest.raises(websockets.InvalidStatus) as ei:
        async with websockets.connect(url, origin="http://evil.example"):
            pass
    body = json.loads(ei.value.response.body)
    assert body["error"]["code"] == "unauthorized" and "--allow-origin" in body["error"]["message"]


async def test_same_origin_localhost_variants_and_allow_list_accepted(srv):
    url = srv.ws_url + "/v1/realtime"
    for origin in (f"http://127.0.0.1:{srv.port}", f"http://localhost:{srv.port}", f"http://[::1]:{srv.port}",
                   ALLOWED, None):
        kw = {"origin": origin} if origin else {}
        srv.wait_idle()  # the previous session's slot is free (the per-client cap is 4 of 8)
        assert await _ws_status(url, **kw) == "session.created", origin


async def test_dns_rebinding_host_refused(srv):
    # a page on evil.example re-bound to 127.0.0.1: same "origin" as its Host, but Host is not loopback
    r = httpx.get(srv.url + "/v1/models", headers={"Host": f"evil.example:{srv.port}"})
    assert r.status_code == 403
    assert await _ws_status(srv.ws_url + "/v1/realtime", origin=f"http://evil.example:{srv.port}",
                            additional_headers={"Host": f"evil.example:{srv.port}"}) == 403


def test_cross_origin_text_plain_post_refused(srv):
    # a <form enctype=text/plain> / fetch(no-cors) POST needs no preflight: it must be refused by Origin
    hostile = {"Origin": "http://evil.example", "Content-Type": "text/plain"}
    r = httpx.post(srv.url + "/v1/chat/completions", content=json.dumps(CHAT), headers=hostile)
    assert r.status_code == 403 and r.json()["error"]["code"] == "unauthorized"
    same = {"Origin": srv.url, "Content-Type": "application/json"}
    assert httpx.post(srv.url + "/v1/chat/completions", json=CHAT, headers=same, timeout=30).status_code == 200
    r = httpx.post(srv.url + "/v1/chat/completions", json=CHAT, headers={"Origin": ALLOWED}, timeout=30)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ALLOWED
    # GET stays readable (no state change); CORS still hides it from other origins
    r = httpx.get(srv.url + "/v1/models", headers={"Origin": "http://evil.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_page_security_headers_and_static_nul(srv):
    r = httpx.get(srv.url + "/")
    assert r.status_code == 200
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp and "'unsafe-inline'" not in csp
    assert f"ws://127.0.0.1:{srv.port}" in csp
    assert r.headers["x-content-type-options"] == "nosniff" and r.headers["x-frame-options"] == "DENY"
    assert httpx.get(srv.url + "/static/app.js").headers["x-content-type-options"] == "nosniff"
    assert httpx.get(srv.url + "/static/%00").status_code == 404
    assert httpx.get(srv.url + "/static/..%2F__init__.py").status_code == 404


async def test_key_alone_as_subprotocol_not_echoed():
    with ServerProc("scripted", "--api-key", "sk-x") as s:
        async with websockets.connect(s.ws_url + "/v1/realtime", subprotocols=["openai-insecure-api-key.sk-x"]) as ws:
            assert ws.subprotocol is None
            assert json.loads(await ws.recv())["type"] == "session.created"


def test_public_bind_without_key_warns_and_serves_any_host():
    with ServerProc("scripted", "--host", "0.0.0.0") as s:
        assert httpx.get(s.url + "/v1/models", headers={"Host": "voice.example.com"}).status_code == 200
        assert httpx.post(s.url + "/v1/chat/completions", json=CHAT,
                          headers={"Origin": "http://evil.example"}).status_code == 403
        out = s.output()
    assert "without an API key" in out
