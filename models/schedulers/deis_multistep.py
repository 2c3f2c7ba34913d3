"""DEIS multistep (Zhang & Chen 2022, https://huggingface.co/papers/2204.13902) = diffusers'
DEISMultistepScheduler ("logrho", the only solver diffusers implements).

The loop of DPM-Solver multistep (dpm_solver.py: the history, the orders of the first and last steps) over the
noise prediction instead of x0: a step integrates the exponential integrator exactly for a polynomial in
log(rho), rho = sigma_t / alpha_t, through the last `solver_order` noise predictions. Its schedule ends at the
training sigma_min (not 0; on flow sigmas, at its own last sigma, repeated), so the last step never takes the
first-order update unless lower_order_final does.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from meshserve.models.schedulers.common import (
    SigmaSchedule,
    f32,
    multistep_timesteps,
    respaced_sigmas,
)
from meshserve.models.schedulers.dpm_solver import DPMSolverMultistepScheduler
from meshserve.models.schedulers.euler import training_sigmas


@dataclass(frozen=True)
class DEISMultistepScheduler(DPMSolverMultistepScheduler):
    """Settings: diffusers' DEISMultistepScheduler config (defaults equal): solver_order 1-3, lower_order_final,
    karras / exponential / beta sigmas, thresholding, flow sigmas (use_flow_sigmas with flow_prediction,
    flow_shift: DPM-Solver's, the last sigma repeated as the end). As diffusers, DPM-Solver's and UniPC's
    algorithm and solver names ("dpmsolver++", "midpoint", "bh2", ...) in a config read as DEIS's own."""

    algorithm_type: str = "deis"
    solver_type: str = "logrho"
    final_sigmas_type: str = "sigma_min"  # fixed: the schedule ends at the training sigma_min

    ALGORITHM_TYPES = ("deis",)
    SOLVER_TYPES = ("logrho",)
    CONFIG_ALIASES = {
        "algorithm_type": {"dpmsolver": "deis", "dpmsolver++": "deis"},
        "solver_type": {"midpoint": "logrho", "heun": "logrho", "bh1": "logrho", "bh2": "logrho"},
    }
    # DPM-Solver's settings that DEIS has not: a config carrying them (a DPM-Solver or Euler folder's) is read
    # as DEIS reads it, without them.
    IGNORED = (
        "final_sigmas_type",
        "euler_at_final",
        "lambda_min_clipped",
        "use_lu_lambdas",
        "variance_type",
        "rescale_betas_zero_snr",
    )

    def scheduler_arguments(self) -> dict:
        return self.argument_rules(sigmas=False, timesteps=False, sigmas_end=False)

    def schedule(self, num_inference_steps: int) -> SigmaSchedule:
        n = int(num_inference_steps)
        self.check_steps(n)
        train_sigmas = training_sigmas(self)
        if self.respaced:
            # Karras timesteps always rounded (DPM-Solver keeps a cosine schedule's fractional); the last sigma is
            # the respaced schedule's own end.
            sigmas, timesteps = respaced_sigmas(self, train_sigmas, n, round_karras=True)
            sigma_last = sigmas[-1]
        elif self.use_flow_sigmas:
            sigmas = self._flow_sigmas(n)
            timesteps, sigma_last = sigmas * self.num_train_timesteps, sigmas[-1]
        else:
            timesteps = multistep_timesteps(
                self.timestep_spacing,
                self.num_train_timesteps,
                self.num_train_timesteps,
                n,
                self.steps_offset,
            )
            sigmas = np.interp(timesteps, np.arange(len(train_sigmas)), train_sigmas)
            sigma_last = train_sigmas[0]
        sigmas = np.concatenate([sigmas, [sigma_last]])
        # int64 timesteps as diffusers': fractional ones (exponential / beta sigmas) truncated.
        timesteps = np.asarray(timesteps).astype(np.int64)
        return SigmaSchedule(timesteps=f32(timesteps), sigmas=f32(sigmas), init_noise_sigma=f32(1.0))

    def _convert_model_output(self, sigma, model_output, sample):
        """The noise prediction, through x0 (thresholded where the config says) as diffusers does."""
        x0 = self._data_prediction(sigma, model_output, sample)
        alpha_t, sigma_t = self._alpha_sigma(sigma)
        return (sample - alpha_t * x0) / sigma_t

    def _first_order(self, sigmas, i, history, sample, noise):
        (alpha_t, sigma_t, lambda_t), (alpha_s, _, lambda_s) = self._lambdas(sigmas, i, 1)
        h = lambda_t - lambda_s
        return (alpha_t / alpha_s) * sample - (sigma_t * (jnp.exp(h) - 1.0)) * history[-1]

    def _second_order(self, sigmas, i, history, sample, noise):
        (alpha_t, sigma_t, _), (alpha_s0, sigma_s0, _), (alpha_s1, sigma_s1, _) = self._lambdas(sigmas, i, 2)
        m0, m1 = history[-1], history[-2]
        rho_t, rho_s0, rho_s1 = sigma_t / alpha_t, sigma_s0 / alpha_s0, sigma_s1 / alpha_s1

        def ind_fn(t, b, c):  # the integral of the Lagrange basis polynomial through (b, c) in log rho
            return t * (-jnp.log(c) + jnp.log(t) - 1) / (jnp.log(b) - jnp.log(c))

        coef1 = ind_fn(rho_t, rho_s0, rho_s1) - ind_fn(rho_s0, rho_s0, rho_s1)
        coef2 = ind_fn(rho_t, rho_s1, rho_s0) - ind_fn(rho_s0, rho_s1, rho_s0)
        return alpha_t * (sample / alpha_s0 + coef1 * m0 + coef2 * m1)

    def _third_order(self, sigmas, i, history, sample, noise):
        lams = self._lambdas(sigmas, i, 3)
        alpha_t, alpha_s0 = lams[0][0], lams[1][0]
        rho_t, rho_s0, rho_s1, rho_s2 = (sigma / alpha for alpha, sigma, _ in lams)
        m0, m1, m2 = history[-1], history[-2], history[-3]

        def ind_fn(t, b, c, d):
            log_t, log_b, log_c, log_d = jnp.log(t), jnp.log(b), jnp.log(c), jnp.log(d)
            numerator = t * (log_c * (log_d - log_t + 1) - log_d * log_t + log_d + log_t**2 - 2 * log_t + 2)
            return numerator / ((log_b - log_c) * (log_b - log_d))

        coef1 = ind_fn(rho_t, rho_s0, rho_s1, rho_s2) - ind_fn(rho_s0, rho_s0, rho_s1, rho_s2)
        coef2 = ind_fn(rho_t, rho_s1, rho_s2, rho_s0) - ind_fn(rho_s0, rho_s1, rho_s2, rho_s0)
        coef3 = ind_fn(rho_t, rho_s2, rho_s0, rho_s1) - ind_fn(rho_s0, rho_s2, rho_s0, rho_s1)
        return alpha_t * (sample / alpha_s0 + coef1 * m0 + coef2 * m1 + coef3 * m2)
