"""The OpenAI routes as OpenAI's SDKs call them (ASGI, real Redis): the SDKs retry 408, 409, 429 and every 5xx
twice, each time as a new submit, unless the answer says `x-should-retry: false`. A client audit saw one
`images.generate()` make three jobs for a failed, a canceled and a timed-out job. Answers about a job that exists
say not to retry and where to follow it; an `Idempotency-Key` makes a retry return the same job."""

from __future__ import annotations

import pytest

from tests.service.conftest import FakeWorker, api_client

pytestmark = pytest.mark.anyio


async def _jobs(store) -> int:
    return len([k async for k in store.redis.scan_iter(f"{store.prefix}:job:*", count=1000)])


async def test_a_timed_out_or_canceled_job_is_not_retried_and_a_key_returns_the_same_job(make_settings):
    async with api_client(make_settings(openai_timeout_s=0.3)) as (client, store):
        worker = FakeWorker(store)
        await worker.register()  # ready, not running: the job waits
        body, key = {"prompt": "x", "model": "toy"}, {"Idempotency-Key": "gen-1"}
        r = await client.post("/v1/images/generations", json=body, headers=key)
        assert r.status_code == 504, r.text
        assert r.headers["x-should-retry"] == "false"
        location = r.headers["location"]
        assert location.startswith("/v1/jobs/") and location.split("/")[-1] in r.json()["error"]["message"]
        # The SDK's retry (or the client's own) with the key waits for the same job: still one job.
        before = await _jobs(store)
        r = await client.post("/v1/images/generations", json=body, headers=key)
        assert r.status_code == 504 and r.headers["location"] == location
        assert await _jobs(store) == before
        # Another body under the key is a conflict, not a second job.
        r = await client.post("/v1/images/generations", json={**body, "n": 2}, headers=key)
        assert r.status_code == 422, r.text
        # Canceled: 409 that says not to retry; the key's replay answers the same.
        assert (await client.post(f"{location}/cancel")).status_code in (200, 202)
        r = await client.post("/v1/images/generations", json=body, headers=key)
        assert r.status_code == 409 and r.json()["error"]["code"] == "job_canceled", r.text
        assert r.headers["x-should-retry"] == "false" and r.headers["location"] == location
        assert await _jobs(store) == before
        # With a worker the key's job would have run; a new key makes a new job, answered 200.
        worker.start()
        try:
            r = await client.post("/v1/images/generations", json=body, headers={"Idempotency-Key": "gen-2"})
            assert r.status_code == 200, r.text
            again = await client.post(
                "/v1/images/generations", json=body, headers={"Idempotency-Key": "gen-2"}
            )
            assert again.status_code == 200 and again.json()["data"] == r.json()["data"]
        finally:
            await worker.stop()
