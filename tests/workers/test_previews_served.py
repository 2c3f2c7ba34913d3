"""Live previews served (docs/previews.md): a worker pool on the embedded model, the API over ASGI, and an SSE
client that sees `preview` events carrying decodable pictures for each output, before the job's end; and the
pool's prompt-embedding cache counted in the worker's metrics."""

import asyncio
import base64
import io

import httpx
import pytest
from PIL import Image
from prometheus_client import REGISTRY

from meshserve.service.app import create_app
from meshserve.service.contract import JobParams
from meshserve.service.store import Store
from meshserve.workers.config import WorkerConfig, single_model_config
from meshserve.workers.main import Worker
from tests.service.test_api import parse_sse
from tests.workers.helpers import cleanup, make_settings


def _config() -> WorkerConfig:
    # Batches of 2, the shape the engine's preview and prompt-cache tests compile on the shared pipeline.
    config = single_model_config(None).model_dump()
    config["pools"][0].update(max_batch=2, warm_up_batch_sizes=[2])
    return WorkerConfig.model_validate(config)


def _metric(name: str) -> float:
    return REGISTRY.get_sample_value(name, {"model": "tiny-sdxl"}) or 0.0


def test_an_sse_client_sees_preview_events(embedded_sdxl, monkeypatch):
    monkeypatch.setattr("meshserve.models.load_pipeline", lambda *a, **kw: embedded_sdxl)
    # The session's pipeline compiles the batch-2 CFG program once (the engine tests run it too); the pool's
    # warm-up would add the CFG-off one, which no job here runs (~25 s on a loaded 2-core machine).
    monkeypatch.setattr(embedded_sdxl, "warm_up", lambda *a, **kw: 0.0)

    async def main():
        settings = make_settings(lease_s=30.0)
        store = Store(settings)
        worker = Worker(_config(), settings)
        task = asyncio.create_task(worker.run())
        app = create_app(settings, store)
        try:
            await asyncio.wait_for(worker.ready.wait(), 300)
            hits_before = _metric("meshserve_worker_prompt_cache_hits_total")
            async with app.router.lifespan_context(app):
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
                    body = {"prompt": "a red circle on a blue background", "n": 2, "num_inference_steps": 6}
                    r = await client.post("/v1/generate", json={**body, "preview_every": 2, "seed": 3})
                    assert r.status_code == 202, r.text
                    job = r.json()
                    assert job["params"]["preview_every"] == 2
                    plain = (await client.post("/v1/generate", json=body)).json()
                    assert plain["params"]["preview_every"] == 0
                    on = (await client.post("/v1/generate", json={**body, "previews": True})).json()
                    assert on["params"]["preview_every"] == 1  # about ten over the run: 6 // 10 -> 1
                    bad = await client.post("/v1/generate", json={**body, "preview_every": 0})
                    assert bad.status_code == 422 and "preview_every" in bad.text
                    streams = {}
                    # All three end before the cache's counts are read: `on` (this tenant's, the same texts)
                    # hitting the cache after them made the other tenant's check see 4 more hits (a slow CPU).
                    for j in (job, plain, on):
                        r = await client.get(f"/v1/jobs/{j['id']}/events")  # ends at the terminal event
                        streams[j["id"]] = parse_sse(r.text)
            events = streams[job["id"]]
            assert events[-1]["event"] == "succeeded", events[-1]
            previews = [e["data"] for e in events if e["event"] == "preview"]
            assert previews, [e["event"] for e in events]
            for p in previews:
                # The newest preview of an output per progress round: some steps may be superseded.
                assert p["index"] in (0, 1) and p["step"] in (2, 4, 6) and p["total_steps"] == 6
                head, data = p["image"].split(",", 1)
                assert head == "data:image/webp;base64"
                picture = Image.open(io.BytesIO(base64.b64decode(data)))
                assert picture.format == "WEBP" and picture.size == (128, 128)  # 16x16 latents, x8
                assert picture.convert("RGB").getextrema() != ((0, 0), (0, 0), (0, 0))
            assert not [e for e in streams[plain["id"]] if e["event"] == "preview"]
            # The second job's rows (the same prompt, the empty negative) were all in the prompt cache.
            assert _metric("meshserve_worker_prompt_cache_hits_total") >= hits_before + 4
            assert _metric("meshserve_worker_prompt_cache_entries") >= 2
            # Another tenant's job with the same texts hits none of them: each tenant has its own rows (a hit's
            # speed would tell it what the first had asked).
            hits, misses = (_metric(f"meshserve_worker_prompt_cache_{c}_total") for c in ("hits", "misses"))
            other = await store.submit(JobParams.model_validate(plain["params"]), owner="bob")
            for _ in range(600):
                if (await store.get(other.id)).status.terminal:
                    break
                await asyncio.sleep(0.1)
            assert (await store.get(other.id)).status.value == "succeeded"
            assert _metric("meshserve_worker_prompt_cache_hits_total") == hits
            # 2 outputs x (the text, the empty negative)
            assert _metric("meshserve_worker_prompt_cache_misses_total") == misses + 4
        finally:
            worker.stop()
            await asyncio.wait_for(task, 60)
            await store.close()
            cleanup(settings)
            embedded_sdxl.prompt_cache = None

    asyncio.run(main())


@pytest.fixture(autouse=True)
def _no_stray_cache(embedded_sdxl):
    yield
    embedded_sdxl.prompt_cache = None
