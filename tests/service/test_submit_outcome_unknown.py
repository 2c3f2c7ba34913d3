"""Found by an audit: Redis stalled (SIGSTOP) while a submit's script was on its way, the client got 503
store_unavailable after the command deadline, and when Redis resumed the script ran: a job the client never heard
of, which a retry without an Idempotency-Key doubled. Now a submit whose script may have been sent answers 503
with the job's `Location` (its id is chosen before the script runs) and a message saying the outcome is unknown.
Uses its own redis-server, never the shared one."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from tests.service.conftest import FakeWorker, api_client

pytestmark = pytest.mark.anyio


async def test_a_submit_that_times_out_names_the_job_it_may_have_made(make_settings, private_redis):
    # The catalog is cached (pool_cache_s): only the submit's script meets the stalled Redis.
    settings = make_settings(redis_url=private_redis.url, redis_command_timeout_s=0.5, pool_cache_s=60)
    async with api_client(settings) as (client, store):
        await FakeWorker(store).register()
        assert (await client.post("/v1/generate", json={"prompt": "warm"})).status_code == 202
        os.kill(private_redis.pid, signal.SIGSTOP)
        try:
            r = await client.post("/v1/generate", json={"prompt": "ghost"})
        finally:
            os.kill(private_redis.pid, signal.SIGCONT)  # Redis resumes and runs the script it was sent
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["code"] == "store_unavailable"
        location = r.headers.get("location", "")
        job_id = location.rsplit("/", 1)[-1]
        assert location == f"/v1/jobs/{job_id}" and job_id and job_id in error["message"], (
            r.headers,
            error,
        )
        assert "unknown" in error["message"] and "Idempotency-Key" in error["message"]
        assert "retry-after" in r.headers
        for _ in range(100):
            r = await client.get(location)
            if r.status_code == 200:
                break
            await asyncio.sleep(0.05)
        assert r.status_code == 200, r.text
        assert r.json()["params"]["prompt"] == "ghost" and r.json()["status"] == "queued"
