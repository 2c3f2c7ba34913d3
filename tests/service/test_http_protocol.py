"""The API's HTTP protocol bounds a request's headers in bytes and in time (service/api/http_protocol.py), on a
real uvicorn server and raw sockets: an audit saw 64 MiB header lines read whole before the key check, and
connections that sent nothing or dripped headers held open for minutes."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import uvicorn

from meshserve.service.api.http_protocol import BoundedHttpProtocol
from meshserve.service.settings import get_settings
from tests.private_redis import free_port

pytestmark = pytest.mark.anyio

MAX_HEADER_BYTES, HEADER_TIMEOUT_S = 8192, 0.5


async def hello(scope, receive, send):
    assert scope["type"] == "http"
    if scope["path"] == "/slow":  # a long answer: longer than the header deadline
        await asyncio.sleep(HEADER_TIMEOUT_S * 2)
    if scope["path"] == "/refuse":  # answered before its body is read, as a refused key is
        await send({"type": "http.response.start", "status": 401, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})
        return
    body = b""
    while True:  # the whole body, however slowly it comes
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-length", b"%d" % (len(body) + 2))],
        }
    )
    await send({"type": "http.response.body", "body": b"ok" + body})


@pytest.fixture
async def server(monkeypatch):
    monkeypatch.setenv("MESHSERVE_MAX_HEADER_BYTES", str(MAX_HEADER_BYTES))
    monkeypatch.setenv("MESHSERVE_HEADER_TIMEOUT_S", str(HEADER_TIMEOUT_S))
    get_settings.cache_clear()
    port = free_port()
    config = uvicorn.Config(
        hello, host="127.0.0.1", port=port, http=BoundedHttpProtocol, log_level="error", lifespan="off"
    )
    srv = uvicorn.Server(config)
    task = asyncio.create_task(srv.serve())
    while not srv.started:
        await asyncio.sleep(0.01)
    try:
        yield port
    finally:
        srv.should_exit = True
        await task
        get_settings.cache_clear()


@contextlib.asynccontextmanager
async def connection(port):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        yield reader, writer
    finally:
        writer.close()


async def closed_after(reader) -> float:
    """Seconds until the server closes the connection (EOF), reading and discarding whatever it sends."""
    t0 = time.monotonic()
    while await asyncio.wait_for(reader.read(65536), 10):
        pass
    return time.monotonic() - t0


async def test_requests_within_the_bounds_are_served_and_kept_alive(server):
    async with connection(server) as (reader, writer):
        for _ in range(2):
            writer.write(b"GET / HTTP/1.1\r\nhost: x\r\nx-pad: " + b"a" * 4000 + b"\r\n\r\n")
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
            assert await reader.readexactly(2) == b"ok"


async def test_headers_over_the_bound_are_a_431_and_a_closed_connection(server):
    async with connection(server) as (reader, writer):
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\nx-pad: " + b"a" * (MAX_HEADER_BYTES + 1000))
        answer = await asyncio.wait_for(reader.read(65536), 5)
        assert answer.startswith(b"HTTP/1.1 431") and b"headers_too_large" in answer, answer
        assert b"400" not in answer.split(b"\r\n", 1)[1]  # nothing after it
        assert await closed_after(reader) < 5
    async with connection(server) as (reader, writer):  # a long request line counts too
        writer.write(b"GET /" + b"a" * (MAX_HEADER_BYTES + 1) + b" HTTP/1.1\r\n")
        assert (await asyncio.wait_for(reader.read(65536), 5)).startswith(b"HTTP/1.1 431")


async def test_silent_and_dripping_connections_are_closed(server):
    async with connection(server) as (reader, _):  # sends nothing
        assert await closed_after(reader) < HEADER_TIMEOUT_S + 2
    async with connection(server) as (reader, writer):  # a header line now and then, never the end
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n")

        async def drip():
            for i in range(100):
                writer.write(b"x-%d: y\r\n" % i)
                await asyncio.sleep(0.1)

        dripping = asyncio.create_task(drip())
        try:
            assert await closed_after(reader) < HEADER_TIMEOUT_S + 2
        finally:
            dripping.cancel()
    async with connection(server) as (reader, writer):  # after a response, the next request's headers stall
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        assert await reader.readexactly(2) == b"ok"
        writer.write(b"GET / HTTP/1.1\r\n")
        assert await closed_after(reader) < HEADER_TIMEOUT_S + 2


async def test_a_slow_body_is_not_cut_by_the_header_deadline(server):
    """The deadline ends with the headers: a body is the body limit's business (body_timeout_s)."""
    async with connection(server) as (reader, writer):
        writer.write(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\n\r\nab")
        await asyncio.sleep(HEADER_TIMEOUT_S * 2)
        writer.write(b"cd")
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        assert await reader.readexactly(6) == b"okabcd"


async def test_a_pipelined_request_is_not_cut_by_the_header_deadline(server):
    """Two requests in one write: the second's headers came with the first, so its long answer runs to the end."""
    async with connection(server) as (reader, writer):
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\nGET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
        for _ in range(2):
            assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).startswith(b"HTTP/1.1 200")
            assert await reader.readexactly(2) == b"ok"


async def test_the_unread_body_of_an_answered_request_is_not_counted_as_headers(server):
    """A request answered before its body was read (a refused key): the rest of its body, however large, is not
    the next request's headers. An audit saw a keyed request after a keyless 2 MiB POST answered 431."""
    size = 4 * MAX_HEADER_BYTES
    async with connection(server) as (reader, writer):
        writer.write(b"POST /refuse HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\nab" % size)
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).startswith(b"HTTP/1.1 401")
        for _ in range(4):  # the body comes after the answer, in pieces
            writer.write(b"x" * (MAX_HEADER_BYTES // 2))
            await writer.drain()
            await asyncio.sleep(0.01)
        writer.write(b"x" * (size - 2 - 4 * (MAX_HEADER_BYTES // 2)) + b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).startswith(b"HTTP/1.1 200")
        assert await reader.readexactly(2) == b"ok"
        # The next headers are counted again.
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\nx-pad: " + b"a" * (MAX_HEADER_BYTES + 1000))
        assert (await asyncio.wait_for(reader.read(65536), 5)).startswith(b"HTTP/1.1 431")


async def test_headers_piling_up_behind_a_long_answer_end_the_connection(server):
    """The next request's headers are counted while the previous one is still being answered (they were not)."""
    async with connection(server) as (reader, writer):
        writer.write(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
        await asyncio.sleep(0.05)
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\nx-pad: " + b"a" * (MAX_HEADER_BYTES + 1000))
        # Closed at once, before the long answer (and no 431 written into it); before, the answer came and the
        # header deadline closed the connection after it.
        assert await asyncio.wait_for(reader.read(), 5) == b""
