"""PNDM (Liu et al. 2022, https://huggingface.co/papers/2202.09778) = diffusers' PNDMScheduler: pseudo numerical
methods on the DDIM transfer. Stable Diffusion 1.x's configs set skip_prk_steps: the first step is taken twice
(the second time from the same sample with the mean of both noise predictions) and every later one extrapolates
the noise from up to four past predictions (PLMS, linear multistep); without it, the first three steps are pseudo
Runge-Kutta, four model calls each.

diffusers' step keeps a call counter, a list of past predictions, a running Runge-Kutta sum and a stored sample;
what it does at a call depends on the counter (calls since the loop began: 0 at an image-to-image start too) and
the call's timestep. So the state carries the counter, and the schedule carries tables of both kinds: per
counter, the weights of one update; per call, alpha_bar around the call's timestep:

    ets      = the last four predictions, the call's own appended where diffusers appends it
    eps      = w_out * model_output + w_ets . ets + w_acc * acc
    prev     = the transfer from `stored` or `sample` between the alpha_bar the counter picks, along eps

so one compiled loop runs every step count and every start.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from meshserve.models.schedulers.common import (
    NoiseScheduler,
    at,
    f32,
    schedule_dataclass,
    spaced_timesteps,
)

# The Runge-Kutta start: 3 steps of 4 calls, over pndm_order = 4 timesteps.
PRK_CALLS = 12
# PLMS's weights of the last 1-4 predictions, oldest first (Adams-Bashforth).
PLMS_WEIGHTS = {2: (-1 / 2, 3 / 2), 3: (5 / 12, -16 / 12, 23 / 12), 4: (-9 / 24, 37 / 24, -59 / 24, 55 / 24)}


# Which alpha_bar a transfer starts from (a counter's `start_from`): the call's timestep t, t + the step (the
# first step's second call), the Runge-Kutta step's first timestep; and where it goes (`prev_from`): t - the
# step, t (the first step's second call, the Runge-Kutta step's odd calls), t - half the step (its even ones).
FROM_T, FROM_T_PLUS, FROM_PRK_START = 0, 1, 2
TO_T_MINUS, TO_T, TO_T_HALF = 0, 1, 2


@schedule_dataclass
class PNDMSchedule:
    """All [L] float32, L the model calls (N + 1 with skip_prk_steps, N + 9 without); w_ets [L, 4].

    Per call i (its timestep t):
    timesteps: what the UNet receives;
    alpha_prod_t, alpha_prod_t_plus, alpha_prod_t_minus, alpha_prod_t_half: alpha_bar at t, t + step, t - step and
        t - step // 2 (step: num_train_timesteps // N, diffusers' difference whatever the spacing; 1 or
        alpha_bar[0] below 0, as set_alpha_to_one says).
    Per counter c:
    start_from, prev_from: which alpha_bar the transfer starts from (FROM_T, FROM_T_PLUS, FROM_PRK_START) and goes to
        (TO_T_MINUS, TO_T, TO_T_HALF); prk_alpha_prod: alpha_bar at the Runge-Kutta step's first timestep;
    append, store, use_stored: flags (1 or 0, floats as every traced input of a schedule): the call appends its
        prediction to ets, stores its sample, transfers from the stored sample instead of its own;
    w_out, w_ets, w_acc: the weights of eps (above); acc_keep, acc_add: acc' = acc_keep * acc + acc_add * output.
    init_noise_sigma: [] float32 (1); steps: None, or [] int32 when padded (`pad_schedule`)."""

    timesteps: object
    alpha_prod_t: object
    alpha_prod_t_plus: object
    alpha_prod_t_minus: object
    alpha_prod_t_half: object
    start_from: object
    prev_from: object
    prk_alpha_prod: object
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
            t = np.asarray(t)
            return np.where(
                t >= 0, alphas_cumprod[np.clip(t, 0, self.num_train_timesteps - 1)], final_alpha_cumprod
            ).astype(np.float32)

        rows = self._counter_rows(len(timesteps), len(prk))
        for c, row in enumerate(rows):
            row["prk_alpha_prod"] = alpha(prk[c // 4 * 4]) if c < len(prk) else 0.0

        def column(name):
            return np.asarray([r[name] for r in rows], np.float32)

        return PNDMSchedule(
            timesteps=f32(timesteps),
            alpha_prod_t=alpha(timesteps),
            alpha_prod_t_plus=alpha(timesteps + ratio),
            alpha_prod_t_minus=alpha(timesteps - ratio),
            alpha_prod_t_half=alpha(timesteps - ratio // 2),
            **{name: column(name) for name in rows[0]},
            init_noise_sigma=f32(1.0),
        )

    @staticmethod
    def _counter_rows(calls: int, prk_calls: int) -> list[dict]:
        """What diffusers' step does at each call of a loop, by its counter: the update's weights and which
        alpha_bar it transfers between."""
        rows, num_ets = [], 0  # num_ets: the predictions diffusers' ets list holds (at most 4 are used)
        for counter in range(calls):
            row = dict(append=0.0, store=0.0, use_stored=0.0, w_out=0.0, w_ets=[0.0] * 4, w_acc=0.0)
            row.update(acc_keep=1.0, acc_add=0.0, start_from=FROM_T, prev_from=TO_T_MINUS)
            rows.append(row)
            if counter < prk_calls:  # diffusers' step_prk: from the stored sample, to t or t - step // 2
                row.update(start_from=FROM_PRK_START, prev_from=TO_T if counter % 2 else TO_T_HALF)
                row.update(use_stored=1.0, w_out=1.0)
                phase = counter % 4
                if phase == 0:
                    row.update(append=1.0, store=1.0, acc_add=1 / 6)
                    num_ets += 1
                elif phase in (1, 2):
                    row.update(acc_add=1 / 3)
                else:  # the Runge-Kutta combination of the four calls
                    row.update(w_out=1 / 6, w_acc=1.0, acc_keep=0.0)
                continue
            # diffusers' step_plms
            if counter != 1:
                row["append"] = 1.0
                num_ets = min(num_ets + 1, 4)
            else:  # the first step again: same target, from the stored sample
                row.update(start_from=FROM_T_PLUS, prev_from=TO_T)
            if num_ets == 1 and counter == 0:
                row.update(store=1.0, w_out=1.0)
            elif num_ets == 1 and counter == 1:
                row.update(use_stored=1.0, w_out=0.5, w_ets=[0.0, 0.0, 0.0, 0.5])
            else:
                weights = PLMS_WEIGHTS[num_ets]
                row["w_ets"] = [0.0] * (4 - len(weights)) + list(weights)
        return rows

    def init_state(self, sample):
        """counter: the calls this loop has made; ets: the last four appended predictions, oldest first, float32
        [4, *sample.shape]; acc: the Runge-Kutta sum; stored: the sample a step's later calls start from
        (diffusers' cur_sample)."""
        zeros = jnp.zeros(sample.shape, jnp.float32)
        return {
            "counter": jnp.zeros((), jnp.int32),
            "ets": jnp.zeros((4, *sample.shape), jnp.float32),
            "acc": zeros,
            "stored": zeros,
        }

    def step(self, schedule: PNDMSchedule, state, model_output, sample, i, key=None, *, noise=None):
        """Model call i, the loop's call state["counter"]; returns (prev_sample in sample's dtype, state)."""
        c = state["counter"]
        out = model_output.astype(jnp.float32)
        x = sample.astype(jnp.float32)
        appended = jnp.concatenate([state["ets"][1:], out[None]])
        ets = jnp.where(at(schedule.append, c) != 0, appended, state["ets"])
        eps = (
            at(schedule.w_out, c) * out
            + jnp.tensordot(at(schedule.w_ets, c), ets, axes=1)
            + at(schedule.w_acc, c) * state["acc"]
        )
        stored = jnp.where(at(schedule.store, c) != 0, x, state["stored"])
        base = jnp.where(at(schedule.use_stored, c) != 0, stored, x)
        start_from, prev_from = at(schedule.start_from, c), at(schedule.prev_from, c)
        alpha_t = at(schedule.alpha_prod_t, i)
        alpha_start = jnp.where(
            start_from == FROM_T,
            alpha_t,
            jnp.where(
                start_from == FROM_T_PLUS, at(schedule.alpha_prod_t_plus, i), at(schedule.prk_alpha_prod, c)
            ),
        )
        alpha_prev = jnp.where(
            prev_from == TO_T_MINUS,
            at(schedule.alpha_prod_t_minus, i),
            jnp.where(prev_from == TO_T, alpha_t, at(schedule.alpha_prod_t_half, i)),
        )
        prev_sample = self._transfer(base, alpha_start, alpha_prev, eps)
        state = {
            "counter": c + 1,
            "ets": ets,
            "acc": at(schedule.acc_keep, c) * state["acc"] + at(schedule.acc_add, c) * out,
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
