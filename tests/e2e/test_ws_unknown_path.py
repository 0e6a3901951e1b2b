"""A WebSocket to a path the server does not have (a typo such as ``/v1/realtim``) is a 404 that
names the endpoints, and the clients say the URL is wrong, not that the API key was refused.
Against a real ``duplexkit serve scripted`` process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import websockets
from _serverproc import ServerProc
from _timing import bound

from duplexkit.clients import DuplexClient
from duplexkit.errors import DuplexConnectionError

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def srv():
    with ServerProc("scripted", "--answer-policy", "on_request") as s:
        yield s


async def test_unknown_websocket_path_is_404_naming_the_endpoints(srv):
    with pytest.raises(websockets.InvalidStatus) as ei:
        async with websockets.connect(srv.ws_url + "/v1/realtim", open_timeout=bound(20)):
            pass
    assert ei.value.response.status_code == 404
    err = json.loads(ei.value.response.body)["error"]
    assert err["type"] == "invalid_request_error"
    assert "no WebSocket endpoint at /v1/realtim" in err["message"]
    assert "/v1/realtime" in err["message"] and "/v1/duplex" in err["message"]
    # the real routes are untouched: a session opens on /v1/realtime, HTTP 404s stay HTTP 404s
    async with websockets.connect(srv.ws_url + "/v1/realtime?duplex=1", open_timeout=bound(20)) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
    assert httpx.get(srv.url + "/v1/realtim", timeout=bound(10)).status_code == 404
    assert httpx.get(srv.url + "/health", timeout=bound(10)).status_code == 200


async def test_client_reports_a_wrong_path_not_a_refused_key(srv):
    url = srv.ws_url + "/v1/realtim"
    client = DuplexClient(url, request_timeout_s=bound(30))
    with pytest.raises(DuplexConnectionError) as ei:
        await client.connect()
    e = ei.value
    assert e.code == "connection_failed", (e.code, e.message)
    assert e.message.startswith(f"no WebSocket endpoint at {url} (HTTP 404): ")  # without the query
    assert "/v1/duplex" in e.message and "API key" not in e.message


def test_cli_wrong_path_is_one_line_naming_the_url(srv):
    url = srv.ws_url + "/v1/realtim"
    r = subprocess.run([sys.executable, "-m", "duplexkit", "demo", "--url", url, "-o", "/dev/null"],
                       cwd=str(REPO), capture_output=True, text=True, timeout=bound(120))
    assert r.returncode == 3, r.stderr
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert len(err) == 1 and f"no WebSocket endpoint at {url}" in err[0], r.stderr
    assert "refused the API key" not in r.stderr
