"""meshserve.models.schedulers against diffusers' schedulers: schedules, single steps, and whole jitted loops.

Every case starts from the tiny SDXL scheduler_config.json (written by diffusers' save_config from
tests/fixtures/tiny_sdxl.SCHEDULER) with a few keys changed, and builds diffusers' class from the same dict
with `from_config`. Random draws of the stochastic schedulers are fed to both sides: diffusers draws them from
a torch.Generator, we replay the same generator's draws as explicit `noise`.
"""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from functools import partial
from pathlib import Path

import diffusers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from meshserve.models.schedulers import _BY_CLASS, SCHEDULER_NAMES, make_scheduler, pad_schedule
from meshserve.models.schedulers.common import RESPACINGS
from tests.fixtures.tiny_sdxl import SCHEDULER

TOL = 1e-4  # fp32 relative error budget of the house rules
SHAPE = (2, 4, 8, 8)  # schedulers are elementwise: any layout, tiny latents

CLASS = {
    "euler": "EulerDiscreteScheduler",
    "euler_ancestral": "EulerAncestralDiscreteScheduler",
    "ddim": "DDIMScheduler",
    "ddpm": "DDPMScheduler",
    "deis": "DEISMultistepScheduler",
    "pndm": "PNDMScheduler",
    "dpmpp_2m": "DPMSolverMultistepScheduler",
    "dpmpp_2m_sde": "DPMSolverMultistepScheduler",
    "euler_karras": "EulerDiscreteScheduler",
    "dpmpp_2m_karras": "DPMSolverMultistepScheduler",
    "dpmpp_2m_sde_karras": "DPMSolverMultistepScheduler",
    "dpmpp_2s": "DPMSolverSinglestepScheduler",
    "lcm": "LCMScheduler",
    "tcd": "TCDScheduler",
    "unipc": "UniPCMultistepScheduler",
    "heun": "HeunDiscreteScheduler",
    "dpm2": "KDPM2DiscreteScheduler",
    "dpm2_karras": "KDPM2DiscreteScheduler",
    "lms": "LMSDiscreteScheduler",
    "lms_karras": "LMSDiscreteScheduler",
    "dpmpp_sde": "DPMSolverSDEScheduler",
    "dpmpp_sde_karras": "DPMSolverSDEScheduler",
    "dpm2_ancestral": "KDPM2AncestralDiscreteScheduler",
    "dpm2_ancestral_karras": "KDPM2AncestralDiscreteScheduler",
}
VPRED_ZSNR = dict(prediction_type="v_prediction", rescale_betas_zero_snr=True, timestep_spacing="trailing")
SDE = dict(algorithm_type="sde-dpmsolver++")
# An EDM folder's own sigma range (the SDXL config's sigma_min / sigma_max are null: Euler's "use the schedule's").
EDM = dict(sigma_min=0.002, sigma_max=80.0)
# What a name means in diffusers' terms (its docs' A1111 table), given to the reference alone: ours must read
# the same from the name.
KARRAS = dict(use_karras_sigmas=True, use_exponential_sigmas=False, use_beta_sigmas=False)
DPMPP_2 = dict(algorithm_type="dpmsolver++", solver_order=2)
NAMED = {
    "dpmpp_2m": DPMPP_2,
    "dpmpp_2s": DPMPP_2,
    "dpmpp_2m_sde": dict(SDE, solver_order=2),
    "euler_karras": KARRAS,
    "dpmpp_2m_karras": dict(DPMPP_2, **KARRAS, use_lu_lambdas=False),
    "dpmpp_2m_sde_karras": dict(SDE, solver_order=2, **KARRAS, use_lu_lambdas=False),
    "dpm2_karras": KARRAS,
    "lms_karras": KARRAS,
    "dpmpp_sde_karras": KARRAS,
    "dpm2_ancestral_karras": KARRAS,
}

# (name, config changes over the tiny SDXL config, runtime overrides)
CASES = [
    ("euler", {}, {}),
    ("euler", dict(use_karras_sigmas=True), {}),
    ("euler", dict(timestep_spacing="trailing"), {}),
    ("euler", dict(timestep_spacing="linspace", prediction_type="v_prediction"), {}),
    ("euler", dict(prediction_type="sample"), {}),
    ("euler", dict(beta_schedule="squaredcos_cap_v2", timestep_spacing="linspace"), {}),
    ("euler", dict(beta_schedule="linear", beta_start=0.0001, beta_end=0.02), {}),
    ("euler", VPRED_ZSNR, {}),
    ("euler", dict(use_karras_sigmas=True, final_sigmas_type="sigma_min"), {}),
    ("euler", dict(use_karras_sigmas=True, sigma_min=0.1, sigma_max=10.0), {}),
    ("euler", dict(interpolation_type="log_linear"), {}),
    (
        "euler",
        dict(timestep_type="continuous", prediction_type="v_prediction", timestep_spacing="linspace"),
        {},
    ),
    ("euler", dict(use_exponential_sigmas=True), {}),
    ("euler", dict(use_beta_sigmas=True), {}),
    ("euler", dict(trained_betas=list(np.linspace(0.001, 0.02, 1000))), {}),
    ("euler_ancestral", {}, {}),
    ("euler_ancestral", dict(timestep_spacing="trailing"), {}),
    ("euler_ancestral", dict(timestep_spacing="linspace", prediction_type="v_prediction"), {}),
    ("euler_ancestral", VPRED_ZSNR, {}),
    ("ddim", {}, {}),
    ("ddim", dict(clip_sample=False, timestep_spacing="trailing"), {}),
    ("ddim", dict(VPRED_ZSNR, clip_sample=False), {}),
    ("ddim", dict(set_alpha_to_one=False, timestep_spacing="linspace", clip_sample=False), {}),
    ("ddim", dict(prediction_type="sample", clip_sample_range=0.5), {}),
    ("ddim", dict(thresholding=True, dynamic_thresholding_ratio=0.9, sample_max_value=1.5), {}),
    ("ddim", dict(clip_sample=False), dict(eta=0.7)),
    # DDPM: the posterior mean plus noise of its fixed variance, none at timestep 0.
    ("ddpm", {}, {}),
    ("ddpm", dict(clip_sample=False, timestep_spacing="trailing"), {}),
    ("ddpm", dict(VPRED_ZSNR, clip_sample=False), {}),
    ("ddpm", dict(timestep_spacing="linspace", variance_type="fixed_large", clip_sample=False), {}),
    ("ddpm", dict(variance_type="fixed_small_log", prediction_type="sample", clip_sample_range=0.5), {}),
    ("ddpm", dict(thresholding=True, dynamic_thresholding_ratio=0.9, sample_max_value=1.5), {}),
    # PNDM: PLMS (skip_prk_steps, SD's configs) and the Runge-Kutta start (the class's default).
    ("pndm", dict(skip_prk_steps=True), {}),
    ("pndm", {}, {}),
    ("pndm", dict(skip_prk_steps=True, timestep_spacing="trailing", prediction_type="v_prediction"), {}),
    ("pndm", dict(timestep_spacing="linspace", set_alpha_to_one=True), {}),
    ("pndm", dict(VPRED_ZSNR, skip_prk_steps=True), {}),
    # DEIS: DPM-Solver's loop over noise predictions; a DPM-Solver folder's config read as DEIS reads it.
    ("deis", {}, {}),
    ("deis", dict(timestep_spacing="trailing", prediction_type="v_prediction"), {}),
    ("deis", dict(prediction_type="sample", thresholding=True, sample_max_value=1.2), {}),
    ("deis", dict(use_karras_sigmas=True, beta_schedule="squaredcos_cap_v2"), {}),
    ("deis", dict(use_exponential_sigmas=True, steps_offset=1, timestep_spacing="leading"), {}),
    ("deis", dict(use_beta_sigmas=True), {}),
    ("deis", dict(algorithm_type="dpmsolver++", solver_type="midpoint", final_sigmas_type="zero"), {}),
    ("DEISMultistepScheduler", dict(solver_order=1), {}),
    ("DEISMultistepScheduler", dict(solver_order=3), {}),
    ("DEISMultistepScheduler", dict(solver_order=3, lower_order_final=False), {}),
    ("dpmpp_2m", {}, {}),
    ("dpmpp_2m", dict(use_karras_sigmas=True), {}),
    ("dpmpp_2m", dict(timestep_spacing="trailing"), {}),
    ("dpmpp_2m", dict(timestep_spacing="linspace", prediction_type="v_prediction"), {}),
    ("dpmpp_2m", dict(prediction_type="sample"), {}),
    ("dpmpp_2m", dict(final_sigmas_type="sigma_min", lower_order_final=False), {}),
    ("dpmpp_2m", dict(solver_type="heun"), {}),
    ("dpmpp_2m", dict(euler_at_final=True, final_sigmas_type="sigma_min"), {}),
    ("dpmpp_2m", dict(use_exponential_sigmas=True), {}),
    ("dpmpp_2m", dict(use_beta_sigmas=True), {}),
    ("dpmpp_2m", dict(use_lu_lambdas=True), {}),
    ("dpmpp_2m", VPRED_ZSNR, {}),
    ("dpmpp_2m", dict(thresholding=True, prediction_type="sample", sample_max_value=1.2), {}),
    (
        "dpmpp_2m",
        dict(beta_schedule="squaredcos_cap_v2", lambda_min_clipped=-5.1, use_karras_sigmas=True),
        {},
    ),
    ("DPMSolverMultistepScheduler", dict(solver_order=1), {}),
    ("DPMSolverMultistepScheduler", dict(solver_order=3), {}),
    (
        "DPMSolverMultistepScheduler",
        dict(solver_order=3, final_sigmas_type="sigma_min", lower_order_final=False),
        {},
    ),
    ("dpmpp_2m_sde", SDE, {}),
    ("dpmpp_2m_sde", dict(SDE, solver_type="heun", use_karras_sigmas=True), {}),
    ("DPMSolverMultistepScheduler", dict(SDE, solver_order=3), {}),
    ("euler_karras", {}, {}),
    ("dpmpp_2m_karras", {}, {}),
    ("dpmpp_2m_sde_karras", {}, {}),
    # DPM-Solver singlestep: its groups of 1-3 steps from the group's first sample; the config's timestep
    # spacing and offset mean nothing to it (diffusers' class has neither: linspace timesteps).
    ("dpmpp_2s", {}, {}),
    ("dpmpp_2s", dict(prediction_type="v_prediction", timestep_spacing="trailing", steps_offset=1), {}),
    ("dpmpp_2s", dict(SDE, solver_type="heun", use_karras_sigmas=True), {}),
    ("DPMSolverSinglestepScheduler", dict(solver_order=3), {}),
    ("DPMSolverSinglestepScheduler", dict(SDE, solver_order=3), {}),
    (
        "DPMSolverSinglestepScheduler",
        dict(solver_order=3, solver_type="heun", use_exponential_sigmas=True, final_sigmas_type="sigma_min"),
        {},
    ),
    # A folder's own other sigma setting: the Karras name wins (NAMED turns it off for diffusers too).
    ("euler_karras", dict(use_beta_sigmas=True), {}),
    ("dpmpp_2m_karras", dict(use_lu_lambdas=True), {}),
    ("dpmpp_2m_sde_karras", dict(use_exponential_sigmas=True), {}),
    # LCM reads the SDXL folder's config as diffusers' LCMScheduler.from_config does (LCM-LoRA's recipe).
    ("lcm", {}, {}),
    ("lcm", dict(prediction_type="v_prediction", rescale_betas_zero_snr=True), {}),
    ("lcm", dict(original_inference_steps=40, timestep_scaling=5.0), {}),
    ("lcm", dict(prediction_type="sample", clip_sample=True, clip_sample_range=0.5), {}),
    ("lcm", dict(thresholding=True, prediction_type="sample", sample_max_value=1.2), {}),
    ("lcm", dict(set_alpha_to_one=False, beta_schedule="linear", beta_start=0.0001, beta_end=0.02), {}),
    # TCD: gamma is diffusers' step argument eta (0: its pipelines' default, deterministic).
    ("tcd", {}, {}),
    ("tcd", {}, dict(eta=0.3)),
    ("tcd", dict(prediction_type="v_prediction", rescale_betas_zero_snr=True), dict(eta=0.5)),
    ("tcd", dict(prediction_type="sample", original_inference_steps=40, clip_sample=True), dict(eta=1.0)),
    # UniPC's VP form, as "unipc" reads a beta-schedule (SDXL) folder's config (its flow form: test_unipc.py).
    ("unipc", {}, {}),
    ("unipc", dict(timestep_spacing="trailing"), {}),
    ("unipc", dict(timestep_spacing="linspace", prediction_type="v_prediction"), {}),
    ("unipc", dict(prediction_type="sample"), {}),
    ("unipc", dict(beta_schedule="squaredcos_cap_v2", timestep_spacing="linspace"), {}),
    ("unipc", VPRED_ZSNR, {}),
    ("unipc", dict(solver_type="bh1", final_sigmas_type="sigma_min"), {}),
    ("unipc", dict(disable_corrector=[1, 2]), {}),
    ("unipc", dict(use_karras_sigmas=True), {}),
    ("unipc", dict(use_karras_sigmas=True, final_sigmas_type="sigma_min"), {}),
    ("unipc", dict(use_exponential_sigmas=True), {}),
    ("unipc", dict(use_beta_sigmas=True), {}),
    ("unipc", dict(use_karras_sigmas=True, beta_schedule="squaredcos_cap_v2"), {}),
    # diffusers' k-diffusion ports: Heun and DPM2 (two model calls a step but the last), LMS (4 slopes).
    ("heun", {}, {}),
    ("heun", dict(use_karras_sigmas=True), {}),
    ("heun", dict(timestep_spacing="trailing"), {}),
    ("heun", dict(timestep_spacing="linspace", prediction_type="v_prediction"), {}),
    ("heun", dict(prediction_type="sample", clip_sample=True, clip_sample_range=0.5), {}),
    ("heun", dict(use_exponential_sigmas=True, steps_offset=1), {}),
    ("heun", VPRED_ZSNR, {}),  # diffusers' Heun has no zero-SNR setting: the key is ignored by both
    ("dpm2", {}, {}),
    ("dpm2", dict(timestep_spacing="trailing"), {}),
    ("dpm2", dict(timestep_spacing="linspace", prediction_type="v_prediction"), {}),
    ("dpm2", dict(beta_schedule="squaredcos_cap_v2", use_exponential_sigmas=True), {}),
    ("dpm2_karras", {}, {}),
    ("dpm2_karras", dict(use_beta_sigmas=True), {}),
    ("lms", {}, {}),
    ("lms", dict(timestep_spacing="trailing"), {}),
    ("lms", dict(timestep_spacing="linspace", prediction_type="v_prediction"), {}),
    ("lms", dict(prediction_type="sample"), {}),
    ("lms", dict(use_exponential_sigmas=True), {}),
    ("lms_karras", {}, {}),
    # EDM-trained folders' DPM-Solver++ (Playground v2.5): EDM's sigmas and preconditioning, no beta schedule.
    ("EDMDPMSolverMultistepScheduler", EDM, {}),
    ("EDMDPMSolverMultistepScheduler", dict(EDM, sigma_schedule="exponential", sigma_max=120.0), {}),
    ("EDMDPMSolverMultistepScheduler", dict(EDM, prediction_type="v_prediction", solver_order=3), {}),
    ("EDMDPMSolverMultistepScheduler", dict(EDM, algorithm_type="sde-dpmsolver++"), {}),
    (
        "EDMDPMSolverMultistepScheduler",
        # (sigma_min ends where the sigmas end: a zero last interval, NaN in diffusers' second order at 15+
        # steps; euler_at_final takes a first-order last step)
        dict(EDM, final_sigmas_type="sigma_min", euler_at_final=True, solver_type="heun", sigma_data=1.0),
        {},
    ),
    ("EDMEulerScheduler", EDM, {}),
    ("EDMEulerScheduler", dict(EDM, sigma_schedule="exponential", prediction_type="v_prediction"), {}),
    ("EDMEulerScheduler", dict(EDM, final_sigmas_type="sigma_min", sigma_data=1.0, rho=5.0), {}),
    ("UniPCMultistepScheduler", dict(solver_order=1), {}),
    # UniPC over noise predictions (predict_x0=False: its schedule must end at sigma_min) and thresholded x0.
    ("UniPCMultistepScheduler", dict(predict_x0=False, final_sigmas_type="sigma_min"), {}),
    (
        "UniPCMultistepScheduler",
        dict(predict_x0=False, final_sigmas_type="sigma_min", solver_order=3, prediction_type="v_prediction"),
        {},
    ),
    (
        "unipc",
        dict(predict_x0=False, final_sigmas_type="sigma_min", solver_type="bh1", prediction_type="sample"),
        {},
    ),
    ("unipc", dict(thresholding=True, prediction_type="sample", sample_max_value=1.2), {}),
    ("UniPCMultistepScheduler", dict(solver_order=3), {}),
    (
        "UniPCMultistepScheduler",
        dict(solver_order=3, final_sigmas_type="sigma_min", lower_order_final=False),
        {},
    ),
]


def case_id(case) -> str:
    name, changes, runtime = case
    parts = [f"{k}={v}" for k, v in {**changes, **runtime}.items() if k != "trained_betas"]
    parts += ["trained_betas"] if "trained_betas" in changes else []
    return "-".join([name, *parts]) or name


def rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return float(np.max(np.abs(ours - ref)) / max(np.max(np.abs(ref)), 1e-30))


@pytest.fixture(scope="module")
def sdxl_config(tmp_path_factory) -> dict:
    """The tiny SDXL scheduler_config.json exactly as a diffusers folder holds it."""
    folder = tmp_path_factory.mktemp("scheduler")
    diffusers.EulerDiscreteScheduler(**SCHEDULER).save_config(str(folder))
    return json.loads((folder / "scheduler_config.json").read_text())


def build(sdxl_config: dict, case):
    """(ours, diffusers') for a case: the same config dict into make_scheduler and Class.from_config."""
    name, changes, runtime = case
    config = {**sdxl_config, **changes}
    ref_cls = getattr(diffusers, CLASS.get(name, name))
    return make_scheduler(name, config, **runtime), ref_cls.from_config({**config, **NAMED.get(name, {})})


def fake_model(x, t, xp):
    """A fixed stand-in for the UNet, the same function of (input, timestep) in torch and jax."""
    return xp.sin(x * 1.3 + t / 250.0) * 0.8 + 0.1 * x


def torch_noises(seed: int, n: int) -> list[torch.Tensor]:
    """The draws diffusers' step makes from torch.Generator().manual_seed(seed): one randn per step."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=gen) for _ in range(n)]


def ref_step_kwargs(ours, seed: int) -> dict:
    kwargs = {"generator": torch.Generator().manual_seed(seed)} if ours.stochastic else {}
    if hasattr(ours, "eta"):  # DDIM's and TCD's step argument
        kwargs["eta"] = ours.eta
    return kwargs


# -------------------------------------------------------------------------------------------------
# Schedules


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("steps", [1, 5, 30])
def test_schedule_matches_diffusers(sdxl_config, case, steps):
    ours, ref = build(sdxl_config, case)
    if case[0] == "pndm" and not ours.skip_prk_steps and steps < 4:  # diffusers' Runge-Kutta start fails too
        with pytest.raises(ValueError, match="at least 4 steps"):
            ours.schedule(steps)
        return
    schedule = ours.schedule(steps)
    ref.set_timesteps(steps)
    assert rel_err(schedule.timesteps, ref.timesteps.numpy()) <= TOL
    if hasattr(schedule, "sigmas"):
        assert rel_err(schedule.sigmas, ref.sigmas.numpy()) <= TOL
    elif case[0] != "pndm":  # DDIM, DDPM, LCM: alpha_bar at each step's timestep (PNDM's: its loops)
        t = ref.timesteps.numpy()
        assert rel_err(schedule.alpha_prod_t, ref.alphas_cumprod.numpy()[t]) <= TOL
    assert rel_err(ours.init_noise_sigma(schedule), float(ref.init_noise_sigma)) <= TOL
    assert schedule.timesteps.dtype == np.float32


@pytest.mark.parametrize("name", SCHEDULER_NAMES)
def test_new_step_count_gives_new_schedule(sdxl_config, name):
    ours, ref = build(sdxl_config, (name, {}, {}))
    first = ours.schedule(10)
    second = ours.schedule(25)
    ref.set_timesteps(10)
    ref.set_timesteps(25)
    assert first.timesteps.shape == (ours.model_calls(10),)
    assert second.timesteps.shape == (ours.model_calls(25),)
    assert rel_err(second.timesteps, ref.timesteps.numpy()) <= TOL
    if hasattr(second, "sigmas"):
        assert rel_err(second.sigmas, ref.sigmas.numpy()) <= TOL
    # Making a schedule changes nothing in the scheduler: the 10-step one is made again identically.
    np.testing.assert_array_equal(ours.schedule(10).timesteps, first.timesteps)


def test_trailing_spacing_keeps_requested_step_count(sdxl_config):
    """Deliberate deviation: diffusers' trailing arange gives 62 timesteps for 61 steps, the last being -1."""
    for name in ("euler", "ddim", "dpmpp_2m"):
        ours, ref = build(sdxl_config, (name, dict(timestep_spacing="trailing"), {}))
        schedule = ours.schedule(61)
        ref.set_timesteps(61)
        assert ref.timesteps.shape == (62,) and int(ref.timesteps[-1]) == -1
        assert schedule.timesteps.shape == (61,)
        np.testing.assert_array_equal(schedule.timesteps, ref.timesteps.numpy()[:61].astype(np.float32))
        if hasattr(schedule, "sigmas"):
            assert rel_err(schedule.sigmas[:61], ref.sigmas.numpy()[:61]) <= TOL
            assert schedule.sigmas[-1] == 0.0


# -------------------------------------------------------------------------------------------------
# One step


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_step_matches_diffusers(sdxl_config, case):
    """Step 0 for every scheduler; also step 2 for the one-step methods (DPM-Solver's later steps need its
    history, which the loop test covers)."""
    ours, ref = build(sdxl_config, case)
    steps = 5
    schedule = ours.schedule(steps)
    rng = np.random.default_rng(0)
    sample = rng.standard_normal(SHAPE).astype(np.float32) * 3
    model_output = rng.standard_normal(SHAPE).astype(np.float32)
    indices = [0] if "DPMSolver" in type(ours).__name__ else [0, 2]
    for i in indices:
        ref.set_timesteps(steps)
        if hasattr(ref, "set_begin_index"):
            ref.set_begin_index(i)
        t = ref.timesteps[i]
        ref_in = ref.scale_model_input(torch.from_numpy(sample), t)
        ref_out = ref.step(
            torch.from_numpy(model_output), t, torch.from_numpy(sample), **ref_step_kwargs(ours, i)
        )
        noise = torch_noises(i, 1)[0].numpy() if ours.stochastic else None
        x_in = ours.scale_model_input(schedule, jnp.asarray(sample), i)
        prev, _ = ours.step(
            schedule, ours.init_state(sample), jnp.asarray(model_output), sample, i, noise=noise
        )
        assert rel_err(x_in, ref_in.numpy()) <= TOL
        assert rel_err(prev, ref_out.prev_sample.numpy()) <= TOL, i


# -------------------------------------------------------------------------------------------------
# Whole loops


@partial(jax.jit, static_argnums=0)
def run_loop(scheduler, schedule, latents, noises):
    """The denoising loop as the pipeline runs it: one program, lax.fori_loop over a traced step index."""
    sample = latents * scheduler.init_noise_sigma(schedule)

    def body(i, carry):
        sample, state = carry
        x_in = scheduler.scale_model_input(schedule, sample, i)
        model_output = fake_model(x_in, schedule.timesteps[i], jnp)
        noise = noises[i] if scheduler.stochastic else None
        return scheduler.step(schedule, state, model_output, sample, i, noise=noise)

    sample, _ = jax.lax.fori_loop(0, schedule.num_steps, body, (sample, scheduler.init_state(sample)))
    return sample


def ref_loop(ref, steps: int, latents: np.ndarray, step_kwargs: dict) -> np.ndarray:
    """diffusers' loop as StableDiffusionXLPipeline runs it (begin index 0: with repeated timesteps, e.g.
    clipped Karras ones, looking the first one up would start at index 1)."""
    ref.set_timesteps(steps)
    return ref_loop_from(ref, latents, step_kwargs)


def ref_loop_from(ref, latents: np.ndarray, step_kwargs: dict) -> np.ndarray:
    """diffusers' loop over the timesteps `ref` was set to."""
    if hasattr(ref, "set_begin_index"):
        ref.set_begin_index(0)
    sample = torch.from_numpy(latents) * ref.init_noise_sigma
    for t in ref.timesteps:
        x_in = ref.scale_model_input(sample, t)
        sample = ref.step(fake_model(x_in, t.float(), torch), t, sample, **step_kwargs).prev_sample
    return sample.numpy()


def check_loop(ours, ref, steps: int, seed: int = 0) -> float:
    latents = np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float32)
    noises = np.stack([n.numpy() for n in torch_noises(seed, steps)])
    expected = ref_loop(ref, steps, latents, ref_step_kwargs(ours, seed))
    got = run_loop(ours, ours.schedule(steps), jnp.asarray(latents), jnp.asarray(noises))
    assert np.all(np.isfinite(expected))
    return rel_err(got, expected)


def check_loop_from(ours, ref, steps: int, start: int) -> float:
    """An image-to-image loop: the model calls from `start` on (diffusers: its begin index where it has one;
    PNDM's counter starts at 0 either way), ours with a fresh state, from the same sample."""
    x = np.random.default_rng(start).standard_normal(SHAPE).astype(np.float32)
    ref.set_timesteps(steps)
    if hasattr(ref, "set_begin_index"):
        ref.set_begin_index(start)
    sample = torch.from_numpy(x)
    for t in ref.timesteps[start:]:
        x_in = ref.scale_model_input(sample, t)
        sample = ref.step(fake_model(x_in, t.float(), torch), t, sample).prev_sample
    schedule = jax.tree.map(jnp.asarray, ours.schedule(steps))

    def body(i, carry):
        sample, state = carry
        x_in = ours.scale_model_input(schedule, sample, i)
        return ours.step(schedule, state, fake_model(x_in, schedule.timesteps[i], jnp), sample, i)

    calls = ours.model_calls(steps)
    got, _ = jax.lax.fori_loop(start, calls, body, (jnp.asarray(x), ours.init_state(x)))
    return rel_err(got, sample.numpy())


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_loop_matches_diffusers(sdxl_config, case):
    ours, ref = build(sdxl_config, case)
    assert check_loop(ours, ref, steps=5) <= TOL


@pytest.mark.parametrize(
    "name, changes",
    [
        ("DPMSolverMultistepScheduler", dict(solver_order=3)),
        ("DPMSolverMultistepScheduler", dict(solver_order=3, final_sigmas_type="sigma_min")),
        ("DPMSolverMultistepScheduler", dict(use_karras_sigmas=True)),
        ("DEISMultistepScheduler", dict(solver_order=3)),
        ("DEISMultistepScheduler", dict(use_karras_sigmas=True)),
    ],
    ids=str,
)
def test_dpm_long_loop_matches_diffusers(sdxl_config, name, changes):
    """16 steps: past diffusers' 15-step threshold where lower_order_final stops lowering the last steps."""
    ours, ref = build(sdxl_config, (name, changes, {}))
    assert check_loop(ours, ref, steps=16) <= TOL


@pytest.mark.parametrize(
    "changes, steps",
    [
        # Whole groups, no lowered last step: [1, 2] x 8 and [1, 2, 3] x 5.
        (dict(final_sigmas_type="sigma_min"), 16),
        (dict(solver_order=3, final_sigmas_type="sigma_min"), 15),
        # A step count that is not a multiple of the order: diffusers turns lower_order_final on.
        (dict(solver_order=3, final_sigmas_type="sigma_min"), 16),
        (dict(solver_order=2, final_sigmas_type="sigma_min"), 7),
        # lower_order_final asked for; the zero final sigma's first-order last step.
        (dict(solver_order=3, final_sigmas_type="sigma_min", lower_order_final=True), 12),
        (dict(solver_order=3), 14),
        (dict(solver_order=3, solver_type="heun"), 9),
        (dict(SDE, solver_order=3), 8),
    ],
    ids=str,
)
def test_dpm_singlestep_groups_match_diffusers(sdxl_config, changes, steps):
    """Each step's order as diffusers' get_order_list gives it after its set_timesteps, and the loop."""
    ours, ref = build(sdxl_config, ("DPMSolverSinglestepScheduler", changes, {}))
    ref.set_timesteps(steps)
    assert ours.schedule(steps).orders.astype(int).tolist() == ref.order_list
    assert check_loop(ours, ref, steps=steps) <= TOL


@pytest.fixture(scope="module")
def wan_config(tmp_path_factory) -> dict:
    """Wan 2.1's scheduler_config.json (UniPC in its flow-matching form, flow_shift 3) as diffusers saves it."""
    from meshserve.models.wan.random_tiny import SCHEDULER as WAN_SCHEDULER

    folder = tmp_path_factory.mktemp("wan_scheduler")
    diffusers.UniPCMultistepScheduler(**WAN_SCHEDULER).save_config(str(folder))
    return json.loads((folder / "scheduler_config.json").read_text())


@pytest.mark.parametrize(
    "name, changes",
    [
        ("dpmpp_2m", {}),
        ("dpmpp_2s", {}),
        ("DPMSolverMultistepScheduler", dict(solver_order=3, flow_shift=5.0)),
        ("DPMSolverMultistepScheduler", dict(SDE, solver_type="heun")),
        ("DPMSolverMultistepScheduler", dict(final_sigmas_type="sigma_min", lower_order_final=False)),
        ("DPMSolverSinglestepScheduler", dict(solver_order=3)),
        ("DPMSolverSinglestepScheduler", dict(SDE, lower_order_final=True)),
        ("deis", {}),
        ("DEISMultistepScheduler", dict(solver_order=3, flow_shift=5.0)),
        ("DEISMultistepScheduler", dict(solver_order=1)),
        ("DEISMultistepScheduler", dict(lower_order_final=False, thresholding=True, sample_max_value=0.8)),
    ],
    ids=str,
)
def test_dpm_solver_on_flow_sigmas_matches_diffusers(wan_config, name, changes):
    """DPM-Solver and DEIS on Wan's flow config (its "dpm++" solver): shifted flow sigmas, x0 = x - sigma v,
    alpha = 1 - sigma; diffusers' class from the same config (the names' settings given to it)."""
    config = {**wan_config, **changes}
    ours = make_scheduler(name, config)
    assert ours.use_flow_sigmas and not ours.scheduler_arguments()["timesteps"]
    for steps in (1, 5, 12):
        ref = getattr(diffusers, CLASS.get(name, name)).from_config({**config, **NAMED.get(name, {})})
        ref.set_timesteps(steps)
        schedule = ours.schedule(steps)
        np.testing.assert_array_equal(schedule.timesteps, ref.timesteps.numpy().astype(np.float32))
        assert rel_err(schedule.sigmas, ref.sigmas.numpy()) <= TOL
        assert check_loop(ours, ref, steps=steps) <= TOL


@pytest.mark.parametrize("name", ["dpmpp_2m", "dpmpp_2s", "deis"])
def test_a_bf16_velocity_on_flow_sigmas_rounds_as_diffusers(wan_config, name):
    """Wan's transformer returns bf16 into fp32 latents: x0 = x - sigma * v with diffusers' bf16 product
    (sigma rounded to bf16 first), over a 10-step loop."""
    ours = make_scheduler(name, wan_config)
    ref = getattr(diffusers, CLASS[name]).from_config({**wan_config, **NAMED.get(name, {})})
    ref.set_timesteps(10)
    schedule = ours.schedule(10)
    x0 = np.random.default_rng(4).standard_normal(SHAPE).astype(np.float32)
    x_t, x_j, state = torch.from_numpy(x0), jnp.asarray(x0), ours.init_state(x0)
    for i, t in enumerate(ref.timesteps):
        v = fake_model(x_t, t.float(), torch).bfloat16()
        x_t = ref.step(v, t, x_t).prev_sample
        x_j, state = ours.step(schedule, state, jnp.asarray(v.float().numpy(), jnp.bfloat16), x_j, i)
    assert x_j.dtype == jnp.float32 and x_t.dtype == torch.float32
    # Measured: 2.5e-7 (DPM-Solver) and 1.1e-5 (DEIS, whose log-rho coefficients carry float32 rounding further);
    # with the product in float32, 2.8-3.6e-4.
    assert rel_err(x_j, x_t.numpy()) <= 3e-5


@pytest.mark.parametrize("start", [1, 2, 4])
def test_dpm_singlestep_from_a_start_step_matches_diffusers(sdxl_config, start):
    """Image-to-image starts DPM-Solver singlestep inside a group: diffusers (begin index > 0) lowers the
    order to the predictions it has, so the start step is first order and stores its sample, as ours."""
    ours, ref = build(sdxl_config, ("DPMSolverSinglestepScheduler", dict(solver_order=3), {}))
    assert check_loop_from(ours, ref, steps=9, start=start) <= TOL


@pytest.mark.parametrize("changes", [{}, dict(variance_type="fixed_large", clip_sample=False)], ids=str)
def test_ddpm_custom_timesteps_match_diffusers(sdxl_config, changes):
    """diffusers' set_timesteps(timesteps=): each step goes to the next given timestep (the last to a clean
    sample), with no noise added at timestep 0."""
    ours, ref = build(sdxl_config, ("ddpm", changes, {}))
    for custom in ([999, 700, 420, 100, 7], [960, 901, 500, 250, 0]):
        ref.set_timesteps(timesteps=custom)
        schedule = ours.schedule(len(custom), timesteps=custom)
        latents = np.random.default_rng(1).standard_normal(SHAPE).astype(np.float32)
        noises = np.stack([n.numpy() for n in torch_noises(1, len(custom))])
        expected = ref_loop_from(ref, latents, {"generator": torch.Generator().manual_seed(1)})
        got = run_loop(ours, schedule, jnp.asarray(latents), jnp.asarray(noises))
        assert rel_err(got, expected) <= TOL
    assert ours.scheduler_arguments()["timesteps"]
    with pytest.raises(ValueError, match="decrease"):
        ours.schedule(2, timesteps=[499, 999])


@pytest.mark.parametrize(
    "changes",
    [
        {},
        dict(solver_order=3),
        dict(solver_type="bh1", final_sigmas_type="sigma_min"),
        dict(predict_x0=False, final_sigmas_type="sigma_min", solver_order=3),
    ],
    ids=str,
)
def test_unipc_long_loop_matches_diffusers(sdxl_config, changes):
    """UniPC's VP form over 12 steps: every order's predictor and corrector, the lowered last steps."""
    ours, ref = build(sdxl_config, ("UniPCMultistepScheduler", changes, {}))
    assert check_loop(ours, ref, steps=12) <= TOL


@pytest.mark.parametrize("start", [1, 3])
def test_lms_from_a_start_step_matches_diffusers(sdxl_config, start):
    """Image-to-image starts LMS at a later step with no slopes from before it: diffusers (begin index > 0)
    then sums the step's weights only over the slopes it has, as the zeros of ours do."""
    ours, ref = build(sdxl_config, ("lms", {}, {}))
    assert check_loop_from(ours, ref, steps=6, start=start) <= TOL


@pytest.mark.parametrize("skip_prk_steps", [True, False])
@pytest.mark.parametrize("start", [1, 2, 5])
def test_pndm_from_a_start_call_matches_diffusers(sdxl_config, skip_prk_steps, start):
    """Image-to-image runs PNDM over the calls from `start` with its counter at 0 (diffusers' PNDM has no begin
    index): the first of them taken as a first step, the Runge-Kutta start (without skip_prk_steps) on
    the later timesteps, with the alpha_bar its counter picks."""
    ours, ref = build(sdxl_config, ("pndm", dict(skip_prk_steps=skip_prk_steps), {}))
    assert check_loop_from(ours, ref, steps=6, start=start) <= TOL


def check_calls_schedule(ours, ref, steps: int) -> None:
    """A two-call scheduler's schedule of `steps` steps against diffusers': one timestep per model call, the
    sigmas as diffusers lays them out, the initial noise scale."""
    schedule = ours.schedule(steps)
    ref.set_timesteps(steps)
    assert schedule.timesteps.shape == (ours.model_calls(steps),)
    assert rel_err(schedule.timesteps, ref.timesteps.numpy()) <= TOL
    assert rel_err(schedule.sigmas, ref.sigmas.numpy()) <= TOL
    assert rel_err(ours.init_noise_sigma(schedule), float(ref.init_noise_sigma)) <= TOL


# DPM++ SDE draws from a Brownian tree, not a generator: its own cases (not CASES, whose steps replay a generator).
SDE_CASES = [
    ("dpmpp_sde", {}, {}),
    ("dpmpp_sde_karras", {}, {}),
    ("dpmpp_sde", dict(timestep_spacing="trailing", prediction_type="v_prediction"), {}),
    ("dpmpp_sde", dict(timestep_spacing="leading", steps_offset=1, use_exponential_sigmas=True), {}),
    ("DPMSolverSDEScheduler", dict(beta_schedule="scaled_linear", beta_start=0.0001, beta_end=0.02), {}),
]


@pytest.mark.parametrize("case", SDE_CASES, ids=case_id)
def test_dpm_sde_schedule_matches_diffusers(sdxl_config, case):
    for steps in (1, 5, 30):
        check_calls_schedule(*build(sdxl_config, case), steps)


@pytest.mark.parametrize("case", SDE_CASES, ids=case_id)
def test_dpm_sde_loop_matches_diffusers_on_its_brownian_draws(sdxl_config, case):
    """diffusers' loop with its Brownian tree, each draw recorded; ours fed the same increments as standard
    normals: stage 1's draw n1 as is, stage 2's as the z that extends it (n2 = (sqrt(s - mid) n1 +
    sqrt(mid - s_next) z) / sqrt(s - s_next), dpm_solver_sde.py)."""
    from diffusers.schedulers.scheduling_dpmsolver_sde import BrownianTreeNoiseSampler

    ours, ref = build(sdxl_config, case)
    steps = 5
    latents = np.random.default_rng(5).standard_normal(SHAPE).astype(np.float32)
    ref.set_timesteps(steps)
    sigmas = ref.sigmas
    tree = BrownianTreeNoiseSampler(
        torch.zeros(SHAPE), sigmas[sigmas > 0].min().item(), sigmas.max().item(), seed=11
    )
    draws = []

    def recording(sigma, sigma_next):
        n = tree(sigma, sigma_next)
        draws.append((float(sigma), float(sigma_next), n.numpy().astype(np.float64)))
        return n

    ref.noise_sampler = recording
    expected = ref_loop_from(ref, latents, {})
    assert len(draws) == 2 * (steps - 1)  # none on the last (Euler) step
    noises = np.zeros((ours.model_calls(steps), *SHAPE), np.float32)
    for k in range(steps - 1):
        (s, mid, n1), (_, s_next, n2) = draws[2 * k], draws[2 * k + 1]
        noises[2 * k] = n1
        noises[2 * k + 1] = (n2 * (s - s_next) ** 0.5 - n1 * (s - mid) ** 0.5) / (mid - s_next) ** 0.5
    got = run_loop(ours, ours.schedule(steps), jnp.asarray(latents), jnp.asarray(noises))
    assert rel_err(got, expected) <= TOL
    padded = run_loop(ours, pad_schedule(ours.schedule(steps), 20), jnp.asarray(latents), jnp.asarray(noises))
    assert rel_err(padded, expected) <= TOL


# DPM2 ancestral draws noise on a step's second call only: its own cases (CASES' loops give one draw per call).
DPM2_ANCESTRAL_CASES = [
    ("dpm2_ancestral", {}, {}),
    ("dpm2_ancestral_karras", {}, {}),
    ("dpm2_ancestral", dict(timestep_spacing="trailing", prediction_type="v_prediction"), {}),
    ("dpm2_ancestral", dict(timestep_spacing="linspace", use_exponential_sigmas=True), {}),
]


@pytest.mark.parametrize("case", DPM2_ANCESTRAL_CASES, ids=case_id)
def test_dpm2_ancestral_matches_diffusers(sdxl_config, case):
    """The schedule at 1, 5 and 30 steps; a 5-step loop (9 calls) with diffusers' generator draws, the j-th
    given to ours at call 2j + 1 (stage 2 of step j), exact and padded."""
    ours, ref = build(sdxl_config, case)
    for steps in (1, 5, 30):
        check_calls_schedule(ours, ref, steps)
    steps = 5
    latents = np.random.default_rng(2).standard_normal(SHAPE).astype(np.float32)
    expected = ref_loop(ref, steps, latents, {"generator": torch.Generator().manual_seed(2)})
    noises = np.zeros((ours.model_calls(steps), *SHAPE), np.float32)
    noises[1::2] = np.stack([n.numpy() for n in torch_noises(2, steps - 1)])
    schedule = ours.schedule(steps)
    got = run_loop(ours, schedule, jnp.asarray(latents), jnp.asarray(noises))
    assert rel_err(got, expected) <= TOL
    padded = run_loop(ours, pad_schedule(schedule, 20), jnp.asarray(latents), jnp.asarray(noises))
    assert rel_err(padded, expected) <= TOL


def test_dpm_sde_second_stage_extends_the_first_draw(sdxl_config):
    """The two draws of a step are one Brownian motion's increments over nested intervals: with z = 0 the second
    stage reuses the first's normal scaled by sqrt((s - mid) / (s - s_next)), not a fresh one."""
    ours = make_scheduler("dpmpp_sde", sdxl_config)
    schedule = ours.schedule(4)
    x = jnp.ones(SHAPE)
    n1 = jnp.asarray(np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32))
    _, state = ours.step(schedule, ours.init_state(x), x * 0.1, x, 0, noise=n1)
    np.testing.assert_array_equal(state[1], n1)
    with_z, _ = ours.step(schedule, state, x * 0.1, x, 1, noise=jnp.zeros(SHAPE))
    without, _ = ours.step(schedule, (state[0], jnp.zeros(SHAPE)), x * 0.1, x, 1, noise=jnp.zeros(SHAPE))
    assert float(jnp.max(jnp.abs(with_z - without))) > 1e-3


def test_ancestral_step_to_a_tiny_sigma_stays_finite(sdxl_config):
    """Linear betas, linspace, 2 steps: sigma_to / sigma ~ 1e-4, where sigma_down's radicand is 0 in float32
    (a fused multiply-add once made it negative: an all-NaN sample where diffusers' is finite)."""
    changes = dict(beta_schedule="linear", beta_start=0.0001, beta_end=0.02, timestep_spacing="linspace")
    ours, ref = build(sdxl_config, ("euler_ancestral", changes, {}))
    assert check_loop(ours, ref, steps=2) <= TOL


def test_loop_with_a_new_step_count(sdxl_config):
    ours, ref = build(sdxl_config, ("euler", {}, {}))
    for steps in (3, 7):
        assert check_loop(ours, ref, steps=steps) <= TOL


# -------------------------------------------------------------------------------------------------
# Compilation, noise, names


@pytest.mark.parametrize("name", SCHEDULER_NAMES)
def test_jitted_step_compiles_once(sdxl_config, name):
    ours = make_scheduler(name, sdxl_config)
    traces = []

    @jax.jit
    def step(schedule, state, model_output, sample, i, key):
        traces.append(i)
        return ours.step(schedule, state, model_output, sample, i, key)

    schedule = jax.tree.map(jnp.asarray, ours.schedule(5))
    sample = jnp.ones(SHAPE, jnp.bfloat16)
    state = ours.init_state(sample)
    for i in range(4):
        sample, state = step(schedule, state, sample * 0.5, sample, jnp.int32(i), jax.random.key(i))
        assert sample.dtype == jnp.bfloat16  # the loop carry keeps its dtype
    # New schedule values of the same length are traced inputs too.
    other = jax.tree.map(lambda a: a * 1.01, schedule)
    step(other, state, sample, sample, jnp.int32(1), jax.random.key(9))
    assert len(traces) == 1


@pytest.mark.parametrize(
    "case",
    [
        c
        for c in CASES
        if c[0] in ("euler_ancestral", "dpmpp_2m_sde", "dpmpp_2m_sde_karras", "lcm") or c[2].get("eta")
    ]
    + SDE_CASES[:1]
    + DPM2_ANCESTRAL_CASES[:1],
    ids=case_id,
)
def test_key_draws_standard_normal_noise(sdxl_config, case):
    ours, _ = build(sdxl_config, case)
    schedule = ours.schedule(5)
    sample = jnp.ones(SHAPE)
    state = ours.init_state(sample)
    key = jax.random.key(3)
    by_key, _ = ours.step(schedule, state, sample, sample, 1, key)
    by_noise, _ = ours.step(schedule, state, sample, sample, 1, noise=jax.random.normal(key, SHAPE))
    other_key, _ = ours.step(schedule, state, sample, sample, 1, jax.random.key(4))
    np.testing.assert_array_equal(by_key, by_noise)
    assert np.max(np.abs(by_key - other_key)) > 1e-3
    with pytest.raises(ValueError, match="key"):
        ours.step(schedule, state, sample, sample, 1)


@pytest.mark.parametrize("steps", [1, 4, 7, 50])
def test_lcm_custom_timesteps_and_step_limit(sdxl_config, steps):
    """LCM's schedule is a subset of its distillation's 50 timesteps: at most 50 steps (diffusers raises
    past them, as ours does); custom timesteps (any strictly decreasing training timesteps) run as
    diffusers' set_timesteps(timesteps=) runs them, the last step returning the estimate itself."""
    ours, ref = build(sdxl_config, ("lcm", {}, {}))
    ref.set_timesteps(steps)
    custom = [int(t) for t in ref.timesteps]
    if steps > 1:
        custom[1] -= 3  # off the distillation's grid: diffusers warns and runs it
    for timesteps in (None, custom):
        schedule = ours.schedule(steps, timesteps=timesteps)
        ref = build(sdxl_config, ("lcm", {}, {}))[1]
        if timesteps is None:
            ref.set_timesteps(steps)
        else:
            ref.set_timesteps(timesteps=timesteps)
        np.testing.assert_array_equal(schedule.timesteps, ref.timesteps.numpy().astype(np.float32))
        latents = np.random.default_rng(steps).standard_normal(SHAPE).astype(np.float32)
        noises = np.stack([n.numpy() for n in torch_noises(steps, steps)])
        expected = ref_loop_from(ref, latents, {"generator": torch.Generator().manual_seed(steps)})
        got = run_loop(ours, schedule, jnp.asarray(latents), jnp.asarray(noises))
        assert rel_err(got, expected) <= TOL
    assert ours.scheduler_arguments()["max_steps"] == 50 and ours.scheduler_arguments()["timesteps"]
    with pytest.raises(ValueError, match="at most original_inference_steps = 50"):
        ours.schedule(51)
    with pytest.raises(ValueError, match="descending"):
        ours.schedule(2, timesteps=[499, 999])


def test_make_scheduler_names_and_errors(sdxl_config):
    assert set(SCHEDULER_NAMES) >= {"euler", "euler_ancestral", "ddim", "dpmpp_2m"}
    default = make_scheduler(None, sdxl_config)
    assert type(default).__name__ == "EulerDiscreteScheduler"
    assert (
        default
        == make_scheduler("euler", sdxl_config)
        == make_scheduler("EulerDiscreteScheduler", sdxl_config)
    )
    hash(default)  # a static jit argument
    # "dpmpp_2m" means DPM++ 2M whatever the config says; the class name takes the config as is.
    dpm_config = {**sdxl_config, "solver_order": 3}
    assert make_scheduler("dpmpp_2m", dpm_config).solver_order == 2
    assert make_scheduler("DPMSolverMultistepScheduler", dpm_config).solver_order == 3
    assert make_scheduler("euler", sdxl_config, use_karras_sigmas=True).use_karras_sigmas
    with pytest.raises(ValueError, match="euler_ancestral"):
        make_scheduler("dpmpp_2s_ancestral", sdxl_config)
    with pytest.raises(ValueError, match="the folder.s scheduler .ScoreSdeVeScheduler. is not implemented"):
        make_scheduler(None, {**sdxl_config, "_class_name": "ScoreSdeVeScheduler"})
    # An SD-style folder's PNDM (skip_prk_steps: PLMS): N + 1 calls for N steps; without it, 9 more.
    pndm = make_scheduler(None, {**sdxl_config, "_class_name": "PNDMScheduler", "skip_prk_steps": True})
    assert pndm.model_calls(10) == 11 and pndm.max_steps_within(200) == 199
    assert make_scheduler("pndm", sdxl_config).model_calls(10) == 19
    # A folder saved with one of the k-diffusion ports: its class, with its config.
    heun = make_scheduler(None, {**sdxl_config, "_class_name": "HeunDiscreteScheduler", "clip_sample": True})
    assert type(heun).__name__ == "HeunDiscreteScheduler" and heun.clip_sample
    assert heun.model_calls(10) == 19 and make_scheduler("lms", sdxl_config).model_calls(10) == 10
    bad = [
        ("euler", dict(timestep_spacing="middle")),
        ("euler", dict(beta_schedule="sigmoid")),
        ("ddim", dict(prediction_type="flow")),
        ("euler_ancestral", dict(prediction_type="sample")),
        ("DPMSolverMultistepScheduler", dict(algorithm_type="dpmsolver")),
        ("dpm2", dict(prediction_type="sample")),
        ("lms", dict(use_karras_sigmas=True, use_beta_sigmas=True)),
        ("ddpm", dict(variance_type="learned_range")),
        ("ddpm", dict(variance_type="fixed_large_log")),
        ("deis", dict(algorithm_type="sde-dpmsolver++")),
        ("DPMSolverMultistepScheduler", dict(use_flow_sigmas=True)),  # flow sigmas, a noise prediction
        ("DPMSolverMultistepScheduler", dict(prediction_type="flow_prediction")),
        ("dpmpp_2s", dict(use_flow_sigmas=True, prediction_type="flow_prediction", use_karras_sigmas=True)),
        ("pndm", dict(prediction_type="sample")),
        ("unipc", dict(predict_x0=False)),  # at a final sigma of 0: NaN in diffusers
        ("unipc", dict(solver_p="DDIMScheduler")),
    ]
    for name, changes in bad:
        with pytest.raises(ValueError):
            make_scheduler(name, {**sdxl_config, **changes})
    with pytest.raises(ValueError, match="no setting"):
        make_scheduler("euler", sdxl_config, karras=True)
    with pytest.raises(ValueError, match="num_inference_steps"):
        default.schedule(0)


# The classes of diffusers' SDXL pipelines' `scheduler.compatibles`, whose folders' configs a name may be read from.
FOLDER_CLASSES = (
    "EulerDiscreteScheduler",
    "EulerAncestralDiscreteScheduler",
    "DDIMScheduler",
    "DDPMScheduler",
    "PNDMScheduler",
    "LMSDiscreteScheduler",
    "HeunDiscreteScheduler",
    "KDPM2DiscreteScheduler",
    "KDPM2AncestralDiscreteScheduler",
    "DPMSolverMultistepScheduler",
    "DPMSolverSinglestepScheduler",
    "DPMSolverSDEScheduler",
    "DEISMultistepScheduler",
    "UniPCMultistepScheduler",
    "LCMScheduler",
    "TCDScheduler",
)
# Where a name reads a folder's setting through diffusers' renaming (DPM-Solver reads UniPC's "bh2" as
# "midpoint", UniPC DPM-Solver's "midpoint" as "bh2", DEIS both as "logrho", DPM-Solver a DDPM folder's
# variance_type as None and DDPM a DPM-Solver folder's None as "fixed_small"): the loops must agree too.
RENAMED = [
    ("UniPCMultistepScheduler", "dpmpp_2m"),
    ("UniPCMultistepScheduler", "dpmpp_2s"),
    ("UniPCMultistepScheduler", "deis"),
    ("DEISMultistepScheduler", "dpmpp_2m_sde"),
    ("DEISMultistepScheduler", "unipc"),
    ("DPMSolverMultistepScheduler", "deis"),
    ("DPMSolverMultistepScheduler", "unipc"),
    ("DPMSolverMultistepScheduler", "ddpm"),
    ("DDPMScheduler", "dpmpp_2m"),
]


@pytest.fixture(scope="module")
def folder_configs(sdxl_config, tmp_path_factory) -> dict:
    """Each compatible class's scheduler_config.json as its folder holds it (saved by diffusers from the SDXL
    settings, with every other key at the class's default)."""
    configs = {}
    for class_name in FOLDER_CLASSES:
        folder = tmp_path_factory.mktemp(class_name)
        getattr(diffusers, class_name).from_config(sdxl_config).save_config(str(folder))
        configs[class_name] = json.loads((folder / "scheduler_config.json").read_text())
    return configs


def test_every_name_reads_every_compatible_folder_as_diffusers_does(folder_configs):
    """A name asked of a folder saved with another class: ours is made where diffusers' from_config makes
    its class (and the schedules agree), and refused where diffusers refuses. One deliberate difference: UniPC
    on a DPM-Solver singlestep folder (its lower_order_final=False at a final sigma of 0) makes NaN pictures in
    diffusers and is refused here."""
    refused_here = {("DPMSolverSinglestepScheduler", "unipc")}
    # Not the DPM2 names: diffusers' KDPM2 classes build a 1000-step schedule in __init__ (0.5 s each, 30 s for
    # the 64 pairs), and they read no setting another class renames.
    names = [n for n in SCHEDULER_NAMES if not n.startswith("dpm2")]
    for class_name, config in folder_configs.items():
        for name in names:
            try:
                ref = getattr(diffusers, CLASS[name]).from_config({**config, **NAMED.get(name, {})})
            except (ValueError, NotImplementedError):
                ref = None
            try:
                ours = make_scheduler(name, config)
            except ValueError:
                ours = None
            if (class_name, name) in refused_here:
                assert ref is not None and ours is None
                continue
            assert (ours is None) == (ref is None), (class_name, name)
            if ours is not None:
                ref.set_timesteps(10)
                assert rel_err(ours.schedule(10).timesteps, ref.timesteps.numpy()) <= TOL, (class_name, name)


@pytest.mark.parametrize("class_name, name", RENAMED, ids=str)
def test_renamed_settings_run_as_diffusers(folder_configs, class_name, name):
    config = folder_configs[class_name]
    ours = make_scheduler(name, config)
    ref = getattr(diffusers, CLASS[name]).from_config({**config, **NAMED.get(name, {})})
    assert check_loop(ours, ref, steps=5) <= TOL


# Flow-matching Euler's schedule is its pipelines' (sigmas linspace(1, 1/N)), not set_timesteps' own:
# tests/models/test_flow_match_euler.py.
@pytest.mark.parametrize("class_name", sorted(set(_BY_CLASS) - {"FlowMatchEulerDiscreteScheduler"}))
def test_a_config_without_settings_means_diffusers_defaults(class_name):
    """A config that omits a key means the diffusers class's default for it (Heun's and DPM2's betas are
    0.00085-0.012, not DDPM's 0.0001-0.02; EDM's sigma range 0.002-80)."""
    ours = make_scheduler(class_name, {})
    ref = getattr(diffusers, class_name)()
    schedule = ours.schedule(10)
    ref.set_timesteps(10)
    assert rel_err(schedule.timesteps, ref.timesteps.numpy()) <= TOL
    if hasattr(schedule, "sigmas") and hasattr(ref, "sigmas"):
        assert rel_err(schedule.sigmas, ref.sigmas.numpy()) <= TOL


def _takes(cls, setting: str) -> bool:
    return setting in inspect.signature(cls.__init__).parameters


@pytest.mark.parametrize(
    "class_name",
    sorted(c for c in _BY_CLASS if _takes(getattr(diffusers, c), "use_karras_sigmas")),
)
def test_respacings_together_are_refused_or_run_as_diffusers(sdxl_config, class_name):
    """Every class whose diffusers counterpart has the respacing settings (RespacedSigmas) refuses two of
    Karras / exponential / beta sigmas together, as its __init__ does, and runs each alone; DPM-Solver's lu
    lambdas beside one run as diffusers' set_timesteps orders them (Karras, then lu lambdas, then the others)."""
    theirs = getattr(diffusers, class_name)
    config = {k: v for k, v in sdxl_config.items() if k not in ("_class_name", "_diffusers_version")}
    for i, first in enumerate(RESPACINGS):
        for second in RESPACINGS[i + 1 :]:
            with pytest.raises(ValueError):
                theirs.from_config(config, **{first: True, second: True})
            with pytest.raises(ValueError, match=f"only one of .*{first}.*{second}"):
                make_scheduler(class_name, {**config, first: True, second: True})
        make_scheduler(class_name, {**config, first: True}).schedule(4)
    if _takes(theirs, "use_lu_lambdas"):
        for first in RESPACINGS:
            settings = {**config, first: True, "use_lu_lambdas": True}
            ref = theirs.from_config(settings)
            ref.set_timesteps(6)
            schedule = make_scheduler(class_name, settings).schedule(6)
            assert rel_err(schedule.timesteps, ref.timesteps.numpy()) <= TOL, first
            assert rel_err(schedule.sigmas, ref.sigmas.numpy()) <= TOL, first


def test_runtime_imports_no_torch():
    """meshserve.models.schedulers is runtime code: importable with torch and diffusers unavailable."""
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['diffusers'] = None; "
        "import models.schedulers as s; s.make_scheduler('euler', {}).schedule(4)"
    )
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
