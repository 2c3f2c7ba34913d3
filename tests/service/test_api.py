"""The full client path over HTTP (ASGI) with a fake worker on the real Redis: submit, poll, SSE, download,
cancel, idempotency, every 422 rule, 404s, 429, 503, `Prefer: wait`, the OpenAI route, probes and metrics."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time

import httpx
import pytest
import uvicorn
from PIL import Image

from meshserve.service.api.routes.generate import prefer_wait
from meshserve.service.app import create_app
from meshserve.service.store import Store
from tests.private_redis import free_port
from tests.service.conftest import TOY, TOY_VIDEO, FakeWorker, api_client, drop_keys

pytestmark = pytest.mark.anyio


async def wait_status(client, job_id: str, statuses: set[str], timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        body = (await client.get(f"/v1/jobs/{job_id}")).json()
        if body["status"] in statuses or time.monotonic() > deadline:
            return body
        await asyncio.sleep(0.01)


def parse_sse(text: str) -> list[dict]:
    events = []
    for block in text.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if not line.startswith(":"))
        if fields:
            events.append(
                {"id": fields.get("id"), "event": fields["event"], "data": json.loads(fields["data"])}
            )
    return events


async def test_submit_poll_download(api):
    client, store, worker = api
    worker.start()
    r = await client.post("/v1/generate", json={"model": "toy", "prompt": "a red square", "n": 2})
    assert r.status_code == 202, r.text
    job = r.json()
    assert r.headers["location"] == f"/v1/jobs/{job['id']}"
    assert job["object"] == "job" and job["status"] in ("queued", "running", "succeeded")
    p = job["params"]  # normalised: the model's defaults and the seed used
    assert (p["width"], p["height"], p["num_inference_steps"], p["guidance_scale"]) == (64, 48, 4, 5.0)
    assert isinstance(p["seed"], int) and p["output_format"] == "png"
    done = await wait_status(client, job["id"], {"succeeded"})
    assert done["status"] == "succeeded" and done["progress"] == {"step": 4, "total_steps": 4}
    assert done["timings"]["total_s"] >= done["timings"]["inference_s"] > 0
    # The worker's stages, as the succeeded event has them (the job left them out).
    assert set(done["timings"]["stages"]) == {"denoise"}
    assert [o["seed"] for o in done["outputs"]] == [p["seed"], p["seed"] + 1]
    for out in done["outputs"]:
        img = await client.get(out["url"])
        assert img.status_code == 200 and img.headers["content-type"] == "image/png"
        assert Image.open(io.BytesIO(img.content)).size == (64, 48) == (out["width"], out["height"])
    r = await client.get(f"/v1/jobs/{job['id']}/outputs/2")
    assert r.status_code == 404 and r.json()["error"]["code"] == "output_not_found"


async def test_seed_given_or_random(api):
    client, _, _ = api
    given = (await client.post("/v1/generate", json={"model": "toy", "prompt": "x", "seed": 123})).json()
    assert given["params"]["seed"] == 123
    seeds = {
        (await client.post("/v1/generate", json={"model": "toy", "prompt": "x", "seed": None})).json()[
            "params"
        ]["seed"]
        for _ in range(3)
    }
    assert len(seeds) == 3  # random per request (a 1 in ~10^9 chance of a false failure)


async def test_sse_stream_and_resume(api):
    client, _, worker = api
    worker.start()
    job = (
        await client.post("/v1/generate", json={"model": "toy", "prompt": "x", "num_inference_steps": 3})
    ).json()
    r = await client.get(f"/v1/jobs/{job['id']}/events")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(r.text)
    assert [e["event"] for e in events] == [
        "queued",
        "started",
        "progress",
        "progress",
        "progress",
        "succeeded",
    ]
    assert [e["data"].get("step") for e in events[2:5]] == [1, 2, 3]
    assert events[-1]["data"]["outputs"][0]["url"].endswith("/outputs/0")
    # A finished job's events are read at once and go out as one write (one write per event went on after a
    # client that left: 38-74 logged "socket.send() raised exception" per dropped stream in an audit).
    chunks = await _asgi_body_messages(client, f"/v1/jobs/{job['id']}/events")
    assert len(chunks) == 1 and parse_sse(chunks[0].decode()) == events
    # Resume after the second event: only the rest comes.
    r = await client.get(f"/v1/jobs/{job['id']}/events", headers={"Last-Event-ID": events[1]["id"]})
    assert [e["id"] for e in parse_sse(r.text)] == [e["id"] for e in events[2:]]
    # Resume after the terminal event (a client dropped right after it): the stream ends at once, with no
    # event, instead of sending keep-alives for the job's lifetime (an audit's finding).
    r = await asyncio.wait_for(
        client.get(f"/v1/jobs/{job['id']}/events", headers={"Last-Event-ID": events[-1]["id"]}), 5
    )
    assert r.status_code == 200 and parse_sse(r.text) == []


async def _asgi_body_messages(client, path: str) -> list[bytes]:
    """The non-empty `http.response.body` messages of a GET, straight from the ASGI app (httpx joins them)."""
    sent: list[bytes] = []
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [(b"host", b"testserver")], "client": ("127.0.0.1", 1), "server": ("testserver", 80),
    }  # fmt: skip

    async def receive():
        await asyncio.sleep(30)  # the client never disconnects: the stream ends by itself
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            sent.append(message["body"])

    await asyncio.wait_for(client._transport.app(scope, receive, send), 10)
    return sent


async def test_cancel_queued_job(api):
    client, store, worker = api
    job = (await client.post("/v1/generate", json={"model": "toy", "prompt": "x"})).json()
    r = await client.post(f"/v1/jobs/{job['id']}/cancel")
    assert r.status_code == 200 and r.json()["status"] == "canceled" and r.json()["finished_at"]
    worker.start()  # the pool meets the canceled entry and skips it
    later = (await client.post("/v1/generate", json={"model": "toy", "prompt": "y"})).json()
    assert (await wait_status(client, later["id"], {"succeeded"}))["status"] == "succeeded"
    # The job reads succeeded once its end is committed, a moment before the worker notes it (a fixed 50 ms wait
    # raced a loaded machine's scheduling; tests/service/test_redis_restart.py failed that way).
    deadline = time.monotonic() + 10
    while not worker.finished and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert worker.finished == [later["id"]]
    assert (await client.get(f"/v1/jobs/{job['id']}")).json()["status"] == "canceled"
    events = parse_sse((await client.get(f"/v1/jobs/{job['id']}/events")).text)
    assert [e["event"] for e in events] == ["queued", "canceled"]


async def test_cancel_running_job(api):
    client, _, worker = api
    worker.step_s = 0.05
    worker.start()
    job = (
        await client.post("/v1/generate", json={"model": "toy", "prompt": "x", "num_inference_steps": 40})
    ).json()
    running = await wait_status(client, job["id"], {"running"})
    assert running["status"] == "running"
    r = await client.post(f"/v1/jobs/{job['id']}/cancel")
    assert r.status_code == 200 and r.json()["status"] in ("running", "canceled")
    ended = await wait_status(client, job["id"], {"canceled", "succeeded"})
    assert ended["status"] == "canceled" and ended["progress"]["step"] < 40 and ended["outputs"] == []


async def test_idempotency_key(api):
    from meshserve.service import metrics

    client, _, _ = api
    body = {"model": "toy", "prompt": "x", "seed": 1}
    submitted = metrics.JOBS_SUBMITTED.labels("toy", "normal")
    before = submitted._value.get()
    a = await client.post("/v1/generate", json=body, headers={"Idempotency-Key": "abc"})
    b = await client.post("/v1/generate", json=body, headers={"Idempotency-Key": "abc"})
    assert a.status_code == b.status_code == 202 and a.json()["id"] == b.json()["id"]
    assert submitted._value.get() == before + 1  # a replay creates no job
    spelled_out = {**body, "priority": "normal", "negative_prompt": None}  # defaults: the same request
    e = await client.post("/v1/generate", json=spelled_out, headers={"Idempotency-Key": "abc"})
    assert e.status_code == 202 and e.json()["id"] == a.json()["id"], e.text
    c = await client.post("/v1/generate", json={**body, "seed": 2}, headers={"Idempotency-Key": "abc"})
    assert c.status_code == 422
    assert (
        c.json()["error"]["code"] == "idempotency_key_reused"
        and c.json()["error"]["field"] == "Idempotency-Key"
    )
    d = await client.post("/v1/generate", json=body, headers={"Idempotency-Key": "other"})
    assert d.json()["id"] != a.json()["id"]


BAD_BODIES = [
    ({"model": "m" * 201}, "model", "string_too_long"),
    ({"width": 65}, "width", "not_multiple"),
    ({"height": 1024}, "height", "out_of_range"),
    ({"width": 16}, "width", "out_of_range"),
    ({"width": 0}, "width", "greater_than"),
    ({"width": "wide"}, "width", "int_type"),
    ({"num_inference_steps": 0}, "num_inference_steps", "greater_than"),
    ({"num_inference_steps": 51}, "num_inference_steps", "out_of_range"),
    ({"n": 0}, "n", "greater_than_equal"),
    ({"n": 5}, "n", "out_of_range"),
    ({"guidance_scale": -1}, "guidance_scale", "greater_than_equal"),
    ({"seed": -1}, "seed", "greater_than_equal"),
    ({"seed": 2**40}, "seed", "less_than_equal"),
    ({"scheduler": "nope"}, "scheduler", "not_supported"),
    ({"output_format": "gif"}, "output_format", "literal_error"),
    ({"output_format": "mp4"}, "output_format", "not_supported"),
    ({"num_frames": 9}, "num_frames", "not_supported"),
    ({"prompt": ""}, "prompt", "string_too_short"),
    ({"prompt": "x" * 4001}, "prompt", "string_too_long"),
    ({"prompt": None}, "prompt", "string_type"),
    ({"priority": "urgent"}, "priority", "enum"),
    ({"metadata": {"a": {"nested": 1}}}, "metadata.a.str", "string_type"),
    ({"colour": "red"}, "colour", "extra_forbidden"),
]


@pytest.mark.parametrize(("patch", "field", "code"), BAD_BODIES, ids=[f"{f}-{c}" for _, f, c in BAD_BODIES])
async def test_422_rules(api, patch, field, code):
    client, store, _ = api
    r = await client.post("/v1/generate", json={"model": "toy", "prompt": "x", **patch})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert (err["field"], err["code"]) == (field, code) and err["message"]
    assert await store.redis.exists(store.stream_key("toy", "normal")) == 0  # nothing was queued


async def test_422_request_shape(api):
    client, _, _ = api
    cases = [
        (
            dict(content=b'{"prompt": "x",', headers={"content-type": "application/json"}),
            "body",
            "invalid_json",
        ),
        (dict(json={"model": "toy"}), "prompt", "missing"),
        (dict(json=["not", "an", "object"]), "body", "model_attributes_type"),
        (
            dict(json={"model": "toy", "prompt": "x"}, headers={"Idempotency-Key": "k" * 256}),
            "Idempotency-Key",
            "string_too_long",
        ),
    ]
    for kwargs, field, code in cases:
        r = await client.post("/v1/generate", **kwargs)
        assert r.status_code == 422, r.text
        assert (r.json()["error"]["field"], r.json()["error"]["code"]) == (field, code)


async def test_video_model_rules(make_settings):
    async with api_client(make_settings()) as (client, store):
        await FakeWorker(store, name="v", models=(TOY_VIDEO,)).register()
        post = lambda **kw: client.post("/v1/generate", json={"model": "toy-video", "prompt": "x", **kw})  # noqa: E731
        ok = (await post(width=96, height=64)).json()
        assert ok["params"]["num_frames"] == 9 and ok["params"]["output_format"] == "mp4"
        for kw, field, code in [
            (dict(width=128, height=128), "width", "size_not_supported"),
            (dict(num_frames=10), "num_frames", "not_multiple"),
            (dict(num_frames=37), "num_frames", "out_of_range"),
            (dict(output_format="png"), "output_format", "not_supported"),
        ]:
            err = (await post(**kw)).json()["error"]
            assert (err["field"], err["code"]) == (field, code)
        # The OpenAI image routes answer images: a video model is refused there (it answered an MP4's URL).
        r = await client.post("/v1/images/generations", json={"model": "toy-video", "prompt": "x"})
        assert r.status_code == 422 and (r.json()["error"]["field"], r.json()["error"]["code"]) == (
            "model",
            "not_supported",
        )
        assert "use POST /v1/generate" in r.json()["error"]["message"]


async def test_model_not_found_and_no_pool(make_settings):
    async with api_client(make_settings()) as (client, store):
        r = await client.post("/v1/generate", json={"model": "toy", "prompt": "x"})
        assert (
            r.status_code == 503 and r.json()["error"]["code"] == "no_ready_pool" and r.headers["retry-after"]
        )
        worker = FakeWorker(store)
        await worker.register(ready=False)  # loading: still no ready pool
        assert (await client.post("/v1/generate", json={"prompt": "x"})).status_code == 503
        await worker.register(ready=True)
        r = await client.post("/v1/generate", json={"model": "sdxl-huge", "prompt": "x"})
        assert r.status_code == 404
        assert r.json()["error"] == {
            "code": "model_not_found",
            "field": "model",
            "message": "model 'sdxl-huge' is not served; served models: ['toy']",
            "param": "model",  # OpenAI's names for the field and the kind, which its SDKs read
            "type": "invalid_request_error",
        }
        # With one model served, `model` may be left out.
        assert (await client.post("/v1/generate", json={"prompt": "x"})).json()["model"] == "toy"


async def test_queue_full_429(make_settings):
    async with api_client(make_settings(queue_max_length=2, retry_after_s=7)) as (client, store):
        worker = FakeWorker(store)
        await worker.register()
        for _ in range(2):
            assert (await client.post("/v1/generate", json={"prompt": "x"})).status_code == 202
        r = await client.post("/v1/generate", json={"prompt": "x"})
        assert r.status_code == 429 and r.headers["retry-after"] == "7"
        assert r.json()["error"]["code"] == "queue_full"
        worker.start()  # drained: accepted again
        deadline = time.monotonic() + 10
        while (await client.post("/v1/generate", json={"prompt": "x"})).status_code != 202:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        await worker.stop()


async def test_prefer_wait(api):
    client, _, worker = api
    r = await client.post("/v1/generate", json={"prompt": "x"}, headers={"Prefer": "wait=1"})
    assert r.status_code == 202 and r.json()["status"] == "queued" and r.json()["queue_position"] == 0
    assert r.headers["preference-applied"] == "wait=1"
    worker.start()
    t0 = time.monotonic()
    r = await client.post("/v1/generate", json={"prompt": "x"}, headers={"Prefer": "respond-async, wait=10"})
    assert r.status_code == 200 and r.json()["status"] == "succeeded" and r.json()["outputs"]
    assert time.monotonic() - t0 < 5
    assert (
        prefer_wait("wait=600", 60) == 60 and prefer_wait("wait=abc", 60) == 0 and prefer_wait(None, 60) == 0
    )
    # RFC 7240: several Prefer headers (an audit's second header was never read), several preferences in one,
    # and `wait` as another preference's parameter is not a wait.
    assert prefer_wait(["respond-async", "wait=3"], 60) == 3 and prefer_wait(['x=1, WAIT = "7"'], 60) == 7
    assert prefer_wait("handling=strict; wait=3", 60) == 0 and prefer_wait("wait=5; foo=bar", 60) == 5
    assert prefer_wait("nowait=5", 60) == 0
    r = await client.post(
        "/v1/generate", json={"prompt": "x"}, headers=[("Prefer", "respond-async"), ("Prefer", "wait=10")]
    )
    assert r.status_code == 200 and r.headers["preference-applied"] == "wait=10", r.text
    # Over 4,300 digits int() refuses: that was a 500 after the job was queued (its id never reached the client).
    r = await client.post("/v1/generate", json={"prompt": "x"}, headers={"Prefer": "wait=" + "1" * 5000})
    assert r.status_code == 200 and r.headers["preference-applied"] == "wait=60", r.text


async def test_a_store_failure_while_waiting_still_answers_the_accepted_job(api, monkeypatch):
    """Found by an audit (Redis paused mid-wait): the job was accepted and ran, but the client got a 503 without
    its id and would have submitted it again."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    client, store, _ = api

    async def stalled(*args, **kwargs):
        raise RedisConnectionError("Redis did not answer XREAD within 15 s")

    monkeypatch.setattr(store, "wait", stalled)
    r = await client.post("/v1/generate", json={"prompt": "x"}, headers={"Prefer": "wait=5"})
    assert r.status_code == 202 and r.json()["status"] == "queued", r.text
    assert r.headers["location"] == f"/v1/jobs/{r.json()['id']}"
    assert (await store.get(r.json()["id"])).status.value == "queued"
    r = await client.post("/v1/images/generations", json={"prompt": "x"})
    assert r.status_code == 503 and r.headers["location"].startswith("/v1/jobs/"), r.text
    assert r.headers["location"].removeprefix("/v1/jobs/") in r.json()["error"]["message"]


async def test_not_found_shapes(api):
    client, _, _ = api
    for path in (
        "/v1/jobs/0123456789abcdef0123456789abcdef",
        "/v1/jobs/..%2Fetc",
        "/v1/jobs/nope/outputs/0",
        "/v1/jobs/nope/events",
    ):
        r = await client.get(path)
        assert r.status_code == 404 and r.json()["error"]["code"] in ("job_not_found", "not_found"), path
    r = await client.post("/v1/jobs/nope/cancel")
    assert r.status_code == 404 and r.json()["error"]["field"] == "job_id"
    r = await client.get("/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = await client.delete("/v1/generate")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    assert r.headers["allow"] == "POST"
    r = await client.delete("/v1/models")  # a GET route answers HEAD too (head_requests.py): Allow says so
    assert r.status_code == 405 and r.headers["allow"] == "GET, HEAD"
    job = (await client.post("/v1/generate", json={"prompt": "x"})).json()
    r = await client.get(f"/v1/jobs/{job['id']}/outputs/0")
    assert r.status_code == 404 and "queued" in r.json()["error"]["message"]
    r = await client.get(f"/v1/jobs/{job['id']}/outputs/-1")
    assert r.status_code == 422 and r.json()["error"]["field"] == "index"


async def test_models_endpoint(api):
    client, _, _ = api
    body = (await client.get("/v1/models")).json()
    (card,) = body["data"]
    assert card["id"] == "toy" and card["family"] == "sdxl" and card["task"] == "text-to-image"
    assert card["defaults"] == {"width": 64, "height": 48, "num_inference_steps": 4, "guidance_scale": 5.0}
    assert card["limits"]["max_n"] == 4 and card["limits"]["size_multiple"] == 8
    assert [p["name"] for p in card["pools"]] == ["pool-a"]


async def test_openai_images(api):
    client, _, worker = api
    worker.start()
    r = await client.post(
        "/v1/images/generations",
        json={"prompt": "x", "n": 2, "size": "96x64", "response_format": "b64_json", "user": "u"},
    )
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert len(data) == 2
    assert Image.open(io.BytesIO(base64.b64decode(data[0]["b64_json"]))).size == (96, 64)
    r = await client.post("/v1/images/generations", json={"prompt": "x", "model": "toy"})
    url = r.json()["data"][0]["url"]
    assert url.startswith("http://testserver/v1/jobs/")
    assert (await client.get(url)).headers["content-type"] == "image/png"
    r = await client.post("/v1/images/generations", json={"prompt": "x", "size": "big"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "size"
    r = await client.post("/v1/images/generations", json={"prompt": "x", "size": "100x100"})
    assert r.status_code == 422 and r.json()["error"]["code"] == "not_multiple"


async def test_openai_images_take_the_fields_openai_clients_send(api):
    """OpenAI's nullable fields as null (LiteLLM-style clients), size "auto", gpt-image-1's output_format (an audit
    got PNG for jpeg), and stream: true refused (the SDK then failed reading JSON as an event stream)."""
    client, store, worker = api
    worker.start()
    body = {"prompt": "x", "n": None, "size": "auto", "response_format": None, "output_format": "jpeg"}
    r = await client.post("/v1/images/generations", json=body)
    assert r.status_code == 200, r.text
    (data,) = r.json()["data"]
    job = await store.get(data["url"].split("/v1/jobs/")[1].split("/")[0])
    assert (job.params.output_format, job.params.n, job.params.width) == ("jpeg", 1, 64)
    r = await client.post("/v1/images/generations", json={"prompt": "x", "stream": True})
    assert r.status_code == 422 and (r.json()["error"]["field"], r.json()["error"]["code"]) == (
        "stream",
        "not_supported",
    )
    r = await client.post("/v1/images/generations", json={"prompt": "x", "output_format": "gif"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "output_format", r.text


async def test_probes(make_settings):
    async with api_client(make_settings()) as (client, store):
        assert (await client.get("/livez")).status_code == 200
        r = await client.get("/readyz")
        assert (
            r.status_code == 503
            and r.json()["error"]["code"] == "no_ready_pool"
            and "retry-after" in r.headers
        )
        await FakeWorker(store).register()
        r = await client.get("/readyz")
        assert r.status_code == 200 and r.json()["detail"]["ready_pools"] == ["pool-a"]


async def test_metrics(api):
    client, store, worker = api
    worker.start()
    job = (
        await client.post("/v1/generate", json={"prompt": "secret prompt"}, headers={"Prefer": "wait=5"})
    ).json()
    await client.post("/v1/generate", json={"prompt": "x", "width": 65})
    await client.get(f"/v1/jobs/{job['id']}")
    text = (await client.get("/metrics")).text
    assert 'meshserve_http_requests_total{method="POST",route="/v1/generate",status="200"}' in text
    assert 'meshserve_http_requests_total{method="GET",route="/v1/jobs/{job_id}",status="200"}' in text
    assert 'meshserve_jobs_rejected_total{reason="invalid"}' in text
    assert 'meshserve_queue_depth{model="toy",priority="normal"} 0.0' in text
    assert 'meshserve_jobs_finished_total{model="toy",outcome="succeeded"} 1.0' in text
    assert 'meshserve_pools{ready="true"} 1.0' in text
    assert "meshserve_build_info{" in text
    assert job["id"] not in text and "secret" not in text  # never a job id or a prompt in a label
    assert "meshserve_store_up 1.0" in text
    # Redis away (an audit saw unmarked stale values): the snapshot stays, and says it is one.
    from redis.exceptions import ConnectionError as RedisConnectionError

    async def away(*args, **kwargs):
        raise RedisConnectionError("Redis did not answer")

    store.queue_depths = away  # the app's own store (api_client hands it to create_app)
    text = (await client.get("/metrics")).text
    assert "meshserve_store_up 0.0" in text
    assert 'meshserve_jobs_finished_total{model="toy",outcome="succeeded"} 1.0' in text
    assert "meshserve_store_snapshot_timestamp_seconds 1." in text


async def test_sse_streams_live_over_real_http(make_settings):
    """Over a real uvicorn server (ASGI transports buffer whole responses): events arrive as they happen, with the
    keep-alive comment while nothing does."""
    port = free_port()
    settings = make_settings(sse_keepalive_s=0.2)
    app = create_app(settings)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    serving = asyncio.create_task(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        store = app.state.store
        worker = FakeWorker(store, step_s=0.05)
        await worker.register()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            job = (await client.post("/v1/generate", json={"prompt": "x", "num_inference_steps": 3})).json()
            seen: list[str] = []
            async with client.stream("GET", f"/v1/jobs/{job['id']}/events") as r:
                async for line in r.aiter_lines():
                    if line.startswith(": keep-alive") and worker.task is None:
                        worker.start()  # the stream is open and idle: only now does the job run
                    if line.startswith("event: "):
                        seen.append(line[7:])
            assert seen == ["queued", "started", "progress", "progress", "progress", "succeeded"]
        await worker.stop()
    finally:
        server.should_exit = True
        await serving

        cleanup = Store(settings)
        await drop_keys(cleanup)
        await cleanup.close()


def _serving(info, buckets):
    """`info` as a pool publishes it that serves only `buckets` (None: any size)."""
    return info.model_copy(update={"limits": info.limits.model_copy(update={"buckets": buckets})})


async def test_only_sizes_every_ready_pool_serves_are_admitted(make_settings):
    """Pools of one model read one stream, so a size is admitted only when every ready pool serves it (before:
    the first pool's buckets decided, and 64x48 went to a pool that would compile it on the request path)."""
    async with api_client(make_settings()) as (client, store):
        await FakeWorker(store, name="a", models=(_serving(TOY, [(64, 48), (96, 64)]),)).register()
        await FakeWorker(store, name="b", models=(_serving(TOY, [(96, 64), (128, 128)]),)).register()
        await FakeWorker(store, name="c", models=(TOY,)).register()  # any size: narrows nothing
        await FakeWorker(store, name="d", models=(_serving(TOY, [(32, 32)]),)).register(
            ready=False
        )  # loading
        (card,) = (await client.get("/v1/models")).json()["data"]
        assert card["limits"]["buckets"] == [[96, 64]]
        assert (card["defaults"]["width"], card["defaults"]["height"]) == (96, 64)  # 64x48 is not common

        async def post(**kw):
            return await client.post("/v1/generate", json={"model": "toy", "prompt": "x", **kw})

        assert (await post(width=96, height=64)).status_code == 202
        assert (await post()).json()["params"]["width"] == 96  # no size: the served default
        for kw, field in [(dict(width=64, height=48), "width"), (dict(width=96, height=48), "height")]:
            r = await post(**kw)
            assert r.status_code == 422, r.text
            err = r.json()["error"]
            assert (err["field"], err["code"]) == (field, "size_not_supported")
            assert "served sizes: 96x64" in err["message"]
        r = await client.post("/v1/images/generations", json={"prompt": "x", "size": "64x48"})
        assert r.status_code == 422 and r.json()["error"]["field"] == "size"
        assert r.json()["error"]["code"] == "size_not_supported"
        assert await store.redis.xlen(store.stream_key("toy", "normal")) == 2  # only the admitted ones


async def test_pools_without_a_common_size_admit_none_and_say_so(make_settings):
    async with api_client(make_settings()) as (client, store):
        await FakeWorker(store, name="a", models=(_serving(TOY, [(64, 48)]),)).register()
        await FakeWorker(store, name="b", models=(_serving(TOY, [(96, 64)]),)).register()
        r = await client.post("/v1/generate", json={"prompt": "x", "width": 64, "height": 48})
        assert r.status_code == 422 and "its pools share no size" in r.json()["error"]["message"]


async def test_max_prompt_chars_setting_is_enforced(make_settings):
    """Before: the setting existed but nothing read it (the schema's fixed 4000 applied), so 11 characters
    passed with max_prompt_chars=10."""
    async with api_client(make_settings(max_prompt_chars=10)) as (client, store):
        await FakeWorker(store).register()
        assert (await client.post("/v1/generate", json={"prompt": "x" * 10})).status_code == 202
        for body, field in [
            ({"prompt": "x" * 11}, "prompt"),
            ({"prompt": "x", "negative_prompt": "y" * 11}, "negative_prompt"),
        ]:
            r = await client.post("/v1/generate", json=body)
            assert r.status_code == 422, r.text
            assert (r.json()["error"]["field"], r.json()["error"]["code"]) == (field, "string_too_long")
        r = await client.post("/v1/images/generations", json={"prompt": "x" * 11})
        assert r.status_code == 422 and r.json()["error"]["field"] == "prompt"


async def test_openai_images_keep_absolute_output_urls(make_settings, tmp_path):
    """With outputs served by an object store (`output_url_base`), the URL is returned as it is. Before:
    `http://testserverhttps://cdn.example/outputs/<id>/0.png`."""
    settings = make_settings(output_dir=str(tmp_path), output_url_base="https://cdn.example/outputs")
    async with api_client(settings) as (client, store):
        worker = FakeWorker(store)
        await worker.register()
        worker.start()
        try:
            r = await client.post("/v1/images/generations", json={"prompt": "x"})
            assert r.status_code == 200, r.text
            (image,) = r.json()["data"]
            job_id, token = image["url"].split("/")[-3:-1]
            assert image["url"] == f"https://cdn.example/outputs/{job_id}/{token}/0.png"
            assert (tmp_path / job_id / token / "0.png").is_file()
        finally:
            await worker.stop()


async def test_the_playground_policy_admits_an_outside_output_origin(make_settings, tmp_path):
    """Outputs on another origin are shown from there (playground.js never sends the key but to its own origin:
    an audit found it sent to any output URL); the policy admits that origin's images and media only."""
    from meshserve.service.api.routes.playground import CONTENT_SECURITY_POLICY

    settings = make_settings(output_dir=str(tmp_path), output_url_base="https://cdn.example.com/out")
    async with api_client(settings) as (client, _):
        policy = (await client.get("/playground")).headers["content-security-policy"]
    assert "img-src 'self' data: blob: https://cdn.example.com;" in policy
    assert "media-src 'self' blob: https://cdn.example.com;" in policy
    assert "connect-src 'self';" in policy  # nothing is fetched from there with the key
    async with api_client(make_settings()) as (client, _):
        assert (await client.get("/playground")).headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    async with api_client(make_settings()) as (client, _):
        script = (await client.get("/playground/playground.js")).text
    assert "origin === location.origin" in script  # the key goes with same-origin fetches only


async def test_head_answers_every_get_route_without_a_body(api):
    """HEAD on a GET route is the GET's status and headers with no body (it was 405 on every route); on a
    POST-only route it is still 405; on a job's event stream it ends at once instead of streaming."""
    client, store, worker = api
    worker.start()
    job = (await client.post("/v1/generate", json={"model": "toy", "prompt": "a red square"})).json()
    done = await wait_status(client, job["id"], {"succeeded"})
    url = done["outputs"][0]["url"]
    get, head = await client.get(url), await client.head(url)
    assert head.status_code == 200 and head.content == b""
    assert head.headers["content-type"] == "image/png"
    assert head.headers["content-length"] == get.headers["content-length"] == str(len(get.content))
    for path in ("/v1/models", f"/v1/jobs/{job['id']}", "/livez"):
        r = await client.head(path)
        assert (r.status_code, r.content) == (200, b""), path
    r = await client.head("/v1/jobs/nope")
    assert r.status_code == 404 and r.content == b""
    assert (await client.head("/v1/generate")).status_code == 405
    running = await client.post(
        "/v1/generate", json={"model": "toy", "prompt": "x", "num_inference_steps": 50}
    )
    r = await asyncio.wait_for(client.head(f"/v1/jobs/{running.json()['id']}/events"), 5)
    assert r.status_code == 200 and r.content == b""
    assert r.headers["content-type"].startswith("text/event-stream")


async def test_a_body_without_a_json_content_type_says_so(api):
    """FastAPI reads a JSON body only under a JSON Content-Type; without one the answer named no cause
    ("Input should be a valid dictionary or object to extract fields from")."""
    client, _, _ = api
    for headers in ({}, {"content-type": "application/x-www-form-urlencoded"}):
        r = await client.post("/v1/generate", content=b'{"model": "toy", "prompt": "x"}', headers=headers)
        error = r.json()["error"]
        assert r.status_code == 422 and (error["code"], error["field"]) == ("invalid_json", "body"), r.text
        assert "Content-Type: application/json" in error["message"]


async def test_an_encoded_body_says_so(api):
    """A gzip body is read as sent (bytes that are not JSON): the answer names the content coding."""
    import gzip

    client, _, _ = api
    body = gzip.compress(b'{"model": "toy", "prompt": "x"}')
    headers = {"content-type": "application/json", "content-encoding": "gzip"}
    r = await client.post("/v1/generate", content=body, headers=headers)
    error = r.json()["error"]
    assert r.status_code == 422 and (error["code"], error["field"]) == ("invalid_json", "body"), r.text
    assert "Content-Encoding 'gzip'" in error["message"], error


async def test_outputs_answer_conditional_and_ranged_downloads(api):
    """A `<video>` seeks with ranges (Safari plays an MP4 only from them) and a resumed download asks for the
    rest: an audit got 200 and the whole body for every Range, and no ETag."""
    client, _, worker = api
    worker.start()
    r = await client.post("/v1/generate", json={"prompt": "x"}, headers={"Prefer": "wait=10"})
    url = r.json()["outputs"][0]["url"]
    whole = await client.get(url)
    data, etag, size = whole.content, whole.headers["etag"], len(whole.content)
    assert whole.status_code == 200 and whole.headers["accept-ranges"] == "bytes" and etag.startswith('"')
    for spec, start, end in (
        ("0-9", 0, 9),
        ("10-", 10, size - 1),
        ("-7", size - 7, size - 1),
        ("5-99999", 5, size - 1),
    ):
        r = await client.get(url, headers={"Range": f"bytes={spec}"})
        assert r.status_code == 206, (spec, r.status_code)
        assert (
            r.content == data[start : end + 1] and r.headers["content-range"] == f"bytes {start}-{end}/{size}"
        )
    for spec in (f"{size}-", "-0"):
        r = await client.get(url, headers={"Range": f"bytes={spec}"})
        assert r.status_code == 416 and r.headers["content-range"] == f"bytes */{size}", spec
    # Whole answers: several ranges, an invalid one, another unit, a stale If-Range.
    for headers in (
        {"Range": "bytes=0-1,4-5"},
        {"Range": "bytes=9-3"},
        {"Range": "items=0-1"},
        {"Range": "bytes=0-1", "If-Range": '"other"'},
    ):
        r = await client.get(url, headers=headers)
        assert r.status_code == 200 and r.content == data, headers
    r = await client.get(url, headers={"Range": "bytes=0-1", "If-Range": etag})
    assert r.status_code == 206 and r.content == data[:2]
    for tag in (etag, f"W/{etag}", '"x", ' + etag, "*"):
        r = await client.get(url, headers={"If-None-Match": tag})
        assert r.status_code == 304 and not r.content and r.headers["etag"] == etag, tag
    r = await client.head(url, headers={"Range": "bytes=0-9"})
    assert r.status_code == 206 and r.headers["content-length"] == "10"


async def test_output_compression_is_the_lossy_formats_quality(api):
    """OpenAI's gpt-image-1 `output_compression`: 0-100, for jpeg and webp outputs only (a 422 naming the field
    with png, the default format), on /v1/generate and /v1/images/generations alike."""
    client, store, _ = api
    r = await client.post(
        "/v1/generate", json={"prompt": "x", "output_format": "jpeg", "output_compression": 40}
    )
    assert r.status_code == 202, r.text
    assert (await store.get(r.json()["id"])).params.output_compression == 40
    r = await client.post("/v1/generate", json={"prompt": "x"})
    assert r.json()["params"]["output_compression"] is None
    for body, rule in (
        ({"output_compression": 50}, "not_supported"),  # png
        ({"output_format": "webp", "output_compression": 101}, "less_than_equal"),
        ({"output_format": "webp", "output_compression": -1}, "greater_than_equal"),
        ({"output_format": "webp", "output_compression": 5.5}, "int_type"),
    ):
        r = await client.post("/v1/generate", json={"prompt": "x", **body})
        assert r.status_code == 422, (body, r.text)
        assert (r.json()["error"]["field"], r.json()["error"]["code"]) == ("output_compression", rule), r.text
    body = {"prompt": "x", "output_format": "png", "output_compression": 10}
    r = await client.post("/v1/images/generations", json=body)
    assert r.status_code == 422 and r.json()["error"]["field"] == "output_compression", r.text
