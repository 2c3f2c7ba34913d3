"""Custom schedules, diffusers' `sigmas` / `timesteps` call arguments: each scheduler's schedule and whole loop
against diffusers' `set_timesteps(sigmas=...)` / `set_timesteps(timesteps=...)`, what each scheduler publishes
it takes (diffusers refuses the same), and the one rules check (meshserve/limits.py) the API and the pipelines
run.
"""

from __future__ import annotations

import inspect

import diffusers
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from meshserve.limits import LimitError, check_scheduler_arguments
from meshserve.models.schedulers import make_scheduler
from tests.models.test_flow_match_euler import FLUX_DEV
from tests.models.test_schedulers import (
    CLASS,
    NAMED,
    SHAPE,
    TOL,
    fake_model,
    ref_step_kwargs,
    rel_err,
    run_loop,
    sdxl_config,  # noqa: F401 - the module fixture
    torch_noises,
)

# Uneven on purpose: a custom schedule is nothing like the spaced one.
SIGMAS = [14.6, 9.0, 3.1, 1.7, 0.4, 0.0]  # Euler: 5 steps and the last one's end
TIMESTEPS = [999, 870, 512, 400, 90]


def build(config, name, changes=None):
    config = {**config, **(changes or {})}
    ref = getattr(diffusers, CLASS.get(name, name)).from_config({**config, **NAMED.get(name, {})})
    return make_scheduler(name, config), ref


CASES = [
    ("euler", {}, "sigmas", SIGMAS),
    ("euler", {}, "timesteps", TIMESTEPS),
    ("euler", dict(timestep_spacing="trailing", prediction_type="v_prediction"), "sigmas", SIGMAS),
    ("euler", dict(final_sigmas_type="sigma_min"), "sigmas", [*SIGMAS[:-1], 0.03]),
    ("euler_karras", {}, "sigmas", SIGMAS),  # given sigmas are not respaced
    ("dpmpp_2m", {}, "timesteps", TIMESTEPS),
    (
        "DPMSolverMultistepScheduler",  # the name dpmpp_2m is second order whatever the config says
        dict(final_sigmas_type="sigma_min", solver_order=3),
        "timesteps",
        TIMESTEPS,
    ),
    ("dpmpp_2m_sde", {}, "timesteps", TIMESTEPS),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[2]}-{'-'.join(c[1])}")
def test_custom_schedule_and_loop_match_diffusers(sdxl_config, case):  # noqa: F811
    name, changes, kind, values = case
    ours, ref = build(sdxl_config, name, changes)
    assert ours.scheduler_arguments()[kind]
    assert ours.scheduler_arguments()["max_sigma"] == (1e4 if "euler" in name else None)
    steps = len(values) - 1 if kind == "sigmas" else len(values)
    schedule = ours.schedule(steps, **{kind: values})
    ref.set_timesteps(**{kind: values})
    assert rel_err(schedule.timesteps, ref.timesteps.numpy()) <= TOL
    assert rel_err(schedule.sigmas, ref.sigmas.numpy()) <= TOL
    assert rel_err(ours.init_noise_sigma(schedule), float(ref.init_noise_sigma)) <= TOL

    latents = np.random.default_rng(3).standard_normal(SHAPE).astype(np.float32)
    noises = np.stack([n.numpy() for n in torch_noises(3, steps)])
    ref.set_timesteps(**{kind: values})
    ref.set_begin_index(0)
    sample = torch.from_numpy(latents) * ref.init_noise_sigma
    kwargs = ref_step_kwargs(ours, 3)
    for t in ref.timesteps:
        x_in = ref.scale_model_input(sample, t)
        sample = ref.step(fake_model(x_in, t.float(), torch), t, sample, **kwargs).prev_sample
    got = run_loop(ours, schedule, jnp.asarray(latents), jnp.asarray(noises))
    assert np.all(np.isfinite(sample.numpy()))
    assert rel_err(got, sample.numpy()) <= TOL


REFUSED = [
    ("euler_karras", {}, "timesteps"),
    ("euler", dict(timestep_type="continuous", prediction_type="v_prediction"), "timesteps"),
    ("dpmpp_2m_karras", {}, "timesteps"),
    ("dpmpp_2m", dict(use_lu_lambdas=True), "timesteps"),
]


@pytest.mark.parametrize("case", REFUSED, ids=lambda c: f"{c[0]}-{c[2]}-{'-'.join(c[1])}")
def test_refused_where_diffusers_refuses(sdxl_config, case):  # noqa: F811
    name, changes, kind = case
    ours, ref = build(sdxl_config, name, changes)
    assert not ours.scheduler_arguments()[kind]
    with pytest.raises(ValueError):
        ref.set_timesteps(**{kind: TIMESTEPS})
    with pytest.raises(ValueError, match="not supported"):
        ours.schedule(len(TIMESTEPS), **{kind: TIMESTEPS})


@pytest.mark.parametrize("name", ["euler_ancestral", "ddim"])
def test_schedulers_diffusers_gives_no_custom_schedule_publish_none(sdxl_config, name):  # noqa: F811
    ours, _ = build(sdxl_config, name)
    taken = ours.scheduler_arguments()
    assert not taken.get("sigmas") and not taken.get("timesteps")
    assert bool(taken.get("eta")) == (name == "ddim")  # DDIM's step takes diffusers' eta
    params = inspect.signature(getattr(diffusers, CLASS[name]).set_timesteps).parameters
    assert "sigmas" not in params and "timesteps" not in params


def test_ddim_eta_of_a_call_matches_diffusers_step_argument(sdxl_config):  # noqa: F811
    """diffusers' `eta` call argument reaches DDIM's step; ours carries it in the schedule (traced): a loop with
    eta 0.6 from a scheduler made without it equals diffusers' loop stepping with eta=0.6 (same noises), and
    eta 0 equals the deterministic loop."""
    ours, ref = build(sdxl_config, "ddim", dict(clip_sample=False))
    assert ours.scheduler_arguments()["eta"] and not ours.scheduler_arguments()["sigmas"]
    steps = 5
    latents = np.random.default_rng(5).standard_normal(SHAPE).astype(np.float32)
    noises = np.stack([n.numpy() for n in torch_noises(5, steps)])
    for eta in (0.0, 0.6):
        ref.set_timesteps(steps)
        gen = torch.Generator().manual_seed(5)
        sample = torch.from_numpy(latents)
        for t in ref.timesteps:
            x_in = ref.scale_model_input(sample, t)
            sample = ref.step(
                fake_model(x_in, t.float(), torch), t, sample, eta=eta, generator=gen
            ).prev_sample
        got = run_loop(ours, ours.schedule(steps, eta=eta), jnp.asarray(latents), jnp.asarray(noises))
        assert rel_err(got, sample.numpy()) <= TOL, eta
    with pytest.raises(ValueError, match="eta must be >= 0"):
        ours.schedule(steps, eta=-0.1)


@pytest.mark.parametrize("mu", [None, 0.8])
def test_flow_sigmas_match_diffusers_flux(mu):
    """FluxPipeline passes the caller's sigmas through set_timesteps(sigmas=, mu=): shifted, then a 0 appended."""
    config = FLUX_DEV if mu is not None else {**FLUX_DEV, "use_dynamic_shifting": False}
    ours = make_scheduler("flow_match_euler", config)
    ref = diffusers.FlowMatchEulerDiscreteScheduler.from_config(config)
    sigmas = [1.0, 0.83, 0.5, 0.31, 0.07]
    schedule = ours.schedule(len(sigmas), mu=mu, sigmas=sigmas)
    ref.set_timesteps(sigmas=sigmas, mu=mu)
    np.testing.assert_allclose(schedule.sigmas, ref.sigmas.numpy(), rtol=2e-7, atol=0)
    np.testing.assert_allclose(schedule.timesteps, ref.timesteps.numpy(), rtol=2e-7, atol=0)
    # Not the default schedule of 5 steps: the sigmas were used.
    assert not np.allclose(schedule.sigmas, ours.schedule(5, mu=mu).sigmas)
    assert ours.scheduler_arguments() | {"max_timestep": 0} == {
        "sigmas": True,
        "timesteps": False,
        "sigmas_end": False,
        "max_sigma": 1.0,
        "max_timestep": 0,
        "eta": False,
        "max_steps": None,
        "min_steps": None,
    }


# -------------------------------------------------------------------------------------------------
# The rules (meshserve/limits.py): what the API answers 422 to and a pipeline call raises for

EULER = {"sigmas": True, "timesteps": True, "sigmas_end": True, "max_sigma": 1e4, "max_timestep": 999}
FLOW = {"sigmas": True, "timesteps": False, "sigmas_end": False, "max_sigma": 1.0, "max_timestep": 999}
LIMITS = {"min_steps": 1, "max_steps": 8, "scheduler_arguments": {"default": EULER, "ddim": {}, "flow": FLOW}}


def test_eta_rules():
    ddim = {**FLOW, "sigmas": False, "eta": True}
    limits = {**LIMITS, "scheduler_arguments": {**LIMITS["scheduler_arguments"], "ddim": ddim}}
    assert check_scheduler_arguments(limits, {"eta": 0.5, "scheduler": "ddim"}) is None
    assert check_scheduler_arguments(limits, {"eta": 0}) is None  # diffusers' default: any scheduler
    for request, rule in (
        ({"eta": 0.5}, "not_supported"),
        ({"eta": 1.5, "scheduler": "ddim"}, "out_of_range"),
        ({"eta": -0.5, "scheduler": "ddim"}, "out_of_range"),
        ({"eta": float("nan"), "scheduler": "ddim"}, "number_type"),
        ({"eta": True, "scheduler": "ddim"}, "number_type"),
    ):
        with pytest.raises(LimitError) as e:
            check_scheduler_arguments(limits, request)
        assert (e.value.field, e.value.rule) == ("eta", rule), request


def test_a_scheduler_step_cap():
    """LCM's schedule holds at most its distillation's steps: the request's num_inference_steps, else the
    model's default, past the cap is out of range; a custom schedule is not capped (diffusers warns only)."""
    lcm = {**EULER, "sigmas": False, "max_steps": 4}
    limits = {**LIMITS, "scheduler_arguments": {**LIMITS["scheduler_arguments"], "lcm": lcm}}
    assert check_scheduler_arguments(limits, {"scheduler": "lcm", "num_inference_steps": 4}) is None
    assert check_scheduler_arguments(limits, {"scheduler": "lcm"}, default_steps=4) is None
    assert check_scheduler_arguments(limits, {"scheduler": "lcm", "timesteps": TIMESTEPS}) == 5
    assert check_scheduler_arguments(limits, {"num_inference_steps": 8}) is None  # no cap: the model's
    for request, default in (({"num_inference_steps": 5}, None), ({}, 30), ({"num_inference_steps": 5}, 2)):
        with pytest.raises(LimitError, match="at most 4 with scheduler 'lcm'") as e:
            check_scheduler_arguments(limits, {"scheduler": "lcm", **request}, default_steps=default)
        assert (e.value.field, e.value.rule) == ("num_inference_steps", "out_of_range")
    # PNDM's Runge-Kutta start: at least 4 steps, the model's default counted too.
    pndm = {**EULER, "sigmas": False, "min_steps": 4}
    limits = {**LIMITS, "scheduler_arguments": {**LIMITS["scheduler_arguments"], "pndm": pndm}}
    assert check_scheduler_arguments(limits, {"scheduler": "pndm", "num_inference_steps": 4}) is None
    for request, default in (({"num_inference_steps": 3}, None), ({}, 2)):
        with pytest.raises(LimitError, match="at least 4 with scheduler 'pndm'") as e:
            check_scheduler_arguments(limits, {"scheduler": "pndm", **request}, default_steps=default)
        assert (e.value.field, e.value.rule) == ("num_inference_steps", "out_of_range")


def test_steps_of_a_custom_schedule():
    assert check_scheduler_arguments(LIMITS, {}) is None
    assert check_scheduler_arguments(LIMITS, {"sigmas": SIGMAS}) == 5  # the last step's end included
    assert check_scheduler_arguments(LIMITS, {"timesteps": TIMESTEPS, "num_inference_steps": 5}) == 5
    assert check_scheduler_arguments(LIMITS, {"sigmas": [1.0, 0.5, 0.2], "scheduler": "flow"}) == 3


@pytest.mark.parametrize(
    "request_, field, rule",
    [
        ({"sigmas": SIGMAS, "timesteps": TIMESTEPS}, "timesteps", "conflict"),
        ({"sigmas": SIGMAS, "num_inference_steps": 6}, "num_inference_steps", "conflict"),
        ({"sigmas": SIGMAS, "scheduler": "ddim"}, "sigmas", "not_supported"),
        ({"sigmas": SIGMAS, "scheduler": "unlisted"}, "sigmas", "not_supported"),
        ({"timesteps": [900, 500], "scheduler": "flow"}, "timesteps", "not_supported"),
        ({"sigmas": [1.0]}, "sigmas", "out_of_range"),  # Euler: no step, only an end
        ({"timesteps": list(range(900, 0, -100))}, "timesteps", "out_of_range"),  # 9 > max_steps
        ({"sigmas": [3.0, 5.0, 0.0]}, "sigmas", "not_decreasing"),
        ({"timesteps": [500, 500]}, "timesteps", "not_decreasing"),
        ({"sigmas": [3.0, 0.0, -1.0]}, "sigmas", "out_of_range"),
        # float32 trouble: sigma^2 overflows (NaN in diffusers too), a subnormal start flushes to 0 (NaN).
        ({"sigmas": [1e30, 0.0]}, "sigmas", "out_of_range"),
        ({"sigmas": [14.6, 1e-40, 0.0]}, "sigmas", "out_of_range"),
        ({"sigmas": [0.5, 1e-12], "scheduler": "flow"}, "sigmas", "out_of_range"),
        ({"sigmas": [3.0, 0.0, 0.0]}, "sigmas", "not_decreasing"),
        ({"sigmas": [1.2, 0.5], "scheduler": "flow"}, "sigmas", "out_of_range"),
        ({"sigmas": [0.5, 0.0], "scheduler": "flow"}, "sigmas", "out_of_range"),  # a step from sigma 0
        ({"timesteps": [1000, 500]}, "timesteps", "out_of_range"),
        ({"timesteps": [500, -1]}, "timesteps", "out_of_range"),
        ({"timesteps": [500.5, 20]}, "timesteps", "int_type"),
        ({"sigmas": [float("nan"), 0.0]}, "sigmas", "number_type"),
        ({"sigmas": [float("inf"), 0.0]}, "sigmas", "number_type"),
    ],
)
def test_custom_schedule_rules(request_, field, rule):
    with pytest.raises(LimitError) as e:
        check_scheduler_arguments(LIMITS, request_, model="m")
    assert (e.value.field, e.value.rule) == (field, rule), str(e.value)


def test_an_out_of_range_error_quotes_the_value_at_fault():
    for request, bad in (
        ({"sigmas": [14.6, 9.9e-11, 0.0]}, "9.9e-11"),
        ({"sigmas": [2e4, 1.0, 0.0]}, "20000.0"),
        ({"sigmas": [3.0, 1.0, -0.5]}, "-0.5"),
        ({"timesteps": [1200, 5]}, "1200"),
    ):
        with pytest.raises(LimitError, match=f"got {bad}$"):
            check_scheduler_arguments(LIMITS, request)
