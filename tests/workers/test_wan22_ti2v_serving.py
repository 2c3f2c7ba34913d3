"""Wan 2.2's TI2V-5B layout served end to end: a worker pool on a tiny TI2V folder diffusers wrote, the API
in-process over ASGI, one Redis. The card lists both tasks and 24 fps; a job without an image (text-to-video)
and one with `image` (image-to-video) both run, each MP4 the video a direct pipeline call with the same inputs
and seed gives, at 24 fps. The pool's warm-up is skipped, as in tests/workers/test_i2v_serving.py."""

from __future__ import annotations

import asyncio
import io

import numpy as np

from meshserve.models import load_pipeline
from meshserve.workers.main import Worker
from tests.service.conftest import api_client
from tests.workers.helpers import cleanup, job_when_ended, make_settings
from tests.workers.test_i2v_serving import PROMPT, STEPS, data_url, direct_video, frames_of, still, video_pool

MODEL = "tiny-wan22-ti2v"
SEED = 6


def test_text_and_image_to_video_from_one_folder(tiny_wan_path, tmp_path_factory, monkeypatch):
    import av

    from tests.fixtures.tiny_wan import build_tiny_wan22_ti2v

    folder = build_tiny_wan22_ti2v(tmp_path_factory.mktemp("wan22_ti2v"), tiny_wan_path)
    pipe = load_pipeline(folder)
    monkeypatch.setattr("meshserve.models.load_pipeline", lambda *a, **kw: pipe)
    monkeypatch.setattr(pipe, "warm_up", lambda *a, **kw: 0.0)
    first = still((220, 20, 20))

    async def main():
        settings = make_settings(lease_s=60.0, pool_cache_s=0)
        config = video_pool(MODEL, folder)
        # 96 x 64: the tiny folder's default video (diffusers' 832 x 480, 81 frames) would take minutes here
        config.pools[0] = config.pools[0].model_copy(update={"buckets": [(96, 64)]})
        worker = Worker(config, settings)
        task = asyncio.create_task(worker.run())
        try:
            await asyncio.wait_for(worker.ready.wait(), 600)
            async with api_client(settings) as (client, _):
                card = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}[MODEL]
                assert card["tasks"] == ["text-to-video", "image-to-video"], card
                assert card["defaults"]["fps"] == 24
                base = {"model": MODEL, "prompt": PROMPT, "num_inference_steps": STEPS, "seed": SEED}
                base |= {"height": 64, "width": 96, "output_format": "mp4"}
                served, rates = [], []
                for body in (base, {**base, "image": data_url(first)}):
                    r = await client.post("/v1/generate", json=body)
                    assert r.status_code == 202, r.text
                    job = await job_when_ended(client, r.json()["id"])
                    assert job["status"] == "succeeded", job
                    mp4 = (await client.get(f"/v1/jobs/{job['id']}/outputs/0")).content
                    with av.open(io.BytesIO(mp4)) as container:
                        rates.append(container.streams.video[0].average_rate)
                    served.append(frames_of(mp4).astype(int))
                return job["params"], served, rates
        finally:
            worker.stop()
            await asyncio.wait_for(task, 120)
            cleanup(settings)

    p, (text_only, from_image), rates = asyncio.run(main())
    assert rates == [24, 24]
    err_text = np.abs(text_only - direct_video(pipe, p, PROMPT, SEED)).max()
    err_image = np.abs(from_image - direct_video(pipe, p, PROMPT, SEED, image=first)).max()
    print(f"served vs direct: text-to-video {err_text}, image-to-video {err_image}")
    assert err_text <= 2 and err_image <= 2
    assert np.abs(from_image - text_only).mean() > 1.0
