"""SDXL's micro-conditioning over HTTP (ASGI, real Redis): diffusers' original_size, crops_coords_top_left,
target_size and their negatives as [height, width] / [top, left] pairs, taken by a model whose limits publish
`micro_conditioning` (SDXL pools do), each number bounded, refused with a 422 naming the field for any other
model, and carried in the job to the worker."""

from __future__ import annotations

import pytest

from meshserve.service.contract import MICRO_CONDITIONING
from tests.service.conftest import TOY, FakeWorker, api_client

pytestmark = pytest.mark.anyio

TOY_MICRO = TOY.model_copy(
    update={"id": "toy-micro", "limits": TOY.limits.model_copy(update={"micro_conditioning": True})}
)


@pytest.fixture
async def served(make_settings):
    async with api_client(make_settings()) as (client, store):
        await FakeWorker(store, name="mixed", models=(TOY_MICRO, TOY)).register()
        yield client, store


def post(client, **body):
    return client.post("/v1/generate", json={"prompt": "a lighthouse", **body})


async def test_every_field_reaches_the_worker(served):
    client, store = served
    cards = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}
    assert cards["toy-micro"]["limits"]["micro_conditioning"] is True
    assert cards["toy"]["limits"]["micro_conditioning"] is False
    given = {name: [100 + i, 0 if "crops" in name else 50 + i] for i, name in enumerate(MICRO_CONDITIONING)}
    r = await post(client, model="toy-micro", **given)
    assert r.status_code == 202, r.text
    assert {name: r.json()["params"][name] for name in MICRO_CONDITIONING} == given
    left_out = await post(client, model="toy-micro")
    assert all(left_out.json()["params"][name] is None for name in MICRO_CONDITIONING)
    claimed = {d.job.id: d.job.params for d in await store.claim(["toy-micro"], "w", 10, 100)}
    assert claimed[r.json()["id"]].original_size == (100, 50)


@pytest.mark.parametrize("name", MICRO_CONDITIONING)
async def test_refused_for_a_model_without_it(served, name):
    client, store = served
    r = await post(client, model="toy", **{name: [64, 64]})
    assert r.status_code == 422, r.text
    assert (r.json()["error"]["field"], r.json()["error"]["code"]) == (name, "not_supported")
    assert await store.redis.exists(store.stream_key("toy", "normal")) == 0


@pytest.mark.parametrize(
    ("name", "value", "field", "code"),
    [
        ("original_size", [0, 64], "original_size.0", "greater_than_equal"),
        ("target_size", [64, 16385], "target_size.1", "less_than_equal"),
        ("crops_coords_top_left", [-1, 0], "crops_coords_top_left.0", "greater_than_equal"),
        ("negative_original_size", [64], "negative_original_size", "too_short"),
        ("negative_target_size", [64, 64, 64], "negative_target_size", "too_long"),
        ("original_size", ["64", 64], "original_size.0", "int_type"),
        ("original_size", [64.0, 64], "original_size.0", "int_type"),
        ("original_size", "64x64", "original_size", "list_type"),
    ],
)
async def test_checked(served, name, value, field, code):
    client, _ = served
    r = await post(client, model="toy-micro", **{name: value})
    assert r.status_code == 422, r.text
    assert (r.json()["error"]["field"], r.json()["error"]["code"]) == (field, code)
