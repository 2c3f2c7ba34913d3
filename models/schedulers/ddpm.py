"""DDPM ancestral sampling (Ho et al. 2020, https://huggingface.co/papers/2006.11239) = diffusers' DDPMScheduler.

Like DDIM it works in alpha_bar: a step predicts x0, takes the mean of the posterior q(x_{t-1} | x_t, x0) (a blend
of x0 and x_t) and adds fresh noise of the posterior's standard deviation, except at timestep 0. Unlike DDIM,
the previous timestep is the schedule's next entry (diffusers' previous_timestep), so custom timesteps step
where they say.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from meshserve.models.schedulers.common import (
    NoiseScheduler,
    alpha_bar_prediction,
    at,
    check_choice,
    clip_or_threshold,
    f32,
    schedule_dataclass,
    spaced_timesteps,
    step_noise,
)

# diffusers' fixed variances; "fixed_large_log" is left out (its step takes the square root of log(beta), NaN
# in diffusers), and the learned ones need a UNet that predicts its variance (twice the latent channels).
VARIANCE_TYPES = ("fixed_small", "fixed_small_log", "fixed_large")


@schedule_dataclass
class DDPMSchedule:
    """timesteps: [N] float32 (integers, as float for a uniform UNet input);
    alpha_prod_t, alpha_prod_t_prev: [N] float32 alpha_bar at step i's timestep and at the next one (1 after the
        last step);
    noise_std: [N] float32, the standard deviation of the noise step i adds (0 at timestep 0);
    init_noise_sigma: [] float32 (1: the latents are unit Gaussian);
    steps: None, or [] int32 when the arrays are padded past the schedule's end (`pad_schedule`)."""

    timesteps: object
    alpha_prod_t: object
    alpha_prod_t_prev: object
    noise_std: object
    init_noise_sigma: object
    steps: object = None


@dataclass(frozen=True)
class DDPMScheduler(NoiseScheduler):
    """Settings: diffusers' DDPMScheduler config (defaults equal: clip_sample=True, "leading" spacing)."""

    timestep_spacing: str = "leading"
    variance_type: str = "fixed_small"
    clip_sample: bool = True
    clip_sample_range: float = 1.0
    thresholding: bool = False
    dynamic_thresholding_ratio: float = 0.995
    sample_max_value: float = 1.0

    stochastic = True
    # A DPM-Solver folder's `variance_type: null` (its learned-variance switch): diffusers' DDPM step then
    # takes the fixed_small variance.
    CONFIG_ALIASES = {"variance_type": {None: "fixed_small"}}

    def __post_init__(self):
        super().__post_init__()
        check_choice("variance_type", self.variance_type, VARIANCE_TYPES)

    def scheduler_arguments(self) -> dict:
        return self.argument_rules(sigmas=False, timesteps=True, sigmas_end=False)

    def schedule(self, num_inference_steps: int, *, timesteps=None) -> DDPMSchedule:
        """The schedule of N steps, or of `timesteps` (diffusers' custom ones: N decreasing integers below
        num_train_timesteps) in place of the spaced ones."""
        n = int(num_inference_steps)
        self.check_steps(n)
        if timesteps is not None:
            timesteps = np.asarray(timesteps).astype(np.int64)
            if len(timesteps) != n:
                raise ValueError(f"{n} steps take {n} timesteps, got {len(timesteps)}")
            if (
                np.any(np.diff(timesteps) >= 0)
                or timesteps[0] >= self.num_train_timesteps
                or timesteps[-1] < 0
            ):
                raise ValueError(
                    f"timesteps must decrease strictly within [0, {self.num_train_timesteps - 1}]"
                )
        else:
            timesteps = spaced_timesteps(
                self.timestep_spacing, self.num_train_timesteps, n, self.steps_offset, round_linspace=True
            ).astype(np.int64)
        alphas_cumprod = self.alphas_cumprod()
        prev_timesteps = np.append(timesteps[1:], -1)
        alpha_prod_t = alphas_cumprod[timesteps]
        alpha_prod_t_prev = np.where(
            prev_timesteps >= 0, alphas_cumprod[np.maximum(prev_timesteps, 0)], np.float32(1.0)
        ).astype(np.float32)
        # diffusers' _get_variance, in float32 as its torch tensors: the posterior variance (fixed_small) or
        # the step's beta (fixed_large).
        current_beta_t = np.float32(1.0) - alpha_prod_t / alpha_prod_t_prev
        if self.variance_type == "fixed_large":
            std = current_beta_t**0.5
        else:  # fixed_small; fixed_small_log is exp(0.5 log variance), the same standard deviation
            variance = (
                (np.float32(1.0) - alpha_prod_t_prev) / (np.float32(1.0) - alpha_prod_t) * current_beta_t
            )
            std = np.maximum(variance, np.float32(1e-20)) ** 0.5
        return DDPMSchedule(
            timesteps=f32(timesteps),
            alpha_prod_t=f32(alpha_prod_t),
            alpha_prod_t_prev=f32(alpha_prod_t_prev),
            noise_std=f32(np.where(timesteps > 0, std, 0.0)),
            init_noise_sigma=f32(1.0),
        )

    def generator_draws(self, schedule, start, stop, total, eta):
        # diffusers draws where t > 0
        timesteps = np.asarray(schedule.timesteps)
        return [i for i in range(start, stop) if timesteps[i] > 0]

    def step(self, schedule: DDPMSchedule, state, model_output, sample, i, key=None, *, noise=None):
        """One DDPM step; returns (prev_sample in sample's dtype, state). The added noise is `noise` when given,
        else jax.random.normal(key, sample.shape), weighted by the schedule's noise_std (0 at timestep 0)."""
        alpha_prod_t = at(schedule.alpha_prod_t, i)
        alpha_prod_t_prev = at(schedule.alpha_prod_t_prev, i)
        beta_prod_t, beta_prod_t_prev = 1 - alpha_prod_t, 1 - alpha_prod_t_prev
        current_alpha_t = alpha_prod_t / alpha_prod_t_prev
        current_beta_t = 1 - current_alpha_t
        x = sample.astype(jnp.float32)
        pred_original, _ = alpha_bar_prediction(
            self.prediction_type, alpha_prod_t, x, model_output.astype(jnp.float32)
        )
        pred_original = clip_or_threshold(self, pred_original)

        # The posterior mean (formula 7 of the paper): a blend of the x0 prediction and the current sample.
        pred_original_coeff = (alpha_prod_t_prev**0.5 * current_beta_t) / beta_prod_t
        current_sample_coeff = current_alpha_t**0.5 * beta_prod_t_prev / beta_prod_t
        prev_sample = pred_original_coeff * pred_original + current_sample_coeff * x
        prev_sample = prev_sample + at(schedule.noise_std, i) * step_noise(key, noise, x)
        return prev_sample.astype(sample.dtype), state
