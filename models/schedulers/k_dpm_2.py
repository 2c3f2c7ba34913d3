"""DPM2 (k-diffusion's sample_dpm_2, Karras et al. 2022's second-order sampler at the midpoint in log sigma) =
diffusers' KDPM2DiscreteScheduler (A1111's "DPM2"; with use_karras_sigmas, "DPM2 Karras").

A step from sigma_k to sigma_{k+1} is two model calls: an Euler move to the geometric midpoint
sigma_mid = sqrt(sigma_k sigma_{k+1}), the model there, and the step taken again from sigma_k with the midpoint's
slope. diffusers runs it as a loop over 2N - 1 timesteps ([t_0, t_mid1, t_1, ..., t_mid(N-1), t_{N-1}]) whose step
alternates the two stages; the last step is a plain Euler step to sigma 0. So does this port: the stage is the
parity of the traced step index, and the carried state is the sample the step started from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np

from meshserve.models.schedulers.common import at, f32, schedule_dataclass, sigma_to_t
from meshserve.models.schedulers.euler import init_noise_sigma, predicted_original, training_sigmas
from meshserve.models.schedulers.k_diffusion import KDiffusionScheduler, doubled


@schedule_dataclass
class KDPM2Schedule:
    """timesteps: [2N - 1] float32, the model's timestep at each call (the midpoints' at the odd calls);
    sigmas, sigmas_interpol: [2N + 2] float32, diffusers' arrays as they are (each inner value twice), the
        steps' ends and the midpoints between them (sigmas_interpol[0], NaN in diffusers and never read, is 0);
    init_noise_sigma: [] float32;
    steps: None, or [] int32 when the arrays are padded past the schedule's end (`pad_schedule`)."""

    timesteps: Any
    sigmas: Any
    sigmas_interpol: Any
    init_noise_sigma: Any
    steps: Any = None


@dataclass(frozen=True)
class KDPM2DiscreteScheduler(KDiffusionScheduler):
    """Settings: diffusers' KDPM2DiscreteScheduler config (defaults equal); prediction_type "sample" is refused,
    as diffusers' step refuses it."""

    beta_start: float = 0.00085  # diffusers' defaults for this class
    beta_end: float = 0.012

    order = 2
    takes_sample_prediction = False

    def schedule(self, num_inference_steps: int) -> KDPM2Schedule:
        timesteps, sigmas = self.inference_sigmas(int(num_inference_steps), round_karras=True)
        sigmas = f32(np.concatenate([sigmas, [0.0]]))
        # The midpoint before each sigma, in float32 as diffusers' torch.lerp of the logs at weight 0.5
        # (end - (end - start) * 0.5); the last is 0 (its end is sigma 0).
        with np.errstate(divide="ignore", invalid="ignore"):
            log_sigmas = np.log(sigmas)
            before = np.roll(log_sigmas, 1)
            interpol = np.exp(before - (before - log_sigmas) * np.float32(0.5)).astype(np.float32)
        interpol[0] = 0.0
        timesteps_interpol = sigma_to_t(interpol, np.log(training_sigmas(self)))
        timesteps = f32(timesteps)
        inner = np.stack([f32(timesteps_interpol[1:-1]), timesteps[1:]], axis=-1).reshape(-1)

        sigmas = doubled(sigmas)
        return KDPM2Schedule(
            timesteps=np.concatenate([timesteps[:1], inner]),
            sigmas=sigmas,
            sigmas_interpol=doubled(interpol),
            init_noise_sigma=init_noise_sigma(sigmas, self.timestep_spacing),
        )

    def scale_model_input(self, schedule: KDPM2Schedule, sample, i):
        """sample / sqrt(sigma^2 + 1) at the call's noise level: the step's start, or its midpoint."""
        first = i % 2 == 0
        sigma = jnp.where(first, at(schedule.sigmas, i), at(schedule.sigmas_interpol, i))
        return (sample / (sigma**2 + 1) ** 0.5).astype(sample.dtype)

    def init_state(self, sample):
        """The sample the step started from, float32."""
        return jnp.zeros(sample.shape, jnp.float32)

    def step(self, schedule: KDPM2Schedule, state, model_output, sample, i, key=None, *, noise=None):
        """Stage 1 of a step at even i (an Euler move to the midpoint), stage 2 at odd i (the whole step with
        the midpoint's slope); returns (prev_sample in sample's dtype, state). `key` and `noise` are unused."""
        first = i % 2 == 0
        sigma = jnp.where(first, at(schedule.sigmas, i), at(schedule.sigmas, i - 1))
        sigma_interpol = jnp.where(
            first, at(schedule.sigmas_interpol, i + 1), at(schedule.sigmas_interpol, i)
        )
        sigma_next = jnp.where(first, at(schedule.sigmas, i + 1), at(schedule.sigmas, i))
        sigma_input = jnp.where(first, sigma, sigma_interpol)
        x = sample.astype(jnp.float32)
        out = model_output.astype(jnp.float32)
        derivative = (x - predicted_original(self.prediction_type, sigma_input, x, out)) / sigma_input
        dt = jnp.where(first, sigma_interpol - sigma, sigma_next - sigma)
        start = jnp.where(first, x, state)
        return (start + derivative * dt).astype(sample.dtype), start
