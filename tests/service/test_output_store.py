"""The object-store output layer (service/output_store.py) on obstore's local and in-memory backends; signed URLs
with static S3 credentials (signing is local computation: no request leaves the machine)."""

from __future__ import annotations

from urllib.parse import parse_qs, urlparse

import pytest

from meshserve.service.output_store import OutputStore, OutputStoreError

pytestmark = pytest.mark.anyio

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4


@pytest.fixture(params=["local", "file", "memory"])
def store(request, tmp_path) -> OutputStore:
    location = {"local": str(tmp_path / "out"), "file": f"file://{tmp_path}/out", "memory": "memory://"}
    return OutputStore(location[request.param])


async def test_round_trip_and_delete(store):
    assert await store.put("job1", 0, "png", PNG) == "job1/0.png"
    assert await store.put("job1", 1, ".webp", b"webp bytes", key="s3cr3t_-X") == "job1/s3cr3t_-X/1.webp"
    await store.put("job2", 0, "png", b"another job")
    assert await store.get("job1", 0, "png") == PNG
    assert await store.get("job1", 1, "webp", key="s3cr3t_-X") == b"webp bytes"
    assert await store.get("job1", 1, "webp") is None  # without the key: another path
    assert await store.get("job1", 7, "png") is None
    await store.put("job1", 0, "png", b"replaced")  # a retried attempt overwrites its own output
    assert await store.get("job1", 0, "png") == b"replaced"

    assert await store.delete("job1") == 2
    assert await store.get("job1", 0, "png") is None
    assert await store.get("job1", 1, "webp", key="s3cr3t_-X") is None
    assert await store.get("job2", 0, "png") == b"another job"  # a job's prefix only
    assert await store.delete("job1") == 0


async def test_local_files_land_under_the_folder(tmp_path):
    store = OutputStore(tmp_path / "out")
    await store.put("abc", 2, "mp4", b"video", key="k")
    assert (tmp_path / "out" / "abc" / "k" / "2.mp4").read_bytes() == b"video"
    assert sorted(p.name for p in (tmp_path / "out" / "abc" / "k").iterdir()) == [
        "2.mp4"
    ]  # no temp files left
    await store.delete("abc")
    assert not (tmp_path / "out" / "abc").exists()  # empty folders go too


async def test_urls(tmp_path):
    plain = OutputStore(tmp_path / "out")
    assert await plain.url("job1", 0, "png") is None  # the API serves it
    cdn = OutputStore("memory://", url_base="https://cdn.example.com/outputs/")
    assert await cdn.url("job1", 0, "png", key="tok") == "https://cdn.example.com/outputs/job1/tok/0.png"


async def test_signed_url_for_s3(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    store = OutputStore("s3://bucket/meshserve", signed_url_ttl_s=600)
    url = urlparse(await store.url("job1", 0, "png", key="tok"))
    assert url.path == "/bucket/meshserve/job1/tok/0.png"
    query = parse_qs(url.query)
    assert query["X-Amz-Expires"] == ["600"] and query["X-Amz-Credential"][0].startswith("AKIDEXAMPLE/")
    assert len(query["X-Amz-Signature"][0]) == 64


async def test_a_write_error_is_the_stores_error(tmp_path):
    store = OutputStore(tmp_path / "out")
    (tmp_path / "out" / "job1").write_text("a file where the job's folder goes")
    with pytest.raises(OutputStoreError, match="cannot write output job1/0.png to .*out") as e:
        await store.put("job1", 0, "png", PNG)
    assert e.value.__cause__ is not None  # the backend's error, kept


def test_an_unusable_location_is_the_stores_error(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(OutputStoreError, match="cannot open output_dir"):
        OutputStore(tmp_path / "file" / "out")


def test_bad_configuration_and_paths_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unsupported scheme 'ftp'"):
        OutputStore("ftp://host/x")
    with pytest.raises(ValueError, match="signed URLs need"):
        OutputStore(str(tmp_path), signed_url_ttl_s=60)
    with pytest.raises(ValueError, match="not both"):
        OutputStore("s3://bucket/x", url_base="https://cdn", signed_url_ttl_s=60)
    for job_id, index, ext, key in [
        ("../etc", 0, "png", None),
        ("job", -1, "png", None),
        ("job", 0, "p/ng", None),
        ("job", 0, "png", "a/b"),
        ("job", 0, "png", ".."),
    ]:
        with pytest.raises(ValueError):
            OutputStore.path(job_id, index, ext, key)
