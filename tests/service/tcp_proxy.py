"""A TCP proxy on 127.0.0.1 (asyncio, in the test's event loop) that can make its connections half-open.

proxy = await BlackHoleProxy.start("127.0.0.1", 6379)    # proxy.url: redis://127.0.0.1:<port>/0
proxy.stall()      # every open connection stops forwarding, both ways, and is NOT closed (a partition, a NAT
                   # that forgot the flow): bytes sent into it vanish, no reply, no reset, no EOF
proxy.partition()  # the same, and connections opened meanwhile are accepted and black-holed too
proxy.heal()       # connections opened from now on forward again (the black-holed ones stay silent)
proxy.first_reply_after_stall  # monotonic time of the first bytes the server sent a client after `stall`
await proxy.close()
"""

from __future__ import annotations

import asyncio
import time


class _Link:
    def __init__(self, client_writer: asyncio.StreamWriter, server_writer: asyncio.StreamWriter):
        self.writers = (client_writer, server_writer)
        self.dead = False  # black-holed: nothing is forwarded any more, the sockets stay open
        self.tasks: list[asyncio.Task] = []


class BlackHoleProxy:
    def __init__(self, target_host: str, target_port: int):
        self.target = (target_host, target_port)
        self.links: list[_Link] = []
        self.partitioned = False
        self.stalled_at: float | None = None
        self.first_reply_after_stall: float | None = None
        self.connections = 0
        self._server: asyncio.Server | None = None

    @classmethod
    async def start(cls, target_host: str = "127.0.0.1", target_port: int = 6379) -> BlackHoleProxy:
        proxy = cls(target_host, target_port)
        proxy._server = await asyncio.start_server(proxy._accept, "127.0.0.1", 0)
        return proxy

    @property
    def port(self) -> int:
        assert self._server is not None
        return self._server.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stall(self) -> None:
        self.stalled_at = time.monotonic()
        self.first_reply_after_stall = None
        for link in self.links:
            link.dead = True

    def partition(self) -> None:
        self.partitioned = True
        self.stall()

    def heal(self) -> None:
        self.partitioned = False

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        server_reader, server_writer = await asyncio.open_connection(*self.target)
        link = _Link(client_writer, server_writer)
        link.dead = self.partitioned
        self.links.append(link)
        link.tasks = [
            asyncio.create_task(self._pump(link, client_reader, server_writer, to_client=False)),
            asyncio.create_task(self._pump(link, server_reader, client_writer, to_client=True)),
        ]

    async def _pump(
        self, link: _Link, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, to_client: bool
    ) -> None:
        try:
            while not link.dead:
                data = await reader.read(65536)
                if link.dead:  # read just before the stall: it vanishes like the rest
                    break
                if not data:  # a side closed a healthy link: close the other
                    for w in link.writers:
                        w.close()
                    return
                if to_client and self.stalled_at is not None and self.first_reply_after_stall is None:
                    self.first_reply_after_stall = time.monotonic()
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            for w in link.writers:
                w.close()
            return
        # Black-holed: keep both sockets open and read nothing more (the peer's writes fill the buffers, as with
        # a peer that went silent) until the proxy closes.
        await asyncio.Event().wait()

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        for link in self.links:
            for t in link.tasks:
                t.cancel()
            for w in link.writers:
                w.close()
        await asyncio.gather(*(t for link in self.links for t in link.tasks), return_exceptions=True)
        await self._server.wait_closed()
