"""Flow-matching Euler = diffusers' FlowMatchEulerDiscreteScheduler (Flux.1, SD3, and Wan's flow models).

The sample moves along a straight path x_sigma = (1 - sigma) * x0 + sigma * noise, sigma from 1 to 0; the
model predicts the velocity v = noise - x0 and a step is x + (sigma_next - sigma) * v. No input scaling, initial
noise of scale 1. The schedule's sigmas are shifted towards 1 (more steps at high noise), statically by
`shift` or, with `use_dynamic_shifting`, by a per-request `mu` that depends on the image size (`flux_mu`).

    sched = make_scheduler("flow_match_euler", scheduler_config)
    schedule = sched.schedule(28, mu=flux_mu(image_seq_len, scheduler_config))   # Flux: mu per request

The formulas and their float precision mirror diffusers 0.42's `set_timesteps` and `step` line by line.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import jax.numpy as jnp
import numpy as np

from meshserve.models.schedulers.common import (
    RespacedSigmasInRange,
    SigmaSchedule,
    at,
    check_choice,
    f32,
    step_noise,
    stretch_to_terminal,
)


def flux_mu(image_seq_len: int, config: Mapping[str, Any]) -> float:
    """diffusers' Flux `calculate_shift`: mu linear in the packed latent sequence length, from base_shift at
    base_image_seq_len to max_shift at max_image_seq_len (0.5 at 256 tokens, 1.15 at 4096 = 1024x1024).

    config: the scheduler config dict, read with the pipeline's defaults for absent keys.
    """
    base_seq_len = config.get("base_image_seq_len", 256)
    max_seq_len = config.get("max_image_seq_len", 4096)
    base_shift = config.get("base_shift", 0.5)
    max_shift = config.get("max_shift", 1.15)
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    b = base_shift - m * base_seq_len
    return image_seq_len * m + b


@dataclass(frozen=True)
class FlowMatchEulerDiscreteScheduler(RespacedSigmasInRange):
    """Settings: diffusers' FlowMatchEulerDiscreteScheduler config (defaults equal). The beta fields inherited
    from NoiseScheduler are unused (a flow model has no beta schedule)."""

    shift: float = 1.0
    use_dynamic_shifting: bool = False
    base_shift: float | None = 0.5
    max_shift: float | None = 1.15
    base_image_seq_len: int = 256
    max_image_seq_len: int = 4096
    time_shift_type: str = "exponential"
    # After the shift: stretched to end at shift_terminal (LTX-Video's), then respaced (the inherited settings)
    # between the shifted sigmas' ends or the config's sigma_min / sigma_max, as diffusers' set_timesteps.
    shift_terminal: float | None = None
    # Each step goes to the x0 the velocity implies and noises it afresh to the next sigma (`step`).
    stochastic_sampling: bool = False

    # Mochi's inverted sigmas (its model's time runs the other way): no Flux or Wan model is trained so.
    UNSUPPORTED: ClassVar[Mapping[str, Any]] = {"invert_sigmas": False}

    @property
    def stochastic(self) -> bool:
        return self.stochastic_sampling

    def __post_init__(self):
        super().__post_init__()
        check_choice("time_shift_type", self.time_shift_type, ("exponential", "linear"))
        self.check_one_spacing()

    def _training_sigma_range(self) -> tuple[float, float]:
        """diffusers' __init__: (sigma_max, sigma_min) of the float32 training sigmas t / 1000, t = 1000..1,
        statically shifted unless use_dynamic_shifting (then set_timesteps shifts them a second time)."""
        n = self.num_train_timesteps
        sigmas = np.linspace(1, n, n, dtype=np.float32)[::-1] / np.float32(n)
        if not self.use_dynamic_shifting:
            sigmas = f32(self.shift * sigmas / (1 + (self.shift - 1) * sigmas))
        return float(sigmas[0]), float(sigmas[-1])

    def _time_shift(self, mu: float, t: np.ndarray) -> np.ndarray:
        if self.time_shift_type == "exponential":
            return math.exp(mu) / (math.exp(mu) + (1 / t - 1))
        return mu / (mu + (1 / t - 1))

    def scheduler_arguments(self) -> dict:
        # diffusers' set_timesteps takes timesteps too, but no flow pipeline passes them.
        return self.argument_rules(sigmas=True, timesteps=False, sigmas_end=False, max_sigma=1.0)

    def schedule(
        self, num_inference_steps: int, mu: float | None = None, *, pipeline_sigmas: bool = True, sigmas=None
    ) -> SigmaSchedule:
        """The schedule of N steps: timesteps [N] = sigmas * 1000, sigmas [N + 1] ending in 0.

        mu: the dynamic shift (required with use_dynamic_shifting; `flux_mu` of the request's size).
        pipeline_sigmas: True: the sigmas diffusers' Flux pipeline passes, linspace(1, 1/N, N), then shifted;
            False: the scheduler's own, linspace over its (shifted) training sigma range, then shifted again, as
            diffusers does for pipelines that pass none (SD3, or a config with `use_flow_sigmas`).
        sigmas: the caller's own N sigmas in place of either (diffusers' `sigmas` argument), shifted as they are.
        """
        n = int(num_inference_steps)
        self.check_steps(n)
        if self.use_dynamic_shifting and mu is None:
            raise ValueError("mu must be given when use_dynamic_shifting is set (flux_mu of the image size)")
        if sigmas is not None:
            sigmas = f32(sigmas)
            if len(sigmas) != n:
                raise ValueError(f"{n} steps take {n} sigmas, got {len(sigmas)}")
        elif pipeline_sigmas:
            # The pipeline's float64 linspace, cast to float32 by set_timesteps; the shift below then runs in
            # float32 (numpy keeps float32 arrays float32 against Python floats), as in diffusers.
            sigmas = f32(np.linspace(1.0, 1 / n, n))
        else:
            sigma_max, sigma_min = self._training_sigma_range()
            t = self.num_train_timesteps
            sigmas = np.linspace(sigma_max * t, sigma_min * t, n) / t  # float64, as diffusers
        if self.use_dynamic_shifting:
            sigmas = self._time_shift(mu, sigmas)
        else:
            sigmas = self.shift * sigmas / (1 + (self.shift - 1) * sigmas)
        if self.shift_terminal:
            if sigmas[-1] == 1:  # one step at sigma 1: diffusers' stretch divides 0 by 0 (NaN)
                raise ValueError(
                    "shift_terminal stretches the schedule to its last sigma: it needs 2 steps or more"
                )
            sigmas = stretch_to_terminal(sigmas, self.shift_terminal)
        if self.respaced:
            sigmas = self.respaced_between(sigmas[-1], sigmas[0], n)
        sigmas = f32(sigmas)
        timesteps = sigmas * np.float32(self.num_train_timesteps)  # torch float32 product
        return SigmaSchedule(
            timesteps=f32(timesteps),
            sigmas=f32(np.concatenate([sigmas, [0.0]])),
            init_noise_sigma=f32(1.0),
        )

    def step(self, schedule: SigmaSchedule, state, model_output, sample, i, key=None, *, noise=None):
        """x + (sigma_next - sigma) * v from sigmas[i] to sigmas[i + 1]; returns (prev_sample, state). With
        stochastic_sampling: x0 = x - sigma * v, then (1 - sigma_next) * x0 + sigma_next * fresh noise (`noise`
        when given, else drawn from `key`, as `step_noise`), the product sigma * v rounded as dt * v below.

        As diffusers: the sample is upcast to fp32 and the result cast back to the model output's dtype. The
        product dt * v is taken in the model output's dtype: torch multiplies the 0-d fp32 dt with a bf16 v
        into a bf16 tensor, dt first rounded to bf16 (measured on 10^4 random bf16 values: this form matches
        diffusers bit for bit; rounding only the fp32 product differs in 199, all-fp32 in 466). For an fp32
        model this is plain fp32 arithmetic.
        """
        sigma, sigma_next = at(schedule.sigmas, i), at(schedule.sigmas, i + 1)
        x = sample.astype(jnp.float32)
        if self.stochastic_sampling:
            x0 = x - (sigma.astype(model_output.dtype) * model_output).astype(jnp.float32)
            prev_sample = (1 - sigma_next) * x0 + sigma_next * step_noise(key, noise, x)
        else:
            update = (sigma_next - sigma).astype(model_output.dtype) * model_output
            prev_sample = x + update.astype(jnp.float32)
        return prev_sample.astype(model_output.dtype), state
