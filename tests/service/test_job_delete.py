"""`DELETE /v1/jobs/{id}`: an ended job goes with its outputs (Redis or the output location), its stored image
inputs, its events, its index entry and a webhook not yet delivered; a queued or running job is a 409; another
tenant's job is a 404 exactly like an unknown id."""

from __future__ import annotations

import asyncio

import pytest

from meshserve.service.auth import KeyStore
from meshserve.service.input_store import InputStore
from tests.service.conftest import FakeWorker, api_client
from tests.service.test_image_inputs import PNG, TOY_IMG, data_url
from tests.service.test_store_outputs import wait_succeeded

pytestmark = pytest.mark.anyio


async def keys_of(store, job_id: str) -> list[str]:
    return [k async for k in store.redis.scan_iter(f"{store.prefix}:*{job_id}*")]


@pytest.mark.parametrize("where", ["redis", "local"])
async def test_an_ended_job_goes_with_its_outputs_inputs_and_events(make_settings, tmp_path, where):
    output_dir = None if where == "redis" else str(tmp_path / "outputs")
    async with api_client(make_settings(output_dir=output_dir)) as (client, store):
        worker = FakeWorker(store, models=(TOY_IMG,))
        await worker.register()
        worker.start()
        try:
            body = {"model": "toy-img", "prompt": "p", "image": data_url(PNG), "strength": 0.5, "n": 2}
            r = await client.post("/v1/generate", json=body)
            assert r.status_code == 202, r.text
            done = await wait_succeeded(client, r.json()["id"])
            job_id, ref = done["id"], done["params"]["image"]
            assert done["status"] == "succeeded" and await InputStore.of(store).get(ref) is not None
            assert (await client.get(f"/v1/jobs/{job_id}/outputs/1")).status_code == 200
            assert await keys_of(store, job_id)

            r = await client.delete(f"/v1/jobs/{job_id}")
            assert (r.status_code, r.content) == (204, b"")
            for path in ("", "/outputs/0", "/events"):
                r = await client.get(f"/v1/jobs/{job_id}{path}")
                assert r.status_code == 404 and r.json()["error"]["code"] == "job_not_found", (path, r.text)
            assert await keys_of(store, job_id) == []
            assert await InputStore.of(store).get(ref) is None
            assert (await client.get("/v1/jobs")).json()["data"] == []
            if where == "local":
                assert not [p for p in (tmp_path / "outputs").rglob("*") if p.is_file()]
            else:
                assert not await store.redis.exists(store.output_key(job_id, 0), store.output_key(job_id, 1))
            assert (await client.delete(f"/v1/jobs/{job_id}")).status_code == 404
        finally:
            await worker.stop()


async def test_two_deletes_at_once_both_succeed(make_settings, tmp_path):
    """Found by an audit: with outputs in a local output_dir, two concurrent deletes of one job answered 503
    (one deleted the files the other had listed), sometimes both, leaving the job without its outputs."""
    async with api_client(make_settings(output_dir=str(tmp_path / "outputs"))) as (client, store):
        worker = FakeWorker(store)
        await worker.register()
        worker.start()
        try:
            for _ in range(5):
                job_id = (await client.post("/v1/generate", json={"prompt": "p", "n": 3})).json()["id"]
                await wait_succeeded(client, job_id)
                answers = await asyncio.gather(*(client.delete(f"/v1/jobs/{job_id}") for _ in range(2)))
                assert sorted(r.status_code for r in answers) in ([204, 204], [204, 404]), [
                    r.text for r in answers
                ]
                assert await keys_of(store, job_id) == []
            assert not [p for p in (tmp_path / "outputs").rglob("*") if p.is_file()]
        finally:
            await worker.stop()


async def test_a_queued_job_is_a_409_until_it_ended(api):
    client, store, _ = api  # the worker is not started: the job stays queued
    job_id = (await client.post("/v1/generate", json={"prompt": "p"})).json()["id"]
    r = await client.delete(f"/v1/jobs/{job_id}")
    assert r.status_code == 409 and r.json()["error"]["code"] == "job_not_ended", r.text
    assert (await client.get(f"/v1/jobs/{job_id}")).json()["status"] == "queued"
    assert (await client.post(f"/v1/jobs/{job_id}/cancel")).json()["status"] == "canceled"
    assert (await client.delete(f"/v1/jobs/{job_id}")).status_code == 204
    assert await keys_of(store, job_id) == []


async def test_a_webhook_not_yet_delivered_is_dropped(api):
    client, store, worker = api
    worker.start()
    job_id = (await client.post("/v1/generate", json={"prompt": "p"})).json()["id"]
    await wait_succeeded(client, job_id)
    # As the end script leaves a job whose webhook is due (service/webhooks/queue.py reads these).
    await store.redis.hset(store.job_key(job_id), mapping={"webhook": "{}", "wh_status": "pending"})
    await store.redis.zadd(f"{store.prefix}:webhooks:due", {job_id: 0})
    assert (await client.delete(f"/v1/jobs/{job_id}")).status_code == 204
    assert await store.redis.zscore(f"{store.prefix}:webhooks:due", job_id) is None
    assert await keys_of(store, job_id) == []


async def test_only_the_owner_or_an_admin_deletes(make_settings):
    async with api_client(make_settings(auth="keys")) as (client, store):
        worker = FakeWorker(store)
        await worker.register()
        worker.start()
        ks = KeyStore(store.redis, store.prefix)
        keys = {
            name: await ks.create(name, rate_per_minute=0, max_active=0, admin=name == "root")
            for name in ("alice", "bob", "root")
        }

        def as_(name: str) -> dict[str, str]:
            return {"Authorization": f"Bearer {keys[name]}"}

        try:
            ids = []
            for _ in range(2):
                r = await client.post("/v1/generate", json={"prompt": "p"}, headers=as_("alice"))
                ids.append(r.json()["id"])
            for job_id in ids:
                for _ in range(500):
                    r = await client.get(f"/v1/jobs/{job_id}", headers=as_("alice"))
                    if r.json()["status"] == "succeeded":
                        break
                    await asyncio.sleep(0.01)
            theirs = await client.delete(f"/v1/jobs/{ids[0]}", headers=as_("bob"))
            unknown = await client.delete(f"/v1/jobs/{'0' * 32}", headers=as_("bob"))
            assert theirs.status_code == unknown.status_code == 404
            assert theirs.json()["error"]["code"] == unknown.json()["error"]["code"] == "job_not_found"
            assert (await client.get(f"/v1/jobs/{ids[0]}", headers=as_("alice"))).status_code == 200
            assert (await client.delete(f"/v1/jobs/{ids[0]}")).status_code == 401
            assert (await client.delete(f"/v1/jobs/{ids[0]}", headers=as_("alice"))).status_code == 204
            assert (await client.delete(f"/v1/jobs/{ids[1]}", headers=as_("root"))).status_code == 204
            assert await keys_of(store, ids[1]) == []
        finally:
            await worker.stop()
