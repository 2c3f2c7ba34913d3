"""Request bodies over `Settings.max_body_bytes` (1 MiB by default) are refused with 413 before they are parsed;
the routes that take images (`IMAGE_ROUTES`) have their own limit, `max_image_body_bytes` (24 MiB by default: an
image and a mask of up to `max_image_bytes` as base64).

A pure ASGI middleware: a declared `Content-Length` over the limit is refused before a byte of the body is read;
a body without one (chunked) is read up to the limit and refused as soon as it passes it. Bodies within the limit
are handed on unchanged (buffered: at most the limit per request in flight). The largest legitimate body, a
4000-character prompt and negative prompt with 32 metadata entries, is under 200 KiB.

What all requests in flight hold together is bounded too, by `max_buffered_body_bytes` per process: a body whose
bytes as they arrive would take the sum past it is answered 503 `server_busy` with `Retry-After`, and its bytes
are released when its request ends. Without it one key's burst of image requests (24 MiB each, a token bucket of
600) could hold gigabytes. Only bytes that arrived count: when declared lengths were reserved up front, eleven
connections that sent headers declaring 24 MiB and no body held the budget, and every client's POST got 503, for
as long as they stayed open (an audit's finding). A body must also arrive whole within `body_timeout_s`, else
408 `body_timeout`. The bytes a request fetches (image URLs) count against the same budget, through
`request.state.hold_bytes(n)`, until the request ends.
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from meshserve.service.api.errors import error_response

_NO_BODY = frozenset({"GET", "HEAD", "OPTIONS"})
IMAGE_ROUTES = frozenset({"/v1/generate", "/v1/images/edits"})


def body_limit(path: str, settings) -> int:
    """The largest body a route takes."""
    return settings.max_image_body_bytes if path.rstrip("/") in IMAGE_ROUTES else settings.max_body_bytes


class BodySizeLimit:
    def __init__(self, app: ASGIApp):
        self.app = app
        self.buffered = 0  # bytes held by the requests in flight (one event loop: no lock)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in _NO_BODY:
            await self.app(scope, receive, send)
            return
        settings = scope["app"].state.settings
        limit = body_limit(scope["path"], settings)
        declared = dict(scope["headers"]).get(b"content-length")
        # (The server already refused a Content-Length that is not a number.)
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._too_large(scope, receive, send, limit)
            return
        held = 0

        def hold(size: int) -> bool:
            nonlocal held
            if size > held:
                if self.buffered + size - held > settings.max_buffered_body_bytes:
                    return False
                self.buffered += size - held
                held = size
            return True

        try:
            chunks: list[bytes] = []
            size = 0
            try:
                async with asyncio.timeout(settings.body_timeout_s):
                    while True:
                        message = await receive()
                        if message["type"] != "http.request":  # the client went away
                            return
                        chunk = message.get("body", b"")
                        size += len(chunk)
                        if size > limit:
                            await self._too_large(scope, receive, send, limit)
                            return
                        if not hold(size):
                            await self._busy(scope, receive, send)
                            return
                        chunks.append(chunk)
                        if not message.get("more_body", False):
                            break
            except TimeoutError:
                await self._timed_out(scope, receive, send, settings.body_timeout_s)
                return
            body, replayed = b"".join(chunks), False

            async def replay() -> Message:
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                # Later calls wait for the disconnect, as the server's own receive does.
                return await receive()

            # What the request fetches (image URLs: service/api/image_requests.py) is held under the same budget,
            # released with its body.
            scope.setdefault("state", {})["hold_bytes"] = lambda n: hold(held + n)
            await self.app(scope, replay, send)
        finally:
            self.buffered -= held

    @staticmethod
    async def _busy(scope: Scope, receive: Receive, send: Send) -> None:
        message = "the server holds as many request bodies as it may; retry shortly"
        headers = {"Retry-After": "1", "Connection": "close"}
        await error_response(503, "server_busy", message, None, headers)(scope, receive, send)

    @staticmethod
    async def _timed_out(scope: Scope, receive: Receive, send: Send, seconds: float) -> None:
        message = f"the request body did not arrive within {seconds:g} s"
        response = error_response(408, "body_timeout", message, "body", {"Connection": "close"})
        await response(scope, receive, send)

    @staticmethod
    async def _too_large(scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        message = f"the request body is larger than {limit} bytes"
        # Connection: close - the rest of the body is not read, so the connection cannot be reused.
        response = error_response(413, "body_too_large", message, "body", {"Connection": "close"})
        await response(scope, receive, send)
