"""Served adapters for Wan 2.2's two experts: `load_into_transformer_2` (diffusers' argument) in pools.yaml and
`POST /v1/loras`, through the registry to the runner, kept when an evicted adapter is loaded again; refused (422
naming the field) for a model with one denoiser. The API in-process over ASGI, a real worker pool running the
fake runner (`lora_experts`: it records which adapters went into its second expert), the real Redis. No JAX.
The engine's side (the adapter's layers under `transformer_2`) is tests/models/test_wan_two_experts.py's."""

from __future__ import annotations

import asyncio
import json

import pytest
from pydantic import ValidationError

from meshserve.service.contract import LoraSpec
from meshserve.service.lora_requests import LoraRequests
from meshserve.workers.config import ModelSpec, PoolConfig, WorkerConfig
from meshserve.workers.main import Worker
from meshserve.workers.pool import load_runners
from tests.service.conftest import api_client
from tests.service.test_loras_api import job_when_ended, lora_root

pytestmark = pytest.mark.anyio

EXPERTS = {"runner": "fake", "options": {"lora_slots": 2, "lora_experts": True}}
ONE_DENOISER = {"runner": "fake", "options": {"lora_slots": 2}}


def test_pools_yaml_declares_the_expert(tmp_path):
    spec = ModelSpec(
        **EXPERTS,
        loras={"high": "style", "low": {"source": "extra.safetensors", "load_into_transformer_2": True}},
    )
    assert spec.loras == {
        "high": LoraSpec(source="style"),
        "low": LoraSpec(source="extra.safetensors", load_into_transformer_2=True),
    }
    with pytest.raises(
        ValidationError, match="unknown keys"
    ):  # a misspelt key is not silently the first expert
        ModelSpec(**EXPERTS, loras={"low": {"source": "x.safetensors", "load_into_transformer": True}})
    with pytest.raises(ValidationError, match="'..' is not allowed"):
        ModelSpec(**EXPERTS, loras={"low": {"source": "../x.safetensors", "load_into_transformer_2": True}})
    root, pool = lora_root(tmp_path), PoolConfig(name="p", models=["m"], devices="0")
    runners, models = load_runners(pool, {"m": spec}, lora_root=str(root))
    assert runners["m"].into_transformer_2 == {"low"}
    assert {a.name: a.load_into_transformer_2 for a in models["m"].adapters} == {"high": False, "low": True}
    one = ModelSpec(
        **ONE_DENOISER, loras={"low": {"source": "extra.safetensors", "load_into_transformer_2": True}}
    )
    with pytest.raises(ValueError, match="'low'.*load_into_transformer_2"):
        load_runners(pool, {"m": one}, lora_root=str(root))


async def test_a_stored_request_of_an_earlier_release_adapts_the_first_expert(make_settings):
    async with api_client(make_settings()) as (_, store):
        wanted = LoraRequests(store)
        await store.redis.hset(
            wanted.key("m"), "old", json.dumps({"source": "a.safetensors", "added_at": 1.0})
        )
        await wanted.put("m", "new", LoraSpec(source="b.safetensors", load_into_transformer_2=True))
        assert await wanted.get("m") == {
            "old": LoraSpec(source="a.safetensors"),
            "new": LoraSpec(source="b.safetensors", load_into_transformer_2=True),
        }


async def test_adapters_into_the_second_expert_are_served(tmp_path, make_settings):
    root = lora_root(tmp_path)
    settings = make_settings(lora_root=str(root), lora_poll_s=0.05, lora_wait_s=10, lease_s=10)
    low = {"source": "style", "load_into_transformer_2": True}
    config = WorkerConfig(
        models={"wan": ModelSpec(**EXPERTS, loras={"low": low}), "toy": ModelSpec(**ONE_DENOISER)},
        pools=[PoolConfig(name="p-0", models=["wan", "toy"], devices="0", max_batch=4, batch_wait_ms=0)],
        metrics_port=None,
    )
    async with api_client(settings) as (client, _):
        worker = Worker(config, settings)
        task = asyncio.create_task(worker.run())
        try:
            await asyncio.wait_for(worker.ready.wait(), 30)
            runner = worker.pools[0].runners["wan"]
            cards = {c["id"]: c for c in (await client.get("/v1/models")).json()["data"]}
            assert cards["wan"]["limits"]["loras"]["load_into_transformer_2"] is True
            assert "load_into_transformer_2" not in cards["toy"]["limits"]["loras"]

            async def add(model, name, source, **expert):
                body = {"model": model, "name": name, "source": source, **expert}
                return await client.post("/v1/loras", json=body)

            async def listed():
                return {(e["model"], e["name"]): e for e in (await client.get("/v1/loras")).json()["data"]}

            entry = (await listed())[("wan", "low")]
            assert (entry["origin"], entry["load_into_transformer_2"], entry["usable"]) == (
                "config",
                True,
                True,
            )

            # A model with one denoiser: 422 naming the field, before anything is asked of its pools.
            r = await add("toy", "x", "extra.safetensors", load_into_transformer_2=True)
            assert (r.status_code, r.json()["error"]["field"], r.json()["error"]["code"]) == (
                422,
                "load_into_transformer_2",
                "not_supported",
            ), r.text
            r = await add("wan", "x", "extra.safetensors", load_into_transformer_2="yes")
            assert (r.status_code, r.json()["error"]["field"]) == (422, "load_into_transformer_2"), r.text
            assert ("toy", "x") not in await listed() and ("wan", "x") not in await listed()

            # Into the second expert, then the same file moved to the first: the pool loads it again there.
            r = await add("wan", "x", "extra.safetensors", load_into_transformer_2=True)
            assert r.status_code == 201 and r.json()["load_into_transformer_2"] is True, r.text
            assert runner.into_transformer_2 == {"low", "x"}
            r = await add("wan", "x", "extra.safetensors")
            assert r.status_code == 201 and r.json()["load_into_transformer_2"] is False, r.text
            assert runner.into_transformer_2 == {"low"}
            assert (await listed())[("wan", "x")]["pools"][0]["status"] == "loaded"

            # The table holds two: a third adapter evicts `low`; a job naming it loads it into its expert again.
            assert (await add("wan", "third", "third.safetensors")).status_code == 201
            assert "low" not in runner.resident_loras()
            body = {"model": "wan", "prompt": "a cat", "loras": [{"name": "low", "scale": 0.5}]}
            job = await job_when_ended(
                client, (await client.post("/v1/generate", json=body)).json()["id"], {}
            )
            assert job["status"] == "succeeded", job
            assert "low" in runner.resident_loras() and runner.into_transformer_2 == {"low"}
        finally:
            worker.stop()
            await asyncio.wait_for(task, 30)
