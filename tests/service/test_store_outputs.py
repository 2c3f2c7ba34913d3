"""Outputs in object storage through the Store and the API (service/store.py + service/output_store.py), on the
real Redis: obstore's in-memory and local backends, and S3 through a local S3 server (moto's, on 127.0.0.1: no
request leaves the machine) for signed URLs. Layout `<job id>/<token>-<attempt>/<i>.<ext>`; a stale attempt's
objects never become the job's; deletion removes every object of a job."""

from __future__ import annotations

import asyncio
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from meshserve.service.contract import JobParams, JobStatus, OutputBlob
from meshserve.service.output_store import OutputStore, OutputStoreError
from meshserve.service.settings import Settings
from meshserve.service.store import Store
from tests.service.conftest import FakeWorker, api_client, drop_keys, png_bytes

pytestmark = pytest.mark.anyio


def params(**kw) -> JobParams:
    base = dict(
        model="toy",
        prompt="a red square",
        width=64,
        height=48,
        num_inference_steps=2,
        guidance_scale=5.0,
        seed=7,
    )
    return JobParams(**{**base, **kw})


def blob(i: int, data: bytes | None = None, content_type: str = "image/png") -> OutputBlob:
    return OutputBlob(
        index=i, data=data or b"img%d" % i, content_type=content_type, width=64, height=48, seed=7 + i
    )


async def wait_succeeded(client: httpx.AsyncClient, job_id: str, timeout: float = 10.0) -> dict:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        body = (await client.get(f"/v1/jobs/{job_id}")).json()
        if body["status"] in ("succeeded", "failed", "canceled"):
            return body
        assert asyncio.get_running_loop().time() < deadline, body
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("where", ["memory", "local"])
async def test_outputs_round_trip_through_the_api(make_settings, tmp_path, where):
    output_dir = "memory://" if where == "memory" else str(tmp_path / "outputs")
    async with api_client(make_settings(output_dir=output_dir)) as (client, store):
        worker = FakeWorker(store)
        await worker.register()
        worker.start()
        try:
            r = await client.post("/v1/generate", json={"model": "toy", "prompt": "a red square", "n": 2})
            assert r.status_code == 202, r.text
            done = await wait_succeeded(client, r.json()["id"])
            assert done["status"] == "succeeded", done
            job_id, seed = done["id"], done["params"]["seed"]
            for i, out in enumerate(done["outputs"]):
                # No url_base, no signing: the API serves it.
                assert out["url"] == f"/v1/jobs/{job_id}/outputs/{i}"
                got = await client.get(out["url"])
                assert got.status_code == 200 and got.headers["content-type"] == "image/png"
                assert got.content == png_bytes(64, 48, seed + i)  # the bytes the worker stored
            assert not await store.redis.exists(store.output_key(job_id, 0))  # in the object store, not Redis
            token, out_key = await store.redis.hmget(store.job_key(job_id), ["out_token", "out_key"])
            assert out_key == f"{token}-1"
            if where == "local":
                files = sorted(
                    p.relative_to(tmp_path / "outputs") for p in (tmp_path / "outputs").rglob("*.*")
                )
                assert [str(p) for p in files] == [f"{job_id}/{token}-1/0.png", f"{job_id}/{token}-1/1.png"]
            r = await client.get(f"/v1/jobs/{job_id}/outputs/2")
            assert r.status_code == 404 and r.json()["error"]["code"] == "output_not_found"
            # Deleted objects (e.g. by a bucket lifecycle rule): the job remains, its outputs are gone (410).
            assert await store.delete_outputs(job_id) == 2
            r = await client.get(f"/v1/jobs/{job_id}/outputs/0")
            assert r.status_code == 410 and r.json()["error"]["code"] == "output_expired"
        finally:
            await worker.stop()


async def test_url_base_names_the_token_and_attempt(make_settings):
    store = Store(make_settings(output_dir="memory://", output_url_base="https://cdn.example/outputs/"))
    try:
        job = await store.submit(params(n=2, output_format="webp"))
        (d,) = await store.claim(["toy"], "c1")
        assert await store.start(d)
        assert await store.complete(
            d, [blob(0, content_type="image/webp"), blob(1, content_type="image/webp")]
        )
        token = await store.redis.hget(store.job_key(job.id), "out_token")
        done = await store.get(job.id)
        assert [o.url for o in done.outputs] == [
            f"https://cdn.example/outputs/{job.id}/{token}-1/{i}.webp" for i in (0, 1)
        ]
        # The URL's path is the object's path under the location: what a bucket serving it answers with.
        assert await store.outputs.get(job.id, 1, "webp", key=f"{token}-1") == b"img1"
        assert await store.output(job.id, 1) == b"img1"
    finally:
        await drop_keys(store)
        await store.close()


async def test_a_stale_attempts_objects_never_become_the_jobs(make_settings):
    """Each attempt writes under its own key: the attempt that lost its lease cannot replace the committed bytes,
    even when it writes after the new attempt committed."""
    store = Store(make_settings(output_dir="memory://", lease_s=0.3))
    try:
        job = await store.submit(params())
        (old,) = await store.claim(["toy"], "c1")
        assert await store.start(old)
        await asyncio.sleep(0.4)  # the lease lapses: c2 takes the job over
        (new,) = await store.claim(["toy"], "c2")
        assert await store.start(new) and await store.complete(new, [blob(0, b"new")])
        assert not await store.complete(old, [blob(0, b"stale")])  # fenced
        assert await store.output(job.id, 0) == b"new"
        token = await store.redis.hget(store.job_key(job.id), "out_token")
        assert await store.redis.hget(store.job_key(job.id), "out_key") == f"{token}-2"
        # The refused attempt deleted what it wrote under its own key; the committed objects stay.
        assert await store.outputs.get(job.id, 0, "png", key=f"{token}-1") is None
        assert await store.delete_outputs(job.id) == 1
    finally:
        await drop_keys(store)
        await store.close()


async def test_a_lapsed_workers_objects_do_not_outlive_a_deleted_job(make_settings, tmp_path):
    """A worker whose lease lapsed is writing its outputs when the job is canceled, ended by the next claim and
    deleted: its objects land after the job's delete_outputs ran, and its refused commit deletes them."""

    class LateOutputStore(OutputStore):
        """Runs `meanwhile` (once) between the worker's read of the job's token and its first write."""

        meanwhile = None

        async def put(self, job_id, index, ext, data, *, key=None):
            if self.meanwhile is not None:
                meanwhile, self.meanwhile = self.meanwhile, None
                await meanwhile()
            return await super().put(job_id, index, ext, data, key=key)

    root = tmp_path / "outputs"
    outputs = LateOutputStore(str(root))
    store = Store(make_settings(output_dir=str(root), lease_s=0.3), outputs=outputs)
    try:
        job = await store.submit(params(n=2))
        (old,) = await store.claim(["toy"], "c1")
        assert await store.start(old)

        async def cancel_and_delete():
            await asyncio.sleep(0.4)  # c1 stalls past its lease; the client cancels; c2's claim ends the job
            await store.cancel(job.id)
            assert await store.claim(["toy"], "c2") == []
            assert (await store.get(job.id)).status == JobStatus.CANCELED
            assert await store.delete_ended(job.id) == "deleted"

        outputs.meanwhile = cancel_and_delete
        assert not await store.complete(old, [blob(0), blob(1)])  # c1's writes land, its commit is fenced
        assert outputs.meanwhile is None  # the deletion ran between them
        assert [p for p in root.rglob("*") if p.is_file()] == []
    finally:
        await drop_keys(store)
        await store.close()


async def test_a_repeated_commit_keeps_the_committed_objects(make_settings):
    """A commit whose reply was lost and that is sent again is refused (the job has ended), but the objects are
    the job's: they stay."""
    store = Store(make_settings(output_dir="memory://"))
    try:
        job = await store.submit(params())
        (d,) = await store.claim(["toy"], "c1")
        assert await store.start(d) and await store.complete(d, [blob(0)])
        assert not await store.complete(d, [blob(0)])
        assert (await store.get(job.id)).status == JobStatus.SUCCEEDED
        assert await store.output(job.id, 0) == b"img0"
    finally:
        await drop_keys(store)
        await store.close()


class RefusingOutputStore(OutputStore):
    """A memory store whose writes fail, as a bucket without write permission does."""

    async def put(self, job_id, index, ext, data, *, key=None):
        raise OutputStoreError(f"cannot write output {self.path(job_id, index, ext, key)}: permission denied")


async def test_a_failed_write_commits_nothing(make_settings):
    store = Store(make_settings(output_dir="memory://"), outputs=RefusingOutputStore("memory://"))
    try:
        job = await store.submit(params())
        (d,) = await store.claim(["toy"], "c1")
        assert await store.start(d)
        with pytest.raises(OutputStoreError, match="permission denied"):
            await store.complete(d, [blob(0)])
        # Still running under its lease: the worker retries, or the job is redelivered.
        running = await store.get(job.id)
        assert running.status == JobStatus.RUNNING and running.outputs == []
        assert await store.heartbeat(d)
    finally:
        await drop_keys(store)
        await store.close()


async def test_a_read_error_is_a_503_not_a_500(make_settings, tmp_path):
    class UnreadableOutputStore(OutputStore):
        async def get(self, job_id, index, ext, *, key=None):
            raise OutputStoreError(
                f"cannot read output {self.path(job_id, index, ext, key)}: connection reset"
            )

    settings = make_settings(output_dir="memory://")
    store = Store(settings, outputs=UnreadableOutputStore("memory://"))
    from meshserve.service.app import create_app

    app = create_app(settings, store)
    try:
        async with app.router.lifespan_context(app):
            worker = FakeWorker(store)
            await worker.register()
            worker.start()
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
                r = await client.post("/v1/generate", json={"model": "toy", "prompt": "x"})
                done = await wait_succeeded(client, r.json()["id"])
                r = await client.get(done["outputs"][0]["url"])
                assert r.status_code == 503 and r.json()["error"]["code"] == "output_store_unavailable"
                token = await store.redis.hget(store.job_key(done["id"]), "out_token")
                assert f"{done['id']}/<key>/0.png" in r.json()["error"]["message"]
                assert token not in r.text  # the path's secret segment is not echoed
                assert r.headers["retry-after"] == str(settings.retry_after_s)
            await worker.stop()
    finally:
        await drop_keys(store)
        await store.close()


async def test_when_signing_fails_the_job_lists_the_apis_route(make_settings):
    class SignedOutputStore(OutputStore):
        """Signed URLs on the memory backend (which cannot sign): fake signatures until `broken` (e.g. a
        revoked key), then the signer's error."""

        broken = False

        async def url(self, job_id, index, ext, *, key=None):
            path = self.path(job_id, index, ext, key)
            if self.broken:
                raise OutputStoreError(f"cannot sign a URL for {path}: expired token")
            return f"https://bucket.example/{path}?signature=x"

    outputs = SignedOutputStore("memory://")
    outputs.signed_url_ttl_s = 600
    store = Store(make_settings(output_dir="memory://"), outputs=outputs)
    try:
        job = await store.submit(params())
        (d,) = await store.claim(["toy"], "c1")
        assert await store.start(d) and await store.complete(d, [blob(0)])
        token = await store.redis.hget(store.job_key(job.id), "out_token")
        signed = f"https://bucket.example/{job.id}/{token}-1/0.png?signature=x"
        assert [o.url for o in (await store.get(job.id)).outputs] == [signed]
        outputs.broken = True  # reads list the API's route, which still serves the bytes
        assert [o.url for o in (await store.get(job.id)).outputs] == [f"/v1/jobs/{job.id}/outputs/0"]
        assert await store.output(job.id, 0) == b"img0"
    finally:
        await drop_keys(store)
        await store.close()


@pytest.fixture
def local_s3(monkeypatch):
    """A bucket on moto's S3 server at 127.0.0.1, with static fake credentials in the environment, which obstore
    reads as it reads real ones."""
    boto3 = pytest.importorskip("boto3")
    server_mod = pytest.importorskip("moto.server")
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    for name, value in {
        "AWS_ACCESS_KEY_ID": "AKIDEXAMPLE",
        "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY",
        "AWS_REGION": "us-east-1",
        "AWS_ENDPOINT": endpoint,
        "AWS_ALLOW_HTTP": "true",
    }.items():
        monkeypatch.setenv(name, value)
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="outputs")
    yield endpoint
    server.stop()


async def test_s3_outputs_with_signed_urls(make_settings, local_s3):
    settings = make_settings(output_dir="s3://outputs/meshserve", output_signed_url_ttl_s=600)
    async with api_client(settings) as (client, store):
        worker = FakeWorker(store)
        await worker.register()
        worker.start()
        try:
            r = await client.post("/v1/generate", json={"model": "toy", "prompt": "a red square"})
            done = await wait_succeeded(client, r.json()["id"])
            assert done["status"] == "succeeded", done
            job_id, seed = done["id"], done["params"]["seed"]
            token = await store.redis.hget(store.job_key(job_id), "out_token")
            url = done["outputs"][0]["url"]
            parts = urlsplit(url)
            assert f"{parts.scheme}://{parts.netloc}" == local_s3
            assert parts.path == f"/outputs/meshserve/{job_id}/{token}-1/0.png"
            query = parse_qs(parts.query)
            assert query["X-Amz-Expires"] == ["600"]
            assert query["X-Amz-Credential"][0].startswith("AKIDEXAMPLE/")
            assert query["X-Amz-Algorithm"] == ["AWS4-HMAC-SHA256"] and query["X-Amz-Signature"]
            # A client fetches the signed URL from the bucket itself, with no credentials of its own.
            async with httpx.AsyncClient() as outside:
                got = await outside.get(url)
            assert got.status_code == 200 and got.content == png_bytes(64, 48, seed)
            assert got.headers["content-type"] == "image/png"  # set on the object at upload
            # The API's own route reads the same object through the store's credentials.
            api = await client.get(f"/v1/jobs/{job_id}/outputs/0")
            assert api.status_code == 200 and api.content == got.content
            assert await store.delete_outputs(job_id) == 1
            async with httpx.AsyncClient() as outside:
                assert (await outside.get(url)).status_code == 404
        finally:
            await worker.stop()


def test_signed_urls_need_a_cloud_location_and_exclude_a_url_base(tmp_path):
    with pytest.raises(ValueError, match="signed URLs need"):
        Store(Settings(output_dir=str(tmp_path), output_signed_url_ttl_s=60))
    with pytest.raises(ValueError, match="not both"):
        Store(Settings(output_dir="s3://b/x", output_url_base="https://cdn", output_signed_url_ttl_s=60))
    with pytest.raises(ValueError, match="less than or equal"):
        Settings(output_dir="s3://b/x", output_signed_url_ttl_s=8 * 24 * 3600)
