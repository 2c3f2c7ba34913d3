"""Image inputs served end to end: the API (in-process, over ASGI) and a worker pool running the embedded tiny
SDXL (the session's `embedded_sdxl`, so its compiled programs are shared with the other tests of the process),
on one Redis. An image-to-image and an inpainting request each give what a direct pipeline call with the
same image, mask, strength and seed gives; an image for a model without that task is a 422; a job whose stored
input is gone fails with the reason; jobs of different tasks or strengths never share a batch."""

from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
from PIL import Image, ImageDraw

from meshserve.service.contract import JobParams, JobStatus
from meshserve.service.input_store import InputStore
from meshserve.service.store import Store
from meshserve.workers.config import ModelSpec, PoolConfig, WorkerConfig
from meshserve.workers.encoding import to_uint8
from meshserve.workers.main import Worker
from tests.service.conftest import api_client
from tests.workers.helpers import cleanup, job_when_ended, make_settings, wait_ended

PROMPT = "a yellow triangle on a purple background"


def picture() -> tuple[Image.Image, Image.Image]:
    """A red circle on blue, and a mask repainting its left half."""
    img = Image.new("RGB", (64, 64), (20, 40, 200))
    ImageDraw.Draw(img).ellipse((16, 16, 48, 48), fill=(220, 20, 20))
    mask = Image.new("L", (64, 64), 0)
    ImageDraw.Draw(mask).rectangle((0, 0, 31, 63), fill=255)
    return img, mask


def wide_picture() -> tuple[Image.Image, Image.Image]:
    """A 96x80 picture (not the model's 64x64) and a mask of a small region of it."""
    img = Image.new("RGB", (96, 80), (30, 160, 60))
    ImageDraw.Draw(img).rectangle((50, 20, 80, 60), fill=(240, 220, 20))
    mask = Image.new("L", (96, 80), 0)
    ImageDraw.Draw(mask).rectangle((56, 30, 74, 50), fill=255)
    return img, mask


def data_url(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_img2img_and_inpaint_served_end_to_end(embedded_sdxl, monkeypatch):
    monkeypatch.setattr("meshserve.models.load_pipeline", lambda *a, **kw: embedded_sdxl)
    # The pool's warm-up compiles text-to-image programs no job here runs (~25 s each on the loaded 2-core
    # machine); the image tasks compile on their first job (one denoise program each).
    monkeypatch.setattr(embedded_sdxl, "warm_up", lambda *a, **kw: 0.0)

    async def main():
        settings = make_settings(lease_s=60.0, pool_cache_s=0)
        config = WorkerConfig(
            models={"tiny-sdxl": ModelSpec(path=None), "toy": ModelSpec(runner="fake")},
            pools=[
                PoolConfig(name="sdxl-0", models=["tiny-sdxl"], devices="0", prompt_cache_mb=0),
                PoolConfig(name="fake-0", models=["toy"], devices="1"),
            ],
            metrics_port=None,
        )
        worker = Worker(config, settings)
        task = asyncio.create_task(worker.run())
        store = Store(settings)
        try:
            await asyncio.wait_for(worker.ready.wait(), 600)
            runner = worker.pools[0].runners["tiny-sdxl"]
            pipe = runner.pipe
            async with api_client(settings) as (client, _):
                cards = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}
                assert cards["tiny-sdxl"]["tasks"] == ["text-to-image", "image-to-image", "inpaint"]
                assert cards["tiny-sdxl"]["limits"]["strength"]["rule"] == "int"
                assert cards["tiny-sdxl"]["limits"]["strength"]["defaults"] == {
                    "image-to-image": 0.3,
                    "inpaint": 0.9999,
                }
                assert cards["toy"]["tasks"] == ["text-to-image"]
                img, mask = picture()
                base = {
                    "model": "tiny-sdxl",
                    "prompt": PROMPT,
                    "image": data_url(img),
                    "seed": 3,
                    "num_inference_steps": 4,
                }

                # An image for a model without the task, a mask for it: 422s, nothing queued.
                for body, field in (
                    ({**base, "model": "toy"}, "image"),
                    ({**base, "model": "toy", "mask": data_url(mask)}, "mask"),
                ):
                    r = await client.post("/v1/generate", json=body)
                    assert r.status_code == 422, r.text
                    assert (r.json()["error"]["field"], r.json()["error"]["code"]) == (
                        field,
                        "task_not_supported",
                    )

                i2i = await client.post("/v1/generate", json={**base, "strength": 0.6})
                inpaint = await client.post("/v1/generate", json={**base, "mask": data_url(mask)})
                # Only the masked region, inpainted at the model's 64x64 and laid back: a 96x80 output.
                big, big_mask = wide_picture()
                cropped = {**base, "image": data_url(big), "mask": data_url(big_mask), "padding_mask_crop": 4}
                crop = await client.post("/v1/generate", json=cropped)
                assert i2i.status_code == inpaint.status_code == crop.status_code == 202, (
                    i2i.text,
                    crop.text,
                )
                jobs = [await job_when_ended(client, r.json()["id"]) for r in (i2i, inpaint, crop)]
                assert [j["status"] for j in jobs] == ["succeeded"] * 3, jobs
                assert jobs[2]["params"]["padding_mask_crop"] == 4
                assert (jobs[2]["outputs"][0]["width"], jobs[2]["outputs"][0]["height"]) == (96, 80)
                outputs = []
                for job in jobs:
                    r = await client.get(f"/v1/jobs/{job['id']}/outputs/0")
                    outputs.append(np.asarray(Image.open(io.BytesIO(r.content)).convert("RGB")))
                p = jobs[0]["params"]
                assert (p["strength"], jobs[1]["params"]["strength"]) == (0.6, 0.9999)

            def direct(**kw):
                out = pipe(
                    [PROMPT],
                    negative_prompt=[None],
                    height=p["height"],
                    width=p["width"],
                    num_inference_steps=p["num_inference_steps"],
                    guidance_scale=[p["guidance_scale"]],
                    seed=[3],
                    num_images_per_prompt=1,
                    output_type="np",
                    **{"image": [img], **kw},
                )
                return to_uint8(out.images[0]).astype(int)

            ref_i2i = await asyncio.to_thread(direct, strength=0.6)
            ref_inpaint = await asyncio.to_thread(direct, mask_image=[mask], strength=0.9999)
            ref_crop = await asyncio.to_thread(
                direct, image=[big], mask_image=[big_mask], strength=0.9999, padding_mask_crop=4
            )
            assert outputs[2].shape == ref_crop.shape == (80, 96, 3)
            pairs = ((outputs[0], ref_i2i, "img2img"), (outputs[1], ref_inpaint, "inpaint"))
            for got, ref, name in (*pairs, (outputs[2], ref_crop, "padding_mask_crop")):
                diff = np.abs(got.astype(int) - ref).max()
                assert diff <= 1, f"{name}: served vs direct max |diff| {diff}"
            # The inputs reached the model: another strength, and no mask, give other pictures; inpainting
            # kept the unmasked (right) half nearer the input than the repainted left.
            assert np.abs(outputs[0] - await asyncio.to_thread(direct, strength=0.9)).max() > 1
            assert np.abs(outputs[1] - ref_i2i).max() > 1
            source = np.asarray(img).astype(int)
            kept, repainted = (np.abs(outputs[1] - source)[:, sl].mean() for sl in (np.s_[40:], np.s_[:24]))
            assert kept < repainted, (kept, repainted)

            # A job whose input is gone (expired while queued) fails with the reason, it is not lost.
            gone = JobParams(
                model="tiny-sdxl",
                prompt=PROMPT,
                width=p["width"],
                height=p["height"],
                num_inference_steps=2,
                guidance_scale=2.0,
                seed=1,
                image="redis:" + "A" * 22,
                strength=0.5,
            )
            job = await store.submit(gone)
            ended = (await wait_ended(store, [job.id], timeout=120))[job.id]
            assert ended.status == JobStatus.FAILED and "expired" in ended.error.message, ended.error

            # Batching: jobs share a call only with one task and one strength.
            def key(**kw):
                return runner.batch_key(gone.model_copy(update=kw))

            assert key(strength=0.5) == key(strength=0.5)
            assert key(strength=0.5) != key(strength=0.6)
            assert len({key(image=None, strength=None), key(), key(mask="redis:" + "B" * 22)}) == 3
            # padding_mask_crop's outputs have their image's size: only jobs of one stored image share a call.
            masked = {"mask": "redis:" + "B" * 22, "padding_mask_crop": 4}
            assert key(**masked) == key(**masked) != key(**masked, image="redis:" + "C" * 22)
            assert key(**masked) != key(**{**masked, "padding_mask_crop": 5})
            assert await InputStore.of(store).get(gone.image) is None
        finally:
            worker.stop()
            await asyncio.wait_for(task, 120)
            await store.close()
            cleanup(settings)

    asyncio.run(main())


def test_a_multihost_batch_message_carries_the_image_inputs():
    """Followers of a multi-host pool make the leader's call: the inputs the leader read go in the message."""
    from meshserve.workers.multihost import requests_of, run_message
    from meshserve.workers.runner import RunRequest
    from tests.workers.helpers import params

    img, mask = picture()
    job = params("a cat", model="tiny-sdxl", size=64).model_copy(
        update={"image": "redis:" + "A" * 22, "mask": "redis:" + "B" * 22, "strength": 0.7}
    )
    batch = [RunRequest("j1", job, image=img, mask=mask), RunRequest("j2", job, missing="gone")]
    (first, second) = requests_of(run_message(batch, "tiny-sdxl"))
    assert first.params == job and first.image.mode == "RGB" and first.mask.mode == "L"
    assert np.array_equal(np.asarray(first.image), np.asarray(img))
    assert np.array_equal(np.asarray(first.mask), np.asarray(mask))
    assert (second.image, second.missing) == (None, "gone")
