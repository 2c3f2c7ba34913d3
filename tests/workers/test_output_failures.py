"""Output storage faults in the worker's job loop (workers/job_loop.py), against the real Redis with the fake
runner: the job loop runs in this process with a Store whose output store (an in-memory obstore) refuses some
writes, installed through Store's `outputs` argument. A write that fails briefly is retried and the job succeeds;
one that fails for a whole delivery is redelivered; one that never succeeds ends the job failed with
"output_store_error" on its last delivery, its partial objects deleted. No job is lost, none succeeds without
its outputs."""

from __future__ import annotations

import asyncio
import io

import numpy as np
from PIL import Image

from meshserve.service.contract import JobStatus
from meshserve.service.output_store import OutputStore, OutputStoreError
from meshserve.service.store import Store
from meshserve.workers.fake_runner import FakeRunner
from meshserve.workers.job_loop import JobLoop
from meshserve.workers.threads import PoolThread
from tests.workers.helpers import all_events, cleanup, make_settings, params, submit_many, wait_ended


class FlakyOutputStore(OutputStore):
    """An in-memory output store whose writes fail while `refuse(job_id, index, key, write number)` says so,
    with the error obstore gives for a bucket that refuses a PUT; a write it takes lands `slow(job_id, index)`
    seconds later. Every write is logged as (job id, index, key, refused)."""

    def __init__(self, refuse, slow=lambda job_id, index: 0.0):
        super().__init__("memory://")
        self.refuse, self.slow = refuse, slow
        self.writes: list[tuple[str, int, str, bool]] = []

    async def put(self, job_id, index, ext, data, *, key=None):
        refused = bool(self.refuse(job_id, index, key, len(self.writes)))
        self.writes.append((job_id, index, key, refused))
        if refused:
            raise OutputStoreError(f"cannot write output {job_id}/{key}/{index}.{ext}: 503 Slow Down")
        await asyncio.sleep(self.slow(job_id, index))
        return await super().put(job_id, index, ext, data, key=key)


async def run_loop(store: Store, settings, until_ended: list[str], timeout: float):
    """A real JobLoop (one pool, the fake runner) until the jobs have ended; returns them."""
    loop = JobLoop(
        pool="p0",
        consumer="test-host/p0",
        runners={"fake": FakeRunner("fake")},
        store=store,
        settings=settings,
        thread=PoolThread("p0"),
        max_batch=1,
        batch_wait_ms=0,
        idle_block_ms=50,
    )
    task = asyncio.create_task(loop.run())
    try:
        return await wait_ended(store, until_ended, timeout=timeout)
    finally:
        loop.request_stop(0.0)
        await asyncio.wait_for(task, 10)
        loop.thread.close()


def _png(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def test_a_write_that_fails_briefly_is_retried_and_the_job_succeeds():
    settings = make_settings(lease_s=1.0, output_dir="memory://")
    outputs = FlakyOutputStore(lambda job_id, index, key, n: n < 3)  # the first 3 writes fail

    async def main():
        store = Store(settings, outputs=outputs)
        try:
            (job_id,) = await submit_many(store, [params("brief outage")])
            job = (await run_loop(store, settings, [job_id], timeout=20))[job_id]
            assert job.status == JobStatus.SUCCEEDED and job.attempt == 1  # within the first delivery
            assert [w[3] for w in outputs.writes] == [True, True, True, False]
            assert _png(await store.output(job_id, 0)).shape == (16, 16, 3)
            assert (await all_events(store, job_id)).count("succeeded") == 1
        finally:
            await store.close()

    try:
        asyncio.run(main())
    finally:
        cleanup(settings)


def test_a_delivery_that_cannot_write_is_redelivered_and_succeeds():
    settings = make_settings(lease_s=0.5, output_dir="memory://")
    # Every write of the first attempt fails, for longer than the retry window (one lease).
    outputs = FlakyOutputStore(lambda job_id, index, key, n: key.endswith("-1"))

    async def main():
        store = Store(settings, outputs=outputs)
        try:
            (job_id,) = await submit_many(store, [params("outage", n=2)])
            job = (await run_loop(store, settings, [job_id], timeout=30))[job_id]
            assert job.status == JobStatus.SUCCEEDED and job.attempt == 2, job
            first = [w for w in outputs.writes if w[2].endswith("-1")]
            assert len(first) >= 4 and all(w[3] for w in first)  # retried, then given up
            assert {w[1] for w in outputs.writes if not w[3]} == {0, 1}
            for i in (0, 1):
                assert _png(await store.output(job_id, i)).shape == (16, 16, 3)
            events = await all_events(store, job_id)
            assert events.count("started") == 2 and events.count("succeeded") == 1
            assert (await store.stats())[("fake", "reclaimed")] == 1
        finally:
            await store.close()

    try:
        asyncio.run(main())
    finally:
        cleanup(settings)


def test_a_write_that_never_succeeds_fails_the_job_on_its_last_delivery():
    settings = make_settings(lease_s=0.5, output_dir="memory://", max_deliveries=3)
    # Output 1 of the doomed job can never be written; output 0 always can (and must not be left behind), and
    # lands 0.2 s after output 1 is refused: an attempt's error waits for its other writes, or the last one
    # landed after the failed job's cleanup (seen once in a loaded suite run before they were awaited).
    doomed: list[str] = []
    outputs = FlakyOutputStore(
        lambda job_id, index, key, n: job_id in doomed and index == 1,
        slow=lambda job_id, index: 0.2 if job_id in doomed and index == 0 else 0.0,
    )

    async def main():
        store = Store(settings, outputs=outputs)
        try:
            bad, good = await submit_many(store, [params("doomed", n=2), params("fine")])
            doomed.append(bad)
            jobs = await run_loop(store, settings, [bad, good], timeout=40)
            assert jobs[good].status == JobStatus.SUCCEEDED  # no other job is held up or lost
            job = jobs[bad]
            assert job.status == JobStatus.FAILED and job.attempt == 3, job
            assert job.error.code == "output_store_error"
            assert "after 3 deliveries" in job.error.message and "503 Slow Down" in job.error.message
            token = await store.redis.hget(store.job_key(bad), "out_token")
            assert f"{bad}/<token>-3/1.png" in job.error.message and token not in job.error.message
            assert job.outputs == []
            # Each delivery wrote output 0 under its own key; the final failure deleted them all.
            assert {w[2].rsplit("-", 1)[1] for w in outputs.writes if w[0] == bad} == {"1", "2", "3"}
            await asyncio.sleep(0.3)  # past any write still in flight
            assert await store.outputs.delete(bad) == 0
            assert await store.output(bad, 0) is None
            events = await all_events(store, bad)
            assert events.count("started") == 3 and events[-1] == "failed"
            # Failed by the loop on the last delivery, not dead-lettered by a fourth claim.
            assert await store.redis.xlen(store.dlq_key("fake")) == 0
        finally:
            await store.close()

    try:
        asyncio.run(main())
    finally:
        cleanup(settings)
