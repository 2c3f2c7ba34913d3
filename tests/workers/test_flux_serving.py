"""Flux served end to end (issue 9, "Served"): a worker pool on the random tiny dev-type Flux (guidance
embedding; models/flux/random_tiny.py) beside one on the tiny SDXL, driven over HTTP (the app over ASGI, the
real Redis): /v1/models shows the Flux card, a job with and without true CFG returns PNGs equal to the
pipeline called directly with the same seed, a batch may mix true-CFG and plain jobs, the SDXL model refuses
`true_cfg_scale` with a 422; `meshserve serve --model tiny-flux` serves the trained tiny Flux from a fresh
process."""

from __future__ import annotations

import asyncio
import io
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import yaml
from PIL import Image
from prometheus_client import REGISTRY

from meshserve.models.flux.random_tiny import random_flux_path
from meshserve.service.app import create_app
from meshserve.service.contract import JobParams
from meshserve.service.store import Store
from meshserve.workers.config import WorkerConfig, single_model_config
from meshserve.workers.encoding import to_uint8
from meshserve.workers.main import Worker
from meshserve.workers.runner import PipelineRunner, RunRequest
from tests.private_redis import free_port
from tests.workers.helpers import ROOT, cleanup, make_settings

STEPS = 2  # the tiny models' images are noise-like whatever the count; 2 steps exercise the loop


def png(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def direct(pipe, p: JobParams, seed: int) -> np.ndarray:
    """The pipeline called directly for one row of a job, as uint8 (what the PNG holds)."""
    out = pipe(
        [p.prompt],
        negative_prompt=[p.negative_prompt],
        height=p.height,
        width=p.width,
        num_inference_steps=p.num_inference_steps,
        guidance_scale=[p.guidance_scale],
        true_cfg_scale=[p.true_cfg_scale],
        seed=[seed],
        num_images_per_prompt=1,
        output_type="np",
    )
    return to_uint8(out.images[0])


def max_diff(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(a.astype(int) - b.astype(int)).max())


def test_single_model_config_takes_the_embedded_flux_names():
    for name in ("tiny-flux", "embedded:tiny-flux"):
        cfg = single_model_config(name)
        assert list(cfg.models) == ["tiny-flux"] and cfg.models["tiny-flux"].path == name
        assert cfg.pools[0].name == "tiny-flux-0" and cfg.pools[0].models == ["tiny-flux"]


def test_readme_flux_pools_example_is_a_valid_config():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("### Flux") : readme.index("### Deploy")]
    example = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    cfg = WorkerConfig.model_validate(yaml.safe_load(example))
    assert [m.dtype for m in cfg.models.values()] == ["bfloat16", "bfloat16"]
    assert all(p.weights.shard_over == ["context"] for p in cfg.pools)


def test_flux_cards_dev_and_schnell(tiny_flux_dev_path, tiny_flux_schnell_path):
    """What a pool publishes for each kind of Flux folder (load only, nothing compiles): dev 28 steps with its
    guidance 3.5, schnell 4 steps and guidance 0; both take true_cfg_scale (1.0, off)."""
    expected = {tiny_flux_dev_path: (28, 3.5), tiny_flux_schnell_path: (4, 0.0)}
    for path, (steps, guidance) in expected.items():
        runner = PipelineRunner("m", str(path), "float32", None, None)
        runner.load()
        info = runner.info()
        assert info.family == "flux"
        assert info.defaults.model_dump() == {
            "width": 256,  # diffusers: 128 latents x the VAE factor 2
            "height": 256,
            "num_inference_steps": steps,
            "guidance_scale": guidance,
            "true_cfg_scale": 1.0,
        }
        assert info.limits.size_multiple == 4 and info.limits.schedulers == ["flow_match_euler"]


def test_flux_pool_over_http_true_cfg_and_sdxl_refusal():
    cfg = WorkerConfig.model_validate(
        {
            # The random dev-type folder (the trained tiny-flux has no guidance embedding), served as "tiny-flux".
            "models": {
                "tiny-flux": {"path": str(random_flux_path())},
                "tiny-sdxl": {"path": "embedded:tiny-sdxl"},
            },
            "pools": [
                # max_batch 2 with a wait: the plain and the true-CFG job below may share one batch (one
                # true-CFG program, the plain row selected per row); both batch sizes are warmed up.
                {
                    "name": "flux",
                    "devices": "0",
                    "models": ["tiny-flux"],
                    "max_batch": 2,
                    "batch_wait_ms": 300,
                    "warm_up_batch_sizes": [1, 2],
                    # Its size (diffusers' Flux default would be 128 latents x 2 = 256): the card's default too.
                    "buckets": [[64, 64]],
                },
                {"name": "sdxl", "devices": "1", "models": ["tiny-sdxl"], "max_batch": 1, "batch_wait_ms": 0},
            ],
            "metrics_port": None,
        }
    )

    async def main():
        settings = make_settings(lease_s=60.0)
        store = Store(settings)
        worker = Worker(cfg, settings)
        task = asyncio.create_task(worker.run())
        app = create_app(settings, store)
        try:
            ready = asyncio.create_task(worker.ready.wait())
            done, _ = await asyncio.wait([ready, task], timeout=600, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                task.result()  # a load error ends the worker: raise it here rather than wait out the timeout
            assert ready in done, "the pools were not ready within 600 s"
            runner = next(p for p in worker.pools if p.name == "flux").runners["tiny-flux"]
            pipe = runner.pipe
            async with (
                app.router.lifespan_context(app),
                httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client,
            ):
                # The model cards: Flux publishes its defaults (true_cfg_scale among them) and limits. A pool
                # that was ready long before the other heartbeats only once the worker runs (workers/main.py),
                # so its entry may be stale for a moment: wait for both.
                deadline = time.monotonic() + 30
                while True:
                    cards = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}
                    if set(cards) == {"tiny-flux", "tiny-sdxl"} or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.2)
                flux = cards["tiny-flux"]
                assert flux["family"] == "flux" and flux["task"] == "text-to-image"
                assert flux["defaults"] == {
                    "width": 64,
                    "height": 64,
                    "num_inference_steps": 28,  # FluxPipeline's default for a dev (guidance-embedding) model
                    "guidance_scale": 3.5,
                    "true_cfg_scale": 1.0,
                }
                assert flux["limits"]["size_multiple"] == pipe.limits["size_multiple"] == 4  # tiny VAE: x2
                assert flux["limits"]["schedulers"] == ["flow_match_euler"]
                assert flux["limits"]["buckets"] == [[64, 64]]
                assert "true_cfg_scale" not in cards["tiny-sdxl"]["defaults"]

                # SDXL has no true CFG: a 422 naming the field.
                r = await client.post(
                    "/v1/generate",
                    json={"model": "tiny-sdxl", "prompt": "x", "negative_prompt": "y", "true_cfg_scale": 3.0},
                )
                assert r.status_code == 422, r.text
                err = r.json()["error"]
                assert (err["field"], err["code"]) == ("true_cfg_scale", "not_supported")
                assert await store.redis.xlen(store.stream_key("tiny-sdxl", "normal")) == 0  # nothing queued

                # One plain job and one true-CFG job (same prompt, negative and seed): both come back as PNGs.
                common = {
                    "model": "tiny-flux",
                    "prompt": "a lighthouse",
                    "seed": 7,
                    "num_inference_steps": STEPS,
                }
                bodies = {
                    "plain": {**common, "negative_prompt": "fog"},  # a negative alone does nothing (scale 1)
                    "true_cfg": {**common, "negative_prompt": "fog", "true_cfg_scale": 4.0},
                }
                ids = {}
                for name, body in bodies.items():
                    r = await client.post("/v1/generate", json=body)
                    assert r.status_code == 202, r.text
                    ids[name] = r.json()["id"]
                    want = body.get("true_cfg_scale", 1.0)
                    assert r.json()["params"]["true_cfg_scale"] == want
                images, jobs = {}, {}
                deadline = time.monotonic() + 300
                for name, job_id in ids.items():
                    while (job := (await client.get(f"/v1/jobs/{job_id}")).json())["status"] not in (
                        "succeeded",
                        "failed",
                        "canceled",
                    ):
                        assert time.monotonic() < deadline, job
                        await asyncio.sleep(0.1)
                    assert job["status"] == "succeeded", job
                    out = await client.get(job["outputs"][0]["url"])
                    assert out.headers["content-type"] == "image/png"
                    images[name], jobs[name] = png(out.content), job
                    assert images[name].shape == (64, 64, 3) and images[name].std() > 1

                # Each equals the pipeline called directly with the same seed (same program family; a batch
                # of 2 vs 1 rows may round differently: at most 1 level).
                refs = {}
                for name, job in jobs.items():
                    p = JobParams.model_validate(job["params"])
                    refs[name] = await asyncio.to_thread(direct, pipe, p, p.seed)
                    assert max_diff(images[name], refs[name]) <= 1, name
                # True CFG did act: the same seed without it gives another image.
                assert max_diff(images["true_cfg"], images["plain"]) > 10

                # A step cache reaches the pipeline: listed on the card, carried in the job, and at threshold
                # 0 (never skips) the plain job's picture from the cached program (docs/step-cache.md).
                assert flux["limits"]["cache"] == {
                    "first_block": {"default_threshold": 0.08},
                    "teacache": {"default_threshold": 0.1},
                }
                assert cards["tiny-sdxl"]["limits"]["cache"] == {
                    "deep_features": {"default_threshold": 0.1},
                    "teacache": {"default_threshold": 0.2},
                }
                cached = {**bodies["plain"], "cache": {"method": "first_block", "threshold": 0.0}}
                r = await client.post("/v1/generate", json=cached)
                assert r.status_code == 202 and r.json()["params"]["cache"] == cached["cache"], r.text
                compiled = pipe.compilations

                async def finished(job_id):
                    while (job := (await client.get(f"/v1/jobs/{job_id}")).json())["status"] not in (
                        "succeeded",
                        "failed",
                        "canceled",
                    ):
                        assert time.monotonic() < deadline + 120, job
                        await asyncio.sleep(0.1)
                    assert job["status"] == "succeeded", job
                    return job

                job = await finished(r.json()["id"])
                assert pipe.compilations == compiled + 1  # the cached denoise program, compiled once
                out = png((await client.get(job["outputs"][0]["url"])).content)
                assert max_diff(out, images["plain"]) <= 1
                # The job says how many steps its cache skipped: none at 0; at 1, every step but the first
                # (the first-block rule on this random model, as in tests/models/test_step_cache.py), with
                # no new program. A job without a cache has no count.
                assert job["cached_steps"] == 0 and jobs["plain"]["cached_steps"] is None
                labels = {"model": "tiny-flux", "method": "first_block"}
                counted = REGISTRY.get_sample_value("meshserve_worker_cached_steps_total", labels) or 0.0
                lazy = {**cached, "cache": {"method": "first_block", "threshold": 1.0}}
                job = await finished((await client.post("/v1/generate", json=lazy)).json()["id"])
                assert job["cached_steps"] == job["params"]["num_inference_steps"] - 1 > 0, job
                assert pipe.compilations == compiled + 1
                # ... and the worker counts them (meshserve_worker_cached_steps_total, once per batch).
                now = REGISTRY.get_sample_value("meshserve_worker_cached_steps_total", labels)
                assert now - counted == job["cached_steps"]

                # A batch mixing the two (the pipeline selects per row) gives each row its own result.
                reqs = [
                    RunRequest(ids[name], JobParams.model_validate(jobs[name]["params"]))
                    for name in ("plain", "true_cfg")
                ]
                results = await asyncio.to_thread(runner.run, reqs)
                for name, result in zip(("plain", "true_cfg"), results, strict=True):
                    assert max_diff(png(result.outputs[0].data), refs[name]) <= 1, name
        finally:
            worker.stop()
            await asyncio.wait_for(task, 60)
            await store.close()
            cleanup(settings)

    asyncio.run(main())


def test_serve_tiny_flux_in_one_command(tmp_path):
    """`meshserve serve --model tiny-flux`: the shipped trained tiny Flux, API + worker + Redis."""
    port = free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("MESHSERVE_REDIS_URL", None)
    env.pop("MESHSERVE_AUTH", None)
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "meshserve.cli", "serve", "--port", str(port), "--model", "tiny-flux"],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            deadline = time.monotonic() + 600
            while True:
                assert proc.poll() is None, log_path.read_text()
                try:
                    if client.get("/readyz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "serve never became ready"
                time.sleep(0.5)
            (card,) = client.get("/v1/models").json()["data"]
            assert (card["id"], card["family"]) == ("tiny-flux", "flux")
            assert card["defaults"]["true_cfg_scale"] == 1.0
            r = client.post(
                "/v1/generate",
                headers={"Prefer": "wait=60"},
                json={
                    "prompt": "a red circle on a blue background",
                    "negative_prompt": "",
                    "true_cfg_scale": 3.0,
                    "seed": 1,
                    "num_inference_steps": STEPS,
                },
            )
            assert r.status_code in (200, 202), r.text
            job_id = r.json()["id"]
            while (job := client.get(f"/v1/jobs/{job_id}").json())["status"] not in (
                "succeeded",
                "failed",
                "canceled",
            ):
                assert time.monotonic() < deadline, job
                time.sleep(0.2)
            assert job["status"] == "succeeded", job
            img = client.get(job["outputs"][0]["url"])
            assert img.headers["content-type"] == "image/png"
            assert Image.open(io.BytesIO(img.content)).size == (64, 64)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
