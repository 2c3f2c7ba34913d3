"""A worker rides out a Redis restart: while Redis is down its claims, heartbeats and writes fail and are retried;
once Redis is back (same AOF), every accepted job ends succeeded exactly once and the pool is registered again.
Uses a private redis-server on a spare port (the shared one on 6379 is never touched)."""

import asyncio

import pytest

from meshserve.service.contract import JobStatus
from meshserve.service.settings import Settings
from meshserve.service.store import Store
from meshserve.workers.config import WorkerConfig
from meshserve.workers.main import Worker
from tests.workers.helpers import all_events, params, submit_many, wait_ended, wait_status


def _fake_worker(port: int, *, step_seconds: float, pool_stale_s: float) -> tuple[Settings, WorkerConfig]:
    """Settings for Redis on `port` (lease 2 s) and one pool `r` of the fake runner."""
    settings = Settings(
        redis_url=f"redis://127.0.0.1:{port}/0", key_prefix="ms", lease_s=2.0, pool_stale_s=pool_stale_s
    )
    cfg = WorkerConfig.model_validate(
        {
            "models": {"fake": {"runner": "fake", "options": {"step_seconds": step_seconds}}},
            "pools": [{"name": "r", "devices": "0", "models": ["fake"]}],
            "metrics_port": None,
        }
    )
    return settings, cfg


@pytest.mark.parametrize("outage_s", [1.5, 4.0], ids=["write-retried", "write-abandoned-then-reclaimed"])
def test_worker_survives_a_redis_restart_and_loses_no_job(private_redis, outage_s):
    """1.5 s: shorter than the lease (2 s), the finished job's write is retried until Redis is back. 4 s: the
    worker gives the write up after a lease; the job, still `running` in Redis with its lease lapsed, is
    reclaimed and run again - still one result."""
    settings, cfg = _fake_worker(private_redis.port, step_seconds=0.05, pool_stale_s=5.0)

    async def main():
        store = Store(settings)
        worker = Worker(cfg, settings)
        task = asyncio.create_task(worker.run())
        try:
            await asyncio.wait_for(worker.ready.wait(), 20)
            ids = await submit_many(store, [params(f"job {i}", steps=10, seed=i) for i in range(5)])
            await wait_status(store, ids[0], JobStatus.RUNNING, timeout=10, step=2)
            private_redis.kill()
            await asyncio.sleep(outage_s)  # the running job finishes its steps with Redis away
            assert not task.done()
            private_redis.start()
            jobs = await wait_ended(store, ids, timeout=60)
            assert all(j.status == JobStatus.SUCCEEDED for j in jobs.values()), jobs
            for job_id in ids:
                assert (await all_events(store, job_id)).count("succeeded") == 1
            if outage_s > settings.lease_s:
                assert jobs[ids[0]].attempt == 2 and (await store.stats())[("fake", "reclaimed")] == 1
            assert [p.name.rsplit("/", 1)[1] for p in await store.list_pools()] == ["r"]
        finally:
            worker.stop()
            await asyncio.wait_for(task, 30)
            await store.close()

    asyncio.run(main())


def test_a_worker_that_warms_up_while_redis_is_down_registers_when_it_is_back(private_redis):
    """Found by an audit: a pool whose warm-up ended with Redis away raised from its registration and the worker
    exited, throwing its loaded models away (minutes for a real one). Now it waits for Redis and serves."""
    private_redis.kill()  # the worker starts with no Redis
    settings, cfg = _fake_worker(private_redis.port, step_seconds=0.01, pool_stale_s=3.0)

    async def main():
        worker = Worker(cfg, settings)
        task = asyncio.create_task(worker.run())
        store = None
        try:
            await asyncio.sleep(3.0)  # loaded and warmed up (the fake model: at once) with no Redis
            assert not task.done(), task.exception() if task.done() else None
            private_redis.start()
            store = Store(settings)
            for _ in range(100):
                if await store.list_pools():
                    break
                await asyncio.sleep(0.1)
            assert [p.name.rsplit("/", 1)[1] for p in await store.list_pools()] == ["r"]
            ids = await submit_many(store, [params("after", steps=2, seed=1)])
            jobs = await wait_ended(store, ids, timeout=30)
            assert all(j.status == JobStatus.SUCCEEDED for j in jobs.values()), jobs
        finally:
            worker.stop()
            await asyncio.wait_for(task, 30)
            if store is not None:
                await store.close()

    asyncio.run(main())
