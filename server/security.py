"""Browser-facing protection of the bundled server: Origin and Host policy, security headers.

A web page in any tab can open a WebSocket to ``ws://127.0.0.1:8000`` (CORS does not apply to
WebSockets) and can POST a ``text/plain`` body to any URL without a preflight. With auth off (the
default) such a page could drive a local server. :class:`OriginPolicyMiddleware` refuses that:

* **Origin.** A WebSocket upgrade, or an HTTP request with a state-changing method (anything but
  ``GET``/``HEAD``/``OPTIONS``), that carries an ``Origin`` header is served only when that origin
  is allowed: the server's own origin (the ``Origin`` host equals the ``Host`` header), the loopback
  variants of it (``localhost``, ``127.0.0.1``, ``[::1]`` on the server's port) when the server is
  bound to a loopback address, or an entry of ``--allow-origin`` (``*`` allows every origin).
  Requests without ``Origin`` (curl, SDKs, ``websockets``) are not browser requests and pass.
* **Host.** When bound to loopback, the ``Host`` header must name a loopback host (or the host of an
  allowed origin): a page whose DNS name was re-bound to 127.0.0.1 (DNS rebinding) is refused.

A refusal is HTTP 403 with an OpenAI error body, code ``unauthorized`` (docs/protocol.md §9). For a
WebSocket the 403 is the handshake answer (the ASGI ``websocket.http.response`` extension) where the
ASGI server supports it, else the upgrade is closed with 1008 before it is accepted.

:func:`page_headers` gives the security headers of the browser page (CSP, framing, referrer,
content-type sniffing, permissions).
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
import logging
import re
from typing import Iterable, Optional
from urllib.parse import urlsplit

from duplexkit.errors import ERROR_TYPES, ErrorCode
from duplexkit.protocol.vocabulary import CloseCode

logger = logging.getLogger("duplexkit.server.security")

__all__ = ["OriginPolicy", "OriginPolicyMiddleware", "is_loopback_host", "page_headers", "style_hashes"]

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}
_HOST_RE = re.compile(r"^[A-Za-z0-9.\-\[\]:]{1,255}$")


def is_loopback_host(host: Optional[str]) -> bool:
    """True for ``localhost``, ``*.localhost``, 127.0.0.0/8 and ``::1`` (``[::1]`` too)."""
    if not host:
        return False
    h = host.strip().lower().strip("[]")
    if h == "localhost" or h.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def _split_hostport(value: str, scheme: str = "http") -> Optional[tuple[str, int]]:
    """``"host:port"`` (a Host header) -> (lower-case host without brackets, port) or None."""
    try:
        parts = urlsplit(f"{scheme}://{value}")
        host, port = parts.hostname, parts.port
    except ValueError:
        return None
    if not host:
        return None
    return host.lower(), port if port is not None else _DEFAULT_PORTS.get(scheme, 80)


def _origin_tuple(origin: str) -> Optional[tuple[str, str, int]]:
    """``"scheme://host[:port]"`` -> (scheme, host, port) or None (``null`` and junk)."""
    try:
        parts = urlsplit(origin.strip())
        host, port = parts.hostname, parts.port
    except ValueError:
        return None
    scheme = (parts.scheme or "").lower()
    if not host or scheme not in _DEFAULT_PORTS:
        return None
    return scheme, host.lower(), port if port is not None else _DEFAULT_PORTS[scheme]


class OriginPolicy:
    """Which browser origins and Host names the server serves (see the module docstring).

    Args:
        allow_origins: extra allowed origins, e.g. ``["https://app.example.com"]``; ``"*"`` allows all,
            ``"null"`` allows the opaque origin of ``file://`` pages and sandboxed frames.
        bind_host: the address the server listens on (None: treated as loopback, as for an app
            built in-process for tests).
        port: the listening port (None: any port of a loopback origin is the server's own).
    """

    def __init__(self, allow_origins: Iterable[str] = (), bind_host: Optional[str] = None,
                 port: Optional[int] = None) -> None:
        self.allow_any = False
        self.allow_null = False
        self.allowed: set[tuple[str, str, int]] = set()
        for o in allow_origins or ():
            o = o.strip()
            if o == "*":
                self.allow_any = True
            elif o.lower() == "null":
                self.allow_null = True
            else:
                t = _origin_tuple(o)
                if t is None:
                    raise ValueError(f"--allow-origin {o!r} is not an origin like https://host[:port]")
                self.allowed.add(t)
        self.loopback = bind_host is None or is_loopback_host(bind_host)
        self.port = port

    def host_allowed(self, host_header: Optional[str]) -> bool:
        """The ``Host`` check (DNS rebinding): any host unless bound to loopback."""
        if not self.loopback or self.allow_any:
            return True
        if not host_header:
            return True  # HTTP/1.0 without Host: not a browser
        hp = _split_hostport(host_header)
        if hp is None:
            return False
        return is_loopback_host(hp[0]) or any(hp[0] == h for _, h, _ in self.allowed)

    def origin_allowed(self, origin: Optional[str], host_header: Optional[str]) -> bool:
        """May a request carrying ``Origin: origin`` (None: no header) change state or open a session?"""
        if origin is None or self.allow_any:
            return True
        if origin.strip().lower() == "null":
            return self.allow_null
        t = _origin_tuple(origin)
        if t is None:
            return False
        if t in self.allowed:
            return True
        scheme, host, port = t
        if host_header:
            hp = _split_hostport(host_header, "https" if scheme in ("https", "wss") else "http")
            if hp is not None and hp == (host, port):
                return True  # same origin as the page the server handed out
        if self.loopback and is_loopback_host(host):
            return self.port is None or port == self.port
        return False


def _forbidden_body(message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": ERROR_TYPES[ErrorCode.UNAUTHORIZED], "param": None,
                                 "code": ErrorCode.UNAUTHORIZED.value}}).encode()


class OriginPolicyMiddleware:
    """Pure ASGI middleware applying :class:`OriginPolicy` to HTTP and WebSocket scopes.

    ``policy`` may be a callable returning the current policy (the bind address is known only when
    :func:`duplexkit_server.app.serve` starts).
    """

    def __init__(self, app, policy) -> None:
        self.app = app
        self._policy = policy

    @property
    def policy(self) -> OriginPolicy:
        return self._policy() if callable(self._policy) else self._policy

    async def __call__(self, scope, receive, send) -> None:
        kind = scope.get("type")
        if kind not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers = {}
        for k, v in scope.get("headers") or ():
            headers.setdefault(k.decode("latin-1").lower(), v.decode("latin-1"))
        policy = self.policy
        host = headers.get("host")
        reason = None
        if not policy.host_allowed(host):
            reason = (f"Host {host!r} is not served: this server is bound to a loopback address "
                      "(use --allow-origin to add a host)")
        elif kind == "websocket" or scope.get("method", "GET").upper() not in _SAFE_METHODS:
            origin = headers.get("origin")
            if not policy.origin_allowed(origin, host):
                reason = (f"Origin {origin!r} is not allowed to use this server "
                          "(start it with --allow-origin ORIGIN to allow it)")
        if reason is None:
            return await self.app(scope, receive, send)
        logger.warning("refused %s %s from %s: %s", kind, scope.get("path"),
                       (scope.get("client") or ("?",))[0], reason)
        body = _forbidden_body(reason)
        resp_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if kind == "http":
            await send({"type": "http.response.start", "status": 403, "headers": resp_headers})
            await send({"type": "http.response.body", "body": body})
            return
        await receive()  # websocket.connect
        if "websocket.http.response" in (scope.get("extensions") or {}):
            await send({"type": "websocket.http.response.start", "status": 403, "headers": resp_headers})
            await send({"type": "websocket.http.response.body", "body": body})
        else:
            await send({"type": "websocket.close", "code": int(CloseCode.POLICY_VIOLATION), "reason": "origin not allowed"})


def style_hashes(html: str) -> list[str]:
    """CSP source expressions (``'sha256-…'``) of the inline ``<style>`` blocks of ``html``."""
    out = []
    for m in re.finditer(r"<style[^>]*>(.*?)</style>", html, re.S | re.I):
        digest = base64.b64encode(hashlib.sha256(m.group(1).encode()).digest()).decode()
        out.append(f"'sha256-{digest}'")
    return out


def page_headers(host_header: Optional[str], styles: Iterable[str] = ()) -> dict[str, str]:
    """Security headers for the browser page and its static files.

    The CSP lets the page load only its own scripts (``script-src 'self'``: no inline script, no
    eval), its inline style by hash, talk only to this server (HTTP and ``ws(s)://`` of the same
    host) and never be framed; the page needs the microphone, nothing else.
    """
    connect = ["'self'"]
    if host_header and _HOST_RE.match(host_header):
        connect += [f"ws://{host_header}", f"wss://{host_header}"]
    csp = "; ".join([
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self' " + " ".join(styles) if styles else "style-src 'self'",
        "img-src 'self' data: blob:",
        "media-src 'self' data: blob:",
        "connect-src " + " ".join(connect),
        "worker-src 'self' blob:",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    ])
    return {
        "Content-Security-Policy": csp,
        "X-Content-Type-Options": "nosniff",
        "X-Frame-Options": "DENY",
        "Referrer-Policy": "no-referrer",
        "Cross-Origin-Opener-Policy": "same-origin",
        "Cross-Origin-Resource-Policy": "same-origin",
        "Permissions-Policy": "microphone=(self), camera=(), geolocation=()",
    }


def header_timeout_protocol(timeout_s: float, max_header_bytes: int = 64 * 1024):
    """A uvicorn HTTP protocol class that guards the request head (request line and headers, the
    WebSocket handshake's included) before uvicorn parses it:

    * **time**: a connection whose request head is not complete ``timeout_s`` seconds after the
      connection opened or after the first byte of a next request is closed (slowloris). uvicorn has
      no such timeout of its own (``timeout_keep_alive`` only covers idle connections *between*
      requests).
    * **size**: a head larger than ``max_header_bytes`` is answered ``431 Request Header Fields Too
      Large`` (an OpenAI error body, code ``request_too_large``) once that many bytes arrived, and
      the connection is closed; at most ``max_header_bytes`` of it are ever handed to the parser.
      uvicorn's httptools protocol has no cap (``h11_max_incomplete_event_size`` applies to h11 only),
      so a 64 MiB header used to be parsed whole, blocking the loop for seconds.

    Pass the result as ``uvicorn.Config(http=...)``.
    """
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
        guard_size = True
    except ImportError:  # pragma: no cover - uvicorn without [standard]: h11_max_incomplete_event_size
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
        guard_size = False

    body = json.dumps({"error": {
        "message": f"the request head (request line and headers) is larger than {max_header_bytes} bytes",
        "type": "invalid_request_error", "param": None, "code": "request_too_large"}}).encode()
    too_large = (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
                 b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)

    class HeaderGuardProtocol(base):  # type: ignore[misc, valid-type]
        _hdr_timer = None
        _hdr_cycle = None
        _in_head = True  # the bytes arriving now belong to a request head
        _head_bytes = 0
        _refused = False

        def _arm_header_timer(self) -> None:
            self._hdr_cycle = self.cycle
            self._hdr_timer = self.loop.call_later(timeout_s, self._header_timer_expired)

        def _header_timer_expired(self) -> None:
            self._hdr_timer = None
            if self.transport.is_closing() or self.transport.get_protocol() is not self:
                return  # closed, or upgraded to a WebSocket
            if self.cycle is self._hdr_cycle:  # no request head completed since the timer was armed
                logger.warning("closing %s: request head not complete after %.0f s", self.client, timeout_s)
                self.transport.close()

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_header_timer()

        # -- the size guard (httptools callbacks) --------------------------------------------------
        def on_headers_complete(self) -> None:
            self._in_head = False
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._in_head, self._head_bytes = True, 0  # what follows is the next request's head
            super().on_message_complete()

        def _refuse_head(self) -> None:
            self._refused = True
            logger.warning("refused a request head over %d bytes from %s: 431", max_header_bytes,
                           (self.client or ("?",))[0])
            self.transport.write(too_large)
            # read and drop what the client still sends for a moment, so that the 431 is read before
            # the close (closing with unread input would reset the connection and lose the answer)
            self.loop.call_later(1.0, self.transport.close)

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return  # the 431 is out; the rest of the head is dropped unparsed
            idle = self.cycle is None or self.cycle.response_complete
            if idle and (self._hdr_timer is None or self._hdr_cycle is not self.cycle):
                # the first bytes of a next request on a kept-alive connection: a new deadline
                if self._hdr_timer is not None:
                    self._hdr_timer.cancel()
                self._arm_header_timer()
            if not guard_size:
                return super().data_received(data)
            while data and self._in_head:
                room = max_header_bytes - self._head_bytes
                if room <= 0:
                    self._refuse_head()
                    return
                piece, data = data[:room], data[room:]
                self._head_bytes += len(piece)
                super().data_received(piece)
                if self.transport.is_closing() or self.transport.get_protocol() is not self:
                    return  # answered and closed (a parse error), or upgraded to a WebSocket
            if data:
                super().data_received(data)

        def connection_lost(self, exc) -> None:
            if self._hdr_timer is not None:
                self._hdr_timer.cancel()
                self._hdr_timer = None
            super().connection_lost(exc)

    return HeaderGuardProtocol


def abortable_websocket_protocol():
    """uvicorn's WebSocket protocol (the one ``ws="auto"`` picks) with a scope extension
    ``duplexkit.transport: {"abort": callable}`` that drops the TCP connection at once, buffers and
    all: the only way to end a connection whose peer reads nothing (a close frame waits behind the
    unread data). Used by :mod:`duplexkit_server.realtime` for a peer over the outbound bounds.
    Its ``close_handshake_pending`` tells the graceful shutdown (:func:`duplexkit_server.lifecycle.drain`)
    which connections still wait for the peer's close frame.
    Returns None when that protocol is not the websockets sans-I/O one (uvicorn then picks its own).
    """
    try:
        from uvicorn.protocols.websockets.auto import AutoWebSocketsProtocol
        from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
    except ImportError:  # pragma: no cover
        return None
    if AutoWebSocketsProtocol is not WebSocketsSansIOProtocol:
        return None  # pragma: no cover

    class AbortableWebSocketProtocol(WebSocketsSansIOProtocol):
        @property
        def close_handshake_pending(self) -> bool:
            """True from the moment this side sent its close frame until the connection is gone
            (the peer's close frame came back and the TCP connection was closed, or it dropped).
            Meanwhile uvicorn still reads, and drops, what the peer sends; closing the TCP
            connection then, with the peer's frames unread, resets it (docs/server.md, "Graceful
            shutdown")."""
            return bool(self.close_sent) and not self.disconnected

        def handle_connect(self, event) -> None:  # type: ignore[override]
            super().handle_connect(event)
            scope = getattr(self, "scope", None)
            if scope is not None:  # the ASGI task starts on the next loop turn: it sees the extension
                transport = self.transport
                scope.setdefault("extensions", {})["duplexkit.transport"] = {"abort": transport.abort}

    return AbortableWebSocketProtocol
