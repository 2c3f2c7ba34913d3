"""`guidance_rescale` over HTTP (ASGI, real Redis): taken only by a model whose published defaults list it (SDXL
pools publish 0.0), checked to [0, 1] and finite, refused with a 422 naming the field for any other model, and
carried in the job params to the worker that claims the job."""

from __future__ import annotations

import pytest

from meshserve.service.contract import ModelDefaults
from tests.service.conftest import TOY, TOY_FLUX, FakeWorker, api_client

pytestmark = pytest.mark.anyio

TOY_RESCALE = TOY.model_copy(
    update={
        "id": "toy-rescale",
        "defaults": ModelDefaults(
            width=64, height=48, num_inference_steps=4, guidance_scale=5.0, guidance_rescale=0.0
        ),
    }
)


@pytest.fixture
async def served(make_settings):
    async with api_client(make_settings()) as (client, store):
        await FakeWorker(store, name="mixed", models=(TOY_RESCALE, TOY_FLUX)).register()
        yield client, store


def post(client, **body):
    return client.post("/v1/generate", json={"prompt": "a lighthouse", **body})


async def test_taken_by_a_model_that_publishes_it_and_reaches_the_worker(served):
    client, store = served
    cards = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}
    assert cards["toy-rescale"]["defaults"]["guidance_rescale"] == 0.0
    assert "guidance_rescale" not in cards["toy-flux"]["defaults"]
    given = await post(client, model="toy-rescale", guidance_rescale=0.7, seed=1)
    default = await post(client, model="toy-rescale", seed=2)
    assert given.status_code == default.status_code == 202, (given.text, default.text)
    assert given.json()["params"]["guidance_rescale"] == 0.7
    assert default.json()["params"]["guidance_rescale"] == 0.0  # the model's default: what will run
    claimed = {d.job.id: d.job.params for d in await store.claim(["toy-rescale"], "w", 10, 100)}
    assert claimed[given.json()["id"]].guidance_rescale == 0.7


async def test_refused_for_a_model_without_it(served):
    client, store = served
    r = await post(client, model="toy-flux", guidance_rescale=0.5)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert (err["field"], err["code"]) == ("guidance_rescale", "not_supported")
    assert await store.redis.exists(store.stream_key("toy-flux", "normal")) == 0
    r = await post(client, model="toy-flux")
    assert r.status_code == 202 and r.json()["params"]["guidance_rescale"] is None


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ('"guidance_rescale": -0.1', "greater_than_equal"),
        ('"guidance_rescale": 1.5', "less_than_equal"),
        ('"guidance_rescale": "much"', "float_type"),
        ('"guidance_rescale": NaN', "finite_number"),
        ('"guidance_rescale": Infinity', "finite_number"),
    ],
)
async def test_range_checked(served, body, code):
    client, store = served
    content = f'{{"model": "toy-rescale", "prompt": "x", {body}}}'
    r = await client.post("/v1/generate", content=content, headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert (err["field"], err["code"]) == ("guidance_rescale", code), err
    assert await store.redis.exists(store.stream_key("toy-rescale", "normal")) == 0
