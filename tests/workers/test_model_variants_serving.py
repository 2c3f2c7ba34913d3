"""FLUX.1 Kontext, Fill and Canny/Depth and SDXL with a ControlNet served end to end: a worker pool on a tiny
folder of each (diffusers' FluxKontextPipeline, FluxFillPipeline, FluxControlPipeline and
StableDiffusionXLControlNetPipeline layouts), the API in-process over ASGI, one Redis. Each card lists the
model's tasks and strength rule; a request the model does not take is a 422 naming the field, nothing queued;
each job's PNG is the image a direct pipeline call with the same inputs and seed gives. The pools' warm-up is
skipped (as in tests/workers/test_i2v_serving.py): the first jobs compile their programs."""

from __future__ import annotations

import asyncio
import io

import numpy as np
from PIL import Image, ImageDraw

from meshserve.models import load_pipeline
from meshserve.workers.config import ModelSpec, PoolConfig, WorkerConfig
from meshserve.workers.encoding import to_uint8
from meshserve.workers.main import Worker
from tests.service.conftest import api_client
from tests.workers.helpers import cleanup, job_when_ended, make_settings
from tests.workers.test_i2v_serving import data_url, still

WIDTH, HEIGHT, SEED, STEPS = 48, 32, 5, 2


def served(model: str, pipe, folder, bodies: list[dict], refused: list[tuple[dict, str, str]], monkeypatch):
    """A pool serving `pipe` as `model` at WIDTH x HEIGHT: each of `refused` (body, field, code) must be a 422
    with that field and code, each of `bodies` must succeed -> (the card, [job], [output pixels [H, W, 3]])."""
    monkeypatch.setattr("meshserve.models.load_pipeline", lambda *a, **kw: pipe)
    monkeypatch.setattr(pipe, "warm_up", lambda *a, **kw: 0.0)
    base = {"model": model, "num_inference_steps": STEPS, "seed": SEED, "width": WIDTH, "height": HEIGHT}

    async def main():
        settings = make_settings(lease_s=60.0, pool_cache_s=0)
        pool = PoolConfig(
            name=f"{model}-0", models=[model], devices="0", buckets=[(WIDTH, HEIGHT)], prompt_cache_mb=0
        )
        config = WorkerConfig(models={model: ModelSpec(path=str(folder))}, pools=[pool], metrics_port=None)
        worker = Worker(config, settings)
        task = asyncio.create_task(worker.run())
        try:
            await asyncio.wait_for(worker.ready.wait(), 600)
            async with api_client(settings) as (client, _):
                card = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}[model]
                for body, field, code in refused:
                    r = await client.post("/v1/generate", json={**base, **body})
                    assert r.status_code == 422, r.text
                    assert (r.json()["error"]["field"], r.json()["error"]["code"]) == (field, code)
                jobs, outputs = [], []
                for body in bodies:
                    r = await client.post("/v1/generate", json={**base, **body})
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

    return asyncio.run(main())


def direct(pipe, job: dict, **images) -> np.ndarray:
    """A served job's call made directly (the runner's arguments), as 8-bit pixels."""
    p = job["params"]
    own = (
        "true_cfg_scale",
        "controlnet_conditioning_scale",
        "control_guidance_start",
        "control_guidance_end",
        "guess_mode",
    )
    rows = {name: [p[name]] for name in own if name in pipe.row_fields}
    out = pipe(
        [p["prompt"]],
        negative_prompt=[None],
        guidance_scale=[p["guidance_scale"]],
        **rows,
        seed=[SEED],
        height=HEIGHT,
        width=WIDTH,
        num_inference_steps=STEPS,
        output_type="np",
        **({"strength": p["strength"]} if p.get("strength") is not None else {}),
        **{name: [image] for name, image in images.items()},
    )
    return to_uint8(out.images[0]).astype(int)


def test_kontext_served_with_and_without_an_image(tiny_flux_kontext_path, monkeypatch):
    pipe = load_pipeline(tiny_flux_kontext_path)
    picture = still((220, 20, 20))
    edit = {"prompt": "make the ball green", "image": data_url(picture)}
    card, jobs, (edited, plain) = served(
        "tiny-kontext",
        pipe,
        tiny_flux_kontext_path,
        [edit, {"prompt": "make the ball green"}],
        [({**edit, "strength": 0.5}, "strength", "not_supported")],
        monkeypatch,
    )
    assert card["tasks"] == ["text-to-image", "image-to-image"], card
    assert card["limits"].get("strength") is None
    assert jobs[0]["params"].get("strength") is None
    err_edit = np.abs(edited - direct(pipe, jobs[0], image=picture)).max()
    err_plain = np.abs(plain - direct(pipe, jobs[1])).max()
    print(f"served vs direct: image-to-image {err_edit}, text-to-image {err_plain}")
    assert err_edit <= 1 and err_plain <= 1
    moved = float(np.mean(edited != plain))
    print(f"the image changed {moved:.0%} of the pixel values")  # the tiny random model attends it weakly
    assert moved > 0.1


def test_fill_served_with_an_image_and_a_mask(tiny_flux_fill_path, monkeypatch):
    pipe = load_pipeline(tiny_flux_fill_path)
    picture = still((220, 20, 20))
    mask = Image.new("L", picture.size, 0)
    ImageDraw.Draw(mask).rectangle((0, 0, 34, 49), fill=255)  # the left half: repaint
    fill = {"prompt": "a green ball", "image": data_url(picture), "mask": data_url(mask)}
    card, jobs, (filled, half) = served(
        "tiny-fill",
        pipe,
        tiny_flux_fill_path,
        [fill, {**fill, "strength": 0.5}],
        [({"prompt": "a green ball"}, "image", "missing"), ({**fill, "mask": None}, "mask", "missing")],
        monkeypatch,
    )
    assert card["tasks"] == ["inpaint"], card
    assert card["limits"]["strength"]["defaults"] == {"inpaint": 1.0}
    assert card["defaults"]["guidance_scale"] == 30.0
    assert [j["params"]["strength"] for j in jobs] == [1.0, 0.5]
    err = np.abs(filled - direct(pipe, jobs[0], image=picture, mask_image=mask)).max()
    err_half = np.abs(half - direct(pipe, jobs[1], image=picture, mask_image=mask)).max()
    print(f"served vs direct: strength 1.0 {err}, 0.5 {err_half}")
    assert err <= 1 and err_half <= 1
    assert np.abs(filled - half).mean() > 1.0


def test_control_served_with_its_control_image(tiny_flux_control_path, monkeypatch):
    pipe = load_pipeline(tiny_flux_control_path)
    edges = Image.new("RGB", (70, 50), (0, 0, 0))
    ImageDraw.Draw(edges).rectangle((10, 8, 50, 40), outline=(255, 255, 255), width=2)
    other = edges.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    body = {"prompt": "a window", "control_image": data_url(edges)}
    picture = still((220, 20, 20))
    mask = Image.new("L", picture.size, 0)
    ImageDraw.Draw(mask).rectangle((0, 0, 34, 49), fill=255)  # the left half: repaint
    inpaint = {**body, "image": data_url(picture), "mask": data_url(mask), "strength": 0.8}
    card, jobs, (steered, flipped, repainted) = served(
        "tiny-control",
        pipe,
        tiny_flux_control_path,
        [body, {**body, "control_image": data_url(other)}, inpaint],
        [
            ({"prompt": "a window"}, "control_image", "missing"),
            ({"prompt": "a window", "image": data_url(edges)}, "control_image", "missing"),
        ],
        monkeypatch,
    )
    assert card["tasks"] == ["text-to-image", "image-to-image", "inpaint"], card
    assert card["limits"]["control_image"] is True
    assert jobs[0]["params"]["control_image"] is not None and jobs[0]["params"]["image"] is None
    err = np.abs(steered - direct(pipe, jobs[0], control_image=edges)).max()
    err_other = np.abs(flipped - direct(pipe, jobs[1], control_image=other)).max()
    err_inpaint = np.abs(
        repainted - direct(pipe, jobs[2], image=picture, mask_image=mask, control_image=edges)
    ).max()
    print(f"served vs direct: {err}, {err_other}, inpaint {err_inpaint}")
    assert err <= 1 and err_other <= 1 and err_inpaint <= 1
    assert np.abs(steered - flipped).mean() > 0.5


def test_sdxl_controlnet_served_with_its_control_image(tiny_sdxl_controlnet_path, monkeypatch):
    pipe = load_pipeline(tiny_sdxl_controlnet_path)
    edges = Image.new("RGB", (70, 50), (0, 0, 0))
    ImageDraw.Draw(edges).ellipse((10, 8, 50, 40), outline=(255, 255, 255), width=2)
    body = {"prompt": "a ring", "control_image": data_url(edges), "guidance_scale": 5.0}
    picture = still((220, 20, 20))
    from_picture = {**body, "image": data_url(picture), "strength": 0.6}
    card, jobs, (steered, weaker, redrawn) = served(
        "tiny-sdxl-controlnet",
        pipe,
        tiny_sdxl_controlnet_path,
        [
            body,
            {**body, "controlnet_conditioning_scale": 0.3, "control_guidance_end": 0.5, "guess_mode": True},
            from_picture,
        ],
        [
            ({"prompt": "a ring"}, "control_image", "missing"),
            ({"prompt": "a ring", "image": data_url(picture)}, "control_image", "missing"),
            (
                {**body, "control_guidance_start": 0.5, "control_guidance_end": 0.5},
                "control_guidance_end",
                "out_of_range",
            ),
            ({**body, "cache": {"method": "teacache"}}, "cache", "not_supported"),
        ],
        monkeypatch,
    )
    assert card["tasks"] == ["text-to-image", "image-to-image", "inpaint"], card
    assert card["limits"]["control_image"] is True
    assert card["limits"]["strength"]["defaults"]["image-to-image"] == 0.8
    assert card["defaults"]["controlnet_conditioning_scale"] == 1.0
    assert (card["defaults"]["control_guidance_start"], card["defaults"]["control_guidance_end"]) == (
        0.0,
        1.0,
    )
    assert card["defaults"]["guess_mode"] is False
    assert [j["params"]["controlnet_conditioning_scale"] for j in jobs] == [1.0, 0.3, 1.0]
    assert [(j["params"]["control_guidance_end"], j["params"]["guess_mode"]) for j in jobs] == [
        (1.0, False),
        (0.5, True),
        (1.0, False),
    ]
    err = np.abs(steered - direct(pipe, jobs[0], control_image=edges)).max()
    err_weaker = np.abs(weaker - direct(pipe, jobs[1], control_image=edges)).max()
    print(f"served vs direct: {err}, scale 0.3, the first half of the steps, guess mode: {err_weaker}")
    err_redrawn = np.abs(redrawn - direct(pipe, jobs[2], image=picture, control_image=edges)).max()
    print(f"image-to-image with the control image, strength 0.6: {err_redrawn}")
    assert err <= 1 and err_weaker <= 1 and err_redrawn <= 1
    assert np.abs(steered - weaker).mean() > 0.5 and np.abs(steered - redrawn).mean() > 0.5
