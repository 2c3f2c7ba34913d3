"""`fps` over HTTP (ASGI, real Redis): a video model's outputs are written at the request's frame rate or, left
out, the model's published one (Wan: 16); an image model refuses the field with a 422 naming it."""

from __future__ import annotations

import pytest

from meshserve.service.contract import ModelDefaults, ModelInfo
from tests.service.conftest import TOY, TOY_VIDEO, FakeWorker, api_client

pytestmark = pytest.mark.anyio

# The toy video model as a Wan pool publishes it: its defaults carry the frame rate.
TOY_VIDEO_24 = ModelInfo(
    id="toy-video-24",
    family=TOY_VIDEO.family,
    task=TOY_VIDEO.task,
    defaults=ModelDefaults(**{**TOY_VIDEO.defaults.model_dump(), "fps": 24}),
    limits=TOY_VIDEO.limits,
)


@pytest.fixture
async def client(make_settings):
    async with api_client(make_settings()) as (client, store):
        await FakeWorker(store, name="mixed", models=(TOY, TOY_VIDEO, TOY_VIDEO_24)).register()
        yield client


def post(client, **body):
    return client.post("/v1/generate", json={"prompt": "waves", **body})


async def test_image_model_refuses_fps(client):
    r = await post(client, model=TOY.id, fps=12)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert (err["field"], err["code"]) == ("fps", "not_supported")
    r = await post(client, model=TOY.id)
    assert r.status_code == 202 and r.json()["params"]["fps"] is None


async def test_video_fps_from_request_then_model_then_default(client):
    r = await post(client, model="toy-video-24", fps=8)
    assert r.status_code == 202, r.text
    assert r.json()["params"]["fps"] == 8
    assert (await post(client, model="toy-video-24")).json()["params"]["fps"] == 24
    # A video model that publishes no rate is written at the default (Wan 2.1's 16).
    assert (await post(client, model=TOY_VIDEO.id)).json()["params"]["fps"] == 16
    cards = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}
    assert cards["toy-video-24"]["defaults"]["fps"] == 24
    assert "fps" not in cards[TOY.id]["defaults"]


@pytest.mark.parametrize("value", [0, -1, 121, 2.5, "fast"])
async def test_fps_range_checked(client, value):
    r = await post(client, model="toy-video-24", fps=value)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["field"] == "fps"
