"""`guidance_scale_2` over HTTP (ASGI, real Redis): Wan 2.2's two-expert models publish it (their default
guidance); a request that leaves it out takes its own guidance_scale, as diffusers' WanPipeline does; any other
model refuses it with a 422 naming the field; values are checked to [0, 100] and finite."""

from __future__ import annotations

import pytest

from meshserve.service.contract import ModelDefaults
from tests.service.conftest import TOY, FakeWorker, api_client

pytestmark = pytest.mark.anyio

TOY_EXPERTS = TOY.model_copy(
    update={
        "id": "toy-experts",
        "defaults": ModelDefaults(
            width=64, height=48, num_inference_steps=4, guidance_scale=5.0, guidance_scale_2=5.0
        ),
    }
)


@pytest.fixture
async def served(make_settings):
    async with api_client(make_settings()) as (client, store):
        await FakeWorker(store, name="mixed", models=(TOY_EXPERTS, TOY)).register()
        yield client, store


def post(client, **body):
    return client.post("/v1/generate", json={"prompt": "a lighthouse", **body})


async def test_taken_by_two_experts_left_out_it_is_the_requests_guidance(served):
    client, store = served
    cards = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}
    assert cards["toy-experts"]["defaults"]["guidance_scale_2"] == 5.0
    assert "guidance_scale_2" not in cards[TOY.id]["defaults"]
    given = await post(client, model="toy-experts", guidance_scale=4.0, guidance_scale_2=3.0, seed=1)
    left_out = await post(client, model="toy-experts", guidance_scale=4.0, seed=2)
    default = await post(client, model="toy-experts", seed=3)
    assert {r.status_code for r in (given, left_out, default)} == {202}, (given.text, left_out.text)
    assert given.json()["params"]["guidance_scale_2"] == 3.0
    assert left_out.json()["params"]["guidance_scale_2"] == 4.0  # the request's guidance, not the model's 5
    assert default.json()["params"]["guidance_scale_2"] == 5.0
    claimed = {d.job.id: d.job.params for d in await store.claim(["toy-experts"], "w", 10, 100)}
    assert claimed[given.json()["id"]].guidance_scale_2 == 3.0


async def test_refused_for_one_denoiser(served):
    client, store = served
    r = await post(client, model=TOY.id, guidance_scale_2=2.0)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert (err["field"], err["code"]) == ("guidance_scale_2", "not_supported")
    r = await post(client, model=TOY.id)
    assert r.status_code == 202 and r.json()["params"]["guidance_scale_2"] is None


@pytest.mark.parametrize("value", [-1, 101, "nan", "inf", "high", True])
async def test_values_out_of_range_are_422(served, value):
    client, _ = served
    r = await post(client, model="toy-experts", guidance_scale_2=value)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["field"] == "guidance_scale_2"
