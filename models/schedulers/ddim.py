"""DDIM (Song et al. 2020, https://huggingface.co/papers/2010.02502) = diffusers' DDIMScheduler.

Works in alpha_bar (alphas_cumprod) rather than sigma: x_t = sqrt(a_t) x0 + sqrt(1 - a_t) eps. A step predicts
x0 and eps from the model output, then re-noises x0 to the previous timestep's level along eps; eta > 0 mixes
in fresh noise (eta = 1 is DDPM-like), eta = 0 is deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from meshserve.models.schedulers.common import (
    NoiseScheduler,
    alpha_bar_prediction,
    at,
    clip_or_threshold,
    f32,
    schedule_dataclass,
    spaced_timesteps,
    step_noise,
)


@schedule_dataclass
class DDIMSchedule:
    """timesteps: [N] float32 (integers, as float for a uniform UNet input);
    alpha_prod_t, alpha_prod_t_prev: [N] float32 alpha_bar at step i's timestep and at the one it steps to;
    init_noise_sigma: [] float32 (1: DDIM's latents are unit Gaussian);
    eta: [] float32, the weight of the fresh noise (diffusers' `eta` call argument): traced, so a request's
        own eta compiles nothing;
    steps: None, or [] int32 when the arrays are padded past the schedule's end (`pad_schedule`)."""

    timesteps: object
    alpha_prod_t: object
    alpha_prod_t_prev: object
    init_noise_sigma: object
    eta: object
    steps: object = None


@dataclass(frozen=True)
class DDIMScheduler(NoiseScheduler):
    """Settings: diffusers' DDIMScheduler config (defaults equal: note clip_sample=True and "leading" spacing),
    plus eta, the noise weight diffusers takes as a step argument (its pipelines' default 0): this field is the
    default of the schedule's traced `eta`, which a call may set (`schedule(n, eta=)`)."""

    timestep_spacing: str = "leading"
    clip_sample: bool = True
    set_alpha_to_one: bool = True
    thresholding: bool = False
    dynamic_thresholding_ratio: float = 0.995
    clip_sample_range: float = 1.0
    sample_max_value: float = 1.0
    eta: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        if self.eta < 0:
            raise ValueError(f"DDIM eta must be >= 0, got {self.eta}")

    # Every step draws its noise: eta is traced, and at eta = 0 the noise is weighted by an exact 0 (the same
    # sample as no draw; one normal draw per latent is small beside a UNet step).
    stochastic = True

    def scheduler_arguments(self) -> dict:
        return {**self.argument_rules(sigmas=False, timesteps=False, sigmas_end=False), "eta": True}

    def schedule(self, num_inference_steps: int, *, eta: float | None = None) -> DDIMSchedule:
        """The schedule of N steps; `eta`: diffusers' call argument (None: this scheduler's `eta`)."""
        n = int(num_inference_steps)
        self.check_steps(n)
        eta = self.eta if eta is None else float(eta)
        if not eta >= 0:
            raise ValueError(f"DDIM eta must be >= 0, got {eta}")
        alphas_cumprod = self.alphas_cumprod()
        # The alpha_bar "before" the first training step: 1 (a clean sample) or, for SD 1.x-style configs,
        # alpha_bar[0].
        final_alpha_cumprod = 1.0 if self.set_alpha_to_one else alphas_cumprod[0]
        timesteps = spaced_timesteps(
            self.timestep_spacing, self.num_train_timesteps, n, self.steps_offset, round_linspace=True
        ).astype(np.int64)
        # diffusers steps back by num_train // n whatever the spacing (exact only for "leading"); kept as is.
        prev_timesteps = timesteps - self.num_train_timesteps // n
        alpha_prod_t_prev = np.where(
            prev_timesteps >= 0, alphas_cumprod[np.maximum(prev_timesteps, 0)], final_alpha_cumprod
        )
        return DDIMSchedule(
            timesteps=f32(timesteps),
            alpha_prod_t=f32(alphas_cumprod[timesteps]),
            alpha_prod_t_prev=f32(alpha_prod_t_prev),
            init_noise_sigma=f32(1.0),
            eta=f32(eta),
        )

    def generator_draws(self, schedule, start, stop, total, eta):
        return list(range(start, stop)) if eta > 0 else []  # diffusers draws only when eta > 0

    def step(self, schedule: DDIMSchedule, state, model_output, sample, i, key=None, *, noise=None):
        """One DDIM step; returns (prev_sample in sample's dtype, state). The added noise (weighted by the
        schedule's eta) is `noise` when given, else jax.random.normal(key, sample.shape)."""
        alpha_prod_t = at(schedule.alpha_prod_t, i)
        alpha_prod_t_prev = at(schedule.alpha_prod_t_prev, i)
        beta_prod_t = 1 - alpha_prod_t
        x = sample.astype(jnp.float32)
        pred_original, pred_epsilon = alpha_bar_prediction(
            self.prediction_type, alpha_prod_t, x, model_output.astype(jnp.float32)
        )
        pred_original = clip_or_threshold(self, pred_original)

        # sigma_t of the DDIM paper (eq. 16) times eta.
        variance = ((1 - alpha_prod_t_prev) / beta_prod_t) * (1 - alpha_prod_t / alpha_prod_t_prev)
        std_dev_t = schedule.eta * variance**0.5
        # Exactly 0 at eta = 1 with a zero-terminal-SNR schedule: rounding decides its sign (a NaN sample in
        # diffusers at some step counts, in ours at others), hence the clamp.
        pred_sample_direction = jnp.maximum(1 - alpha_prod_t_prev - std_dev_t**2, 0.0) ** 0.5 * pred_epsilon
        prev_sample = alpha_prod_t_prev**0.5 * pred_original + pred_sample_direction
        prev_sample = prev_sample + std_dev_t * step_noise(key, noise, x)
        return prev_sample.astype(sample.dtype), state
