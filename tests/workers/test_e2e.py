"""The real model path: the pipeline runner with the embedded tiny SDXL model inside a worker pool, and
`run_serve` (API + worker + its own redis-server) driven over HTTP."""

import asyncio
import base64
import io
import os
import signal
import subprocess
import sys
import time
from functools import partial

import httpx
import numpy as np
import pytest
from PIL import Image

from meshserve.service.contract import MICRO_CONDITIONING, JobStatus
from meshserve.service.store import Store
from meshserve.training.shape_score import read_picture
from meshserve.workers.config import single_model_config
from meshserve.workers.encoding import to_uint8
from meshserve.workers.main import Worker
from meshserve.workers.runner import Cancelled, RunRequest
from tests.private_redis import free_port
from tests.workers.helpers import ROOT, cleanup, make_settings, params, submit_many, wait_ended


def test_pipeline_pool_serves_the_embedded_model_and_matches_a_direct_call():
    async def main():
        settings = make_settings(lease_s=30.0)
        store = Store(settings)
        worker = Worker(single_model_config(None), settings)
        task = asyncio.create_task(worker.run())
        try:
            await asyncio.wait_for(worker.ready.wait(), 300)
            (pool,) = await store.list_pools()
            info = pool.models[0]
            assert (info.id, info.family, info.task) == ("tiny-sdxl", "sdxl", "text-to-image")
            d = info.defaults
            jobs = [
                params("a red square", model="tiny-sdxl", steps=d.num_inference_steps, seed=11, size=d.width),
                params(
                    "a blue circle", model="tiny-sdxl", steps=d.num_inference_steps, seed=5, size=d.width, n=2
                ),
                # diffusers' guidance_rescale and clip_skip, per row: batched with the jobs above, which carry
                # none (a job from before the fields: the pipeline's defaults) and run as the call without them.
                params(
                    "a green triangle", model="tiny-sdxl", steps=d.num_inference_steps, seed=8, size=d.width
                ).model_copy(update={"guidance_rescale": 0.7, "clip_skip": 1}),
                # The second CLIP's own texts (prompt_2 / negative_prompt_2) and a crop's micro-conditioning,
                # per row in the same batch.
                params(
                    "a yellow triangle", model="tiny-sdxl", steps=d.num_inference_steps, seed=9, size=d.width
                ).model_copy(
                    update={
                        "negative_prompt": "blue",
                        "prompt_2": "a red circle",
                        "negative_prompt_2": "white",
                        "crops_coords_top_left": (16, 8),
                    }
                ),
                # diffusers' custom sigmas: 3 steps and the last one's end (a batch of its own: the
                # schedule is the batch's).
                params("a purple square", model="tiny-sdxl", steps=3, seed=4, size=d.width).model_copy(
                    update={"sigmas": (14.6, 4.0, 0.9, 0.0)}
                ),
            ]
            assert d.guidance_rescale == 0.0
            ids = await submit_many(store, jobs)
            done = await wait_ended(store, ids, timeout=300)
            assert all(j.status == JobStatus.SUCCEEDED for j in done.values()), done
            pipe = worker.pools[0].runners["tiny-sdxl"].pipe
            runner = worker.pools[0].runners["tiny-sdxl"]
            for job_id, p in zip(ids, jobs, strict=True):
                job = done[job_id]
                assert [o.seed for o in job.outputs] == [p.seed + i for i in range(p.n)]
                assert job.progress.step == job.progress.total_steps == p.num_inference_steps
                assert {"text_encode", "denoise", "vae_decode", "encode"} <= set(job.timings.stages)
                for i, out in enumerate(job.outputs):
                    assert (out.width, out.height, out.content_type) == (p.width, p.height, "image/png")
                    got = np.asarray(Image.open(io.BytesIO(await store.output(job_id, i))).convert("RGB"))
                    call = partial(
                        pipe,
                        [p.prompt],
                        negative_prompt=[p.negative_prompt],
                        height=p.height,
                        width=p.width,
                        num_inference_steps=p.num_inference_steps,
                        guidance_scale=[p.guidance_scale],
                        guidance_rescale=[p.guidance_rescale or 0.0],
                        seed=[p.seed + i],
                        num_images_per_prompt=1,
                        output_type="uint8",
                    )
                    if p.sigmas is not None:
                        call = partial(call, sigmas=list(p.sigmas))
                    names = ("prompt_2", "negative_prompt_2", "clip_skip", *MICRO_CONDITIONING)
                    texts = {name: getattr(p, name) for name in names}
                    ref = (await asyncio.to_thread(call, **{k: [v] for k, v in texts.items()})).images[0]
                    # Same program, same inputs: identical up to a rounding level (batch of 1 vs n rows).
                    diff = np.abs(got.astype(int) - ref.astype(int)).max()
                    assert diff <= 1, f"job {job_id} image {i}: max |diff| {diff}"
                    assert got.std() > 1  # not a blank image
                    if any(v is not None for v in texts.values()):  # they acted: without, another picture
                        without = (await asyncio.to_thread(call)).images[0]
                        assert np.abs(got.astype(int) - without.astype(int)).max() > 8
            # GenerationCancelled from inside the compiled loop surfaces as the runner's Cancelled.
            req = RunRequest(
                "x", params("stop", model="tiny-sdxl", steps=d.num_inference_steps, size=d.width)
            )
            seen = []
            with pytest.raises(Cancelled):
                await asyncio.to_thread(runner.run, [req], lambda step, total: seen.append(step) or step < 2)
            assert seen == [1, 2]
        finally:
            worker.stop()
            await asyncio.wait_for(task, 60)
            await store.close()
            cleanup(settings)

    asyncio.run(main())


def test_serve_runs_api_worker_and_its_own_redis_in_one_command(tmp_path):
    port = free_port()
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "JAX_COMPILATION_CACHE_DIR": str(ROOT / ".cache" / "jax"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5",
    }
    env.pop("MESHSERVE_REDIS_URL", None)
    code = (
        f"from meshserve.workers.serve import run_serve; run_serve(port={port}, redis_url=None, model=None)"
    )
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
    )
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=base, timeout=10) as client:
            deadline = time.monotonic() + 300
            while True:
                assert proc.poll() is None, (tmp_path / "serve.log").read_text()
                try:
                    if client.get("/readyz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "serve never became ready"
                time.sleep(0.5)
            models_ = client.get("/v1/models").json()
            assert [m["id"] for m in models_["data"]] == ["tiny-sdxl"]
            # No buckets configured: the pool serves the model's default size alone, warmed up at start.
            assert models_["data"][0]["limits"]["buckets"] == [[64, 64]]
            r = client.post("/v1/generate", json={"prompt": "x", "width": 128, "height": 128})
            assert r.status_code == 422 and r.json()["error"]["code"] == "size_not_supported", r.text
            # The README's prompt: the embedded model draws it (training/shape_score.py reads the picture).
            r = client.post("/v1/generate", json={"prompt": "a red circle on a blue background", "seed": 3})
            assert r.status_code == 202, r.text
            job_id = r.json()["id"]
            while True:
                job = client.get(f"/v1/jobs/{job_id}").json()
                if job["status"] in ("succeeded", "failed", "canceled"):
                    break
                assert time.monotonic() < deadline
                time.sleep(0.2)
            assert job["status"] == "succeeded", job
            img = client.get(job["outputs"][0]["url"])
            assert img.headers["content-type"] == "image/png"
            picture = np.asarray(Image.open(io.BytesIO(img.content)).convert("RGB"))
            assert picture.shape == (64, 64, 3)
            reading = read_picture(picture)
            assert (reading.colour, reading.shape, reading.background) == ("red", "circle", "blue"), reading
            # Image inputs and a job of more images than max_batch (1 here): every task and every part runs
            # programs compiled at start (before, the first image job and an n of 3 compiled on the request path).
            buf = io.BytesIO()
            Image.fromarray(picture).save(buf, format="PNG")
            image = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
            mask = np.zeros((64, 64), np.uint8)
            mask[16:48, 16:48] = 255
            buf = io.BytesIO()
            Image.fromarray(mask).save(buf, format="PNG")
            mask_url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
            ids = []
            for body in (
                {"prompt": "a red circle on a blue background", "image": image, "strength": 0.5, "n": 3},
                {"prompt": "a red circle on a blue background", "image": image, "mask": mask_url, "seed": 4},
            ):
                r = client.post("/v1/generate", json=body)
                assert r.status_code == 202, r.text
                ids.append(r.json()["id"])
            ended = []
            for job_id in ids:
                while (job := client.get(f"/v1/jobs/{job_id}").json())["status"] not in (
                    "succeeded",
                    "failed",
                ):
                    assert time.monotonic() < deadline
                    time.sleep(0.2)
                assert job["status"] == "succeeded", job
                ended.append(job)
            seed = ended[0]["params"]["seed"]
            assert [(o["index"], o["seed"]) for o in ended[0]["outputs"]] == [(i, seed + i) for i in range(3)]
            text = client.get("/metrics").text
            assert 'meshserve_worker_jobs_total{model="tiny-sdxl",outcome="succeeded"} 3.0' in text
            assert "meshserve_http_requests_total" in text
            compiled = {
                reason: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                for reason in ("warmup", "request")
                if line.startswith(f'meshserve_compilations_total{{pool="tiny-sdxl-0",reason="{reason}"}}')
            }
            assert compiled.get("warmup", 0) > 0 and compiled.get("request", 0) == 0, compiled
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        out = (tmp_path / "serve.log").read_text()
        assert "started a local redis-server" in out
        redis_pid = int(out.split("(pid ")[1].split(")")[0])
        with pytest.raises(ProcessLookupError):
            os.kill(redis_pid, 0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.slow
def test_two_pools_on_disjoint_4_device_slices_match_one_device():
    """Issue 4 §4: two pools x 4 CPU devices in one process, each on its own mesh, side by side; every image
    equals the single-device pipeline's."""
    import jax

    from meshserve.models import load_pipeline
    from meshserve.workers.config import WorkerConfig

    assert len(jax.devices()) >= 8
    mesh = {"cfg": 2, "context": 2}
    pool = {"models": ["tiny-sdxl"], "mesh": mesh, "max_batch": 1, "batch_wait_ms": 0}
    cfg = WorkerConfig.model_validate(
        {
            "models": {"tiny-sdxl": {"path": None}},
            "pools": [
                {"name": "left", "devices": "0-3", **pool},
                {"name": "right", "devices": "4-7", **pool},
            ],
            "metrics_port": None,
        }
    )

    async def main():
        settings = make_settings(lease_s=60.0)
        store = Store(settings)
        worker = Worker(cfg, settings)
        task = asyncio.create_task(worker.run())
        try:
            await asyncio.wait_for(worker.ready.wait(), 600)
            pools = {p.name.rsplit("/", 1)[1]: p for p in await store.list_pools()}
            assert pools["left"].mesh == {"data": 1, "cfg": 2, "context": 2, "tensor": 1}
            d = pools["left"].models[0].defaults
            jobs = [
                params(f"prompt {i}", model="tiny-sdxl", steps=d.num_inference_steps, seed=i, size=d.width)
                for i in range(4)
            ]
            ids = await submit_many(store, jobs)
            done = await wait_ended(store, ids, timeout=600)
            assert all(j.status == JobStatus.SUCCEEDED for j in done.values()), done
            assert {j.worker.rsplit("/", 1)[1] for j in done.values()} == {"left", "right"}
            ref_pipe = await asyncio.to_thread(load_pipeline, None)
            for job_id, p in zip(ids, jobs, strict=True):
                got = np.asarray(Image.open(io.BytesIO(await store.output(job_id, 0))).convert("RGB"))
                ref = await asyncio.to_thread(
                    ref_pipe,
                    [p.prompt],
                    negative_prompt=[None],
                    height=p.height,
                    width=p.width,
                    num_inference_steps=p.num_inference_steps,
                    guidance_scale=[p.guidance_scale],
                    seed=[p.seed],
                    num_images_per_prompt=1,
                    output_type="np",
                )
                diff = np.abs(got.astype(int) - to_uint8(ref.images[0]).astype(int)).max()
                assert diff <= 1, f"{done[job_id].worker}: max |diff| {diff} against one device"
        finally:
            worker.stop()
            await asyncio.wait_for(task, 60)
            await store.close()
            cleanup(settings)

    asyncio.run(main())
