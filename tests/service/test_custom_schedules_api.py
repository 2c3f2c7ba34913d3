"""diffusers' custom `sigmas` / `timesteps` over HTTP (ASGI, real Redis): taken where the model's
`limits.scheduler_arguments` lists the job's scheduler for them, the step count theirs, carried in the job to the
worker; refused with a 422 naming the field and the rule otherwise (meshserve/limits.py has the rules, checked
in full in tests/models/test_scheduler_arguments.py), and nothing queued."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from meshserve.service.api.catalog import common_sizes
from meshserve.service.contract import SchedulerArguments, StrengthLimits
from tests.service.conftest import TOY, FakeWorker, api_client

pytestmark = pytest.mark.anyio

EULER = SchedulerArguments(sigmas=True, timesteps=True, sigmas_end=True)
DDIM = SchedulerArguments(eta=True)
LCM = SchedulerArguments(timesteps=True, max_steps=3)  # a cap under the model's (LCM's original steps)
TOY_CUSTOM = TOY.model_copy(
    update={
        "id": "toy-custom",
        "limits": TOY.limits.model_copy(
            update={
                "scheduler_arguments": {"default": EULER, "euler": EULER, "ddim": DDIM, "lcm": LCM},
                "schedulers": ["euler", "ddim", "lcm"],
                "max_steps": 8,
                "tasks": ["text-to-image", "image-to-image"],
                "strength": StrengthLimits(defaults={"image-to-image": 0.3}, rule="int"),
            }
        ),
    }
)


@pytest.fixture
async def served(make_settings):
    async with api_client(make_settings()) as (client, store):
        await FakeWorker(store, name="mixed", models=(TOY_CUSTOM, TOY)).register()
        yield client, store


async def test_taken_and_carried_to_the_worker_with_their_step_count(served):
    client, store = served
    card = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}["toy-custom"]
    assert card["limits"]["scheduler_arguments"]["euler"]["sigmas_end"] is True
    sigmas = await client.post(
        "/v1/generate", json={"model": "toy-custom", "prompt": "a", "sigmas": [14.6, 3, 0.5, 0]}
    )
    timesteps = await client.post(
        "/v1/generate",
        json={"model": "toy-custom", "prompt": "a", "scheduler": "euler", "timesteps": [999, 500]},
    )
    assert sigmas.status_code == timesteps.status_code == 202, (sigmas.text, timesteps.text)
    assert sigmas.json()["params"]["num_inference_steps"] == 3  # 4 sigmas: 3 steps and the last one's end
    assert timesteps.json()["params"]["num_inference_steps"] == 2
    claimed = {d.job.id: d.job.params for d in await store.claim(["toy-custom"], "w", 10, 100)}
    assert claimed[sigmas.json()["id"]].sigmas == (14.6, 3.0, 0.5, 0.0)
    assert claimed[timesteps.json()["id"]].timesteps == (999, 500)
    assert claimed[sigmas.json()["id"]].timesteps is None


async def test_eta_taken_by_ddim_and_zero_by_any(served):
    client, store = served
    body = {"model": "toy-custom", "prompt": "a"}
    ddim = await client.post("/v1/generate", json={**body, "scheduler": "ddim", "eta": 0.5})
    zero = await client.post("/v1/generate", json={**body, "scheduler": "euler", "eta": 0})
    assert ddim.status_code == zero.status_code == 202, (ddim.text, zero.text)
    claimed = {d.job.id: d.job.params for d in await store.claim(["toy-custom"], "w", 10, 100)}
    assert claimed[ddim.json()["id"]].eta == 0.5 and claimed[zero.json()["id"]].eta is None


async def test_a_scheduler_step_cap_takes_steps_up_to_it_and_custom_timesteps(served):
    client, _ = served
    body = {"model": "toy-custom", "prompt": "a", "scheduler": "lcm"}
    capped = await client.post("/v1/generate", json={**body, "num_inference_steps": 3})
    custom = await client.post("/v1/generate", json={**body, "timesteps": [999, 759, 499, 259]})
    assert capped.status_code == custom.status_code == 202, (capped.text, custom.text)
    assert custom.json()["params"]["num_inference_steps"] == 4  # the cap is on spaced schedules only
    card = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}["toy-custom"]
    assert card["limits"]["scheduler_arguments"]["lcm"]["max_steps"] == 3


@pytest.mark.parametrize(
    "body,field,code",
    [
        ({"model": "toy", "sigmas": [3.0, 1.0, 0.0]}, "sigmas", "not_supported"),
        ({"scheduler": "ddim", "sigmas": [3.0, 1.0, 0.0]}, "sigmas", "not_supported"),
        ({"sigmas": [3.0, 1.0, 0.0], "timesteps": [900, 10]}, "timesteps", "conflict"),
        ({"sigmas": [3.0, 1.0, 0.0], "num_inference_steps": 4}, "num_inference_steps", "conflict"),
        ({"sigmas": [1.0, 3.0, 0.0]}, "sigmas", "not_decreasing"),
        ({"sigmas": [3.0, 0.0, -1.0]}, "sigmas", "out_of_range"),
        ({"sigmas": [float(10 - i) for i in range(10)]}, "sigmas", "out_of_range"),  # 9 steps > max_steps 8
        ({"timesteps": [1000, 10]}, "timesteps", "out_of_range"),
        ({"timesteps": [900.5, 10]}, "timesteps.0", "int_type"),
        ({"timesteps": []}, "timesteps", "too_short"),
        ({"sigmas": "3, 1, 0"}, "sigmas", "list_type"),
        ({"sigmas": [3.0] * 1002}, "sigmas", "too_long"),
        ({"eta": 0.5}, "eta", "not_supported"),  # the model's own scheduler (euler) takes none
        ({"scheduler": "ddim", "eta": 1.5}, "eta", "less_than_equal"),
        ({"scheduler": "ddim", "eta": "0.5"}, "eta", "float_type"),
        # The scheduler's own cap: asked for, or the model's default steps (4) beyond it.
        ({"scheduler": "lcm", "num_inference_steps": 5}, "num_inference_steps", "out_of_range"),
        ({"scheduler": "lcm"}, "num_inference_steps", "out_of_range"),
    ],
)
async def test_refused_with_the_field_and_the_rule(served, body, field, code):
    client, store = served
    r = await client.post("/v1/generate", json={"model": "toy-custom", "prompt": "a", **body})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert (err["field"], err["code"]) == (field, code), err
    for model in ("toy", "toy-custom"):
        assert await store.redis.exists(store.stream_key(model, "normal")) == 0


@pytest.mark.parametrize(
    "body,field",
    [
        ({"sigmas": [14.6, 3.0, 0.0]}, "sigmas"),  # the default strength 0.3 of 2 steps runs none
        ({"timesteps": [900, 500]}, "timesteps"),
        ({"sigmas": [14.6, 3.0, 0.0], "strength": 0.4}, "strength"),
    ],
)
async def test_an_image_task_with_too_few_custom_steps_names_what_set_them(served, body, field):
    client, _ = served
    image = "data:image/png;base64," + base64.b64encode(_png()).decode()
    r = await client.post("/v1/generate", json={"model": "toy-custom", "prompt": "a", "image": image, **body})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert (err["field"], err["code"]) == (field, "no_steps"), err
    assert "num_inference_steps" not in err["message"], err
    if field == "sigmas":  # 4 Euler steps are 5 sigmas (the last step's end)
        assert "at least 4 steps (5 sigmas)" in err["message"], err


def _png() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 10, 10)).save(buffer, "PNG")
    return buffer.getvalue()


async def test_non_finite_sigmas_are_refused(served):
    client, _ = served
    r = await client.post(
        "/v1/generate",
        content='{"model": "toy-custom", "prompt": "a", "sigmas": [NaN, 0]}',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 422, r.text
    assert r.json()["error"]["field"].startswith("sigmas")


def test_pools_of_one_model_publish_the_schedules_they_share():
    other = TOY_CUSTOM.model_copy(
        update={
            "limits": TOY_CUSTOM.limits.model_copy(
                update={
                    "scheduler_arguments": {
                        "default": EULER,
                        "euler": EULER.model_copy(update={"timesteps": False}),
                    }
                }
            )
        }
    )
    assert common_sizes([TOY_CUSTOM, other]).limits.scheduler_arguments == {"default": EULER}
    assert common_sizes([TOY_CUSTOM, TOY]).limits.scheduler_arguments == {}
