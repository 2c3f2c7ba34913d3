"""DPM2 ancestral (k-diffusion's sample_dpm_2_ancestral) = diffusers' KDPM2AncestralDiscreteScheduler (A1111's
"DPM2 a"; with use_karras_sigmas, "DPM2 a Karras").

DPM2 (k_dpm_2.py) aimed at sigma_down instead of sigma_next, then fresh noise of scale sigma_up added, where
sigma_down^2 + sigma_up^2 = sigma_next^2 (as Euler ancestral): stage 1 an Euler move to the geometric midpoint of
sigma and sigma_down, stage 2 the whole step with the midpoint's slope plus the noise. 2N - 1 model calls, as
diffusers' loop; only stage 2 draws noise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np

from meshserve.models.schedulers.common import (
    at,
    f32,
    schedule_dataclass,
    sigma_to_t,
    step_noise,
)
from meshserve.models.schedulers.euler import init_noise_sigma, predicted_original, training_sigmas
from meshserve.models.schedulers.k_diffusion import KDiffusionScheduler, doubled


@schedule_dataclass
class KDPM2AncestralSchedule:
    """timesteps: [2N - 1] float32 (the midpoints' at the odd calls); sigmas, sigmas_interpol, sigmas_up,
    sigmas_down: [2N + 2] float32, diffusers' arrays as they are (each inner value twice; entries diffusers
    leaves NaN and never reads are 0); init_noise_sigma: [] float32; steps: None, or [] int32 when padded."""

    timesteps: Any
    sigmas: Any
    sigmas_interpol: Any
    sigmas_up: Any
    sigmas_down: Any
    init_noise_sigma: Any
    steps: Any = None


@dataclass(frozen=True)
class KDPM2AncestralDiscreteScheduler(KDiffusionScheduler):
    """Settings: diffusers' KDPM2AncestralDiscreteScheduler config (defaults equal); prediction_type "sample"
    is refused, as diffusers' step refuses it."""

    beta_start: float = 0.00085  # diffusers' defaults for this class
    beta_end: float = 0.012

    order = 2
    takes_sample_prediction = False
    stochastic = True

    def schedule(self, num_inference_steps: int) -> KDPM2AncestralSchedule:
        timesteps, sigmas = self.inference_sigmas(int(num_inference_steps), round_karras=True)
        sigmas = f32(np.concatenate([sigmas, [0.0]]))
        sigmas_next = np.concatenate([sigmas[1:], [0.0]]).astype(np.float32)
        with np.errstate(divide="ignore", invalid="ignore"):
            sigmas_up = (sigmas_next**2 * (sigmas**2 - sigmas_next**2) / sigmas**2) ** 0.5
            sigmas_up[-1] = 0.0  # 0 / 0 in diffusers, never read
            sigmas_down = (sigmas_next**2 - sigmas_up**2) ** 0.5
            sigmas_down[-1] = 0.0
            # The midpoint of sigma and sigma_down in log space, as torch.lerp at 0.5 (end - (end - start) / 2).
            start, end = np.log(sigmas), np.log(sigmas_down)
            interpol = np.exp(end - (end - start) * np.float32(0.5)).astype(np.float32)
        interpol[-2:] = 0.0
        timesteps_interpol = sigma_to_t(interpol, np.log(training_sigmas(self)))
        timesteps = f32(timesteps)
        inner = np.stack([f32(timesteps_interpol[:-2]), timesteps[1:]], axis=-1).reshape(-1)
        expanded = doubled(sigmas)
        return KDPM2AncestralSchedule(
            timesteps=np.concatenate([timesteps[:1], inner]),
            sigmas=expanded,
            sigmas_interpol=doubled(interpol),
            sigmas_up=doubled(f32(sigmas_up)),
            sigmas_down=doubled(f32(sigmas_down)),
            init_noise_sigma=init_noise_sigma(expanded, self.timestep_spacing),
        )

    def scale_model_input(self, schedule: KDPM2AncestralSchedule, sample, i):
        """sample / sqrt(sigma^2 + 1) at the call's noise level: the step's start, or its midpoint."""
        first = i % 2 == 0
        sigma = jnp.where(first, at(schedule.sigmas, i), at(schedule.sigmas_interpol, i - 1))
        return (sample / (sigma**2 + 1) ** 0.5).astype(sample.dtype)

    def init_state(self, sample):
        """The sample the step started from, float32."""
        return jnp.zeros(sample.shape, jnp.float32)

    def generator_draws(self, schedule, start, stop, total, eta):
        # diffusers draws on a step's second call only (odd calls; the last step has one call)
        return [i for i in range(start, stop) if i % 2 == 1]

    def step(self, schedule: KDPM2AncestralSchedule, state, model_output, sample, i, key=None, *, noise=None):
        """Stage 1 at even i (an Euler move to the midpoint), stage 2 at odd i (the step to sigma_down with the
        midpoint's slope, plus noise x sigma_up: `noise` when given, else drawn from `key`); returns
        (prev_sample in sample's dtype, state)."""
        first = i % 2 == 0
        j = jnp.where(first, i, i - 1)  # the step's first call: its sigmas' index
        sigma, sigma_interpol = at(schedule.sigmas, j), at(schedule.sigmas_interpol, j)
        sigma_input = jnp.where(first, sigma, sigma_interpol)
        x = sample.astype(jnp.float32)
        out = model_output.astype(jnp.float32)
        derivative = (x - predicted_original(self.prediction_type, sigma_input, x, out)) / sigma_input
        start = jnp.where(first, x, state)
        dt = jnp.where(first, sigma_interpol, at(schedule.sigmas_down, j)) - sigma
        added = jnp.where(first, 0.0, step_noise(key, noise, x) * at(schedule.sigmas_up, j))
        return (start + derivative * dt + added).astype(sample.dtype), start
