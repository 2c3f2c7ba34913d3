"""Euler ancestral = diffusers' EulerAncestralDiscreteScheduler (k-diffusion's sample_euler_ancestral).

Each step goes down from sigma_i to sigma_down with the Euler ODE step, then adds fresh noise of scale sigma_up,
where sigma_down^2 + sigma_up^2 = sigma_{i+1}^2: the sample ends at the right noise level but forgets part of
its past, which is why the results depend on the noise drawn at every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from meshserve.models.schedulers.common import (
    NoiseScheduler,
    SigmaSchedule,
    at,
    f32,
    spaced_timesteps,
    step_noise,
)
from meshserve.models.schedulers.euler import (
    EulerDiscreteScheduler,
    init_noise_sigma,
    predicted_original,
    training_sigmas,
)


@dataclass(frozen=True)
class EulerAncestralDiscreteScheduler(NoiseScheduler):
    """Settings: diffusers' EulerAncestralDiscreteScheduler config (defaults equal); prediction_type "sample"
    is refused, as diffusers' step refuses it."""

    stochastic = True

    def __post_init__(self):
        super().__post_init__()
        if self.prediction_type == "sample":
            raise ValueError("EulerAncestralDiscreteScheduler: prediction_type='sample' is not supported")

    def schedule(self, num_inference_steps: int) -> SigmaSchedule:
        n = int(num_inference_steps)
        self.check_steps(n)
        train_sigmas = training_sigmas(self)
        timesteps = spaced_timesteps(
            self.timestep_spacing, self.num_train_timesteps, n, self.steps_offset, round_linspace=False
        )
        sigmas = np.interp(timesteps, np.arange(len(train_sigmas)), train_sigmas)
        sigmas = f32(np.concatenate([sigmas, [0.0]]))
        return SigmaSchedule(
            timesteps=f32(timesteps),
            sigmas=sigmas,
            init_noise_sigma=init_noise_sigma(sigmas, self.timestep_spacing),
        )

    # The same input scaling as plain Euler: sample / sqrt(sigma_i^2 + 1).
    scale_model_input = EulerDiscreteScheduler.scale_model_input

    def step(self, schedule: SigmaSchedule, state, model_output, sample, i, key=None, *, noise=None):
        """One ancestral step; returns (prev_sample in sample's dtype, state).

        The fresh noise is `noise` when given (standard normal, sample's shape), else
        jax.random.normal(key, sample.shape). Use a new key per step (e.g. fold_in(key, i)).
        """
        sigma = at(schedule.sigmas, i)
        sigma_to = at(schedule.sigmas, i + 1)
        x = sample.astype(jnp.float32)
        out = model_output.astype(jnp.float32)
        pred_original = predicted_original(self.prediction_type, sigma, x, out)
        sigma_up = (sigma_to**2 * (sigma**2 - sigma_to**2) / sigma**2) ** 0.5
        # sigma_to^4 / sigma^2 in exact arithmetic: under float32's resolution when sigma_to / sigma < 3e-4
        # (linear betas, linspace, 2 steps), where XLA's fused multiply-add left -2.5e-12 (a NaN sample)
        # and torch's unfused arithmetic exactly 0: clamped at 0.
        sigma_down = jnp.maximum(sigma_to**2 - sigma_up**2, 0.0) ** 0.5
        derivative = (x - pred_original) / sigma
        prev_sample = x + derivative * (sigma_down - sigma)
        prev_sample = prev_sample + step_noise(key, noise, x) * sigma_up
        return prev_sample.astype(sample.dtype), state
