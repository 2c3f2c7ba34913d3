"""`true_cfg_scale` over HTTP (ASGI, real Redis): taken only by a model whose published defaults list it (Flux),
range- and finiteness-checked, refused with a 422 naming the field for any other model, and carried in the job
params to the worker that claims the job."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.anyio


def post(client, **body):
    return client.post("/v1/generate", json={"prompt": "a lighthouse", **body})


async def test_models_card_shows_which_model_takes_it(toy_and_flux):
    client, _ = toy_and_flux
    cards = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}
    assert cards["toy-flux"]["defaults"]["true_cfg_scale"] == 1.0
    assert cards["toy-flux"]["limits"]["size_multiple"] == 16
    # A model without it publishes no such key: its presence is what says a model takes the field.
    assert "true_cfg_scale" not in cards["toy"]["defaults"]


async def test_refused_for_a_model_without_it(toy_and_flux):
    client, store = toy_and_flux
    r = await post(client, model="toy", true_cfg_scale=4.0, negative_prompt="blurry")
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert (err["field"], err["code"]) == ("true_cfg_scale", "not_supported")
    assert "toy" in err["message"] and "left out" in err["message"]
    assert await store.redis.exists(store.stream_key("toy", "normal")) == 0  # nothing was queued
    # Left out (or null) it is fine, and the job says the model has none.
    for body in ({}, {"true_cfg_scale": None}):
        r = await post(client, model="toy", **body)
        assert r.status_code == 202, r.text
        assert r.json()["params"]["true_cfg_scale"] is None


BAD_VALUES = [
    (0.5, "greater_than_equal"),  # < 1 never acts: refused rather than silently ignored
    (0, "greater_than_equal"),
    (-2, "greater_than_equal"),
    (100.5, "less_than_equal"),
    ("strong", "float_type"),
]


@pytest.mark.parametrize(("value", "code"), BAD_VALUES, ids=[str(v) for v, _ in BAD_VALUES])
async def test_range_checked(toy_and_flux, value, code):
    client, store = toy_and_flux
    r = await post(client, model="toy-flux", true_cfg_scale=value, negative_prompt="blurry")
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert (err["field"], err["code"]) == ("true_cfg_scale", code), err
    assert await store.redis.exists(store.stream_key("toy-flux", "normal")) == 0


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
async def test_non_finite_refused(toy_and_flux, literal):
    # Python's JSON parser reads these non-standard literals as floats: they must not get past the schema.
    client, store = toy_and_flux
    body = f'{{"model": "toy-flux", "prompt": "x", "negative_prompt": "y", "true_cfg_scale": {literal}}}'
    r = await client.post("/v1/generate", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["field"] == "true_cfg_scale" and err["code"] == "finite_number", err
    assert await store.redis.exists(store.stream_key("toy-flux", "normal")) == 0


async def test_accepted_for_a_model_with_it_and_reaches_the_worker(toy_and_flux):
    client, store = toy_and_flux
    r = await post(client, model="toy-flux", true_cfg_scale=4.5, negative_prompt="blurry", seed=3)
    assert r.status_code == 202, r.text
    given = r.json()
    assert given["params"]["true_cfg_scale"] == 4.5 and given["params"]["negative_prompt"] == "blurry"
    # Left out: the model's default (1.0, off), so the job's params say exactly what will run.
    r = await post(client, model="toy-flux", seed=4)
    assert r.status_code == 202, r.text
    default = r.json()
    assert default["params"]["true_cfg_scale"] == 1.0
    # Exactly 1 is accepted (off) and kept.
    r = await post(client, model="toy-flux", true_cfg_scale=1)
    assert r.status_code == 202 and r.json()["params"]["true_cfg_scale"] == 1.0
    # What a worker claims carries it in the job params.
    claimed = {d.job.id: d.job.params for d in await store.claim(["toy-flux"], "w", 10, 100)}
    assert claimed[given["id"]].true_cfg_scale == 4.5
    assert claimed[default["id"]].true_cfg_scale == 1.0
    assert (await store.get(given["id"])).params.true_cfg_scale == 4.5
    # GET /v1/jobs/{id} shows it too.
    job = (await client.get(f"/v1/jobs/{given['id']}")).json()
    assert job["params"]["true_cfg_scale"] == 4.5
