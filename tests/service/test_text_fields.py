"""The text encoders' request fields over HTTP (ASGI, real Redis). `prompt_2` / `negative_prompt_2`: taken only
by a model whose limits publish `prompt_2` (SDXL and Flux pools do), bounded like the prompt, "" read as left
out (diffusers' `prompt_2 or prompt`). `clip_skip`: taken by a model whose limits publish `max_clip_skip` (SDXL),
0 to that. Both refused with a 422 naming the field for any other model, and carried in the job to the worker."""

from __future__ import annotations

import json

import pytest

from tests.service.conftest import TOY, FakeWorker, api_client

pytestmark = pytest.mark.anyio

TOY_TWO = TOY.model_copy(
    update={"id": "toy-two", "limits": TOY.limits.model_copy(update={"prompt_2": True, "max_clip_skip": 3})}
)


@pytest.fixture
async def served(make_settings):
    async with api_client(make_settings(max_prompt_chars=40)) as (client, store):
        await FakeWorker(store, name="mixed", models=(TOY_TWO, TOY)).register()
        yield client, store


def post(client, **body):
    # json.dumps escapes a lone surrogate (\ud800) as JSON allows; httpx's json= cannot encode it.
    body = json.dumps({"prompt": "a lighthouse", **body})
    return client.post("/v1/generate", content=body, headers={"content-type": "application/json"})


async def test_taken_by_a_model_that_publishes_it_and_reaches_the_worker(served):
    client, store = served
    cards = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}
    assert cards["toy-two"]["limits"]["prompt_2"] is True and cards["toy"]["limits"]["prompt_2"] is False
    given = await post(client, model="toy-two", prompt_2="oil painting", negative_prompt_2="blurry", seed=1)
    empty = await post(client, model="toy-two", prompt_2="", negative_prompt_2="", seed=2)
    assert given.status_code == empty.status_code == 202, (given.text, empty.text)
    assert given.json()["params"]["prompt_2"] == "oil painting"
    assert given.json()["params"]["negative_prompt_2"] == "blurry"
    assert empty.json()["params"]["prompt_2"] is None and empty.json()["params"]["negative_prompt_2"] is None
    claimed = {d.job.id: d.job.params for d in await store.claim(["toy-two"], "w", 10, 100)}
    assert claimed[given.json()["id"]].prompt_2 == "oil painting"


@pytest.mark.parametrize("field", ["prompt_2", "negative_prompt_2"])
async def test_refused_for_a_model_with_one_text_encoder(served, field):
    client, store = served
    r = await post(client, model="toy", **{field: "oil painting"})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert (err["field"], err["code"]) == (field, "not_supported")
    assert await store.redis.exists(store.stream_key("toy", "normal")) == 0


@pytest.mark.parametrize("field", ["prompt_2", "negative_prompt_2"])
@pytest.mark.parametrize(
    ("value", "code"), [("x" * 41, "string_too_long"), (3, "string_type"), ("\ud800", "string_unicode")]
)
async def test_checked_like_the_prompt(served, field, value, code):
    client, _ = served
    r = await post(client, model="toy-two", **{field: value})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert (err["field"], err["code"]) == (field, code)


async def test_clip_skip_within_the_models_range_reaches_the_worker(served):
    client, store = served
    cards = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}
    assert (
        cards["toy-two"]["limits"]["max_clip_skip"] == 3 and cards["toy"]["limits"]["max_clip_skip"] is None
    )
    given, left_out = await post(client, model="toy-two", clip_skip=3), await post(client, model="toy-two")
    assert given.status_code == left_out.status_code == 202, (given.text, left_out.text)
    assert given.json()["params"]["clip_skip"] == 3 and left_out.json()["params"]["clip_skip"] is None
    claimed = {d.job.id: d.job.params for d in await store.claim(["toy-two"], "w", 10, 100)}
    assert claimed[given.json()["id"]].clip_skip == 3


@pytest.mark.parametrize(
    ("model", "value", "code"),
    [
        ("toy", 1, "not_supported"),
        ("toy-two", 4, "out_of_range"),
        ("toy-two", -1, "greater_than_equal"),
        ("toy-two", 1.0, "int_type"),
        ("toy-two", True, "int_type"),
    ],
)
async def test_clip_skip_refused(served, model, value, code):
    client, store = served
    r = await post(client, model=model, clip_skip=value)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert (err["field"], err["code"]) == ("clip_skip", code)
    assert await store.redis.exists(store.stream_key(model, "normal")) == 0


async def test_taken_only_when_every_pool_of_the_model_takes_them(make_settings):
    """Two pools serve toy-two, one publishing none of these fields (an older worker, whose job params would drop
    them): the card says so and the fields are refused; the lower clip_skip bound of two pools holds."""
    older = TOY.model_copy(update={"id": "toy-two"})
    fewer = TOY_TWO.model_copy(update={"limits": TOY_TWO.limits.model_copy(update={"max_clip_skip": 1})})
    async with api_client(make_settings()) as (client, store):
        await FakeWorker(store, name="new", models=(TOY_TWO,)).register()
        await FakeWorker(store, name="fewer", models=(fewer,)).register()
        (card,) = (await client.get("/v1/models")).json()["data"]
        assert card["limits"]["prompt_2"] is True and card["limits"]["max_clip_skip"] == 1
        r = await post(client, model="toy-two", clip_skip=2)
        assert r.status_code == 422 and r.json()["error"]["code"] == "out_of_range", r.text
        await FakeWorker(store, name="old", models=(older,)).register()
        (card,) = (await client.get("/v1/models")).json()["data"]
        assert card["limits"]["prompt_2"] is False and card["limits"]["max_clip_skip"] is None
        for field, value in (("prompt_2", "oil"), ("clip_skip", 1)):
            r = await post(client, model="toy-two", **{field: value})
            assert r.status_code == 422 and r.json()["error"]["code"] == "not_supported", r.text
