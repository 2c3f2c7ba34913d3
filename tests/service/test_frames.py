"""A video model's frame counts over HTTP (ASGI, real Redis): a pool serves only the `num_frames` it compiled
(`limits.frames.served`), so the API refuses any other with a 422 `frames_not_supported` naming the field, and
with several pools of one model admits only the counts every pool serves."""

from __future__ import annotations

import pytest

from meshserve.service.contract import ModelInfo
from tests.service.conftest import TOY_VIDEO, FakeWorker, api_client

pytestmark = pytest.mark.anyio


def served_frames(frames: list[int], default: int) -> ModelInfo:
    """TOY_VIDEO as a pool warmed up for `frames` publishes it."""
    fr = TOY_VIDEO.limits.frames.model_copy(update={"served": frames, "default": default})
    return TOY_VIDEO.model_copy(update={"limits": TOY_VIDEO.limits.model_copy(update={"frames": fr})})


def post(client, **body):
    return client.post("/v1/generate", json={"prompt": "waves", "model": TOY_VIDEO.id, **body})


async def test_only_served_frame_counts_are_admitted(make_settings):
    async with api_client(make_settings()) as (client, store):
        await FakeWorker(store, name="video-a", models=(served_frames([9, 17], 9),)).register()
        for n in (9, 17):
            r = await post(client, num_frames=n)
            assert r.status_code == 202, r.text
            assert r.json()["params"]["num_frames"] == n
        assert (await post(client)).json()["params"]["num_frames"] == 9  # the default is served
        # 13 frames passes the model's own rule (4k+1 in [5, 33]) but was not compiled: refused, naming the field.
        r = await post(client, num_frames=13)
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert (err["field"], err["code"]) == ("num_frames", "frames_not_supported")
        assert "9, 17" in err["message"]
        # The model's own rules still come first.
        r = await post(client, num_frames=12)
        assert (r.status_code, r.json()["error"]["code"]) == (422, "not_multiple")
        card = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}[TOY_VIDEO.id]
        assert card["limits"]["frames"]["served"] == [9, 17]


async def test_pools_of_one_model_serve_their_common_frame_counts(make_settings):
    async with api_client(make_settings()) as (client, store):
        await FakeWorker(store, name="video-a", models=(served_frames([9, 17], 9),)).register()
        await FakeWorker(store, name="video-b", models=(served_frames([17, 33], 17),)).register()
        r = await post(client, num_frames=9)  # pool b did not compile 9 frames: any pool may take the job
        assert r.status_code == 422, r.text
        assert r.json()["error"]["code"] == "frames_not_supported"
        r = await post(client)  # the default moves to the first common count
        assert r.status_code == 202, r.text
        assert r.json()["params"]["num_frames"] == 17
        card = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}[TOY_VIDEO.id]
        assert (card["limits"]["frames"]["served"], card["limits"]["frames"]["default"]) == ([17], 17)


async def test_no_served_list_admits_every_count_the_rule_allows(make_settings):
    # An any_size pool publishes served=None: every 4k+1 count in range is admitted (and compiles on demand).
    async with api_client(make_settings()) as (client, store):
        await FakeWorker(store, name="video-any", models=(TOY_VIDEO,)).register()
        r = await post(client, num_frames=13)
        assert r.status_code == 202, r.text
