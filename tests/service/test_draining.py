"""A SIGTERMed API process ends what waits on jobs at once (service/api/draining.py): a `Prefer: wait` submit
answers 202 with the job's Location, an SSE stream ends with a comment saying to reconnect, and the process
exits well within Kubernetes' grace period. An audit saw one wait a minute for a long job (the stream open)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from meshserve.service.api.draining import unless_draining
from meshserve.service.store import Store
from tests.private_redis import free_port
from tests.service.conftest import FakeWorker, drop_keys

pytestmark = pytest.mark.anyio


async def test_unless_draining():
    draining = asyncio.Event()
    assert await unless_draining(asyncio.sleep(0, "done"), draining) == "done"
    slow = asyncio.create_task(unless_draining(asyncio.sleep(30), draining))
    await asyncio.sleep(0.05)
    draining.set()
    assert await asyncio.wait_for(slow, 2) is None
    assert await unless_draining(asyncio.sleep(30), draining) is None  # already set: at once


async def test_sigterm_ends_waits_and_streams_and_the_process(make_settings):
    settings = make_settings()
    store = Store(settings)
    await FakeWorker(store).register()  # ready: submits are admitted; it never runs them
    port = free_port()
    env = {
        **os.environ,
        "MESHSERVE_REDIS_URL": settings.redis_url,
        "MESHSERVE_KEY_PREFIX": settings.key_prefix,
        "MESHSERVE_AUTH": "none",
        "MESHSERVE_POOL_CACHE_S": "0",
        "MESHSERVE_POOL_STALE_S": "300",
    }
    api = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from meshserve.cli import main; main()",
            "api",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            for _ in range(300):
                try:
                    if (await client.get("/readyz")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.1)
            queued = (await client.post("/v1/generate", json={"prompt": "a"})).json()["id"]
            waiting = asyncio.create_task(
                client.post("/v1/generate", json={"prompt": "b"}, headers={"Prefer": "wait=60"})
            )

            async def follow() -> list[str]:
                async with client.stream("GET", f"/v1/jobs/{queued}/events") as r:
                    return [line async for line in r.aiter_lines() if line]

            stream = asyncio.create_task(follow())
            await asyncio.sleep(1.0)  # both are waiting on Redis now
            t0 = time.monotonic()
            api.send_signal(signal.SIGTERM)
            r = await asyncio.wait_for(waiting, 10)
            lines = await asyncio.wait_for(stream, 10)
            answered = time.monotonic() - t0
        assert r.status_code == 202 and r.json()["status"] == "queued", r.text
        assert r.headers["location"] == f"/v1/jobs/{r.json()['id']}"
        assert lines[:2] == ["id: " + lines[0].removeprefix("id: "), "event: queued"], lines
        assert "reconnect with Last-Event-ID" in lines[-1], lines
        assert answered < 5, answered  # at once, not when the jobs end (never, here)
        # Ended (uvicorn re-raises the SIGTERM it handled once it has shut down: -15).
        assert api.wait(timeout=15) in (0, -signal.SIGTERM), api.stderr.read().decode()[-2000:]
    finally:
        if api.poll() is None:
            api.kill()
            api.wait()
        await drop_keys(store)
        await store.close()
