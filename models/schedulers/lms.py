"""Linear multistep (k-diffusion's sample_lms) = diffusers' LMSDiscreteScheduler (A1111's "LMS"; with
use_karras_sigmas, "LMS Karras").

Each step integrates the probability-flow ODE from sigma_i to sigma_{i+1} with the slopes of the last (up to) 4
steps: the Lagrange polynomial through them, integrated exactly. The weights depend on the sigmas alone, so they
are made on the host with the schedule ([N, 4], zero past a step's order), where diffusers integrates each one
numerically per step (scipy's quad: exact for these polynomials of degree <= 3 up to rounding); the carried state
is the last 4 slopes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np

from meshserve.models.schedulers.common import at, f32, schedule_dataclass
from meshserve.models.schedulers.euler import EulerDiscreteScheduler, init_noise_sigma, predicted_original
from meshserve.models.schedulers.k_diffusion import KDiffusionScheduler

ORDER = 4  # diffusers' step(order=4): its pipelines never pass another


@schedule_dataclass
class LMSSchedule:
    """timesteps: [N] float32; sigmas: [N + 1] float32 (then 0); coefficients: [N, ORDER] float32, step i's
    weight of the slope k steps back; init_noise_sigma: [] float32; steps: None, or [] int32 when padded."""

    timesteps: Any
    sigmas: Any
    coefficients: Any
    init_noise_sigma: Any
    steps: Any = None


def lms_coefficients(sigmas: np.ndarray, order: int = ORDER) -> np.ndarray:
    """[N, order] float64: step i's weight of the slope at sigmas[i - k], the integral from sigmas[i] to
    sigmas[i + 1] of the Lagrange basis polynomial of that node over the step's min(i + 1, order) nodes."""
    sigmas = np.asarray(sigmas, np.float64)
    n = len(sigmas) - 1
    out = np.zeros((n, order))
    for i in range(n):
        nodes = sigmas[i - np.arange(min(i + 1, order))]
        for k, node in enumerate(nodes):
            others = np.delete(nodes, k)
            basis = np.polynomial.Polynomial([1.0])
            if len(others):
                basis = np.polynomial.Polynomial.fromroots(others) / np.prod(node - others)
            antiderivative = basis.integ()
            out[i, k] = antiderivative(sigmas[i + 1]) - antiderivative(sigmas[i])
    return out


@dataclass(frozen=True)
class LMSDiscreteScheduler(KDiffusionScheduler):
    """Settings: diffusers' LMSDiscreteScheduler config (defaults equal)."""

    def schedule(self, num_inference_steps: int) -> LMSSchedule:
        timesteps, sigmas = self.inference_sigmas(int(num_inference_steps))
        sigmas = f32(np.concatenate([sigmas, [0.0]]))
        return LMSSchedule(
            timesteps=f32(timesteps),
            sigmas=sigmas,
            coefficients=f32(lms_coefficients(sigmas)),
            init_noise_sigma=init_noise_sigma(sigmas, self.timestep_spacing),
        )

    # The UNet's input at step i: sample / sqrt(sigmas[i]^2 + 1), as Euler's.
    scale_model_input = EulerDiscreteScheduler.scale_model_input

    def init_state(self, sample):
        """The last ORDER slopes, newest first, float32 [ORDER, *sample.shape] (zeros before the first)."""
        return jnp.zeros((ORDER, *sample.shape), jnp.float32)

    def step(self, schedule: LMSSchedule, state, model_output, sample, i, key=None, *, noise=None):
        """One step from sigmas[i] to sigmas[i + 1]; returns (prev_sample in sample's dtype, state). `key` and
        `noise` are unused."""
        sigma = at(schedule.sigmas, i)
        x = sample.astype(jnp.float32)
        out = model_output.astype(jnp.float32)
        derivative = (x - predicted_original(self.prediction_type, sigma, x, out)) / sigma
        state = jnp.concatenate([derivative[None], state[:-1]])
        coefficients = jnp.asarray(schedule.coefficients)[i]
        weighted = coefficients[0] * state[0]
        for k in range(1, ORDER):  # diffusers' sum, newest slope first
            weighted = weighted + coefficients[k] * state[k]
        return (x + weighted).astype(sample.dtype), state
