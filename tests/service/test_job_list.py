"""`GET /v1/jobs`: a tenant's own jobs, newest first, paged by cursor, filtered by status and model; other tenants'
jobs never listed (admin keys may ask for them); expired jobs dropped from the index; bad parameters are 422s."""

from __future__ import annotations

import asyncio

import pytest

from meshserve.service.auth import KeyStore
from meshserve.service.contract import JobParams
from meshserve.service.job_reads import LIST_SCAN_MAX
from meshserve.service.store import Store
from tests.service.conftest import TOY, TOY_FLUX, FakeWorker, api_client, drop_keys

pytestmark = pytest.mark.anyio


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def toy_params(model: str = "toy") -> JobParams:
    return JobParams(
        model=model, prompt="x", width=64, height=48, num_inference_steps=1, guidance_scale=5, seed=0
    )


async def submit(client, n: int, headers=None, **body) -> list[str]:
    ids = []
    for i in range(n):
        r = await client.post(
            "/v1/generate", json={"prompt": f"p{i}", "model": "toy", **body}, headers=headers or {}
        )
        assert r.status_code == 202, r.text
        ids.append(r.json()["id"])
    return ids


async def pages(client, query: str = "", headers=None) -> tuple[list[str], int]:
    """Every id the listing gives, following next_cursor; and how many pages it took."""
    ids, cursor, count = [], None, 0
    while True:
        sep = "&" if query else ""
        url = f"/v1/jobs?{query}" + (f"{sep}cursor={cursor}" if cursor else "")
        r = await client.get(url, headers=headers or {})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list" and body["has_more"] == (body["next_cursor"] is not None)
        ids += [j["id"] for j in body["data"]]
        count += 1
        if not body["has_more"]:
            return ids, count
        cursor = body["next_cursor"]


async def test_jobs_are_listed_newest_first_in_pages(toy_and_flux):
    client, _ = toy_and_flux
    ids = await submit(client, 7)
    listed, count = await pages(client, "limit=3")
    assert listed == ids[::-1] and count == 3
    r = await client.get("/v1/jobs")
    assert [j["id"] for j in r.json()["data"]] == ids[::-1]
    job = r.json()["data"][0]
    assert job["object"] == "job" and job["status"] == "queued" and job["params"]["prompt"] == "p6"
    # Exactly a page's worth: the last page says so (no empty page after it).
    assert (await pages(client, "limit=7"))[1] == 1


async def test_jobs_of_one_instant_are_each_listed_once(store):
    """Index entries that share a created_at (one clock tick) sort by id: a cursor between them skips none and
    repeats none."""
    params = toy_params()
    ids = [(await store.submit(params)).id for _ in range(5)]
    key = store.tenant_jobs_key(store.settings.default_owner)
    await store.redis.zadd(key, {job_id: 1_700_000_000.5 for job_id in ids})
    seen, cursor = [], None
    while True:
        page = await store.list_jobs(store.settings.default_owner, limit=2, cursor=cursor)
        seen += [j.id for j in page.jobs]
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    assert seen == sorted(ids, reverse=True)


async def test_filters_by_status_and_model(toy_and_flux):
    client, store = toy_and_flux
    toy = await submit(client, 3)
    flux = await submit(client, 2, model="toy-flux")
    canceled = toy[1]
    assert (await client.post(f"/v1/jobs/{canceled}/cancel")).json()["status"] == "canceled"
    assert (await pages(client, "model=toy-flux"))[0] == flux[::-1]
    assert (await pages(client, "status=canceled"))[0] == [canceled]
    both = await pages(client, "status=canceled&status=queued&model=toy")
    assert both[0] == toy[::-1]
    assert (await pages(client, "status=succeeded"))[0] == []
    assert (await pages(client, "model=no-such-model"))[0] == []


@pytest.mark.parametrize("newer", [LIST_SCAN_MAX + 5, LIST_SCAN_MAX - 1])
async def test_a_narrow_filter_pages_through_a_long_index(make_settings, newer):
    """A page reads at most LIST_SCAN_MAX index entries: past them it ends early with a cursor, and following
    the cursors finds the one match. An index of exactly LIST_SCAN_MAX entries is read in one page that says
    it is the last (an audit's page 2 was empty)."""
    store = Store(make_settings(queue_max_length=10 * LIST_SCAN_MAX))
    try:
        owner = store.settings.default_owner
        first = await store.submit(toy_params(model="toy-flux"))
        for _ in range(newer):
            await store.submit(toy_params())
        read, original = [], store.redis.zrevrangebyscore

        async def counted(*args, **kwargs):
            rows = await original(*args, **kwargs)
            read.append(len(rows))
            return rows

        store.redis.zrevrangebyscore = counted
        page = await store.list_jobs(owner, limit=5, model="toy-flux")
        # (+ per read: the cursor's own entry, and one row to see whether the index goes on)
        assert sum(read) <= LIST_SCAN_MAX + 2 * len(read), read
        if newer >= LIST_SCAN_MAX:
            assert page.jobs == [] and page.next_cursor is not None
            page = await store.list_jobs(owner, limit=5, model="toy-flux", cursor=page.next_cursor)
        assert [j.id for j in page.jobs] == [first.id] and page.next_cursor is None
    finally:
        await drop_keys(store)
        await store.close()


async def test_expired_jobs_leave_the_index(toy_and_flux):
    client, store = toy_and_flux
    ids = await submit(client, 4)
    gone = ids[1:3]
    await store.redis.delete(*(store.job_key(j) for j in gone))  # what their TTL does
    assert (await pages(client, "limit=1"))[0] == [ids[3], ids[0]]
    key = store.tenant_jobs_key(store.settings.default_owner)
    assert set(await store.redis.zrange(key, 0, -1)) == {ids[0], ids[3]}
    # A submit drops expired ids from the index's oldest end too, and keeps the index's ttl.
    await store.redis.delete(store.job_key(ids[0]))
    await submit(client, 1)
    assert ids[0] not in await store.redis.zrange(key, 0, -1)
    assert await store.redis.ttl(key) > store.settings.job_ttl_s


async def test_a_long_lived_job_does_not_keep_expired_ids_in_the_index(store):
    """Submits drop expired ids drawn at random from the index: two old jobs that stay queued do not shield
    the expired ones behind them (an audit: 1,002 entries for 2 live jobs when the oldest two were checked)."""
    for _ in range(2):
        await store.submit(toy_params())
    for _ in range(300):
        job = await store.submit(toy_params())
        await store.redis.delete(store.job_key(job.id))  # what its TTL does
    # Each submit adds one id and drops each of two drawn ones that expired: a few expired ids stay, not 300.
    assert await store.redis.zcard(store.tenant_jobs_key(store.settings.default_owner)) < 20


async def test_a_succeeded_job_is_listed_with_its_outputs(api):
    client, _, worker = api
    worker.start()
    (job_id,) = await submit(client, 1)
    for _ in range(500):
        listed = (await client.get("/v1/jobs?status=succeeded")).json()["data"]
        if listed:
            break
        await asyncio.sleep(0.01)
    assert [j["id"] for j in listed] == [job_id]
    assert listed[0]["outputs"][0]["url"] == f"/v1/jobs/{job_id}/outputs/0"
    assert listed[0] == {**(await client.get(f"/v1/jobs/{job_id}")).json(), "queue_position": None}


async def test_bad_parameters_are_422s_naming_the_field(toy_and_flux):
    client, _ = toy_and_flux
    for query, field in (
        ("limit=0", "limit"),
        ("limit=101", "limit"),
        ("limit=x", "limit"),
        ("status=done", "status"),
        ("cursor=abc", "cursor"),
        ("cursor=nan_" + "0" * 32, "cursor"),
        ("cursor=1.5_../../x", "cursor"),
        ("cursor=1e5_" + "0" * 32, "cursor"),  # (only the form a listing writes)
        ("cursor=١٢_" + "0" * 32, "cursor"),
        ("tenant=", "tenant"),
        ("stauts=queued", "stauts"),  # a misspelt filter is not silently dropped
        ("=true", ""),
        ("cursor=" + "9" * 101, "cursor"),
        ("model=" + "m" * 201, "model"),
    ):
        r = await client.get(f"/v1/jobs?{query}")
        assert r.status_code == 422, (query, r.text)
        assert r.json()["error"]["field"].split(".")[0] == field, (query, r.json())  # (status.0: the first)


async def test_tenants_see_only_their_own_jobs(make_settings):
    async with api_client(make_settings(auth="keys")) as (client, store):
        await FakeWorker(store, models=(TOY, TOY_FLUX)).register()
        ks = KeyStore(store.redis, store.prefix)
        keys = {
            name: await ks.create(name, rate_per_minute=0, max_active=0, admin=name == "root")
            for name in ("alice", "bob", "root")
        }
        alice = await submit(client, 3, headers=bearer(keys["alice"]))
        bob = await submit(client, 2, headers=bearer(keys["bob"]))
        assert (await pages(client, "limit=2", bearer(keys["alice"])))[0] == alice[::-1]
        assert (await pages(client, "", bearer(keys["bob"])))[0] == bob[::-1]
        assert (await pages(client, "", bearer(keys["root"])))[0] == []
        # A cursor from alice's listing reads bob's index in bob's hands: still only bob's jobs.
        r = await client.get("/v1/jobs?limit=1", headers=bearer(keys["alice"]))
        cursor = r.json()["next_cursor"]
        r = await client.get(f"/v1/jobs?cursor={cursor}", headers=bearer(keys["bob"]))
        assert {j["id"] for j in r.json()["data"]} <= set(bob)
        # `tenant`: an admin's; another key gets a 403, its own name is its own listing.
        r = await client.get("/v1/jobs?tenant=alice", headers=bearer(keys["bob"]))
        assert r.status_code == 403 and r.json()["error"]["field"] == "tenant"
        assert (await pages(client, "tenant=bob", bearer(keys["bob"])))[0] == bob[::-1]
        assert (await pages(client, "tenant=alice", bearer(keys["root"])))[0] == alice[::-1]
        assert (await client.get("/v1/jobs")).status_code == 401
