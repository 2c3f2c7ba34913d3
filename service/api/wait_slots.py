"""Wait slots: a bound on the requests that wait on a job, per API process and per tenant.

An SSE stream (`GET /v1/jobs/{id}/events`), a `Prefer: wait` submit and the OpenAI route each hold a blocking
Redis read, so a connection of the blocking reads' pool (service/store_base.py), for as long as they wait: an
audit held 120 streams with one key and left every other tenant 503s. Each such request takes a slot here
first: at most `max_waiting` per process (the pool's size) and, with API keys, `max_waiting_per_key` per tenant
(in open mode every client is the same tenant, so only the process bound applies). Counted in memory: one API
process's slots, as its pool is its own.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

from meshserve.service.api.errors import ApiError
from meshserve.service.settings import Settings


class WaitSlots:
    def __init__(self, settings: Settings):
        self.limit = settings.max_waiting
        self.per_tenant = settings.max_waiting_per_key if settings.auth == "keys" else settings.max_waiting
        self.held: Counter[str] = Counter()
        self.total = 0
        self.retry_after_s = settings.retry_after_s

    def refusal(self, tenant: str) -> str | None:
        """Why `tenant` may not take a slot now: "tenant" (its own limit), "process", or None."""
        if self.held[tenant] >= self.per_tenant:
            return "tenant"
        if self.total >= self.limit:
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
