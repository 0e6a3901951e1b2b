"""Cheap checks that run before anything heavy: no torch, no model code, no server, no socket.

The ``duplexkit`` CLI calls :func:`check_model` before it binds a port or imports torch, so a wrong
path, a broken ``config.json``, missing weight files or a GPU layout on a machine without a GPU are
refused within a second instead of after a long import. :func:`fetch_health` lets remote clients
(``demo --url``, ``chat --url``, the examples) read a server's ``/health`` and say when it runs
random weights.

The model checks live in :mod:`duplexkit.engine.checks` (the engine's loader runs them too) and are
re-exported here; this module adds the remote-server helpers. Everything here imports only the
standard library, numpy-free modules of duplexkit and (for a layout) ``duplexkit.engine.layout``
(pyyaml); ``httpx`` when a server is asked.
"""

from __future__ import annotations

from typing import Optional

from duplexkit.engine.checks import (BUILTIN_MODELS, RANDOM_WEIGHTS_NOTICE, PreflightError, check_checkpoint_dir,
                                     check_layout, check_model, visible_cuda_devices)

__all__ = ["PreflightError", "check_checkpoint_dir", "check_layout", "check_model", "visible_cuda_devices",
           "http_base_url", "fetch_health", "RANDOM_WEIGHTS_NOTICE", "BUILTIN_MODELS"]



# ---------------------------------------------------------------------------------------------
# remote servers
# ---------------------------------------------------------------------------------------------


def http_base_url(url: str) -> str:
    """``ws://h:p/v1/realtime?x`` or ``http://h:p/v1/chat/completions`` -> ``http://h:p`` (wss -> https)."""
    u = url.strip()
    if u.startswith("ws://"):
        u = "http://" + u[5:]
    elif u.startswith("wss://"):
        u = "https://" + u[6:]
    u = u.split("?", 1)[0]
    if "/v1/" in u or u.endswith("/v1"):
        u = u.split("/v1", 1)[0]
    return u.rstrip("/")


def fetch_health(url: str, *, timeout_s: float = 5.0) -> Optional[dict]:
    """GET ``/health`` of the server behind ``url`` (any of its ws/http URLs).

    Returns the JSON object, or None when the server cannot be reached or does not answer JSON
    (the caller's own request then reports the real error). ``/health`` needs no API key.
    """
    import httpx

    try:
        r = httpx.get(http_base_url(url) + "/health", timeout=timeout_s)
        data = r.json()
    except (httpx.HTTPError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def remote_random_weights(url: str, *, timeout_s: float = 5.0) -> bool:
    """True when the server's ``/health`` reports ``random_weights: true``."""
    health = fetch_health(url, timeout_s=timeout_s)
    return bool(health and health.get("random_weights"))
