"""LCM (Latent Consistency Models, Luo et al. 2023, https://huggingface.co/papers/2310.04378) = diffusers'
LCMScheduler: the sampler of LCM-distilled UNets and of LCM-LoRA adapters (2-8 steps, guidance ~1).

A consistency model maps any point of the trajectory straight to its end. Each step turns the model output into
x0 (as DDIM does), mixes it with the sample by the consistency boundary conditions c_skip / c_out (the sample's
share vanishes as t grows), and, except at the last step, noises that estimate afresh to the next timestep's
level: the sample forgets its past, so the result depends on the noise drawn at every step.

The timesteps are a subset of the distillation's own `original_inference_steps` (50) evenly spaced training
timesteps (k - 1, 2k - 1, ... for k = 1000 / 50), so a schedule holds at most that many steps;
`timestep_spacing` and `steps_offset` do not apply (diffusers' LCMScheduler ignores them too).
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
    step_noise,
)

# diffusers' get_scalings_for_boundary_condition_discrete: sigma_data of the consistency parameterisation.
SIGMA_DATA = 0.5


@schedule_dataclass
class LCMSchedule:
    """timesteps: [N] float32 (integer training timesteps, as float for a uniform UNet input);
    alpha_prod_t: [N] float32 alpha_bar at step i's timestep (also what image inputs are noised with);
    alpha_prod_t_prev: [N] float32 alpha_bar of the timestep step i re-noises to (unused at the last step);
    c_skip, c_out: [N] float32 the boundary conditions at step i's timestep;
    init_noise_sigma: [] float32 (1: the latents are unit Gaussian);
    steps: None, or [] int32 when the arrays are padded past the schedule's end (`pad_schedule`)."""

    timesteps: object
    alpha_prod_t: object
    alpha_prod_t_prev: object
    c_skip: object
    c_out: object
    init_noise_sigma: object
    steps: object = None


@dataclass(frozen=True)
class LCMScheduler(NoiseScheduler):
    """Settings: diffusers' LCMScheduler config (defaults equal; note scaled_linear betas 0.00085-0.012, SD's
    and SDXL's, so `LCMScheduler.from_config(an SDXL folder's scheduler config)` reads as diffusers' does)."""

    beta_start: float = 0.00085
    beta_end: float = 0.012
    beta_schedule: str = "scaled_linear"
    timestep_spacing: str = "leading"
    original_inference_steps: int = 50
    clip_sample: bool = False
    clip_sample_range: float = 1.0
    set_alpha_to_one: bool = True
    thresholding: bool = False
    dynamic_thresholding_ratio: float = 0.995
    sample_max_value: float = 1.0
    timestep_scaling: float = 10.0

    # Every step but the last adds fresh noise; the last one's draw is weighted out (`step`).
    stochastic = True

    def __post_init__(self):
        super().__post_init__()
        if not 1 <= self.original_inference_steps <= self.num_train_timesteps:
            raise ValueError(
                f"LCMScheduler: original_inference_steps must be in [1, {self.num_train_timesteps}], "
                f"got {self.original_inference_steps}"
            )

    def max_steps(self) -> int:
        """The most steps a schedule of N steps can have: the distillation's own schedule's length."""
        return self.original_inference_steps

    def scheduler_arguments(self) -> dict:
        return {
            **self.argument_rules(sigmas=False, timesteps=True, sigmas_end=False),
            "max_steps": self.max_steps(),
        }

    def origin_timesteps(self) -> np.ndarray:
        """The distillation's timesteps, ascending: k - 1, 2k - 1, ..., for k = num_train // original steps."""
        k = self.num_train_timesteps // self.original_inference_steps
        return np.arange(1, self.original_inference_steps + 1, dtype=np.int64) * k - 1

    def distilled_timesteps(self, num_inference_steps: int, timesteps=None) -> np.ndarray:
        """[N] int64: N of the distillation's timesteps evenly spaced by index from the noisiest, or the
        caller's own (checked: N of them, strictly decreasing, training timesteps)."""
        n = int(num_inference_steps)
        self.check_steps(n)
        if timesteps is not None:
            timesteps = np.asarray(timesteps, np.int64)
            if len(timesteps) != n:
                raise ValueError(f"{n} steps take {n} timesteps, got {len(timesteps)}")
            if np.any(np.diff(timesteps) >= 0):
                raise ValueError("custom timesteps must be in descending order")
            if timesteps[0] >= self.num_train_timesteps or timesteps[-1] < 0:
                raise ValueError(f"timesteps must be in [0, {self.num_train_timesteps - 1}]")
            return timesteps
        if n > self.max_steps():
            raise ValueError(
                f"{type(self).__name__} makes at most original_inference_steps = {self.max_steps()} steps, got {n}"
            )
        origin = self.origin_timesteps()[::-1]
        return origin[np.floor(np.linspace(0, len(origin), num=n, endpoint=False)).astype(np.int64)]

    def schedule(self, num_inference_steps: int, *, timesteps=None) -> LCMSchedule:
        """The schedule of N steps: N of the distillation's timesteps, evenly spaced by index from the noisiest
        (diffusers' set_timesteps at strength 1; a strength is applied by the caller, as diffusers' img2img
        pipelines do), or the caller's own strictly decreasing `timesteps` (N of them)."""
        timesteps = self.distilled_timesteps(num_inference_steps, timesteps)
        alphas_cumprod = self.alphas_cumprod()
        final_alpha_cumprod = np.float32(1.0) if self.set_alpha_to_one else alphas_cumprod[0]
        # The timestep step i re-noises to: the next one (the last step re-noises nowhere; diffusers reads its
        # own timestep there).
        prev_timesteps = np.concatenate([timesteps[1:], timesteps[-1:]])
        alpha_prod_t_prev = np.where(
            prev_timesteps >= 0, alphas_cumprod[np.maximum(prev_timesteps, 0)], final_alpha_cumprod
        )
        scaled = timesteps.astype(np.float32) * np.float32(self.timestep_scaling)
        c_skip = SIGMA_DATA**2 / (scaled**2 + SIGMA_DATA**2)
        c_out = scaled / (scaled**2 + SIGMA_DATA**2) ** 0.5
        return LCMSchedule(
            timesteps=f32(timesteps),
            alpha_prod_t=f32(alphas_cumprod[timesteps]),
            alpha_prod_t_prev=f32(alpha_prod_t_prev),
            c_skip=f32(c_skip),
            c_out=f32(c_out),
            init_noise_sigma=f32(1.0),
        )

    def generator_draws(self, schedule, start, stop, total, eta):
        # diffusers draws on every step but the schedule's last
        return [i for i in range(start, stop) if i != total - 1]

    def step(self, schedule: LCMSchedule, state, model_output, sample, i, key=None, *, noise=None):
        """One LCM step; returns (prev_sample in sample's dtype, state). The fresh noise of every step but the
        last is `noise` when given (standard normal, sample's shape), else jax.random.normal(key, ...)."""
        alpha_prod_t = at(schedule.alpha_prod_t, i)
        alpha_prod_t_prev = at(schedule.alpha_prod_t_prev, i)
        x = sample.astype(jnp.float32)
        pred_original, _ = alpha_bar_prediction(
            self.prediction_type, alpha_prod_t, x, model_output.astype(jnp.float32)
        )
        pred_original = clip_or_threshold(self, pred_original)
        denoised = at(schedule.c_out, i) * pred_original + at(schedule.c_skip, i) * x
        renoised = alpha_prod_t_prev**0.5 * denoised + (1 - alpha_prod_t_prev) ** 0.5 * step_noise(
            key, noise, x
        )
        # The last step returns the estimate itself (i is traced: a select, not a branch).
        prev_sample = jnp.where(i == schedule.num_steps - 1, denoised, renoised)
        return prev_sample.astype(sample.dtype), state
