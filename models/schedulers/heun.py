"""Heun (Karras et al. 2022, Algorithm 1 without churn) = diffusers' HeunDiscreteScheduler (A1111's "Heun").

A second-order step is two model calls: an Euler move from sigma_k to sigma_{k+1}, then the model at the result,
and the step taken again from sigma_k with the mean of the two slopes. diffusers runs it as a loop over 2N - 1
timesteps ([t_0, t_1, t_1, ..., t_{N-1}, t_{N-1}]) whose step alternates the two stages; the last step is a plain
Euler step to sigma 0 (a slope there would divide by 0). So does this port: the stage is the parity of the
traced step index, and the carried state is the first stage's slope and starting sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp

from meshserve.models.schedulers.common import SigmaSchedule, at
from meshserve.models.schedulers.euler import EulerDiscreteScheduler, init_noise_sigma, predicted_original
from meshserve.models.schedulers.k_diffusion import KDiffusionScheduler, heun_layout


@dataclass(frozen=True)
class HeunDiscreteScheduler(KDiffusionScheduler):
    """Settings: diffusers' HeunDiscreteScheduler config (defaults equal); clip_sample clamps x0 to
    [-clip_sample_range, clip_sample_range]."""

    beta_start: float = 0.00085  # diffusers' defaults for this class
    beta_end: float = 0.012

    clip_sample: bool = False
    clip_sample_range: float = 1.0

    order = 2

    def schedule(self, num_inference_steps: int) -> SigmaSchedule:
        """timesteps [2N - 1] (every one but the first twice), sigmas [2N] (likewise, then 0)."""
        timesteps, sigmas = heun_layout(*self.inference_sigmas(int(num_inference_steps)))
        return SigmaSchedule(
            timesteps=timesteps,
            sigmas=sigmas,
            init_noise_sigma=init_noise_sigma(sigmas, self.timestep_spacing),
        )

    # The UNet's input at call i: sample / sqrt(sigmas[i]^2 + 1), as Euler's.
    scale_model_input = EulerDiscreteScheduler.scale_model_input

    def init_state(self, sample):
        """(the first stage's slope, the sample it started from), float32 like sample."""
        return jnp.zeros(sample.shape, jnp.float32), jnp.zeros(sample.shape, jnp.float32)

    def step(self, schedule: SigmaSchedule, state, model_output, sample, i, key=None, *, noise=None):
        """Stage 1 of a step at even i (an Euler move, remembered), stage 2 at odd i; returns (prev_sample in
        sample's dtype, state). float32 as diffusers; `key` and `noise` are unused."""
        first = i % 2 == 0
        sigma = jnp.where(first, at(schedule.sigmas, i), at(schedule.sigmas, i - 1))
        sigma_next = jnp.where(first, at(schedule.sigmas, i + 1), at(schedule.sigmas, i))
        # Stage 1 reads the model at sigma, stage 2 at sigma_next (where stage 1 ended).
        sigma_input = jnp.where(first, sigma, sigma_next)
        x = sample.astype(jnp.float32)
        out = model_output.astype(jnp.float32)
        pred_original = predicted_original(self.prediction_type, sigma_input, x, out)
        if self.clip_sample:
            pred_original = jnp.clip(pred_original, -self.clip_sample_range, self.clip_sample_range)
        derivative = (x - pred_original) / sigma_input
        prev_derivative, start = state
        dt = sigma_next - sigma
        prev_sample = jnp.where(first, x + derivative * dt, start + (prev_derivative + derivative) / 2 * dt)
        state = (jnp.where(first, derivative, prev_derivative), jnp.where(first, x, start))
        return prev_sample.astype(sample.dtype), state
