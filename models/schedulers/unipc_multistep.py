"""UniPC multistep (Zhao et al. 2023, https://huggingface.co/papers/2302.04867) = diffusers'
UniPCMultistepScheduler in its two forms:

- flow matching, as Wan 2.1 runs it: `use_flow_sigmas=True`, `prediction_type="flow_prediction"`, `flow_shift`
  3.0 (480p) / 5.0 (720p), solver_order 2, `solver_type="bh2"`, `lower_order_final`, predict_x0;
- the beta-schedule (variance-preserving) form SD-type UNets sample with (SDXL folders, A1111's "UniPC"):
  sigmas of the training schedule at multistep timesteps (as DPM-Solver's), epsilon / v / sample predictions,
  integrated over x0 predictions (predict_x0, thresholded where the config says) or, with predict_x0=False,
  over the noise they imply (then the schedule must end at sigma_min: at 0 diffusers' last step is NaN).

    sched = make_scheduler("unipc", wan_scheduler_config, flow_shift=3.0)
    schedule = sched.schedule(50)            # timesteps 999, 993, ... (int64 in diffusers; exact in float32)
    sched = make_scheduler("unipc", sdxl_scheduler_config)   # a beta-schedule config: the VP form

Each step converts the model output to a data prediction (flow: x0 = x - sigma * v; VP: diffusers'
convert_model_output with alpha_t = 1 / sqrt(sigma^2 + 1), sigma_t = sigma * alpha_t), then
- corrects the sample it was handed (UniC): the previous step's predictor is re-run with this step's x0 as one
  more point, unless this is the loop's first step or the previous step index is in `disable_corrector`;
- predicts the next sample (UniP) from the last `solver_order` x0 predictions in lambda = log(alpha / sigma),
  on the flow path alpha = 1 - sigma, sigma; on the VP path alpha_t, sigma_t above.
The order rises 1, 2, ... as predictions accumulate, and with lower_order_final the last steps use
min(solver_order, steps left). The state carried through the loop holds the x0 history, the corrected sample
of the previous step and the order it used, so the step index and the step count may be traced (a padded
schedule: one compiled loop for every step count); the orders are branches of `lax.switch`.

Precision follows diffusers 0.42: the schedule in float64 numpy, cast to float32 at the end; timesteps are
sigma * 1000 truncated to integers (999 where sigma is 1 - 1e-6); the updates are float32 with float sigmas.
Computed in float32 whatever the sample dtype (Wan keeps its latents fp32, where this equals diffusers); a bf16
model output enters the x0 conversion as diffusers' 0-d fp32 sigma times a bf16 tensor does: sigma rounded to
bf16, the product in bf16, then subtracted from the fp32 sample.

One deliberate deviation: with solver_type "bh1" and a final sigma of 0, B(h) = -h is -inf on the last step and
diffusers' first-order update multiplies it by its zero correction term, so its final sample is NaN; ours leaves
the zero term out (the first-order update is x0 there).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from meshserve.models.schedulers.common import (
    TIMESTEP_SPACINGS,
    RespacedSigmasInRange,
    SigmaSchedule,
    check_choice,
    f32,
    multistep_timesteps,
    respaced_sigmas,
    schedule_length,
    stretch_to_terminal,
    threshold_sample,
    vp_alpha_sigma,
    vp_data_prediction,
)
from meshserve.models.schedulers.euler import training_sigmas


@dataclass(frozen=True)
class UniPCMultistepScheduler(RespacedSigmasInRange):
    """Settings: diffusers' UniPCMultistepScheduler config (defaults equal). The "unipc" name implies the flow
    form (use_flow_sigmas, flow_prediction) on a flow-matching model's config and the VP form on a
    beta-schedule one (make_scheduler). The beta fields inherited from NoiseScheduler are unused with flow
    sigmas (diffusers ignores them there too)."""

    solver_order: int = 2
    predict_x0: bool = True
    solver_type: str = "bh2"
    lower_order_final: bool = True
    disable_corrector: tuple[int, ...] = ()
    use_flow_sigmas: bool = False
    flow_shift: float = 1.0
    final_sigmas_type: str = "zero"
    use_dynamic_shifting: bool = False
    time_shift_type: str = "exponential"
    shift_terminal: float | None = None

    thresholding: bool = False
    dynamic_thresholding_ratio: float = 0.995
    sample_max_value: float = 1.0

    # A solver_p (another scheduler as the predictor) and respaced flow sigmas are not implemented: no Wan or
    # SDXL folder seen sets them.
    UNSUPPORTED: ClassVar[Mapping[str, Any]] = {"solver_p": None}
    # As diffusers' __init__: a DPM-Solver or DEIS folder's solver names read as bh2.
    CONFIG_ALIASES = {"solver_type": {"midpoint": "bh2", "heun": "bh2", "logrho": "bh2"}}

    def __post_init__(self):
        if self.use_flow_sigmas != (self.prediction_type == "flow_prediction"):
            raise ValueError(
                "UniPCMultistepScheduler: flow sigmas go with prediction_type 'flow_prediction' and the "
                "beta-schedule sigmas with 'epsilon', 'v_prediction' or 'sample'; got use_flow_sigmas="
                f"{self.use_flow_sigmas!r}, prediction_type={self.prediction_type!r}"
            )
        if self.use_flow_sigmas:
            # Not NoiseScheduler's checks: "flow_prediction" is no prediction type of the beta-schedule family.
            check_choice("timestep_spacing", self.timestep_spacing, TIMESTEP_SPACINGS)
        else:
            super().__post_init__()
        self.check_one_spacing()
        if self.respaced and self.use_flow_sigmas:
            raise ValueError(
                "UniPCMultistepScheduler: use_karras_sigmas, use_exponential_sigmas or use_beta_sigmas with "
                "flow sigmas is not implemented"
            )
        check_choice("solver_order", self.solver_order, (1, 2, 3))
        if not self.predict_x0 and self.use_flow_sigmas:
            raise ValueError(
                "UniPCMultistepScheduler: predict_x0=False takes no flow prediction (as diffusers)"
            )
        if not self.predict_x0 and self.final_sigmas_type == "zero":
            # The noise-prediction form's last update is alpha_t / alpha_s0 x - sigma_t (e^h - 1) eps with
            # sigma_t = 0 and h = inf: 0 x inf, NaN (diffusers' too, every order).
            raise ValueError(
                "UniPCMultistepScheduler: predict_x0=False with final_sigmas_type 'zero' makes the last step NaN; "
                "set final_sigmas_type to 'sigma_min'"
            )
        if not self.lower_order_final and self.solver_order > 1 and self.final_sigmas_type == "zero":
            # The last step at order 2 or 3 works in lambda = log(alpha / sigma), infinite at a final sigma of
            # 0: all NaN (diffusers: NaN at order 2, a singular linalg.solve at 3).
            raise ValueError(
                "UniPCMultistepScheduler: lower_order_final=False with solver_order "
                f"{self.solver_order} and final_sigmas_type 'zero' makes the last step NaN; set "
                "lower_order_final to true or final_sigmas_type to 'sigma_min'"
            )
        check_choice("final_sigmas_type", self.final_sigmas_type, ("zero", "sigma_min"))
        check_choice("time_shift_type", self.time_shift_type, ("exponential", "linear"))
        check_choice("solver_type", self.solver_type, ("bh1", "bh2"))
        # A JSON list in the config; a tuple keeps the scheduler hashable (a static jit argument).
        object.__setattr__(self, "disable_corrector", tuple(int(s) for s in self.disable_corrector or ()))

    # ---------------------------------------------------------------------------------------------
    # Host: the schedule

    def schedule(self, num_inference_steps: int, mu: float | None = None) -> SigmaSchedule:
        """The schedule of N steps: timesteps [N] (integers, as float32), sigmas [N + 1] ending in 0 (or the
        last sigma with final_sigmas_type "sigma_min"). mu: the dynamic shift (only with use_dynamic_shifting).
        """
        n = int(num_inference_steps)
        self.check_steps(n)
        if not self.use_flow_sigmas:
            return self._beta_schedule(n)
        if self.use_dynamic_shifting and mu is None:
            raise ValueError("mu must be given when use_dynamic_shifting is set")
        num_train = self.num_train_timesteps
        sigmas = np.linspace(1, 1 / num_train, n + 1)[:-1]  # float64, as diffusers
        if self.use_dynamic_shifting:
            if self.time_shift_type == "exponential":
                sigmas = math.exp(mu) / (math.exp(mu) + (1 / sigmas - 1) ** 1.0)
            else:
                sigmas = mu / (mu + (1 / sigmas - 1) ** 1.0)
        else:
            sigmas = self.flow_shift * sigmas / (1 + (self.flow_shift - 1) * sigmas)
        if self.shift_terminal:
            sigmas = stretch_to_terminal(sigmas, self.shift_terminal)
        # sigma 1 would make lambda = log(0) at the first step; diffusers nudges it (and t becomes 999).
        eps = 1e-6
        if np.fabs(sigmas[0] - 1) < eps:
            sigmas[0] -= eps
        timesteps = (sigmas * num_train).astype(np.int64)  # truncated, as torch's int64 conversion
        sigma_last = sigmas[-1] if self.final_sigmas_type == "sigma_min" else 0.0
        return SigmaSchedule(
            timesteps=f32(timesteps),
            sigmas=f32(np.concatenate([sigmas, [sigma_last]])),
            init_noise_sigma=f32(1.0),
        )

    def _beta_schedule(self, n: int) -> SigmaSchedule:
        """The VP form's: the training sigmas at multistep timesteps (diffusers: the whole training range,
        no lambda_min_clipped), or respaced ones (DPM-Solver's, but Karras timesteps always rounded), then 0
        or the smallest sigma (respaced: the last one, as diffusers)."""
        train_sigmas = training_sigmas(self)
        num_train = self.num_train_timesteps
        if self.respaced:
            sigmas, timesteps = respaced_sigmas(self, train_sigmas, n, round_karras=True)
            smallest = sigmas[-1]
        else:
            timesteps = multistep_timesteps(self.timestep_spacing, num_train, num_train, n, self.steps_offset)
            sigmas = np.interp(timesteps, np.arange(len(train_sigmas)), train_sigmas)
            smallest = train_sigmas[0]
        sigma_last = smallest if self.final_sigmas_type == "sigma_min" else 0.0
        return SigmaSchedule(
            # int64 in diffusers: fractional (exponential / beta) timesteps truncated.
            timesteps=f32(np.asarray(timesteps).astype(np.int64)),
            sigmas=f32(np.concatenate([sigmas, [sigma_last]])),
            init_noise_sigma=f32(1.0),
        )

    # ---------------------------------------------------------------------------------------------
    # Traced: the step

    def init_state(self, sample):
        """model_outputs: the last solver_order x0 predictions, oldest first, float32 [order, *shape];
        last_sample: the previous step's (corrected) input sample, which the corrector restarts from;
        last_order: the order the previous step's predictor used; lower_order_nums: steps taken, capped at
        solver_order (0: this loop has taken no step, so there is nothing to correct)."""
        return {
            "model_outputs": jnp.zeros((self.solver_order, *sample.shape), jnp.float32),
            "last_sample": jnp.zeros(sample.shape, jnp.float32),
            "last_order": jnp.ones((), jnp.int32),
            "lower_order_nums": jnp.zeros((), jnp.int32),
        }

    def step(self, schedule: SigmaSchedule, state, model_output, sample, i, key=None, *, noise=None):
        """One UniC correction of `sample` (when due) and one UniP update from sigmas[i] to sigmas[i + 1];
        returns (prev_sample in sample's dtype, state). i may be traced; so may the schedule's length."""
        num_steps = schedule_length(schedule)
        sigmas = jnp.asarray(schedule.sigmas)
        i = jnp.asarray(i, jnp.int32)
        x = sample.astype(jnp.float32)
        x0 = self._convert_model_output(sigmas[i], model_output, x)

        history = state["model_outputs"]
        lower_order_nums = state["lower_order_nums"]
        use_corrector = (i > 0) & (lower_order_nums > 0)
        for disabled in self.disable_corrector:
            use_corrector &= i - 1 != disabled
        correctors = [
            lambda k=k: self._corrector(k, sigmas, i, history, state["last_sample"], x0)
            for k in range(1, self.solver_order + 1)
        ]
        x = jax.lax.cond(
            use_corrector,
            lambda: jax.lax.switch(state["last_order"] - 1, correctors),
            lambda: x,
        )

        history = jnp.concatenate([history[1:], x0[None]])
        order = self.solver_order
        if self.lower_order_final:
            order = jnp.minimum(order, jnp.asarray(num_steps, jnp.int32) - i)
        order = jnp.maximum(jnp.minimum(order, lower_order_nums + 1), 1)
        predictors = [
            lambda k=k: self._predictor(k, sigmas, i, history, x) for k in range(1, self.solver_order + 1)
        ]
        prev_sample = jax.lax.switch(order - 1, predictors)
        state = {
            "model_outputs": history,
            "last_sample": x,
            "last_order": order.astype(jnp.int32),
            "lower_order_nums": jnp.minimum(lower_order_nums + 1, self.solver_order),
        }
        return prev_sample.astype(sample.dtype), state

    def _convert_model_output(self, sigma, model_output, x):
        """diffusers' convert_model_output, float32: x0 from the model output at sigma (predict_x0,
        thresholded where the config says), or the noise it implies (predict_x0=False)."""
        if self.use_flow_sigmas:
            # x0 = x - sigma * v (see the module docstring for bf16).
            x0 = x - (sigma.astype(model_output.dtype) * model_output).astype(jnp.float32)
        elif self.predict_x0:
            x0 = vp_data_prediction(self.prediction_type, sigma, model_output.astype(jnp.float32), x)
        else:
            model_output = model_output.astype(jnp.float32)
            alpha_t, sigma_t = vp_alpha_sigma(sigma)
            if self.prediction_type == "epsilon":
                return model_output
            if self.prediction_type == "sample":
                return (x - alpha_t * model_output) / sigma_t
            return alpha_t * model_output + sigma_t * x
        if self.thresholding:
            x0 = threshold_sample(x0, self.dynamic_thresholding_ratio, self.sample_max_value)
        return x0

    def _lambda(self, sigmas, idx):
        """(alpha_t, sigma_t, lambda) at sigmas[idx]. idx is clamped at 0: the branches that would read below
        it are traced but never taken."""
        sigma = sigmas[jnp.maximum(idx, 0)]
        alpha, sigma = (1 - sigma, sigma) if self.use_flow_sigmas else vp_alpha_sigma(sigma)
        return alpha, sigma, jnp.log(alpha) - jnp.log(sigma)

    def _phi(self, h, order: int):
        """diffusers' shared coefficients: hh = -h (predict_x0; h for noise predictions), h_phi_1 = e^hh - 1,
        B(h), and the b vector."""
        hh = -h if self.predict_x0 else h
        h_phi_1 = jnp.expm1(hh)
        h_phi_k = h_phi_1 / hh - 1
        factorial_i = 1
        b_h = hh if self.solver_type == "bh1" else jnp.expm1(hh)
        b = []
        for i in range(1, order + 1):
            b.append(h_phi_k * factorial_i / b_h)
            factorial_i *= i + 1
            h_phi_k = h_phi_k / hh - 1 / factorial_i
        return h_phi_1, b_h, jnp.stack(b)

    def _predictor(self, order: int, sigmas, i, history, x):
        """multistep_uni_p_bh_update: from sigmas[i] (sample x, x0 history ending at this step's) to
        sigmas[i + 1] with `order` predictions."""
        alpha_t, sigma_t, lambda_t = self._lambda(sigmas, i + 1)
        alpha_s0, sigma_s0, lambda_s0 = self._lambda(sigmas, i)
        h = lambda_t - lambda_s0
        m0 = history[-1]
        rks, d1s = [], []
        for k in range(1, order):
            rk = (self._lambda(sigmas, i - k)[2] - lambda_s0) / h
            rks.append(rk)
            d1s.append((history[-(k + 1)] - m0) / rk)
        h_phi_1, b_h, b = self._phi(h, order)
        x_scale, scale = self._scales(alpha_t, sigma_t, alpha_s0, sigma_s0)
        x_t = x_scale * x - (scale * h_phi_1) * m0
        if order == 1:
            return x_t
        if order == 2:
            rhos_p = jnp.full((1,), 0.5, jnp.float32)
        else:
            rhos_p = jnp.linalg.solve(_powers(rks)[:-1, :-1], b[:-1])
        pred_res = sum(rhos_p[k] * d1s[k] for k in range(order - 1))
        return x_t - (scale * b_h) * pred_res

    def _corrector(self, order: int, sigmas, i, history, last_sample, x0):
        """multistep_uni_c_bh_update: the previous step (sigmas[i - 1] -> sigmas[i], from last_sample) redone
        with this step's x0 as one more point; history is the x0 history before this step's is appended."""
        alpha_t, sigma_t, lambda_t = self._lambda(sigmas, i)
        alpha_s0, sigma_s0, lambda_s0 = self._lambda(sigmas, i - 1)
        h = lambda_t - lambda_s0
        m0 = history[-1]
        rks, d1s = [], []
        for k in range(1, order):
            rk = (self._lambda(sigmas, i - (k + 1))[2] - lambda_s0) / h
            rks.append(rk)
            d1s.append((history[-(k + 1)] - m0) / rk)
        h_phi_1, b_h, b = self._phi(h, order)
        if order == 1:
            rhos_c = jnp.full((1,), 0.5, jnp.float32)
        else:
            rhos_c = jnp.linalg.solve(_powers(rks), b)
        x_scale, scale = self._scales(alpha_t, sigma_t, alpha_s0, sigma_s0)
        x_t = x_scale * last_sample - (scale * h_phi_1) * m0
        corr_res = sum(rhos_c[k] * d1s[k] for k in range(order - 1))
        return x_t - (scale * b_h) * (corr_res + rhos_c[-1] * (x0 - m0))

    def _scales(self, alpha_t, sigma_t, alpha_s0, sigma_s0):
        """(the sample's factor, the predictions' scale) of an update from s0 to t: sigma_t / sigma_s0 and
        alpha_t over x0 predictions, alpha_t / alpha_s0 and sigma_t over noise predictions."""
        if self.predict_x0:
            return sigma_t / sigma_s0, alpha_t
        return alpha_t / alpha_s0, sigma_t


def _powers(rks):
    """diffusers' R: row p holds rks ** p, rks = [r_1, ..., r_{k-1}, 1]."""
    r = jnp.stack([*rks, jnp.ones((), jnp.float32)])
    return jnp.stack([r**p for p in range(r.shape[0])])
