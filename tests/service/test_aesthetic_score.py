"""The SDXL refiner's `aesthetic_score` / `negative_aesthetic_score` over HTTP (ASGI, real Redis): taken only by a
model whose published defaults list them (a refiner pool publishes 6.0 and 2.5), checked to [0, 10] and finite,
the defaults filled in, refused with a 422 naming the field for any other model, carried to the worker."""

from __future__ import annotations

import pytest

from meshserve.service.contract import ModelDefaults
from tests.service.conftest import TOY, FakeWorker, api_client

pytestmark = pytest.mark.anyio

TOY_REFINER = TOY.model_copy(
    update={
        "id": "toy-refiner",
        "defaults": ModelDefaults(
            width=64,
            height=48,
            num_inference_steps=4,
            guidance_scale=5.0,
            aesthetic_score=6.0,
            negative_aesthetic_score=2.5,
        ),
    }
)


@pytest.fixture
async def served(make_settings):
    async with api_client(make_settings()) as (client, store):
        await FakeWorker(store, name="mixed", models=(TOY_REFINER, TOY)).register()
        yield client, store


def post(client, **body):
    return client.post("/v1/generate", json={"prompt": "a lighthouse", **body})


async def test_taken_by_a_model_that_publishes_them_and_reaches_the_worker(served):
    client, store = served
    cards = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}
    assert cards["toy-refiner"]["defaults"]["aesthetic_score"] == 6.0
    assert "aesthetic_score" not in cards["toy"]["defaults"]
    given = await post(client, model="toy-refiner", aesthetic_score=7.5, seed=1)
    assert given.status_code == 202, given.text
    params = given.json()["params"]
    assert (params["aesthetic_score"], params["negative_aesthetic_score"]) == (7.5, 2.5)
    claimed = {d.job.id: d.job.params for d in await store.claim(["toy-refiner"], "w", 10, 100)}
    assert claimed[given.json()["id"]].aesthetic_score == 7.5


@pytest.mark.parametrize("field", ["aesthetic_score", "negative_aesthetic_score"])
async def test_refused_for_a_model_without_them(served, field):
    client, store = served
    r = await post(client, model="toy", **{field: 5.0})
    assert r.status_code == 422, r.text
    assert (r.json()["error"]["field"], r.json()["error"]["code"]) == (field, "not_supported")
    assert await store.redis.exists(store.stream_key("toy", "normal")) == 0


@pytest.mark.parametrize(("value", "code"), [(10.5, "less_than_equal"), (-1, "greater_than_equal")])
async def test_checked(served, value, code):
    client, _ = served
    r = await post(client, model="toy-refiner", aesthetic_score=value)
    assert r.status_code == 422, r.text
    assert (r.json()["error"]["field"], r.json()["error"]["code"]) == ("aesthetic_score", code)
