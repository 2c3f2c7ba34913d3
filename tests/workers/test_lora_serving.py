"""Served LoRA end to end on a real model: a worker pool running the embedded tiny SDXL (the session's
`embedded_sdxl`, so its compiled programs are shared with the other tests of the process) with one adapter
declared in pools.yaml under the LoRA root, and the API in-process over ASGI, on the real Redis. One pool start.

The pool's LoRA options reach load_pipeline (the table is built from them), the adapter is registered before the
warm-up, /v1/models lists it with the limits, a job naming it succeeds and records it, its image differs from the
same seed's without it, and the worker's LoRA metrics move."""

from __future__ import annotations

import asyncio
import io

import numpy as np
from PIL import Image
from prometheus_client import REGISTRY

from meshserve.models.lora.pool import AdapterPool
from meshserve.workers.config import ModelSpec, PoolConfig, WorkerConfig
from meshserve.workers.main import Worker
from tests.service.conftest import api_client
from tests.workers.helpers import job_when_ended, make_settings

# Two attention projections per transformer block, of the UNet and of both CLIP text encoders (so a job runs the
# text_encode program's LoRA variant too): the LoRA programs add a gather and two matmuls per adapted layer, so a
# narrow table keeps their compile short on the 2-core CPU.
TARGETS = r"attn1\.to_(q|v)$|self_attn\.(q|v)_proj$"


def write_lora(pipe_pool: AdapterPool, path, rank: int = 4, seed: int = 0) -> None:
    """A diffusers/PEFT-format adapter for every layer of the pool's table (the UNet's under `unet.`, a text
    encoder's under its own name): A ~ N(0, 1/in), B ~ N(0, 0.5/r) (a delta about half a weight's size: the
    image moves visibly)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    _, shapes = pipe_pool._layers()
    tensors = {}
    for module, s in shapes.items():
        key = module if module.startswith("text_encoder") else f"unet.{module}"
        tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, s["in"])) / np.sqrt(s["in"])).astype(
            np.float32
        )
        tensors[f"{key}.lora_B.weight"] = (
            rng.standard_normal((s["out"], rank)) * 0.5 / np.sqrt(rank)
        ).astype(np.float32)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))


def sample(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_a_declared_lora_served_end_to_end(embedded_sdxl, tmp_path, monkeypatch):
    pipe = embedded_sdxl
    built, warmed_with = {}, []

    def load_pipeline(path, **options):
        # The pool's table, as load_pipeline would build it from the pool's options (restored after the test).
        built.update({k: v for k, v in options.items() if "lora" in k})
        monkeypatch.setattr(
            pipe,
            "lora",
            AdapterPool(
                pipe,
                max_per_request=options["max_loras"],
                max_rank=options["max_lora_rank"],
                budget_mb=options["lora_budget_mb"],
                targets=options["lora_targets"],
            ),
        )
        return pipe

    monkeypatch.setattr("meshserve.models.load_pipeline", load_pipeline)
    # The warm-up compiles programs the two jobs compile anyway; it records what was registered by then.
    monkeypatch.setattr(pipe, "warm_up", lambda *a, **kw: warmed_with.append(list(pipe.loras)) or 0.0)
    root = tmp_path / "loras"
    write_lora(
        AdapterPool(pipe, max_per_request=1, max_rank=4, targets=TARGETS), root / "style" / "a.safetensors"
    )
    loads, hits = (
        sample("meshserve_worker_lora_loads_total", model="tiny-sdxl", reason="register"),
        sample("meshserve_worker_lora_hits_total", model="tiny-sdxl"),
    )

    async def main():
        settings = make_settings(lease_s=60.0, pool_cache_s=0, lora_root=str(root))
        pool = PoolConfig(
            name="sdxl-0",
            models=["tiny-sdxl"],
            devices="0",
            prompt_cache_mb=0,
            max_loras=2,
            max_lora_rank=4,
            lora_budget_mb=1,
            lora_targets=TARGETS,
        )
        config = WorkerConfig(
            models={"tiny-sdxl": ModelSpec(path=None, loras={"style": "style"})},
            pools=[pool],
            metrics_port=None,
        )
        worker = Worker(config, settings)
        task = asyncio.create_task(worker.run())
        try:
            await asyncio.wait_for(worker.ready.wait(), 600)
            assert built == {"max_loras": 2, "max_lora_rank": 4, "lora_budget_mb": 1, "lora_targets": TARGETS}
            assert warmed_with == [["style"]]  # registered before the warm-up
            # The adapter has factors for both CLIPs: its job runs the text_encode program's LoRA variant.
            assert pipe.lora._info["style"]["text_encoders"] == ["text_encoder", "text_encoder_2"]
            async with api_client(settings) as (client, _):
                (card,) = (await client.get("/v1/models")).json()["data"]
                assert card["adapters"] == [{"name": "style", "rank": 4}]
                assert card["limits"]["loras"]["max_per_request"] == 2
                assert card["limits"]["loras"]["max_rank"] == 4
                body = {"prompt": "a red circle", "seed": 11, "num_inference_steps": 2}
                ids = [
                    (
                        await client.post(
                            "/v1/generate", json={**body, "loras": [{"name": "style", "scale": 1.0}]}
                        )
                    ).json()["id"],
                    (await client.post("/v1/generate", json=body)).json()["id"],
                ]
                jobs = [await job_when_ended(client, i) for i in ids]
                assert [j["status"] for j in jobs] == ["succeeded", "succeeded"], jobs
                assert jobs[0]["params"]["loras"] == [{"name": "style", "scale": 1.0}]
                images = [
                    np.asarray(
                        Image.open(io.BytesIO((await client.get(j["outputs"][0]["url"])).content)), np.float32
                    )
                    for j in jobs
                ]
                assert np.abs(images[0] - images[1]).mean() > 2.0, "the adapter did not change the image"
        finally:
            worker.stop()
            await asyncio.wait_for(task, 120)

    asyncio.run(main())
    assert sample("meshserve_worker_lora_loads_total", model="tiny-sdxl", reason="register") - loads == 1
    assert sample("meshserve_worker_lora_hits_total", model="tiny-sdxl") - hits == 1
