"""DPM-Solver++ singlestep (Lu et al. 2022, https://huggingface.co/papers/2211.01095: "DPM-Solver++(2S)") =
diffusers' DPMSolverSinglestepScheduler with algorithm_type "dpmsolver++" or "sde-dpmsolver++".

Where the multistep solver (dpm_solver.py) extrapolates from the last x0 predictions at every step, the
singlestep one cuts the schedule into groups of up to `solver_order` steps (diffusers' get_order_list:
1, 2, 3, 1, 2, 3, ... at order 3): a group's first step is a first-order update that also stores its sample,
and its k-th step goes from that stored sample, at the group's first sigma, to the next sigma with the k x0
predictions made inside the group. Which order a step takes depends on the step count, so it is a per-step table
of the schedule (`orders`, as PNDM's tables), lowered where the loop has fewer predictions (an image-to-image
start); the state carries the history, the count of steps taken and the stored sample.

One deliberate deviation: diffusers' set_timesteps turns `lower_order_final` on in the scheduler's config for
good when a call's step count is not a multiple of the order, or the final sigma is 0 (its warnings), so the
orders of a later call with the same scheduler object depend on the calls before it; here they depend on the
call alone (what a fresh diffusers scheduler would use).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from meshserve.models.schedulers.common import at, f32, schedule_dataclass, step_noise
from meshserve.models.schedulers.dpm_solver import DPMSolverMultistepScheduler


@schedule_dataclass
class SinglestepSchedule:
    """timesteps [N], sigmas [N + 1] as SigmaSchedule's; orders [N] float32: the order step i takes (1-3, one
    more than its place in its group); init_noise_sigma [] (1); steps: None, or [] int32 when padded."""

    timesteps: Any
    sigmas: Any
    orders: Any
    init_noise_sigma: Any
    steps: Any = None


@dataclass(frozen=True)
class DPMSolverSinglestepScheduler(DPMSolverMultistepScheduler):
    """Settings: diffusers' DPMSolverSinglestepScheduler config (defaults equal: note lower_order_final=False).
    Supported: solver_order 1-3, algorithm_type dpmsolver++ / sde-dpmsolver++, solver_type midpoint / heun,
    lower_order_final, karras / exponential / beta sigmas, final_sigmas_type, lambda_min_clipped, thresholding,
    custom timesteps, flow sigmas (dpm_solver.py). Its timesteps are always linspace-spaced (diffusers' class has no timestep_spacing)."""

    lower_order_final: bool = False

    # Settings of DPM-Solver multistep (and of this port's base) that diffusers' singlestep class has not: a
    # folder's config carrying them (a multistep or Euler folder's) is read without them, as diffusers does.
    IGNORED = (
        "timestep_spacing",
        "steps_offset",
        "rescale_betas_zero_snr",
        "euler_at_final",
        "use_lu_lambdas",
    )

    def _rounds_karras(self) -> bool:
        return True  # diffusers' singlestep set_timesteps rounds Karras timesteps on every beta schedule

    def schedule(self, num_inference_steps: int, *, timesteps=None) -> SinglestepSchedule:
        sigma_schedule = super().schedule(num_inference_steps, timesteps=timesteps)
        orders = self.order_list(int(sigma_schedule.timesteps.shape[0]))
        return SinglestepSchedule(
            timesteps=sigma_schedule.timesteps,
            sigmas=sigma_schedule.sigmas,
            orders=f32(orders),
            init_noise_sigma=sigma_schedule.init_noise_sigma,
        )

    def order_list(self, steps: int) -> list[int]:
        """The order of each of `steps` steps: diffusers' get_order_list after set_timesteps' switch of
        lower_order_final (on for a step count that is not a multiple of the order, or a final sigma of 0)."""
        order = self.solver_order
        lower_order_final = self.lower_order_final or steps % order != 0 or self.final_sigmas_type == "zero"
        groups, rest = divmod(steps, order)
        if not lower_order_final:
            orders = list(range(1, order + 1)) * groups
        elif order == 3 and rest == 0:
            orders = [1, 2, 3] * (groups - 1) + [1, 2, 1]
        elif order == 2 and rest == 0:
            orders = [1, 2] * (groups - 1) + [1, 1]
        else:  # a last, shorter group
            orders = list(range(1, order + 1)) * groups + list(range(1, rest + 1))
        if self.final_sigmas_type == "zero":
            orders[-1] = 1
        return orders

    # ---------------------------------------------------------------------------------------------
    # Traced: the step

    def init_state(self, sample):
        """The multistep state (the last solver_order x0 predictions, the steps taken, capped at the order)
        and the sample its group started from (`sample`, float32 like sample)."""
        return {**super().init_state(sample), "sample": jnp.zeros(sample.shape, jnp.float32)}

    def step(self, schedule: SinglestepSchedule, state, model_output, sample, i, key=None, *, noise=None):
        """One step from sigmas[i] to sigmas[i + 1] at the order orders[i] (lowered to the predictions the loop
        has made); returns (prev_sample in sample's dtype, state). sde-dpmsolver++ draws `noise` or from `key`."""
        sigmas = jnp.asarray(schedule.sigmas)
        x = sample.astype(jnp.float32)
        converted = self._convert_model_output(sigmas[i], model_output, x)
        history = jnp.concatenate([state["model_outputs"][1:], converted[None]])
        taken = state["lower_order_nums"]
        # diffusers lowers the order while model_outputs[-order] is None: the loop has made taken + 1.
        order = jnp.minimum(at(schedule.orders, i).astype(jnp.int32), taken + 1)
        stored = jnp.where(order == 1, x, state["sample"])

        noise = step_noise(key, noise, x) if self.stochastic else jnp.zeros_like(x)
        updates = (self._first_order, self._group_second_order, self._group_third_order)[: self.solver_order]
        branch = jnp.clip(order, 1, self.solver_order) - 1
        prev_sample = jax.lax.switch(branch, updates, sigmas, i, history, stored, noise)
        state = {
            "model_outputs": history,
            "lower_order_nums": jnp.minimum(taken + 1, self.solver_order),
            "sample": stored,
        }
        return prev_sample.astype(sample.dtype), state

    def _group_second_order(self, sigmas, i, history, sample, noise):
        """diffusers' singlestep_dpm_solver_second_order_update: from `sample` at sigmas[i - 1] (s1, the
        group's start) to sigmas[i + 1], with the predictions at s1 and s0 = sigmas[i]."""
        (alpha_t, sigma_t, lambda_t), (_, _, lambda_s0), (_, sigma_s1, lambda_s1) = self._lambdas(
            sigmas, i, 2
        )
        m0, m1 = history[-1], history[-2]
        h, h_0 = lambda_t - lambda_s1, lambda_s0 - lambda_s1
        r0 = h_0 / h
        return self._second_order_update(
            alpha_t, sigma_t, sigma_s1, h, sample, m1, (1.0 / r0) * (m0 - m1), noise
        )

    def _group_third_order(self, sigmas, i, history, sample, noise):
        """diffusers' singlestep_dpm_solver_third_order_update: from `sample` at sigmas[i - 2] (s2) to
        sigmas[i + 1], with the predictions at s2, s1 = sigmas[i - 1] and s0 = sigmas[i]. "heun" takes the
        multistep solver's third-order terms; "midpoint" a second-order one through the latest prediction."""
        lams = self._lambdas(sigmas, i, 3)
        alpha_t, sigma_t, lambda_t = lams[0]
        lambda_s0, lambda_s1 = lams[1][2], lams[2][2]
        _, sigma_s2, lambda_s2 = lams[3]
        m0, m1, m2 = history[-1], history[-2], history[-3]
        h, h_0, h_1 = lambda_t - lambda_s2, lambda_s0 - lambda_s2, lambda_s1 - lambda_s2
        r0, r1 = h_0 / h, h_1 / h
        d1_0, d1_1 = (1.0 / r1) * (m1 - m2), (1.0 / r0) * (m0 - m2)
        if self.solver_type == "heun":
            d1 = (r0 * d1_0 - r1 * d1_1) / (r0 - r1)
            d2 = 2.0 * (d1_1 - d1_0) / (r0 - r1)
            return self._third_order_update(alpha_t, sigma_t, sigma_s2, h, sample, m2, d1, d2, noise)
        if self.algorithm_type == "dpmsolver++":
            return (
                (sigma_t / sigma_s2) * sample
                - (alpha_t * (jnp.exp(-h) - 1.0)) * m2
                + (alpha_t * ((jnp.exp(-h) - 1.0) / h + 1.0)) * d1_1
            )
        return (
            (sigma_t / sigma_s2 * jnp.exp(-h)) * sample
            + (alpha_t * (1.0 - jnp.exp(-2.0 * h))) * m2
            + (alpha_t * ((1.0 - jnp.exp(-2.0 * h)) / (-2.0 * h) + 1.0)) * d1_1
            + sigma_t * jnp.sqrt(1.0 - jnp.exp(-2 * h)) * noise
        )
