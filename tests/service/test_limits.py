"""Resource limits (issue 11; OWASP API4 unrestricted resource consumption) over HTTP (ASGI) on the real Redis:
per-key requests per minute shared by every replica (429 + Retry-After + the IETF draft's RateLimit headers),
active jobs per tenant (pruned as jobs end, so a tenant is never locked out), bodies over the limit (413 before
parsing), non-finite and out-of-range numbers, bounded metadata, and path/id abuse on every job route."""

from __future__ import annotations

import asyncio
import json
import re
import uuid

import httpx
import pytest

from meshserve.service.api.body_limit import BodySizeLimit
from meshserve.service.app import create_app
from meshserve.service.auth import KeyStore
from meshserve.service.store import Store
from tests.service.conftest import FakeWorker, api_client, drop_keys

pytestmark = pytest.mark.anyio
RATELIMIT = re.compile(r'^"per-minute";r=(\d+);t=(\d+)$')


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_requests_per_minute_are_shared_by_replicas_and_answered_429_with_headers(make_settings):
    settings = make_settings(auth="keys")
    async with api_client(settings) as (first, store):
        replica = create_app(settings, Store(settings))
        async with replica.router.lifespan_context(replica):
            transport = httpx.ASGITransport(app=replica)
            async with httpx.AsyncClient(transport=transport, base_url="http://replica") as second:
                key = await KeyStore(store.redis, store.prefix).create(
                    "erin", rate_per_minute=3, max_active=0
                )
                answers = [
                    await client.get("/v1/models", headers=bearer(key))
                    for client in (first, second, first, second)
                ]
            await replica.state.store.close()
    assert [r.status_code for r in answers] == [200, 200, 200, 429]
    for r in answers:
        assert r.headers["ratelimit-policy"] == '"per-minute";q=3;w=60'
    remaining = [int(RATELIMIT.match(r.headers["ratelimit"]).group(1)) for r in answers]
    assert remaining == [2, 1, 0, 0]
    refused = answers[-1]
    assert refused.json()["error"]["code"] == "rate_limited"
    # One token comes back every 20 s (3 per minute): that is when to retry, and what RateLimit's t says.
    t = int(RATELIMIT.match(refused.headers["ratelimit"]).group(2))
    assert 1 <= int(refused.headers["retry-after"]) == t <= 20


async def test_a_key_without_a_rate_sends_no_ratelimit_headers(make_settings):
    async with api_client(make_settings(auth="keys")) as (client, store):
        key = await KeyStore(store.redis, store.prefix).create("free", rate_per_minute=0, max_active=0)
        r = await client.get("/v1/models", headers=bearer(key))
        assert r.status_code == 200 and "ratelimit" not in r.headers


async def test_active_jobs_per_tenant_are_limited_and_freed_when_jobs_end(make_settings):
    async with api_client(make_settings(auth="keys")) as (client, store):
        worker = FakeWorker(store)
        await worker.register()
        ks = KeyStore(store.redis, store.prefix)
        key = await ks.create("frank", rate_per_minute=0, max_active=2)
        other = await ks.create("grace", rate_per_minute=0, max_active=2)
        ids = []
        for _ in range(2):
            r = await client.post("/v1/generate", json={"prompt": "x"}, headers=bearer(key))
            assert r.status_code == 202, r.text
            ids.append(r.json()["id"])
        r = await client.post("/v1/generate", json={"prompt": "x"}, headers=bearer(key))
        assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_active_jobs"
        assert int(r.headers["retry-after"]) >= 1
        r = await client.post("/v1/images/generations", json={"prompt": "x"}, headers=bearer(key))
        assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_active_jobs"
        # Another tenant is not affected.
        assert (
            await client.post("/v1/generate", json={"prompt": "x"}, headers=bearer(other))
        ).status_code == 202
        # A canceled job frees its place...
        assert (await client.post(f"/v1/jobs/{ids[0]}/cancel", headers=bearer(key))).status_code == 200
        r = await client.post("/v1/generate", json={"prompt": "x"}, headers=bearer(key))
        assert r.status_code == 202, r.text
        # ... and so do finished ones (the worker ends them through its own scripts; nothing decrements).
        worker.start()
        for _ in range(500):
            if len(worker.finished) >= 3:
                break
            await asyncio.sleep(0.01)
        for _ in range(2):
            r = await client.post("/v1/generate", json={"prompt": "x"}, headers=bearer(key))
            assert r.status_code == 202, r.text
        await worker.stop()


async def test_a_body_over_the_limit_is_413_before_it_is_parsed(make_settings):
    # (/v1/generate takes images: its limit is max_image_body_bytes, set to the same here.)
    async with api_client(make_settings(max_body_bytes=4096, max_image_body_bytes=4096)) as (client, store):
        await FakeWorker(store).register()
        big = b'{"prompt": "' + b"x" * 5000 + b'"}'
        r = await client.post("/v1/generate", content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

        async def chunks():  # no Content-Length: counted as it arrives
            for _ in range(10):
                yield b"x" * 1000

        r = await client.post("/v1/generate", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413 and "content-length" not in r.request.headers
        # Not JSON at all, but over the limit: still 413, the parser never saw it.
        r = await client.post("/v1/images/generations", content=b"\xff" * 5000)
        assert r.status_code == 413
        ok = await client.post("/v1/generate", json={"prompt": "x" * 1000})
        assert ok.status_code == 202, ok.text


async def test_the_bodies_held_at_once_are_bounded(make_settings):
    """`max_buffered_body_bytes`: a body that would take the sum held by the requests in flight past it is a 503
    before it is read (an audit measured 38 MB of API memory per 14 MB image request in flight); the bytes are
    released when a request ends, chunked bodies are counted as they arrive."""
    settings = make_settings(max_buffered_body_bytes=1 << 20)
    release, entered = asyncio.Event(), asyncio.Event()

    async def handler(scope, receive, send):  # holds its request until released, then answers 200
        await receive()
        entered.set()
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    limit = BodySizeLimit(handler)
    app = type("App", (), {"state": type("State", (), {"settings": settings})()})()

    async def post(size: int, declared: bool = True) -> tuple[int, dict]:
        head = [(b"content-length", str(size).encode())] if declared else []
        scope = {"type": "http", "method": "POST", "path": "/v1/generate", "headers": head, "app": app}
        parts = [b"x" * (size // 2), b"x" * (size - size // 2)]

        async def receive():
            return (
                {"type": "http.request", "body": parts.pop(0), "more_body": bool(parts)}
                if parts
                else {"type": "http.disconnect"}
            )

        sent: list[dict] = []

        async def send(message):
            sent.append(message)

        await limit(scope, receive, send)
        return sent[0]["status"], dict(sent[0]["headers"])

    first = asyncio.create_task(post(700 << 10))
    await entered.wait()
    assert limit.buffered == 700 << 10
    status, headers = await post(400 << 10)
    assert status == 503 and headers[b"retry-after"] == b"1"
    assert (await post(400 << 10, declared=False))[0] == 503  # chunked: refused once it passes the bound
    assert limit.buffered == 700 << 10  # the refused ones hold nothing
    release.set()
    assert (await first)[0] == 200 and limit.buffered == 0
    assert (await post(900 << 10))[0] == 200  # room again


async def test_declared_lengths_hold_nothing_and_a_body_that_never_comes_times_out(make_settings):
    """Headers declaring big bodies, and no body (an audit's 11 such connections took every POST to 503 for as
    long as they stayed open): only arrived bytes count, and the body's deadline answers 408."""
    settings = make_settings(max_buffered_body_bytes=1 << 20, body_timeout_s=0.2)
    limit = BodySizeLimit(lambda scope, receive, send: None)
    app = type("App", (), {"state": type("State", (), {"settings": settings})()})()
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/generate",
        "headers": [(b"content-length", str(900 << 10).encode())],
        "app": app,
    }
    silent = asyncio.Event()

    async def receive():
        await silent.wait()  # the body never comes

    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    idle = [asyncio.create_task(limit(dict(scope), receive, send)) for _ in range(3)]
    await asyncio.sleep(0.05)
    assert limit.buffered == 0  # 3 x 900 KiB declared against 1 MiB: nothing held
    await asyncio.gather(*idle)
    statuses = [m["status"] for m in sent if m["type"] == "http.response.start"]
    assert statuses == [408, 408, 408]
    body = json.loads(next(m["body"] for m in sent if m["type"] == "http.response.body"))
    assert body["error"]["code"] == "body_timeout"


async def test_the_default_body_limit_is_one_mebibyte(api):
    client, *_ = api
    body = b'{"prompt": "' + b"x" * (1 << 20) + b'"}'
    # A route without images (/v1/generate and /v1/images/edits have max_image_body_bytes: test_image_inputs.py)
    r = await client.post(
        "/v1/images/generations", content=body, headers={"content-type": "application/json"}
    )
    assert r.status_code == 413


@pytest.mark.parametrize(
    ("raw", "field", "code"),
    [
        ('"guidance_scale": NaN', "guidance_scale", "finite_number"),
        ('"guidance_scale": Infinity', "guidance_scale", "finite_number"),
        ('"guidance_scale": -Infinity', "guidance_scale", "finite_number"),
        ('"guidance_scale": 1e309', "guidance_scale", "finite_number"),
        # A union's first branch names the error; the message lists each branch's rule (finite_number too).
        ('"metadata": {"a": NaN}', "metadata.a.str", "string_type"),
        ('"metadata": {"a": 1e309}', "metadata.a.str", "string_type"),
        ('"metadata": {"a": 9007199254740993}', "metadata", "out_of_range"),
        ('"metadata": {"a": "' + "x" * 1025 + '"}', "metadata", "string_too_long"),
        ('"metadata": {"' + "k" * 65 + '": 1}', "metadata", "metadata_key_length"),
        ('"metadata": {"a": [1]}', "metadata.a.str", "string_type"),
        ('"width": 1e309', "width", "int_type"),  # a float (an infinite one) where an integer goes
        ('"width": 100000000000000000000000000000', "width", "out_of_range"),
        ('"seed": 4294967296', "seed", "less_than_equal"),
        ('"seed": -1', "seed", "greater_than_equal"),
        ('"n": 1000000000000', "n", "out_of_range"),
        ('"num_inference_steps": 1e3', "num_inference_steps", "int_type"),  # JSON's 1e3 is a float
        # JSON's types are kept, not coerced (found by an audit: "n": true ran one image, "width": "64" ran).
        ('"n": true', "n", "int_type"),
        ('"width": "64"', "width", "int_type"),
        ('"num_inference_steps": 2.0', "num_inference_steps", "int_type"),
        ('"deadline_s": true', "deadline_s", "float_type"),
        ('"deadline_s": "5"', "deadline_s", "float_type"),
        ('"previews": 1', "previews", "bool_type"),
        ('"loras": [{"name": "a", "scale": "1"}]', "loras.0.scale", "float_type"),
    ],
)
async def test_numbers_are_finite_and_in_range(api, raw, field, code):
    client, *_ = api
    body = '{"model": "toy", "prompt": "x", ' + raw + "}"
    r = await client.post("/v1/generate", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert (err["field"], err["code"]) == (field, code), err
    if ("NaN" in raw or "e309" in raw) and field != "width":
        assert "finite_number" in err["message"]


@pytest.mark.parametrize(
    ("route", "raw", "field"),
    [
        ("/v1/generate", '"prompt": "x", "negative_prompt": "a\\ud800b"', "negative_prompt"),
        ("/v1/generate", '"prompt": "x", "metadata": {"k": "a\\udfffb"}', "metadata"),
        ("/v1/generate", '"prompt": "x", "metadata": {"a\\ud800": 1}', "metadata"),
        ("/v1/generate", '"prompt": "a\\ud800"', "prompt"),
        ("/v1/images/generations", '"prompt": "a\\ud800"', "prompt"),
    ],
)
async def test_a_lone_surrogate_in_any_string_is_a_422(api, route, raw, field):
    """JSON may escape a lone UTF-16 surrogate, which Python reads into a str no encoder takes: an audit's
    negative_prompt and metadata value made the API answer 500 (the job could not be written), a metadata key
    was stored mangled. A real character written as an escaped pair is text and is accepted."""
    client, store, _ = api
    body = '{"model": "toy", ' + raw + "}"
    r = await client.post(route, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert (err["field"], err["code"]) == (field, "string_unicode"), err
    assert await store.redis.exists(store.stream_key("toy", "normal")) == 0
    pair = '{"model": "toy", "prompt": "x", "negative_prompt": "\\ud83d\\ude00", "metadata": {"\\u00e9": "\\ud83d\\ude00"}}'
    r = await client.post("/v1/generate", content=pair, headers={"content-type": "application/json"})
    assert r.status_code == 202 and r.json()["params"]["negative_prompt"] == "\U0001f600", r.text
    assert r.json()["params"]["metadata"] == {"\u00e9": "\U0001f600"}


async def test_a_number_with_thousands_of_digits_is_a_422(api):
    client, *_ = api
    body = '{"model": "toy", "prompt": "x", "seed": ' + "9" * 5000 + "}"
    r = await client.post("/v1/generate", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_json", r.text
    # A body that is not even UTF-8: the same answer (FastAPI's own is a 400 in another shape).
    r = await client.post(
        "/v1/generate", content=b"\xce\xb8\xff\x04@", headers={"content-type": "application/json"}
    )
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_json", r.text


async def test_path_and_id_abuse_is_answered_4xx(api):
    client, store, worker = api
    worker.start()
    r = await client.post("/v1/generate", json={"model": "toy", "prompt": "x"})
    job_id = r.json()["id"]
    for _ in range(500):
        if (await client.get(f"/v1/jobs/{job_id}")).json()["status"] == "succeeded":
            break
        await asyncio.sleep(0.01)
    ids = ["..", "%2e%2e", "..%2f..%2fetc%2fpasswd", "a%00b", "%00", "x" * 5000, "*", "job%0d%0aX: y", "%ff"]
    for bad in ids:
        for method, suffix in (("GET", ""), ("POST", "/cancel"), ("GET", "/events"), ("GET", "/outputs/0")):
            r = await client.request(method, f"/v1/jobs/{bad}{suffix}")
            assert 400 <= r.status_code < 500, (bad, suffix, r.status_code, r.text[:200])
            assert "x" * 100 not in r.text  # a 5,000-character id is not echoed back whole
    for index in ("-1", "65536", "1" + "0" * 30, "9" * 5000, "1.5", "0x1", "%00"):
        r = await client.get(f"/v1/jobs/{job_id}/outputs/{index}")
        assert r.status_code == 422, (index, r.status_code, r.text[:200])
    assert (await client.get(f"/v1/jobs/{job_id}/outputs/1")).status_code == 404  # n=1: only index 0
    assert (await client.get(f"/v1/jobs/{job_id}/outputs/0")).status_code == 200
    # Event ids are checked too: a malformed Last-Event-ID restarts the stream instead of reaching Redis.
    r = await client.get(f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": "../../x"})
    assert r.status_code == 200 and "event: succeeded" in r.text
    # One the pattern admits but Redis would refuse (over 2**64): the same, not a `store_unavailable` event.
    r = await client.get(f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": "9" * 20 + "-0"})
    assert r.status_code == 200 and "event: succeeded" in r.text and "store_unavailable" not in r.text
    assert uuid.UUID(job_id)


async def test_a_zero_size_on_the_openai_route_is_a_422_naming_size(api):
    """Found by the fuzzer: "0x0" matches the size pattern and was a 500 (GenerateRequest raised in the handler)."""
    client, *_ = api
    for size in ("0x0", "0x64", "64x0"):
        r = await client.post("/v1/images/generations", json={"prompt": "x", "size": size})
        assert r.status_code == 422, r.text
        assert r.json()["error"]["field"] == "size" and r.json()["error"]["code"] == "greater_than"


async def test_waiting_requests_are_bounded_per_key_and_per_process(make_settings):
    """Found by an audit: 120 SSE streams of one key took every Redis connection of the API process (blocking
    reads), and every other tenant got 503s, /readyz too. Now blocking reads have their own pool, and waits take a
    slot: per key (429) and per process (503); a `Prefer: wait` without one is answered at once."""
    import uvicorn

    from tests.private_redis import free_port

    port = free_port()
    settings = make_settings(auth="keys", max_waiting=3, max_waiting_per_key=2, sse_keepalive_s=0.2)
    app = create_app(settings)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    serving = asyncio.create_task(server.serve())
    opened: list = []
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        store = app.state.store
        await FakeWorker(store).register()  # ready, never runs anything: the jobs stay queued
        keys = KeyStore(store.redis, store.prefix)
        alice = bearer(await keys.create("alice", rate_per_minute=0, max_active=0))
        bob = bearer(await keys.create("bob", rate_per_minute=0, max_active=0))
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            jobs = {}
            for name, who in (("alice", alice), ("bob", bob)):
                jobs[name] = (await client.post("/v1/generate", json={"prompt": "x"}, headers=who)).json()[
                    "id"
                ]

            async def follow(who, name):
                stream = client.stream("GET", f"/v1/jobs/{jobs[name]}/events", headers=who)
                r = await stream.__aenter__()
                opened.append(stream)
                return r

            assert [(await follow(alice, "alice")).status_code for _ in range(2)] == [200, 200]
            r = await follow(alice, "alice")
            assert r.status_code == 429 and "retry-after" in r.headers  # alice's own bound
            assert (await follow(bob, "bob")).status_code == 200
            r = await follow(bob, "bob")
            assert r.status_code == 503  # the process's bound (3)
            # Everything else still answers: keys, submits, probes.
            assert (await client.get("/readyz")).status_code == 200
            assert (await client.get("/v1/models", headers=bob)).status_code == 200
            r = await client.post("/v1/generate", json={"prompt": "y"}, headers={**bob, "Prefer": "wait=5"})
            assert r.status_code == 202 and "preference-applied" not in r.headers  # no slot: answered at once
            r = await client.post("/v1/images/generations", json={"prompt": "z"}, headers=bob)
            assert r.status_code == 503 and r.json()["error"]["code"] == "too_many_waiting"
            await opened.pop(0).__aexit__(None, None, None)  # alice closes one: a slot is free again
            for _ in range(100):
                if app.state.wait_slots.total == 2:
                    break
                await asyncio.sleep(0.02)
            assert (await follow(alice, "alice")).status_code == 200
    finally:
        for stream in opened:
            await stream.__aexit__(None, None, None)
        server.should_exit = True
        await serving
        cleanup = Store(settings)
        await drop_keys(cleanup)
        await cleanup.close()


def test_a_full_process_in_open_mode_says_the_process_is_full(make_settings):
    """In open mode every client is one tenant whose bound is the process's: a refusal there is the process's
    503, not a 429 telling "this key" it holds too many (an audit's reading of it)."""
    from meshserve.service.api.wait_slots import WaitSlots

    slots = WaitSlots(make_settings(auth="none", max_waiting=2))
    assert slots.take("anonymous") and slots.take("anonymous") and not slots.take("anonymous")
    error = slots.refused("anonymous", "too_many_streams")
    assert error.status == 503 and "this API process" in error.message
    keyed = WaitSlots(make_settings(auth="keys", max_waiting=3, max_waiting_per_key=1))
    assert keyed.take("alice") and not keyed.take("alice")
    assert keyed.refused("alice", "too_many_streams").status == 429
