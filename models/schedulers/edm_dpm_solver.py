"""DPM-Solver++ on EDM's parameterisation (edm.py) = diffusers' EDMDPMSolverMultistepScheduler, Playground
v2.5's scheduler: the multistep updates of dpm_solver.py with alpha_t = 1 and sigma_t = sigma (the inputs are
preconditioned before the UNet), EDM's sigmas, and x0 from EDM's output preconditioning.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from meshserve.models.schedulers.common import RESPACINGS, SigmaSchedule, at, f32, threshold_sample
from meshserve.models.schedulers.dpm_solver import DPMSolverMultistepScheduler
from meshserve.models.schedulers.edm import (
    c_noise,
    check_edm_settings,
    edm_sigmas,
    precondition_inputs,
    precondition_outputs,
)


@dataclass(frozen=True)
class EDMDPMSolverMultistepScheduler(DPMSolverMultistepScheduler):
    """Settings: diffusers' EDMDPMSolverMultistepScheduler config (defaults equal): sigma_min, sigma_max,
    sigma_data, sigma_schedule ("karras" with rho, or "exponential"), prediction_type epsilon or v_prediction,
    and DPM-Solver++'s solver_order, algorithm_type, solver_type, lower_order_final, euler_at_final,
    final_sigmas_type (its "sigma_min" is the config's), thresholding. Beta-schedule settings are not read."""

    sigma_min: float = 0.002
    sigma_max: float = 80.0
    sigma_data: float = 0.5
    sigma_schedule: str = "karras"
    rho: float = 7.0

    # Not settings of diffusers' EDM class: a config carrying them (another class's) is read without them.
    IGNORED = (
        "use_flow_sigmas",
        "flow_shift",
        *RESPACINGS,
        "use_lu_lambdas",
    )

    def __post_init__(self):
        super().__post_init__()
        check_edm_settings(self)

    def scheduler_arguments(self) -> dict:
        return {}  # diffusers' set_timesteps takes no custom schedule

    def schedule(self, num_inference_steps: int) -> SigmaSchedule:
        """timesteps [N] = c_noise of the sigmas; sigmas [N + 1] (then 0, or sigma_min)."""
        sigmas = edm_sigmas(self, int(num_inference_steps), np.float32)
        sigma_last = self.sigma_min if self.final_sigmas_type == "sigma_min" else 0.0
        return SigmaSchedule(
            timesteps=c_noise(sigmas),
            sigmas=f32(np.concatenate([sigmas, [sigma_last]])),
            init_noise_sigma=f32((self.sigma_max**2 + 1) ** 0.5),
        )

    def scale_model_input(self, schedule: SigmaSchedule, sample, i):
        """c_in x sample at sigmas[i], in sample's dtype."""
        return precondition_inputs(sample, at(schedule.sigmas, i), self.sigma_data).astype(sample.dtype)

    def _data_prediction(self, sigma, model_output, sample):
        x0 = precondition_outputs(
            self.prediction_type, self.sigma_data, sigma, sample, model_output.astype(jnp.float32)
        )
        if self.thresholding:
            x0 = threshold_sample(x0, self.dynamic_thresholding_ratio, self.sample_max_value)
        return x0

    def _alpha_sigma(self, sigma):
        return jnp.ones_like(sigma), sigma
