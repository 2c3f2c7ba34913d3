"""Image-to-video served end to end (issue 20): a worker pool on the tiny Wan 2.1 I2V folder (the session's
tiny_wan_i2v_path), the API in-process over ASGI, one Redis. /v1/models lists the model's one task,
image-to-video, without a strength; a request without an image, with a mask or with a strength is a 422
naming the field, nothing queued; POST /v1/generate with an `image` data URL runs and its MP4 decodes to the
pool's frame count and size, and is the video a direct pipeline call with the same image and seed gives (so
the image reached the model: another image gives another video). Then `meshserve generate --image in.png -o
clip.mp4` on the same pipeline writes the same video with the same denoise program.

One pool start, one compiled shape: the pool's warm-up is skipped (it would compile the CFG and no-CFG
programs with a black image, ~60 s on the 2-core machine, docs/wan.md), so the first job compiles its
image_encode and CFG denoise programs and every later call (the direct ones, the CLI's) reuses the denoise.
"""

from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
from PIL import Image, ImageDraw

from meshserve.models import load_pipeline
from meshserve.service.store import Store
from meshserve.workers.config import ModelSpec, PoolConfig, WorkerConfig
from meshserve.workers.encoding import encode_video
from meshserve.workers.main import Worker
from tests.service.conftest import api_client
from tests.workers.helpers import cleanup, job_when_ended, make_settings

MODEL = "tiny-wan-i2v"
PROMPT = "a red ball rolls across a blue floor"
FRAMES, STEPS, SEED = 5, 2, 3


def still(colour: tuple[int, int, int]) -> Image.Image:
    """A red disc on blue (or another colour), not the pool's size: the pipeline resizes it."""
    img = Image.new("RGB", (70, 50), (20, 40, 200))
    ImageDraw.Draw(img).ellipse((10, 5, 50, 45), fill=colour)
    return img


def data_url(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def frames_of(mp4: bytes) -> np.ndarray:
    """An MP4's frames, [F, H, W, 3] uint8."""
    import av

    with av.open(io.BytesIO(mp4)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def video_pool(model: str, folder) -> WorkerConfig:
    """One pool serving the video model in `folder` at FRAMES frames, no prompt cache, no metrics port."""
    return WorkerConfig(
        models={model: ModelSpec(path=str(folder))},
        pools=[
            PoolConfig(name=f"{model}-0", models=[model], devices="0", frames=[FRAMES], prompt_cache_mb=0)
        ],
        metrics_port=None,
    )


def served_jobs(model: str, folder, pipe, bodies: list[dict], monkeypatch, buckets=None):
    """A worker pool on `folder` serving `pipe` (its warm-up skipped) and the API: each body POSTed to
    /v1/generate in turn and waited for (it must succeed) -> (the model card, [job], [output bytes],
    [pipe.compilations after each job]). `buckets`: the pool's sizes ([(width, height)]; None: the default)."""
    monkeypatch.setattr("meshserve.models.load_pipeline", lambda *a, **kw: pipe)
    monkeypatch.setattr(pipe, "warm_up", lambda *a, **kw: 0.0)

    async def main():
        settings = make_settings(lease_s=60.0, pool_cache_s=0)
        config = video_pool(model, folder)
        if buckets is not None:
            config.pools[0] = config.pools[0].model_copy(update={"buckets": buckets})
        worker = Worker(config, settings)
        task = asyncio.create_task(worker.run())
        try:
            await asyncio.wait_for(worker.ready.wait(), 600)
            async with api_client(settings) as (client, _):
                card = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}[model]
                jobs, outputs, compiled = [], [], []
                for body in bodies:
                    r = await client.post("/v1/generate", json=body)
                    assert r.status_code == 202, r.text
                    job = await job_when_ended(client, r.json()["id"])
                    assert job["status"] == "succeeded", job
                    jobs.append(job)
                    outputs.append((await client.get(f"/v1/jobs/{job['id']}/outputs/0")).content)
                    compiled.append(pipe.compilations)
                return card, jobs, outputs, compiled
        finally:
            worker.stop()
            await asyncio.wait_for(task, 120)
            cleanup(settings)

    return asyncio.run(main())


def direct_video(pipe, params: dict, prompt: str, seed: int, **images) -> np.ndarray:
    """A served job's call made directly (the runner's arguments; `images`: one PIL image per argument), its
    frames through the same MP4 encoder: [F, H, W, 3] int."""
    video = pipe(
        [prompt],
        negative_prompt=[None],
        guidance_scale=[params["guidance_scale"]],
        seed=[seed],
        height=params["height"],
        width=params["width"],
        num_frames=params["num_frames"],
        num_inference_steps=params["num_inference_steps"],
        num_images_per_prompt=1,
        output_type="np",
        **{name: [image] for name, image in images.items()},
    ).images[0]
    return frames_of(encode_video(video, "mp4", fps=params["fps"])[0]).astype(int)


def test_image_to_video_served_end_to_end_and_by_the_cli(tiny_wan_i2v_path, tmp_path, monkeypatch):
    pipe = load_pipeline(tiny_wan_i2v_path)
    monkeypatch.setattr("meshserve.models.load_pipeline", lambda *a, **kw: pipe)
    monkeypatch.setattr(pipe, "warm_up", lambda *a, **kw: 0.0)
    height, width = pipe.defaults["height"], pipe.defaults["width"]

    async def main():
        settings = make_settings(lease_s=60.0, pool_cache_s=0)
        worker = Worker(video_pool(MODEL, tiny_wan_i2v_path), settings)
        task = asyncio.create_task(worker.run())
        store = Store(settings)
        try:
            await asyncio.wait_for(worker.ready.wait(), 600)
            async with api_client(settings) as (client, _):
                card = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}[MODEL]
                assert card["tasks"] == ["image-to-video"] and card["limits"]["strength"] is None, card

                base = {"model": MODEL, "prompt": PROMPT, "num_inference_steps": STEPS, "seed": SEED}
                image = data_url(still((220, 20, 20)))
                refused = [
                    (base, ("image", "missing")),
                    ({**base, "image": image, "mask": image}, ("mask", "task_not_supported")),
                    ({**base, "image": image, "strength": 0.5}, ("strength", "not_supported")),
                    # a first-last-frame model's field (tests/workers/test_flf2v_serving.py)
                    ({**base, "image": image, "last_image": image}, ("last_image", "not_supported")),
                ]
                for body, expected in refused:
                    r = await client.post("/v1/generate", json=body)
                    assert r.status_code == 422, r.text
                    error = r.json()["error"]
                    assert (error["field"], error["code"]) == expected, error
                assert [k async for k in store.redis.scan_iter(f"{store.prefix}:job:*")] == []

                r = await client.post("/v1/generate", json={**base, "image": image, "output_format": "mp4"})
                assert r.status_code == 202, r.text
                job = await job_when_ended(client, r.json()["id"])
                assert job["status"] == "succeeded", job
                p = job["params"]
                assert (p["num_frames"], p["width"], p["height"], p["strength"]) == (
                    FRAMES,
                    width,
                    height,
                    None,
                )
                out = await client.get(f"/v1/jobs/{job['id']}/outputs/0")
                assert out.status_code == 200 and out.headers["content-type"] == "video/mp4"
                return p, frames_of(out.content)
        finally:
            worker.stop()
            await asyncio.wait_for(task, 120)
            await store.close()
            cleanup(settings)

    p, served = asyncio.run(main())
    assert served.shape == (FRAMES, height, width, 3)

    same = direct_video(pipe, p, PROMPT, SEED, image=still((220, 20, 20)))
    other = direct_video(pipe, p, PROMPT, SEED, image=still((20, 220, 20)))
    err, moved = np.abs(served - same), np.abs(served - other)
    print(f"served vs direct: max {err.max()}, mean {err.mean():.3f}; another image: mean {moved.mean():.2f}")
    assert err.max() <= 2, err.max()
    assert moved.mean() > 4 * max(err.mean(), 0.25)

    # The CLI on the same pipeline: .mp4 from a PNG, the served video (its defaults are the pool's).
    from meshserve import cli

    still((220, 20, 20)).save(tmp_path / "in.png")
    args = ["generate", "--model", str(tiny_wan_i2v_path), "--prompt", PROMPT, "--image"]
    args += [
        str(tmp_path / "in.png"),
        "--seed",
        str(SEED),
        "--steps",
        str(STEPS),
        "-o",
        str(tmp_path / "c.mp4"),
    ]
    assert cli.main(args) == 0
    written = frames_of((tmp_path / "c.mp4").read_bytes())
    assert written.shape == (FRAMES, height, width, 3)
    assert np.abs(written.astype(int) - same).max() <= 2
    # One denoise program served all of it: the job's, shared by the direct calls and the CLI (the decode
    # has a uint8 variant for the pool and a float one for the others).
    assert pipe.programs.by_stage["denoise"] == 1, pipe.programs.by_stage
