"""Worker pools in one process against the real Redis, with the fake runner: two pools share a model's stream,
batches form from compatible jobs, cancel stops a running job between steps, faults end in failure or the DLQ."""

import asyncio

import pytest

from meshserve.service.contract import JobStatus
from meshserve.service.store import Store
from meshserve.workers.config import WorkerConfig
from meshserve.workers.main import Worker
from tests.workers.helpers import (
    all_events,
    cleanup,
    make_settings,
    params,
    submit_many,
    wait_ended,
    wait_status,
)


def _config(pools, drain_seconds=30.0, **options):
    return WorkerConfig.model_validate(
        {
            "models": {"fake": {"runner": "fake", "options": options}},
            "pools": pools,
            "metrics_port": None,
            "drain_seconds": drain_seconds,
        }
    )


def _pool(name, devices, **kw):
    return {"name": name, "devices": devices, "models": ["fake"], "max_batch": 1, "batch_wait_ms": 0, **kw}


class Harness:
    """A Worker running in this event loop, plus a Store for the test's side."""

    def __init__(self, config, **settings_kw):
        self.settings = make_settings(**settings_kw)
        self.config = config

    async def __aenter__(self):
        self.store = Store(self.settings)
        self.worker = Worker(self.config, self.settings)
        self.task = asyncio.create_task(self.worker.run())
        done, _ = await asyncio.wait(
            [self.task, asyncio.create_task(self.worker.ready.wait())],
            timeout=20,
            return_when=asyncio.FIRST_COMPLETED,
        )
        if self.task in done:
            self.task.result()
        assert self.worker.ready.is_set()
        return self

    async def stop(self, timeout=20):
        self.worker.stop()
        await asyncio.wait_for(self.task, timeout)

    async def __aexit__(self, *exc):
        if not self.task.done():
            await self.stop()
        await self.store.close()
        cleanup(self.settings)


def test_two_pools_serving_one_model_both_get_jobs():
    async def main():
        cfg = _config([_pool("a", "0"), _pool("b", "1")], step_seconds=0.02)
        async with Harness(cfg) as h:
            pools = {p.name.rsplit("/", 1)[1]: p for p in await h.store.list_pools()}
            assert set(pools) == {"a", "b"} and all(p.ready for p in pools.values())
            assert pools["a"].models[0].id == "fake" and pools["a"].models[0].family == "fake"
            ids = await submit_many(h.store, [params(f"p{i}", seed=i) for i in range(12)])
            jobs = await wait_ended(h.store, ids, timeout=30)
            assert all(j.status == JobStatus.SUCCEEDED for j in jobs.values())
            served_by = {j.worker.rsplit("/", 1)[1] for j in jobs.values()}
            assert served_by == {"a", "b"}, served_by
            job = jobs[ids[0]]
            assert len(job.outputs) == 1 and job.outputs[0].seed == 0
            data = await h.store.output(job.id, 0)
            assert data[:8] == b"\x89PNG\r\n\x1a\n"
            assert job.timings.stages["denoise"] > 0 and job.progress.step == 4
        assert await _pools_left(h.settings) == []

    asyncio.run(main())


async def _pools_left(settings):
    store = Store(settings)
    try:
        return await store.list_pools(include_stale=True)
    finally:
        await store.close()


def test_compatible_jobs_are_batched():
    async def main():
        cfg = _config([_pool("a", "0", max_batch=4, batch_wait_ms=300)], step_seconds=0.01)
        async with Harness(cfg) as h:
            # Four compatible jobs and one of another size, submitted together: the four share one run.
            items = [params(f"p{i}", seed=i) for i in range(4)] + [params("other", size=32)]
            ids = await submit_many(h.store, items)
            jobs = await wait_ended(h.store, ids, timeout=20)
            assert all(j.status == JobStatus.SUCCEEDED for j in jobs.values())
            runner = h.worker.pools[0].runners["fake"]
            calls = [sorted(c) for c in runner.calls]
            assert sorted(ids[:4]) in calls, calls
            assert [ids[4]] in calls
            assert jobs[ids[4]].outputs[0].width == 32

    asyncio.run(main())


def test_cancel_of_a_running_job_stops_between_steps():
    async def main():
        cfg = _config([_pool("a", "0")], step_seconds=0.1)
        async with Harness(cfg) as h:
            (job_id,) = await submit_many(h.store, [params("slow", steps=50)])
            await wait_status(h.store, job_id, JobStatus.RUNNING, timeout=10, step=2)
            await h.store.cancel(job_id)
            job = (await wait_ended(h.store, [job_id], timeout=5))[job_id]
            assert job.status == JobStatus.CANCELED
            assert 2 <= job.progress.step < 10  # stopped within a step or two of the request, not at 50
            await asyncio.sleep(0.3)
            assert (await h.store.get(job_id)).status == JobStatus.CANCELED
            # The pool serves the next job.
            (nxt,) = await submit_many(h.store, [params("next")])
            assert (await wait_ended(h.store, [nxt], timeout=10))[nxt].status == JobStatus.SUCCEEDED

    asyncio.run(main())


def test_runner_fault_is_retried_then_dead_lettered():
    async def main():
        cfg = _config([_pool("a", "0")])
        async with Harness(cfg, lease_s=0.4) as h:
            poison, good = await submit_many(h.store, [params("FAKE_RAISE"), params("fine")])
            jobs = await wait_ended(h.store, [poison, good], timeout=20)
            assert jobs[good].status == JobStatus.SUCCEEDED
            job = jobs[poison]
            assert job.status == JobStatus.FAILED and job.error.code == "too_many_deliveries"
            assert "4 times" in job.error.message and "limit 3" in job.error.message
            # and why (an audit found the cause only in the worker's log)
            assert "the last attempt failed with RuntimeError: fake runner fault" in job.error.message
            runner = h.worker.pools[0].runners["fake"]
            assert (
                sum(c == [poison] for c in runner.calls) == 3
            )  # three deliveries ran, the fourth was refused
            dlq = await h.store.redis.xrange(h.store.dlq_key("fake"))
            assert [e[1]["job"] for e in dlq] == [poison]
            assert dlq[0][1]["reason"] == "too_many_deliveries"

    asyncio.run(main())


def test_poison_in_a_batch_does_not_take_its_neighbours_down():
    async def main():
        cfg = _config([_pool("a", "0", max_batch=3, batch_wait_ms=300)])
        async with Harness(cfg, lease_s=0.4) as h:
            ids = await submit_many(h.store, [params("ok1"), params("FAKE_RAISE"), params("ok2")])
            jobs = await wait_ended(h.store, ids, timeout=20)
            assert [jobs[i].status for i in ids] == [
                JobStatus.SUCCEEDED,
                JobStatus.FAILED,
                JobStatus.SUCCEEDED,
            ]
            runner = h.worker.pools[0].runners["fake"]
            assert sorted(runner.calls[0]) == sorted(ids)  # batched first, then split up
            assert [ids[0]] in runner.calls and [ids[2]] in runner.calls

    asyncio.run(main())


def test_invalid_request_fails_at_once():
    async def main():
        cfg = _config([_pool("a", "0")])
        async with Harness(cfg) as h:
            (job_id,) = await submit_many(h.store, [params("FAKE_REJECT")])
            job = (await wait_ended(h.store, [job_id], timeout=10))[job_id]
            assert job.status == JobStatus.FAILED and job.error.code == "invalid_request"
            assert job.attempt == 1

    asyncio.run(main())


def test_stop_finishes_a_batch_within_the_drain_time():
    async def main():
        cfg = _config([_pool("a", "0")], drain_seconds=10, step_seconds=0.05)
        async with Harness(cfg) as h:
            first, second = await submit_many(h.store, [params("running", steps=20), params("queued")])
            await wait_status(h.store, first, JobStatus.RUNNING, timeout=10, step=1)
            await h.stop()
            assert (await h.store.get(first)).status == JobStatus.SUCCEEDED
            assert (await h.store.get(second)).status == JobStatus.QUEUED  # never taken
            assert await h.store.list_pools(include_stale=True) == []

    asyncio.run(main())


def test_stop_past_the_drain_time_releases_the_batch():
    async def main():
        cfg = _config([_pool("a", "0")], drain_seconds=0.2, step_seconds=0.05)
        async with Harness(cfg) as h:
            (job_id,) = await submit_many(h.store, [params("long", steps=200)])
            await wait_status(h.store, job_id, JobStatus.RUNNING, timeout=10, step=1)
            await h.stop()
            job = await h.store.get(job_id)
            assert job.status == JobStatus.QUEUED and job.progress.step == 0 and job.worker is None
            # Another worker takes it up at once (no lease wait: released, not abandoned) and finishes it.
            cfg2 = _config([_pool("b", "0")], step_seconds=0.0)
            w2 = Worker(cfg2, h.settings)
            task = asyncio.create_task(w2.run())
            done = await wait_ended(h.store, [job_id], timeout=10)
            w2.stop()
            await asyncio.wait_for(task, 10)
            job = done[job_id]
            assert job.status == JobStatus.SUCCEEDED and job.worker.endswith("/b")
            assert job.attempt == 3  # 1: first delivery, 2: the release's fence bump, 3: the redelivery
            events = await all_events(h.store, job_id)
            assert (
                events.count("succeeded") == 1 and events.count("started") == 2 and events[-1] == "succeeded"
            )

    asyncio.run(main())


def test_worker_metrics_move_and_are_served():
    import httpx
    from prometheus_client import REGISTRY

    from meshserve.workers.metrics import serve_metrics

    def value(name, **labels):
        return REGISTRY.get_sample_value(name, labels) or 0.0

    async def main():
        cfg = _config([_pool("m", "0", max_batch=2, batch_wait_ms=200)], step_seconds=0.01)
        before = {
            "ok": value("meshserve_worker_jobs_total", model="fake", outcome="succeeded"),
            "canceled": value("meshserve_worker_cancelled_total", model="fake"),
            "steps": value("meshserve_worker_denoise_step_seconds_count", model="fake"),
            "batches": value("meshserve_worker_batch_size_count", model="fake"),
            "images": value("meshserve_worker_batch_size_sum", model="fake"),
            "encode": value("meshserve_worker_stage_seconds_count", model="fake", stage="encode"),
        }
        async with Harness(cfg) as h:
            assert value("meshserve_worker_pool_ready", pool="m") == 1.0
            ids = await submit_many(h.store, [params("a", n=1), params("b", n=1)])
            await wait_ended(h.store, ids, timeout=10)
            (slow,) = await submit_many(h.store, [params("slow", steps=100)])
            await wait_status(h.store, slow, JobStatus.RUNNING, timeout=10, step=1)
            await h.store.cancel(slow)
            await wait_ended(h.store, [slow], timeout=10)
            port = serve_metrics(0, addr="127.0.0.1")
            text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
            assert 'meshserve_worker_pool_ready{pool="m"} 1.0' in text
        assert value("meshserve_worker_jobs_total", model="fake", outcome="succeeded") - before["ok"] == 2
        assert value("meshserve_worker_cancelled_total", model="fake") - before["canceled"] == 1
        assert value("meshserve_worker_denoise_step_seconds_count", model="fake") - before["steps"] >= 4 + 1
        batches = value("meshserve_worker_batch_size_count", model="fake") - before["batches"]
        images = value("meshserve_worker_batch_size_sum", model="fake") - before["images"]
        assert (batches, images) == (2, 3)  # a and b together, then the slow one
        assert (
            value("meshserve_worker_stage_seconds_count", model="fake", stage="encode") - before["encode"]
            == 2
        )
        assert value("meshserve_worker_pool_ready", pool="m") == 0.0

    asyncio.run(main())


def _served(pools):
    """Registry entries by config name -> the fake model's info as published."""
    return {p.name.rsplit("/", 1)[1]: p.models[0] for p in pools}


def test_a_pool_publishes_its_buckets_as_the_only_sizes_it_serves():
    """Before: limits carried no buckets (`/v1/models` showed no size limit) and every multiple of 8 up to the
    model's max was admitted, to be compiled on the request path."""

    async def main():
        cfg = _config(
            [
                _pool("buckets", "0", buckets=[[32, 48], [64, 64]]),
                _pool("default", "1"),
                _pool("any", "2", buckets=[[32, 32]], any_size=True, max_programs=4),
            ]
        )
        async with Harness(cfg) as h:
            served = _served(await h.store.list_pools())
            assert served["buckets"].limits.buckets == [(32, 48), (64, 64)]
            assert (served["buckets"].defaults.width, served["buckets"].defaults.height) == (64, 64)
            assert served["default"].limits.buckets == [(64, 64)]  # the fake model's default size alone
            assert served["any"].limits.buckets is None and served["any"].limits.max_size == 1024
            pools = {p.name.rsplit("/", 1)[1]: p for p in await h.store.list_pools()}
            assert pools["buckets"].buckets == [(32, 48), (64, 64)] and pools["any"].buckets == [(32, 32)]

    asyncio.run(main())


def test_a_bucket_the_model_cannot_run_stops_the_pool():
    async def main():
        cfg = _config([_pool("bad", "0", buckets=[[60, 64]])])
        with pytest.raises(ValueError, match="bucket 60x64 is not a size fake can run"):
            async with Harness(cfg):
                pass

    asyncio.run(main())


def test_compilations_are_counted_by_pool_and_reason():
    from prometheus_client import REGISTRY

    def value(pool, reason):
        labels = {"pool": pool, "reason": reason}
        return REGISTRY.get_sample_value("meshserve_compilations_total", labels) or 0.0

    async def main():
        runner = "tests.workers.helpers:CompilingRunner"
        cfg = WorkerConfig.model_validate(
            {
                "models": {"fake": {"runner": runner}},
                "pools": [_pool("cc", "0", buckets=[[16, 16], [32, 32]], any_size=True, max_programs=8)],
                "metrics_port": None,
            }
        )
        before = value("cc", "warmup"), value("cc", "request")
        async with Harness(cfg) as h:
            assert value("cc", "warmup") - before[0] == 2  # two buckets x batch size 1
            ids = await submit_many(h.store, [params(size=16), params(size=48)])  # 48: not warmed up
            await wait_ended(h.store, ids, timeout=10)
            assert value("cc", "request") - before[1] == 1
            assert h.worker.pools[0].runners["fake"].options["max_programs"] == 8

    asyncio.run(main())


def test_a_metrics_port_in_use_ends_the_worker_at_once_saying_so(monkeypatch):
    """A worker restarted while the old one still drains found its metrics port taken: it died with an OSError
    traceback from deep in the HTTP server (an audit). Now it ends before any pool starts, naming the setting."""
    import socket

    from meshserve.workers import main as worker_main

    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        cfg = _config([_pool("p0", "0")]).model_copy(update={"metrics_port": held.getsockname()[1]})
        started = []
        monkeypatch.setattr(worker_main.Worker, "run", lambda self: started.append(self) or asyncio.sleep(0))
        with pytest.raises(RuntimeError, match="cannot serve /metrics on port .*set `metrics_port`"):
            asyncio.run(worker_main._main(cfg))
        assert started == []
