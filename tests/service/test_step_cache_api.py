"""`cache` over HTTP (ASGI, real Redis): a model lists its step cache methods and default thresholds in
`limits.cache`; a request names one (its threshold, or the method's default, in the job params the worker
claims), and a model without one, an unknown method or a bad threshold is a 422 naming the field."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.anyio


def post(client, **body):
    return client.post("/v1/generate", json={"prompt": "a lighthouse", **body})


async def test_models_list_their_methods(toy_and_flux):
    client, _ = toy_and_flux
    cards = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}
    assert cards["toy-flux"]["limits"]["cache"] == {"first_block": {"default_threshold": 0.08}}
    assert cards["toy"]["limits"]["cache"] is None


async def test_accepted_with_its_threshold_or_the_default_and_claimed_with_it(toy_and_flux):
    client, store = toy_and_flux
    given = await post(client, model="toy-flux", cache={"method": "first_block", "threshold": 0.2})
    default = await post(client, model="toy-flux", cache={"method": "first_block"})
    plain = await post(client, model="toy-flux")
    assert all(r.status_code == 202 for r in (given, default, plain)), (given.text, default.text)
    assert given.json()["params"]["cache"] == {"method": "first_block", "threshold": 0.2}
    assert default.json()["params"]["cache"] == {"method": "first_block", "threshold": 0.08}
    assert plain.json()["params"]["cache"] is None
    claimed = {d.job.id: d.job.params for d in await store.claim(["toy-flux"], "w", 10, 100)}
    assert claimed[given.json()["id"]].cache.threshold == 0.2
    assert claimed[default.json()["id"]].cache.method == "first_block"
    assert claimed[plain.json()["id"]].cache is None


BAD = [
    ("toy", {"method": "first_block"}, "cache", "not_supported"),
    ("toy-flux", {"method": "teacache"}, "cache.method", "not_supported"),
    ("toy-flux", {"method": ""}, "cache.method", "string_too_short"),
    ("toy-flux", {"method": "first_block", "threshold": -0.1}, "cache.threshold", "greater_than_equal"),
    ("toy-flux", {"method": "first_block", "threshold": 2}, "cache.threshold", "less_than_equal"),
    ("toy-flux", {"method": "first_block", "threshold": "high"}, "cache.threshold", "float_type"),
    ("toy-flux", {"method": "first_block", "every": 3}, "cache.every", "extra_forbidden"),
    ("toy-flux", {"threshold": 0.1}, "cache.method", "missing"),
    ("toy-flux", "first_block", "cache", "model_attributes_type"),
]


@pytest.mark.parametrize(("model", "cache", "field", "code"), BAD, ids=[f"{b[2]}-{b[3]}" for b in BAD])
async def test_bad_cache_is_a_422_naming_the_field(toy_and_flux, model, cache, field, code):
    client, store = toy_and_flux
    r = await post(client, model=model, cache=cache)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert (err["field"], err["code"]) == (field, code), err
    assert await store.redis.exists(store.stream_key(model, "normal")) == 0  # nothing was queued
