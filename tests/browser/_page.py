"""Helpers shared by the browser tests: a getUserMedia recorder and ``/health`` polling."""

from __future__ import annotations

import time

import httpx
from _timing import bound

# Records every stream and error of getUserMedia before the page's own script runs.
TRACK_MIC = """
window.__mic = { streams: [], errors: [], constraints: [], done: 0 };
const __gum = navigator.mediaDevices.getUserMedia.bind(navigator.mediaDevices);
navigator.mediaDevices.getUserMedia = async (c) => {
  window.__mic.constraints.push(c);
  try { const s = await __gum(c); window.__mic.streams.push(s); return s; }
  catch (e) { window.__mic.errors.push(e.name); throw e; }
  finally { window.__mic.done++; }
};
"""
TRACK_STATES = "() => window.__mic.streams.flatMap(s => s.getTracks().map(t => t.readyState))"


def health(srv) -> dict:
    return httpx.get(srv.url + "/health", timeout=bound(10)).json()


def wait_health(srv, pred, timeout_s: float, what: str) -> dict:
    """Poll ``/health`` until ``pred`` holds; fails after ``timeout_s`` (a bound, scaled by
    ``DUPLEXKIT_TEST_TIME_SCALE``)."""
    deadline = time.monotonic() + bound(timeout_s)
    h = health(srv)
    while not pred(h):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: /health is {h}")
        time.sleep(0.2)
        h = health(srv)
    return h
