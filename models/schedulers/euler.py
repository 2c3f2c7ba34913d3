"""Euler (Karras et al. 2022, Algorithm 2 without churn) = diffusers' EulerDiscreteScheduler, SDXL's default.

The sample lives at noise level sigma (x = x0 + sigma * eps); the UNet sees it scaled by 1 / sqrt(sigma^2 + 1)
(the variance-preserving input it was trained on) and the step is one Euler move of the probability-flow ODE
dx/dsigma = (x - x0) / sigma from sigmas[i] to sigmas[i + 1].
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from meshserve.models.schedulers.common import (
    NoiseScheduler,
    RespacedSigmasInRange,
    SigmaSchedule,
    at,
    check_choice,
    f32,
    sigma_to_t,
    spaced_timesteps,
)

# The largest custom sigma: far above any trained schedule's (SDXL 14.6; zero terminal SNR's cap about 4096;
# EDM's 80), far below where sigma^2 + 1 overflows float32 (1.8e19: a NaN image, in diffusers too).
MAX_CUSTOM_SIGMA = 1e4


def capped_alphas_cumprod(scheduler: NoiseScheduler) -> np.ndarray:
    """[num_train_timesteps] float32 alpha_bar of the sigma-parameterised schedulers."""
    alphas_cumprod = scheduler.alphas_cumprod()
    if scheduler.rescale_betas_zero_snr:
        # Zero terminal SNR means sigma = inf at the last timestep; diffusers caps it at alpha_bar = 2^-24
        # (sigma ~ 4096) so the first step stays finite.
        alphas_cumprod[-1] = 2.0**-24
    return alphas_cumprod


def training_sigmas(scheduler: NoiseScheduler) -> np.ndarray:
    """[num_train_timesteps] float32 sigma of every training timestep, ascending in t."""
    alphas_cumprod = capped_alphas_cumprod(scheduler)
    return ((1 - alphas_cumprod) / alphas_cumprod) ** 0.5


def init_noise_sigma(sigmas: np.ndarray, timestep_spacing: str) -> np.ndarray:
    """The latents' initial scale: sigma_max, or sqrt(sigma_max^2 + 1) for "leading" spacing, whose first
    timestep (e.g. 981 of 1000) is short of the last training one (diffusers keeps this for SD's configs)."""
    sigma_max = np.max(sigmas)
    return f32(sigma_max if timestep_spacing in ("linspace", "trailing") else (sigma_max**2 + 1) ** 0.5)


def predicted_original(prediction_type: str, sigma, sample, model_output):
    """x0 from the model output at noise level sigma (all float32, traced)."""
    if prediction_type == "epsilon":
        return sample - sigma * model_output
    if prediction_type == "v_prediction":
        return model_output * (-sigma / (sigma**2 + 1) ** 0.5) + sample / (sigma**2 + 1)
    return model_output  # "sample"


@dataclass(frozen=True)
class EulerDiscreteScheduler(RespacedSigmasInRange):
    """Settings: diffusers' EulerDiscreteScheduler config (defaults equal). interpolation_type places the
    inference sigmas ("linear" in t, or "log_linear" from sigma_max to sigma_min); at most one of
    use_karras/exponential/beta_sigmas respaces them, the timesteps following by interpolation in log sigma;
    timestep_type "continuous" with v_prediction gives the UNet 0.25 * log(sigma) (EDM models);
    final_sigmas_type: the last step ends at 0 ("zero") or at the smallest training sigma ("sigma_min")."""

    interpolation_type: str = "linear"
    timestep_type: str = "discrete"
    final_sigmas_type: str = "zero"

    def __post_init__(self):
        super().__post_init__()
        check_choice("interpolation_type", self.interpolation_type, ("linear", "log_linear"))
        check_choice("timestep_type", self.timestep_type, ("discrete", "continuous"))
        check_choice("final_sigmas_type", self.final_sigmas_type, ("zero", "sigma_min"))
        self.check_one_spacing()

    def scheduler_arguments(self) -> dict:
        # diffusers refuses custom timesteps where the sigmas are respaced or the timesteps come from them.
        edm = self.timestep_type == "continuous" and self.prediction_type == "v_prediction"
        return self.argument_rules(
            sigmas=True, timesteps=not (self.respaced or edm), sigmas_end=True, max_sigma=MAX_CUSTOM_SIGMA
        )

    def schedule(self, num_inference_steps: int, *, sigmas=None, timesteps=None) -> SigmaSchedule:
        """The schedule of N steps; or diffusers' custom one: `sigmas` (N + 1, the last step's end included;
        timesteps by interpolation in log sigma) or `timesteps` (N, in place of the spaced ones)."""
        n = int(num_inference_steps)
        self.check_steps(n)
        train_sigmas = training_sigmas(self)
        log_sigmas = np.log(train_sigmas)
        if sigmas is not None:
            sigmas = f32(sigmas)
            if len(sigmas) != n + 1:
                raise ValueError(f"{n} steps take {n + 1} sigmas, got {len(sigmas)}")
            return self._timed(f32(sigma_to_t(sigmas[:-1], log_sigmas)), sigmas)
        if timesteps is not None:
            if not self.scheduler_arguments()["timesteps"]:
                raise ValueError("custom timesteps are not supported with respaced sigmas or EDM timesteps")
            timesteps = f32(timesteps)
            if len(timesteps) != n:
                raise ValueError(f"{n} steps take {n} timesteps, got {len(timesteps)}")
        else:
            timesteps = spaced_timesteps(
                self.timestep_spacing, self.num_train_timesteps, n, self.steps_offset, round_linspace=False
            )
        if self.interpolation_type == "linear":
            sigmas = np.interp(timesteps, np.arange(len(train_sigmas)), train_sigmas)
        else:  # diffusers' log_linear yields n + 1 sigmas (then n + 2 with the final one); kept as is.
            sigmas = np.exp(np.linspace(log_sigmas[-1], log_sigmas[0], n + 1))

        if self.respaced:
            # Euler respaces between the ends of the *inference* sigmas (DPM-Solver uses the training ones).
            sigmas = self.respaced_between(sigmas[-1], sigmas[0], n)
            timesteps = sigma_to_t(sigmas, log_sigmas)

        sigma_last = train_sigmas[0] if self.final_sigmas_type == "sigma_min" else 0.0
        return self._timed(f32(timesteps), f32(np.concatenate([sigmas, [sigma_last]])))

    def _timed(self, timesteps: np.ndarray, sigmas: np.ndarray) -> SigmaSchedule:
        if self.timestep_type == "continuous" and self.prediction_type == "v_prediction":
            timesteps = 0.25 * np.log(sigmas[:-1])
        return SigmaSchedule(
            timesteps=f32(timesteps),
            sigmas=sigmas,
            init_noise_sigma=init_noise_sigma(sigmas, self.timestep_spacing),
        )

    def scale_model_input(self, schedule: SigmaSchedule, sample, i):
        """sample / sqrt(sigma_i^2 + 1): the UNet's input at step i, in sample's dtype."""
        sigma = at(schedule.sigmas, i)
        return (sample / (sigma**2 + 1) ** 0.5).astype(sample.dtype)

    def step(self, schedule: SigmaSchedule, state, model_output, sample, i, key=None, *, noise=None):
        """One Euler step from sigmas[i] to sigmas[i + 1]; returns (prev_sample in sample's dtype, state).

        Computed in float32 as diffusers does. Churn (s_churn > 0) is not offered: diffusers' pipelines never
        pass it, so gamma = 0 and sigma_hat = sigma. `key` and `noise` are unused (a deterministic step).
        """
        sigma = at(schedule.sigmas, i)
        sigma_next = at(schedule.sigmas, i + 1)
        x = sample.astype(jnp.float32)
        out = model_output.astype(jnp.float32)
        pred_original = predicted_original(self.prediction_type, sigma, x, out)
        derivative = (x - pred_original) / sigma
        prev_sample = x + derivative * (sigma_next - sigma)
        return prev_sample.astype(sample.dtype), state
