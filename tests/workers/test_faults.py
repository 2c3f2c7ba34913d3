"""Worker processes against the real Redis (fake runner, no JAX): SIGKILL mid-job, a poison job that crashes
the process, a paused (stale) worker fenced off, SIGTERM, and 200 jobs over two processes each succeeding exactly
once. Leases are short so each case runs in seconds."""

import asyncio
import os
import signal
import time

import pytest

from meshserve.service.contract import JobStatus
from meshserve.service.store import Store
from tests.workers.helpers import (
    all_events,
    cleanup,
    fake_config,
    make_settings,
    params,
    spawn_worker,
    submit_many,
    wait_ended,
    wait_pools_ready,
    wait_status,
)


@pytest.fixture
def env(tmp_path):
    """Settings with a unique prefix, a store, and every spawned worker killed at the end."""
    settings = make_settings(lease_s=1.0)
    procs = []

    class Env:
        def spawn(self, config, name):
            p = spawn_worker(config, settings, tmp_path / f"{name}.log")
            procs.append(p)
            return p

        def log(self, name):
            return (tmp_path / f"{name}.log").read_text(errors="replace")

    e = Env()
    e.settings, e.tmp = settings, tmp_path
    yield e
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)
    cleanup(settings)


def _pool(name, **kw):
    return {"name": name, "devices": "0", "models": ["fake"], "max_batch": 1, "batch_wait_ms": 0, **kw}


def _pid_of(job):
    # The consumer is "<host>-<pid>/<pool>".
    return int(job.worker.rsplit("/", 1)[0].rsplit("-", 1)[1])


def test_sigkill_mid_job_is_finished_by_another_worker_exactly_once(env):
    async def main():
        store = Store(env.settings)
        cfg_a = fake_config(env.tmp / "a.yaml", pools=[_pool("a")], step_seconds=0.05)
        cfg_b = fake_config(env.tmp / "b.yaml", pools=[_pool("b")], step_seconds=0.05)
        procs = {"a": env.spawn(cfg_a, "a"), "b": env.spawn(cfg_b, "b")}
        await wait_pools_ready(store, {"a", "b"})
        (job_id,) = await submit_many(store, [params("victim", steps=30)])
        job = await wait_status(store, job_id, JobStatus.RUNNING, timeout=10, step=3)
        holder = job.worker.rsplit("/", 1)[1]
        other = "b" if holder == "a" else "a"
        assert _pid_of(job) == procs[holder].pid
        procs[holder].send_signal(signal.SIGKILL)
        procs[holder].wait(5)
        t_kill = time.monotonic()
        job = (await wait_ended(store, [job_id], timeout=20))[job_id]
        assert job.status == JobStatus.SUCCEEDED
        assert job.worker.endswith(f"/{other}") and job.attempt == 2
        # Taken over once the lease (1 s) lapsed, then 30 steps of 50 ms.
        assert time.monotonic() - t_kill < 10
        events = await all_events(store, job_id)
        assert events.count("succeeded") == 1 and events.count("started") == 2
        assert len(job.outputs) == 1 and await store.output(job_id, 0) is not None
        assert (await store.stats())[("fake", "reclaimed")] == 1
        await store.close()

    asyncio.run(main())


def test_poison_job_that_crashes_the_process_is_dead_lettered_after_3_deliveries(env):
    async def main():
        store = Store(env.settings)
        cfg = fake_config(env.tmp / "w.yaml", pools=[_pool("w")])
        (poison,) = await submit_many(store, [params("FAKE_CRASH")])
        crashes, deadline = 0, time.monotonic() + 60
        proc = env.spawn(cfg, "w")
        while time.monotonic() < deadline:
            job = await store.get(poison)
            if job.status.terminal:
                break
            if proc.poll() is not None:  # a process manager restarts the crashed worker
                assert proc.returncode == 17
                crashes += 1
                proc = env.spawn(cfg, "w")
            await asyncio.sleep(0.05)
        assert job.status == JobStatus.FAILED, job
        assert job.error.code == "too_many_deliveries" and "limit 3" in job.error.message
        assert crashes == 3
        dlq = await store.redis.xrange(store.dlq_key("fake"))
        assert [e[1]["job"] for e in dlq] == [poison] and dlq[0][1]["deliveries"] == "4"
        # The worker that met the fourth delivery is alive and serves the next job.
        (good,) = await submit_many(store, [params("fine")])
        assert (await wait_ended(store, [good], timeout=10))[good].status == JobStatus.SUCCEEDED
        assert proc.poll() is None
        await store.close()

    asyncio.run(main())


def test_a_crashing_job_spends_only_its_own_deliveries_not_its_batch_neighbours(env):
    """The poison job is batched with three others the first time; redelivered, each runs alone, so the crashes
    that follow take only the poison job's deliveries (an audit's neighbours, another tenant's, were dead-lettered
    with it: the same batch formed again on every delivery)."""

    async def main():
        store = Store(env.settings)
        cfg = fake_config(env.tmp / "w.yaml", pools=[_pool("w", max_batch=4, batch_wait_ms=200)])
        poison, *others = await submit_many(
            store, [params("FAKE_CRASH")] + [params(f"fine {i}") for i in range(3)]
        )
        crashes, deadline = 0, time.monotonic() + 60
        proc = env.spawn(cfg, "w")
        while time.monotonic() < deadline:
            jobs = [await store.get(j) for j in (poison, *others)]
            if all(j.status.terminal for j in jobs):
                break
            if proc.poll() is not None:
                assert proc.returncode == 17
                crashes += 1
                proc = env.spawn(cfg, "w")
            await asyncio.sleep(0.05)
        assert jobs[0].status == JobStatus.FAILED and jobs[0].error.code == "too_many_deliveries", jobs[0]
        assert [j.status for j in jobs[1:]] == [JobStatus.SUCCEEDED] * 3, [j.error for j in jobs[1:]]
        assert crashes == 3
        # Started twice each: in the first batch, with the poison job, then alone.
        for j in others:
            assert (await all_events(store, j)).count("started") == 2
        dlq = await store.redis.xrange(store.dlq_key("fake"))
        assert [e[1]["job"] for e in dlq] == [poison]
        await store.close()

    asyncio.run(main())


def test_a_paused_worker_is_fenced_off_and_its_late_result_refused(env):
    async def main():
        store = Store(env.settings)
        slow = fake_config(env.tmp / "a.yaml", pools=[_pool("a")], step_seconds=0.05)
        a = env.spawn(slow, "a")
        await wait_pools_ready(store, {"a"})
        (job_id,) = await submit_many(store, [params("contested", steps=20)])
        await wait_status(store, job_id, JobStatus.RUNNING, timeout=10, step=2)
        os.kill(a.pid, signal.SIGSTOP)  # a GC pause / a hung host: no heartbeats, but not dead
        try:
            b = env.spawn(fake_config(env.tmp / "b.yaml", pools=[_pool("b")], step_seconds=0.05), "b")
            job = (await wait_ended(store, [job_id], timeout=20))[job_id]
            assert job.status == JobStatus.SUCCEEDED and job.worker.endswith("/b") and job.attempt == 2
        finally:
            os.kill(a.pid, signal.SIGCONT)
        # a resumes, finishes its steps (about a second) and its writes are refused: wait for its log to say so.
        for _ in range(60):
            if "owned by another delivery; dropping it" in env.log("a"):
                break
            await asyncio.sleep(0.5)
        job = await store.get(job_id)
        assert job.worker.endswith("/b") and job.attempt == 2
        events = await all_events(store, job_id)
        assert events.count("succeeded") == 1
        assert a.poll() is None and b.poll() is None
        assert "owned by another delivery; dropping it" in env.log("a")
        await store.close()

    asyncio.run(main())


def test_sigterm_finishes_the_running_job_and_exits(env):
    async def main():
        store = Store(env.settings)
        cfg = fake_config(env.tmp / "w.yaml", pools=[_pool("w")], step_seconds=0.05, drain_seconds=10)
        proc = env.spawn(cfg, "w")
        await wait_pools_ready(store, {"w"})
        running, queued = await submit_many(store, [params("running", steps=20), params("queued")])
        await wait_status(store, running, JobStatus.RUNNING, timeout=10, step=1)
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 15) == 0
        assert (await store.get(running)).status == JobStatus.SUCCEEDED
        assert (await store.get(queued)).status == JobStatus.QUEUED
        assert await store.list_pools(include_stale=True) == []
        await store.close()

    asyncio.run(main())


def test_sigterm_past_the_drain_time_releases_the_job_to_another_worker(env):
    async def main():
        store = Store(env.settings)
        a = env.spawn(
            fake_config(env.tmp / "a.yaml", pools=[_pool("a")], step_seconds=0.05, drain_seconds=0.3), "a"
        )
        await wait_pools_ready(store, {"a"})
        (job_id,) = await submit_many(store, [params("long", steps=100)])
        await wait_status(store, job_id, JobStatus.RUNNING, timeout=10, step=1)
        a.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(a.wait, 15) == 0
        job = await store.get(job_id)
        assert job.status == JobStatus.QUEUED and job.attempt == 2
        t0 = time.monotonic()
        env.spawn(fake_config(env.tmp / "b.yaml", pools=[_pool("b")]), "b")
        job = (await wait_ended(store, [job_id], timeout=20))[job_id]
        assert job.status == JobStatus.SUCCEEDED and job.worker.endswith("/b")
        assert time.monotonic() - t0 < 10
        events = await all_events(store, job_id)
        assert events.count("succeeded") == 1
        await store.close()

    asyncio.run(main())


def test_200_jobs_over_two_worker_processes_each_succeed_exactly_once(env):
    async def main():
        store = Store(env.settings)
        pools = [_pool("w", max_batch=4, batch_wait_ms=2)]
        env.spawn(fake_config(env.tmp / "a.yaml", pools=pools, default_steps=2), "a")
        env.spawn(fake_config(env.tmp / "b.yaml", pools=pools, default_steps=2), "b")
        # One config, two replicas: the same pool name, two registry entries and consumers ("<host>-<pid>/w").
        await wait_pools_ready(store, {"w"}, count=2)
        ids = await submit_many(store, [params(f"job {i}", steps=2, seed=i) for i in range(200)])
        jobs = await wait_ended(store, ids, timeout=90)
        assert all(j.status == JobStatus.SUCCEEDED for j in jobs.values())
        consumers = {j.worker for j in jobs.values()}
        assert len(consumers) == 2, consumers
        for job_id in ids:
            events = await all_events(store, job_id)
            assert events.count("succeeded") == 1 and events.count("started") == 1, (job_id, events)
        stats = await store.stats()
        assert stats[("fake", "finished|succeeded")] == 200
        assert ("fake", "reclaimed") not in stats and ("fake", "dead_lettered") not in stats
        await store.close()

    asyncio.run(main())
