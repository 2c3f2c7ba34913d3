"""A claim that fails while a batch is being gathered (Redis silent past its command deadline, or gone) must not
strand the jobs already claimed for that batch: the pool holds them, so its heartbeats kept their leases alive for
ever while nothing ran them (found 2026-11-29 by reading the loop after a stalled mixed-load benchmark)."""

from __future__ import annotations

import asyncio

from redis.exceptions import TimeoutError as RedisTimeoutError

from meshserve.service.contract import JobStatus
from meshserve.service.store import Store
from meshserve.workers.fake_runner import FakeRunner
from meshserve.workers.job_loop import JobLoop
from meshserve.workers.threads import PoolThread
from tests.workers.helpers import cleanup, make_settings, params, submit_many, wait_ended


async def _two_jobs_on_one_pool(store: Store, settings, batch_wait_ms: float) -> dict:
    """Two compatible jobs on one JobLoop (the fake runner, batches of up to 4) until both end, within 8 s."""
    loop = JobLoop(
        pool="p0",
        consumer="test-host/p0",
        runners={"fake": FakeRunner("fake")},
        store=store,
        settings=settings,
        thread=PoolThread("p0"),
        max_batch=4,
        batch_wait_ms=batch_wait_ms,
        idle_block_ms=50,
    )
    ids = await submit_many(store, [params("a", model="fake"), params("b", model="fake")])
    task = asyncio.create_task(loop.run())
    try:
        return await wait_ended(store, ids, timeout=8)
    finally:
        loop.request_stop(0.0)
        await asyncio.wait_for(task, 10)
        loop.thread.close()


def test_jobs_claimed_before_a_failed_claim_still_run():
    settings = make_settings(lease_s=2.0)

    async def main():
        store = Store(settings)
        claims = 0
        real_claim = store.claim

        async def flaky_claim(*args, **kwargs):
            nonlocal claims
            claims += 1
            if claims == 2:  # the first claim of a gather took the anchor; the one for its company fails
                raise RedisTimeoutError("the store stopped answering")
            return await real_claim(*args, **kwargs)

        store.claim = flaky_claim
        try:
            # Within a lease or two: the anchor was neither run nor given back before (its lease renewed).
            done = await _two_jobs_on_one_pool(store, settings, batch_wait_ms=200)
            assert all(j.status == JobStatus.SUCCEEDED for j in done.values()), done
            assert claims >= 2
        finally:
            await store.close()
            cleanup(settings)

    asyncio.run(main())


def test_a_held_job_no_batch_took_is_given_back(monkeypatch):
    """The net under any such bug: after each gathering, a held job that is in no batch, not given back and not
    being encoded is given back (and logged), so another claim runs it. Here the gathering drops one."""
    import meshserve.workers.job_loop as job_loop

    settings = make_settings(lease_s=30.0)  # far longer than the wait: only the net can free the job in time
    real_gather, dropped = job_loop.gather_batch, []

    async def dropping_gather(*args, **kwargs):
        batch, rest = await real_gather(*args, **kwargs)
        if batch and not dropped:
            dropped.append(batch.pop().job_id)
        return batch, rest

    monkeypatch.setattr(job_loop, "gather_batch", dropping_gather)

    async def main():
        store = Store(settings)
        try:
            done = await _two_jobs_on_one_pool(store, settings, batch_wait_ms=50)
            assert dropped and all(j.status == JobStatus.SUCCEEDED for j in done.values()), done
        finally:
            await store.close()
            cleanup(settings)

    asyncio.run(main())
