"""Euler on EDM's parameterisation (edm.py) = diffusers' EDMEulerScheduler (without churn: its pipelines never
pass s_churn): x0 from EDM's output preconditioning, one Euler step of dx/dsigma = (x - x0) / sigma.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from meshserve.models.schedulers.common import NoiseScheduler, SigmaSchedule, at, check_choice, f32
from meshserve.models.schedulers.edm import (
    c_noise,
    check_edm_settings,
    edm_sigmas,
    precondition_inputs,
    precondition_outputs,
)


@dataclass(frozen=True)
class EDMEulerScheduler(NoiseScheduler):
    """Settings: diffusers' EDMEulerScheduler config (defaults equal): sigma_min, sigma_max, sigma_data,
    sigma_schedule, rho, prediction_type epsilon or v_prediction, final_sigmas_type ("sigma_min": the last
    inference sigma again, as diffusers'). Beta-schedule settings are not read."""

    sigma_min: float = 0.002
    sigma_max: float = 80.0
    sigma_data: float = 0.5
    sigma_schedule: str = "karras"
    rho: float = 7.0
    final_sigmas_type: str = "zero"

    def __post_init__(self):
        super().__post_init__()
        check_edm_settings(self)
        check_choice("final_sigmas_type", self.final_sigmas_type, ("zero", "sigma_min"))

    def schedule(self, num_inference_steps: int) -> SigmaSchedule:
        sigmas = edm_sigmas(self, int(num_inference_steps), np.float64)
        sigma_last = sigmas[-1] if self.final_sigmas_type == "sigma_min" else 0.0
        return SigmaSchedule(
            timesteps=c_noise(sigmas),
            sigmas=f32(np.concatenate([sigmas, [sigma_last]])),
            init_noise_sigma=f32((self.sigma_max**2 + 1) ** 0.5),
        )

    def scale_model_input(self, schedule: SigmaSchedule, sample, i):
        """c_in x sample at sigmas[i], in sample's dtype."""
        return precondition_inputs(sample, at(schedule.sigmas, i), self.sigma_data).astype(sample.dtype)

    def step(self, schedule: SigmaSchedule, state, model_output, sample, i, key=None, *, noise=None):
        """One Euler step from sigmas[i] to sigmas[i + 1]; float32 as diffusers; `key`, `noise` unused."""
        sigma, sigma_next = at(schedule.sigmas, i), at(schedule.sigmas, i + 1)
        x = sample.astype(jnp.float32)
        x0 = precondition_outputs(
            self.prediction_type, self.sigma_data, sigma, x, model_output.astype(jnp.float32)
        )
        return (x + (x - x0) / sigma * (sigma_next - sigma)).astype(sample.dtype), state
