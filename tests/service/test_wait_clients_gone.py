"""Found by an audit: a `Prefer: wait` submit or an OpenAI images request whose client closed (or half-closed)
its connection held its wait slot, and a blocking Redis connection, until the job ended or the wait ran out (a
minute; five for the OpenAI route): three such clients left every other client of the process 503s. Now the
wait races the client's disconnect: the slot comes back at once and the accepted job keeps going."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import uvicorn

from meshserve.service.app import create_app
from meshserve.service.contract import JobStatus
from meshserve.service.store import Store
from tests.private_redis import free_port
from tests.service.conftest import TOY, FakeWorker, drop_keys
from tests.service.test_image_inputs import PNG, TOY_IMG

pytestmark = pytest.mark.anyio


async def _raw_post(port: int, path: str, request: httpx.Request):
    """`request` written on a socket of its own, never read: the test decides how the client leaves."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = request.read()
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in request.headers.items() if k.lower() != "host")
    writer.write(head.encode() + b"\r\n" + data)
    await writer.drain()
    return reader, writer


async def _until(predicate, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if predicate():
            return time.monotonic() - t0
        await asyncio.sleep(0.02)
    raise AssertionError(f"no {what} within {timeout} s")


async def test_a_waiting_client_that_leaves_gives_its_wait_slot_back(make_settings):
    port = free_port()
    settings = make_settings(max_waiting=4, sse_keepalive_s=0.2)
    app = create_app(settings)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    serving = asyncio.create_task(server.serve())
    writers = []
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        store = app.state.store
        slots = app.state.wait_slots
        # Ready, never runs anything: the jobs stay queued.
        await FakeWorker(store, models=(TOY, TOY_IMG)).register()
        url = f"http://127.0.0.1:{port}"
        wait = {"Prefer": "wait=60"}
        edit = {"prompt": "edit closes", "model": "toy-img", "size": "64x48"}
        for path, request in (
            (
                "/v1/generate",
                httpx.Request("POST", url, json={"model": "toy", "prompt": "closes"}, headers=wait),
            ),
            (
                "/v1/generate",
                httpx.Request("POST", url, json={"model": "toy", "prompt": "half-closes"}, headers=wait),
            ),
            (
                "/v1/images/generations",
                httpx.Request("POST", url, json={"model": "toy", "prompt": "closes too"}),
            ),
            (
                "/v1/images/edits",  # multipart: its body is read another way (a form)
                httpx.Request("POST", url, files={"image": ("in.png", PNG, "image/png")}, data=edit),
            ),
        ):
            writers.append((await _raw_post(port, path, request))[1])
        await _until(lambda: slots.total == 4, 10, "four waits holding their slots")
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            # Every slot is held: a wait is answered at once, without its preference.
            r = await client.post(
                "/v1/generate", json={"model": "toy", "prompt": "probe"}, headers={"Prefer": "wait=1"}
            )
            assert r.status_code == 202 and "preference-applied" not in r.headers
            probe = r.json()["id"]
            writers[0].close()  # gone
            writers[1].write_eof()  # half-closed: it sends nothing more, and reads nothing
            writers[2].close()
            writers[3].close()
            took = await _until(lambda: slots.total == 0, 3, "the slots back")
            assert took < 2.0, took
            assert not slots.held
            # A new wait and a new stream get slots.
            r = await client.post(
                "/v1/generate", json={"model": "toy", "prompt": "probe 2"}, headers={"Prefer": "wait=1"}
            )
            assert r.status_code == 202 and r.headers["preference-applied"] == "wait=1", r.headers
            async with client.stream("GET", f"/v1/jobs/{probe}/events") as stream:
                assert stream.status_code == 200
            # The jobs of the clients that left were accepted, and stay queued.
            queued = [j async for j in _jobs(store)]
            prompts = {j.params.prompt: j.status for j in queued}
            for prompt in ("closes", "half-closes", "closes too", "edit closes"):
                assert prompts[prompt] == JobStatus.QUEUED, prompts
    finally:
        for w in writers:
            w.close()
        app.state.draining.set()  # waits still held (before the fix) end now, not in a minute
        server.should_exit = True
        await serving
        cleanup = Store(settings)
        await drop_keys(cleanup)
        await cleanup.close()


async def _jobs(store: Store):
    async for key in store.redis.scan_iter(f"{store.prefix}:job:*"):
        job_id = key.decode().rsplit(":", 1)[1] if isinstance(key, bytes) else key.rsplit(":", 1)[1]
        job = await store.get(job_id)
        if job is not None:
            yield job
