"""Redis restarted mid-run: the API answers 503 with Retry-After meanwhile (never a 500), recovers by itself,
and no accepted job is lost. Uses its own redis-server (AOF, fsync always) on a spare port, never the shared one."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.service.conftest import FakeWorker, api_client

pytestmark = pytest.mark.anyio


async def test_redis_restart(make_settings, private_redis):
    settings = make_settings(redis_url=private_redis.url)
    async with api_client(settings) as (client, store):
        worker = FakeWorker(store)
        await worker.register()
        accepted = (await client.post("/v1/generate", json={"prompt": "before"})).json()
        assert accepted["status"] == "queued"

        private_redis.kill()  # SIGKILL: no shutdown save, only what the AOF already holds
        for method, path, body in [
            ("POST", "/v1/generate", {"prompt": "x"}),
            ("GET", f"/v1/jobs/{accepted['id']}", None),
            ("GET", "/readyz", None),
            ("GET", "/v1/models", None),
        ]:
            t0 = time.monotonic()
            r = await client.request(method, path, json=body)
            assert r.status_code == 503, (path, r.status_code, r.text)
            assert r.headers["retry-after"] and r.json()["error"]["code"] == "store_unavailable"
            assert time.monotonic() - t0 < 3  # refused connections fail fast
        assert (await client.get("/livez")).status_code == 200
        assert (await client.get("/metrics")).status_code == 200

        private_redis.start()  # same port and folder: the AOF is replayed
        deadline = time.monotonic() + 10
        while (await client.get("/readyz")).status_code != 200:
            assert time.monotonic() < deadline, "the API did not recover"
            await asyncio.sleep(0.05)
        worker.start()
        after = (await client.post("/v1/generate", json={"prompt": "after"})).json()
        for job_id in (accepted["id"], after["id"]):
            deadline = time.monotonic() + 10
            while (body := (await client.get(f"/v1/jobs/{job_id}")).json())["status"] != "succeeded":
                assert time.monotonic() < deadline, body
                await asyncio.sleep(0.02)
        # The job reads succeeded once its end is committed, a moment before the fake worker notes it: stopping
        # the worker at once cancelled it in between (a failed clean-clone run, 2026-12-01).
        deadline = time.monotonic() + 10
        while len(worker.finished) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await worker.stop()
        assert sorted(worker.finished) == sorted([accepted["id"], after["id"]])  # each exactly once
