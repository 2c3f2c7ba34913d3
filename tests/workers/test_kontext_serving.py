"""FLUX.1 Kontext served end to end: a worker pool on a tiny Kontext folder (the tiny Flux-dev's components,
model_index.json naming FluxKontextPipeline), the API in-process over ASGI, one Redis. The card lists
text-to-image and image-to-image without a strength; a request with `strength` is a 422 naming it, nothing
queued; a job with an `image` and one without both run, each PNG the image a direct pipeline call with the same
inputs and seed gives, and the edit is not the text-to-image result. The pool's warm-up is skipped (as in
tests/workers/test_i2v_serving.py): the first jobs compile their programs."""

from __future__ import annotations

import asyncio
import io

import numpy as np
from PIL import Image

from meshserve.models import load_pipeline
from meshserve.workers.config import ModelSpec, PoolConfig, WorkerConfig
from meshserve.workers.encoding import to_uint8
from meshserve.workers.main import Worker
from tests.service.conftest import api_client
from tests.workers.helpers import cleanup, job_when_ended, make_settings
from tests.workers.test_i2v_serving import data_url, still

MODEL = "tiny-kontext"
PROMPT = "make the ball green"
WIDTH, HEIGHT, SEED = 48, 32, 5


def test_kontext_served_with_and_without_an_image(tiny_flux_kontext_path, monkeypatch):
    pipe = load_pipeline(tiny_flux_kontext_path)
    monkeypatch.setattr("meshserve.models.load_pipeline", lambda *a, **kw: pipe)
    monkeypatch.setattr(pipe, "warm_up", lambda *a, **kw: 0.0)
    picture = still((220, 20, 20))
    base = {"model": MODEL, "prompt": PROMPT, "num_inference_steps": 2, "seed": SEED}
    base |= {"width": WIDTH, "height": HEIGHT}

    async def main():
        settings = make_settings(lease_s=60.0, pool_cache_s=0)
        pool = PoolConfig(
            name="kontext-0", models=[MODEL], devices="0", buckets=[(WIDTH, HEIGHT)], prompt_cache_mb=0
        )
        config = WorkerConfig(
            models={MODEL: ModelSpec(path=str(tiny_flux_kontext_path))}, pools=[pool], metrics_port=None
        )
        worker = Worker(config, settings)
        task = asyncio.create_task(worker.run())
        try:
            await asyncio.wait_for(worker.ready.wait(), 600)
            async with api_client(settings) as (client, _):
                card = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}[MODEL]
                r = await client.post(
                    "/v1/generate", json={**base, "image": data_url(picture), "strength": 0.5}
                )
                assert r.status_code == 422, r.text
                assert (r.json()["error"]["field"], r.json()["error"]["code"]) == (
                    "strength",
                    "not_supported",
                )
                jobs, outputs = [], []
                for body in ({**base, "image": data_url(picture)}, base):
                    r = await client.post("/v1/generate", json=body)
                    assert r.status_code == 202, r.text
                    job = await job_when_ended(client, r.json()["id"])
                    assert job["status"] == "succeeded", job
                    png = (await client.get(f"/v1/jobs/{job['id']}/outputs/0")).content
                    jobs.append(job)
                    outputs.append(np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(int))
                return card, jobs, outputs
        finally:
            worker.stop()
            await asyncio.wait_for(task, 120)
            cleanup(settings)

    card, jobs, (edited, plain) = asyncio.run(main())
    assert card["tasks"] == ["text-to-image", "image-to-image"], card
    assert card["limits"].get("strength") is None
    assert jobs[0]["params"].get("strength") is None

    def direct(**images):
        p = jobs[0]["params"]
        out = pipe(
            [PROMPT],
            negative_prompt=[None],
            guidance_scale=[p["guidance_scale"]],
            true_cfg_scale=[p["true_cfg_scale"]],
            seed=[SEED],
            height=HEIGHT,
            width=WIDTH,
            num_inference_steps=2,
            output_type="np",
            **{name: [image] for name, image in images.items()},
        )
        return to_uint8(out.images[0]).astype(int)

    err_edit = np.abs(edited - direct(image=picture)).max()
    err_plain = np.abs(plain - direct()).max()
    print(f"served vs direct: image-to-image {err_edit}, text-to-image {err_plain}")
    assert err_edit <= 1 and err_plain <= 1
    moved = float(np.mean(edited != plain))
    print(f"the image changed {moved:.0%} of the pixel values")  # the tiny random model attends it weakly
    assert moved > 0.1
