"""TCD (Trajectory Consistency Distillation, Zheng et al. 2024, https://huggingface.co/papers/2402.19159) =
diffusers' TCDScheduler: the sampler of TCD-distilled SDXL adapters (TCD-SDXL-LoRA, Hyper-SD's).

LCM's schedule (N of the distillation's timesteps). A step turns the model output into x0 and eps, moves along
them to an intermediate timestep s = floor((1 - gamma) t_prev), and for gamma > 0 noises from s back to t_prev's
level with fresh noise (no noise after the last step); gamma = 0 is deterministic. gamma is diffusers' `eta`
step argument, which its SDXL pipelines pass from their own `eta` (default 0): here the schedule's alpha_bar
at s, computed on the host for a request's eta (a new eta compiles nothing). Unlike LCM's step, TCD's neither
clips nor thresholds x0 (diffusers' step does not read those settings).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from meshserve.models.schedulers.common import (
    alpha_bar_prediction,
    at,
    f32,
    schedule_dataclass,
    step_noise,
)
from meshserve.models.schedulers.lcm import LCMScheduler


@schedule_dataclass
class TCDSchedule:
    """timesteps: [N] float32 (integer training timesteps); alpha_prod_t, alpha_prod_t_prev, alpha_prod_s: [N]
    float32 alpha_bar at step i's timestep, at the next one (0 after the last) and at the intermediate
    s = floor((1 - eta) t_prev); init_noise_sigma: [] float32 (1); steps: None, or [] int32 when padded."""

    timesteps: object
    alpha_prod_t: object
    alpha_prod_t_prev: object
    alpha_prod_s: object
    init_noise_sigma: object
    steps: object = None


@dataclass(frozen=True)
class TCDScheduler(LCMScheduler):
    """Settings: diffusers' TCDScheduler config (the same fields and defaults as LCMScheduler's), plus eta
    (gamma), diffusers' step argument: the default of the schedule's, which a call may set (`schedule(n,
    eta=)`), 0 as diffusers' pipelines pass it unless told."""

    eta: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        if not 0 <= self.eta <= 1:
            raise ValueError(f"TCD eta (gamma) must be in [0, 1], got {self.eta}")

    def scheduler_arguments(self) -> dict:
        return {**super().scheduler_arguments(), "eta": True}

    def generator_draws(self, schedule, start, stop, total, eta):
        # diffusers draws as LCM does, and only when eta (gamma) > 0
        return super().generator_draws(schedule, start, stop, total, eta) if eta > 0 else []

    def schedule(self, num_inference_steps: int, *, timesteps=None, eta: float | None = None) -> TCDSchedule:
        eta = self.eta if eta is None else float(eta)
        if not 0 <= eta <= 1:
            raise ValueError(f"TCD eta (gamma) must be in [0, 1], got {eta}")
        timesteps = self.distilled_timesteps(num_inference_steps, timesteps)
        alphas_cumprod = self.alphas_cumprod()
        prev = np.concatenate([timesteps[1:], [0]])  # diffusers: timestep 0 after the last step
        # torch's float32 arithmetic: (1 - eta) as float32 times the integer timestep, floored.
        s = np.floor(np.float32(1 - eta) * prev.astype(np.float32)).astype(np.int64)
        return TCDSchedule(
            timesteps=f32(timesteps),
            alpha_prod_t=f32(alphas_cumprod[timesteps]),
            alpha_prod_t_prev=f32(alphas_cumprod[prev]),
            alpha_prod_s=f32(alphas_cumprod[s]),
            init_noise_sigma=f32(1.0),
        )

    def step(self, schedule: TCDSchedule, state, model_output, sample, i, key=None, *, noise=None):
        """One TCD step; returns (prev_sample in sample's dtype, state). The fresh noise (weighted 0 at eta 0
        and at the last step) is `noise` when given (standard normal, sample's shape), else drawn from `key`."""
        alpha_prod_t = at(schedule.alpha_prod_t, i)
        alpha_prod_t_prev = at(schedule.alpha_prod_t_prev, i)
        alpha_prod_s = at(schedule.alpha_prod_s, i)
        x = sample.astype(jnp.float32)
        pred_original, pred_epsilon = alpha_bar_prediction(
            self.prediction_type, alpha_prod_t, x, model_output.astype(jnp.float32)
        )
        pred_noised = alpha_prod_s**0.5 * pred_original + (1 - alpha_prod_s) ** 0.5 * pred_epsilon
        ratio = alpha_prod_t_prev / alpha_prod_s  # 1 at eta 0 (s = t_prev): no noise, as diffusers' eta = 0
        renoised = ratio**0.5 * pred_noised + jnp.maximum(1 - ratio, 0.0) ** 0.5 * step_noise(key, noise, x)
        prev_sample = jnp.where(i == schedule.num_steps - 1, pred_noised, renoised)
        return prev_sample.astype(sample.dtype), state
