"""PNDM (Liu et al. 2022, https://huggingface.co/papers/2202.09778) = diffusers' PNDMScheduler: pseudo numerical
methods on the DDIM transfer. Stable Diffusion 1.x's configs set skip_prk_steps: the first step is taken twice
(the second time from the same sample with the mean of both noise predictions) and every later one extrapolates
the noise from up to four past predictions (PLMS, linear multistep); without it, the first three steps are pseudo
Runge-Kutta, four model calls each.

diffusers' step keeps a call counter, a list of past predictions, a running Runge-Kutta sum and a stored sample,
and what it does at a call depends only on the counter. A loop here always starts at call 0 (PNDM does not start
from an image), so the counter is the call's index and the schedule carries, per call, the weights of one update:

    ets      = the last four predictions, the call's own appended where diffusers appends it
    eps      = w_out * model_output + w_ets . ets + w_acc * acc
    prev     = the transfer from `stored` or `sample` to the call's previous timestep, along eps

so one compiled loop runs every step count.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from meshserve.models.schedulers.common import (
    NoiseScheduler,
    at,
    f32,
    pytree_dataclass,
    schedule_length,
    spaced_timesteps,
)

# The Runge-Kutta start: 3 steps of 4 calls, over pndm_order = 4 timesteps.
PRK_CALLS = 12
# PLMS's weights of the last 1-4 predictions, oldest first (Adams-Bashforth).
PLMS_WEIGHTS = {2: (-1 / 2, 3 / 2), 3: (5 / 12, -16 / 12, 23 / 12), 4: (-9 / 24, 37 / 24, -59 / 24, 55 / 24)}


@pytree_dataclass
class PNDMSchedule:
    """Per model call (all [L], L the calls: N + 1 with skip_prk_steps, N + 9 without; w_ets [L, 4]):
    timesteps: float32, what the UNet receives;
    alpha_prod_t, alpha_prod_t_prev: float32 alpha_bar of the transfer's start and end;
    append, store, use_stored: float32 flags (1 or 0; floats as every other traced input of a schedule),
        whether the call appends its prediction to ets, stores its sample, and transfers from the stored sample
        instead of its own;
    w_out, w_ets, w_acc: float32 weights of eps (above); acc_keep, acc_add: acc' = acc_keep * acc +
        acc_add * model_output (the Runge-Kutta sum);
    init_noise_sigma: [] float32 (1); steps: None, or [] int32 when padded (`pad_schedule`)."""

    timesteps: object
    alpha_prod_t: object
    alpha_prod_t_prev: object
    append: object
    store: object
    use_stored: object
    w_out: object
    w_ets: object
    w_acc: object
    acc_keep: object
    acc_add: object
    init_noise_sigma: object
    steps: object = None

    @property
    def num_steps(self):
        return schedule_length(self)


@dataclass(frozen=True)
class PNDMScheduler(NoiseScheduler):
    """Settings: diffusers' PNDMScheduler config (defaults equal: note skip_prk_steps=False, "leading" spacing,
    set_alpha_to_one=False); prediction_type "sample" is refused, as diffusers' step refuses it."""

    timestep_spacing: str = "leading"
    skip_prk_steps: bool = False
    set_alpha_to_one: bool = False

    IGNORED = ("rescale_betas_zero_snr",)

    def __post_init__(self):
        super().__post_init__()
        if self.prediction_type == "sample":
            raise ValueError("PNDMScheduler: prediction_type='sample' is not supported")

    def check_steps(self, num_inference_steps: int) -> None:
        super().check_steps(num_inference_steps)
        if not self.skip_prk_steps and num_inference_steps < 4:
            raise ValueError(
                "PNDMScheduler without skip_prk_steps takes at least 4 steps (its Runge-Kutta start runs 3), "
                f"got {num_inference_steps}"
            )

    def scheduler_arguments(self) -> dict:
        if self.skip_prk_steps:
            return {}
        return {**self.argument_rules(sigmas=False, timesteps=False, sigmas_end=False), "min_steps": 4}

    def model_calls(self, num_inference_steps: int) -> int:
        n = int(num_inference_steps)
        if not self.skip_prk_steps:
            return n + PRK_CALLS - 3
        return n + 1 if n > 1 else 1

    def max_steps_within(self, calls: int) -> int:
        return calls - (PRK_CALLS - 3 if not self.skip_prk_steps else 1)

    def _call_timesteps(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(prk, plms) int64 timesteps of diffusers' set_timesteps: the Runge-Kutta calls (none with
        skip_prk_steps) and the linear multistep ones."""
        ratio = self.num_train_timesteps // n
        ascending = spaced_timesteps(
            self.timestep_spacing, self.num_train_timesteps, n, self.steps_offset, round_linspace=True
        )[::-1].astype(np.int64)
        if self.skip_prk_steps:
            # The second-to-last training-order timestep twice: the first step is taken again (its correction).
            plms = np.concatenate([ascending[:-1], ascending[-2:-1], ascending[-1:]])[::-1]
            return np.zeros(0, np.int64), plms
        prk = np.repeat(ascending[-4:], 2) + np.tile(np.array([0, ratio // 2]), 4)
        return prk[:-1].repeat(2)[1:-1][::-1], ascending[:-3][::-1]

    def schedule(self, num_inference_steps: int) -> PNDMSchedule:
        n = int(num_inference_steps)
        self.check_steps(n)
        ratio = self.num_train_timesteps // n
        prk, plms = self._call_timesteps(n)
        timesteps = np.concatenate([prk, plms])
        alphas_cumprod = self.alphas_cumprod()
        final_alpha_cumprod = np.float32(1.0) if self.set_alpha_to_one else alphas_cumprod[0]

        def alpha(t):
            return alphas_cumprod[t] if t >= 0 else final_alpha_cumprod

        rows = []
        num_ets = 0
        for counter, t in enumerate(int(t) for t in timesteps):
            row = dict(append=False, store=False, use_stored=False, w_out=0.0, w_ets=[0.0] * 4, w_acc=0.0)
            row.update(acc_keep=1.0, acc_add=0.0)
            if counter < len(prk):  # diffusers' step_prk
                phase = counter % 4
                prev_t = t - (0 if counter % 2 else ratio // 2)
                t = int(prk[counter // 4 * 4])
                row.update(use_stored=True, w_out=1.0)
                if phase == 0:
                    row.update(append=True, store=True, acc_add=1 / 6)
                    num_ets += 1
                elif phase in (1, 2):
                    row.update(acc_add=1 / 3)
                else:  # the Runge-Kutta combination of the four calls
                    row.update(w_out=1 / 6, w_acc=1.0, acc_keep=0.0)
            else:  # diffusers' step_plms
                prev_t = t - ratio
                if counter != 1:
                    row["append"] = True
                    num_ets = min(num_ets + 1, 4)
                else:  # the first step again: same target, from the stored sample
                    prev_t, t = t, t + ratio
                if num_ets == 1 and counter == 0:
                    row.update(store=True, w_out=1.0)
                elif num_ets == 1 and counter == 1:
                    row.update(use_stored=True, w_out=0.5, w_ets=[0.0, 0.0, 0.0, 0.5])
                else:
                    weights = PLMS_WEIGHTS[num_ets]
                    row["w_ets"] = [0.0] * (4 - len(weights)) + list(weights)
            row.update(alpha_prod_t=alpha(t), alpha_prod_t_prev=alpha(prev_t))
            rows.append(row)

        def column(name):
            return np.asarray([r[name] for r in rows], np.float32)

        return PNDMSchedule(
            timesteps=f32(timesteps),
            alpha_prod_t=column("alpha_prod_t"),
            alpha_prod_t_prev=column("alpha_prod_t_prev"),
            append=column("append"),
            store=column("store"),
            use_stored=column("use_stored"),
            w_out=column("w_out"),
            w_ets=column("w_ets"),
            w_acc=column("w_acc"),
            acc_keep=column("acc_keep"),
            acc_add=column("acc_add"),
            init_noise_sigma=f32(1.0),
        )

    def init_state(self, sample):
        """ets: the last four appended predictions, oldest first, float32 [4, *sample.shape]; acc: the
        Runge-Kutta sum; stored: the sample a step's later calls start from (diffusers' cur_sample)."""
        zeros = jnp.zeros(sample.shape, jnp.float32)
        return {"ets": jnp.zeros((4, *sample.shape), jnp.float32), "acc": zeros, "stored": zeros}

    def step(self, schedule: PNDMSchedule, state, model_output, sample, i, key=None, *, noise=None):
        """Model call i; returns (prev_sample in sample's dtype, state)."""
        out = model_output.astype(jnp.float32)
        x = sample.astype(jnp.float32)
        ets = jnp.where(
            at(schedule.append, i) != 0, jnp.concatenate([state["ets"][1:], out[None]]), state["ets"]
        )
        eps = (
            at(schedule.w_out, i) * out
            + jnp.tensordot(at(schedule.w_ets, i), ets, axes=1)
            + at(schedule.w_acc, i) * state["acc"]
        )
        stored = jnp.where(at(schedule.store, i) != 0, x, state["stored"])
        base = jnp.where(at(schedule.use_stored, i) != 0, stored, x)
        prev_sample = self._transfer(
            base, at(schedule.alpha_prod_t, i), at(schedule.alpha_prod_t_prev, i), eps
        )
        state = {
            "ets": ets,
            "acc": at(schedule.acc_keep, i) * state["acc"] + at(schedule.acc_add, i) * out,
            "stored": stored,
        }
        return prev_sample.astype(sample.dtype), state

    def _transfer(self, sample, alpha_prod_t, alpha_prod_t_prev, model_output):
        """diffusers' _get_prev_sample: formula (9) of the paper, the DDIM step written in alpha_bar."""
        beta_prod_t, beta_prod_t_prev = 1 - alpha_prod_t, 1 - alpha_prod_t_prev
        if self.prediction_type == "v_prediction":
            model_output = alpha_prod_t**0.5 * model_output + beta_prod_t**0.5 * sample
        sample_coeff = (alpha_prod_t_prev / alpha_prod_t) ** 0.5
        denominator = (
            alpha_prod_t * beta_prod_t_prev**0.5 + (alpha_prod_t * beta_prod_t * alpha_prod_t_prev) ** 0.5
        )
        return sample_coeff * sample - (alpha_prod_t_prev - alpha_prod_t) * model_output / denominator
