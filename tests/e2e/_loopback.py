"""Test helpers for resume tests: an in-process uvicorn server on a loopback port, and a TCP proxy
that cuts every connection (RST, no close frame) once the server has sent a given number of a
marker string (e.g. the 2nd ``response.output_audio.delta``)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Optional
from _timing import bound


@contextlib.asynccontextmanager
async def inprocess_server(app):
    """Serve ``app`` with uvicorn on 127.0.0.1:<free port> in this event loop; yields the port."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", ws_ping_interval=None, ws_ping_timeout=None,
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None  # older uvicorn; newer ones only capture in the main thread
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    for _ in range(2000):
        if server.started or task.done():
            break
        await asyncio.sleep(0.01)
    if task.done():
        task.result()
    try:
        yield port
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, bound(30))
        sock.close()


class CuttingProxy:
    """A loopback TCP proxy to ``127.0.0.1:target_port``.

    ``cut_after``: (marker bytes, count): when the server->client stream has carried ``count``
    occurrences of ``marker`` (counted over every connection), every open connection is aborted
    (TCP RST both ways: the client sees close 1006, the server a dropped socket). Later connections
    pass untouched. ``cut_now()`` aborts every open connection at once.
    """

    def __init__(self, target_port: int, cut_after: Optional[tuple[bytes, int]] = None) -> None:
        self.target_port = target_port
        self.cut_after = cut_after
        self.seen = 0
        self.cuts = 0
        self.connections = 0
        self.bytes_to_client = 0
        self._pairs: list = []
        self._server: Optional[asyncio.base_events.Server] = None
        self.port = 0
        #: while True, new connections are reset at once (a client that cannot get back in)
        self.blocked = False
        #: while True, client->server bytes are read and dropped (lost in flight)
        self.blackhole = False
        self.bytes_dropped = 0
        self.block_after_cut = False

    async def start(self) -> "CuttingProxy":
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        self.cut_now(count=False)
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def cut_now(self, count: bool = True) -> None:
        for cw, sw in self._pairs:
            for w in (cw, sw):
                w.transport.abort()
        if self._pairs and count:
            self.cuts += 1
        self._pairs.clear()

    async def _accept(self, creader, cwriter) -> None:
        if self.blocked:
            cwriter.transport.abort()
            return
        self.connections += 1
        sreader, swriter = await asyncio.open_connection("127.0.0.1", self.target_port)
        pair = (cwriter, swriter)
        self._pairs.append(pair)
        await asyncio.gather(self._pump(creader, swriter, False), self._pump(sreader, cwriter, True),
                             return_exceptions=True)
        for w in pair:
            w.transport.abort()
        if pair in self._pairs:
            self._pairs.remove(pair)

    async def _pump(self, reader, writer, to_client: bool) -> None:
        tail = b""
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    writer.close()
                    return
                if to_client and self.cut_after is not None and self.cuts == 0:
                    marker, count = self.cut_after
                    buf = tail + data
                    n = buf.count(marker)
                    if self.seen + n >= count:
                        # forward up to the end of the count-th marker plus a few bytes (a frame cut
                        # in the middle), then abort everything
                        idx = -1
                        for _ in range(count - self.seen):
                            idx = buf.index(marker, idx + 1)
                        keep = max(0, idx + len(marker) + 40 - len(tail))
                        writer.write(data[:keep])
                        self.bytes_to_client += keep
                        self.seen = count
                        await writer.drain()
                        self.blocked = self.block_after_cut
                        self.cut_now()
                        return
                    self.seen += n
                    tail = buf[-(len(marker) - 1):]
                if to_client:
                    self.bytes_to_client += len(data)
                elif self.blackhole:
                    self.bytes_dropped += len(data)
                    continue
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError, asyncio.CancelledError):
            return
