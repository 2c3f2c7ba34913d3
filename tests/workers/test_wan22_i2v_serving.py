"""Wan 2.2's two-expert image-to-video served with and without a last frame: a worker pool on a tiny I2V-A14B
folder diffusers wrote, the API in-process over ASGI, one Redis. The card says `limits.last_image` and
`last_image_optional`; a job with `image` alone and one with `image` and `last_image` both run, the second
compiling nothing (one image_encode program serves both: models/wan/pipeline_i2v.py), and each MP4 is the
video a direct pipeline call with the same images and seed gives. The pool's warm-up is skipped, as in
tests/workers/test_i2v_serving.py (the first job compiles)."""

from __future__ import annotations

import asyncio

import numpy as np

from meshserve.models import load_pipeline
from meshserve.workers.main import Worker
from tests.service.conftest import api_client
from tests.workers.helpers import cleanup, job_when_ended, make_settings
from tests.workers.test_i2v_serving import (
    PROMPT,
    STEPS,
    data_url,
    direct_video,
    frames_of,
    still,
    video_pool,
)

MODEL = "tiny-wan22-i2v"
SEED = 5


def test_a_last_frame_is_optional_and_compiles_nothing(tiny_wan_path, tmp_path_factory, monkeypatch):
    from tests.fixtures.tiny_wan_i2v import build_tiny_wan22_i2v

    folder = build_tiny_wan22_i2v(tmp_path_factory.mktemp("wan22_i2v"), tiny_wan_path)
    pipe = load_pipeline(folder)
    monkeypatch.setattr("meshserve.models.load_pipeline", lambda *a, **kw: pipe)
    monkeypatch.setattr(pipe, "warm_up", lambda *a, **kw: 0.0)
    first, last = still((220, 20, 20)), still((240, 240, 20))

    async def main():
        settings = make_settings(lease_s=60.0, pool_cache_s=0)
        worker = Worker(video_pool(MODEL, folder), settings)
        task = asyncio.create_task(worker.run())
        try:
            await asyncio.wait_for(worker.ready.wait(), 600)
            async with api_client(settings) as (client, _):
                card = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}[MODEL]
                assert card["limits"]["last_image"] is card["limits"]["last_image_optional"] is True, card
                base = {"model": MODEL, "prompt": PROMPT, "num_inference_steps": STEPS, "seed": SEED}
                base |= {"image": data_url(first), "output_format": "mp4"}
                served, compiled = [], []
                for body in (base, {**base, "last_image": data_url(last)}):
                    r = await client.post("/v1/generate", json=body)
                    assert r.status_code == 202, r.text
                    job = await job_when_ended(client, r.json()["id"])
                    assert job["status"] == "succeeded", job
                    out = await client.get(f"/v1/jobs/{job['id']}/outputs/0")
                    served.append(frames_of(out.content).astype(int))
                    compiled.append(pipe.compilations)
                return job["params"], served, compiled
        finally:
            worker.stop()
            await asyncio.wait_for(task, 120)
            cleanup(settings)

    p, (alone, with_last), compiled = asyncio.run(main())
    assert compiled[1] == compiled[0], compiled  # the job with a last frame ran the first job's programs
    err_alone = np.abs(alone - direct_video(pipe, p, PROMPT, SEED, image=first)).max()
    err_last = np.abs(with_last - direct_video(pipe, p, PROMPT, SEED, image=first, last_image=last)).max()
    moved = np.abs(with_last - alone).mean()
    print(
        f"served vs direct: {err_alone} alone, {err_last} with a last frame; the last frame moved {moved:.2f}"
    )
    assert err_alone <= 2 and err_last <= 2
    assert moved > 1.0
