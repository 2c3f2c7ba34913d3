"""Deadlines (issue 23 §2): `Cancel-After` (Replicate's durations) or `deadline_s`. A job not started by then ends
`expired` - by the sweep while it waits, or when a pool claims or starts it - and one running past it is canceled
between steps by the worker's job loop (the fake runner), with error `deadline_exceeded`."""

from __future__ import annotations

import asyncio
import time

import pytest
import yaml

from meshserve.service.api.job_options import parse_duration
from meshserve.service.contract import JobStatus
from meshserve.service.openapi_export import DEFAULT_PATH
from meshserve.service.store import Store
from meshserve.workers.config import WorkerConfig
from meshserve.workers.main import Worker
from tests.service.conftest import FakeWorker, api_client
from tests.workers.helpers import all_events, cleanup, params, wait_ended, wait_status
from tests.workers.helpers import make_settings as worker_settings


def test_cancel_after_takes_seconds_and_durations():
    assert parse_duration("90") == 90.0
    assert parse_duration("2.5") == 2.5
    assert parse_duration("45s") == 45.0
    assert parse_duration("5m") == 300.0
    assert parse_duration("1h30m45s") == 5445.0
    assert parse_duration("1.5h") == 5400.0
    assert parse_duration("250ms") == 0.25
    assert parse_duration(" 1M ") == 60.0
    for bad in ("", "-5", "5 m", "m", "5d", "1h-30m", "inf", "nan", "1e3", "5" * 100):
        with pytest.raises(ValueError):
            parse_duration(bad)


@pytest.mark.anyio
async def test_bad_deadlines_are_422s_naming_the_field(make_settings):
    async with api_client(make_settings(max_deadline_s=3600)) as (client, store):
        await FakeWorker(store).register()
        cases = [
            ({"Cancel-After": "soon"}, {}, "Cancel-After", "invalid_duration"),
            ({"Cancel-After": "2h"}, {}, "Cancel-After", "out_of_range"),
            ({"Cancel-After": "0"}, {}, "Cancel-After", "out_of_range"),
            ({}, {"deadline_s": 0}, "deadline_s", "greater_than"),
            ({}, {"deadline_s": 7200}, "deadline_s", "out_of_range"),
            ({}, {"deadline_s": "soon"}, "deadline_s", "float_type"),
        ]
        for headers, extra, field, code in cases:
            r = await client.post("/v1/generate", json={"prompt": "a", **extra}, headers=headers)
            assert r.status_code == 422, (headers, extra, r.text)
            assert r.json()["error"]["field"] == field and r.json()["error"]["code"] == code, r.json()
        # The header wins over the body field.
        t0 = time.time()
        r = await client.post(
            "/v1/generate", json={"prompt": "a", "deadline_s": 5}, headers={"Cancel-After": "10m"}
        )
        assert r.status_code == 202
        assert t0 + 599 < r.json()["deadline_at"] < time.time() + 601
        assert (await client.get(f"/v1/jobs/{r.json()['id']}")).json()["deadline_at"] == r.json()[
            "deadline_at"
        ]


@pytest.mark.anyio
async def test_a_queued_job_expires_at_its_deadline_without_a_pool_claiming(make_settings):
    async with api_client(make_settings(webhook_poll_s=0.05)) as (client, store):
        await FakeWorker(store).register()  # registered, never claims
        r = await client.post("/v1/generate", json={"prompt": "a", "deadline_s": 0.3})
        later = await client.post("/v1/generate", json={"prompt": "b", "deadline_s": 60})
        job_id = r.json()["id"]
        t0 = time.monotonic()
        async with client.stream("GET", f"/v1/jobs/{job_id}/events") as events:
            lines = [line async for line in events.aiter_lines() if line.startswith("event:")]
        waited = time.monotonic() - t0
        job = (await client.get(f"/v1/jobs/{job_id}")).json()
        assert lines == ["event: queued", "event: expired"]  # a terminal event: the stream ends
        assert 0.2 < waited < 1.5  # at the deadline, within the sweep's period (0.05 s here)
        assert job["status"] == "expired" and job["started_at"] is None
        assert job["error"]["code"] == "deadline_exceeded"
        assert (await store.get(later.json()["id"])).status == JobStatus.QUEUED
        # A wait ends with it too (expired is terminal), and the counters count it.
        assert ("toy", "finished|expired") in await store.stats()


@pytest.mark.anyio
async def test_a_pool_never_starts_a_job_past_its_deadline(make_settings):
    settings = make_settings(webhook_deliver_in_api=False)  # no sweep: the pool's claim and start decide
    async with api_client(settings) as (client, store):
        await FakeWorker(store).register()
        late = (await client.post("/v1/generate", json={"prompt": "a", "deadline_s": 0.1})).json()["id"]
        await asyncio.sleep(0.15)
        assert await store.claim(["toy"], "c", 1) == []  # claimed and ended in the same script
        assert (await store.get(late)).status == JobStatus.EXPIRED
        # Claimed in time, started too late (it waited as a batch leftover).
        held = (await client.post("/v1/generate", json={"prompt": "b", "deadline_s": 0.2})).json()["id"]
        (d,) = await store.claim(["toy"], "c", 1)
        await asyncio.sleep(0.25)
        assert await store.expire_due() == []  # the sweep leaves a job a pool holds to that pool
        assert not await store.start(d)
        job = await store.get(held)
        assert job.status == JobStatus.EXPIRED and job.error.code == "deadline_exceeded"


def test_a_running_job_is_canceled_between_steps_at_its_deadline():
    """The worker's own job loop (fake runner, 50 steps of 0.05 s) stops the job at its deadline: its progress
    task reads the deadline with the cancel flags (`Store.poll_running`)."""

    async def main():
        settings = worker_settings()
        config = WorkerConfig.model_validate(
            {
                "models": {"fake": {"runner": "fake", "options": {"step_seconds": 0.05}}},
                "pools": [
                    {"name": "a", "devices": "0", "models": ["fake"], "max_batch": 1, "batch_wait_ms": 0}
                ],
                "metrics_port": None,
            }
        )
        store, worker = Store(settings), Worker(config, settings)
        task = asyncio.create_task(worker.run())
        try:
            await asyncio.wait_for(worker.ready.wait(), 20)
            job = await store.submit(params("slow", steps=50), deadline_at=time.time() + 1.0)
            await wait_status(store, job.id, JobStatus.RUNNING, timeout=10, step=1)
            ended = (await wait_ended(store, [job.id], timeout=10))[job.id]
            assert ended.status == JobStatus.CANCELED
            assert ended.error is not None and ended.error.code == "deadline_exceeded"
            assert ended.finished_at - ended.deadline_at < 1.0  # a poll (0.25 s), a step, slack for a busy CI
            assert 1 <= ended.progress.step < 50
            assert (await all_events(store, job.id))[-1] == "canceled"
            # The pool goes on with the next job.
            nxt = await store.submit(params("next", steps=2))
            assert (await wait_ended(store, [nxt.id], timeout=10))[nxt.id].status == JobStatus.SUCCEEDED
        finally:
            worker.stop()
            await asyncio.wait_for(task, 20)
            await store.close()
            cleanup(settings)

    asyncio.run(main())


def test_expired_is_a_terminal_status_in_the_openapi():
    spec = yaml.safe_load(DEFAULT_PATH.read_text())
    assert "expired" in spec["components"]["schemas"]["JobStatus"]["enum"]
    generate = spec["paths"]["/v1/generate"]["post"]
    assert "Cancel-After" in [p["name"] for p in generate["parameters"]]
    request = spec["components"]["schemas"]["GenerateRequest"]["properties"]
    assert {"deadline_s", "webhook"} <= set(request)
