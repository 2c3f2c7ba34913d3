"""HEAD on every GET route (RFC 9110 9.3.2): the GET's status and headers, no body.

FastAPI routes answer only the methods they declare, so `curl -I` on an output's URL, a job or /v1/models was a
405. The request runs as the GET (same authentication, same handler: its Content-Length, and an output's ETag, are
the GET's); the body is dropped, and once the headers have gone the handler is stopped, so that a HEAD on a stream
(a job's events) holds no wait slot while the stream would run.
"""

from __future__ import annotations

import asyncio

from meshserve.service.api.draining import unless_draining


class HeadAsGet:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return
        answered = asyncio.Event()

        async def send_headers_only(message):
            if answered.is_set():
                return
            if message["type"] == "http.response.start":
                await send(message)
            elif message["type"] == "http.response.body":
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                answered.set()

        # The GET runs until its body has begun, then is cancelled (the rest is not wanted): the same race as a
        # wait that stops when the process drains.
        await unless_draining(self.app({**scope, "method": "GET"}, receive, send_headers_only), answered)
