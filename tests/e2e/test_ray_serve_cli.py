"""``duplexkit serve scripted --ray-replicas N`` as a real process (docs/deployment.md, "Ray Serve"):
it serves through Serve's proxy, SIGTERM drains each replica (``session.closed{reason:"shutdown"}``)
and exits 0; an engine that cannot load ends with status 4."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys

import httpx
import pytest
import websockets
from _timing import bound

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (python -m pip install 'duplexkit[ray]')")

pytestmark = [pytest.mark.e2e, pytest.mark.ray, pytest.mark.timeout(bound(600))]

CMD = [sys.executable, "-m", "duplexkit.cli", "serve", "scripted", "--ray-cpus-per-replica", "0.5"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)  # a new local cluster
    return env


async def test_serve_ray_replicas_serves_and_sigterm_drains_every_replica(tmp_path):
    port = _free_port()
    # the log goes to a file: Ray forwards every replica's log lines, which could fill a pipe
    # nobody reads and block the command
    log = (tmp_path / "serve.log").open("wb")
    proc = subprocess.Popen([*CMD, "--ray-replicas", "2", "--port", str(port), "--drain-s", "2"],
                            stdout=subprocess.DEVNULL, stderr=log, env=_env())

    def tail() -> str:
        return (tmp_path / "serve.log").read_text(errors="replace")[-3000:]

    try:
        async with httpx.AsyncClient() as http:
            for _ in range(int(bound(400))):  # the cluster and both replicas start (a minute when loaded)
                assert proc.poll() is None, tail()
                try:
                    r = await http.get(f"http://127.0.0.1:{port}/ready", timeout=30)
                    if r.status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(1)
            else:
                pytest.fail(f"not ready after {bound(400):.0f} tries a second apart:\n{tail()}")
        assert r.json()["replica"] == r.headers["x-duplexkit-replica"]
        ws = await websockets.connect(f"ws://127.0.0.1:{port}/v1/realtime?duplex=1", open_timeout=bound(60))
        assert json.loads(await ws.recv())["type"] == "session.created"
        proc.send_signal(signal.SIGTERM)
        events = []
        try:
            async with asyncio.timeout(bound(180)):
                while True:
                    events.append(json.loads(await ws.recv()))
        except websockets.ConnectionClosed:
            pass
        assert events[-1]["type"] == "session.closed" and events[-1]["reason"] == "shutdown", (events, tail())
        assert ws.close_code == 1001
        assert await asyncio.to_thread(proc.wait, bound(180)) == 0, tail()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def test_an_engine_that_cannot_load_ends_with_status_4():
    port = _free_port()
    proc = subprocess.run([*CMD, "--ray-replicas", "1", "--port", str(port), "--scripted", "no_such_option=1"],
                          capture_output=True, text=True, env=_env(), timeout=bound(500))
    assert proc.returncode == 4, proc.stderr[-2000:]
    assert "error: engine failed to load on Ray Serve" in proc.stderr
