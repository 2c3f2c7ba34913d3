"""API keys and tenant isolation (issue 11; OWASP API1 broken object-level authorisation) over HTTP (ASGI) with
`MESHSERVE_AUTH=keys`, a fake worker and the real Redis: 401s, cross-tenant 404s on every job route, admin reads,
per-tenant idempotency, revocation seen by another replica at once, keys never stored, logged or exported in
clear, the `meshserve keys` command, and `meshserve api` requiring keys unless told otherwise."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
import redis

from meshserve.service.app import create_app
from meshserve.service.auth import KeyStore, key_digest, new_key
from meshserve.service.store import Store
from tests.private_redis import free_port
from tests.service.conftest import REDIS_URL, FakeWorker, api_client

pytestmark = pytest.mark.anyio
ROOT = Path(__file__).resolve().parents[2]
JOB_ROUTES = ("GET {}", "POST {}/cancel", "GET {}/events", "GET {}/outputs/0")


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def call(client: httpx.AsyncClient, route: str, job_id: str, key: str | None) -> httpx.Response:
    method, path = route.split(" ")
    headers = bearer(key) if key else {}
    return await client.request(method, "/v1/jobs/" + path.format(job_id), headers=headers)


@pytest.fixture
async def keyed(make_settings):
    """(client, store, worker, keys): the API with MESHSERVE_AUTH=keys, a ready fake worker (not started), and
    keys `alice`, `bob` (tenants of those names) and `root` (admin), without limits."""
    async with api_client(make_settings(auth="keys")) as (client, store):
        worker = FakeWorker(store)
        await worker.register()
        ks = KeyStore(store.redis, store.prefix)
        keys = {
            "alice": await ks.create("alice", rate_per_minute=0, max_active=0),
            "bob": await ks.create("bob", rate_per_minute=0, max_active=0),
            "root": await ks.create("root", rate_per_minute=0, max_active=0, admin=True),
        }
        yield client, store, worker, keys
        await worker.stop()


def assert_401(r: httpx.Response, code: str) -> None:
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"].startswith("Bearer")
    assert set(r.json()) == {"error"} and r.json()["error"]["code"] == code
    assert r.json()["error"]["field"] == "Authorization"


async def test_every_route_but_the_probes_needs_a_key(keyed):
    client, _, _, keys = keyed
    some_id = uuid.uuid4().hex
    requests = [
        ("POST", "/v1/generate", {"prompt": "x"}),
        ("POST", "/v1/images/generations", {"prompt": "x"}),
        ("GET", "/v1/models", None),
        *((r.split(" ")[0], "/v1/jobs/" + r.split(" ")[1].format(some_id), None) for r in JOB_ROUTES),
        ("GET", "/v1/no-such-route", None),  # no route discovery without a key
    ]
    malformed = {"Authorization": "Basic " + keys["alice"]}, bearer("msk_short"), bearer("not-a-key")
    unknown = bearer("msk_" + "A" * 43)
    for method, path, body in requests:
        assert_401(await client.request(method, path, json=body), "missing_api_key")
        for headers in malformed[1:]:
            assert_401(await client.request(method, path, json=body, headers=headers), "invalid_api_key")
        assert_401(await client.request(method, path, json=body, headers=malformed[0]), "missing_api_key")
        assert_401(await client.request(method, path, json=body, headers=unknown), "invalid_api_key")
    # With a key the same routes answer (the job is unknown, the route is unknown: 404s, not 401s).
    assert (await client.get("/v1/models", headers=bearer(keys["alice"]))).status_code == 200
    r = await client.get(f"/v1/jobs/{some_id}", headers=bearer(keys["alice"]))
    assert r.status_code == 404 and r.json()["error"]["code"] == "job_not_found"
    assert (await client.get("/v1/no-such-route", headers=bearer(keys["alice"]))).status_code == 404
    # Probes and metrics stay open.
    for path in ("/livez", "/readyz", "/metrics"):
        assert (await client.get(path)).status_code == 200, path


async def test_two_authorization_headers_are_refused(keyed):
    """Found by an audit: the last of two headers counted, while a gateway in front may check the first."""
    client, _, _, keys = keyed
    good, bad = "Bearer " + keys["alice"], "Bearer msk_" + "A" * 43
    for pair in ((bad, good), (good, bad), (good, good)):
        r = await client.get("/v1/models", headers=[("Authorization", pair[0]), ("Authorization", pair[1])])
        assert_401(r, "invalid_api_key")
    assert (await client.get("/v1/models", headers=bearer(keys["alice"]))).status_code == 200


async def test_an_unauthenticated_body_is_not_parsed(keyed):
    """The key is checked before the body: a malformed body without a key is a 401, not a 422."""
    client, *_ = keyed
    r = await client.post("/v1/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert_401(r, "missing_api_key")


async def test_other_tenants_jobs_answer_404_exactly_like_unknown_ids(keyed):
    client, store, worker, keys = keyed
    worker.start()
    r = await client.post("/v1/generate", json={"prompt": "alice's"}, headers=bearer(keys["alice"]))
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    for _ in range(500):
        if (await client.get(f"/v1/jobs/{job_id}", headers=bearer(keys["alice"]))).json()[
            "status"
        ] == "succeeded":
            break
        await asyncio.sleep(0.01)
    unknown = uuid.uuid4().hex
    for route in JOB_ROUTES:
        mine = await call(client, route, job_id, keys["alice"])
        assert mine.status_code == 200, (route, mine.text)
        theirs = await call(client, route, job_id, keys["bob"])
        nobody = await call(client, route, unknown, keys["bob"])
        assert theirs.status_code == nobody.status_code == 404, route
        assert theirs.json() == {
            "error": {
                **nobody.json()["error"],
                "message": nobody.json()["error"]["message"].replace(unknown, job_id),
            }
        }, route
        assert dict(theirs.headers).keys() == dict(nobody.headers).keys(), route
    # Bob's cancel changed nothing; alice's job is still hers and succeeded.
    assert (await store.get(job_id, "alice")).status.value == "succeeded"


async def test_an_admin_key_reads_every_job(keyed):
    client, _, worker, keys = keyed
    worker.start()
    r = await client.post("/v1/generate", json={"prompt": "bob's"}, headers=bearer(keys["bob"]))
    job_id = r.json()["id"]
    for _ in range(500):
        if (await client.get(f"/v1/jobs/{job_id}", headers=bearer(keys["root"]))).json()[
            "status"
        ] == "succeeded":
            break
        await asyncio.sleep(0.01)
    for route in JOB_ROUTES:
        assert (await call(client, route, job_id, keys["root"])).status_code == 200, route
    assert (await call(client, "GET {}", job_id, keys["alice"])).status_code == 404


async def test_idempotency_keys_are_per_tenant(keyed):
    client, _, _, keys = keyed
    body, idem = {"prompt": "same", "seed": 1}, {"Idempotency-Key": "order-1"}
    a1 = await client.post("/v1/generate", json=body, headers={**bearer(keys["alice"]), **idem})
    a2 = await client.post("/v1/generate", json=body, headers={**bearer(keys["alice"]), **idem})
    b1 = await client.post("/v1/generate", json=body, headers={**bearer(keys["bob"]), **idem})
    assert a1.status_code == a2.status_code == b1.status_code == 202
    assert a1.json()["id"] == a2.json()["id"] != b1.json()["id"]
    # Bob's same key with another body is his own conflict, and never reveals alice's job.
    b2 = await client.post("/v1/generate", json={**body, "seed": 2}, headers={**bearer(keys["bob"]), **idem})
    assert b2.status_code == 422 and a1.json()["id"] not in b2.text


async def test_a_revoked_key_is_refused_by_every_replica_at_once(make_settings):
    settings = make_settings(auth="keys")
    async with api_client(settings) as (first, store):
        replica = create_app(settings, Store(settings))
        async with replica.router.lifespan_context(replica):
            transport = httpx.ASGITransport(app=replica)
            async with httpx.AsyncClient(transport=transport, base_url="http://replica") as second:
                ks = KeyStore(store.redis, store.prefix)
                key = await ks.create("carol", rate_per_minute=0, max_active=0)
                for client in (first, second):
                    assert (await client.get("/v1/models", headers=bearer(key))).status_code == 200
                assert await ks.revoke("carol")
                started = time.monotonic()
                for client in (first, second):
                    assert_401(await client.get("/v1/models", headers=bearer(key)), "invalid_api_key")
                assert time.monotonic() - started < 1.0
            await replica.state.store.close()


async def test_keys_are_never_in_redis_logs_or_metrics_in_clear(keyed, caplog):
    client, store, worker, keys = keyed
    caplog.set_level(logging.DEBUG)
    worker.start()
    for key in (keys["alice"], keys["alice"][:-1] + "x"):  # a good key and a near miss
        r = await client.post("/v1/generate", json={"prompt": "x"}, headers=bearer(key))
        assert r.status_code in (202, 401)
        assert key not in r.text
    metrics_text = (await client.get("/metrics")).text
    # Every key and value under the prefix, the raw bytes of each.
    raw = redis.Redis.from_url(REDIS_URL)
    blobs = []
    for k in raw.scan_iter(f"{store.prefix}:*", count=1000):
        blobs.append(k)
        kind = raw.type(k)
        if kind == b"hash":
            blobs += [x for kv in raw.hgetall(k).items() for x in kv]
        elif kind == b"string":
            blobs.append(raw.get(k))
        elif kind == b"set":
            blobs += list(raw.smembers(k))
        elif kind == b"stream":
            blobs += [x for _, f in raw.xrange(k) for kv in f.items() for x in kv]
    raw.close()
    stored = b"\n".join(blobs)
    for name, key in keys.items():
        assert key.encode() not in stored, name
        assert key_digest(key).encode() in stored, name  # what is stored: the digest
        assert key not in caplog.text and key not in metrics_text, name
        assert name not in metrics_text  # no tenant names either
    assert 'meshserve_auth_refused_total{reason="invalid_api_key"}' in metrics_text


def run_cli(*args: str, prefix: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MESHSERVE_REDIS_URL": REDIS_URL, "MESHSERVE_KEY_PREFIX": prefix}
    return subprocess.run(
        [sys.executable, "-m", "meshserve.cli", "keys", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
    )


async def test_the_keys_command_creates_lists_and_revokes(make_settings):
    settings = make_settings(auth="keys")
    created = run_cli(
        "create", "dave", "--rate-per-minute", "7", "--max-active", "3", prefix=settings.key_prefix
    )
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip().splitlines()[-1]
    assert key.startswith("msk_") and len(key) == 47 and key not in created.stdout.splitlines()[0]
    again = run_cli("create", "dave", prefix=settings.key_prefix)
    assert again.returncode == 2 and "exists" in again.stderr
    async with api_client(settings) as (client, _):
        r = await client.get("/v1/models", headers=bearer(key))
        assert r.status_code == 200 and r.headers["ratelimit-policy"] == '"per-minute";q=7;w=60'
        listed = run_cli("list", prefix=settings.key_prefix)
        assert listed.returncode == 0 and key not in listed.stdout
        (row,) = [line.split() for line in listed.stdout.splitlines() if line.startswith("dave")]
        assert row[:5] == ["dave", "dave", "no", "7", "3"] and row[-1] != "never"  # last used: just now
        revoked = run_cli("revoke", "dave", prefix=settings.key_prefix)
        assert revoked.returncode == 0, revoked.stderr
        assert_401(await client.get("/v1/models", headers=bearer(key)), "invalid_api_key")
        assert run_cli("revoke", "dave", prefix=settings.key_prefix).returncode == 2


def test_meshserve_api_requires_keys_unless_auth_none_is_set(make_settings, tmp_path):
    """`meshserve api` (0.0.0.0) turns keys on by itself and says so; MESHSERVE_AUTH=none turns them off."""
    settings = make_settings()
    for auth, expected in ((None, 401), ("none", 200)):
        port = free_port()
        env = {**os.environ, "MESHSERVE_REDIS_URL": REDIS_URL, "MESHSERVE_KEY_PREFIX": settings.key_prefix}
        env.pop("MESHSERVE_AUTH", None)
        if auth:
            env["MESHSERVE_AUTH"] = auth
        log = tmp_path / f"api-{auth}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "meshserve.cli", "api", "--host", "127.0.0.1", "--port", str(port)],
                env=env,
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    status = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code
                    break
                except httpx.TransportError:
                    assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                    time.sleep(0.1)
            assert status == expected, log.read_text()
            assert ("API keys required" if auth is None else "authentication: NONE") in log.read_text()
        finally:
            proc.terminate()
            proc.wait(timeout=10)


async def test_an_admin_key_from_the_environment_is_installed_and_rotated(make_settings):
    """MESHSERVE_ADMIN_KEY (a Secret's value) becomes key `admin` at start-up; a new value replaces the old one."""
    first, second = new_key(), new_key()
    settings = make_settings(auth="keys", admin_key=first)
    async with api_client(settings) as (client, store):
        assert (await client.get("/v1/models", headers=bearer(first))).status_code == 200
        job = await store.submit(params_for_some_tenant(), owner="someone")
        assert (await client.get(f"/v1/jobs/{job.id}", headers=bearer(first))).status_code == 200  # admin
        rotated = make_settings(auth="keys", admin_key=second)
        app = create_app(rotated, Store(rotated))
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://next") as after:
                assert (await after.get("/v1/models", headers=bearer(second))).status_code == 200
                assert_401(await after.get("/v1/models", headers=bearer(first)), "invalid_api_key")
        await app.state.store.close()
        assert [r["name"] for r in await KeyStore(store.redis, store.prefix).list()] == ["admin"]


def params_for_some_tenant():
    from meshserve.service.contract import JobParams

    return JobParams(
        model="toy", prompt="x", width=64, height=48, num_inference_steps=1, guidance_scale=1.0, seed=1, n=1
    )


async def test_an_open_stream_ends_when_its_key_is_revoked(make_settings, monkeypatch):
    """Found by an audit: a stream opened before `keys revoke` streamed on to the job's end."""
    monkeypatch.setattr("meshserve.service.api.routes.jobs.KEY_RECHECK_S", 0.0)
    async with api_client(make_settings(auth="keys", sse_keepalive_s=0.1)) as (client, store):
        await FakeWorker(store).register()  # never runs the job: the stream would stay open
        ks = KeyStore(store.redis, store.prefix)
        key = bearer(await ks.create("leaver", rate_per_minute=0, max_active=0))
        job_id = (await client.post("/v1/generate", json={"prompt": "x"}, headers=key)).json()["id"]
        stream = asyncio.create_task(client.get(f"/v1/jobs/{job_id}/events", headers=key))
        await asyncio.sleep(0.3)
        assert not stream.done()
        assert await ks.revoke("leaver")
        r = await asyncio.wait_for(stream, 5)
        assert "event: queued" in r.text and "the API key was revoked" in r.text
