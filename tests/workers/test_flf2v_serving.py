"""First-last-frame-to-video served end to end: a worker pool on the tiny Wan 2.1 FLF2V folder (the I2V folder
with a transformer that has pos_embed_seq_len), the API in-process over ASGI, one Redis. The card says
`limits.last_image`; a request without `last_image` is a 422 naming it, nothing queued; POST /v1/generate with
`image` and `last_image` data URLs runs, and its MP4 is the video a direct pipeline call with the same two
images and seed gives (another last frame gives another video). The pool's warm-up is skipped, as in
tests/workers/test_i2v_serving.py (one compiled shape, the first job's)."""

from __future__ import annotations

import asyncio

import numpy as np

from meshserve.models import load_pipeline
from meshserve.service.store import Store
from meshserve.workers.main import Worker
from tests.service.conftest import api_client
from tests.workers.helpers import cleanup, job_when_ended, make_settings
from tests.workers.test_i2v_serving import (
    FRAMES,
    PROMPT,
    STEPS,
    data_url,
    direct_video,
    frames_of,
    still,
    video_pool,
)

MODEL = "tiny-wan-flf2v"
SEED = 4


def test_first_last_frame_video_served_end_to_end(tiny_wan_flf2v_path, monkeypatch):
    pipe = load_pipeline(tiny_wan_flf2v_path)
    monkeypatch.setattr("meshserve.models.load_pipeline", lambda *a, **kw: pipe)
    monkeypatch.setattr(pipe, "warm_up", lambda *a, **kw: 0.0)
    height, width = pipe.defaults["height"], pipe.defaults["width"]
    first, last = still((220, 20, 20)), still((240, 240, 20))

    async def main():
        settings = make_settings(lease_s=60.0, pool_cache_s=0)
        worker = Worker(video_pool(MODEL, tiny_wan_flf2v_path), settings)
        task = asyncio.create_task(worker.run())
        store = Store(settings)
        try:
            await asyncio.wait_for(worker.ready.wait(), 600)
            async with api_client(settings) as (client, _):
                card = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}[MODEL]
                assert card["limits"]["last_image"] is True, card
                base = {"model": MODEL, "prompt": PROMPT, "num_inference_steps": STEPS, "seed": SEED}
                r = await client.post("/v1/generate", json={**base, "image": data_url(first)})
                assert r.status_code == 422, r.text
                assert (r.json()["error"]["field"], r.json()["error"]["code"]) == ("last_image", "missing")
                assert [k async for k in store.redis.scan_iter(f"{store.prefix}:job:*")] == []
                body = {
                    **base,
                    "image": data_url(first),
                    "last_image": data_url(last),
                    "output_format": "mp4",
                }
                r = await client.post("/v1/generate", json=body)
                assert r.status_code == 202, r.text
                job = await job_when_ended(client, r.json()["id"])
                assert job["status"] == "succeeded", job
                out = await client.get(f"/v1/jobs/{job['id']}/outputs/0")
                assert out.status_code == 200 and out.headers["content-type"] == "video/mp4"
                return job["params"], frames_of(out.content)
        finally:
            worker.stop()
            await asyncio.wait_for(task, 120)
            await store.close()
            cleanup(settings)

    p, served = asyncio.run(main())
    assert served.shape == (FRAMES, height, width, 3)

    same = direct_video(pipe, p, PROMPT, SEED, image=first, last_image=last)
    other = direct_video(pipe, p, PROMPT, SEED, image=first, last_image=still((20, 220, 20)))
    err, moved = np.abs(served - same), np.abs(served - other)
    print(
        f"served vs direct: max {err.max()}, mean {err.mean():.3f}; another last frame: mean {moved.mean():.2f}"
    )
    assert err.max() <= 2, err.max()
    assert moved.mean() > 4 * max(err.mean(), 0.25)
