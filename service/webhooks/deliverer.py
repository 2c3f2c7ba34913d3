"""The deliverer: claims due webhooks, signs and POSTs them, settles each (delivered, retry later, gave up).

Where it runs: a background task of each API process (`webhook_deliver_in_api`, the default), and/or alone as
`meshserve webhooks` (`python -m meshserve.service.webhooks`) for deployments that keep the API's processes to
requests. Never on the request path and never in a worker: the API's task shares the event loop but only awaits
(DNS through the loop's resolver, the POST through httpx), and at most `webhook_concurrency` POSTs are in flight
per deliverer. Any number of deliverers may run at once: claims are atomic (service/webhooks/queue.py).

Each attempt: the body (`{"type", "timestamp", "data": <the job as GET /v1/jobs/{id} returns it>}`) is built
once and kept, the target's address is checked again (service/ssrf.py: a name may resolve elsewhere now; no
redirects), and the POST carries Standard Webhooks headers signed with the submitting key's secret (and its
previous one during a rotation's grace). The status is the answer, settled on once the headers are in: the body is
never read, so its size and pace do not matter. 2xx: delivered. 410: the receiver asked us to stop, failed at once;
so is an address the rules refuse. Anything else (another status, a timeout, a refused connection) is retried after
`min(webhook_retry_max_s, webhook_retry_base_s * 2**(attempt-1))` times a jitter in [0.5, 1.5), until
`webhook_max_attempts` POSTs or `webhook_max_age_s` since the job ended, then failed.

The same loop runs the deadline sweep (`Store.expire_due`): jobs past their deadline end within about
`webhook_poll_s` of it (queued ones `expired`, running ones whose worker is gone `canceled`), and the unserved
sweep (service/unserved_sweep.py): the waiting jobs of a model no pool has served for `unserved_timeout_s` fail,
and the registry sweep (service/registry_sweep.py): what crashed pools left in Redis goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import random
import time
from collections import Counter
from datetime import UTC, datetime

from redis.exceptions import RedisError

from meshserve.service import metrics, ssrf
from meshserve.service.auth import webhook_secrets
from meshserve.service.registry_sweep import RegistrySweep
from meshserve.service.schemas import JobResponse
from meshserve.service.settings import Settings
from meshserve.service.store import Store
from meshserve.service.unserved_sweep import UnservedSweep
from meshserve.service.webhooks.queue import Claim, WebhookQueue
from meshserve.service.webhooks.signing import headers as signed_headers
from meshserve.service.webhooks.spec import EVENT_TYPES, WebhookSpec

log = logging.getLogger(__name__)

_ERROR_CHARS = 300
_RNG = random.Random()


def backoff_s(attempt: int, settings: Settings, rng: random.Random = _RNG) -> float:
    """Seconds before the retry that follows attempt `attempt` (1: the first POST failed)."""
    base = min(settings.webhook_retry_max_s, settings.webhook_retry_base_s * 2 ** min(attempt - 1, 60))
    return base * rng.uniform(0.5, 1.5)


def webhook_id(job_id: str) -> str:
    """One message per job (only its end is sent), so the job's id names it on every attempt."""
    return f"msg_{job_id}"


class Deliverer:
    """One deliverer over `store`'s Redis. `run()` until `stop()`; `tick()` is one round (tests drive it)."""

    def __init__(self, store: Store, settings: Settings | None = None):
        self.store = store
        self.settings = settings or store.settings
        if self.settings.webhook_lease_s <= self.settings.webhook_timeout_s:
            # A lease that lapses while its POST still runs would let a second deliverer send it meanwhile.
            raise ValueError(
                f"webhook_lease_s ({self.settings.webhook_lease_s:g}) must exceed webhook_timeout_s "
                f"({self.settings.webhook_timeout_s:g})"
            )
        self.queue = WebhookQueue(store.redis, store.prefix)
        self.unserved = UnservedSweep(store, self.settings)
        self.registry = RegistrySweep(store, self.settings)
        self._inflight: set[asyncio.Task] = set()
        self._by_tenant: Counter[str] = (
            Counter()
        )  # POSTs in flight per tenant (`webhook_concurrency_per_key`)
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        """Rounds every `webhook_poll_s` until stopped; then waits for the POSTs in flight (each bounded by
        `webhook_timeout_s`). A round that fails (Redis away) is logged once per outage and tried again."""
        await asyncio.to_thread(ssrf.ssl_context)  # built once, off the event loop (service/ssrf.py)
        failing = False
        while not self._stop.is_set():
            try:
                await self.tick()
                if failing:
                    log.info("webhooks: the store answers again")
                failing = False
            except (RedisError, OSError) as e:
                if not failing:
                    log.warning("webhooks: a round failed (%s); retrying", e)
                failing = True
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.webhook_poll_s):
                    await self._stop.wait()
        await self.drain()

    async def drain(self) -> None:
        if self._inflight:
            await asyncio.gather(*self._inflight, return_exceptions=True)

    async def tick(self) -> int:
        """One round: the deadline sweep, then claim what is due (as many as there is room for) and start their
        POSTs. Returns how many it started."""
        expired = await self.store.expire_due()
        if expired:
            log.info("deadlines: %d jobs ended", len(expired))
        await self.unserved.tick()
        await self.registry.tick()
        room = self.settings.webhook_concurrency - len(self._inflight)
        if room <= 0:
            return 0
        s = self.settings
        claims = await self.queue.claim(
            room,
            s.webhook_lease_s,
            s.webhook_max_age_s,
            # In open mode every job is one tenant's: only the deliverer's own concurrency applies.
            per_tenant=s.webhook_concurrency_per_key if s.auth == "keys" else None,
            in_flight=dict(self._by_tenant),
        )
        for claim in claims:
            task = asyncio.create_task(self._deliver(claim), name=f"webhook-{claim.job_id}")
            self._inflight.add(task)
            self._by_tenant[claim.tenant] += 1
            task.add_done_callback(functools.partial(self._done, claim.tenant))
        return len(claims)

    def _done(self, tenant: str, task: asyncio.Task) -> None:
        self._inflight.discard(task)
        self._by_tenant[tenant] -= 1
        if self._by_tenant[tenant] <= 0:
            del self._by_tenant[tenant]

    async def _deliver(self, claim: Claim) -> None:
        try:
            await self._attempt(claim)
        except (RedisError, OSError) as e:
            # Not settled: the lease lapses and a later claim tries again (at least once).
            log.warning("webhooks: job %s: could not settle attempt %d: %s", claim.job_id, claim.attempt, e)
        except Exception as e:
            # A bug, not the receiver: left unsettled it would be claimed again every lease until the job's
            # webhook_max_age_s (an audit saw attempt 13 and counting), so it ends failed with the reason.
            log.exception("webhooks: job %s: attempt %d failed unexpectedly", claim.job_id, claim.attempt)
            try:
                await self._give_up(
                    claim, f"internal error in the deliverer ({type(e).__name__}): no more attempts"
                )
            except (RedisError, OSError):
                pass  # the lease lapses and a later claim tries again

    async def _attempt(self, claim: Claim) -> None:
        s = self.settings
        spec = WebhookSpec.model_validate_json(claim.spec)
        if claim.body and not await self.store.redis.exists(self.store.job_key(claim.job_id)):
            body = None  # a retry of a job deleted since (DELETE /v1/jobs/{id}): an audit's was sent after it
        else:
            body = claim.body or await self._body(claim.job_id)
        if body is None:  # the job expired or was deleted meanwhile: nothing left to describe
            await self.queue.settle(claim, "failed", "the job no longer exists")
            return
        secrets_ = await webhook_secrets(self.store.redis, self.store.prefix, spec.key, s)
        if not secrets_:
            reason = "no signing secret: the submitting API key was revoked, or no MESHSERVE_WEBHOOK_SECRET"
            await self._give_up(claim, reason)
            return
        msg_id = webhook_id(claim.job_id)
        headers = {
            "content-type": "application/json",
            "user-agent": "meshserve-webhooks",
            **signed_headers(secrets_, msg_id, int(time.time()), body.encode()),
        }
        t0 = time.perf_counter()
        status, error = None, ""
        try:
            answer = await ssrf.fetch(
                spec.url,
                method="POST",
                body=body.encode(),
                headers=headers,
                # The status is the whole answer: the body is not read (`max_bytes` bounds nothing), so a 2xx
                # with a huge declared size or a body sent a byte at a time is delivered, not a failure retried
                # for a day (an audit's).
                read_body=False,
                max_bytes=0,
                connect_timeout_s=min(5.0, s.webhook_timeout_s),
                total_timeout_s=s.webhook_timeout_s,
                max_redirects=0,
                allow_private=s.webhook_allow_private,
            )
            status = answer.status_code
        except ssrf.BlockedURL as e:
            metrics.WEBHOOK_ATTEMPT_SECONDS.labels("refused").observe(time.perf_counter() - t0)
            await self._give_up(claim, f"refused: {e.message}")
            return
        except ssrf.FetchError as e:
            error = f"{e.reason}: {e.message}"
        metrics.WEBHOOK_ATTEMPT_SECONDS.labels(_result(status)).observe(time.perf_counter() - t0)
        if status is not None and 200 <= status < 300:
            if await self.queue.settle(claim, "delivered"):
                metrics.WEBHOOK_DELIVERIES.labels("delivered").inc()
                metrics.WEBHOOK_DELIVERY_SECONDS.observe(max(0.0, time.time() - claim.first_at))
            return
        if status == 410:
            await self._give_up(claim, "the receiver answered 410 Gone: no more attempts")
            return
        if status is not None:
            error = f"HTTP {status}"
        error = error[:_ERROR_CHARS]
        now = time.time()
        due = now + backoff_s(claim.attempt, s)
        if claim.attempt >= s.webhook_max_attempts or due - claim.first_at > s.webhook_max_age_s:
            await self._give_up(claim, f"gave up after {claim.attempt} attempts; last: {error}")
            return
        if await self.queue.settle(claim, "retry", error, due):
            metrics.WEBHOOK_RETRIES.inc()
            log.info(
                "webhooks: job %s: attempt %d failed (%s); next in %.1f s",
                claim.job_id,
                claim.attempt,
                error,
                due - now,
            )

    async def _give_up(self, claim: Claim, reason: str) -> None:
        if await self.queue.settle(claim, "failed", reason[:_ERROR_CHARS]):
            metrics.WEBHOOK_DELIVERIES.labels("failed").inc()
            log.warning("webhooks: job %s: %s", claim.job_id, reason)

    async def _body(self, job_id: str) -> str | None:
        """Build the body from the job as it is now, and keep it for every later attempt (the first wins)."""
        job = await self.store.get(job_id)
        if job is None:
            return None
        ended = datetime.fromtimestamp(job.finished_at or time.time(), UTC)
        payload = {
            "type": EVENT_TYPES[job.status],
            "timestamp": ended.isoformat().replace("+00:00", "Z"),
            "data": json.loads(JobResponse.from_job(job).model_dump_json()),
        }
        return await self.queue.keep_body(job_id, json.dumps(payload, separators=(",", ":")))


def _result(status: int | None) -> str:
    return "error" if status is None else f"{status // 100}xx"


@contextlib.asynccontextmanager
async def deliver_in_background(store: Store, settings: Settings):
    """The API process's deliverer (unless `webhook_deliver_in_api` is false): a task beside the request handlers,
    stopped when the API stops. POSTs still in flight get up to `webhook_timeout_s` to finish; any that do not
    are settled by nobody and retried by another deliverer once their lease lapses."""
    if not settings.webhook_deliver_in_api:
        yield None
        return
    deliverer = Deliverer(store, settings)
    task = asyncio.create_task(deliverer.run(), name="webhook-deliverer")
    try:
        yield deliverer
    finally:
        deliverer.stop()
        try:
            async with asyncio.timeout(settings.webhook_timeout_s):
                await asyncio.shield(task)
        except TimeoutError:
            task.cancel()
            for t in list(deliverer._inflight):
                t.cancel()
            await asyncio.gather(task, *deliverer._inflight, return_exceptions=True)
