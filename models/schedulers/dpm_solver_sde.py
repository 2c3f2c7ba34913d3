"""DPM++ SDE (k-diffusion's sample_dpmpp_sde: DPM-Solver++ second order with an ancestral step and Brownian
noise) = diffusers' DPMSolverSDEScheduler (A1111's "DPM++ SDE"; with use_karras_sigmas, "DPM++ SDE Karras").

A step from sigma to sigma_next is two model calls, as Heun's: an ancestral move to the geometric midpoint
sigma_mid (x0 from the model at sigma), the model at the midpoint, then the whole step again from the start with
that x0. diffusers runs it as a loop over 2N - 1 timesteps ([t_0, t_mid0, t_1, ..., t_mid(N-2), t_{N-1}]), the
last step a plain Euler step to sigma 0; so does this port (the stage is the traced index's parity).

The noise. diffusers draws both stages' noise from one Brownian motion W over sigma (torchsde's BrownianInterval,
seeded by the config's noise_sampler_seed, else at random), normalised by the interval's length: stage 1 reads
W over [sigma_mid, sigma], stage 2 over [sigma_next, sigma], which contains it. So stage 2's normal is not fresh:
n2 = (sqrt(sigma - sigma_mid) n1 + sqrt(sigma_mid - sigma_next) z) / sqrt(sigma - sigma_next), z independent of
n1: the same Brownian increments, made from two standard normals per step drawn from the row's own key (so an
output depends on its seed, not on a tree's). noise_sampler_seed is therefore not used.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from meshserve.models.schedulers.common import SigmaSchedule, at, sigma_to_t, step_noise
from meshserve.models.schedulers.euler import init_noise_sigma, predicted_original, training_sigmas
from meshserve.models.schedulers.k_diffusion import KDiffusionScheduler, heun_layout


def midpoint_sigma(sigma, sigma_next):
    """exp(-(t + (t_next - t) / 2)) with t = -log(sigma): the geometric mean, written as diffusers computes it."""
    t, t_next = -jnp.log(sigma), -jnp.log(sigma_next)
    return jnp.exp(-(t + (t_next - t) * 0.5))


@dataclass(frozen=True)
class DPMSolverSDEScheduler(KDiffusionScheduler):
    """Settings: diffusers' DPMSolverSDEScheduler config (defaults equal, its betas 0.00085-0.012 included);
    prediction_type "sample" is refused, as diffusers' step refuses it; noise_sampler_seed is accepted and not
    used (module docstring)."""

    beta_start: float = 0.00085
    beta_end: float = 0.012
    noise_sampler_seed: int | None = None

    stochastic = True
    order = 2
    takes_sample_prediction = False

    def schedule(self, num_inference_steps: int) -> SigmaSchedule:
        """timesteps [2N - 1] (the midpoints' at the odd calls), sigmas [2N] (each inner one twice, then 0)."""
        timesteps, sigmas = self.inference_sigmas(int(num_inference_steps))
        t = -np.log(sigmas)
        midpoints = np.exp(-(t[:-1] + np.diff(t) * 0.5))
        calls, sigmas = heun_layout(timesteps, sigmas)
        calls[1::2] = sigma_to_t(midpoints, np.log(training_sigmas(self)))
        return SigmaSchedule(
            timesteps=calls,
            sigmas=sigmas,
            init_noise_sigma=init_noise_sigma(sigmas, self.timestep_spacing),
        )

    def _stage(self, schedule: SigmaSchedule, i):
        """(first stage?, the step's sigma, its sigma_next, its midpoint); sigma_next 0 on the last step, whose
        midpoint is then the step's sigma (unused: that step is Euler's)."""
        first = i % 2 == 0
        sigma = jnp.where(first, at(schedule.sigmas, i), at(schedule.sigmas, i - 1))
        sigma_next = jnp.where(first, at(schedule.sigmas, i + 1), at(schedule.sigmas, i))
        mid = midpoint_sigma(sigma, jnp.where(sigma_next > 0, sigma_next, sigma))
        return first, sigma, sigma_next, mid

    def scale_model_input(self, schedule: SigmaSchedule, sample, i):
        """sample / sqrt(sigma^2 + 1) at the call's noise level: the step's start, or its midpoint."""
        first, sigma, _, mid = self._stage(schedule, i)
        sigma = jnp.where(first, sigma, mid)
        return (sample / (sigma**2 + 1) ** 0.5).astype(sample.dtype)

    def init_state(self, sample):
        """(the sample the step started from, stage 1's standard normal), float32."""
        return jnp.zeros(sample.shape, jnp.float32), jnp.zeros(sample.shape, jnp.float32)

    def generator_draws(self, schedule, start, stop, total, eta):
        # diffusers' noise comes from its Brownian tree (its own seed), never from the pipeline's generator
        return []

    def step(self, schedule: SigmaSchedule, state, model_output, sample, i, key=None, *, noise=None):
        """Stage 1 of a step at even i, stage 2 at odd i; returns (prev_sample in sample's dtype, state). The
        standard normal of this call is `noise` when given (stage 2: z of the module docstring), else drawn from
        `key` (one per row, or one for the batch); the last step draws nothing it uses."""
        first, sigma, sigma_next, mid = self._stage(schedule, i)
        start, first_normal = state
        x = sample.astype(jnp.float32)
        out = model_output.astype(jnp.float32)
        pred_original = predicted_original(self.prediction_type, jnp.where(first, sigma, mid), x, out)

        euler = x + (x - pred_original) / sigma * (sigma_next - sigma)  # the last step, to sigma 0

        base = jnp.where(first, x, start)
        sigma_to = jnp.where(first, mid, sigma_next)
        sigma_up = jnp.minimum(sigma_to, (sigma_to**2 * (sigma**2 - sigma_to**2) / sigma**2) ** 0.5)
        sigma_down = jnp.maximum(sigma_to**2 - sigma_up**2, 0.0) ** 0.5
        t, ancestral_t = -jnp.log(sigma), -jnp.log(sigma_down)
        ancestral = (jnp.exp(-ancestral_t) / jnp.exp(-t)) * base - jnp.expm1(t - ancestral_t) * pred_original
        normal = step_noise(key, noise, x)
        # Stage 2's Brownian increment over [sigma_next, sigma] contains stage 1's over [mid, sigma].
        second_normal = (
            (sigma - mid) ** 0.5 * first_normal + jnp.maximum(mid - sigma_next, 0.0) ** 0.5 * normal
        ) / jnp.where(sigma_next > 0, sigma - sigma_next, 1.0) ** 0.5
        ancestral = ancestral + jnp.where(first, normal, second_normal) * sigma_up

        prev_sample = jnp.where(sigma_next > 0, ancestral, euler)
        state = (base, jnp.where(first, normal, first_normal))
        return prev_sample.astype(sample.dtype), state
