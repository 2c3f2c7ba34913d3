"""uvicorn's HTTP/1.1 protocol (httptools) with the two bounds it lacks: the bytes of a request's line and headers,
and the time they take to arrive.

uvicorn 0.54 with httptools reads headers without a size limit or a deadline, before any route, key check or
body limit runs: an audit's four keyless connections each sending a 64 MiB header line took the API from 91
to 362 MiB (each then got its 401), header lines dripped one per second for 40 s were never cut off, and a
connection that sent nothing stayed open over a minute (1,500 of them at once). Here a request whose line and
headers pass `max_header_bytes` is answered 431 and closed, and one whose headers are not complete
`header_timeout_s` after its connection opened (or after its previous response, on a kept-alive connection)
is closed. An ingress usually bounds these too; the API does not count on one.

The bytes counted are those of a request's line and headers only: from the end of the previous request's message
(its body included, however late it comes) to the end of the headers. A request answered before its body was read
(a refused key, a body over the limit) has the rest of its body discarded by uvicorn's parser; an audit found those
bytes counted as the next request's headers (a keyed request after it got 431).

The bounds come from the process's settings (`get_settings()`: the environment), as `create_app()`'s do, so
the class is importable by name and also serves `meshserve api --workers N`, whose processes uvicorn spawns.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from meshserve.service.settings import get_settings

_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
    b"content-length: %d\r\nconnection: close\r\n\r\n%s"
)


class BoundedHttpProtocol(HttpToolsProtocol):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        settings = get_settings()
        self.max_header_bytes = settings.max_header_bytes
        self.header_timeout_s = settings.header_timeout_s
        self.header_bytes = 0
        self.header_timer: asyncio.TimerHandle | None = None
        # True between the end of a request's message (or the connection's start) and the end of the next
        # request's headers: the bytes that arrive then are a request line and headers.
        self.reading_headers = True

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._await_headers()

    def connection_lost(self, exc) -> None:
        self._headers_arrived()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # Counted here, as the bytes come: httptools hands a header to uvicorn only once it has all of it, so
        # a header line that never ends would otherwise be buffered whole. A chunk that ends the headers counts
        # up to their end, not the body after it.
        # (A chunk that ends a body and starts the next request is not counted: at most one read's bytes.)
        if self.reading_headers:
            end = data.find(b"\r\n\r\n")
            self.header_bytes += len(data) if end < 0 else end + 4
            if self.header_bytes > self.max_header_bytes:
                self._refuse_headers()
                return
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self._headers_arrived()
        self.reading_headers = False
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self.reading_headers, self.header_bytes = True, 0  # what comes next is the next request's
        super().on_message_complete()

    def on_response_complete(self) -> None:
        pipelined = bool(self.pipeline)  # a next request whose headers arrived already: it runs now
        super().on_response_complete()
        # Kept alive: the next request's headers get their own bounds (uvicorn's keep-alive timeout, 5 s by
        # default, closes an idle connection before this deadline; this one bounds a request that stalls).
        if not pipelined and not self.transport.is_closing():
            self._await_headers()

    def _await_headers(self) -> None:
        # The deadline runs from the response: the rest of an unread body and the next headers fall within it.
        self._headers_arrived()
        self.header_timer = self.loop.call_later(self.header_timeout_s, self._headers_timed_out)

    def _headers_arrived(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def _headers_timed_out(self) -> None:
        self.header_timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def _refuse_headers(self) -> None:
        self._headers_arrived()
        if self.cycle is not None and not self.cycle.response_complete:
            # Headers piling up while the previous request is still being answered: a 431 written now would
            # land inside that answer, so the connection just ends.
            self.transport.close()
            return
        body = (
            b'{"error":{"code":"headers_too_large","message":"the request line and headers are over '
            + str(self.max_header_bytes).encode()
            + b' bytes","field":null,"param":null,"type":"invalid_request_error"}}'
        )
        self.transport.write(_TOO_LARGE % (len(body), body))
        self.transport.close()
