"""Wait slots: a bound on the requests that wait on a job, per API process and per tenant.

An SSE stream (`GET /v1/jobs/{id}/events`), a `Prefer: wait` submit and the OpenAI route each hold a blocking
Redis read, so a connection of the blocking reads' pool (service/store_base.py), for as long as they wait: an
audit held 120 streams with one key and left every other tenant 503s. Each such request takes a slot here
first: at most `max_waiting` per process (the pool's size) and, with API keys, `max_waiting_per_key` per tenant
(in open mode every client is the same tenant, so only the process bound applies). Counted in memory: one API
process's slots, as its pool is its own.

A request holds its slot while it waits, and no longer than its client does: `wait_unless_gone` races the wait
against the client's disconnect (and the process's draining). An audit saw three clients that sent `Prefer:
wait=60` (or an OpenAI images request, which waits up to `openai_timeout_s`) and closed or half-closed their
connections keep their slots, and their blocking Redis connections, until their jobs ended: every other client
of the process got 503s meanwhile. The job itself was accepted and runs on.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Awaitable, Iterator
from typing import TypeVar

from starlette.requests import Request

from meshserve.service.api.draining import unless_draining
from meshserve.service.api.errors import ApiError
from meshserve.service.settings import Settings

T = TypeVar("T")

# The status recorded for a request whose client left before its answer (nginx's "client closed request"): no
# one receives it, but the request metrics tell abandoned waits from answered ones.
CLIENT_GONE_STATUS = 499


class ClientGone(Exception):
    """The client closed (or half-closed) its connection while its request waited on a job."""


def client_gone(job_id: str) -> ApiError:
    """The answer, which no one reads, to a request whose client left while it waited on job `job_id`."""
    return ApiError(
        CLIENT_GONE_STATUS,
        "client_closed_request",
        f"the client left while waiting; job {job_id} was accepted and goes on at /v1/jobs/{job_id}",
        headers={"Location": f"/v1/jobs/{job_id}"},
    )


async def wait_unless_gone(work: Awaitable[T], request: Request) -> T | None:
    """`work`'s result (a wait on the store); None when the API process starts draining first
    (service/api/draining.py); ClientGone when the client disconnects first. Either way `work` is cancelled, so the
    blocking Redis read ends and the caller gives its slot back at once.

    The disconnect is what the server's `receive()` says once the request's body has been read (uvicorn answers
    `http.disconnect` when the connection closes; a half-close closes it too): a watcher awaits it beside the
    wait, with no polling."""
    draining: asyncio.Event = request.app.state.draining
    if draining.is_set():
        if asyncio.iscoroutine(work):
            work.close()
        return None
    return await unless_draining(_unless_gone(work, request), draining)


async def _unless_gone(work: Awaitable[T], request: Request) -> T:
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if task not in done and gone.exception() is None:
            raise ClientGone
        return await task  # done, or the watcher itself failed (a server whose receive() misbehaves): wait on
    finally:
        for f in (gone, task):
            if not f.done():
                f.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await f


async def _disconnected(request: Request) -> None:
    """Returns once the client is gone. The body has been read by now: the next message is the disconnect."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
        if message["type"] == "http.request" and not message.get("more_body", False) and not message["body"]:
            # Some servers answer an empty final body again; do not spin on them.
            await asyncio.sleep(0.5)


class WaitSlots:
    def __init__(self, settings: Settings):
        self.limit = settings.max_waiting
        self.per_tenant = settings.max_waiting_per_key if settings.auth == "keys" else settings.max_waiting
        self.held: Counter[str] = Counter()
        self.total = 0
        self.retry_after_s = settings.retry_after_s

    def refusal(self, tenant: str) -> str | None:
        """Why `tenant` may not take a slot now: "tenant" (its own limit, when it is below the process's),
        "process", or None. In open mode every client is one tenant whose limit is the process's: "process"."""
        own = self.held[tenant] >= self.per_tenant
        if own and self.per_tenant < self.limit:
            return "tenant"
        if own or self.total >= self.limit:
            return "process"
        return None

    def refused(self, tenant: str, code: str) -> ApiError:
        """The answer to a request of `tenant` that found no slot: 429 for its own limit, else 503."""
        own = self.refusal(tenant) == "tenant"
        message = (
            f"this key already has {self.per_tenant} requests waiting on jobs here (streams, waits); end one "
            "or retry"
            if own
            else "this API process has as many requests waiting on jobs as it may; retry shortly"
        )
        return ApiError(429 if own else 503, code, message, headers={"Retry-After": str(self.retry_after_s)})

    def take(self, tenant: str) -> bool:
        if self.refusal(tenant) is not None:
            return False
        self.held[tenant] += 1
        self.total += 1
        return True

    def give_back(self, tenant: str) -> None:
        self.held[tenant] -= 1
        if self.held[tenant] <= 0:
            del self.held[tenant]
        self.total -= 1

    @contextlib.contextmanager
    def slot(self, tenant: str) -> Iterator[bool]:
        """A slot for the block's duration if one is free: yields whether it got one."""
        got = self.take(tenant)
        try:
            yield got
        finally:
            if got:
                self.give_back(tenant)
