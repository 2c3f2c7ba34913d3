"""Encoding off the pool thread (workers/job_loop.py): the pool thread starts the next batch while the last one's
outputs are encoded; a job still succeeds only once its outputs are stored; an encoding error fails that job
alone with "encode_error"; at stop, batches being encoded are drained, or their jobs released past the deadline.
The real Redis, a model-free runner whose `generate` returns uint8 arrays, and `encode_job` wrapped to block or
fail on cue."""

from __future__ import annotations

import asyncio
import io
import threading
import time

import numpy as np
import pytest
from PIL import Image

from meshserve.service.contract import JobStatus
from meshserve.service.store import Store
from meshserve.workers import job_loop
from meshserve.workers.fake_runner import FakeRunner
from meshserve.workers.job_loop import JobLoop
from meshserve.workers.runner import Generated, encode_job
from meshserve.workers.threads import PoolThread
from tests.workers.helpers import cleanup, make_settings, params, submit_many, wait_ended, wait_status


class GeneratingRunner(FakeRunner):
    """`generate` returns each job's rows as uint8 (a grey level from the seed), not encoded; records when
    each batch started on the pool thread."""

    def __init__(self, name: str):
        super().__init__(name)
        self.started: dict[str, float] = {}

    def generate(self, batch, callback=None, **previews):
        out = []
        for req in batch:
            self.started[req.params.prompt] = time.monotonic()
            p = req.params
            rows = np.full((p.n, p.height, p.width, 3), p.seed % 256, np.uint8)
            out.append(Generated(req.job_id, rows, req.seeds(), {"denoise": 0.0}))
        return out


class Encoder:
    """encode_job, blocked for prompts in `hold` until `release` is set, failing for prompts in `fail`."""

    def __init__(self, hold=(), fail=()):
        self.hold, self.fail = set(hold), set(fail)
        self.release = threading.Event()
        self.encoded: dict[str, float] = {}

    def __call__(self, req, generated):
        prompt = req.params.prompt
        if prompt in self.hold:
            assert self.release.wait(30)
        if prompt in self.fail:
            raise OSError("disk full while encoding")
        self.encoded[prompt] = time.monotonic()
        return encode_job(req, generated)


def _loop(store, settings, runner) -> JobLoop:
    return JobLoop(
        pool="p0",
        consumer="test-host/p0",
        runners={"fake": runner},
        store=store,
        settings=settings,
        thread=PoolThread("p0"),
        max_batch=1,
        batch_wait_ms=0,
        idle_block_ms=50,
    )


def _run(settings, main):
    try:
        asyncio.run(main())
    finally:
        cleanup(settings)


def test_next_batch_starts_while_the_last_one_is_encoded(monkeypatch):
    settings = make_settings(lease_s=1.0)
    encoder = Encoder(hold={"first"})
    monkeypatch.setattr(job_loop, "encode_job", encoder)
    runner = GeneratingRunner("fake")

    async def main():
        store = Store(settings)
        loop = _loop(store, settings, runner)
        task = asyncio.create_task(loop.run())
        try:
            first, second = await submit_many(store, [params("first", seed=7, n=2), params("second", seed=9)])
            # The second job ran to the end while the first one's encoding is still held: the pool thread
            # did not wait for it.
            await wait_status(store, second, JobStatus.SUCCEEDED, timeout=10)
            job = await store.get(first)
            assert job.status == JobStatus.RUNNING  # not succeeded before its outputs are stored
            assert runner.started["second"] < time.monotonic() and "first" not in encoder.encoded
            await asyncio.sleep(1.5)  # over a lease: the held job's lease is renewed while it is encoded
            assert (await store.get(first)).status == JobStatus.RUNNING
            encoder.release.set()
            jobs = await wait_ended(store, [first, second], timeout=10)
            assert jobs[first].status == JobStatus.SUCCEEDED and jobs[first].attempt == 1
            for i in (0, 1):
                png = np.asarray(Image.open(io.BytesIO(await store.output(first, i))))
                assert png.shape == (16, 16, 3) and (png == 7).all()
            assert encoder.encoded["second"] < encoder.encoded["first"]
        finally:
            encoder.release.set()
            loop.request_stop(0.0)
            await asyncio.wait_for(task, 10)
            loop.thread.close()
            await store.close()

    _run(settings, main)


def test_an_encoding_error_fails_that_job_alone(monkeypatch):
    settings = make_settings(lease_s=1.0)
    monkeypatch.setattr(job_loop, "encode_job", Encoder(fail={"bad"}))

    async def main():
        store = Store(settings)
        loop = _loop(store, settings, GeneratingRunner("fake"))
        task = asyncio.create_task(loop.run())
        try:
            bad, good = await submit_many(store, [params("bad"), params("good")])
            jobs = await wait_ended(store, [bad, good], timeout=10)
            assert jobs[good].status == JobStatus.SUCCEEDED
            assert jobs[bad].status == JobStatus.FAILED and jobs[bad].attempt == 1  # not retried
            assert jobs[bad].error.code == "encode_error" and "disk full" in jobs[bad].error.message
        finally:
            loop.request_stop(0.0)
            await asyncio.wait_for(task, 10)
            loop.thread.close()
            await store.close()

    _run(settings, main)


@pytest.mark.parametrize("released", [True, False], ids=["drained", "past-deadline"])
def test_stop_drains_encoding_or_releases_its_jobs(monkeypatch, released):
    """Stop while a job is encoded: it finishes within the drain deadline (drained), or, still encoding past the
    deadline and its grace, it is released: queued again, no delivery spent, never lost."""
    settings = make_settings(lease_s=1.0)
    encoder = Encoder(hold={"slow"})
    monkeypatch.setattr(job_loop, "encode_job", encoder)
    monkeypatch.setattr(job_loop, "_GRACE_S", 0.5)

    async def main():
        store = Store(settings)
        loop = _loop(store, settings, GeneratingRunner("fake"))
        task = asyncio.create_task(loop.run())
        try:
            (job_id,) = await submit_many(store, [params("slow")])
            await wait_status(store, job_id, JobStatus.RUNNING, timeout=10)
            while not loop._finishing:  # handed to the encoder
                await asyncio.sleep(0.01)
            loop.request_stop(2.0 if released else 0.0)
            if released:
                await asyncio.sleep(0.5)
                encoder.release.set()
            await asyncio.wait_for(task, 10)
            job = await store.get(job_id)
            if released:
                assert job.status == JobStatus.SUCCEEDED
                assert (await store.output(job_id, 0))[:4] == b"\x89PNG"
            else:
                assert job.status == JobStatus.QUEUED, job  # released for another delivery
        finally:
            encoder.release.set()
            loop.thread.close()
            await store.close()

    _run(settings, main)
